"""Patches of megatron-core: what lets it build, run and train this model without Transformer Engine, without
mamba-ssm or without a GPU, and the changes the model needs on every platform.

`apply(kernels)` installs, once each, the patches the kernels need (`shims_for`) and the model patches (`MODEL_SHIMS`)
in every process before megatron modules are built (omni_model.build_model, distributed.init_distributed). On a CPU run
megatron's optimizers build, step and load in `CudaToCpuMode`; without TE, train.build_optimizer builds the
precision-aware optimizer through `optimizer_config` and `precision_aware_adam`. checkpoint.py calls the checkpointing
repairs (`name_grad_dtype`, `restore_adam_steps`, `use_in_process_write_queue`). Each patch carries a
`SHIM(megatron-core <version>): <upstream file:line>` marker; `apply()` refuses any other megatron-core. Why each
exists: docs/DESIGN.md, "Kernels and megatron-core patches". Tests: `pytest tests/test_megatron_patches.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
import queue
import re
import sys
import types
from collections.abc import Callable
from importlib import metadata

import torch
from torch.overrides import TorchFunctionMode

from backend import shared_prompt
from backend.kernel_selection import Kernels, select_kernels

MEGATRON_CORE_VERSION_CHECKED = "0.19.2"  # every SHIM marker names a line of this release

# The patches (functions of this module), installed by apply() in this order.
CPU_ONLY_SHIMS = ("_disable_dynamo", "_patch_current_device", "_patch_cuda_streams", "_install_cpu_rng_tracker",
                  "_patch_causal_masks", "_patch_moe_split_sizes", "_patch_clip_grads",
                  "_optimizers_in_cpu_mode")  # no CUDA
LOCAL_SPEC_SHIMS = ("_patch_torch_norm_sequence_parallel", "_patch_hybrid_final_norm")  # no TE spec
TORCH_MAMBA_SHIMS = ("install_torch_mamba",)  # no mamba-ssm kernels, no Triton set
TRITON_MAMBA_SHIMS = ("install_triton_mamba",)  # mamba-ssm's Triton sources and fla-core instead of mamba-ssm
# Every platform, after the ones above (the scan hook wraps whichever Mamba kernel is installed by then).
MODEL_SHIMS = ("install_mamba_scan_hook", "_recompute_in_forward_context", "_fix_router_padding_mask",
               "_routers_without_statistics_in_context", "_master_as_kept")

_INSTALLED: set[str] = set()
_KERNELS: Kernels | None = None  # the kernels of the first apply(): passed, or probed once

# Per-forward state, set by omni_model around the language model and read by the patched layers (context variables,
# so the recomputed forward of activation recomputation sees them too: _recompute_in_forward_context);
# the shared-prompt format's is shared_prompt.ROW_SPANS.
# The time-step clamp (min, max) of the Mamba mixer running now (OmniMambaMixer); None: megatron's (0, inf).
MAMBA_DT_LIMIT: contextvars.ContextVar = contextvars.ContextVar("omni_mamba_dt_limit", default=None)
# True while the row holds no real token (a dummy bin): the MoE routers run as in evaluation.
ROUTERS_WITHOUT_STATISTICS: contextvars.ContextVar = contextvars.ContextVar("omni_routers_without_statistics",
                                                                            default=False)


def shims_for(k: Kernels) -> tuple[str, ...]:
    """Names of the patches `apply` installs for the kernels `k`, before MODEL_SHIMS."""
    names = ("_stub_paged_stash_without_triton",)
    if k.device == "cpu":
        names += CPU_ONLY_SHIMS
    if k.spec == "local":
        names += LOCAL_SPEC_SHIMS
    if k.mamba == "torch":
        names += TORCH_MAMBA_SHIMS
    if k.mamba == "triton":
        names += TRITON_MAMBA_SHIMS
    return names


def check_megatron_core_version() -> str:
    """The installed megatron-core version (package metadata); RuntimeError unless MEGATRON_CORE_VERSION_CHECKED."""
    installed = metadata.version("megatron-core")
    if installed != MEGATRON_CORE_VERSION_CHECKED:
        raise RuntimeError(f"megatron-core {installed} is installed but the patches were checked on megatron-core "
                           f"{MEGATRON_CORE_VERSION_CHECKED}; re-check every SHIM marker, then update "
                           "megatron_patches.MEGATRON_CORE_VERSION_CHECKED")
    return installed


def apply(kernels: Kernels | None = None, force: bool = False) -> bool:
    """Install the patches `kernels` need and the model patches, once each. kernels: the process's selection (train
    passes the one it printed); None: the first apply's, probed by `select_kernels()` when no call passed one. force:
    install the CPU-only ones even with CUDA (tests). Returns True when the CPU-only patches are installed."""
    global _KERNELS
    check_megatron_core_version()
    if force:
        k = select_kernels(cuda=False)
    else:
        k = kernels or _KERNELS or select_kernels()
        _KERNELS = _KERNELS or k
    for name in shims_for(k) + MODEL_SHIMS:
        if name not in _INSTALLED:
            globals()[name]()
            _INSTALLED.add(name)
    return set(CPU_ONLY_SHIMS) <= _INSTALLED


# ---------------------------------------------------------------------------------------------------------------------
# Process-level settings, streams and RNG


def _disable_dynamo() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/jit.py:21
    # jit_fuser is torch.compile: the router's first call compiles C++ (seconds on 2 cores). An explicit
    # TORCHDYNAMO_DISABLE in the environment wins.
    if os.environ.get("TORCHDYNAMO_DISABLE") is None:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        import torch._dynamo

        torch._dynamo.config.disable = True


def _stub_paged_stash_without_triton() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/ops/paged_stash.py:4
    # `import megatron.core` imports triton unguarded through paged_stash.py; only a bare CPU torch lacks triton.
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
    # Allocations with device=torch.cuda.current_device() land on the CPU.
    torch.cuda.current_device = lambda: "cpu"


class _NoOpEvent:
    """torch.cuda.Event on CPU: CPU ops are synchronous, so waiting is a no-op."""

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
    """torch.cuda.Stream on CPU (torch.cpu.Stream.record_event returns None, so it does not do)."""

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
    # The alltoall dispatcher creates and synchronizes CUDA streams; on CPU no-op streams and events are exact.
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpEvent
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None


def _install_cpu_rng_tracker() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/tensor_parallel/random.py:303
    # CudaRNGStatesTracker keeps CUDA generator states; this one keeps named states of the CPU generator, so
    # model_parallel_cuda_manual_seed, fork() and activation recomputation work unchanged.
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
    # The default causal and sliding-window masks are built with device="cuda"; the same masks on the CPU.
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
    # WrappedTorchNorm refuses sequence parallelism; build it without, then tag its weights `sequence_parallel` (as
    # TENorm does) so finalize_model_grads all-reduces their grads over TP.
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
    # HybridStack's final norm is a hard-coded TENorm; WrappedTorchNorm is the same op and parameter name.
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hybrid_block.TENorm = WrappedTorchNorm


# ---------------------------------------------------------------------------------------------------------------------
# MoE and the optimizer path


def _patch_moe_split_sizes() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/moe_utils.py:1184
    # maybe_move_tensor_to_cpu(as_numpy=True) converts only CUDA tensors; gloo's all_to_all_single needs the lists.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_clip_grads() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/optimizer/clip_grads.py:174 (and :180)
    # clip_grad_by_total_norm_fp32 asserts CUDA grads; the same rule on CPU.
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


def te_fused_adam() -> bool:
    """True where Transformer Engine's FusedAdam is importable: megatron-core's own precision-aware path runs."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


def optimizer_config(config_cls, precision: dict, **kwargs):
    """megatron-core's OptimizerConfig(**kwargs, **precision); `precision`: use_precision_aware_optimizer,
    store_param_remainders, exp_avg_dtype, exp_avg_sq_dtype. Without TE's FusedAdam the config is built without the
    flag (its check imports TE and turns remainders off below TE 2.1), then given the fields as that check would.
    SHIM(megatron-core 0.19.2): megatron/core/optimizer/optimizer_config.py:430 (and :438, :404)"""
    if not precision.get("use_precision_aware_optimizer") or te_fused_adam():
        return config_cls(**kwargs, **precision)
    cfg = config_cls(**kwargs)
    for k, v in precision.items():
        setattr(cfg, k, v)
    assert cfg.optimizer == "adam" and cfg.use_distributed_optimizer and cfg.fp8_recipe is None
    cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return cfg


@contextlib.contextmanager
def precision_aware_adam(config):
    """While get_megatron_optimizer builds: precision_adam.PrecisionAwareAdam as megatron-core's `Adam` (TE's FusedAdam
    keywords, store_param_remainders included) where the config asks for it and TE's FusedAdam is not importable.
    SHIM(megatron-core 0.19.2): megatron/core/optimizer/__init__.py:556 (and :583)"""
    if not config.use_precision_aware_optimizer or te_fused_adam():
        yield
        return
    from megatron.core import optimizer as mopt

    from backend import precision_adam

    saved = {k: getattr(mopt, k) for k in ("Adam", "USING_PYTORCH_OPTIMIZER", "is_te_min_version")}
    mopt.Adam, mopt.USING_PYTORCH_OPTIMIZER = precision_adam.PrecisionAwareAdam, False
    mopt.is_te_min_version = lambda version, check_equality=True: True
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(mopt, k, v)


def _master_as_kept() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/optimizer/distrib_optimizer.py:1193 (and :1225)
    # A saved master in the other form than this optimizer keeps (int16 remainders of a precision-aware run, fp32
    # values of the fp32-master path) is converted with the loaded bf16 weight; the precision-aware optimizer converts
    # in set_scaled_state, the fp32-master path here.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(set_states, "_omni_master", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if tensors.get("param") is not None and tensors["param"].dtype == torch.int16 and not (
                self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            from backend import precision_adam

            r = self._get_model_param_range_map(model_param)["param"]
            weight = model_param.detach().view(-1)[r.start : r.end]
            tensors = dict(tensors, param=precision_adam.master_from_remainder(weight, tensors["param"]))
        return set_states(self, model_param, tensors)

    _set_main_param_and_optimizer_states._omni_master = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _cpu_device(device):
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    return device


_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
              torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor",
              torch.int64: "torch.cuda.LongTensor", torch.int32: "torch.cuda.IntTensor"}


class CudaToCpuMode(TorchFunctionMode):
    """megatron's optimizer code on CPU: a 'cuda' device becomes 'cpu', `.cuda()` and pin_memory are the identity,
    and `Tensor.type()` reports the CUDA type name of the dtype."""

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


_IN_CPU_MODE: contextvars.ContextVar = contextvars.ContextVar("omni_optimizer_in_cpu_mode", default=False)
# The optimizers' methods that build, step, save or load: each runs in CudaToCpuMode (once, also when nested).
OPTIMIZER_METHODS_IN_CPU_MODE = ("__init__", "step", "sharded_state_dict", "load_state_dict",
                                 "_init_optimizer_states_with_dummy_values")


def _in_cpu_mode(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def in_cpu_mode(*args, **kwargs):
        if _IN_CPU_MODE.get():
            return fn(*args, **kwargs)
        token = _IN_CPU_MODE.set(True)
        try:
            with CudaToCpuMode():
                return fn(*args, **kwargs)
        finally:
            _IN_CPU_MODE.reset(token)

    return in_cpu_mode


def _optimizers_in_cpu_mode() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/optimizer/optimizer.py:1249 (and :690, :1028;
    # megatron/core/optimizer/distrib_optimizer.py:466)
    # The optimizers allocate on device="cuda", call .cuda() and test Tensor.type() against CUDA type names: their
    # construction, step and state's save and load run in CudaToCpuMode.
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = [c for mod in (optimizer, distrib_optimizer) for c in vars(mod).values()
               if isinstance(c, type) and issubclass(c, optimizer.MegatronOptimizer) and c.__module__ == mod.__name__]
    for cls in classes:  # each class's own methods: an inherited one is wrapped once, in its defining class
        for name in OPTIMIZER_METHODS_IN_CPU_MODE:
            if name in vars(cls):
                setattr(cls, name, _in_cpu_mode(vars(cls)[name]))


# ---------------------------------------------------------------------------------------------------------------------
# Mamba-2 kernels without mamba-ssm


def install_torch_mamba() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)
    # Without mamba-ssm, MambaMixer refuses to build: run it on mamba_torch's kernels.
    from backend import mamba_torch

    _install_mamba_kernels(mamba_torch.mamba_split_conv1d_scan_combined, mamba_torch.mamba_chunk_scan_combined,
                           mamba_torch.causal_conv1d_fn, mamba_torch.rmsnorm_fn)


def install_triton_mamba() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)
    # Without mamba-ssm, MambaMixer refuses to build: run it on mamba_triton's kernels.
    from backend import mamba_triton

    k = mamba_triton.kernels()
    _install_mamba_kernels(mamba_triton.mamba_split_conv1d_scan_combined, k["scan_fn"], k["conv_fn"], k["norm_fn"])


def _install_mamba_kernels(split_fn, scan_fn, conv_fn, norm_fn) -> None:
    # Sets the mixer module's own names, not sys.modules, so transformers' NemotronH keeps its own torch path (the
    # reference of the tests). The first call in a process wins.
    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from backend import mamba_torch

    if getattr(mamba_mixer, "_omni_torch_mamba", False):
        return

    class ExtendedRMSNorm(mamba_torch.RMSNormGated):
        """Gated grouped RMSNorm on `norm_fn`, weight sharded over TP along dim 0 in distributed checkpoints."""

        def forward(self, x, z=None):
            return norm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                           norm_before_gate=self.norm_before_gate)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            from megatron.core import parallel_state

            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0}, sharded_offsets, tp_group=tp_group,
                                                       dp_cp_group=metadata["dp_cp_group"])

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
# Distributed checkpointing (called by checkpoint.save and checkpoint.load)

BUCKET_DTYPE_RE = re.compile(r"\.dtype_\((torch\.\w+), torch\.\w+\)\.")  # (param, grad dtype) in an optimizer key


def name_grad_dtype(tree, grad_reduce_in_fp32: bool) -> None:
    """Name, in place, the gradient-buffer dtype in the distributed optimizer's `dp_reshardable` state `tree` as
    `grad_reduce_in_fp32` makes it (fp32, or the param dtype): in a sharded state dict's keys
    (`...dtype_(<param dtype>, <grad dtype>)...`) and in a loaded one's per-bucket element counts
    ({(param dtype, grad dtype): [numel]} per buffer). What the state holds (fp32 master weights, Adam moments) does not
    depend on the grad dtype, so checkpoint.load names the keys as saved, then the counts as this run's.
    SHIM(megatron-core 0.19.2): megatron/core/optimizer/distrib_optimizer.py:1894 (and :1236, :2068)"""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def grad(param_dtype):
        return torch.float32 if grad_reduce_in_fp32 else param_dtype

    def key(m: re.Match) -> str:
        return f".dtype_({m[1]}, {'torch.float32' if grad_reduce_in_fp32 else m[1]})."

    for k, v in list(tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if isinstance(v, ShardedBase):
            v.key = BUCKET_DTYPE_RE.sub(key, v.key)
        elif k in ("per_bucket_numel", "per_bucket_numel_unpadded") and isinstance(v, list):
            tree[k] = [{(p, grad(p)): n for (p, _), n in buffer.items()} for buffer in v]
        elif isinstance(v, (dict, list)):
            name_grad_dtype(v, grad_reduce_in_fp32)


def restore_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor holding the loaded param-group step.
    SHIM(megatron-core 0.19.2): megatron/core/optimizer/distrib_optimizer.py:1032"""
    steps = set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):  # a ChainedOptimizer's, or [optimizer]
        inner = getattr(opt, "optimizer", None)
        for group in inner.param_groups if inner is not None else []:
            for p in group["params"] if "step" in group else []:
                st = inner.state.get(p)
                if st is not None and "step" in st:
                    st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype, device=st["step"].device)
                    steps.add(float(group["step"]))
    assert len(steps) <= 1, f"param groups with different Adam steps {sorted(steps)}"


CHECKPOINT_WRITE_ERRORS: list[BaseException] = []  # the shard writers' exceptions of the save in progress


def use_in_process_write_queue() -> None:
    """An in-process results queue for dist_checkpointing's save, and the writers' exceptions kept for checkpoint.save
    (CHECKPOINT_WRITE_ERRORS).
    SHIM(megatron-core 0.19.2): megatron/core/dist_checkpointing/strategies/filesystem_async.py:65"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync
    if getattr(writer.write_preloaded_data, "_omni_mpo_records", False):
        return
    write, finish = writer.write_preloaded_data, writer.finish

    def recording(*args, **kwargs):
        out = write(*args, **kwargs)
        if out is not None and isinstance(out[1], BaseException):
            CHECKPOINT_WRITE_ERRORS.append(out[1])  # megatron-core logs it and raises only "Worker failure"
        return out

    def recording_finish(self, *args, **kwargs):
        try:
            return finish(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised by checkpoint.save on every rank, after megatron's broadcast
            CHECKPOINT_WRITE_ERRORS.append(e)

    recording._omni_mpo_records = True
    writer.write_preloaded_data = staticmethod(recording)
    writer.finish = recording_finish


@contextlib.contextmanager
def checkpoint_writer_log_quiet():
    """megatron-core's checkpoint writer logs a failed write at ERROR level; checkpoint.save reports it itself, in one
    line."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    logger = logging.getLogger(filesystem_async.__name__)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------------
# Model patches (every platform)


def install_mamba_scan_hook() -> None:
    """Wrap the fused Mamba scan megatron calls: pass MAMBA_DT_LIMIT as `dt_limit`, and run
    shared_prompt.mamba_split_conv1d_scan while shared_prompt.ROW_SPANS is set.

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:755
    """
    from megatron.core.ssm import mamba_mixer

    fn = mamba_mixer.mamba_split_conv1d_scan_combined
    if fn is None or getattr(fn, "_omni_scan_hook", False):
        return

    def omni_mamba_scan(*args, **kwargs):
        limit = MAMBA_DT_LIMIT.get()
        if limit is not None and "dt_limit" not in kwargs:
            kwargs["dt_limit"] = limit
        row_spans = shared_prompt.ROW_SPANS.get()
        if row_spans is not None:
            return shared_prompt.mamba_split_conv1d_scan(*args, row_spans=row_spans, **kwargs,
                                                         **shared_prompt.mamba_kernels(fn))
        return fn(*args, **kwargs)

    omni_mamba_scan._omni_scan_hook = True
    omni_mamba_scan.__wrapped__ = fn
    mamba_mixer.mamba_split_conv1d_scan_combined = omni_mamba_scan


def _recompute_in_forward_context() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/tensor_parallel/random.py:591
    # CheckpointFunction recomputes in backward, after the forward reset the context variables (and on a GPU in
    # autograd's thread): run the forward and its recomputation in a copy of the caller's context.
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
    # `routing_map & ~padding_mask` broadcasts [N] along the expert dim of [N, E]; the same update, masked per token.
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
    """Without Transformer Engine, give megatron's Mamba context parallelism (THD) the token index it asks TE for:
    partition_index(cu_seqlens_padded int32 [S+1], cp_size, cp_rank) -> int64 [T/CP] (pack.cp_partition_index).

    SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_context_parallel.py:392 (and :377, :415, :430)
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


@contextlib.contextmanager
def routers_without_statistics(active: bool):
    """While `active`, every MoE router runs in evaluation mode (no aux loss, z-loss or expert-bias counts)."""
    token = ROUTERS_WITHOUT_STATISTICS.set(bool(active))
    try:
        yield
    finally:
        ROUTERS_WITHOUT_STATISTICS.reset(token)


def _routers_without_statistics_in_context() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/transformer/moe/moe_utils.py:141
    # With every token masked the aux loss divides 0 by 0 (NaN router gradients); routers compute it only in training.
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
