"""Kernel selection by capability: which attention, MoE-expert and Mamba-2 kernels this process uses.

`select_kernels()` probes what imports and runs here and returns a `Kernels`, whose `line()` is the start-up banner,
e.g. `kernels: spec local; attention sdpa; experts grouped-loop; mamba torch; device cpu`. `install_torch_mamba` /
`install_triton_mamba` put the chosen Mamba-2 kernels into megatron-core's MambaMixer (megatron_patches.apply).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Kernels:
    """The kernels of a model build."""

    spec: str  # "te" (Transformer Engine spec) or "local" (local_spec's torch modules)
    mamba: str  # "mamba-ssm" (its compiled kernels), "triton" (mamba_triton) or "torch" (mamba_torch)
    device: str  # "cuda" or "cpu"
    attention: str = "sdpa"  # "varlen" (torch varlen FlashAttention), "sdpa" (SDPA per sequence) or "te"
    # local_spec.GroupedExperts: "grouped" (torch's CUTLASS grouped GEMM) or "grouped-loop" (torch loops over the
    # experts: CPU, other GPUs); "te" (TEGroupedMLP); "sequential" (megatron's SequentialMLP, the tests' reference)
    experts: str = "grouped-loop"

    def line(self) -> str:
        return (f"kernels: spec {self.spec}; attention {self.attention}; experts {self.experts}; mamba {self.mamba}; "
                f"device {self.device}")


def te_importable() -> bool:
    """True when transformer_engine's torch extension imports (whatever the device)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from a TE build that does not match this CUDA/torch
        return False
    return True


def mamba_ssm_importable() -> bool:
    """True when mamba-ssm's fused Mamba-2 kernels and causal-conv1d import."""
    try:
        import causal_conv1d  # noqa: F401
        from mamba_ssm.ops.triton.ssd_combined import mamba_split_conv1d_scan_combined  # noqa: F401
    except Exception:  # ImportError, or an OSError from a compiled extension built for another torch
        return False
    return True


def mamba_triton_importable() -> bool:
    """True when mamba_triton's set (mamba-ssm's Triton sources, fla-core's conv) imports."""
    import mamba_triton

    try:
        return mamba_triton.load_mamba_ssm_triton() is not None and mamba_triton.have_fla_conv()
    except Exception:  # ImportError from sources that do not import here (another triton, a wrong folder)
        return False


def have_grouped_mm() -> bool:
    """True when torch's grouped GEMM has its CUTLASS kernel here (compute capability 9.x or 10.x)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in (9, 10)


def have_varlen_attn() -> bool:
    """True when torch's varlen_attn takes `scale` and a FlashAttention-2 device (sm80+) is here."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "scale" in inspect.signature(varlen_attn).parameters and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() >= (8, 0)


def select_kernels(te: bool | None = None, mamba_ssm: bool | None = None, cuda: bool | None = None,
                   grouped_mm: bool | None = None, varlen_attn: bool | None = None,
                   mamba_triton: bool | None = None, dtype: torch.dtype | None = None) -> Kernels:
    """The kernels for this process; each argument is a capability, None probes it. Every fast kernel needs CUDA.
    dtype: the layers' (model.params_dtype; None: bf16): torch's varlen FlashAttention and CUTLASS grouped GEMM run in
    bf16 only here (fp32 layers stay on SDPA and torch's per-group loop)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = (cuda and te_importable()) if te is None else te
    mamba_ssm = (cuda and mamba_ssm_importable()) if mamba_ssm is None else mamba_ssm
    mamba_triton = (cuda and not mamba_ssm and mamba_triton_importable()) if mamba_triton is None else mamba_triton
    grouped_mm = (cuda and have_grouped_mm()) if grouped_mm is None else grouped_mm
    varlen_attn = (cuda and have_varlen_attn()) if varlen_attn is None else varlen_attn
    grouped_mm, varlen_attn = (grouped_mm, varlen_attn) if dtype in (None, torch.bfloat16) else (False, False)
    spec = "te" if te and cuda else "local"
    mamba = "mamba-ssm" if mamba_ssm and cuda else "triton" if mamba_triton and cuda else "torch"
    return Kernels(spec=spec, mamba=mamba, device="cuda" if cuda else "cpu",
                   attention="te" if spec == "te" else "varlen" if varlen_attn and cuda else "sdpa",
                   experts="te" if spec == "te" else "grouped" if grouped_mm and cuda else "grouped-loop")


def install_torch_mamba() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)
    # Without mamba-ssm, MambaMixer refuses to build: run it on mamba_torch's kernels.
    import mamba_torch

    _install_mamba_kernels(mamba_torch.mamba_split_conv1d_scan_combined, mamba_torch.mamba_chunk_scan_combined,
                           mamba_torch.causal_conv1d_fn, mamba_torch.rmsnorm_fn)


def install_triton_mamba() -> None:
    # SHIM(megatron-core 0.19.2): megatron/core/ssm/mamba_mixer.py:204 (and :92, :1490)
    # Without mamba-ssm, MambaMixer refuses to build: run it on mamba_triton's kernels.
    import mamba_triton

    k = mamba_triton.kernels()
    _install_mamba_kernels(mamba_triton.mamba_split_conv1d_scan_combined, k["scan_fn"], k["conv_fn"], k["norm_fn"])


def _install_mamba_kernels(split_fn, scan_fn, conv_fn, norm_fn) -> None:
    # Sets the mixer module's own names, not sys.modules, so transformers' NemotronH keeps its own torch path (the
    # reference of the tests). The first call in a process wins.
    from megatron.core.ssm import mamba_mixer
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    import mamba_torch

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
