"""Item 1, packing (exact token arithmetic, not timed): our pair-atomic, greedily balanced THD bins against the same
bins dealt round-robin and against one padded pair per microbatch (the reference system's non-packed path)."""

from __future__ import annotations

import pack
from bench.workload import synthetic_mmpr_lengths


def deal_round_robin(bins, dp_size: int) -> list[list[pack.Bin]]:
    """Bin i to DP rank i % dp_size, in the given order (NeMo-RL's deal; the baseline)."""
    assert len(bins) % dp_size == 0
    return [list(bins[r::dp_size]) for r in range(dp_size)]


def round_robin_ranks(plan: pack.BinPlan, lengths) -> list[list[pack.Bin]]:
    """The bins of `plan` in the step's data order (dummies last), dealt round-robin: pack.deal_greedy's baseline."""
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
    """LM tokens of the same pairs (`synthetic_mmpr_parts`) as separate sequences and in the shared-prompt format under
    one bin budget (pack.plan_bins): tokens_*, useful_*, bins_* and token_ratio = tokens_separate / tokens_shared."""
    # tokens_* count padding and dummies, useful_* the real tokens; the shared format stores prompt - 1 tokens once
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
    """Useful-token fraction, busiest rank's token share and the padding compute of (c) against (a) of three ways to lay
    out one MMPR-like step: (a) ours, (b) round-robin, (c) padded pairs."""
    # Setup: synthetic_mmpr_lengths(256, seed=0) (prompts ~300-3400 tokens, mostly image tokens; responses 50-1500), 8
    # DP ranks, sequences padded to a multiple of 8, bins of <= 10240 tokens, one pair per bin (the config's default);
    # the same numbers in --quick (no cost to compute).
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
    # (c): one pair per microbatch as a [2, L] batch, L = the longer sequence padded to the multiple; in data order,
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
