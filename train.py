"""MPO training of Nemotron-3-Nano-Omni with torchrun: the whole job, read top to bottom.

    torchrun --nproc-per-node 2 train.py configs/tiny.toml                                  # CPU (gloo), ~1 min
    torchrun --nproc-per-node 8 train.py configs/nano.toml data.train.data_path=/abs/meta.json   # one 8-GPU node

Offline preference training: for every packed microbatch the frozen reference model and the policy score the same
chosen/rejected rows (two forward passes, no generation); mpo_loss.py turns the per-sequence log-ratios into the MPO
loss (w_p·DPO + w_q·BCO + w_g·SFT). What one optimizer step does, in order (`train_step` below):

    1. take `policy.train_global_batch_size` pairs (mmpr_data sampler, the same on every rank)
    2. plan bins (pack.plan_step; a pair is never split) and load this data-parallel rank's bins
    3. count the step's valid pairs over all ranks: the denominator of every loss term
    4. reference forward of every microbatch (no grad; with `reference.offload` the reference visits the GPU once)
    5. per microbatch: policy forward -> fused MPO loss -> backward (gradients accumulate)
    6. gradient reduction over DP (a sum: each loss is already divided by the global pair count), optimizer step,
       LR-scheduler step, then the BCO reward shift δ from the step's global statistics (used from the next step on)

Device rule: every tensor a step touches lives on the step's device (`Ctx.device`: cuda:LOCAL_RANK, or the CPU).
`load_bins` builds each packed microbatch on the CPU (pack.pack, in the data loader's processes) and moves the whole
`PackedBatch` once (`PackedBatch.to`); from there on every tensor is made on the device of the tensor it derives from or
with `device=ctx.device`, and only Python numbers leave the device (`.item()`, `.tolist()`, for logging and δ). The
exceptions are by design and off the step's path: the offloaded reference's weights (`reference.offload`: CPU between
its passes), checkpoint files and the HF export (written from CPU copies), RNG states (CPU byte tensors).
tests/test_train.py::test_train_step_keeps_one_device checks it with a recording TorchFunctionMode.

Validation runs every `mpo.val_period` steps and at the end (same losses, no gradient, δ untouched). The job stops at
`mpo.max_num_steps`, at `mpo.stop_after_step` (a segment of a chained run) or on SIGTERM / SIGUSR1 (Slurm's
pre-timeout signal) / SIGINT (Ctrl-C): it finishes the current step, saves a checkpoint and exits 0. A run directory
with a complete checkpoint resumes automatically (checkpoint.py). Metrics: one line per step on rank 0,
`<checkpoint.dir>/metrics.jsonl` and Weights & Biases (`logging.wandb`); the resolved config goes to
`<checkpoint.dir>/config.json`.

Tests: `pytest tests/test_train.py`.
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import config as config_mod

config_mod.quiet_known_warnings()  # before megatron-core is imported (mpo_loss); OMNI_MPO_SHOW_WARNINGS=1 shows all
import hf_weights  # noqa: E402
import mmpr_data  # noqa: E402
import mpo_loss  # noqa: E402
import omni_model  # noqa: E402
import pack  # noqa: E402

# ======================================================================================================================
# Small helpers (each tested on its own)


def build_scheduler(optimizer, cfg):
    """megatron-core's OptimizerParamScheduler for `cfg`: linear warmup from scheduler.lr_warmup_init to optimizer.lr
    over scheduler.lr_warmup_steps, then `lr_decay_style` to optimizer.min_lr at mpo.max_num_steps.

    The horizon is always mpo.max_num_steps, never mpo.stop_after_step, so the segments of a chained run follow one
    schedule. Megatron's convention: the lr of schedule step n (n = 0, 1, ...) is used by optimizer step n + 1.

    Raises:
        config.ConfigError: lr_warmup_steps >= max_num_steps (megatron needs a decay phase).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, o, horizon = cfg.scheduler, cfg.optimizer, cfg.mpo.max_num_steps
    if s.lr_warmup_steps >= horizon:
        raise config_mod.ConfigError(
            f"scheduler.lr_warmup_steps = {s.lr_warmup_steps} must be < mpo.max_num_steps = {horizon}"
        )
    if s.lr_warmup_init > o.lr:
        raise config_mod.ConfigError(f"scheduler.lr_warmup_init = {s.lr_warmup_init} must be <= optimizer.lr = {o.lr}")
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.lr_warmup_steps,
        lr_decay_steps=horizon,
        lr_decay_style=s.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=horizon,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,  # a schedule change between segments is an error (checkpoint.load)
    )


def build_optimizer(policy, cfg):
    """megatron-core DDP around the policy, its Adam (distributed optimizer by default; bf16 params keep fp32 master
    weights) and the LR scheduler. Returns (ddp, optimizer, scheduler).

    The DDP sums gradients over data (and context) parallel ranks instead of averaging them: every microbatch loss
    is already divided by the step's global pair count (mpo_loss's contract), megatron's `calculate_per_token_loss`
    regime. Gradient buffers are fp32.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    ddp_model_cfg = copy.copy(policy.lm_config)
    ddp_model_cfg.calculate_per_token_loss = True  # DDP: gradient scaling 1 and a SUM reduction
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=o.use_distributed_optimizer
    )
    ddp = DistributedDataParallel(ddp_model_cfg, ddp_cfg, policy)
    bf16 = cfg.model.params_dtype == "bfloat16"
    optim_cfg = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=o.use_distributed_optimizer,
    )  # fmt: skip
    with cuda_to_cpu():
        optimizer = get_megatron_optimizer(optim_cfg, [ddp])
    return ddp, optimizer, build_scheduler(optimizer, cfg)


class StopSignal:
    """Remembers SIGTERM / SIGUSR1 (Slurm sends USR1 before the time limit) / SIGINT (Ctrl-C); the loop finishes the
    step, saves, exits 0. Under torchrun a Ctrl-C reaches every rank twice (the terminal's and torchrun's forward);
    repeats are ignored, so a second Ctrl-C does not abort the save (Ctrl-\\, SIGQUIT, still kills at once).

    `should_stop()` is collective: the flag is all-reduced (MAX) so that every rank stops after the same step even
    when the signal reaches the ranks at different times.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum
        # Ignore repeats at the OS level: under Slurm a rank can get USR1 twice (step-wide delivery and the launcher's
        # forward), and a repeat arriving while the interpreter shuts down would take the default action and kill the
        # rank (exit -10), failing a job that had already saved.
        signal.signal(signum, signal.SIG_IGN)

    def should_stop(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


RESOLVED_CONFIG_FILE = "config.json"


def write_resolved_config(cfg) -> Path:
    """Write the resolved config (defaults + TOML + overrides, as config.to_dict) to `<checkpoint.dir>/config.json`
    (rank 0; replaced by every segment of a chained run, whose checkpoints keep their own copy in run_state.json);
    returns its path."""
    path = Path(cfg.checkpoint.dir) / RESOLVED_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_mod.to_dict(cfg), indent=1) + "\n")
    return path


def report_error(e: Exception) -> str:
    """The one-line message of a known bad input (ConfigError / DataError / CheckpointError), printed to stderr by
    global rank 0 only (every rank usually hits the same check). Under torchrun every rank also writes it to its
    TORCHELASTIC_ERROR_FILE, so torchrun's failure report ends with this line ("Root Cause ... traceback : error: ...")
    instead of a pointer to its documentation. Returns the message."""
    msg = f"error: {type(e).__name__}: {e}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's format (torch.distributed.elastic ProcessFailure): message + timestamp
        data = {"message": {"message": msg, "extraInfo": {"timestamp": str(int(time.time()))}}}
        Path(error_file).write_text(json.dumps(data))
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, file=sys.stderr, flush=True)
    return msg


def reduce_metrics(local: dict[str, float], group, device: torch.device) -> dict[str, float]:
    """Combine one rank's summed step metrics (mpo_loss.combine_metrics) over the data-parallel `group`.

    "mean" and "count" metrics (mpo_loss.METRIC_REDUCTION) are summed (each microbatch value is already divided by
    the global pair count), "constant" ones are kept. Keys must be the same on every rank.
    """
    keys = sorted(k for k in local if mpo_loss.METRIC_REDUCTION.get(k, "mean") != "constant")
    vals = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(vals, group=group)
    out = dict(local)
    out.update(zip(keys, vals.tolist(), strict=True))
    return out


def check_inputs(cfg) -> None:
    """The checks that need neither a process group nor a model: the files the config names and the packing layout.

    Run before `init_distributed`, so a typo fails in seconds on every rank with the key named.

    Raises:
        config.ConfigError: model.hf_path has no config.json; data.train.data_path (or data.validation.data_path, when
            set) is not a file; the packing / parallel divisibility rule (pack.validate_packing_config) fails.
    """
    if not (Path(cfg.model.hf_path) / "config.json").is_file():
        raise config_mod.ConfigError(
            f"model.hf_path = {cfg.model.hf_path!r}: no config.json there (a local HF checkpoint directory; relative "
            f"paths are relative to the working directory {os.getcwd()})"
        )
    for key, path in (("data.train.data_path", cfg.data.train.data_path),
                      ("data.validation.data_path", cfg.data.validation.data_path)):  # fmt: skip
        if path and not Path(path).expanduser().is_file():
            raise config_mod.ConfigError(
                f"{key} = {path!r} is not a file (an MMPR meta-recipe JSON; relative paths are relative to the "
                f"working directory {os.getcwd()})"
            )
    try:
        pack.validate_packing_config(cfg)
    except ValueError as e:
        raise config_mod.ConfigError(str(e)) from None


# megatron-core TransformerConfig fields set from this project's keys (the rest come from the checkpoint's config.json)
MCORE_FIELD_KEYS = {
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "expert_tensor_parallel_size": "parallel.expert_tensor_parallel_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "params_dtype": "model.params_dtype",
    "bf16": "model.params_dtype",
    "recompute_granularity": "model.recompute",
    "recompute_method": "model.recompute",
    "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
    "moe_router_load_balancing_type": "model.moe_router_load_balancing_type",
    "moe_aux_loss_coeff": "model.moe_aux_loss_coeff",
    "moe_router_bias_update_rate": "model.moe_router_bias_update_rate",
}


def check_model_config(cfg, hf) -> None:
    """megatron-core's constraints on this model and layout, checked before any process group, data or model work.

    Builds the three megatron-core TransformerConfigs (language model, ViT, projector: their __post_init__ runs
    megatron's own checks) and applies the rules megatron-core enforces only later, at build or at the first training
    forward: MoE with TP > 1 needs sequence parallelism (MoELayer.forward), experts whole on their EP rank (ETP = 1,
    build_model), a vocabulary divisible by TP (the output layer stays vocab-parallel). Nothing to train is an error.

    Raises:
        config.ConfigError: one line naming the project's keys (and their values) behind megatron-core's message.
    """
    m, p = cfg.model, cfg.parallel
    if m.freeze_vision_encoder and m.freeze_vision_projector and m.freeze_language_model:
        raise config_mod.ConfigError(
            "model.freeze_vision_encoder, model.freeze_vision_projector and model.freeze_language_model are all true: "
            "nothing to train; unfreeze at least one"
        )
    use_te = omni_model.have_transformer_engine()
    parts = (("language model", omni_model.language_config), ("vision encoder", omni_model.vision_config),
             ("vision projector", omni_model.projector_config))  # fmt: skip
    for what, build in parts:
        try:
            mcore = build(hf, m, p, use_te)
        except (ValueError, AssertionError, TypeError) as e:
            named = {k: v for k, v in MCORE_FIELD_KEYS.items() if k in str(e)}
            keys = ", ".join(dict.fromkeys(f"{v} = {_dotted(cfg, v)!r}" for v in named.values()))
            raise config_mod.ConfigError(
                f"megatron-core refuses the {what} config: {str(e).strip()} (this run's "
                f"{keys or 'settings'}; the other sizes come from {m.hf_path}/config.json)"
            ) from None
        if what == "language model":
            lm = mcore
    tp = p.tensor_model_parallel_size
    if lm.num_moe_experts and tp > 1 and not p.sequence_parallel:
        raise config_mod.ConfigError(
            f"parallel.tensor_model_parallel_size = {tp} with MoE layers needs parallel.sequence_parallel = true "
            "(megatron-core's MoELayer refuses MoE and tensor parallelism without sequence parallelism in training)"
        )
    if lm.num_moe_experts and p.expert_tensor_parallel_size != 1:
        raise config_mod.ConfigError(
            f"parallel.expert_tensor_parallel_size = {p.expert_tensor_parallel_size}: only 1 (experts whole on their "
            "EP rank) is supported"
        )
    if hf.text.vocab_size % tp:
        raise config_mod.ConfigError(
            f"parallel.tensor_model_parallel_size = {tp} must divide the vocabulary size {hf.text.vocab_size} "
            f"({m.hf_path}/config.json): the output layer stays vocab-parallel"
        )


def _dotted(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_splits(train_split, val_split, cfg):
    """Check the loaded splits against the batch and bin sizes before the models are built; returns the validation
    split to use (None when it has no pair) and a list of notes for the console.

    Raises:
        config.ConfigError: fewer training pairs than policy.train_global_batch_size (every step would repeat pairs);
            a training or validation pair larger than packing.max_tokens_per_bin without packing.drop_oversized_pairs
            (found here, at start, instead of at the step that samples it).
    """
    notes = []
    gbs, n_train = cfg.policy.train_global_batch_size, len(train_split.pair_ids)
    if n_train < gbs:
        raise config_mod.ConfigError(
            f"policy.train_global_batch_size = {gbs} pairs per step but only {n_train} training pairs (after "
            f"data.train.max_samples = {cfg.data.train.max_samples}, data.train.split_validation_size = "
            f"{cfg.data.train.split_validation_size} and dropped rows): a step would repeat pairs; lower the batch or "
            "use more data"
        )
    if val_split is not None and not val_split.pair_ids:
        notes.append(f"validation: data.train.split_validation_size = {cfg.data.train.split_validation_size} of "
                     f"{len(train_split.index)} pairs is 0 pairs: no validation")  # fmt: skip
        val_split = None
    pk = cfg.packing
    d = pk.make_sequence_length_divisible_by
    for name, split in (("training", train_split), ("validation", val_split)):
        if split is None:
            continue
        lengths = split.index.lengths(split.pair_ids)
        sizes = {p: pack.padded_length(c, d) + pack.padded_length(r, d) for p, (c, r) in lengths.items()}
        big = sorted((p for p, n in sizes.items() if n > pk.max_tokens_per_bin), key=lambda p: -sizes[p])
        if not big:
            continue
        if not pk.drop_oversized_pairs:
            raise config_mod.ConfigError(
                f"{len(big)} of {len(sizes)} {name} pairs need more than packing.max_tokens_per_bin = "
                f"{pk.max_tokens_per_bin} tokens (largest: {split.index.source(big[0])}, {sizes[big[0]]} tokens after "
                f"padding to a multiple of {d}); raise the limit, lower data.max_seq_length, or set "
                "packing.drop_oversized_pairs = true"
            )
        if len(big) == len(sizes):
            raise config_mod.ConfigError(
                f"every {name} pair needs more than packing.max_tokens_per_bin = {pk.max_tokens_per_bin} tokens"
            )
        notes.append(f"{name}: {len(big)} of {len(sizes)} pairs exceed packing.max_tokens_per_bin = "
                     f"{pk.max_tokens_per_bin} and are dropped from the steps that hold them "
                     "(metrics: dropped_oversized)")  # fmt: skip
    return val_split, notes


def active_params(model, hf) -> int:
    """Parameters used per token (global over TP/EP): dense parameters plus top-k of the routed experts' share.

    Counts this rank's parameters, scales tensor-parallel ones by TP and expert ones by EP (megatron marks expert
    parameters with `allreduce = False`), then keeps `num_experts_per_tok / n_routed_experts` of the expert part.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    dense = expert = 0
    for p in model.parameters():
        n = p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        if getattr(p, "allreduce", True):
            dense += n
        else:
            expert += n * ep
    n_exp = getattr(hf.text, "n_routed_experts", 0) or 0
    top_k = getattr(hf.text, "num_experts_per_tok", 0) or 0
    return int(dense + (expert * top_k / n_exp if n_exp else expert))


PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12}  # dense, per GPU


def mfu(tokens: int, seconds: float, n_active: int, world: int) -> float | None:
    """Model FLOPs utilisation: (6·N·tokens for the policy fwd+bwd + 2·N·tokens for the reference fwd) /
    (seconds · world · peak bf16 FLOPs of the GPU). None on CPU or an unknown GPU. Ignores attention's quadratic term
    and the vision tower (the hybrid LM is mostly linear in tokens; shared/research/nemotron_omni_arch.md)."""
    if not torch.cuda.is_available() or seconds <= 0:
        return None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return None if peak is None else 8.0 * n_active * tokens / (seconds * world * peak)


class MetricsLog:
    """`<checkpoint.dir>/metrics.jsonl` (one object per step, "step" first) and Weights & Biases, on global rank 0.

    An existing metrics.jsonl is never restarted silently: a fresh start (resumed_step 0) moves it to
    `metrics.<n>.jsonl` (the first free n), a resume drops its rows after `resumed_step` (a segment that stopped
    before saving); both print a `metrics:` line.

    W&B: mode `logging.wandb` (online / offline / disabled), project WANDB_PROJECT else `logging.wandb_project`,
    WANDB_ENTITY and WANDB_NAME honoured; the run id is kept in the checkpoint and reused with resume="allow" so the
    segments of a chained run continue one curve. WANDB_API_KEY is read by wandb itself, never printed or written.
    """

    def __init__(self, cfg, run_id: str | None, resumed_step: int, rank: int) -> None:
        self.rank, self.run, self.run_id = rank, None, run_id
        self.path = Path(cfg.checkpoint.dir) / "metrics.jsonl"
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = [r for r in self.path.read_text().splitlines() if r.strip()] if self.path.exists() else []
        if rows and resumed_step == 0:  # a run that saved no checkpoint here: keep its rows in a file of their own
            n = 1
            while (old := self.path.with_name(f"metrics.{n}.jsonl")).exists():
                n += 1
            self.path.rename(old)
            print(f"metrics: {self.path} held {len(rows)} rows of an earlier run without a checkpoint; moved to "
                  f"{old.name}, this run starts a new {self.path.name}")  # fmt: skip
        elif rows:  # rows after the resumed step belong to a segment that died before saving
            keep = [r for r in rows if json.loads(r)["step"] <= resumed_step]
            if len(keep) < len(rows):
                self.path.write_text("".join(r + "\n" for r in keep))
                print(f"metrics: dropped {len(rows) - len(keep)} rows after step {resumed_step} from {self.path} "
                      "(logged by a segment that stopped before saving)")  # fmt: skip
        if cfg.logging.wandb != "disabled":
            import wandb

            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or cfg.logging.wandb_project,
                entity=os.environ.get("WANDB_ENTITY") or None,
                name=os.environ.get("WANDB_NAME") or None,
                id=run_id or os.environ.get("WANDB_RUN_ID") or None,
                resume="allow",
                mode=cfg.logging.wandb,
                dir=str(self.path.parent),
                config=config_mod.to_dict(cfg),
            )
            self.run_id = self.run.id

    def log(self, step: int, metrics: dict, split: str = "train") -> None:
        if self.rank != 0:
            return
        row = {"step": step, "split": split, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            self.run.log({f"{split}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


# ======================================================================================================================
# Distributed setup


def init_distributed(cfg, num_experts: int | None):
    """torch.distributed (nccl on GPU, gloo on CPU) and megatron-core parallel state; returns (device, dp size).

    World size = TP·CP·DP and EP | experts are checked (config.validate_parallel) before any process group exists.
    Without torchrun (plain `python train.py`) it runs as a world of one.
    """
    from megatron.core import parallel_state

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(omni_model.free_port()))
    dp = config_mod.validate_parallel(cfg, int(os.environ["WORLD_SIZE"]), num_experts)
    import cpu_compat

    cpu_compat.apply()  # the stand-ins for what this process lacks: TE, mamba-ssm, CUDA (cpu_compat.shims_for)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )
    return device, dp


def seed_everything(seed: int) -> None:
    """Python, numpy, torch and megatron-core's model-parallel RNG tracker (dropout is off; kept for any randomness)."""
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def cuda_to_cpu():
    """cpu_compat's catch-all around megatron's optimizer code on CPU; a null context on GPU."""
    import contextlib

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    import cpu_compat

    return cpu_compat.cuda_to_cpu()


# ======================================================================================================================
# One microbatch, one step, one validation


class Ctx:
    """What every step needs: groups, sizes, device, config (built once in main)."""

    def __init__(self, cfg, device, dp: int):
        from megatron.core import parallel_state as ps

        self.cfg, self.device, self.dp = cfg, device, dp
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group()
        self.cp = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()


def sequence_logps(model, batch: pack.PackedBatch, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one packed microbatch: per-sequence response log-prob sums [S] (fp32) and response-token counts [S]."""
    logits = model(batch)  # [T_local, V/TP]: this CP rank's tokens, this TP rank's vocabulary shard
    T, S = batch.input_ids.shape[1], batch.num_sequences
    labels, loss_mask = batch.labels[0], batch.loss_mask[0]
    seq_ids = pack.token_sequence_ids(batch.cu_seqlens_padded, T)
    if ctx.cp > 1:
        index = pack.cp_partition_index(batch.cu_seqlens_padded, ctx.cp, ctx.cp_rank).to(labels.device)
        labels, loss_mask, seq_ids = labels[index], loss_mask[index], seq_ids[index]
    return mpo_loss.packed_sequence_logps(
        logits, labels, loss_mask, seq_ids, S, ctx.tp_group, ctx.cp_group if ctx.cp > 1 else None,
        ctx.cfg.policy.logprob_chunk_size, inplace_backward=True,  # the logits are read by nothing else
    )  # fmt: skip


def count_global_pairs(batches: list[pack.PackedBatch], ctx: Ctx) -> int:
    """Valid pairs of the step over all microbatches and DP ranks (the loss denominator), before any forward.
    Computed on the batches' device (the device rule of the module docstring)."""
    local = 0
    for b in batches:
        seq_ids = pack.token_sequence_ids(b.cu_seqlens_padded, b.input_ids.shape[1])
        num_tokens = mpo_loss.sequence_sums(b.loss_mask[0].long(), seq_ids, b.num_sequences)
        local += mpo_loss.count_valid_pairs(num_tokens, b.pair_index, b.is_chosen, b.sample_mask)
    n = torch.tensor([local], dtype=torch.long, device=ctx.device)
    dist.all_reduce(n, group=ctx.dp_group)
    return int(n.item())


def reference_logps(reference, batches: list[pack.PackedBatch], ctx: Ctx) -> list[torch.Tensor]:
    """Reference log-prob sums [S] of every microbatch (no grad). With `reference.offload` (GPU) the frozen reference
    lives on the CPU and visits the GPU once per step, for these passes only."""
    offload = ctx.cfg.reference.offload and ctx.device.type == "cuda"
    if offload:
        reference.to(ctx.device)
    with torch.no_grad():
        out = [sequence_logps(reference, b, ctx)[0] for b in batches]
    if offload:
        reference.to("cpu")
    return out


def mpo_metrics_of(batches, ref_logps, policy, ctx: Ctx, reward_shift: float, num_pairs: int, train: bool):
    """Policy forward + fused MPO loss (+ backward when `train`) over the microbatches; returns this rank's summed
    metrics and δ's statistics (reward_sum, reward_count)."""
    per_mb, r_sum, r_count = [], 0.0, 0.0
    for b, ref in zip(batches, ref_logps, strict=True):
        with torch.set_grad_enabled(train):
            logps, num_tokens = sequence_logps(policy, b, ctx)
            loss, metrics, (s, c) = mpo_loss.mpo_loss(
                logps, ref, num_tokens, b.pair_index, b.is_chosen, b.sample_mask,
                ctx.cfg.mpo, reward_shift, num_pairs,
            )  # fmt: skip
        if train:
            loss.backward()  # megatron DDP accumulates into its main_grad buffers
        per_mb.append(metrics)
        r_sum, r_count = r_sum + float(s), r_count + float(c)
    return mpo_loss.combine_metrics(per_mb), r_sum, r_count


def load_bins(plan: pack.Plan, pairs: dict, ctx: Ctx, image_token_id: int, pad_id: int) -> list[pack.PackedBatch]:
    """This DP rank's packed microbatches of a plan (dummy bins keep every rank at the same count)."""
    return [
        pack.pack([pairs[p] for p in b.pair_ids], ctx.cfg.packing.make_sequence_length_divisible_by, image_token_id,
                  pad_id, dummy=b.dummy).to(ctx.device)
        for b in plan.ranks[ctx.dp_rank]
    ]  # fmt: skip


def train_step(policy, ddp, reference, optimizer, scheduler, batches, ctx: Ctx, reward_shift: float):
    """One optimizer step over this rank's microbatches (steps 3-6 of the module docstring). Returns
    (metrics of the step over all DP ranks, the new reward shift δ)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    num_pairs = count_global_pairs(batches, ctx)
    ref = reference_logps(reference, batches, ctx)
    # MoE auxiliary loss as megatron-core's schedules scale it: a mean over microbatches, DP and CP ranks (our DP
    # reduction sums, so the 1/(DP·CP) of megatron's averaging DDP goes here).
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=ctx.device) / (len(batches) * ctx.dp * ctx.cp))
    local, r_sum, r_count = mpo_metrics_of(batches, ref, ddp, ctx, reward_shift, num_pairs, train=True)
    finalize_model_grads([ddp])  # DP (+CP) gradient sum, sequence-parallel norm grads
    lr = optimizer.param_groups[0]["lr"]  # the lr this update uses
    with cuda_to_cpu():
        _, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    stats = torch.tensor([r_sum, r_count], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(stats, group=ctx.dp_group)
    r_sum, r_count = stats.tolist()
    new_shift = mpo_loss.update_reward_shift(reward_shift, r_sum, r_count, ctx.cfg.mpo.reward_shift_momentum)
    metrics = reduce_metrics(local, ctx.dp_group, ctx.device)
    metrics.update(
        lr=lr,
        grad_norm=float(grad_norm),
        num_global_pairs=num_pairs,
        reward_shift=new_shift,
        reward_shift_used=reward_shift,
        **{"bco/reward_sum": r_sum, "bco/reward_count": r_count},
    )
    return metrics, new_shift


def validate(policy, reference, val: mmpr_data.Split, dataset, ctx: Ctx, reward_shift: float, ids: dict) -> dict:
    """The MPO losses and metrics on (up to mpo.val_batches batches of) the validation split; no gradient, δ fixed.

    Batches of mpo.val_global_batch_size pairs in split order; the metrics are pair-weighted means over batches."""
    cfg = ctx.cfg
    policy.eval()
    n = cfg.mpo.val_global_batch_size
    chunks = [val.pair_ids[i : i + n] for i in range(0, len(val.pair_ids), n)][: cfg.mpo.val_batches]
    total: dict[str, float] = {}
    pairs_seen = 0
    for chunk in chunks:
        plan = pack.plan_step(val.index.lengths(chunk), cfg, ctx.dp)
        pairs = {p: dataset[p] for b in plan.ranks[ctx.dp_rank] for p in b.pair_ids}
        batches = load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
        num_pairs = count_global_pairs(batches, ctx)
        ref = reference_logps(reference, batches, ctx)
        local, _, _ = mpo_metrics_of(batches, ref, policy, ctx, reward_shift, num_pairs, train=False)
        m = reduce_metrics(local, ctx.dp_group, ctx.device)
        for k, v in m.items():
            if mpo_loss.METRIC_REDUCTION.get(k, "mean") == "mean":
                total[k] = total.get(k, 0.0) + v * num_pairs
            elif mpo_loss.METRIC_REDUCTION.get(k) == "count":
                total[k] = total.get(k, 0.0) + v
        pairs_seen += num_pairs
    policy.train()
    out = {k: (v / max(pairs_seen, 1) if mpo_loss.METRIC_REDUCTION.get(k, "mean") == "mean" else v)
           for k, v in total.items()}  # fmt: skip
    out["val_batches"] = len(chunks)
    return out


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_line(step: int, cfg, m: dict) -> str:
    """The per-step console line (rank 0)."""
    mx = cfg.mpo.max_num_steps
    speed = f"{m['pairs_per_s']:.2f} pairs/s {m['tokens_per_s']:.0f} tok/s"
    if m.get("mfu") is not None:
        speed += f" mfu {100 * m['mfu']:.1f}%"
    return (
        f"step {step}/{mx} | loss {m['loss']:.4f} (pref {m['preference_loss']:.4f} bco {m['bco_loss']:.4f} "
        f"sft {m['sft_loss']:.4f}) | acc {m['accuracy']:.3f} margin {m['rewards/margin']:.4f} | "
        f"δ {m['reward_shift']:.3e} | lr {m['lr']:.3e} | gnorm {m['grad_norm']:.3f} | {speed} | "
        f"{m['step_time']:.2f} s/step | eta {_duration(m['eta_s'])}"
    )


# ======================================================================================================================
# The job


def main(cfg) -> int:
    """Run (or resume) the training job described by `cfg`; returns the exit code (0 also for a segment stop)."""
    from transformers import AutoProcessor

    # -- config, distributed, seeds --------------------------------------------------------------------------------
    check_inputs(cfg)
    hf = omni_model.read_hf_config(cfg.model.hf_path)
    check_model_config(cfg, hf)  # megatron-core's constraints, before any process group, data or model
    device, dp = init_distributed(cfg, getattr(hf.text, "n_routed_experts", None))
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.mpo.seed)
    if rank == 0:
        import cpu_compat

        print(cpu_compat.select_kernels().line())
        print(f"world {world}: TP {cfg.parallel.tensor_model_parallel_size} CP {cfg.parallel.context_parallel_size} "
              f"DP {dp} EP {cfg.parallel.expert_model_parallel_size} on {device.type}")  # fmt: skip
    resume_from = checkpoint.resume_path(cfg.checkpoint.dir, cfg.checkpoint.resume)  # refuses before heavy work
    stopper = StopSignal()
    ctx = Ctx(cfg, device, dp)

    # -- data ------------------------------------------------------------------------------------------------------
    processor = AutoProcessor.from_pretrained(cfg.model.hf_path)
    train_split, val_split = mmpr_data.load_splits(processor, cfg)
    val_split, notes = check_splits(train_split, val_split, cfg)
    train_set = mmpr_data.PairDataset(train_split.index, processor)
    val_set = mmpr_data.PairDataset(val_split.index, processor) if val_split is not None else None
    sampler = mmpr_data.PairSampler(train_split.pair_ids, cfg.data.train.seed, cfg.data.train.shuffle)
    ids = {"image": hf.image_token_id, "pad": processor.tokenizer.pad_token_id or 0}
    if rank == 0:
        print(f"data: {len(train_split.pair_ids)} train pairs, {len(val_split.pair_ids) if val_split else 0} "
              f"validation pairs, dropped rows {mmpr_data.summary_drops(train_split.index)}")  # fmt: skip
        if val_split is not None and val_split.index is not train_split.index:
            print(f"validation data: dropped rows {mmpr_data.summary_drops(val_split.index)}")
        for note in notes:
            print(note)

    # -- policy and frozen reference (same initial weights) --------------------------------------------------------
    policy = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(policy, cfg.model.hf_path)
    reference = omni_model.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(reference, cfg.model.hf_path)
    reference.eval().requires_grad_(False)
    if cfg.reference.offload and device.type == "cuda":
        reference.to("cpu")
    n_active = active_params(policy, hf)

    # -- optimizer: megatron DDP + (distributed) Adam, LR schedule -------------------------------------------------
    ddp, optimizer, scheduler = build_optimizer(policy, cfg)

    # -- resume ----------------------------------------------------------------------------------------------------
    step, reward_shift, shift_updates, run_id = 0, cfg.mpo.reward_shift, 0, None
    if resume_from is not None:
        with cuda_to_cpu():
            state = checkpoint.load(resume_from, ddp, optimizer, scheduler)
        step, reward_shift = state["step"], state["reward_shift"]
        shift_updates, run_id = state["reward_shift_num_updates"], state.get("wandb_run_id")
        sampler.load_state_dict(state["sampler"])
        if rank == 0:
            print(f"resumed from {resume_from} (step {step}, reward_shift {reward_shift!r})")
    if rank == 0:  # after a successful resume: a refused config never replaces the run's
        print(f"config: {write_resolved_config(cfg)}")
    log = MetricsLog(cfg, run_id, step, rank)
    last = cfg.mpo.stop_after_step or cfg.mpo.max_num_steps
    if step >= last:
        if rank == 0:
            print(f"nothing to do: step {step} already reached the stop step {last}")
        log.finish()
        return 0

    # -- the loop --------------------------------------------------------------------------------------------------
    def plan_fn(pair_ids):
        plan = pack.plan_step(train_split.index.lengths(pair_ids), cfg, dp)
        return plan, [p for b in plan.ranks[ctx.dp_rank] for p in b.pair_ids]

    loader = iter(mmpr_data.StepLoader(train_set, sampler, cfg.policy.train_global_batch_size, plan_fn,
                                       cfg.data.num_workers))  # fmt: skip
    bar = None
    if rank == 0 and sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(total=cfg.mpo.max_num_steps, initial=step, unit="step")
    consumed = state["consumed_pairs"] if resume_from is not None else 0
    sampler_state = sampler.state_dict()
    t_start, steps_done = time.perf_counter(), 0
    ddp.train()

    def save(at: int) -> None:
        run_state = {"consumed_pairs": consumed, "sampler": sampler_state, "reward_shift": reward_shift,
                     "reward_shift_num_updates": shift_updates, "wandb_run_id": log.run_id,
                     "config": config_mod.to_dict(cfg)}  # fmt: skip
        path = checkpoint.save(cfg.checkpoint.dir, at, ddp, optimizer, scheduler, run_state, cfg.checkpoint.keep_last)
        if rank == 0:
            print(f"saved {path}")

    while True:
        t0 = time.perf_counter()
        data = next(loader)
        batches = load_bins(data.plan, data.pairs, ctx, ids["image"], ids["pad"])
        metrics, reward_shift = train_step(policy, ddp, reference, optimizer, scheduler, batches, ctx, reward_shift)
        step += 1
        shift_updates += int(metrics["bco/reward_count"] > 0)
        consumed += len(data.pair_ids)
        sampler_state = data.sampler_state
        tokens = torch.tensor([sum(int(b.cu_seqlens[-1]) for b in batches)], device=device)
        dist.all_reduce(tokens, group=ctx.dp_group)
        dt = time.perf_counter() - t0
        steps_done += 1
        metrics.update(
            tokens=int(tokens.item()), step_time=dt, pairs_per_s=len(data.pair_ids) / dt,
            tokens_per_s=int(tokens.item()) / dt, mfu=mfu(int(tokens.item()), dt, n_active, world),
            dropped_oversized=len(data.plan.dropped), consumed_pairs=consumed,
            eta_s=(time.perf_counter() - t_start) / steps_done * (last - step),
        )  # fmt: skip
        log.log(step, metrics)
        if rank == 0 and step % cfg.logging.log_period == 0:
            (bar.write if bar else print)(format_line(step, cfg, metrics))
        if bar:
            bar.update(1)

        at_end = step >= cfg.mpo.max_num_steps
        if val_split is not None and (
            (cfg.mpo.val_period and step % cfg.mpo.val_period == 0) or (at_end and cfg.mpo.val_at_end)
        ):
            vm = validate(ddp, reference, val_split, val_set, ctx, reward_shift, ids)
            log.log(step, vm, split="validation")
            if rank == 0:
                print(f"validation step {step}: loss {vm['loss']:.4f} acc {vm['accuracy']:.3f} "
                      f"margin {vm['rewards/margin']:.4f} ({vm['val_batches']} batches)")  # fmt: skip
        stop = stopper.should_stop(device)
        segment_end = cfg.mpo.stop_after_step and step == cfg.mpo.stop_after_step
        periodic = cfg.checkpoint.save_period and step % cfg.checkpoint.save_period == 0
        if at_end or segment_end or stop or periodic:
            save(step)
        if at_end or segment_end or stop:
            break

    # -- teardown --------------------------------------------------------------------------------------------------
    if rank == 0:
        why = "max_num_steps" if step >= cfg.mpo.max_num_steps else "stop_after_step" if segment_end else "signal"
        print(f"stopped after step {step} ({why})")
    if bar:
        bar.close()
    log.finish()
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: torchrun --nproc-per-node N train.py CONFIG.toml [section.key=value ...]")
    try:
        code = main(config_mod.load_config(sys.argv[1], sys.argv[2:]))
    except (config_mod.ConfigError, mmpr_data.DataError, checkpoint.CheckpointError) as e:
        # A bad setting, input or run directory: the message says what to change; a traceback (one per rank under
        # torchrun) would only bury it.
        report_error(e)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C before the training loop installed its handler: nothing to save yet
        if int(os.environ.get("RANK", "0")) == 0:
            print("interrupted before the first step: nothing saved", file=sys.stderr)
        sys.exit(130)
    if dist.is_initialized():
        from megatron.core import parallel_state

        dist.barrier()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    sys.exit(code)
