"""Item 4b, shared: the shared-prompt pair format (packing.shared_prompt) vs separate sequences, same pairs and bin
budget: LM tokens computed for 10,000 MMPR-like pairs (exact arithmetic), and one MPO step (train.train_step, small
config) on 8 MMPR-like text pairs at full length (--quick: lengths / 16): pairs/s and the ratio; the step-1 loss of
both formats must agree to 1e-5 (asserted)."""

from __future__ import annotations

import copy
import json

import pack
from bench.common import VALUE_TOL, _bench_cfg, _build_ours, _device, interleaved_times, small_checkpoint
from bench.packing import shared_prompt_token_counts
from bench.workload import mmpr_like_text_pairs, shared_lengths, synthetic_mmpr_parts

SHARED_BIN_TOKENS = 16384  # configs/nano.toml's packing.max_tokens_per_bin: the budget of the token count
SHARED_GOAL = 1.4  # goal of the shared-prompt format: >= 1.4x pairs/s on the MMPR-like mix (CPU)


def bench_shared(quick: bool) -> dict:
    """Shared-prompt format (packing.shared_prompt, pack.pack_shared_prompt) vs separate sequences (pack.pack), same
    pairs, same bin budget: (a) tokens the language model computes for 10,000 MMPR-like pairs
    (shared_prompt_token_counts, budget SHARED_BIN_TOKENS, 1 pair per bin, 8 DP ranks; exact arithmetic); (b) one MPO
    optimizer step (train.train_step) of the small Omni config on MMPR-like text pairs (lengths of synthetic_mmpr_parts
    divided by a scale: 1, or 16 in --quick; bins of SHARED_BIN_TOKENS / scale tokens and up to 8 pairs): step time,
    pairs/s and their ratio; the step-1 loss of both formats must agree to VALUE_TOL (asserted)."""
    import dataclasses

    import distributed
    import mpo_loss
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
        batches[name] = pack.load_bins(plan, pairs, c, 18, 0)
    tokens = {k: sum(int(b.cu_seqlens[-1]) for b in v) for k, v in batches.items()}
    padded = {k: sum(b.input_ids.shape[1] for b in v) for k, v in batches.items()}

    def loss(name):  # step-1 loss without an update: the equality check
        c, bs = ctxs[name], batches[name]
        n = mpo_loss.count_global_pairs(bs, c)
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
