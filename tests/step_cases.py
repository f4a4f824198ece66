"""Shared code of the CPU and GPU tests of a training step: an in-process tiny MPO step and the device-rule audit.

Not a test module itself. `tiny_step(device)` sets up what train.main sets up for one rank (tiny config, tiny-omni
policy and reference, megatron DDP + Adam, the sample's first step packed into microbatches on `device`);
`DeviceAudit` is a TorchFunctionMode that records every breach of train.py's device rule while a step runs.
tests/test_train.py runs both on the CPU, tests/test_gpu.py on CUDA.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
TINY_TOML = ROOT / "configs" / "tiny.toml"

# The modules whose code runs inside a step on the step's device (the CPU-only patches are not on a GPU path).
PROJECT_FILES = frozenset(str(ROOT / f) for f in ("train.py", "mpo_loss.py", "pack.py", "backend/shared_prompt.py",
                                                  "omni_model.py", "backend/mamba_torch.py", "checkpoint.py"))
# ... and, for host reads (`DeviceAudit.reads`), also the modules the forward calls into
READ_FILES = PROJECT_FILES | frozenset(str(ROOT / f) for f in ("backend/local_spec.py", "backend/mamba_triton.py",
                                                                 "monitor.py"))
_TORCH_DIR = os.path.dirname(torch.__file__)
FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                       torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint})
MOVES = {torch.Tensor.cpu: "Tensor.cpu", torch.Tensor.cuda: "Tensor.cuda", torch.Tensor.numpy: "Tensor.numpy"}
# Calls that read a tensor's values (or a size that depends on them) on the host: on a GPU each waits for the device.
T = torch.Tensor
READS = frozenset({T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu, torch.nonzero,
                   T.nonzero, torch.unique, T.unique, torch.bincount, T.bincount, torch.masked_select,
                   T.masked_select, torch.equal, T.equal})
# Factories that copy host data to their device: torch's blocking copy waits for the device (pack.to_device does not)
COPIES = frozenset({torch.tensor, torch.as_tensor})


def _same(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _device_arg(args, kwargs):
    """The target device of a Tensor.to call, or None (a dtype-only or tensor-like conversion)."""
    for v in (kwargs.get("device"), *args[1:]):
        if isinstance(v, (torch.device, str)) and not isinstance(v, torch.dtype):
            try:
                return torch.device(v)
            except RuntimeError:
                continue
        if isinstance(v, int) and not isinstance(v, bool):
            return torch.device("cuda", v)
    return None


class DeviceAudit(TorchFunctionMode):
    """Records breaches of train.py's device rule by the project's code while active.

    For every torch call whose nearest non-torch caller is a project file (`PROJECT_FILES`, plus `extra_files`) it
    records (file:line function: what) when the call
      - moves a tensor explicitly off the device (Tensor.cpu / .cuda / .numpy, or Tensor.to another device),
      - creates a tensor with a factory (torch.tensor, zeros, arange, ...) without `device=` (the default device),
      - gets a tensor argument, or returns a tensor, on another device than `device`.
    On the CPU the third check cannot fire (everything is on the CPU), the first two can: they are what would put a
    tensor on the wrong device on a GPU (a `.cpu()` in the pair count broke the first GPU run).
    `violations` is the list of records; `calls` counts the audited calls (a check that saw nothing is no check).

    Host numbers: the CPU copies of the step's batches (`host`: their PackedBatch.host, pack.host_view), tensors made
    with device="cpu" (the string, as host code writes it; the step's device is a torch.device), and whatever is
    computed from those (and from factory results, e.g. an arange on a host tensor's device) are host tensors: they
    may be on the CPU and be read; `pack.to_device` moves what the device needs. `reads` records (file:line
    function: what) every read of a tensor that is not a host tensor (READS, a boolean-mask index, a
    repeat_interleave sized by its data) and every COPIES call onto the step's device by the project's code: on a
    GPU each is a host synchronisation; so is a blocking `Tensor.to` of a CPU tensor onto the step's device (on the
    CPU that is no copy: it shows on a GPU, and on the meta device in the tests; the project moves host data with
    pack.to_device).
    """

    def __init__(self, device, extra_files=(), host=()):
        super().__init__()
        self.device = torch.device(device)
        self.files = PROJECT_FILES | {str(Path(f).resolve()) for f in extra_files}
        self.violations: list[str] = []
        self.reads: list[str] = []
        self.calls = 0
        self._host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive, so an id is never reused)
        self._made: dict[int, torch.Tensor] = {}  # factory results: host or device by what they meet
        for b in host:
            self._mark(vars(b.host).values() if getattr(b, "host", None) is not None else ())

    def _mark(self, values) -> None:
        for t in values:
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = t

    def _is_read(self, func, args, kwargs, tensors) -> bool:
        if func in READS:
            return True
        if func is torch.Tensor.__getitem__:  # a boolean mask: the result's size is the mask's count
            return any(t.dtype == torch.bool for t in tensors[1:])
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            return len(tensors) > 1 and kwargs.get("output_size") is None
        return False

    def _caller(self, files=None) -> str | None:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name in (files or self.files):
                return f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}"
            if not (name.startswith(_TORCH_DIR) or name == __file__):
                return None
            f = f.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        explicit_cpu = func in FACTORIES and kwargs.get("device") == "cpu"  # the string: host code, not ctx.device
        host = explicit_cpu or (any(id(t) in self._host for t in tensors)
                                and all(id(t) in self._host or id(t) in self._made for t in tensors))
        if not host and (func in FACTORIES or (tensors and all(id(t) in self._made for t in tensors))):
            self._made.update((id(t), t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        moved = func is torch.Tensor.to and _device_arg(args, kwargs) not in (None, torch.device("cpu"))
        if host and not moved:
            self._mark(tree_flatten(out)[0])
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        target = kwargs.get("device")
        copy = (func in COPIES and target not in (None, "cpu") and _same(torch.device(target), self.device)
                and not isinstance(args[0] if args else None, torch.Tensor))
        if func is torch.Tensor.to and args[0].device.type == "cpu" and not kwargs.get("non_blocking"):
            to = _device_arg(args, kwargs)  # a CPU tensor onto the step's device, waiting for it
            copy = to is not None and _same(to, self.device) and to.type != "cpu"
        if copy or (not host and self._is_read(func, args, kwargs, tensors)):
            reader = self._caller(READ_FILES | self.files)
            if reader is not None:
                self.reads.append(f"{reader}: {name}")
        where = self._caller()
        if where is None or host:
            return out
        self.calls += 1
        if func in MOVES:
            self.violations.append(f"{where}: {MOVES[func]} moves a tensor off {self.device}")
        elif func is torch.Tensor.to:
            target = _device_arg(args, kwargs)
            if target is not None and not _same(target, self.device):
                self.violations.append(f"{where}: Tensor.to({target}) moves a tensor off {self.device}")
        elif func in FACTORIES and "device" not in kwargs:
            self.violations.append(f"{where}: {name} without device= (lands on the default device)")
        for kind, tree in (("argument", (args, kwargs)), ("result", out)):
            leaves, _ = tree_flatten(tree)
            bad = {str(t.device) for t in leaves if isinstance(t, torch.Tensor) and not _same(t.device, self.device)}
            if bad:
                self.violations.append(f"{where}: {name} has a tensor {kind} on {sorted(bad)}, not {self.device}")
        return out


def tiny_config(*overrides: str):
    """configs/tiny.toml with `overrides`, `packing.shared_prompt` resolved as train.main does ("auto" included)."""
    import config as config_mod
    from backend import kernel_selection, shared_prompt

    cfg = config_mod.load_config(str(TINY_TOML), list(overrides))
    cfg.packing.shared_prompt = shared_prompt.resolve(cfg, kernel_selection.select_kernels())[0]
    return cfg


def tiny_step(device, *overrides: str) -> dict:
    """What train.main sets up for one rank with configs/tiny.toml (+ overrides), on `device`, and the first step's
    packed microbatches (this DP rank's). Returns a dict: cfg, ctx, policy, reference, ddp, optimizer, scheduler, plan,
    batches, run(batches, reward_shift) -> (metrics, new shift) (train.train_step with these objects)."""
    import distributed
    import hf_weights
    import omni_model as om
    import pack
    import train

    old = os.getcwd()
    os.chdir(ROOT)  # the config's relative paths
    try:
        device = torch.device(device)
        cfg = tiny_config(*overrides)
        distributed.init_distributed(device=device)
        distributed.seed_everything(cfg.mpo.seed)
        policy = om.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
        hf_weights.load_hf_weights(policy, cfg.model.hf_path)
        if cfg.lora.rank:  # train.main's LoRA: adapters on the policy, the reference is the policy with them off
            import lora
            import reference_logprobs

            lora.apply_lora(policy, cfg.lora, seed=cfg.mpo.seed)
            reference = reference_logprobs.build_reference(cfg, None, None, policy)
        else:
            reference = om.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
            hf_weights.load_hf_weights(reference, cfg.model.hf_path)
            reference.eval().requires_grad_(False)
        ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)
        ctx = distributed.Ctx.current(cfg, device)
        ddp.train()
        from transformers import AutoProcessor

        import mmpr_data
        import mmpr_index

        processor = AutoProcessor.from_pretrained(cfg.model.hf_path)
        train_split, _ = mmpr_index.load_splits(processor, cfg.data)
        dataset = mmpr_data.PairDataset(train_split.index, processor)
        ids = train_split.pair_ids[: cfg.policy.train_global_batch_size]
        lengths, shared = train_split.index.lengths(ids), train_split.index.shared_lengths(ids)
        plan = pack.plan_step(lengths, cfg.packing, ctx.dp, shared)  # this rank's bins: plan.ranks[ctx.dp_rank]
        pairs = {p: dataset[p] for b in plan.ranks[ctx.dp_rank] for p in b.pair_ids}
        hf = om.read_hf_config(cfg.model.hf_path)
        batches = pack.load_bins(plan, pairs, ctx, hf.image_token_id, processor.tokenizer.pad_token_id or 0)
    finally:
        os.chdir(old)

    def run(batches, reward_shift: float):
        return train.train_step(ddp, reference, optimizer, scheduler, batches, ctx, reward_shift)

    return dict(cfg=cfg, ctx=ctx, policy=policy, reference=reference, ddp=ddp, optimizer=optimizer,
                scheduler=scheduler, batches=batches, run=run, plan=plan)
