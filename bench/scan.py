"""The GPU item's "scan" section: the Mamba-2 chunked scan's forward + backward of every kernel usable here
(mamba_torch; mamba-ssm's Triton kernel, compiled package or sources; fla-core's simple-GLA kernel through
mamba_triton.mamba_chunk_scan_via_simple_gla) at the Nano layer shape, the first call (Triton autotuning) apart."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import torch

from backend import mamba_triton
from bench.common import TINY, _peak_memory, _reset_peak, _sync, error_record


def mamba_scan_kernels(device: torch.device) -> dict:
    """The Mamba-2 chunked-scan implementations usable here: {name: mamba_chunk_scan_combined}. mamba_torch always;
    with CUDA, mamba-ssm's Triton kernel when it imports (mamba_ssm_importable) or, without the compiled
    package, from its sources ("mamba-ssm-src", mamba_triton.load_mamba_ssm_triton), and fla-core's Triton simple-GLA
    kernel through mamba_triton.mamba_chunk_scan_via_simple_gla when `fla` imports (the portable candidate of issue
    12, evaluated by tests/test_gpu.py against mamba_torch; not used for training)."""
    import functools

    from backend import kernel_selection, mamba_torch

    kernels = {"torch": mamba_torch.mamba_chunk_scan_combined}
    if device.type == "cuda" and kernel_selection.mamba_ssm_importable():
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        kernels["mamba-ssm"] = mamba_chunk_scan_combined
    elif device.type == "cuda" and (source := mamba_triton.load_mamba_ssm_triton()) is not None:
        kernels["mamba-ssm-src"] = source["scan_fn"]
    if device.type == "cuda":
        try:
            from fla.ops.simple_gla import chunk_simple_gla
        except Exception:  # not installed, or a build for another torch / Triton
            chunk_simple_gla = None
        if chunk_simple_gla is not None and mamba_triton.fla_refusal(device) is None:
            def gla(q, k, v, g, cu):
                return chunk_simple_gla(q, k, v, g=g, scale=1.0, cu_seqlens=cu)[0]

            kernels["fla"] = functools.partial(mamba_triton.mamba_chunk_scan_via_simple_gla, gla=gla)
    return kernels


def scan_inputs(device, T: int, n_seq: int, heads: int, head_dim: int, groups: int, d_state: int, dtype,
                seed: int = 0) -> dict:
    """Inputs of one packed Mamba-2 scan: x [1,T,h,p], dt [1,T,h], A [h], B/C [1,T,g,n], D [h], z [1,T,h,p], dt_bias
    [h], seq_idx [1,T] int32 of `n_seq` near-equal sequences (float inputs require grad)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.linspace(0, T, n_seq + 1).long()
    seq_idx = torch.repeat_interleave(torch.arange(n_seq, dtype=torch.int32), torch.diff(cuts))[None]
    t = {"x": torch.randn(1, T, heads, head_dim, generator=g), "dt": torch.randn(1, T, heads, generator=g) - 1.0,
         "B": torch.randn(1, T, groups, d_state, generator=g), "C": torch.randn(1, T, groups, d_state, generator=g),
         "z": torch.randn(1, T, heads, head_dim, generator=g)}
    fixed = {"A": -torch.rand(heads, generator=g) - 0.5, "D": torch.randn(heads, generator=g),
             "dt_bias": torch.randn(heads, generator=g) * 0.1}
    out = {k: v.to(device=device, dtype=dtype).requires_grad_(True) for k, v in t.items()}
    out.update({k: v.to(device) for k, v in fixed.items()})
    out["seq_idx"] = seq_idx.to(device)
    return out


def run_scan(kernel, inp: dict, chunk_size: int, grad_out: torch.Tensor | None = None):
    """Forward (+ backward with `grad_out`) of one scan with dt softplus, dt_limit (0.001, inf), D and z, as
    megatron's mixer calls it. Returns (y, {name: grad of x, dt, B, C, z})."""
    for k in ("x", "dt", "B", "C", "z"):
        inp[k].grad = None
    y = kernel(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, D=inp["D"], z=inp["z"],
               dt_bias=inp["dt_bias"], dt_softplus=True, seq_idx=inp["seq_idx"], dt_limit=(0.001, float("inf")))
    grads = {}
    if grad_out is not None:
        y.backward(grad_out)
        grads = {k: inp[k].grad for k in ("x", "dt", "B", "C", "z")}
    return y, grads


def scan_bench(device, shape: dict, reps: int) -> dict:
    """Mamba-2 scan fwd+bwd time of every available kernel at the Nano layer shape (64 heads x 64, 8 groups, d_state
    128, chunk 128) on shape["scan_tokens"] tokens in shape["scan_sequences"] packed sequences, bf16 on CUDA (fp32
    on the CPU). The first call (Triton compiles and autotunes there) is reported apart from the min of `reps`. A
    kernel that raises is recorded as {"error": "Type: message"} and the others still run; each kernel's result is
    printed on stderr as it ends (`[bench] gpu scan NAME {...}`: a run killed at a time limit keeps them).
    MAMBA_DETERMINISTIC (mamba-ssm's fixed Triton configs, set by tests/gpu_check.sh) is recorded."""
    device = torch.device(device)
    llm = {**json.loads((TINY / "config.json").read_text())["llm_config"], **shape["llm"]}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = dict(heads=llm["mamba_num_heads"], head_dim=llm["mamba_head_dim"], groups=llm["n_groups"],
                d_state=llm["ssm_state_size"])
    T, n_seq, chunk = shape["scan_tokens"], shape["scan_sequences"], llm["chunk_size"]
    inp = scan_inputs(device, T, n_seq, dtype=dtype, **dims)
    grad_out = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out = {"tokens": T, "sequences": n_seq, "chunk_size": chunk, "dtype": str(dtype).removeprefix("torch."), **dims,
           "mamba_deterministic": os.environ.get("MAMBA_DETERMINISTIC")}
    if importlib.util.find_spec("fla") is not None and (reason := mamba_triton.fla_refusal(device)) is not None:
        out["fla"] = {"skipped": reason}
    for name, kernel in mamba_scan_kernels(device).items():
        try:
            _reset_peak(device)
            _sync(device)
            t = time.perf_counter()
            run_scan(kernel, inp, chunk, grad_out)
            _sync(device)
            first = time.perf_counter() - t
            times = []
            for _ in range(reps):
                _sync(device)
                t = time.perf_counter()
                run_scan(kernel, inp, chunk, grad_out)
                _sync(device)
                times.append(time.perf_counter() - t)
            out[name] = {"first_call_s": first, "fwd_bwd_s": min(times), "peak_bytes": _peak_memory(device)}
        except Exception as e:  # noqa: BLE001 - an optional kernel (a Triton build, an out-of-memory): recorded
            out[name] = error_record(e)
        print(f"[bench] gpu scan {name} {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return out


def scan_rows(sc: dict) -> list[tuple[str, ...]]:
    """The table rows of `scan_bench`'s result: per kernel its fwd+bwd time (first call apart), or its error."""
    rows = []
    fixed = " (fixed configs)" if sc.get("mamba_deterministic") == "1" else ""
    for name in ("torch", "mamba-ssm", "mamba-ssm-src", "fla"):
        if name in sc and "skipped" in sc[name]:
            rows.append((f"Mamba-2 scan {name}", "fwd+bwd", "skipped", sc[name]["skipped"][:100], ""))
        elif name in sc and "error" in sc[name]:
            rows.append((f"Mamba-2 scan {name}, T={sc['tokens']} {sc['dtype']}", "fwd+bwd", "failed",
                         sc[name]["error"][:100], ""))
        elif name in sc:
            label = name + (fixed if name.startswith("mamba-ssm") else "")
            rows.append((f"Mamba-2 scan {label}, T={sc['tokens']} {sc['dtype']}", "fwd+bwd (first call)",
                         f"{sc[name]['fwd_bwd_s'] * 1e3:.1f} ms", f"{sc[name]['first_call_s']:.2f} s", ""))
    return rows
