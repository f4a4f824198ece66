"""Mamba-2 kernels in pure Triton for a GPU without compiled mamba-ssm: mamba-ssm's Triton scan and gated norm from
its sources (`load_mamba_ssm_triton`) and fla-core's Triton conv (`causal_conv1d_fn`), as `kernels()` for mamba_torch.
The candidate portable scan: Mamba-2's chunked scan as a simple-GLA recurrence (`mamba_chunk_scan_via_simple_gla`,
for fla-core's `chunk_simple_gla`; `fla_refusal` says where fla-core refuses to run), evaluated by the benchmark and
tests/test_gpu.py, not used for training.
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
    """The `mamba_ssm/` sources ($OMNI_MAMBA_SSM_SRC, else the installed package's) or None."""
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
        # The package's module made from its spec but not executed; afterwards every `mamba_ssm*` entry is taken out
        # of sys.modules again (and any earlier one put back), so no partial package stays importable by that name.
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
    """{"scan_fn", "norm_fn"} from mamba-ssm's Triton sources (None without them), loaded without running the
    package's `__init__`, which imports the compiled extension."""
    package = mamba_ssm_package_dir()
    return None if package is None else _load(package.resolve())


def have_fla_conv() -> bool:
    """True when fla-core's Triton causal_conv1d imports."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d  # noqa: F401
    except Exception:  # ImportError, or an error from a build for another torch / Triton
        return False
    return True


# The conv offsets of the packed row running now, set by OmniModel.forward from host-side offsets so the conv reads
# nothing back: (seq_idx [1, T] as megatron passes it, cu_seqlens int32 [S+1], chunk_indices int64 [NT, 2]).
# None: derived from seq_idx (one host read).
CONV_OFFSETS: contextvars.ContextVar = contextvars.ContextVar("omni_mamba_conv_offsets", default=None)


def conv_chunk_indices(cu_seqlens: list[int]) -> torch.Tensor:
    """fla-core's chunk_indices of a packed row: int64 [NT, 2], (sequence, chunk) per FLA_CHUNK tokens."""
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
    """mamba_torch.causal_conv1d_fn (seq_idx only for batch 1) on fla-core's Triton causal_conv1d."""
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
    """{"conv_fn", "scan_fn", "norm_fn"} of this set; ImportError when either library is missing."""
    scan_norm = load_mamba_ssm_triton()
    if scan_norm is None:
        raise ImportError(f"no mamba-ssm sources: install mamba-ssm built without CUDA or set {MAMBA_SSM_SRC_ENV}")
    if not have_fla_conv():
        raise ImportError("fla-core's causal_conv1d does not import (pip install fla-core)")
    return {"conv_fn": causal_conv1d_fn, **scan_norm}


def mamba_split_conv1d_scan_combined(*args, **kwargs):
    """mamba_torch.mamba_split_conv1d_scan_combined on `kernels()`."""
    from backend import mamba_torch

    return mamba_torch.mamba_split_conv1d_scan_combined(*args, **kwargs, **kernels())


def fla_refusal(device: torch.device) -> str | None:
    """Why fla-core's chunk_simple_gla does not run on `device`, or None: fla refuses Triton >= 3.4.0 and < 3.7.1 on
    Hopper (sm90) GPUs itself (a Triton code-generation bug in its gated chunk backward, fla-core issue #640)."""
    import triton

    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and (3, 4) <= version < (3, 7, 1):
        return f"fla-core refuses Triton {triton.__version__} on Hopper (needs >= 3.7.1)"
    return None


def mamba_chunk_scan_via_simple_gla(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    gla=None,
) -> torch.Tensor:
    """mamba_torch.mamba_chunk_scan_combined's forward as a simple-GLA recurrence (one scalar decay per head): q = C,
    k = B (groups repeated over their heads), v = dt·x, log-decay g = dt·A, scale 1, then + D·x and · silu(z).
    gla(q [1,T,H,N], k [1,T,H,N], v [1,T,H,P], g [1,T,H] fp32, cu_seqlens [S+1] int64 or None) returns o_t = q_t · S_t,
    S_t = exp(g_t) S_{t-1} + k_t^T v_t (e.g. fla-core's `chunk_simple_gla`); chunk_size is unused. Packed rows
    (seq_idx) need batch 1. Returns out [batch, seqlen, nheads, headdim] in x.dtype."""
    from backend import mamba_torch

    b, seqlen, h, p = x.shape
    r = h // B.shape[2]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtf = mamba_torch.processed_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    cu = None
    if seq_idx is not None:
        if b != 1:
            raise ValueError(f"packed sequences (seq_idx) need batch 1, got {b}")
        counts = torch.unique_consecutive(seq_idx[0], return_counts=True)[1]
        cu = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))
    q, k = C.repeat_interleave(r, dim=2), B.repeat_interleave(r, dim=2)
    v = (x.to(cdt) * dtf[..., None]).to(x.dtype)
    o = gla(q, k, v, dtf * A.to(cdt), cu).to(cdt)
    if D is not None:
        o = o + x.to(cdt) * (D.to(cdt)[:, None] if D.dim() == 1 else D.to(cdt))
    if z is not None:
        o = o * torch.nn.functional.silu(z.to(cdt))
    return o.to(x.dtype)
