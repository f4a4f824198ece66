"""Mamba-2 training kernels in pure Triton, for a CUDA machine without compiled mamba-ssm / causal-conv1d: the
`mamba triton` kernel set of kernel_selection.select_kernels.

* scan and gated norm: mamba-ssm's `mamba_chunk_scan_combined` (chunked SSD; packed sequences by seq_idx) and
  `rmsnorm_fn`, imported from mamba-ssm's sources by `load_mamba_ssm_triton`. mamba-ssm builds without CUDA
  (`MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps
  mamba-ssm==2.3.2.post1`), or $OMNI_MAMBA_SSM_SRC names its unpacked sdist; its package `__init__` imports the
  compiled `selective_scan_cuda`, which these kernels never call: the loader runs the two Triton modules without
  that `__init__`.
* conv: fla-core's Triton `causal_conv1d` (packed sequences by cu_seqlens), behind `causal_conv1d_fn`, which takes
  mamba_torch.causal_conv1d_fn's arguments.

`kernels()` returns them as the conv_fn / scan_fn / norm_fn of mamba_torch's composed functions
(`mamba_split_conv1d_scan_combined`, `mamba_split_conv1d_scan_shared_prompt`); kernel_selection.install_triton_mamba wires
them into megatron-core's MambaMixer. The CPU proof runs them in Triton's interpreter against mamba_torch
(tests/test_mamba_ssm_interpret.py); the GPU one is tests/test_gpu.py.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

MAMBA_SSM_SRC_ENV = "OMNI_MAMBA_SSM_SRC"  # a folder holding mamba-ssm's `mamba_ssm/` sources (e.g. its unpacked sdist)
_PACKAGE = "mamba_ssm"
_TRITON_MODULES = ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated")
FLA_CHUNK = 64  # fla-core's causal_conv1d tiles time in chunks of 64 tokens (CausalConv1dFunction's chunk_size)


def mamba_ssm_package_dir() -> Path | None:
    """The `mamba_ssm/` source folder: under $OMNI_MAMBA_SSM_SRC when set, else the installed package's (located by
    importlib without running it), else None. Raises ImportError when $OMNI_MAMBA_SSM_SRC holds no Triton sources."""
    if os.environ.get(MAMBA_SSM_SRC_ENV):
        src = os.environ[MAMBA_SSM_SRC_ENV]
        package = Path(src) / _PACKAGE
        if not (package / "ops" / "triton" / "ssd_combined.py").is_file():
            raise ImportError(f"{MAMBA_SSM_SRC_ENV}={src} does not hold mamba-ssm's sources (mamba_ssm/ops/triton/)")
        return package
    module = sys.modules.get(_PACKAGE)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def _load(package_dir: Path) -> dict:
    if _PACKAGE in sys.modules and getattr(sys.modules[_PACKAGE], "__file__", None) is not None:
        modules = [importlib.import_module(name) for name in _TRITON_MODULES]  # the complete package, imported
    else:
        # The package's own module, made from its spec but not executed; the submodules then import normally (their
        # own __init__ files are empty). Afterwards every `mamba_ssm*` entry is taken out of sys.modules again (and
        # any left by an earlier failed import put back), so no partial package stays importable by that name.
        saved = {n: m for n, m in sys.modules.items() if n == _PACKAGE or n.startswith(_PACKAGE + ".")}
        for name in saved:
            del sys.modules[name]
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
        )
        sys.modules[_PACKAGE] = importlib.util.module_from_spec(spec)
        try:
            modules = [importlib.import_module(name) for name in _TRITON_MODULES]
        finally:
            for name in [n for n in sys.modules if n == _PACKAGE or n.startswith(_PACKAGE + ".")]:
                del sys.modules[name]
            sys.modules.update(saved)
    ssd, norm = modules
    return {"scan_fn": ssd.mamba_chunk_scan_combined, "norm_fn": norm.rmsnorm_fn}


def load_mamba_ssm_triton() -> dict | None:
    """mamba-ssm's Triton Mamba-2 scan and gated RMSNorm: {"scan_fn": mamba_chunk_scan_combined, "norm_fn":
    rmsnorm_fn}, or None when no mamba-ssm sources are found (`mamba_ssm_package_dir`). Loaded once per process;
    nothing named `mamba_ssm` is left in sys.modules by it. Raises ImportError when the sources do not import
    (e.g. no triton)."""
    package = mamba_ssm_package_dir()
    return None if package is None else _load(package.resolve())


def have_fla_conv() -> bool:
    """True when fla-core's Triton causal_conv1d imports."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
    except Exception:  # ImportError, or an error from a build for another torch / Triton
        return False
    return True


# The conv offsets of the packed row running now (set by omni_model.OmniModel.forward from the batch's host-side
# cu_seqlens_padded, so the conv needs no host read): (seq_idx [1, T] as megatron's mixer passes it, cu_seqlens int32
# [S+1] and fla's chunk_indices int64 [NT, 2] on the step's device). None: derived from seq_idx (one host read).
CONV_OFFSETS: contextvars.ContextVar = contextvars.ContextVar("omni_mamba_conv_offsets", default=None)


def conv_chunk_indices(cu_seqlens: list[int]) -> torch.Tensor:
    """fla-core's chunk_indices of a packed row, int64 [NT, 2] on the CPU: (sequence, chunk within it) for every
    FLA_CHUNK-token chunk of every sequence, from host offsets (fla.ops.utils.prepare_chunk_indices' layout)."""
    rows = [
        (s, c) for s in range(len(cu_seqlens) - 1) for c in range(-(-(cu_seqlens[s + 1] - cu_seqlens[s]) // FLA_CHUNK))
    ]
    return torch.tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, 2)


def _offsets(seq_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row = CONV_OFFSETS.get()
    if row is not None and row[0] is seq_idx:
        return row[1], row[2]
    T = seq_idx.shape[-1]
    starts = torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1  # a host read: sizes the result
    cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), T)]).to(torch.int32)
    return cu, conv_chunk_indices(cu.tolist()).to(seq_idx.device)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """mamba_torch.causal_conv1d_fn's call on fla-core's Triton causal_conv1d: out[b, d, t] = act(bias[d] +
    Σ_k weight[d, k] · x[b, d, t - (W-1) + k]), taps reaching another sequence (another seq_idx) reading 0.

    Args: x [batch, dim, seqlen] (a transposed channel-last tensor, as the mixer's split gives it, costs no copy);
        weight [dim, W]; bias [dim] or None; seq_idx [1, seqlen] int, non-decreasing (batch 1), or None;
        activation None, "silu" or "swish".
    Returns: [batch, dim, seqlen] in x.dtype (fla accumulates in float32).
    """
    from fla.modules.causal_conv1d import causal_conv1d

    assert activation in (None, "silu", "swish"), activation
    if seq_idx is None:
        y, _ = causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation)
    else:
        assert x.shape[0] == 1 and seq_idx.shape == (1, x.shape[-1]), (tuple(x.shape), tuple(seq_idx.shape))
        cu, chunks = _offsets(seq_idx)
        y, _ = causal_conv1d(
            x.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu, chunk_indices=chunks
        )
    return y.transpose(1, 2)


def kernels() -> dict:
    """{"conv_fn", "scan_fn", "norm_fn"}: fla-core's conv and mamba-ssm's Triton scan and norm, the keywords of
    mamba_torch's composed functions. Raises ImportError when either library is missing."""
    scan_norm = load_mamba_ssm_triton()
    if scan_norm is None:
        raise ImportError(f"no mamba-ssm sources: install mamba-ssm built without CUDA or set {MAMBA_SSM_SRC_ENV}")
    if not have_fla_conv():
        raise ImportError("fla-core's causal_conv1d does not import (pip install fla-core)")
    return {"conv_fn": causal_conv1d_fn, **scan_norm}


def mamba_split_conv1d_scan_combined(*args, **kwargs):
    """mamba_torch.mamba_split_conv1d_scan_combined (same arguments) on `kernels()`: the fused mixer body megatron's
    MambaMixer calls in training, with the `mamba triton` set."""
    import mamba_torch

    return mamba_torch.mamba_split_conv1d_scan_combined(*args, **kwargs, **kernels())
