"""Kernel selection by capability: `select_kernels()` probes which attention, MoE-expert and Mamba-2 kernels import
and run here, once per process (train.main), and returns the `Kernels` passed down (`line()`: the start-up banner).
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
    from backend import mamba_triton

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
    dtype: the layers' (model.params_dtype; None: bf16)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = (cuda and te_importable()) if te is None else te
    mamba_ssm = (cuda and mamba_ssm_importable()) if mamba_ssm is None else mamba_ssm
    mamba_triton = (cuda and not mamba_ssm and mamba_triton_importable()) if mamba_triton is None else mamba_triton
    grouped_mm = (cuda and have_grouped_mm()) if grouped_mm is None else grouped_mm
    varlen_attn = (cuda and have_varlen_attn()) if varlen_attn is None else varlen_attn
    # torch's varlen FlashAttention and CUTLASS grouped GEMM run in bf16 only here: fp32 layers stay on SDPA and
    # torch's per-group loop
    grouped_mm, varlen_attn = (grouped_mm, varlen_attn) if dtype in (None, torch.bfloat16) else (False, False)
    spec = "te" if te and cuda else "local"
    mamba = "mamba-ssm" if mamba_ssm and cuda else "triton" if mamba_triton and cuda else "torch"
    return Kernels(spec=spec, mamba=mamba, device="cuda" if cuda else "cpu",
                   attention="te" if spec == "te" else "varlen" if varlen_attn and cuda else "sdpa",
                   experts="te" if spec == "te" else "grouped" if grouped_mm and cuda else "grouped-loop")
