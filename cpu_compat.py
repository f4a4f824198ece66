"""Kernel selection by capability, and the shims that let megatron-core 0.19.2 build, run and train models without
Transformer Engine, without mamba-ssm, or without a GPU.

megatron-core assumes CUDA in a few dozen places (device="cuda" literals, CUDA RNG states, CUDA streams) and, even on a
GPU, Transformer Engine (the hybrid stack's hard-coded TENorm final norm) and mamba-ssm (the Mamba mixer's kernels).
`select_kernels()` decides from what imports and whether CUDA is used: the TE spec only with TE and CUDA, else the local
spec; mamba-ssm's kernels only with mamba-ssm + causal-conv1d and CUDA, else on CUDA the pure-Triton set of
mamba_triton (mamba-ssm's Triton scan and norm from its sources, fla-core's Triton conv) when both import, else
mamba_torch; in the local spec on CUDA,
torch's grouped-GEMM experts and varlen FlashAttention where their kernels run, else megatron-core's SequentialMLP and
SDPA per sequence (the CPU path and the reference). `apply()` patches exactly the
places whose capability is missing (`shims_for`): the CUDA-only workarounds only without CUDA, the final-norm and
sequence-parallel-norm shims whenever the local spec is used, the Triton or torch Mamba whenever mamba-ssm is not;
then the model shims every platform needs (`MODEL_SHIMS`: the Mamba scan hook - time-step clamp and the
shared-prompt scan -, activation recomputation in the forward's context, the routers' padding mask, the routers'
evaluation mode on a row without real tokens).

This module is the project's one boundary for platform code: every workaround of megatron-core behaviour is here (the
non-TE modules themselves are in local_spec.py; checkpoint.py keeps two checkpoint-only ones, `_restore_adam_steps`
and `_use_in_process_write_queue`) and carries a `SHIM(megatron-core 0.19.2): <upstream file:line>`
marker naming the line it works around (paths relative to the installed package's site-packages). The patches touch
private names, so `apply()` refuses to run on any megatron-core but MEGATRON_CORE_VERSION_CHECKED: on a bump, re-check
every marker (its comment states the upstream failure and its exact error), then raise the constant.

Use:
    import cpu_compat
    print(cpu_compat.select_kernels().line())
    # e.g. "kernels: spec local; attention sdpa; experts sequential; mamba torch; device cpu"
    cpu_compat.apply()                 # before building any megatron module
    ...build the model, parallel_state, model_parallel_cuda_manual_seed(seed)...
    with cpu_compat.cuda_to_cpu():     # around optimizer construction, optimizer.step() and checkpoint loading
        optimizer = get_megatron_optimizer(...)

`apply()` is idempotent; its CPU-only part is guarded on `torch.cuda.is_available()` (not on the torch build: the
project's torch 2.14.1 is a CUDA build that runs on CPU). Run it in every process (each torchrun rank) before megatron
modules are built; on a CUDA machine it installs only the TE / mamba-ssm stand-ins the selection needs.

Run the tests: `pytest tests/test_cpu_compat.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import torch
from torch.overrides import TorchFunctionMode

# The megatron-core release every SHIM below was checked against (each names the upstream file:line it works around).
# apply() refuses any other installed version: re-check every marker, then bump this.
MEGATRON_CORE_VERSION_CHECKED = "0.19.2"

_APPLIED = False


def needed() -> bool:
    """True when the CPU-only shims are needed: no usable CUDA device in this process."""
    return not torch.cuda.is_available()


@dataclass(frozen=True)
class Kernels:
    """The kernels a model build uses, chosen by capability (`select_kernels`), never by "CPU or not".

    spec: "te" (megatron-core's Transformer Engine spec) or "local" (torch norms: omni_model's local spec).
    mamba: "mamba-ssm" (mamba-ssm's fused Triton/CUDA kernels), "triton" (mamba_triton: mamba-ssm's Triton scan and
        gated norm without its compiled package, fla-core's Triton conv; CUDA) or "torch" (mamba_torch, on the step's
        device).
    device: "cuda" or "cpu".
    attention (local spec): "varlen" (torch.nn.attention.varlen.varlen_attn, FlashAttention over all sequences of a
        bin in one call, for bf16/fp16 layers on CUDA; fp32, context parallelism and dropout stay on SDPA) or "sdpa"
        (torch SDPA per sequence, the reference); "te" with the TE spec (TE's own attention).
    experts (local spec): "grouped" (local_spec.GroupedExperts: one torch grouped GEMM per projection) or
        "sequential" (megatron-core's SequentialMLP, a loop over the experts, the reference); "te" with the TE spec
        (TEGroupedMLP).
    """

    spec: str
    mamba: str
    device: str
    attention: str = "sdpa"
    experts: str = "sequential"

    def line(self) -> str:
        """The one start-up line of train.py and bench.py, e.g.
        `kernels: spec local; attention varlen; experts grouped; mamba torch; device cuda`."""
        return (f"kernels: spec {self.spec}; attention {self.attention}; experts {self.experts}; mamba {self.mamba}; "
                f"device {self.device}")


def have_transformer_engine() -> bool:
    """True when transformer_engine's torch extension imports (whatever the device)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a TE build that does not match this CUDA/torch
        return False
    return True


def have_mamba_ssm() -> bool:
    """True when mamba-ssm's fused Mamba-2 kernels and causal-conv1d import (what megatron's MambaMixer needs)."""
    try:
        import causal_conv1d  # noqa: F401
        from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined  # noqa: F401
    except Exception:  # ImportError, or an OSError from a compiled extension built for another torch
        return False
    return True


def have_mamba_triton() -> bool:
    """True when the pure-Triton Mamba-2 set imports: mamba-ssm's Triton scan and norm from its sources (installed
    without CUDA, or $OMNI_MAMBA_SSM_SRC) and fla-core's Triton causal_conv1d (mamba_triton). fla-core's refusal of
    Triton 3.4-3.7.0 on Hopper (bench.fla_refusal) concerns its gated chunk backward, not the conv: no guard here."""
    import mamba_triton

    try:
        return mamba_triton.load_mamba_ssm_triton() is not None and mamba_triton.have_fla_conv()
    except Exception:  # ImportError from sources that do not import here (another triton, a wrong folder)
        return False


def have_grouped_mm() -> bool:
    """True when torch's grouped GEMM has its CUTLASS kernel on this GPU: `torch.nn.functional.grouped_mm` (torch >=
    2.10; `torch._grouped_mm` before) and a CUDA device of compute capability 9.x or 10.x (elsewhere torch loops over
    the groups: aten/src/ATen/native/cuda/GroupedBlas.cpp, `_grouped_mm_cuda`)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


def have_varlen_attn() -> bool:
    """True when torch's variable-length FlashAttention runs here: `torch.nn.attention.varlen.varlen_attn` with a
    `scale` argument (torch >= 2.11) and a CUDA device of compute capability >= 8.0 (FlashAttention-2)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "scale" in inspect.signature(varlen_attn).parameters and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() >= (8, 0)


def select_kernels(te: bool | None = None, mamba_ssm: bool | None = None, cuda: bool | None = None,
                   grouped_mm: bool | None = None, varlen_attn: bool | None = None,
                   mamba_triton: bool | None = None) -> Kernels:
    """The kernels for this process: the TE spec only when Transformer Engine imports AND CUDA is used, else the local
    spec; mamba-ssm's kernels only when mamba-ssm + causal-conv1d import AND CUDA is used, else the Triton set when it
    imports (`have_mamba_triton`) AND CUDA is used, else mamba_torch. With the
    local spec: grouped experts when torch's grouped GEMM kernel runs (`have_grouped_mm`) AND CUDA is used, else
    SequentialMLP; varlen attention when torch's varlen FlashAttention runs (`have_varlen_attn`) AND CUDA is used, else
    SDPA per sequence. On the CPU every choice is the reference path.

    Args: te, mamba_ssm, cuda, grouped_mm, varlen_attn, mamba_triton: the capabilities; None probes them
        (have_transformer_engine, have_mamba_ssm, torch.cuda.is_available, have_grouped_mm, have_varlen_attn,
        have_mamba_triton). Tests inject them.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = (cuda and have_transformer_engine()) if te is None else te
    mamba_ssm = (cuda and have_mamba_ssm()) if mamba_ssm is None else mamba_ssm
    mamba_triton = (cuda and not mamba_ssm and have_mamba_triton()) if mamba_triton is None else mamba_triton
    grouped_mm = (cuda and have_grouped_mm()) if grouped_mm is None else grouped_mm
    varlen_attn = (cuda and have_varlen_attn()) if varlen_attn is None else varlen_attn
    spec = "te" if te and cuda else "local"
    mamba = "mamba-ssm" if mamba_ssm and cuda else "triton" if mamba_triton and cuda else "torch"
    return Kernels(spec=spec, mamba=mamba, device="cuda" if cuda else "cpu",
                   attention="te" if spec == "te" else "varlen" if varlen_attn and cuda else "sdpa",
                   experts="te" if spec == "te" else "grouped" if grouped_mm and cuda else "sequential")


# Which shim each missing capability needs (names of functions of this module, applied in this order).
CPU_ONLY_SHIMS = ("_disable_dynamo", "_patch_current_device", "_patch_cuda_streams", "_install_cpu_rng_tracker",
                  "_patch_causal_masks", "_patch_moe_split_sizes", "_patch_clip_grads")  # CUDA-only code paths
LOCAL_SPEC_SHIMS = ("_patch_torch_norm_sequence_parallel", "_patch_hybrid_final_norm")  # no TE spec
TORCH_MAMBA_SHIMS = ("install_torch_mamba",)  # no mamba-ssm kernels, no Triton set
TRITON_MAMBA_SHIMS = ("install_triton_mamba",)  # no compiled mamba-ssm; its Triton sources and fla-core instead
# Upstream behaviour the Omni model needs changed on every platform; installed by apply() after the ones above (the
# Mamba scan hook wraps whichever Mamba scan kernel is installed by then).
MODEL_SHIMS = ("install_mamba_scan_hook", "_recompute_in_forward_context", "_fix_router_padding_mask",
               "_routers_without_statistics_in_context")


def shims_for(kernels: Kernels) -> tuple[str, ...]:
    """Names of the shims `apply` installs for `kernels`: the paged-stash stub always (it checks for triton itself),
    the CPU-only shims without CUDA, the norm shims with the local spec, the Triton or torch Mamba without
    mamba-ssm."""
    names = ("_stub_paged_stash_without_triton",)
    if kernels.device == "cpu":
        names += CPU_ONLY_SHIMS
    if kernels.spec == "local":
        names += LOCAL_SPEC_SHIMS
    if kernels.mamba == "torch":
        names += TORCH_MAMBA_SHIMS
    if kernels.mamba == "triton":
        names += TRITON_MAMBA_SHIMS
    return names


_INSTALLED: set[str] = set()


def check_megatron_core_version() -> str:
    """The installed megatron-core version (package metadata; megatron is not imported).

    Raises RuntimeError (one line naming both versions) when it is not MEGATRON_CORE_VERSION_CHECKED: the shims patch
    private names of that release and are not known to be right for another.
    """
    installed = metadata.version("megatron-core")
    if installed != MEGATRON_CORE_VERSION_CHECKED:
        raise RuntimeError(f"megatron-core {installed} is installed but cpu_compat's shims were checked on "
                           f"megatron-core {MEGATRON_CORE_VERSION_CHECKED}; re-check every SHIM marker, then update "
                           "cpu_compat.MEGATRON_CORE_VERSION_CHECKED (or install megatron-core "
                           f"{MEGATRON_CORE_VERSION_CHECKED})")
    return installed


def apply(force: bool = False) -> bool:
    """Install the shims the selected kernels need (`shims_for(select_kernels())`) and the model shims
    (`MODEL_SHIMS`); idempotent. Run it in every process before megatron modules are built (omni_model.build_model
    and distributed.init_distributed do).

    Args:
        force: install the CPU-only shims even though CUDA is available (only for tests of the shims themselves).
    Returns:
        True when the CPU-only shims are (or already were) installed, False on a CUDA machine (where only the shims
        of missing Transformer Engine / mamba-ssm and the model shims were installed).
    Raises:
        RuntimeError when the installed megatron-core is not MEGATRON_CORE_VERSION_CHECKED
        (check_megatron_core_version).
    """
    global _APPLIED
    check_megatron_core_version()
    kernels = select_kernels(cuda=False) if force else select_kernels()
    for name in shims_for(kernels) + MODEL_SHIMS:
        if name not in _INSTALLED:
            globals()[name]()
            _INSTALLED.add(name)
    _APPLIED = _APPLIED or kernels.device == "cpu"
    return _APPLIED


# ---------------------------------------------------------------------------------------------------------------------
# Process-level settings


def _disable_dynamo() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/jit.py:21
    # megatron.core.jit.jit_fuser is torch.compile: the first call of the sigmoid router's expert-bias helper compiles
    # C++ with inductor (1.3-12 s on 2 cores). An explicit TORCHDYNAMO_DISABLE in the environment wins.
    if os.environ.get("TORCHDYNAMO_DISABLE") is None:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        import torch._dynamo

        torch._dynamo.config.disable = True


def _stub_paged_stash_without_triton() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/ops/paged_stash.py:4
    # paged_stash.py imports triton unguarded and is pulled in by `import megatron.core` (-> pipeline_parallel.schedules
    # -> moe/paged_stash.py): ModuleNotFoundError without triton (upstream NVIDIA/Megatron-LM PR #6891). torch 2.14.1
    # ships triton, so this only fires on a bare CPU torch, and then only if apply() runs before megatron is imported.
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return

    def _no_kernel(*args, **kwargs):
        raise RuntimeError("paged stash needs triton and a GPU; it is stubbed on this CPU machine")

    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _no_kernel
    stub.paged_stash_pop_kernel = _no_kernel
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stub


def _patch_current_device() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:326 (and ~230 more sites, e.g.
    # megatron/core/models/common/embeddings/rotary_pos_embedding.py:162)
    # megatron-core allocates with device=torch.cuda.current_device() (rotary inv_freq, Mamba conv/dt/D params,
    # optimizer buffers), which raises "Torch not compiled with CUDA enabled"/"No CUDA GPUs" without a GPU.
    # Returning "cpu" makes those allocations land on the CPU.
    torch.cuda.current_device = lambda: "cpu"


class _NoOpEvent:
    """Stands in for torch.cuda.Event on CPU: CPU ops are synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class _NoOpStream:
    """Stands in for torch.cuda.Stream on CPU (torch.cpu.Stream.record_event returns None, so it does not do)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _NoOpEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NoOpStream)

    def __hash__(self):
        return 0


_DEFAULT_STREAM = _NoOpStream()


def _patch_cuda_streams() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/token_dispatcher.py:469 (and :922)
    # MoEAlltoAllTokenDispatcher.__init__ creates torch.cuda.Stream() ("torch.cuda.Stream requires CUDA support") and
    # _maybe_dtoh_and_synchronize uses current_stream / stream / record_event().synchronize(). On CPU every op is
    # synchronous, so no-op streams and events are exact.
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None


# ---------------------------------------------------------------------------------------------------------------------
# RNG


def _install_cpu_rng_tracker() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/tensor_parallel/random.py:303
    # tensor_parallel.random.CudaRNGStatesTracker.add calls torch.cuda.get_rng_state() ("Torch not compiled with CUDA
    # enabled"), and without a seeded tracker every get_cuda_rng_tracker().fork() raises "cuda rng state
    # model-parallel-rng is not added" (weight init, dropout). This tracker keeps named states of the *CPU* generator,
    # so model_parallel_cuda_manual_seed and fork() work unchanged; activation recomputation (CheckpointFunction) goes
    # through the same _get/_set_cuda_rng_state helpers, patched to the CPU generator.
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named CPU-generator states with megatron's CudaRNGStatesTracker interface."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_rng_state
    mrandom._set_cuda_rng_state = _set_rng_state
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


# ---------------------------------------------------------------------------------------------------------------------
# Attention masks and norms


def _patch_causal_masks() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/utils.py:39 (and :44)
    # transformer/utils.py builds the default causal and sliding-window masks with device="cuda" (used by the local
    # DotProductAttention / FusedScaleMaskSoftmax when no mask is passed). Same masks, on the CPU.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(mu, diagonal=skv - sq + window_size[1])

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = get_default_causal_mask
        mod.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _patch_torch_norm_sequence_parallel() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/torch_norm.py:50
    # WrappedTorchNorm.__new__ asserts "sequence parallel not supported by torch LayerNorm" (not CPU-specific: any
    # setup without TE/Apex). A norm's weight is replicated over TP; with sequence parallelism each rank sees only its
    # sequence slice, so the weight's grad must be all-reduced over TP: megatron does that for params tagged
    # `sequence_parallel=True` (finalize_model_grads), as TENorm tags them.
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_omni_sp_patched", False):
        return
    orig_new = cls.__new__

    def __new__(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = bool(config.sequence_parallel)
        config.sequence_parallel = False
        try:
            norm = orig_new(klass, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    cls.__new__ = __new__
    cls._omni_sp_patched = True


def _patch_hybrid_final_norm() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/models/hybrid/hybrid_block.py:215
    # HybridStack.__init__ builds its final norm with a hard-coded TENorm, which raises "Transformer Engine is not
    # installed" without TE. WrappedTorchNorm (torch.nn.RMSNorm) is the same op with the same parameter name
    # (final_norm.weight).
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm


# ---------------------------------------------------------------------------------------------------------------------
# MoE


def _patch_moe_split_sizes() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/moe_utils.py:1184
    # moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) converts only CUDA tensors, so on CPU the alltoall
    # dispatcher's input/output split sizes stay tensors and gloo's all_to_all_single raises "incompatible function
    # arguments" with EP>1. Convert CPU tensors to numpy too (what the CUDA path hands to all_to_all).
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------------------------------------------------
# Optimizer path


def _patch_clip_grads() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/optimizer/clip_grads.py:174 (and :180)
    # clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor' and allocates its overflow
    # buffer with device='cuda'. On CPU: scale every grad by max_norm / (total_norm + 1e-6) when that is < 1, the
    # same rule.
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for p in parameters:
                grad = p.decoupled_grad if use_decoupled_grad else p.grad
                if grad is not None:
                    grad.mul_(clip_coeff)

    for mod in (clip_grads, optimizer, distrib_optimizer):
        if hasattr(mod, "clip_grad_by_total_norm_fp32"):
            mod.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _cpu_device(device):
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    return device


_CUDA_TYPE = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Catch-all for megatron's optimizer/checkpoint code on CPU.

    SHIM(megatron-core 0.19.2): megatron/core/optimizer/optimizer.py:1249 (and :690, :1028;
    megatron/core/optimizer/distrib_optimizer.py:466)

    megatron-core 0.19.2's optimizer path allocates with device='cuda' (optimizer.py:1249 `_scale`, found_inf, clip
    buffers), moves with `.cuda()`, pins memory, and checks `param.type() == 'torch.cuda.FloatTensor'`
    (Float16Optimizer, DistributedOptimizer: "Wrapped parameters must be one of torch.cuda.FloatTensor, ...").
    Inside this mode a 'cuda' device becomes 'cpu', `.cuda()` is the identity, pin_memory is dropped and
    `Tensor.type()` (no argument) reports the CUDA type name of the dtype.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE.get(args[0].dtype, func(*args))
        if func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to,) and args and len(args) > 1:
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def cuda_to_cpu():
    """Context manager: `CudaToCpuMode` where the shims are needed, a null context on a CUDA machine.

    Wrap megatron optimizer construction (get_megatron_optimizer), optimizer.step() (with its grad-norm clipping) and
    fully-parallel checkpoint loading in it.
    """
    return CudaToCpuMode() if needed() or _APPLIED else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------------------
# Mamba-2


def install_torch_mamba() -> None:
    """Make megatron-core's MambaMixer build and run with the pure-torch Mamba-2 path of `mamba_torch`.

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)

    megatron/core/ssm/mamba_mixer.py imports mamba_ssm's Triton kernels in a try block; without them HAVE_MAMBA_SSM is
    False and MambaMixer.__init__ raises "MambaSSM is not installed", RMSNormGated is a MagicMock, and packed-sequence
    training asserts a mamba_ssm/causal_conv1d version. This sets the mixer module's own names (not sys.modules, so
    transformers' NemotronH keeps its independent torch path and stays a valid reference): the kernels, the gated norm
    class (with the sharded_state_dict of megatron's ExtendedRMSNorm), HAVE_MAMBA_SSM, and the packing check for the
    training path.
    """
    import mamba_torch

    _install_mamba_kernels(mamba_torch.mamba_split_conv1d_scan_combined, mamba_torch.mamba_chunk_scan_combined,
                           mamba_torch.causal_conv1d_fn, mamba_torch.rmsnorm_fn)


def install_triton_mamba() -> None:
    """Make megatron-core's MambaMixer run on the pure-Triton set of `mamba_triton` (mamba-ssm's Triton scan and
    gated norm loaded from its sources, fla-core's Triton conv, composed by mamba_torch's mixer body).

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)

    The same names as `install_torch_mamba` (mamba-ssm's package does not import without its compiled extensions, so
    megatron-core's own import of its kernels failed); the gated norm module calls mamba-ssm's Triton rmsnorm_fn.
    """
    import mamba_triton

    k = mamba_triton.kernels()
    _install_mamba_kernels(mamba_triton.mamba_split_conv1d_scan_combined, k["scan_fn"], k["conv_fn"], k["norm_fn"])


def _install_mamba_kernels(split_fn, scan_fn, conv_fn, norm_fn) -> None:
    """Set megatron's mamba_mixer names to these kernels (once per process: the first call wins)."""
    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    import mamba_torch

    if getattr(mamba_mixer, "_omni_torch_mamba", False):
        return

    class ExtendedRMSNorm(mamba_torch.RMSNormGated):
        """Gated grouped RMSNorm on `norm_fn`, weight sharded over TP along dim 0 in distributed checkpoints."""

        def forward(self, x, z=None):
            """x, z: [..., hidden_size] → [..., hidden_size] in x.dtype."""
            return norm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                           norm_before_gate=self.norm_before_gate)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            from megatron.core import parallel_state

            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True),
                prefix,
                {"weight": 0},
                sharded_offsets,
                tp_group=tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )

    orig_check = mamba_mixer._check_mamba_sequence_packing_support

    def _check_packing(for_inference_not_training: bool = True):
        # The torch and Triton paths honour seq_idx in training; inference/varlen kernels are megatron's own Triton ops.
        if not for_inference_not_training:
            return True, None
        return orig_check(for_inference_not_training)

    mamba_mixer.RMSNormGated = mamba_torch.RMSNormGated
    mamba_mixer.ExtendedRMSNorm = ExtendedRMSNorm
    mamba_mixer.mamba_chunk_scan_combined = scan_fn
    mamba_mixer.mamba_split_conv1d_scan_combined = split_fn
    mamba_mixer.causal_conv1d_fn = conv_fn
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer._check_mamba_sequence_packing_support = _check_packing
    mamba_mixer._omni_torch_mamba = True


# ---------------------------------------------------------------------------------------------------------------------
# Model shims (every platform): upstream behaviour the Omni model needs changed

# The time-step clamp of the Mamba mixer running now: set by omni_model.OmniMambaMixer around its training scan, read
# by install_mamba_scan_hook's wrapper. None: megatron-core's default (0, inf).
MAMBA_DT_LIMIT: contextvars.ContextVar = contextvars.ContextVar("omni_mamba_dt_limit", default=None)


# The shared-prompt layout of the language-model forward running now (shared_prompt.pack): the batch's
# segment_cu_seqlens_padded (int32 [3P+1], on the batch's device), set by omni_model.OmniModel.forward around the
# language model only (never the ViT); read by install_mamba_scan_hook's wrapper (Mamba layers),
# local_spec.ThdDotProductAttention and omni_model.shared_prompt_te_attention (attention layers). None: the
# separate-rows layout.
SHARED_PROMPT_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("omni_shared_prompt_segments", default=None)


def _shared_prompt_kernels(fn) -> dict:
    """conv_fn / scan_fn / norm_fn for mamba_torch.mamba_split_conv1d_scan_shared_prompt, those of the fused function
    megatron calls: {} for mamba_torch's, mamba_triton.kernels() for the Triton set's, else mamba-ssm's and
    causal-conv1d's compiled kernels (GPU)."""
    import mamba_torch
    import mamba_triton

    if fn is mamba_torch.mamba_split_conv1d_scan_combined:
        return {}
    if fn is mamba_triton.mamba_split_conv1d_scan_combined:
        return mamba_triton.kernels()
    from causal_conv1d import causal_conv1d_fn
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return {"conv_fn": causal_conv1d_fn, "scan_fn": mamba_chunk_scan_combined, "norm_fn": rmsnorm_fn}


def install_mamba_scan_hook() -> None:
    """The Mamba scan hook: route every fused Mamba scan megatron-core calls through one wrapper that (1) passes the
    time-step clamp `dt_limit` (megatron-core always calls the scan with the default (0, inf)) and (2) runs the
    shared-prompt scan (mamba_torch.mamba_split_conv1d_scan_shared_prompt) when `SHARED_PROMPT_SEGMENTS` is set.

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:755
    transformers clamps softplus(dt + dt_bias) to >= time_step_min (NemotronHMamba2Mixer.time_step_limit);
    megatron-core does not. This wrapper, installed once over the function megatron's mamba_mixer module calls
    (mamba-ssm's kernel on GPU, mamba_torch's on CPU), forwards `MAMBA_DT_LIMIT` as `dt_limit` when it is set.
    With `SHARED_PROMPT_SEGMENTS` set (a shared-prompt batch, `packing.shared_prompt`) it calls
    mamba_torch.mamba_split_conv1d_scan_shared_prompt instead, with the same arguments plus the segment offsets and
    the platform's kernels (`_shared_prompt_kernels`): each rejected response continues the prompt's state.
    """
    from megatron.core.ssm import mamba_mixer

    fn = mamba_mixer.mamba_split_conv1d_scan_combined
    if fn is None or getattr(fn, "_omni_scan_hook", False):
        return

    def omni_mamba_scan(*args, **kwargs):
        limit = MAMBA_DT_LIMIT.get()
        if limit is not None and "dt_limit" not in kwargs:
            kwargs["dt_limit"] = limit
        segments = SHARED_PROMPT_SEGMENTS.get()
        if segments is not None:
            import mamba_torch

            return mamba_torch.mamba_split_conv1d_scan_shared_prompt(
                *args, segment_cu_seqlens_padded=segments, **kwargs, **_shared_prompt_kernels(fn))
        return fn(*args, **kwargs)

    omni_mamba_scan._omni_scan_hook = True
    omni_mamba_scan.__wrapped__ = fn
    mamba_mixer.mamba_split_conv1d_scan_combined = omni_mamba_scan


def _recompute_in_forward_context() -> None:
    """Run a recomputed forward (activation recomputation, `model.recompute` full or selective) with the context
    variables of its first run.

    SHIM(megatron-core 0.19.2): megatron/core/tensor_parallel/random.py:591
    CheckpointFunction re-runs the checkpointed layers during backward, after OmniModel.forward has reset
    `SHARED_PROMPT_SEGMENTS` (and, on a GPU, in autograd's device thread, which has its own context): without this the
    recomputed attention and Mamba layers of a shared-prompt batch ran the plain span layout (the rejected response
    seeing the chosen one) and the gradients were wrong. The wrapper copies the caller's contextvars.Context when the
    checkpoint is taken and runs both the forward and its recomputation in it. Every megatron-core call site goes
    through CheckpointFunction (tensor_parallel.checkpoint) except te_checkpoint, which megatron uses only with FP8 /
    FP4 (not supported here).
    """
    from megatron.core.tensor_parallel.random import CheckpointFunction

    forward = CheckpointFunction.forward
    if getattr(forward, "_omni_context", False):
        return

    def forward_in_context(ctx, run_function, distribute_saved_activations, *args):
        context = contextvars.copy_context()
        return forward(ctx, functools.partial(context.run, run_function), distribute_saved_activations, *args)

    forward_in_context._omni_context = True
    CheckpointFunction.forward = staticmethod(forward_in_context)


def _fix_router_padding_mask() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/router.py:738
    # TopKRouter._apply_expert_bias masks the routing map [N, E] with the flattened padding mask [N]
    # (`routing_map & ~padding_mask`), which broadcasts along the expert dim and fails (or, with N == E, masks the
    # wrong entries). Same update, with the mask applied per token: counts of non-padding tokens only, outside
    # evaluation and activation recomputation (grad enabled), as megatron-core intends.
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "_omni_fixed", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._omni_fixed = True
    TopKRouter._apply_expert_bias = _apply_expert_bias


def install_mamba_cp_thd_indices(partition_index: Callable[[torch.Tensor, int, int], torch.Tensor]) -> None:
    """Without Transformer Engine, give megatron-core's Mamba context parallelism with THD packing the load-balanced
    token index it asks TE for (omni_model.build_model calls it when CP > 1; a no-op when TE imports).

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_context_parallel.py:392 (and :377, :415, :430)
    `_undo/_redo_attention_load_balancing` call `tex.thd_get_partitioned_indices` and assert TE >= 1.10.

    Args: partition_index(cu_seqlens_padded int32 [S+1], cp_size, cp_rank) -> int64 [T/CP], the token positions of
        this rank (chunk r and 2*CP-1-r of every padded sequence: pack.cp_partition_index).
    Raises (from the installed function): ValueError when cu_seqlens does not end at total_tokens.
    """
    from megatron.core.ssm import mamba_context_parallel as mcp

    if mcp.tex is not None:
        return

    def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank):
        if int(cu_seqlens[-1]) != int(total_tokens):
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, total_tokens is {total_tokens}")
        return partition_index(cu_seqlens, cp_size, cp_rank).to(torch.int32)

    mcp.tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)
    mcp.is_te_min_version = lambda version, *a, **k: True


# Set by omni_model.OmniModel.forward around the language model when its row holds no real token (a dummy bin): the
# MoE routers then run as in evaluation (_routers_without_statistics_in_context). A context variable, not the modules'
# `training` flag, so that activation recomputation (_recompute_in_forward_context) sees it too.
ROUTERS_WITHOUT_STATISTICS: contextvars.ContextVar = contextvars.ContextVar("omni_routers_without_statistics",
                                                                            default=False)


@contextlib.contextmanager
def routers_without_statistics(active: bool):
    """While `active` (the row holds no real token, e.g. a dummy bin), run every MoE router in evaluation mode: no aux
    loss, z-loss or expert-bias counts; the rest of the model stays in training mode. Used by
    omni_model.OmniModel.forward around the language model; it holds for the recomputed forward of activation
    recomputation too, which runs in the forward's context. Needs the model shim
    `_routers_without_statistics_in_context` (installed by apply())."""
    token = ROUTERS_WITHOUT_STATISTICS.set(bool(active))
    try:
        yield
    finally:
        ROUTERS_WITHOUT_STATISTICS.reset(token)


def _routers_without_statistics_in_context() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/moe_utils.py:141
    # With every token masked, megatron-core's aux loss divides 0 by 0 tokens (NaN in the router gradients); its routers
    # compute the aux losses only in training mode, and the expert-bias counts are 0 anyway. TopKRouter.forward runs in
    # evaluation mode while ROUTERS_WITHOUT_STATISTICS is set (routers_without_statistics). Toggling the modules'
    # `training` flag around OmniModel's forward instead missed the recomputed forward of `model.recompute` (a dummy
    # bin with an aux loss gave NaN router gradients).
    from megatron.core.transformer.moe.router import TopKRouter

    forward = TopKRouter.forward
    if getattr(forward, "_omni_context", False):
        return

    def forward_in_context(self, *args, **kwargs):
        if not (self.training and ROUTERS_WITHOUT_STATISTICS.get()):
            return forward(self, *args, **kwargs)
        self.training = False
        try:
            return forward(self, *args, **kwargs)
        finally:
            self.training = True

    forward_in_context._omni_context = True
    TopKRouter.forward = forward_in_context
