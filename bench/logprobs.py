"""Item 3, logprobs: per-token log-probs of T x V fp32 logits: mpo_loss.token_logprobs (chunked) vs the naive
log_softmax(logits.float()).gather; peak additional memory of forward+backward and time; values and gradients must
match to 1e-5 (asserted).

Memory method: a child process (`python -m bench --logprobs-worker`) with glibc's mmap threshold pinned to 64 KiB
(MALLOC_MMAP_THRESHOLD_) so that every tensor buffer is its own mmap, returned to the kernel when freed; the kernel's
peak resident set (VmHWM, reset through /proc/self/clear_refs) over the call minus the resident set before it is the
peak additional memory. Deterministic to a few pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from bench.common import ROOT, VALUE_TOL

MEMORY_GOAL = 4.0  # goal: >= 4x less peak memory for the fused log-probs ...
TIME_GOAL = 1.3  # ... at <= 1.3x the time


def _status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM to the current resident set
    except OSError as e:
        raise RuntimeError(f"cannot reset the peak resident set through /proc/self/clear_refs ({e}): the log-prob "
                           "memory measurement needs Linux >= 4.0 with a writable /proc") from e


def _measure(fn) -> tuple[int, float]:
    """(peak additional resident bytes, seconds) of fn()."""
    _reset_peak_rss()
    base = _status_bytes("VmRSS")
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    return _status_bytes("VmHWM") - base, dt


def logprobs_worker(T: int, V: int, chunk: int, reps: int) -> dict:
    """Run in the child process: both paths `reps` times each (interleaved), then the value check.

    As in training, the logits are the output of an LM head (`h @ W^T`, K = 16 hidden units so the head itself is
    small): they exist before the measurement starts (both paths get the same input), and the backward ends in the
    head's gradients dh, dW, so "additional memory" is everything the log-prob forward + backward allocates beyond the
    logits, including the [T, V] logits gradient the naive backward hands to the head.
    """
    import mpo_loss

    K = 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, K, generator=g) / K**0.25  # unit-scale logits (an initialised LM head's)
    W = torch.randn(V, K, generator=g) / K**0.25
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::97] = -100  # padding positions: log-prob 0, no gradient, on both paths
    w = torch.randn(T, generator=g)
    valid = labels >= 0

    def ours(x):  # as train.py calls it: the logits' gradient is written into the logits buffer
        return mpo_loss.token_logprobs(x, labels, None, chunk, inplace_backward=True)

    def naive(x):
        lp = torch.log_softmax(x.float(), dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        return torch.where(valid, lp, torch.zeros((), dtype=lp.dtype))

    res = {"ours": {"peak_bytes": [], "seconds": []}, "naive": {"peak_bytes": [], "seconds": []}}
    kept = {}
    for rep in range(reps):
        for name, f in (("naive", naive), ("ours", ours)):
            hh, ww = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
            x = hh @ ww.T  # [T, V] logits with the head's graph, made before the measurement
            out = {}

            def run(x=x, f=f, out=out):
                y = f(x)
                (y * w).sum().backward()
                out["y"] = y.detach()

            peak, dt = _measure(run)
            res[name]["peak_bytes"].append(peak)
            res[name]["seconds"].append(dt)
            if rep == reps - 1:
                kept[name] = (out["y"], hh.grad, ww.grad)
            del x, out, hh, ww
    (y_o, dh_o, dw_o), (y_n, dh_n, dw_n) = kept["ours"], kept["naive"]
    # float64 reference of the values, chunk by chunk (no autograd): how far each fp32 path is from the exact value
    exact = torch.cat([torch.log_softmax(h[s:s + chunk].double() @ W.double().T, -1).gather(-1, labels[s:s + chunk]
                       .clamp(min=0)[:, None])[:, 0] for s in range(0, T, chunk)]).masked_fill(~valid, 0.0)
    res["values_ours_vs_fp64"] = (y_o.double() - exact).abs().max().item()
    res["values_naive_vs_fp64"] = (y_n.double() - exact).abs().max().item()
    res["values_max_abs_diff"] = (y_o - y_n).abs().max().item()
    # the head's gradients sum over T tokens or V classes: compare them relative to their largest entry
    res["grads_max_rel_diff"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((dh_o, dh_n),
                                                                                             (dw_o, dw_n)))
    res["logits_bytes"] = T * V * 4
    return res


def bench_logprobs(quick: bool) -> dict:
    """Chunked vocab-parallel log-probs vs the naive path: memory, time, values (child process, see the module's
    docstring)."""
    T, V, chunk, reps = (2048, 32768, 256, 3) if quick else (4096, 131072, 1024, 5)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench", "--logprobs-worker", str(T), str(V), str(chunk), str(reps)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"log-prob worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["values_max_abs_diff"] <= VALUE_TOL, f"logprobs: values differ by {r['values_max_abs_diff']}"
    assert r["grads_max_rel_diff"] <= VALUE_TOL, f"logprobs: gradients differ by {r['grads_max_rel_diff']} (relative)"
    assert r["values_ours_vs_fp64"] <= VALUE_TOL, f"logprobs: ours is {r['values_ours_vs_fp64']} from float64"
    peak_o, peak_n = max(r["ours"]["peak_bytes"]), max(r["naive"]["peak_bytes"])
    t_o, t_n = min(r["ours"]["seconds"]), min(r["naive"]["seconds"])  # see interleaved_times
    grad = r["logits_bytes"]
    return {"T": T, "V": V, "chunk_size": chunk, "reps": reps, "logits_bytes": grad, "peak_bytes_ours": peak_o,
            "peak_bytes_naive": peak_n, "peak_bytes_all_reps": {k: r[k]["peak_bytes"] for k in ("ours", "naive")},
            # the naive backward allocates the [T, V] logits gradient (which the LM head needs) on top of its
            # working memory; ours writes that gradient into the logits buffer, so its peak is working memory only
            "memory_ratio": peak_n / peak_o, "working_bytes_naive": peak_n - grad,
            "working_memory_ratio": (peak_n - grad) / max(peak_o, 1), "seconds_ours": t_o,
            "seconds_naive": t_n, "time_ratio": t_o / t_n, "values_max_abs_diff": r["values_max_abs_diff"],
            "grads_max_rel_diff": r["grads_max_rel_diff"], "values_ours_vs_fp64": r["values_ours_vs_fp64"],
            "values_naive_vs_fp64": r["values_naive_vs_fp64"]}
