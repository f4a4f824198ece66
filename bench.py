"""Measured performance of omni-mpo against the baselines a user would otherwise pick, side by side, as ratios.

    python bench.py            # everything below; prints one table, writes bench_results.json (README's table)
    python bench.py --quick    # reduced sizes, about 1 min (57 s on 2 shared CPU cores; tests/test_bench.py runs it)
    python bench.py --only packing,logprobs --json out.json
    python bench.py --print    # the table of bench_results.json (or --print FILE)
    python bench.py --gpu --profile   # the GPU item alone (CUDA), with the step's device time by region

Only a full run of every item writes bench_results.json by default; a --quick or --only run writes
results/bench_results.json (git-ignored) unless --json says otherwise, so it never replaces the committed full results.

Items (each a function `bench_<name>(quick) -> dict`, recorded under its name in the JSON):
1. packing   pack.py on a synthetic MMPR-like step (256 pairs, 8 DP ranks): (a) our pair-atomic THD bins with greedy
             balancing, (b) the same bins dealt round-robin, (c) unpacked microbatches of one pair padded to its
             longer row (the reference system's non-packed path). Useful-token fraction, busiest rank's token share,
             padding compute of (c) against (a). Pure arithmetic on token counts: exact, not timed.
2. vision    one pair through the Omni model with the image encoded once and shared by chosen and rejected vs
             encoded once per row: vision tower + projector time per pair, whole forward+backward time; the logits
             and every gradient must match (asserted).
3. logprobs  per-token log-probs of T x V fp32 logits: mpo_loss.token_logprobs (chunked) vs the naive
             log_softmax(logits.float()).gather; peak additional memory of forward+backward and time; values and
             gradients must match to 1e-5 (asserted). Memory method: a child process with glibc's mmap threshold
             pinned to 64 KiB (MALLOC_MMAP_THRESHOLD_) so that every tensor buffer is its own mmap, returned to the
             kernel when freed; the kernel's peak resident set (VmHWM, reset through /proc/self/clear_refs) over the
             call minus the resident set before it is the peak additional memory. Deterministic to a few pages.
4. train     one MPO optimizer step on the shipped sample with a small Omni config generated here (hidden 256, 8 layers
             M*EM-M*E, ViT 2 blocks): ours (train.train_step: packed THD microbatches, reference forward without grad,
             vision once per pair, megatron DDP + Adam) vs transformers' NemotronH_Omni_Reasoning_V3 with the same
             weights doing the conventional step (each pair a padded [2, L] batch, the image once per row, policy and
             reference forwards, log_softmax+gather, torch Adam). Same step-1 loss to 1e-4 and gradient norm to 1e-4
             relative (asserted); pairs/s, tokens/s and the speed ratio. Also, interleaved with them on the same bins:
             our step with the reference's sums stored (reference.logprobs = "precomputed": no reference forward; the
             stored sums equal the forward's, asserted) and the reference pass alone (reference_logprobs.score).
4b. shared   the shared-prompt pair layout (packing.shared_prompt) vs separate rows, same pairs and bin budget:
             LM tokens computed for 10,000 MMPR-like pairs (exact arithmetic), and one MPO step (train.train_step,
             small config) on 8 MMPR-like text pairs at full length (--quick: lengths / 16): pairs/s and the
             ratio; the step-1 loss of both layouts must agree to 1e-5 (asserted).
5. data      mmpr_index.build_index of the sample repeated to ~5,000 rows (fresh build vs cache load) and pairs/s of
             image decoding + processing (PairDataset) through a DataLoader with 0 and 2 workers.
6. gpu       only with CUDA (`--gpu` runs it alone, into bench_gpu_results.json; a skip record otherwise): one MPO
             step of a Nano-width model at reduced depth (hidden 2688, pattern MEM*EM, Mamba 64x64 heads, 8 groups,
             d_state 128, attention 32/2 heads of 128, 128 experts top-6 of 1856 + shared 3712, vocabulary 131072,
             bf16, random weights) on 16 MMPR-like text pairs packed 4 per bin vs transformers' padded per-pair step:
             tokens/s, pairs/s, MFU, peak memory, step-1 losses and their deviation from the ln 2 closed form next to
             the noise floor measured in the same run (asserted on the CPU only: GPU kernels are not deterministic);
             the Mamba-2 scan fwd+bwd of every available kernel at T = 16384 (first call, with Triton autotuning,
             reported apart); with --profile, torch.profiler's device time of one step by region (profile_step);
             with --ablation, the step with each fast kernel swapped back to its fallback (kernel_ablation).

7. grads     optimizer.grad_reduce_in_fp32: the tiny model's gradient (bf16 parameters, the MPO loss at step 1) after
             1, 16 and 256 microbatches of one pair (--quick: 1, 4, 8) summed in bf16 and in fp32 gradient buffers,
             against the float64 sum of the same microbatch gradients: relative L2, max-abs and median errors
             (grad_accumulation); megatron DDP's buffers of either setting equal the measured sums (asserted).

Timings on a shared CPU are noisy: read ratios from one run, not absolute times. Memory and value equalities are exact.
Errors: an equality that does not hold raises AssertionError naming the item and both values. Each item (and each
section of the GPU item) is written to the JSON as it ends, a failed one as {"error": "Type: message"}; the later
ones still run, and the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import pack  # noqa: E402
import shared_prompt  # noqa: E402

ROOT = Path(__file__).resolve().parent
TINY = ROOT / "assets" / "tiny-omni"
SAMPLE_META = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "meta.json"

VALUE_TOL = 1e-5  # the benchmark's acceptance: log-probs, vision-once-per-pair logits and gradients
LOSS_TOL = 1e-4  # step-1 loss of ours vs the transformers baseline
MEMORY_GOAL = 4.0  # goal: >= 4x less peak memory for the fused log-probs ...
TIME_GOAL = 1.3  # ... at <= 1.3x the time

# The small Omni config of items 2 and 4: every layer kind (M Mamba-2, * attention, E MoE, - dense MLP).
SMALL_LLM = dict(hidden_size=256, hybrid_override_pattern="M*EM-M*E", num_attention_heads=8, num_key_value_heads=2,
                 head_dim=32, mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=32, n_groups=2, chunk_size=64,
                 intermediate_size=768, moe_intermediate_size=256, moe_shared_expert_intermediate_size=512,
                 n_routed_experts=8, num_experts_per_tok=2)
SMALL_VIT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL_PROJECTOR_HIDDEN = 512


def interleaved_times(fns: dict, reps: int) -> dict[str, dict[str, float]]:
    """Wall times (seconds) of each fn over `reps` rounds, the fns called in turn within a round so that load from
    other processes hits all of them alike. Returns {name: {"min", "median"}}; ratios use the minimum, the estimate
    least inflated by contention on a shared machine."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # GPU work is asynchronous
    for _ in range(reps):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t)
    return {k: {"min": min(v), "median": statistics.median(v)} for k, v in times.items()}


def error_record(e: BaseException) -> dict:
    """How a failed section or kernel is recorded: {"error": "Type: first line of the message"} (<= 300 characters)."""
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def run_section(out: dict, key: str, fn, *args, **kwargs) -> bool:
    """out[key] = fn(*args, **kwargs) with its "bench_seconds", or, when fn raises, error_record (joined to what fn
    left in out[key]; the traceback on stderr). Then the results file is written (`_STATE["write"]`, set by main):
    a later time limit or failure keeps this section. Returns whether fn returned."""
    t = time.perf_counter()
    try:
        out[key] = fn(*args, **kwargs)
        ok = True
    except Exception as e:  # noqa: BLE001 - recorded; the later sections still run and the exit status says it
        traceback.print_exc()
        out[key] = {**out.get(key, {}), **error_record(e)}
        ok = False
    out[key]["bench_seconds"] = round(time.perf_counter() - t, 2)
    print(f"[bench] {key}: {out[key]['bench_seconds']} s{'' if ok else ', ' + out[key]['error']}", file=sys.stderr,
          flush=True)
    if "write" in _STATE:
        _STATE["write"]()
    return ok


# ======================================================================================================================
# 1. Packing


def synthetic_mmpr_parts(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int, int]]:
    """Pair id -> (prompt, chosen response, rejected response) tokens modelling MMPR rows for Nemotron-Omni.

    Prompt = one image of gh x gw 16-px patches (gh in 32..128, gw in 32..104, even; gh*gw/4 tokens after the 2x2
    pixel shuffle) + 40..72 text tokens; responses log-uniform in 50..1500, the rejected one the chosen length times
    exp(N(0, 0.3)), clipped to 50..1500. Deterministic for (n_pairs, seed).
    """
    rng = random.Random(seed)
    out = {}
    for i in range(n_pairs):
        gh, gw = 2 * rng.randint(16, 64), 2 * rng.randint(16, 52)
        prompt = gh * gw // 4 + rng.randint(40, 72)
        chosen = int(math.exp(rng.uniform(math.log(50), math.log(1500))))
        rejected = min(1500, max(50, int(chosen * math.exp(rng.gauss(0.0, 0.3)))))
        out[i] = (prompt, chosen, rejected)
    return out


def synthetic_mmpr_lengths(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int]]:
    """Pair id -> (chosen row, rejected row) tokens: the rows prompt + response of `synthetic_mmpr_parts`."""
    return {i: (p + c, p + r) for i, (p, c, r) in synthetic_mmpr_parts(n_pairs, seed).items()}


def deal_round_robin(bins, dp_size: int) -> list[list[pack.Bin]]:
    """Bin i to DP rank i % dp_size, in the given order (NeMo-RL's deal; the baseline)."""
    assert len(bins) % dp_size == 0
    return [list(bins[r::dp_size]) for r in range(dp_size)]


def round_robin_ranks(plan: pack.Plan, lengths) -> list[list[pack.Bin]]:
    """The bins of `plan` in the step's data order (their first pair's place in `lengths`, dummies last), dealt
    round-robin: the baseline of pack.deal_greedy."""
    arrival = {pid: i for i, pid in enumerate(lengths)}
    bins = [b for r in plan.ranks for b in r]
    return deal_round_robin(sorted(bins, key=lambda b: (b.dummy, min(arrival[p] for p in b.pair_ids))),
                            len(plan.ranks))


def rank_imbalance(ranks, key: str = "tokens") -> float:
    """Busiest rank's load / mean load over DP ranks (1.0 = perfect), load = sum of `key` ("tokens" or "cost")."""
    loads = [sum(getattr(b, key) for b in r) for r in ranks]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def shared_prompt_token_counts(parts, max_tokens_per_bin: int, max_sequences_per_bin: int, dp_size: int,
                               divisible_by: int = 1) -> dict:
    """Tokens the language model computes for the same pairs, separate rows vs the shared-prompt layout, each planned
    by pack.plan_bins under the same bin budget. parts: pair id -> (prompt, chosen, rejected) tokens
    (`synthetic_mmpr_parts`); the shared layout stores prompt - 1 tokens once. Returns tokens_* (padded, dummies
    included), useful_* (real), bins_* of both layouts and token_ratio = tokens_separate / tokens_shared."""
    lengths = {i: (p + c, p + r) for i, (p, c, r) in parts.items()}
    shared = {i: p - 1 for i, (p, _, _) in parts.items()}
    sep = pack.plan_bins(lengths, max_tokens_per_bin, max_sequences_per_bin, dp_size, divisible_by)
    shr = pack.plan_bins(lengths, max_tokens_per_bin, max_sequences_per_bin, dp_size, divisible_by,
                         shared_lengths=shared)

    def total(plan, key):
        return sum(getattr(b, key) for r in plan.ranks for b in r)

    out = {"tokens_separate": total(sep, "tokens"), "tokens_shared": total(shr, "tokens"),
           "useful_separate": total(sep, "useful"), "useful_shared": total(shr, "useful"),
           "bins_separate": sum(map(len, sep.ranks)), "bins_shared": sum(map(len, shr.ranks))}
    out["token_ratio"] = out["tokens_separate"] / out["tokens_shared"]
    return out


def bench_packing(quick: bool) -> dict:
    """Useful-token fraction and DP balance of three ways to lay out one MMPR-like step (exact token arithmetic).

    Setup: synthetic_mmpr_lengths(256, seed=0) (prompts ~300-3400 tokens, mostly image tokens; responses
    50-1500), 8 DP ranks, rows padded to a multiple of 8, bins of <= 10240 tokens, one pair per bin (the config's
    default); the same numbers in --quick (no cost to compute).
    """
    n_pairs, dp, cap, div = 256, 8, 10240, 8
    lengths = synthetic_mmpr_lengths(n_pairs, seed=0)
    useful = sum(c + r for c, r in lengths.values())

    def summary(ranks) -> dict:
        loads = [sum(b.tokens for b in r) for r in ranks]
        total = sum(loads)
        return {"tokens": total, "useful_fraction": useful / total, "busiest_rank_share": max(loads) / total,
                "busiest_rank_tokens": max(loads), "imbalance": rank_imbalance(ranks)}

    ours = pack.plan_bins(lengths, cap, 1, dp, divisible_by=div)
    rr = round_robin_ranks(ours, lengths)
    # (c): one pair per microbatch as a [2, L] batch, L = the longer row padded to the multiple; in data order,
    # dealt round-robin like the reference system.
    padded = []
    for pid, (c, r) in lengths.items():
        L = pack.padded_length(max(c, r), div)
        padded.append(pack.Bin(pair_ids=(pid,), tokens=2 * L, useful=c + r, cost=2 * pack.sequence_cost(L)))
    out = {"pairs": n_pairs, "dp": dp, "max_tokens_per_bin": cap, "divisible_by": div, "useful_tokens": useful,
           "ours": summary(ours.ranks), "round_robin": summary(rr),
           "padded": summary(deal_round_robin(padded, dp))}
    a, c = out["ours"], out["padded"]
    out["padding_compute_c_over_a"] = c["tokens"] / a["tokens"]  # processed tokens of (c) per token of (a)
    out["padding_wasted_fraction_c"] = 1 - c["useful_fraction"]
    out["padding_wasted_fraction_a"] = 1 - a["useful_fraction"]
    out["busiest_rank_c_over_a"] = c["busiest_rank_tokens"] / a["busiest_rank_tokens"]  # step-time proxy
    out["busiest_rank_b_over_a"] = out["round_robin"]["busiest_rank_tokens"] / a["busiest_rank_tokens"]
    return out


# ======================================================================================================================
# Shared set-up of items 2 and 4: an in-process world of size 1 and the small Omni checkpoints


_STATE: dict = {}


def _make_tiny_module():
    spec = importlib.util.spec_from_file_location("make_tiny_omni", ROOT / "assets" / "make_tiny_omni.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars ("Writing model shards", "Loading weights") off inside the block: bench.py's output
    is its table."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _tmp() -> Path:
    """This process's temporary folder of bench checkpoints (made on first use; main() removes it)."""
    if "tmp" not in _STATE:
        _STATE["tmp"] = Path(tempfile.mkdtemp(prefix="omni_bench_"))
    return _STATE["tmp"]


def small_checkpoint(name: str, seed: int) -> Path:
    """A hub-layout checkpoint folder of the small bench config (random weights from transformers' init, `seed`),
    with the tiny asset's tokenizer, chat template and processor. Written once per process into a temporary folder."""
    key = f"ckpt_{name}"
    if key in _STATE:
        return _STATE[key]
    out = _tmp() / name
    out.mkdir()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["llm_config"].update(SMALL_LLM)
    cfg["vision_config"].update(SMALL_VIT)
    cfg["vit_hidden_size"] = SMALL_VIT["hidden_size"]
    cfg["projector_hidden_size"] = SMALL_PROJECTOR_HIDDEN
    from safetensors.torch import save_file

    with no_progress_bars():  # build_weights writes the model with save_pretrained
        sd = _make_tiny_module().build_weights(cfg, seed)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": {k: "model.safetensors" for k in sd}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in TINY.iterdir():
        if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    _STATE[key] = out
    return out


def _processor(path: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def sample_pairs(model_dir: Path, n: int) -> tuple[dict, dict]:
    """The first n pairs of the shipped sample as pack.PreferencePair (decoded once), and {image, pad} token ids."""
    import mmpr_data
    import mmpr_index
    from config import Config

    proc = _processor(model_dir)
    cfg = Config()
    cfg.data.train.data_path = str(SAMPLE_META)
    index = mmpr_index.build_index(SAMPLE_META, proc, cfg.data, use_cache=False)
    if len(index) < n:
        raise ValueError(f"the sample has {len(index)} pairs, fewer than the {n} asked for")
    ds = mmpr_data.PairDataset(index, proc)
    ids = {"image": json.loads((model_dir / "config.json").read_text())["img_context_token_id"],
           "pad": proc.tokenizer.pad_token_id or 0}
    return {i: ds[i] for i in range(n)}, ids


def _build_ours(model_dir: Path):
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(model_dir, ModelConfig(), ParallelConfig())
    hf_weights.load_hf_weights(m, model_dir)
    return m


# ======================================================================================================================
# 2. Vision once per pair


def _device() -> torch.device:
    """The device items 2 and 4 run on: the current CUDA device when there is one (where build_model puts the model),
    else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _per_row_media(batch: pack.PackedBatch) -> dict:
    """The same packed pair with each row holding its own copy of the images (the reference system's layout)."""
    d = {k: getattr(batch, k) for k in ("input_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")}
    s = batch.num_sequences
    n_img = batch.image_grid_hw.shape[0]
    dev = batch.input_ids.device
    d.update(pixel_values=torch.cat([batch.pixel_values] * s), image_grid_hw=torch.cat([batch.image_grid_hw] * s),
             image_token_counts=torch.cat([batch.image_token_counts] * s), media_index=torch.arange(s, device=dev),
             media_image_offsets=torch.arange(s + 1, device=dev) * n_img)
    return d


def bench_vision(quick: bool) -> dict:
    """Vision tower + projector cost per pair, shared vs per row, and the equality of logits and gradients."""
    import distributed

    distributed.init_distributed(device=_device())
    model_dir = small_checkpoint("policy", seed=1234)
    pairs, ids = sample_pairs(model_dir, 1)
    model = _build_ours(model_dir).train()
    shared = pack.pack([pairs[0]], 8, ids["image"], ids["pad"]).to(_device())
    per_row = _per_row_media(shared)

    def fwd_bwd(batch):
        model.zero_grad(set_to_none=True)
        logits = model(batch)
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11)).to(logits.device)
        (logits * w).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    l1, g1 = fwd_bwd(shared)
    l2, g2 = fwd_bwd(per_row)
    logits_diff = (l1 - l2).abs().max().item()
    assert logits_diff <= VALUE_TOL, f"vision: shared vs per-row logits differ by {logits_diff}"
    assert set(g1) == set(g2) and any(n.startswith("vision_model.") for n in g1), "vision: gradient sets differ"
    grad_rel = max((g1[n] - g2[n]).abs().max().item() / max(g2[n].abs().max().item(), 1e-6) for n in g1)
    assert grad_rel <= VALUE_TOL, f"vision: shared vs per-row gradients differ by {grad_rel} (relative)"

    def encode(copies: int):
        model.zero_grad(set_to_none=True)
        feats = model.encode_images(torch.cat([shared.pixel_values] * copies),
                                    torch.cat([shared.image_grid_hw] * copies))
        torch.cat(feats).sum().backward()

    reps = 5 if quick else 15
    encode(1)  # warm-up
    t = interleaved_times({"once": lambda: encode(1), "twice": lambda: encode(2), "shared": lambda: fwd_bwd(shared),
                           "per_row": lambda: fwd_bwd(per_row)}, reps)
    t_once, t_twice, t_step_shared, t_step_per_row = (t[k]["min"] for k in ("once", "twice", "shared", "per_row"))
    return {"image_patches": int(shared.pixel_values.shape[0]), "image_tokens": int(shared.image_token_counts.sum()),
            "pair_tokens": int(shared.cu_seqlens[-1]), "logits_max_abs_diff": logits_diff,
            "grads_max_rel_diff": grad_rel, "vision_fwd_bwd_s_shared": t_once, "vision_fwd_bwd_s_per_row": t_twice,
            "vision_cost_ratio": t_twice / t_once, "pair_fwd_bwd_s_shared": t_step_shared,
            "pair_fwd_bwd_s_per_row": t_step_per_row, "pair_step_ratio": t_step_per_row / t_step_shared}


# ======================================================================================================================
# 3. Fused log-probs (measured in a child process, see the module docstring)


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
    """Chunked vocab-parallel log-probs vs the naive path: memory, time, values (child process, see module doc)."""
    T, V, chunk, reps = (2048, 32768, 256, 3) if quick else (4096, 131072, 1024, 5)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--logprobs-worker", str(T), str(V),
                           str(chunk), str(reps)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
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


# ======================================================================================================================
# 4. Training step: ours vs transformers' model doing the conventional MPO step


def _bench_cfg(model_dir: Path, n_pairs: int):
    from config import Config

    cfg = Config()
    cfg.model.hf_path = str(model_dir)
    cfg.mpo.sft_loss_weight = 1.0  # the MPO paper's weights 0.8 / 0.2 / 1.0: every term of the loss is exercised
    cfg.policy.train_global_batch_size = n_pairs
    cfg.policy.logprob_chunk_size = 1024
    # the config's packing defaults: one pair (~300 tokens here) per packed microbatch (bench_train also times 8)
    cfg.packing.max_tokens_per_bin = 8192
    cfg.packing.max_sequences_per_bin = 1
    cfg.packing.shared_prompt = False  # separate rows; the shared-prompt layout is timed apart (bench_shared)
    cfg.scheduler.lr_warmup_steps = 0  # a real update from step 1 on (megatron: step 1 uses lr_warmup_init otherwise)
    cfg.mpo.max_num_steps = 100
    return cfg


def _conventional_mpo_loss(pol: torch.Tensor, ref: torch.Tensor, n_tok: torch.Tensor, m) -> torch.Tensor:
    """MPO loss of one pair written out directly (MPO paper, arXiv 2411.10442: w_p·DPO + w_q·BCO + w_g·SFT, δ = 0 at
    step 1). pol/ref: [2] response log-prob sums (chosen, rejected); n_tok: [2] response-token counts."""
    import torch.nn.functional as F

    ratio = pol - ref
    avg = ratio / n_tok
    lp = avg if m.preference_average_log_probs else ratio
    lq = avg if m.quality_average_log_probs else ratio
    beta, delta = m.reference_policy_kl_penalty, m.reward_shift
    pref = -F.logsigmoid(beta * (lp[0] - lp[1]))
    bco = -F.logsigmoid(beta * lq[0] - delta) - F.logsigmoid(-(beta * lq[1] - delta))
    sft = -(pol[0] / n_tok[0] if m.sft_average_log_probs else pol[0])
    return m.preference_loss_weight * pref + m.bco_loss_weight * bco + m.sft_loss_weight * sft


def _row_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive per-row response log-prob sums from [B, L, V] logits: log_softmax + gather, the usual way."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    return torch.where(m, lp, torch.zeros((), dtype=lp.dtype)).sum(1), m.sum(1)


def _padded_pair(p, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conventional batch of one pair (the baselines' layout): chosen and rejected rows right-padded to one [2, L]
    batch. Returns (input_ids int64, attention_mask int64, response mask bool), each [2, L] on `device`."""
    rows, masks = (p.chosen_ids, p.rejected_ids), (p.chosen_loss_mask, p.rejected_loss_mask)
    L = max(r.numel() for r in rows)
    input_ids = torch.full((2, L), pad_id, dtype=torch.int64)
    attn = torch.zeros(2, L, dtype=torch.int64)
    resp = torch.zeros(2, L, dtype=torch.bool)
    for j, (r, m) in enumerate(zip(rows, masks, strict=True)):
        input_ids[j, :r.numel()], attn[j, :r.numel()], resp[j, :r.numel()] = r, 1, m
    return input_ids.to(device), attn.to(device), resp.to(device)


def _torch_adam(params, o) -> torch.optim.Adam:
    """The baselines' optimizer: torch Adam with `o` (config.OptimizerConfig)'s lr, betas, eps and weight decay."""
    return torch.optim.Adam(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)


STORED_REFERENCE_GOAL = 1.25  # issue 43: the step with stored reference sums, pairs/s over the online step (CPU)


def bench_train(quick: bool) -> dict:
    """One optimizer step, ours vs the transformers baseline: step-1 loss and gradient norm equal, pairs/s, tokens/s."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import distributed
    import reference_logprobs
    import train

    distributed.init_distributed(device=_device())
    n_pairs, timed = (6, 2) if quick else (16, 5)
    pol_dir, ref_dir = small_checkpoint("policy", seed=1234), small_checkpoint("reference", seed=4321)
    pairs, ids = sample_pairs(pol_dir, n_pairs)
    cfg = _bench_cfg(pol_dir, n_pairs)
    tokens = sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in pairs.values())
    o = cfg.optimizer

    # -- ours: train.train_step as train.main sets it up (one rank) --------------------------------------------------
    policy, reference = _build_ours(pol_dir), _build_ours(ref_dir)
    reference.eval().requires_grad_(False)
    ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)  # fp32, distributed Adam: the config's defaults
    ctx = distributed.Ctx.current(cfg, _device())
    ddp.train()
    lengths = {i: (p.chosen_ids.numel(), p.rejected_ids.numel()) for i, p in pairs.items()}
    state = {"shift": cfg.mpo.reward_shift}

    cfg_packed = copy.deepcopy(cfg)
    cfg_packed.packing.max_sequences_per_bin = 8  # up to 8 pairs (16 rows) in one THD microbatch

    def bins(plan_cfg=cfg) -> list[pack.PackedBatch]:
        return train.load_bins(pack.plan_step(lengths, plan_cfg.packing, 1), pairs, ctx, ids["image"], ids["pad"])

    def ours_step(plan_cfg=cfg, ref=reference) -> dict:
        batches = bins(plan_cfg)
        m, state["shift"] = train.train_step(ddp, ref, optimizer, scheduler, batches, ctx, state["shift"])
        m["microbatches"] = len(batches)
        return m

    # reference.logprobs = "precomputed": the reference pass's values of these pairs, then the step that reads them
    stored = reference_logprobs.Stored.from_scores(_tmp(), max(pairs) + 1,
                                                   reference_logprobs.score(reference, bins(), ctx))
    assert all(torch.equal(a, b) for a, b in zip(reference_logprobs.sums(stored, bins(), ctx),
                                                 reference_logprobs.sums(reference, bins(), ctx), strict=True))

    # -- baseline: transformers, conventional padded per-pair step ---------------------------------------------------
    with no_progress_bars():
        hf_pol = NemotronH_Omni_Reasoning_V3.from_pretrained(pol_dir, dtype=torch.float32).to(ctx.device).train()
        hf_ref = NemotronH_Omni_Reasoning_V3.from_pretrained(ref_dir, dtype=torch.float32).to(ctx.device).eval()
    hf_ref.requires_grad_(False)
    params = [p for p in hf_pol.parameters() if p.requires_grad]
    hf_opt = _torch_adam(params, o)

    def base_step() -> dict:
        hf_opt.zero_grad(set_to_none=True)
        total = 0.0
        for p in pairs.values():
            input_ids, attn, resp = _padded_pair(p, ids["pad"], ctx.device)
            kw = dict(input_ids=input_ids, attention_mask=attn, pixel_values=torch.cat([p.pixel_values] * 2),
                      image_grid_hw=torch.cat([p.image_grid_hw] * 2))  # the image encoded once per row
            kw.update(pixel_values=kw["pixel_values"].to(ctx.device), image_grid_hw=kw["image_grid_hw"].to(ctx.device))
            with torch.no_grad():
                ref, _ = _row_logprobs(hf_ref(**kw).logits, input_ids, resp)
            pol, n_tok = _row_logprobs(hf_pol(**kw).logits, input_ids, resp)
            loss = _conventional_mpo_loss(pol, ref, n_tok, cfg.mpo) / len(pairs)
            loss.backward()
            total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        hf_opt.step()
        return {"loss": total, "grad_norm": float(grad_norm)}

    m_ours, m_base = ours_step(), base_step()  # step 1: the equality check (and warm-up)
    loss_diff = abs(m_ours["loss"] - m_base["loss"])
    assert loss_diff <= LOSS_TOL, f"train: step-1 loss ours {m_ours['loss']} vs baseline {m_base['loss']}"
    gn_rel = abs(m_ours["grad_norm"] - m_base["grad_norm"]) / max(m_base["grad_norm"], 1e-12)
    assert gn_rel <= LOSS_TOL, f"train: step-1 grad norm ours {m_ours['grad_norm']} vs baseline {m_base['grad_norm']}"
    t = interleaved_times({"ours": ours_step, "ours_8_per_bin": lambda: ours_step(cfg_packed),
                           "baseline": base_step, "ours_stored_reference": lambda: ours_step(ref=stored),
                           "reference_pass": lambda: reference_logprobs.score(reference, bins(), ctx)}, timed)
    t_ours, t_base, t_packed = t["ours"]["min"], t["baseline"]["min"], t["ours_8_per_bin"]["min"]
    t_stored, t_pass = t["ours_stored_reference"]["min"], t["reference_pass"]["min"]
    return {"pairs": n_pairs, "tokens": tokens, "microbatches_ours": m_ours["microbatches"],
            "microbatches_baseline": n_pairs, "loss_ours": m_ours["loss"], "loss_baseline": m_base["loss"],
            "loss_abs_diff": loss_diff, "grad_norm_ours": m_ours["grad_norm"],
            "grad_norm_baseline": m_base["grad_norm"],
            "grad_norm_rel_diff": gn_rel, "step_s_ours": t_ours, "step_s_baseline": t_base,
            "pairs_per_s_ours": n_pairs / t_ours, "pairs_per_s_baseline": n_pairs / t_base,
            "tokens_per_s_ours": tokens / t_ours, "tokens_per_s_baseline": tokens / t_base,
            "speed_ratio": t_base / t_ours, "step_s_ours_8_per_bin": t_packed,
            "microbatches_ours_8_per_bin": len(pack.plan_step(lengths, cfg_packed.packing, 1).ranks[0]),
            "speed_ratio_8_per_bin": t_base / t_packed, "step_s_stored_reference": t_stored,
            "pairs_per_s_stored_reference": n_pairs / t_stored, "stored_reference_speed_ratio": t_ours / t_stored,
            "stored_reference_goal": STORED_REFERENCE_GOAL, "pass_s": t_pass, "pairs_per_s_reference_pass":
            n_pairs / t_pass, "pass_over_step_speed_ratio": t_ours / t_pass, "timed_steps": timed,
            "step_s_median": t}


# ======================================================================================================================
# 4b. Shared-prompt pair layout vs separate rows

SHARED_BIN_TOKENS = 16384  # configs/nano.toml's packing.max_tokens_per_bin: the budget of the token count
SHARED_GOAL = 1.4  # goal of the shared-prompt layout: >= 1.4x pairs/s on the MMPR-like mix (CPU)


def mmpr_like_text_pairs(parts: dict, scale: int, vocab: int, seed: int = 0) -> dict:
    """Text pairs (pack.PreferencePair) with the (prompt, chosen, rejected) lengths of `parts`
    (synthetic_mmpr_parts) divided by `scale` (at least 2 / 1 / 1 tokens): the prompt's image tokens become text
    tokens (the language model's work is the same; vision runs once per pair in both layouts). Random ids >= 32."""
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for i, (p, c, r) in parts.items():
        prompt = torch.randint(32, vocab, (max(2, p // scale),), generator=g)
        resp = [torch.randint(32, vocab, (max(1, n // scale),), generator=g) for n in (c, r)]
        resp[1][0] = 32 + (int(resp[0][0]) - 31) % (vocab - 32)  # the responses differ from their first token
        pairs[i] = text_pair(i, prompt, *resp)
    return pairs


def text_pair(pair_index: int, prompt: torch.Tensor, chosen: torch.Tensor,
              rejected: torch.Tensor) -> pack.PreferencePair:
    """A text-only pair: rows [prompt | response] (int64 ids), loss masks on the responses, no image."""
    rows = [torch.cat([prompt, x]) for x in (chosen, rejected)]
    masks = [torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(x.numel(), dtype=torch.bool)])
             for x in (chosen, rejected)]
    return pack.PreferencePair(pair_index=pair_index, chosen_ids=rows[0], rejected_ids=rows[1],
                               chosen_loss_mask=masks[0], rejected_loss_mask=masks[1],
                               pixel_values=torch.zeros(0, 3 * 16 * 16),
                               image_grid_hw=torch.zeros(0, 2, dtype=torch.int64),
                               image_token_counts=torch.zeros(0, dtype=torch.int64))


def shared_lengths(pairs: dict) -> dict[int, int]:
    """{pair id: tokens stored once in the shared-prompt layout} of `pairs` (pack.PreferencePair), by the packer's
    own rule (shared_prompt.prefix_length): what pack.plan_step takes as `shared_lengths`."""
    return {i: shared_prompt.prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask)
            for i, p in pairs.items()}


def bench_shared(quick: bool) -> dict:
    """Shared-prompt layout (packing.shared_prompt, shared_prompt.pack) vs separate rows (pack.pack), same pairs, same
    bin budget: (a) tokens the language model computes for 10,000 MMPR-like pairs (shared_prompt_token_counts,
    budget SHARED_BIN_TOKENS, 1 pair per bin, 8 DP ranks; exact arithmetic); (b) one MPO optimizer step
    (train.train_step) of the small Omni config on MMPR-like text pairs (lengths of synthetic_mmpr_parts divided
    by a scale: 1, or 16 in --quick; bins of SHARED_BIN_TOKENS / scale tokens and up to 8 pairs): step time, pairs/s
    and their ratio; the step-1 loss of both layouts must agree to VALUE_TOL (asserted)."""
    import dataclasses

    import distributed
    import reference_logprobs
    import train

    n_count = 2000 if quick else 10000
    counts = shared_prompt_token_counts(synthetic_mmpr_parts(n_count, seed=0), SHARED_BIN_TOKENS, 1, 8,
                                             divisible_by=8)
    n_pairs, scale, timed = (8, 16, 2) if quick else (8, 1, 3)
    distributed.init_distributed(device=_device())
    pol_dir, ref_dir = small_checkpoint("policy", seed=1234), small_checkpoint("reference", seed=4321)
    vocab = json.loads((pol_dir / "config.json").read_text())["llm_config"]["vocab_size"]
    parts = synthetic_mmpr_parts(n_pairs, seed=1)
    pairs = mmpr_like_text_pairs(parts, scale, vocab)
    lengths = {i: (p.chosen_ids.numel(), p.rejected_ids.numel()) for i, p in pairs.items()}
    cfg = _bench_cfg(pol_dir, n_pairs)
    cfg.packing.max_tokens_per_bin = SHARED_BIN_TOKENS // scale
    cfg.packing.max_sequences_per_bin = 8
    cfg_shared = copy.deepcopy(cfg)
    cfg_shared.packing.shared_prompt = True
    policy, reference = _build_ours(pol_dir), _build_ours(ref_dir)
    reference.eval().requires_grad_(False)
    ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)
    ctx = distributed.Ctx.current(cfg, _device())
    ctxs = {"separate": ctx, "shared": dataclasses.replace(ctx, cfg=cfg_shared)}
    ddp.train()
    batches, shared = {}, shared_lengths(pairs)
    for name, c in ctxs.items():
        plan = pack.plan_step(lengths, c.cfg.packing, 1, shared)  # used when shared
        batches[name] = train.load_bins(plan, pairs, c, 18, 0)
    tokens = {k: sum(int(b.cu_seqlens[-1]) for b in v) for k, v in batches.items()}
    padded = {k: sum(b.input_ids.shape[1] for b in v) for k, v in batches.items()}

    def loss(name):  # step-1 loss without an update: the equality check
        c, bs = ctxs[name], batches[name]
        n = train.count_global_pairs(bs, c)
        ref = reference_logprobs.sums(reference, bs, c)
        return train.policy_forward_backward(bs, ref, ddp, c, 0.0, n, backward=False)[0]["loss"]

    loss_sep, loss_shr = loss("separate"), loss("shared")
    assert abs(loss_sep - loss_shr) <= VALUE_TOL, f"shared: step-1 loss separate {loss_sep} vs shared {loss_shr}"
    state = {"shift": 0.0}

    def step(name):
        def run():
            _, state["shift"] = train.train_step(ddp, reference, optimizer, scheduler, batches[name],
                                                 ctxs[name], state["shift"])
        return run

    t = interleaved_times({"separate": step("separate"), "shared": step("shared")}, timed)
    t_sep, t_shr = t["separate"]["min"], t["shared"]["min"]
    return {"count_pairs": n_count, "count_bin_tokens": SHARED_BIN_TOKENS, **{f"count_{k}": v for k, v in
                                                                              counts.items()},
            "pairs": n_pairs, "length_scale": scale, "bin_tokens": cfg.packing.max_tokens_per_bin,
            "microbatches_separate": len(batches["separate"]), "microbatches_shared": len(batches["shared"]),
            "tokens_separate": tokens["separate"], "tokens_shared": tokens["shared"],
            "padded_tokens_separate": padded["separate"], "padded_tokens_shared": padded["shared"],
            "token_ratio": tokens["separate"] / tokens["shared"], "loss_separate": loss_sep, "loss_shared": loss_shr,
            "loss_abs_diff": abs(loss_sep - loss_shr), "step_s_separate": t_sep, "step_s_shared": t_shr,
            "pairs_per_s_separate": n_pairs / t_sep, "pairs_per_s_shared": n_pairs / t_shr,
            "speed_ratio": t_sep / t_shr, "goal": SHARED_GOAL, "timed_steps": timed, "step_s_median": t}


# ======================================================================================================================
# 5. Data: index build vs cache load, decoding throughput


def _repeated_meta(folder: Path, repeat: int) -> Path:
    """A copy of the sample's meta-recipe whose annotations hold every row `repeat` times (absolute image roots)."""
    import mmpr_rows

    meta = json.loads(SAMPLE_META.read_text())
    subsets = {s.name: s for s in mmpr_rows.read_meta(SAMPLE_META)}
    for name, entry in meta.items():
        s = subsets[name]
        lines = [ln for ln in s.annotation.read_text().splitlines() if ln.strip()]
        ann = folder / f"{name}.jsonl"
        ann.write_text("\n".join(lines * repeat) + "\n")
        entry.update(root=str(s.root), annotation=str(ann), length=len(lines) * repeat)
    path = folder / "meta.json"
    path.write_text(json.dumps(meta, indent=1))
    return path


def bench_data(quick: bool) -> dict:
    """Index build (no cache) vs cache load of the sample repeated to ~5,000 rows; pairs/s with 0 and 2 workers."""
    import mmpr_data
    import mmpr_index
    from config import Config

    repeat, n_decode = (15, 64) if quick else (148, 256)
    proc = _processor(TINY)
    cfg = Config()
    saved = os.environ.get("HF_DATASETS_CACHE")
    with tempfile.TemporaryDirectory(prefix="omni_bench_data_") as d:
        os.environ["HF_DATASETS_CACHE"] = str(Path(d) / "cache")
        try:
            meta = _repeated_meta(Path(d), repeat)
            t = time.perf_counter()
            built = mmpr_index.build_index(meta, proc, cfg.data)
            t_build = time.perf_counter() - t
            t = time.perf_counter()
            loaded = mmpr_index.build_index(meta, proc, cfg.data)
            t_load = time.perf_counter() - t
        finally:
            if saved is None:
                os.environ.pop("HF_DATASETS_CACHE", None)
            else:
                os.environ["HF_DATASETS_CACHE"] = saved
        assert (built.cache_status, loaded.cache_status) == ("built", "hit"), (built.cache_status, loaded.cache_status)
        assert built.lengths() == loaded.lengths(), "data: the cached index differs from the built one"
        ds = mmpr_data.PairDataset(loaded, proc)
        rates = {}
        for workers in (0, 2):
            loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=range(n_decode), num_workers=workers,
                                                 collate_fn=mmpr_data._collate_pairs)
            t = time.perf_counter()
            n = sum(len(b) for b in loader)
            rates[workers] = n / (time.perf_counter() - t)
    return {"rows": len(built), "build_s": t_build, "cache_load_s": t_load, "build_over_load": t_build / t_load,
            "decode_pairs": n_decode, "pairs_per_s_workers0": rates[0], "pairs_per_s_workers2": rates[2],
            "workers2_over_workers0": rates[2] / rates[0]}


# ======================================================================================================================
# 6. GPU


# The GPU step: Nano width at reduced depth (pattern MEM*EM), random weights.
NANO_WIDTH_LLM = dict(hidden_size=2688, hybrid_override_pattern="MEM*EM", num_attention_heads=32,
                      num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
                      n_groups=8, chunk_size=128, intermediate_size=1856, moe_intermediate_size=1856,
                      moe_shared_expert_intermediate_size=3712, n_routed_experts=128, num_experts_per_tok=6,
                      vocab_size=131072)
GPU_SHAPE = dict(llm=NANO_WIDTH_LLM, dtype="bfloat16", pairs=16, pairs_per_bin=4, prompt=(600, 2400),
                 response=(100, 700), scan_tokens=16384, scan_sequences=8)


def gpu_shape_ladder(base: dict = GPU_SHAPE) -> list[dict]:
    """Shapes of the GPU step, largest first: `base`, then fewer pairs per bin (4, 2, 1: activations), then fewer
    routed experts (64, 32 of 128, one pair per bin: the weights and optimizer state). Width, depth, vocabulary, top-k
    and the pairs' lengths stay the Nano's."""
    out = [{**base, "pairs_per_bin": k} for k in (4, 2, 1) if k <= base["pairs_per_bin"]]
    return out + [{**base, "pairs_per_bin": 1, "llm": {**base["llm"], "n_routed_experts": e}}
                  for e in (64, 32) if e < base["llm"]["n_routed_experts"]]


def plan_gpu_step(shape: dict, capacity: float) -> dict:
    """plan.py's numbers for the GPU step of `shape` (one rank: the policy, the reference, megatron's Adam and the
    largest bin's activations) on a device of `capacity` bytes: planned bytes, reserve, spare and whether it fits
    (plan.Plan.fits: plan.MARGIN to spare after the reserve)."""
    import omni_model as om
    import pack
    import plan

    ckpt = _shape_checkpoint(shape)
    cfg = step_config(ckpt, shape)
    pairs = text_pairs(shape["pairs"], shape["prompt"], shape["response"], om.read_hf_config(ckpt).text.vocab_size)
    bins = [b.tokens for b in pack.plan_step(pair_lengths(pairs), cfg.packing, 1).ranks[0]]
    p = plan.make_plan(cfg, 1, image_tokens=0)
    (rank,) = p.ranks
    total = rank.total(p.activations(max(bins)))
    return {"capacity_bytes": capacity, "planned_bytes": total, "reserve_bytes": p.reserve.total(total),
            "spare_bytes": p.spare(capacity, max(bins)), "largest_bin": max(bins), "fits": p.fits(capacity, max(bins))}


def sized_gpu_shape(capacity: float, base: dict = GPU_SHAPE) -> tuple[dict, dict]:
    """The largest shape of `gpu_shape_ladder(base)` whose step plan.py fits in `capacity` bytes (a device's free
    memory), with its plan (`plan_gpu_step`); the smallest shape and its plan when none fits."""
    for shape in gpu_shape_ladder(base):
        planned = plan_gpu_step(shape, capacity)
        if planned["fits"]:
            break
    return shape, planned


def text_pairs(n: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int, seed: int = 0) -> dict:
    """n MMPR-like text pairs (pack.PreferencePair, no image): one prompt of U[prompt] tokens shared by the chosen and
    the rejected row, each followed by its own response of U[response] tokens (the loss mask), random token ids."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo_hi):
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (), generator=g))

    pairs = {}
    for i in range(n):
        p = torch.randint(32, vocab, (rint(prompt),), generator=g)
        responses = [torch.randint(32, vocab, (rint(response),), generator=g) for _ in range(2)]
        pairs[i] = text_pair(i, p, *responses)
    return pairs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _held_memory(device: torch.device, name: str) -> dict:
    """Beside `_peak_memory`: the caching allocator's peak reserve and the device's used memory (total - free of
    cudaMemGetInfo: the CUDA context, NCCL and other processes included), bytes; {} on the CPU. plan.py's reserve is
    calibrated against them."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {f"peak_reserved_bytes_{name}": torch.cuda.max_memory_reserved(device),
            f"device_used_bytes_{name}": total - free}


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _shape_checkpoint(shape: dict) -> Path:
    """A folder with the tiny asset's config.json widened by shape["llm"] (no weights: both models init randomly)."""
    out = _tmp() / f"gpu_shape_{len(list(_tmp().iterdir()))}"
    out.mkdir()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["llm_config"].update(shape["llm"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _release(device: torch.device) -> None:
    """Free what a finished system left (its objects are gone with its function's frame) before the next starts."""
    import gc

    gc.collect()
    _reset_peak(device)


def _ours_system(device, cfg, ckpt):
    """Our system as train.main sets it up (one rank): policy in megatron DDP with its optimizer and scheduler, and the
    frozen reference with the policy's weights. Returns (ddp, reference, optimizer, scheduler, ctx, policy)."""
    import distributed
    import omni_model as om
    import train

    distributed.seed_everything(cfg.mpo.seed)
    policy = om.build_model(ckpt, cfg.model, cfg.parallel)
    reference = om.build_model(ckpt, cfg.model, cfg.parallel)
    reference.load_state_dict(policy.state_dict())
    reference.eval().requires_grad_(False)
    ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)
    ddp.train()
    return ddp, reference, optimizer, scheduler, distributed.Ctx.current(cfg, device), policy


def _drop_system(ddp) -> None:
    """Let a finished system be freed. megatron-core's MoE token dispatchers keep their last forward's routing
    probabilities, whose autograd graph reaches each router weight's AccumulateGrad node; megatron's DDP keeps every
    such node (`grad_accs`) and hooks each one with a closure over the DDP. The cycle runs through autograd's C++
    nodes, out of sight of Python's garbage collector: the policy, its gradient buffers and the optimizer outlived
    their section (the next GPU section ran out of memory)."""
    ddp.grad_accs.clear()
    for module in ddp.modules():
        if (dispatcher := getattr(module, "token_dispatcher", None)) is not None:
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(dispatcher, name, None)


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| over lists of per-sequence log-prob sums (one [S] tensor per microbatch)."""
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def _check_closed_form(what: str, loss: float, want: float, tol: float | None) -> float:
    """|loss - want|; raises AssertionError naming `what` when `tol` is given (the CPU) and the deviation exceeds it."""
    dev = abs(loss - want)
    assert tol is None or dev <= tol, f"gpu step: {what} step-1 loss {loss} != {want} (tolerance {tol})"
    return dev


def _ours_step_bench(device, setup: dict, tol: float | None, timed, timed_steps) -> dict:
    """mpo_step_bench's system under test: train.train_step as train.main sets it up (one rank), with separate rows
    (the default) and with the shared-prompt layout; and the noise floor of its step-1 loss: the reference forward
    twice on the same bins and the policy (before any update, no grad) against the reference, as the max |difference|
    of the per-sequence log-prob sums."""
    ddp, reference, optimizer, scheduler, ctx, policy = _ours_system(device, setup["cfg"], setup["ckpt"])
    try:
        return _ours_steps(device, setup, tol, timed, timed_steps, ddp, reference, optimizer, scheduler, ctx, policy)
    finally:
        _drop_system(ddp)


def _ours_steps(device, setup, tol, timed, timed_steps, ddp, reference, optimizer, scheduler, ctx, policy) -> dict:
    """_ours_step_bench's measurements on the built system."""
    import dataclasses

    import monitor
    import reference_logprobs
    import train

    cfg, pairs, ids, want = setup["cfg"], setup["pairs"], setup["ids"], setup["want"]
    n_active = monitor.active_params(policy, setup["hf"])
    plan = pack.plan_step(setup["lengths"], cfg.packing, 1)
    state = {"shift": cfg.mpo.reward_shift}

    def step_of(plan, ctx):
        """One timed MPO step of `plan`'s bins under `ctx` (its packing layout), δ carried across steps."""
        def step() -> dict:
            batches = train.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
            metrics, state["shift"] = train.train_step(ddp, reference, optimizer, scheduler, batches, ctx,
                                                       state["shift"])
            return metrics
        return step

    ours_step = step_of(plan, ctx)

    # The noise floor, before any update (policy = reference): a no-grad policy forward leaves the routers' expert-bias
    # counts alone, as the reference's does.
    batches = train.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
    ref_a = reference_logprobs.sums(reference, batches, ctx)
    ref_b = reference_logprobs.sums(reference, batches, ctx)
    with torch.no_grad():
        pol = [train.forward_logprobs(ddp, b, ctx)[0] for b in batches]
    noise = dict(noise_ref_repeat_max_abs_diff=_max_abs_diff(ref_a, ref_b),
                 noise_policy_vs_ref_max_abs_diff=_max_abs_diff(pol, ref_a),
                 logprob_sum_max_abs=max(float(r.abs().max()) for r in ref_a))
    del batches, ref_a, ref_b, pol

    # The shared-prompt layout (packing.shared_prompt) on the same pairs and bin budget, its step-1 loss computed before
    # any update (policy = reference: the closed-form loss), timed after the separate-rows steps.
    cfg_shared = copy.deepcopy(cfg)
    cfg_shared.packing.shared_prompt = True
    ctx_shared = dataclasses.replace(ctx, cfg=cfg_shared)
    plan_shared = pack.plan_step(setup["lengths"], cfg_shared.packing, 1, shared_lengths(pairs))
    batches = train.load_bins(plan_shared, pairs, ctx_shared, ids["image"], ids["pad"])
    n = train.count_global_pairs(batches, ctx_shared)
    loss_shared = train.policy_forward_backward(batches, reference_logprobs.sums(reference, batches, ctx_shared),
                                                ddp, ctx_shared, state["shift"], n, backward=False)[0]["loss"]
    dev_shared = _check_closed_form("shared-prompt", loss_shared, want, tol)
    tokens_shared = sum(int(b.cu_seqlens[-1]) for b in batches)
    del batches
    shared_step = step_of(plan_shared, ctx_shared)

    _reset_peak(device)
    m1 = ours_step()
    dev_ours = _check_closed_form("ours", m1["loss"], want, tol)
    t_ours = timed_steps(ours_step, timed)
    peak, held = _peak_memory(device), _held_memory(device, "ours")
    _reset_peak(device)
    t_shared = timed_steps(shared_step, timed)
    return dict(loss_ours=m1["loss"], loss_ours_abs_dev=dev_ours, microbatches_ours=len(plan.ranks[0]),
                n_active=n_active, **noise, step_s_ours=min(t_ours), peak_bytes_ours=peak, **held,
                loss_shared=loss_shared,
                loss_shared_abs_dev=dev_shared, microbatches_shared=len(plan_shared.ranks[0]),
                tokens_shared=tokens_shared, step_s_shared=min(t_shared), peak_bytes_shared=_peak_memory(device))


def _baseline_step_bench(device, setup: dict, tol: float | None, timed, timed_steps) -> dict:
    """mpo_step_bench's baseline: transformers' model, one padded [2, L] batch per pair, torch Adam. Its noise floor:
    max |policy - reference| of the per-row log-prob sums at step 1."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    cfg, pairs, ids, want = setup["cfg"], setup["pairs"], setup["ids"], setup["want"]
    hcfg = NemotronH_Omni_Reasoning_V3_Config(**json.loads((setup["ckpt"] / "config.json").read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        hf_pol = NemotronH_Omni_Reasoning_V3(hcfg).to(setup["dtype"]).train()
    hf_ref = copy.deepcopy(hf_pol).eval().requires_grad_(False)
    params = [p for p in hf_pol.parameters() if p.requires_grad]
    o = cfg.optimizer
    hf_opt = _torch_adam(params, o)

    def base_step() -> dict:
        hf_opt.zero_grad(set_to_none=True)
        total, diff = 0.0, 0.0
        for p in pairs.values():
            input_ids, attn, resp = _padded_pair(p, ids["pad"], device)
            with torch.no_grad():
                ref, _ = _row_logprobs(hf_ref(input_ids=input_ids, attention_mask=attn).logits, input_ids, resp)
            pol, n_tok = _row_logprobs(hf_pol(input_ids=input_ids, attention_mask=attn).logits, input_ids, resp)
            loss = _conventional_mpo_loss(pol, ref, n_tok, cfg.mpo) / len(pairs)
            loss.backward()
            total += loss.item()
            diff = max(diff, float((pol.detach() - ref).abs().max()))
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        hf_opt.step()
        return {"loss": total, "policy_vs_ref": diff}

    _reset_peak(device)
    b1 = base_step()
    dev = _check_closed_form("baseline", b1["loss"], want, tol)
    t_base = timed_steps(base_step, timed)
    return dict(loss_baseline=b1["loss"], loss_baseline_abs_dev=dev,
                noise_baseline_policy_vs_ref_max_abs_diff=b1["policy_vs_ref"], loss_expected=want,
                step_s_baseline=min(t_base), peak_bytes_baseline=_peak_memory(device), timed_steps=timed)


def _step_setup(device: torch.device, shape: dict) -> dict:
    """What both systems of mpo_step_bench (and profile_step) share: the config (configs/tiny.toml at `shape`, separate
    rows), the checkpoint folder of `shape`, its HF config, dtype, the text pairs, their row lengths, token ids and the
    closed-form step-1 loss `want` = w_p·ln 2 + w_q·2 ln 2 (policy = reference, δ = 0, no SFT term)."""
    import math

    import distributed
    import omni_model as om

    distributed.init_distributed(device=device)
    ckpt = _shape_checkpoint(shape)
    hf = om.read_hf_config(ckpt)
    cfg = step_config(ckpt, shape)
    m = cfg.mpo
    pairs = text_pairs(shape["pairs"], shape["prompt"], shape["response"], hf.text.vocab_size)
    return dict(cfg=cfg, ckpt=ckpt, hf=hf, dtype=getattr(torch, shape["dtype"]), pairs=pairs,
                lengths=pair_lengths(pairs),
                ids={"image": hf.image_token_id, "pad": 0},
                want=m.preference_loss_weight * math.log(2) + m.bco_loss_weight * 2 * math.log(2))


def step_config(ckpt, shape: dict):
    """The config of the GPU step (mpo_step_bench, profile_step; plan.py's calibration): configs/tiny.toml with the
    checkpoint folder `ckpt` of `shape`, its dtype, pairs and pairs per bin, separate rows (shared timed apart)."""
    import config as config_mod

    return config_mod.load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"model.hf_path={ckpt}", f"model.params_dtype={shape['dtype']}",
        f"policy.train_global_batch_size={shape['pairs']}", f"packing.max_sequences_per_bin={shape['pairs_per_bin']}",
        "packing.max_tokens_per_bin=65536", "scheduler.lr_warmup_steps=0", "mpo.max_num_steps=100",
        "policy.logprob_chunk_size=1024", "packing.shared_prompt=false"])


def pair_lengths(pairs: dict) -> dict:
    """{pair id: (chosen row tokens, rejected row tokens)} of pack.PreferencePairs (pack.plan_step's lengths)."""
    return {i: (p.chosen_ids.numel(), p.rejected_ids.numel()) for i, p in pairs.items()}


def closed_form_tolerance(device: torch.device, shape: dict, want: float) -> float | None:
    """The tolerance of the step-1 loss against its closed form, or None where it is not exact by construction.

    On the CPU the policy and the reference compute bit-identical log-prob sums (same weights, deterministic kernels),
    so every log-ratio is exactly 0 and only float32 rounding of the loss arithmetic remains: per pair a few roundings
    (ln 2 from logsigmoid(0), the weights, the sum of the terms: 3 ulps) plus one per pair summed in a microbatch
    (pairs_per_bin): (3 + pairs_per_bin) float32 ulps of the loss, eps·|want| bounding one ulp. On CUDA the kernels
    are not deterministic (atomic adds, e.g. combining MoE outputs): the deviation is recorded next to the measured
    noise floor, never asserted (None)."""
    if device.type != "cpu":
        return None
    return (3 + shape["pairs_per_bin"]) * torch.finfo(torch.float32).eps * abs(want)


def mpo_step_bench(device, shape: dict, timed: int) -> dict:
    """One MPO optimizer step (policy fwd+bwd, frozen reference fwd, fused loss, distributed Adam: train.train_step) on
    `shape`'s text pairs packed `pairs_per_bin` pairs per THD microbatch, vs transformers' model doing the conventional
    step (each pair one padded [2, L] batch, log_softmax + gather, torch Adam), both on `device`.

    Both systems start with policy = reference (random weights, the same within a system), so the step-1 loss of
    both is w_p·ln 2 + w_q·2 ln 2 (configs/tiny.toml's loss weights, no SFT term). Recorded: each step-1 loss and its
    deviation from that closed form (`loss_*_abs_dev`), next to the noise floor measured in the same run
    (`noise_*`: max |difference| of per-sequence log-prob sums, reference forward twice on the same bins, and policy
    vs reference before any update; `logprob_sum_max_abs` for their scale). Asserted only on the CPU, where it is exact
    by construction (closed_form_tolerance, recorded as `loss_tolerance`; None on CUDA).
    Returns tokens/s, pairs/s, step seconds (min of `timed` steps after step 1), peak memory (CUDA), MFU
    (8·N_active·tokens / s / peak bf16 FLOP/s, monitor.mfu; N_active = monitor.active_params: the language model's
    parameters without the input embedding table (a lookup) - output layer, every dense parameter and the shared
    expert whole, plus top_k/n_routed of the routed experts; the vision tower is not counted), and the speed
    ratio; plus our step in the shared-prompt layout (packing.shared_prompt, same pairs and bin budget; its loss
    before any update is the same closed form): its tokens, step seconds, pairs/s, peak memory and the speed ratio
    over our separate-rows step (the shared-prompt layout's GPU ratio).
    Raises AssertionError when a step-1 loss is off on the CPU.
    """
    import monitor

    device = torch.device(device)
    setup = _step_setup(device, shape)
    hf, pairs = setup["hf"], setup["pairs"]
    tol = closed_form_tolerance(device, shape, setup["want"])
    tokens = sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in pairs.values())
    out = {"device": str(device), "dtype": shape["dtype"], "pairs": shape["pairs"], "tokens": tokens,
           "pattern": hf.pattern, "hidden_size": hf.text.hidden_size, "vocab_size": hf.text.vocab_size,
           "loss_tolerance": tol, "loss_expected": setup["want"]}

    def timed_steps(step, n: int) -> list[float]:
        times = []
        for _ in range(n):
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t)
        return times

    out.update(_ours_step_bench(device, setup, tol, timed, timed_steps))
    print(f"[bench] gpu step ours {json.dumps(out)}", file=sys.stderr, flush=True)  # kept if the baseline times out
    _release(device)
    try:
        out.update(_baseline_step_bench(device, setup, tol, timed, timed_steps))
    except torch.cuda.OutOfMemoryError as e:  # transformers' padded step is not planned: recorded, ours stands
        out["baseline_error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    _release(device)
    s_o = out["step_s_ours"]
    out.update(tokens_per_s_ours=tokens / s_o, pairs_per_s_ours=len(pairs) / s_o,
               mfu_ours=monitor.mfu(tokens, s_o, out["n_active"], 1) if device.type == "cuda" else None,
               pairs_per_s_shared=len(pairs) / out["step_s_shared"], shared_speed_ratio=s_o / out["step_s_shared"])
    if "step_s_baseline" in out:
        s_b = out["step_s_baseline"]
        out.update(tokens_per_s_baseline=tokens / s_b, pairs_per_s_baseline=len(pairs) / s_b, speed_ratio=s_b / s_o,
                   mfu_baseline=monitor.mfu(tokens, s_b, out["n_active"], 1) if device.type == "cuda" else None)
    return out


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
    import mamba_torch

    b, seqlen, h, p = x.shape
    r = h // B.shape[2]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    dtf = mamba_torch._processed_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
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


def mamba_scan_kernels(device: torch.device) -> dict:
    """The Mamba-2 chunked-scan implementations usable here: {name: mamba_chunk_scan_combined}. mamba_torch always;
    with CUDA, mamba-ssm's Triton kernel when it imports (mamba_ssm_importable) or, without the compiled
    package, from its sources ("mamba-ssm-src", mamba_triton.load_mamba_ssm_triton), and fla-core's Triton simple-GLA
    kernel through mamba_chunk_scan_via_simple_gla when `fla` imports (the portable candidate of issue
    12, evaluated by tests/test_gpu.py against mamba_torch; not used for training)."""
    import functools

    import kernel_selection
    import mamba_torch
    import mamba_triton

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
        if chunk_simple_gla is not None and fla_refusal(device) is None:
            def gla(q, k, v, g, cu):
                return chunk_simple_gla(q, k, v, g=g, scale=1.0, cu_seqlens=cu)[0]

            kernels["fla"] = functools.partial(mamba_chunk_scan_via_simple_gla, gla=gla)
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
    if importlib.util.find_spec("fla") is not None and (reason := fla_refusal(device)) is not None:
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


# The regions of `profile_step`'s table, in its order. "Mamba other" is the mixer outside its projections, conv, scan
# and norm (gating, reshapes; a fused conv+scan kernel such as mamba-ssm's when it runs); "MoE other" the MoE layer
# outside its router, dispatcher, experts and shared expert; "other" what no region holds (loss, gradient reduction,
# bin loading, the step's host code on the CPU).
PROFILE_REGIONS = ("Mamba in/out projections", "Mamba conv", "Mamba scan", "Mamba norm", "Mamba other",
                   "attention (core)", "attention projections", "MoE router", "MoE dispatch (permute)",
                   "MoE expert GEMMs", "MoE combine (unpermute)", "MoE shared expert", "MoE other", "dense MLP",
                   "layer norms", "embedding", "LM head + fused log-probs", "reference forward", "optimizer step",
                   "gradient accumulation (DDP)", "other")
REGION_PREFIX = "omni_region::"  # the record_function ranges of profile_regions
STEP_RANGE = "omni_step"  # the record_function range around the profiled step
_BACKWARD_NODE = "autograd::engine::evaluate_function: "  # the autograd engine's range around one backward node


class _ItemAccess:
    """A dict's items as attributes (`profile_regions` wraps the entries of a dict of kernels like module functions)."""

    def __init__(self, d: dict):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name):
        return self._d.get(name)

    def __setattr__(self, name, value):
        self._d[name] = value

    def __delattr__(self, name):
        del self._d[name]

    @property
    def __dict__(self):  # vars(): what `on_call` records to undo
        return self._d


@contextlib.contextmanager
def profile_regions(policy, optimizer):
    """record_function ranges named REGION_PREFIX + a PROFILE_REGIONS name around the parts of one MPO step, by module
    (forward pre/post hooks on megatron-core's module types inside `policy`) or by call (functions the modules call,
    dispatcher and optimizer methods); removed on exit. Regions nest (an expert MLP inside the MoE layer); the
    profile attributes each event to the innermost. Backward work is attributed through the autograd sequence numbers
    (attribute_profile), so only forward calls need ranges.

    Modules: MambaMixer (in_proj/out_proj, norm, the rest), Attention (core_attention, the rest: QKV and output
    projections), MoELayer (router, experts, shared_experts, the rest), MLPLayer's mlp, the layers' input_layernorm /
    pre_mlp_layernorm and the decoder's final_norm, HybridModel's embedding and output_layer. Calls: mamba_torch's
    causal conv and chunked scan (plain and shared-prompt), the `mamba triton` set's conv and scan, the MoE token
    dispatcher's dispatch_* / token_dispatch and combine_* / token_combine, mpo_loss.packed_sequence_logprobs,
    reference_logprobs.sums (the whole no-grad reference pass: it absorbs every region inside it) and
    `optimizer.step`."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import mamba_torch
    import mamba_triton
    import mpo_loss
    import reference_logprobs

    handles, undo, missing = [], [], object()

    def on_module(module, region: str) -> None:
        if not isinstance(module, torch.nn.Module) or isinstance(module, IdentityOp):
            return
        stack = []

        def pre(m, args):
            stack.append(torch.profiler.record_function(REGION_PREFIX + region))
            stack[-1].__enter__()

        def post(m, args, output):
            stack.pop().__exit__(None, None, None)

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    def on_call(owner, name: str, region: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def ranged(*args, **kwargs):
            with torch.profiler.record_function(REGION_PREFIX + region):
                return fn(*args, **kwargs)

        undo.append((owner, name, vars(owner).get(name, missing)))
        setattr(owner, name, ranged)

    for m in policy.modules():
        if isinstance(m, MambaMixer):
            on_module(m, "Mamba other")
            on_module(m.in_proj, "Mamba in/out projections")
            on_module(m.out_proj, "Mamba in/out projections")
            on_module(getattr(m, "norm", None), "Mamba norm")
        elif isinstance(m, Attention):
            on_module(m, "attention projections")
            on_module(m.core_attention, "attention (core)")
        elif isinstance(m, MoELayer):
            on_module(m, "MoE other")
            on_module(m.router, "MoE router")
            on_module(m.experts, "MoE expert GEMMs")
            on_module(getattr(m, "shared_experts", None), "MoE shared expert")
            for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess"):
                on_call(m.token_dispatcher, name, "MoE dispatch (permute)")
            for name in ("combine_preprocess", "token_combine", "combine_postprocess"):
                on_call(m.token_dispatcher, name, "MoE combine (unpermute)")
        elif isinstance(m, HybridModel):
            on_module(m.embedding, "embedding")
            on_module(m.output_layer, "LM head + fused log-probs")
            on_module(getattr(m.decoder, "final_norm", None), "layer norms")
        if isinstance(m, MLPLayer):
            on_module(m.mlp, "dense MLP")
        if isinstance(m, (TransformerLayer, MambaLayer)):
            for name in ("input_layernorm", "pre_mlp_layernorm", "norm"):
                on_module(getattr(m, name, None), "layer norms")
    for owner, name in ((mamba_torch, "causal_conv1d_fn"), (shared_prompt, "causal_conv1d")):
        on_call(owner, name, "Mamba conv")
    for owner, name in ((mamba_torch, "mamba_chunk_scan_combined"), (shared_prompt, "mamba_chunk_scan")):
        on_call(owner, name, "Mamba scan")
    # the `mamba triton` set: its conv by name, its scan in the kernels dict mamba_triton.kernels() hands out
    on_call(mamba_triton, "causal_conv1d_fn", "Mamba conv")
    try:
        triton_set = mamba_triton.load_mamba_ssm_triton()
    except ImportError:  # sources that do not import here: that set is not used either
        triton_set = None
    if triton_set is not None:
        on_call(_ItemAccess(triton_set), "scan_fn", "Mamba scan")
    on_call(mpo_loss, "packed_sequence_logprobs", "LM head + fused log-probs")
    on_call(reference_logprobs, "sums", "reference forward")
    on_call(optimizer, "step", "optimizer step")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name, before in reversed(undo):
            if before is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def attribute_profile(events, cuda: bool) -> dict:
    """Time by PROFILE_REGIONS region of the profiled step (torch.profiler's `prof.events()` holding one STEP_RANGE):
    device time (each CPU op's own kernels, `self_device_time_total`) with `cuda`, else CPU time (`self_cpu_time_total`:
    on the CPU the step's ops run one after another on its thread, so the regions sum to the step's wall time; ops of
    other threads, e.g. gloo's copies, overlap them and are left out).

    An event inside region ranges belongs to the innermost one (everything inside "reference forward" to it); a
    backward event (inside the autograd engine's range of one node) to the region of the forward op that created the
    node: the op on the same thread with the node's sequence number that started last (ops that create no node carry
    the next node's number too, and run before it). AccumulateGrad nodes (gradients into megatron DDP's buffers) are
    "gradient accumulation (DDP)"; the rest "other". With `cuda`, kernels no CPU op launched are added to "other".

    Returns {"unit": "cuda" | "cpu", "step_wall_s": the step range's duration, "regions_s": {region: seconds} in
    PROFILE_REGIONS order, "total_s": their sum, "device_busy_s" (union of kernel intervals) and "host_gaps_s" (wall
    minus device busy; the profiler's own host overhead included) with `cuda`, else None}. Raises ValueError when the
    events hold no STEP_RANGE."""
    from torch.autograd import DeviceType

    step = next((e for e in events if e.name == STEP_RANGE), None)
    if step is None:
        raise ValueError(f"the profile holds no {STEP_RANGE!r} range")
    lo, hi = step.time_range.start, step.time_range.end
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU and not e.is_async
                  and lo <= e.time_range.start <= hi and (cuda or e.thread == step.thread)),
                 key=lambda e: e.time_range.start)
    where: dict[int, tuple[str | None, object]] = {}  # id -> (innermost region range, innermost backward node range)

    def locate(e) -> tuple[str | None, object]:
        if id(e) not in where:
            region, node = locate(e.cpu_parent) if e.cpu_parent is not None else (None, None)
            if e.name.startswith(REGION_PREFIX) and region != "reference forward":
                region = e.name.removeprefix(REGION_PREFIX)
            elif e.name.startswith(_BACKWARD_NODE) and node is None:
                node = e
            where[id(e)] = (region, node)
        return where[id(e)]

    created: dict[tuple[int, int], str] = {}  # (thread, sequence number) -> region of the forward op
    for e in ops:
        region, node = locate(e)
        if node is None and e.sequence_nr >= 0:
            created[(e.thread, e.sequence_nr)] = region or "other"
    regions = dict.fromkeys(PROFILE_REGIONS, 0.0)
    for e in ops:
        region, node = locate(e)
        if region is None and node is not None:
            region = ("gradient accumulation (DDP)" if node.name.endswith("AccumulateGrad") else
                      created.get((node.fwd_thread, node.sequence_nr), "other"))  # fmt: skip
        regions[region or "other"] += (e.self_device_time_total if cuda else e.self_cpu_time_total) * 1e-6
    out = {"unit": "cuda" if cuda else "cpu", "step_wall_s": (hi - lo) * 1e-6, "device_busy_s": None,
           "host_gaps_s": None}
    if cuda:
        kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.device_type != DeviceType.CPU and lo <= e.time_range.start <= hi)
        regions["other"] += max(0.0, sum(b - a for a, b in kernels) * 1e-6 - sum(regions.values()))
        busy, end = 0.0, lo
        for a, b in kernels:  # the union of the kernel intervals
            busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
        out.update(device_busy_s=busy * 1e-6, host_gaps_s=(hi - lo - busy) * 1e-6)
    return {**out, "regions_s": regions, "total_s": sum(regions.values())}


def profile_step(device, shape: dict) -> dict:
    """torch.profiler over one MPO step of our system (train.train_step, separate rows, `shape` as mpo_step_bench,
    after one unprofiled warm-up step: allocations, cuBLAS handles, Triton autotuning) with profile_regions' ranges:
    attribute_profile's time by region."""
    import train

    device = torch.device(device)
    setup = _step_setup(device, shape)
    cfg, pairs, ids = setup["cfg"], setup["pairs"], setup["ids"]
    ddp, reference, optimizer, scheduler, ctx, policy = _ours_system(device, cfg, setup["ckpt"])
    plan = pack.plan_step(setup["lengths"], cfg.packing, 1)

    def step(shift: float) -> float:
        batches = train.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
        return train.train_step(ddp, reference, optimizer, scheduler, batches, ctx, shift)[1]

    shift = step(cfg.mpo.reward_shift)
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with profile_regions(policy, optimizer), torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(STEP_RANGE):
                step(shift)
                _sync(device)
    finally:
        _drop_system(ddp)
    return attribute_profile(prof.events(), device.type == "cuda")


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
    import local_spec
    import mamba_torch
    import megatron_patches

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
    """The step of mpo_step_bench (ours, separate rows) on one built system with the kernel line's set, then with each
    of its fast kernels swapped for its portable fallback (`fallback`), one at a time: per variant the step seconds
    (min of `timed` steps after one warm-up step), tokens/s and MFU, and the fallback's step time over the set's
    ("slowdown"); a variant that fails is {"error": ...} and the next one runs. `out` (run_section's entry) is
    filled and written as each variant ends. Raises when the set's own step fails."""
    import kernel_selection
    import monitor
    import omni_model as om
    import train

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
        batches = train.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
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
            if "write" in _STATE:
                _STATE["write"]()
    finally:
        _drop_system(ddp)
    failed = [v for v in out["fallbacks"] if "error" in out[v]]
    if failed:  # the section fails (exit status 1); run_section keeps the variants recorded above
        raise RuntimeError(f"kernel ablation: {', '.join(failed)} failed")
    return out


def profile_table(p: dict) -> str:
    """profile_step's result as a Markdown table: region | time (ms) | share of the regions' total."""
    unit = "device time (CUDA)" if p["unit"] == "cuda" else "CPU time"
    lines = [f"| region | {unit}, ms | share |", "|---|---|---|"]
    lines += [f"| {r} | {s * 1e3:.2f} | {100 * s / p['total_s']:.1f}% |" for r, s in p["regions_s"].items()]
    lines.append(f"| total | {p['total_s'] * 1e3:.2f} | 100% |")
    if p.get("host_gaps_s") is not None:
        lines.append(f"| host gaps (step wall {p['step_wall_s'] * 1e3:.2f} ms - device busy "
                     f"{p['device_busy_s'] * 1e3:.2f} ms) | {p['host_gaps_s'] * 1e3:.2f} | |")
    return "\n".join(lines)


def bench_gpu(quick: bool, device=None, shape: dict | None = None, profile: bool = False, timed: int | None = None,
              out: dict | None = None, ablation: bool = False) -> dict:
    """Item 6 on a CUDA device, in sections recorded in `out` (main passes its results entry) as each ends, a failing
    one as {"error": ...} without stopping the next (run_section): "step" (mpo_step_bench, `timed` steps after step 1:
    default 1 with `quick`, else 5), with `profile` "profile" (profile_step; before the scans, whose Triton compilation
    from a cold cache is the slowest part), and "scan" (scan_bench). Without CUDA (and no explicit `device`), a skip
    record. `device`/`shape` let a CPU test run it at a tiny shape."""
    import kernel_selection
    import omni_model as om

    out = {} if out is None else out
    if device is None:
        if not torch.cuda.is_available():
            out["skipped"] = "no CUDA device: the GPU step time, tokens/s and MFU need an accelerator"
            return out
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if shape is None:  # the largest step plan.py fits in the free memory; --quick: 8 pairs, one timed step and scan
        base = {**GPU_SHAPE, "pairs": 8} if quick else GPU_SHAPE
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
        shape, out["planned"] = sized_gpu_shape(free, base)
        out["shape"] = {"pairs": shape["pairs"], "pairs_per_bin": shape["pairs_per_bin"],
                        "n_routed_experts": shape["llm"]["n_routed_experts"]}
        print(f"[bench] gpu shape {json.dumps(out['shape'])}, planned {json.dumps(out['planned'])}", file=sys.stderr,
              flush=True)
    kernels = kernel_selection.select_kernels(cuda=device.type == "cuda", dtype=om.torch_dtype(shape["dtype"]))
    out.update(kernels=kernels.line(), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               versions=versions())
    timed = timed or (1 if quick else 5)
    sections = [("step", mpo_step_bench, (device, shape, timed))]
    if profile:
        sections.append(("profile", profile_step, (device, shape)))
    if ablation:
        sections.append(("ablation", functools.partial(kernel_ablation, out=out.setdefault("ablation", {})),
                         (device, shape, timed)))
    sections.append(("scan", scan_bench, (device, shape, timed)))
    for key, fn, args in sections:
        run_section(out, key, fn, *args)
        print(f"[bench] gpu {key} {json.dumps(out[key])}", file=sys.stderr, flush=True)
        _release(device)
    return out


# ======================================================================================================================
# Table and entry point


# ======================================================================================================================
# 7. Gradient buffers: bf16 against fp32 (optimizer.grad_reduce_in_fp32)

GRAD_COUNTS = (1, 16, 256)  # microbatches accumulated; 256: configs/nano.toml's pairs per step, one pair per bin
GRAD_COUNTS_QUICK = (1, 4, 8)
GRAD_PAIRS = 32  # distinct sample pairs, cycled through the microbatches
GRAD_DDP_CHECKED = 4  # microbatches also accumulated by megatron DDP of each setting, compared bit for bit


def _grad_policy(cfg, fp32: bool | None):
    """The tiny policy with its HF weights, bare (None) or in megatron DDP with fp32 (True) or params-dtype (False)
    gradient buffers, as train.build_optimizer makes it. Returns (the module a step calls, its DDP or None)."""
    import dataclasses

    import hf_weights
    import omni_model as om
    import train

    policy = om.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(policy, cfg.model.hf_path)
    if fp32 is None:
        return policy, None
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, grad_reduce_in_fp32=fp32))
    ddp = train.build_optimizer(policy, cfg)[0]
    ddp.train()
    return ddp, ddp


def grad_errors(acc: torch.Tensor, exact: torch.Tensor, abs_sum: torch.Tensor, n: int) -> dict:
    """Errors of a gradient accumulated in `acc`'s dtype against `exact` (float64 sum of the same n microbatch
    gradients; all flat): rel_l2 = ||acc - exact|| / ||exact||, rel_max = max |acc - exact| / max |exact|, rel_median =
    the median of |acc - exact| / |exact| over nonzero elements, and bound_use = max |acc - exact| / (γ_{n-1} Σ|g_i|)
    per element: recursive summation's bound (Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4) with
    γ_k = k·u / (1 - k·u), u the buffer's unit roundoff (+ 2^-24 for bf16: torch adds bf16 in fp32, then rounds);
    at most 1 by arithmetic."""
    u = torch.finfo(acc.dtype).eps / 2 + (2.0**-24 if acc.dtype == torch.bfloat16 else 0.0)
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    err = (acc.double() - exact).abs()
    nonzero = exact != 0
    use = torch.where(err == 0, 0.0, err / (gamma * abs_sum))  # inf where the bound is 0 and the error is not
    return {"rel_l2": float(err.norm() / exact.norm()), "rel_max": float(err.max() / exact.abs().max()),
            "rel_median": float((err[nonzero] / exact[nonzero].abs()).median()), "bound_use": float(use.max())}


def grad_accumulation(counts: tuple[int, ...] = GRAD_COUNTS) -> dict:
    """The step's gradient after each of `counts` microbatches, accumulated in bf16 and in fp32 buffers, against the
    float64 sum of the same microbatch gradients: configs/tiny.toml in bf16 (one pair per bin; the sample's first
    GRAD_PAIRS pairs, images included, cycled), the MPO loss at step 1 (policy = reference, δ = 0) with the
    denominator max(counts), so the first n microbatches are the first n of one step (a power-of-two denominator
    scales every gradient exactly). Each microbatch's bf16 gradient (train.policy_forward_backward on the bare policy)
    is added as megatron DDP adds it (`main_grad.add_(grad)`) to a bf16, an fp32 and a float64 sum; the first
    GRAD_DDP_CHECKED also run through megatron DDP with each setting, whose buffers must equal the bf16 and fp32 sums
    bit for bit (asserted). Returns per count: grad_errors' dict per buffer dtype, and `sampling_noise` = ||even - odd||
    / ||sum||, the float64 sums of the even and the odd microbatches (for independent microbatches, E||even - odd||² =
    E||sum - E sum||²: the relative sampling noise of the step's gradient, of min(n, GRAD_PAIRS) distinct pairs); and
    the seconds per microbatch."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import config as config_mod
    import distributed
    import reference_logprobs
    import train

    device, n_max = torch.device("cpu"), max(counts)
    distributed.init_distributed(device=device)
    cfg = config_mod.load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"model.hf_path={TINY}", "model.params_dtype=bfloat16", "packing.shared_prompt=false"])  # fmt: skip
    distributed.seed_everything(cfg.mpo.seed)
    ctx = distributed.Ctx.current(cfg, device)
    pairs, ids = sample_pairs(TINY, GRAD_PAIRS)
    policy, _ = _grad_policy(cfg, None)
    reference, _ = _grad_policy(cfg, None)
    reference.eval().requires_grad_(False)
    ddps = {fp32: _grad_policy(cfg, fp32) for fp32 in (True, False)}
    params = [p for p in policy.parameters() if p.requires_grad]
    acc = {d: [torch.zeros_like(p, dtype=d) for p in params] for d in (torch.bfloat16, torch.float32, torch.float64)}
    abs_sum = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    halves = [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(2)]  # even, odd microbatches
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 1.0 / n_max))  # train_step's scale for n_max microbatches
    refs, out, t = {}, {}, time.perf_counter()
    for i in range(n_max):
        pair = pairs[i % GRAD_PAIRS]
        batch = pack.pack([pair], cfg.packing.make_sequence_length_divisible_by, ids["image"], ids["pad"]).to(device)
        if i % GRAD_PAIRS not in refs:
            refs[i % GRAD_PAIRS] = reference_logprobs.sums(reference, [batch], ctx)
        models = [policy] + [m for m, _ in ddps.values()] * (i < GRAD_DDP_CHECKED)
        for model in models:
            train.policy_forward_backward([batch], refs[i % GRAD_PAIRS], model, ctx, 0.0, n_max, backward=True)
        for k, p in enumerate(params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            for a in acc.values():
                a[k].add_(g)
            abs_sum[k].add_(g.abs())
            halves[i % 2][k].add_(g)
            p.grad = None
        if i + 1 == GRAD_DDP_CHECKED:
            for fp32, (_, ddp) in ddps.items():
                sums = acc[torch.float32 if fp32 else torch.bfloat16]
                main = [p.main_grad for p in ddp.module.parameters() if p.requires_grad]
                assert all(torch.equal(a, m) for a, m in zip(sums, main, strict=True)), \
                    f"grads: megatron DDP's {'fp32' if fp32 else 'bf16'} buffer differs from the same accumulation"
        if i + 1 in counts:
            flat = {d: torch.cat([x.reshape(-1) for x in a]) for d, a in acc.items()}
            total = torch.cat([x.reshape(-1) for x in abs_sum])
            even, odd = (torch.cat([x.reshape(-1) for x in h]) for h in halves)
            out[i + 1] = {"bf16": grad_errors(flat[torch.bfloat16], flat[torch.float64], total, i + 1),
                          "fp32": grad_errors(flat[torch.float32], flat[torch.float64], total, i + 1),
                          "sampling_noise": float((even - odd).norm() / flat[torch.float64].norm())}
    return {"counts": list(counts), "pairs": GRAD_PAIRS, "params": sum(p.numel() for p in params),
            "s_per_microbatch": (time.perf_counter() - t) / (n_max + 2 * min(GRAD_DDP_CHECKED, n_max)),
            "errors": {str(n): out[n] for n in counts}}


def bench_grads(quick: bool) -> dict:
    """grad_accumulation at GRAD_COUNTS (--quick: GRAD_COUNTS_QUICK)."""
    return grad_accumulation(GRAD_COUNTS_QUICK if quick else GRAD_COUNTS)


ITEMS = {"packing": bench_packing, "vision": bench_vision, "logprobs": bench_logprobs, "train": bench_train,
         "shared": bench_shared, "data": bench_data, "gpu": bench_gpu, "grads": bench_grads}


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


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


def table(res: dict) -> str:
    """The results as one Markdown table: item | metric | ours | baseline | ratio."""
    from mmpr_rows import plural

    rows = [(name, "failed", r["error"][:100], "", "") for name, r in res.items() if "error" in r]
    res = {name: r for name, r in res.items() if "error" not in r}
    if "packing" in res:
        p = res["packing"]
        a, b, c = p["ours"], p["round_robin"], p["padded"]
        rows += [
            ("packing (a) vs (b) round-robin", "busiest rank's token share (1/8 ideal)",
             f"{a['busiest_rank_share']:.4f}", f"{b['busiest_rank_share']:.4f}", f"{p['busiest_rank_b_over_a']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "useful-token fraction", f"{a['useful_fraction']:.4f}",
             f"{c['useful_fraction']:.4f}", f"{a['useful_fraction'] / c['useful_fraction']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "tokens computed (padding included)", f"{a['tokens']}",
             f"{c['tokens']}", f"{p['padding_compute_c_over_a']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "busiest rank's tokens (step time)", f"{a['busiest_rank_tokens']}",
             f"{c['busiest_rank_tokens']}", f"{p['busiest_rank_c_over_a']:.3f}x"),
        ]
    if "vision" in res:
        v = res["vision"]
        rows += [
            ("vision once per pair", "ViT+projector fwd+bwd per pair", f"{v['vision_fwd_bwd_s_shared'] * 1e3:.1f} ms",
             f"{v['vision_fwd_bwd_s_per_row'] * 1e3:.1f} ms", f"{v['vision_cost_ratio']:.2f}x"),
            ("vision once per pair", "whole pair fwd+bwd", f"{v['pair_fwd_bwd_s_shared'] * 1e3:.1f} ms",
             f"{v['pair_fwd_bwd_s_per_row'] * 1e3:.1f} ms", f"{v['pair_step_ratio']:.2f}x"),
        ]
    if "logprobs" in res:
        lp = res["logprobs"]
        shape = f"T={lp['T']} V={lp['V']}"
        rows += [
            (f"log-probs {shape}", "peak additional memory, fwd+bwd", _mib(lp["peak_bytes_ours"]),
             _mib(lp["peak_bytes_naive"]), f"{lp['memory_ratio']:.2f}x less"),
            (f"log-probs {shape}", "naive without its [T,V] logits-gradient buffer", _mib(lp["peak_bytes_ours"]),
             _mib(lp["working_bytes_naive"]), f"{lp['working_memory_ratio']:.2f}x less"),
            (f"log-probs {shape}", "time fwd+bwd", f"{lp['seconds_ours']:.3f} s", f"{lp['seconds_naive']:.3f} s",
             f"{lp['time_ratio']:.2f}x the time"),
        ]
    if "train" in res:
        t = res["train"]
        rows += [
            ("MPO step vs transformers", f"pairs/s ({t['pairs']} pairs)", f"{t['pairs_per_s_ours']:.2f}",
             f"{t['pairs_per_s_baseline']:.2f}", f"{t['speed_ratio']:.2f}x the speed"),
            ("MPO step vs transformers", "tokens/s", f"{t['tokens_per_s_ours']:.0f}",
             f"{t['tokens_per_s_baseline']:.0f}", f"{t['speed_ratio']:.2f}x the speed"),
            ("MPO step vs transformers",
             f"step, 8 pairs per bin ({plural(t['microbatches_ours_8_per_bin'], 'microbatch')})",
             f"{t['step_s_ours_8_per_bin']:.3f} s", f"{t['step_s_baseline']:.3f} s",
             f"{t['speed_ratio_8_per_bin']:.2f}x the speed"),
            ("MPO step vs transformers", "step-1 loss", f"{t['loss_ours']:.6f}", f"{t['loss_baseline']:.6f}",
             f"diff {t['loss_abs_diff']:.1e}"),
        ]
        if "pairs_per_s_stored_reference" in t:  # results recorded before issue 43 have no such rows
            rows += [
                ("stored reference log-probs vs reference forward", f"MPO step pairs/s ({t['pairs']} pairs, same bins)",
                 f"{t['pairs_per_s_stored_reference']:.2f}", f"{t['pairs_per_s_ours']:.2f}",
                 f"{t['stored_reference_speed_ratio']:.2f}x the speed (goal {t['stored_reference_goal']}x)"),
                ("reference pass vs MPO step", "pairs/s (same bins)", f"{t['pairs_per_s_reference_pass']:.2f}",
                 f"{t['pairs_per_s_ours']:.2f}", f"{t['pass_over_step_speed_ratio']:.2f}x the speed"),
            ]
    if "shared" in res:
        sh = res["shared"]
        rows += [
            ("shared prompt vs separate rows", f"LM tokens, {sh['count_pairs']} MMPR-like pairs (bins of "
             f"{sh['count_bin_tokens']})", f"{sh['count_tokens_shared']}", f"{sh['count_tokens_separate']}",
             f"{sh['count_token_ratio']:.2f}x fewer"),
            ("shared prompt vs separate rows", f"MPO step pairs/s ({sh['pairs']} pairs, lengths / "
             f"{sh['length_scale']}, {sh['tokens_shared']} vs {sh['tokens_separate']} tokens)",
             f"{sh['pairs_per_s_shared']:.2f}", f"{sh['pairs_per_s_separate']:.2f}",
             f"{sh['speed_ratio']:.2f}x the speed"),
        ]
    if "data" in res:
        d = res["data"]
        rows += [
            (f"data index, {d['rows']} rows", "cache load vs build", f"{d['cache_load_s'] * 1e3:.1f} ms",
             f"{d['build_s']:.2f} s", f"{d['build_over_load']:.1f}x faster"),
            ("data decode + process", "pairs/s, 2 workers vs 0", f"{d['pairs_per_s_workers2']:.1f}",
             f"{d['pairs_per_s_workers0']:.1f}", f"{d['workers2_over_workers0']:.2f}x"),
        ]
    if "grads" in res:
        for n, e in res["grads"]["errors"].items():
            b, f = e["bf16"], e["fp32"]
            ratio = f"{b['rel_l2'] / f['rel_l2']:.2g}x the error" if f["rel_l2"] else "both exact"
            rows.append((f"bf16 vs fp32 gradient buffers, {plural(int(n), 'microbatch')}",
                         "relative L2 error against float64 (max-abs)", f"{b['rel_l2']:.1e} ({b['rel_max']:.1e})",
                         f"{f['rel_l2']:.1e} ({f['rel_max']:.1e})", ratio))
    if "gpu" in res and "skipped" in res["gpu"]:
        rows.append(("GPU", "step time, tokens/s, MFU", res["gpu"]["skipped"], "", ""))
    elif "gpu" in res:
        g, st = res["gpu"], res["gpu"].get("step", {"error": "not recorded"})
        if "error" in st:
            rows.append(("MPO step (GPU item)", "failed", st["error"][:100], "", ""))
        else:
            rows += gpu_step_rows(st)
        if "ablation" in g:
            rows += ablation_rows(g["ablation"])
        sc = g.get("scan", {"error": "not recorded"})
        rows += [("Mamba-2 scans", "failed", sc["error"][:100], "", "")] if "error" in sc else scan_rows(sc)
    head = ("item", "metric", "ours", "baseline", "ratio")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


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


def gpu_step_rows(st: dict) -> list[tuple[str, ...]]:
    """The table rows of mpo_step_bench's result: speed, memory, the shared-prompt ratio, the step-1 losses against
    their closed form and the noise floor measured beside them."""
    what = f"MPO step {st['pattern']} h{st['hidden_size']} {st['dtype']} vs transformers"
    mfu = f" (MFU {100 * st['mfu_ours']:.1f}%)" if st.get("mfu_ours") is not None else ""

    def base(key: str, fmt: str) -> str:  # transformers' number, or what stopped its step
        return format(st[key], fmt) if key in st else "out of memory" if "baseline_error" in st else ""

    peak = ("", "")  # CUDA only
    if st["peak_bytes_ours"]:
        peak = (_mib(st["peak_bytes_ours"]),
                _mib(st["peak_bytes_baseline"]) if "peak_bytes_baseline" in st else base("peak_bytes_baseline", ""))
    ratio = f"{st['speed_ratio']:.2f}x the speed" if "speed_ratio" in st else ""
    return [
        (what, f"tokens/s ({st['pairs']} pairs, {st['tokens']} tokens)", f"{st['tokens_per_s_ours']:.0f}{mfu}",
         base("tokens_per_s_baseline", ".0f"), ratio),
        (what, "pairs/s", f"{st['pairs_per_s_ours']:.2f}", base("pairs_per_s_baseline", ".2f"), ratio),
        (what, "peak memory", *peak, ""),
        ("shared prompt vs separate rows (ours)", f"pairs/s ({st['tokens_shared']} vs {st['tokens']} tokens)",
         f"{st['pairs_per_s_shared']:.2f}", f"{st['pairs_per_s_ours']:.2f}",
         f"{st['shared_speed_ratio']:.2f}x the speed"),
        (what, "step-1 loss (policy = reference)", f"{st['loss_ours']:.6f}", base("loss_baseline", ".6f"),
         f"want {st['loss_expected']:.6f}"),
        (what, "step-1 loss: abs deviation from want (asserted on the CPU only)", f"{st['loss_ours_abs_dev']:.1e}",
         base("loss_baseline_abs_dev", ".1e"), f"shared prompt {st['loss_shared_abs_dev']:.1e}"),
        (what, "noise floor: max abs diff of log-prob sums, policy vs reference at step 1",
         f"{st['noise_policy_vs_ref_max_abs_diff']:.1e}", base("noise_baseline_policy_vs_ref_max_abs_diff", ".1e"),
         f"reference twice {st['noise_ref_repeat_max_abs_diff']:.1e} (sums up to {st['logprob_sum_max_abs']:.0f})"),
    ]


def machine() -> str:
    """One line: CPU model, cores, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, Python {platform.python_version()}"


def versions() -> dict:
    """The versions a GPU number depends on: torch, its CUDA, Triton (None where absent)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench.py", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced sizes (about 1 min: 57 s on 2 shared CPU cores)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(ITEMS)}")
    ap.add_argument("--gpu", action="store_true", help="only the GPU item (needs CUDA), written to "
                    "bench_gpu_results.json (results/bench_gpu_results.json with --quick) unless --json is given")
    ap.add_argument("--profile", action="store_true", help="with the GPU item: torch.profiler over one MPO step, a "
                    "table of device time by region (profile_step; CPU time when --only gpu runs on the CPU)")
    ap.add_argument("--ablation", action="store_true", help="with the GPU item: the step again with each fast "
                    "kernel of the kernel line swapped for its portable fallback (kernel_ablation)")
    ap.add_argument("--timed-steps", type=int, metavar="N", help="GPU item: timed steps after step 1 and timed "
                    "scans per kernel (default 1 with --quick, else 5)")
    ap.add_argument("--json", help="where to write the results (default: bench_results.json for a full run of every "
                    "item, results/bench_results.json for --quick / --only)")
    ap.add_argument("--print", metavar="JSON", nargs="?", const=str(ROOT / "bench_results.json"),
                    help="print the table of a saved results file (default bench_results.json) and exit")
    ap.add_argument("--logprobs-worker", nargs=4, type=int, metavar=("T", "V", "CHUNK", "REPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.logprobs_worker:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        print(json.dumps(logprobs_worker(*args.logprobs_worker)))
        return 0
    if args.print:
        if not Path(args.print).is_file():
            print(f"error: no results file {args.print} (a full `python bench.py` writes bench_results.json, "
                  "--quick / --only runs results/bench_results.json)", file=sys.stderr)
            return 1
        try:
            res = json.loads(Path(args.print).read_text())
            head = (f"omni-mpo bench ({'quick' if res['quick'] else 'full'}), {res['date']}, {res['machine']}: "
                    f"`{res.get('command', 'python bench.py')}`")
            text = table({k: v for k, v in res.items() if k in ITEMS})
            if "profile" in res.get("gpu", {}) and "error" not in res["gpu"]["profile"]:
                text += "\n\n" + profile_table(res["gpu"]["profile"])
        except (ValueError, TypeError, KeyError) as e:  # not JSON, or not a results file of this bench.py
            what = (f"invalid JSON: {e}" if isinstance(e, json.JSONDecodeError) else
                    f"not a bench.py results file ({type(e).__name__}: {e})")  # fmt: skip
            print(f"error: {args.print}: {what}", file=sys.stderr)
            return 1
        print(head)
        print(text)
        return 0
    if args.gpu:
        if not torch.cuda.is_available():
            print("bench.py --gpu: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine",
                  file=sys.stderr)
            return 2
        args.only = "gpu"
        args.json = args.json or str(ROOT / ("results" if args.quick else ".") / "bench_gpu_results.json")
    names = list(ITEMS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    if not names:  # --only "" would otherwise run every item and write over the committed bench_results.json
        ap.error(f"--only {args.only!r} names no item; choose from {list(ITEMS)}")
    unknown = sorted(set(names) - set(ITEMS))
    if unknown:
        ap.error(f"unknown item(s) {unknown}; choose from {list(ITEMS)}")
    if (args.profile or args.ablation or args.timed_steps) and "gpu" not in names:
        ap.error("--profile, --ablation and --timed-steps are the GPU item's: use them with --gpu (or an --only that "
                 "names gpu)")
    if args.timed_steps is not None and args.timed_steps < 1:
        ap.error(f"--timed-steps {args.timed_steps}: at least 1")
    import kernel_selection

    print(kernel_selection.select_kernels().line(), file=sys.stderr, flush=True)
    flags = (" --gpu" if args.gpu else "") + (" --quick" if args.quick else "") + (" --profile" if args.profile else "")
    flags += " --ablation" if args.ablation else ""
    flags += f" --timed-steps {args.timed_steps}" if args.timed_steps else ""
    res: dict = {"quick": args.quick, "machine": machine(), "date": datetime.date.today().isoformat(),
                 "command": "python bench.py" + flags}
    out = Path(args.json or (ROOT / "bench_results.json" if not args.quick and args.only is None else
                             ROOT / "results" / "bench_results.json"))  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    _STATE["write"] = lambda: out.write_text(json.dumps(res, indent=1) + "\n")  # after every section (run_section)
    _STATE["write"]()
    failed = []
    try:
        for name in names:
            fn = ITEMS[name]
            if name == "gpu":  # its sections (step, scans, profile) are written as each ends
                fn = functools.partial(bench_gpu, profile=args.profile, timed=args.timed_steps,
                                       out=res.setdefault("gpu", {}), ablation=args.ablation)
            if not run_section(res, name, fn, args.quick):
                failed.append(name)
            failed += [f"{name}.{k}" for k, v in res[name].items() if isinstance(v, dict) and "error" in v]
    finally:
        if "tmp" in _STATE:
            shutil.rmtree(_STATE["tmp"], ignore_errors=True)
        _STATE.clear()  # the folder and the checkpoints cached in it are gone: a later call in this process makes new
    print(f"wrote {out}")
    print(f"omni-mpo bench ({'quick' if args.quick else 'full'}), {res['date']}, {res['machine']}")
    print(table({k: v for k, v in res.items() if k in ITEMS}))
    if "profile" in res.get("gpu", {}) and "error" not in res["gpu"]["profile"]:
        print("\n" + profile_table(res["gpu"]["profile"]))
    if "logprobs" in res and "error" not in res["logprobs"]:
        lp = res["logprobs"]
        met = lp["memory_ratio"] >= MEMORY_GOAL and lp["time_ratio"] <= TIME_GOAL
        print(f"log-prob goal (>= {MEMORY_GOAL}x less peak memory at <= {TIME_GOAL}x time): "
              f"{'met' if met else 'NOT met'} (total {lp['memory_ratio']:.2f}x, against naive without its logits "
              f"gradient {lp['working_memory_ratio']:.2f}x, time {lp['time_ratio']:.2f}x)")
    if "gpu" in res and "skipped" in res["gpu"]:
        print(f"gpu: skipped ({res['gpu']['skipped']})")
    if failed:
        print(f"bench.py: failed: {', '.join(failed)} (recorded as errors in {out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
