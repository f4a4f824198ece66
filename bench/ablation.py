"""The GPU item's "ablation" section (--ablation): the MPO step with the kernel line's set, then with each fast kernel
(varlen attention, grouped experts, a Triton or mamba-ssm Mamba set) swapped for its portable fallback, one at a
time: step time, tokens/s, MFU and the slowdown."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback

import torch

import pack
from bench.common import _release, _sync, error_record, write_results
from bench.gpu_step import _drop_system, _ours_system, _step_setup

# The kernels of the kernel line that have a portable fallback to swap in at run time: kernel -> (selected, fallback).
FALLBACKS = {"attention": ("varlen", "sdpa"), "experts": ("grouped", "loop"), "mamba": (("triton", "mamba-ssm"),
                                                                                              "torch")}


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """local_spec.grouped_mm as SequentialMLP computes it: rows offs[e-1]:offs[e] of a [T, K] times b[e] [K, N], one
    matmul per expert in a Python loop (the counts read on the host, as SequentialMLP does)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    return torch.cat([x @ w for x, w in zip(a.split(counts), b.unbind(0), strict=True)])


def fallbacks(kernels) -> dict[str, str]:
    """{kernel: "selected -> fallback"} for the entries of `kernels` (kernel_selection.Kernels) that `fallback` can
    swap back at run time (the local spec's varlen attention and grouped experts, a Triton or mamba-ssm Mamba set)."""
    out = {}
    for name, (fast, slow) in FALLBACKS.items():
        have = getattr(kernels, name)
        if have in (fast if isinstance(fast, tuple) else (fast,)):
            out[name] = f"{have} -> {slow}"
    return out


@contextlib.contextmanager
def fallback(models, which: str):
    """Run `models` with one kernel swapped for its portable fallback: "attention" -> one SDPA call per sequence
    (local_spec.ThdDotProductAttention.attention = "sdpa"), "experts" -> one matmul per expert in a Python loop
    (`grouped_mm_loop`, SequentialMLP's loop), "mamba" -> mamba_torch's conv, scan and gate under
    megatron_patches' scan hook (megatron's MambaMixer looks the fused call up at each call; its gated RMSNorm,
    built with the model, stays the set's)."""
    from backend import local_spec, mamba_torch, megatron_patches

    mods = list({id(m): m for model in models for m in model.modules()}.values())
    if which == "attention":
        attn = [m for m in mods if isinstance(m, local_spec.ThdDotProductAttention)]
        saved = [m.attention for m in attn]
        for m in attn:
            m.attention = "sdpa"
        try:
            yield
        finally:
            for m, a in zip(attn, saved, strict=True):
                m.attention = a
    elif which == "experts":
        grouped = local_spec.grouped_mm
        try:
            local_spec.grouped_mm = grouped_mm_loop
            yield
        finally:
            local_spec.grouped_mm = grouped
    elif which == "mamba":
        from megatron.core.ssm import mamba_mixer

        hooked = mamba_mixer.mamba_split_conv1d_scan_combined
        try:
            mamba_mixer.mamba_split_conv1d_scan_combined = mamba_torch.mamba_split_conv1d_scan_combined
            megatron_patches.install_mamba_scan_hook()  # the dt limit and the shared-prompt branch, as for any set
            yield
        finally:
            mamba_mixer.mamba_split_conv1d_scan_combined = hooked
    else:
        raise ValueError(f"no fallback for {which!r}; one of {sorted(FALLBACKS)}")


def kernel_ablation(device, shape: dict, timed: int, out: dict | None = None) -> dict:
    """The step of mpo_step_bench (ours, separate sequences) on one built system with the kernel line's set, then with
    each of its fast kernels swapped for its portable fallback (`fallback`), one at a time: per variant the step seconds
    (min of `timed` steps after one warm-up step), tokens/s and MFU, and the fallback's step time over the set's
    ("slowdown"); a variant that fails is {"error": ...} and the next one runs. `out` (run_section's entry) is
    filled and written as each variant ends. Raises when the set's own step fails."""
    import monitor
    import omni_model as om
    import train
    from backend import kernel_selection

    device = torch.device(device)
    out = {} if out is None else out
    setup = _step_setup(device, shape)
    cfg, pairs, ids = setup["cfg"], setup["pairs"], setup["ids"]
    tokens = sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in pairs.values())
    kernels = kernel_selection.select_kernels(cuda=device.type == "cuda", dtype=om.torch_dtype(shape["dtype"]))
    out.update(kernels=kernels.line(), tokens=tokens, fallbacks=fallbacks(kernels))
    ddp, reference, optimizer, scheduler, ctx, policy = _ours_system(device, cfg, setup["ckpt"])
    n_active = monitor.active_params(policy, setup["hf"])
    plan = pack.plan_step(setup["lengths"], cfg.packing, 1)
    state = {"shift": cfg.mpo.reward_shift}

    def step() -> float:
        batches = pack.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
        _sync(device)
        t = time.perf_counter()
        state["shift"] = train.train_step(ddp, reference, optimizer, scheduler, batches, ctx, state["shift"])[1]
        _sync(device)
        return time.perf_counter() - t

    try:
        for variant in ["selected", *out["fallbacks"]]:
            try:
                with fallback([policy, reference], variant) if variant != "selected" else contextlib.nullcontext():
                    step()  # warm-up: Triton compilation, allocations
                    s = min(step() for _ in range(timed))
            except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
                if variant == "selected":
                    raise
                traceback.print_exc()
                out[variant] = error_record(e)
                _release(device)
                continue
            out[variant] = {"step_s": s, "tokens_per_s": tokens / s,
                            "mfu": monitor.mfu(tokens, s, n_active, 1) if device.type == "cuda" else None}
            if variant != "selected":
                out[variant]["slowdown"] = s / out["selected"]["step_s"]
            print(f"[bench] gpu ablation {variant} {json.dumps(out[variant])}", file=sys.stderr, flush=True)
            write_results()
    finally:
        _drop_system(ddp)
    failed = [v for v in out["fallbacks"] if "error" in out[v]]
    if failed:  # the section fails (exit status 1); run_section keeps the variants recorded above
        raise RuntimeError(f"kernel ablation: {', '.join(failed)} failed")
    return out


def ablation_rows(ab: dict) -> list[tuple[str, ...]]:
    """The table rows of kernel_ablation's result: per fallback the step time and MFU against the kernel line's set
    (the variants that ended; the error, if any)."""
    def mfu(r):
        return f" (MFU {100 * r['mfu']:.1f}%)" if r.get("mfu") is not None else ""

    rows = [("kernel ablation", "failed", ab["error"][:100], "", "")] if "error" in ab else []
    sel = ab.get("selected")
    for name, swap in ab.get("fallbacks", {}).items():
        if sel is not None and "error" in ab.get(name, {}):
            rows.append((f"kernel ablation: {name} {swap}", "failed", ab[name]["error"][:100], "", ""))
        elif sel is not None and name in ab:
            r = ab[name]
            rows.append((f"kernel ablation: {name} {swap}", f"step time ({ab['tokens']} tokens)",
                         f"{sel['step_s'] * 1e3:.0f} ms{mfu(sel)}", f"{r['step_s'] * 1e3:.0f} ms{mfu(r)}",
                         f"{r['slowdown']:.2f}x the time"))
    if sel is not None and not ab.get("fallbacks"):
        rows.append(("kernel ablation", "step time", f"{sel['step_s'] * 1e3:.0f} ms{mfu(sel)}", "",
                     "no fast kernel on the kernel line"))
    return rows
