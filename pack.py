"""Pair-atomic THD sequence packing, context-parallel slicing and data-parallel balancing for MPO.

A preference pair (chosen row + rejected row, same prompt and image(s)) is the unit of packing: both rows always land
in the same bin, i.e. the same microbatch on the same data-parallel (DP) rank, so the loss sees both members of every
pair (reference behaviour: NeMo-RL's `pair_grouping_key="pair_index"` packing,
nemo_rl/distributed/batched_data_dict.py::shard_by_batch_size).

Three layers, cheapest first, and the shared-prompt variant of packing (4):

1. Planning (pure Python, no tensors): `plan_bins(lengths, max_tokens_per_bin, max_sequences_per_bin, dp_size, ...)`
   bins the pairs of one optimizer step first-fit-decreasing, makes the bin count a multiple of DP (splitting multi-pair
   bins, then zero-weight dummy bins), and deals bins to DP ranks greedily by cost. `plan_step(lengths, cfg.packing,
   dp_size)` does the same from the config's packing section. The plan is a pure function of the step's pair ids and
   lengths, so every rank computes the same plan and takes `plan.ranks[dp_rank]`; no communication is needed.
2. Packing (tensors, one bin): `pack(pairs, divisible_by, image_token_id)` -> `PackedBatch`, one `[1, T]` THD row with
   `cu_seqlens`, pre-rolled labels, the loss mask aligned with the labels, position ids restarting per sequence, and the
   media of each pair stored once. `packed_seq_params(batch)` builds megatron-core's `PackedSeqParams`.
3. Context parallelism: `cp_partition_index(cu_seqlens_padded, cp_size, cp_rank)` gives the token positions a CP rank
   keeps (TE's `thd_get_partitioned_indices` layout); `cp_gather` inverts it (the tests' oracle).

4. Shared-prompt layout (`packing.shared_prompt`): `pack_shared` stores each pair as one THD span
   [prompt | chosen | rejected] (the prompt and its images once; `PackedBatch.segment_cu_seqlens_padded` marks the
   segments); `plan_bins(..., shared_lengths=...)` sizes such spans; `response_sequence_ids` maps tokens to the loss's
   chosen/rejected sequences; the attention of that layout is local_spec.shared_prompt_attention (SDPA, two calls
   per pair); the Mamba side is `mamba_torch.mamba_split_conv1d_scan_shared_prompt`.
   `shared_prompt_token_counts` compares the tokens of both layouts under one bin budget.

`synthetic_mmpr_lengths`, `deal_round_robin` and `rank_imbalance` are shared with the benchmark; `rank_imbalance`
and `packing_efficiency` also fill `Plan.stats`.

Run `python pack.py` to print the packing efficiency and the DP imbalance of a synthetic MMPR-like step.
Tests: `pytest tests/test_pack.py` (shared-prompt layout: `pytest tests/test_shared_prompt.py`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

IGNORE_INDEX = -100  # label of positions that predict nothing (sequence ends, padding); torch cross_entropy's default

# Cost model of one sequence of L tokens, in "LM token" units: L + L^2 / ATTENTION_QUADRATIC_TOKENS.
# Derivation for Nemotron-3-Nano (its config.json; ~3.58e9 active parameters with embedding and output layer, ~3.23e9
# without the 131072 x 2688 input embedding table as monitor.active_params counts them; the constant is rounded): the
# linear part is ~2 * 3.58e9 active params
# = 7.2e9 forward FLOPs per token; the quadratic part is the 6 attention layers with 32 heads x 128 = 4096 q dims:
# causal QK^T + AV = 2 * L^2 * 4096 FLOPs per layer, 4.9e4 * L^2 in all. 7.2e9 / 4.9e4 ~= 1.46e5 tokens: the
# quadratic term adds ~3% at L = 4096 (the hybrid is mostly Mamba and MoE, linear in L).
ATTENTION_QUADRATIC_TOKENS = 145_000.0


# ======================================================================================================================
# Validation


def validate_divisibility(divisible_by: int, tp: int, cp: int, sequence_parallel: bool) -> None:
    """Check `make_sequence_length_divisible_by` against the tensor/context-parallel layout.

    Every sequence is padded to a multiple of `divisible_by`. Context parallelism cuts each sequence into 2*CP equal
    chunks (load-balanced causal layout), so CP > 1 needs a multiple of 2*CP. Sequence parallelism splits the local
    token dimension over the TP ranks; with CP as well each rank's share of a sequence (L/CP) must still split over
    TP, hence 2*CP*TP. This is NeMo-RL's rule (nemo_rl/models/megatron/data.py::
    _get_pack_sequence_parameters_for_megatron).

    Raises:
        ValueError: naming the value, TP, CP, sequence parallelism and the required factor.
    """
    if divisible_by < 1:
        raise ValueError(f"packing.make_sequence_length_divisible_by = {divisible_by} must be >= 1")
    need = 1
    why = []
    if cp > 1:
        need *= 2 * cp
        why.append(f"2*CP = {2 * cp} (context parallelism cuts each sequence into 2*CP chunks)")
    if sequence_parallel and tp > 1:
        need *= tp
        why.append(f"TP = {tp} (sequence parallelism splits each rank's tokens over TP)")
    if divisible_by % need != 0:
        raise ValueError(
            f"packing.make_sequence_length_divisible_by = {divisible_by} must be a multiple of {need} "
            f"for TP = {tp}, CP = {cp}, sequence_parallel = {sequence_parallel}: " + " times ".join(why)
        )


def validate_packing_config(cfg) -> None:
    """Check `cfg.packing` against `cfg.parallel` before training (grouping key, divisibility).

    Raises:
        ValueError: pair_grouping_key is not "pair_index", the divisibility rule of `validate_divisibility` fails, or
            packing.shared_prompt (when the config has it) is true with context parallelism (not supported yet: the
            CP slices of a [prompt | chosen | rejected] span would need the shared-prompt masks across ranks; "auto"
            resolves to false there, `resolve_shared_prompt`).
    """
    if cfg.packing.pair_grouping_key != "pair_index":
        raise ValueError(
            f"packing.pair_grouping_key = {cfg.packing.pair_grouping_key!r}: only 'pair_index' is supported "
            "(the chosen and rejected rows of a pair must share a microbatch)"
        )
    p = cfg.parallel
    if getattr(cfg.packing, "shared_prompt", False) is True and p.context_parallel_size > 1:
        raise ValueError(
            f"packing.shared_prompt = true is not supported with parallel.context_parallel_size = "
            f"{p.context_parallel_size} yet; set packing.shared_prompt = \"auto\" (separate rows with CP) or false, "
            "or context_parallel_size = 1"
        )
    validate_divisibility(
        cfg.packing.make_sequence_length_divisible_by,
        p.tensor_model_parallel_size,
        p.context_parallel_size,
        p.sequence_parallel,
    )


def padded_length(length: int, divisible_by: int) -> int:
    """`length` rounded up to a multiple of `divisible_by` (tokens)."""
    return -(-length // divisible_by) * divisible_by


# ======================================================================================================================
# Planning: pairs -> bins -> DP ranks (pure Python)


def sequence_cost(padded_len: int) -> float:
    """Cost of one sequence of `padded_len` tokens in LM-token units: L + L^2 / ATTENTION_QUADRATIC_TOKENS."""
    return padded_len + padded_len * padded_len / ATTENTION_QUADRATIC_TOKENS


def token_cost(padded_len: int) -> float:
    """Cost of one sequence = its padded token count (the linear-only model)."""
    return float(padded_len)


@dataclass(frozen=True)
class Bin:
    """One packed microbatch: the pairs it holds, in packing order (each pair contributes chosen then rejected).

    `pair_ids` are the keys of the `lengths` mapping given to `plan_bins` (the data module's pair ids).
    A dummy bin (`dummy=True`) repeats a real pair (the step's smallest) with sample_mask 0: it only keeps every DP rank
    at the same number of microbatches; it adds no gradient and no count. `tokens` are padded tokens, `useful` real
    tokens (0 for a dummy), `cost` the sum of `cost_fn` over its sequences.
    """

    pair_ids: tuple[int, ...]
    tokens: int
    useful: int
    cost: float
    dummy: bool = False


@dataclass
class Plan:
    """The microbatches of one optimizer step.

    ranks[r][m] is microbatch m of DP rank r; every rank has `num_microbatches` bins. `dropped` lists oversized pairs
    dropped (only with drop_oversized=True). `stats` holds token loads per rank, the imbalance (busiest rank / mean,
    by tokens and by cost), the packing efficiency and the counts of bins, dummy bins, splits and drops.
    """

    ranks: list[list[Bin]]
    num_microbatches: int
    dropped: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def _pair_sizes(lens: tuple[int, int], divisible_by: int, cost_fn: Callable[[int], float]) -> tuple[int, int, float]:
    pc, pr = padded_length(lens[0], divisible_by), padded_length(lens[1], divisible_by)
    return pc + pr, lens[0] + lens[1], cost_fn(pc) + cost_fn(pr)


def _shared_pair_sizes(
    lens: tuple[int, int], shared: int, divisible_by: int, cost_fn: Callable[[int], float]
) -> tuple[int, int, float]:
    """(padded tokens, real tokens, cost) of a pair stored as one [prompt | chosen | rejected] span (`pack_shared`).

    lens = (chosen row, rejected row) full lengths; `shared` = tokens stored once (`shared_prefix_length`). The span
    holds Lc + Lr - shared real tokens, padded as a whole. Cost: the chosen sequence is [prompt | chosen] (Lc tokens),
    the rejected one [prompt | rejected (+ the span's padding)], and the prompt runs once, so
    cost = cost_fn(Lc) + cost_fn(Lr + pad) - cost_fn(shared): for `sequence_cost` the linear part is the span's tokens
    and the quadratic part the causal attention of both sequences (the rejected queries see the prompt keys too).
    """
    real = lens[0] + lens[1] - shared
    padded = padded_length(real, divisible_by)
    return padded, real, cost_fn(lens[0]) + cost_fn(lens[1] + padded - real) - cost_fn(shared)


def pair_bin_tokens(
    lengths: Mapping[int, tuple[int, int]], divisible_by: int, shared_lengths: Mapping[int, int] | None = None
) -> dict[int, int]:
    """The tokens each pair takes in a bin: both rows padded to `divisible_by` (`pack`), or its [prompt | chosen |
    rejected] span padded as a whole (`pack_shared`, with `shared_lengths`). The oversized-pair rule, stated once: a
    pair fits a bin iff this is <= packing.max_tokens_per_bin (`plan_bins` drops or refuses the others at a step,
    preflight.check_splits over a whole split at start)."""
    no_cost = float  # the cost model plays no part in the size
    if shared_lengths is None:
        return {p: _pair_sizes(tuple(lens), divisible_by, no_cost)[0] for p, lens in lengths.items()}
    return {p: _shared_pair_sizes(tuple(n), shared_lengths[p], divisible_by, no_cost)[0] for p, n in lengths.items()}


def first_fit_decreasing(
    sizes: Mapping[int, int], max_tokens_per_bin: int, max_sequences_per_bin: int
) -> list[list[int]]:
    """Bin items first-fit-decreasing: largest first (ties by smaller id), into the first bin with room.

    Args:
        sizes: item id -> size (tokens); every size must be <= max_tokens_per_bin.
        max_tokens_per_bin: token capacity of a bin.
        max_sequences_per_bin: item capacity of a bin (here: pairs).
    Returns:
        bins as lists of item ids, in opening order; deterministic for the same input.
    """
    order = sorted(sizes, key=lambda i: (-sizes[i], i))
    smallest = sizes[order[-1]] if order else 0
    bins: list[list[int]] = []
    loads: list[int] = []
    # Bins that can still take an item, in opening order: full bins are skipped, so one pair per bin is O(n).
    open_bins: list[int] = []
    for i in order:
        k = next((k for k, b in enumerate(open_bins) if loads[b] + sizes[i] <= max_tokens_per_bin), None)
        if k is not None:
            b = open_bins[k]
        else:
            k, b = len(open_bins), len(bins)
            bins.append([])
            loads.append(0)
            open_bins.append(b)
        bins[b].append(i)
        loads[b] += sizes[i]
        if len(bins[b]) == max_sequences_per_bin or loads[b] + smallest > max_tokens_per_bin:
            del open_bins[k]
    return bins


def deal_greedy(bins: Sequence[Bin], dp_size: int) -> list[list[Bin]]:
    """Deal bins to DP ranks, largest cost first, each to the least-loaded rank that still has a free slot.

    len(bins) must be a multiple of dp_size; every rank gets len(bins) / dp_size bins (LPT scheduling with equal
    counts). Ties go to the lower rank, so the result is deterministic. Within a rank, bins keep the dealing order.
    """
    if len(bins) % dp_size:
        raise ValueError(f"{len(bins)} bins cannot be dealt evenly to {dp_size} DP ranks")
    per_rank = len(bins) // dp_size
    order = sorted(range(len(bins)), key=lambda i: (-bins[i].cost, i))
    ranks: list[list[Bin]] = [[] for _ in range(dp_size)]
    heap = [(0.0, r) for r in range(dp_size)]  # (load, rank) of ranks with a free slot; ties -> lower rank
    for i in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(bins[i])
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + bins[i].cost, r))
    return ranks


def deal_round_robin(bins: Sequence[Bin], dp_size: int) -> list[list[Bin]]:
    """Deal bins to DP ranks in the given order, bin i to rank i % dp_size (NeMo-RL's deal; the benchmark baseline)."""
    if len(bins) % dp_size:
        raise ValueError(f"{len(bins)} bins cannot be dealt evenly to {dp_size} DP ranks")
    return [list(bins[r::dp_size]) for r in range(dp_size)]


def rank_imbalance(ranks: Sequence[Sequence[Bin]], key: str = "tokens") -> float:
    """Busiest rank's load / mean load over DP ranks (1.0 = perfect), load = sum of `key` ("tokens" or "cost")."""
    loads = [sum(getattr(b, key) for b in r) for r in ranks]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def packing_efficiency(plan: Plan) -> float:
    """Useful tokens / all tokens processed in the step (real tokens of real pairs over padded tokens of all bins,
    dummy bins included). THD bins are not padded to max_tokens_per_bin, so the waste is per-sequence padding plus
    dummy bins."""
    total = sum(b.tokens for r in plan.ranks for b in r)
    useful = sum(b.useful for r in plan.ranks for b in r)
    return useful / total if total else 1.0


def _split_bins_to_multiple(
    bins: list[list[int]], sizes: Mapping[int, int], multiple: int
) -> tuple[list[list[int]], int]:
    """Split multi-pair bins until the bin count is a multiple of `multiple` (or no bin can be split).

    A real split moves work instead of adding a dummy bin; halves never exceed the original bin's capacities.
    The bin with the most tokens among those with >= 2 pairs is split; its pairs (largest first) alternate to the
    lighter half. Returns the new bins and the number of splits.
    """
    splits = 0
    bins = [list(b) for b in bins]
    while len(bins) % multiple:
        cand = [i for i, b in enumerate(bins) if len(b) >= 2]
        if not cand:
            break
        i = max(cand, key=lambda i: (sum(sizes[p] for p in bins[i]), -i))
        a: list[int] = []
        b: list[int] = []
        for p in sorted(bins[i], key=lambda p: (-sizes[p], p)):
            (a if sum(sizes[q] for q in a) <= sum(sizes[q] for q in b) else b).append(p)
        bins[i] = a
        bins.append(b)
        splits += 1
    return bins, splits


def plan_bins(
    lengths: Mapping[int, tuple[int, int]],
    max_tokens_per_bin: int,
    max_sequences_per_bin: int,
    dp_size: int,
    divisible_by: int = 1,
    drop_oversized: bool = False,
    cost_fn: Callable[[int], float] = sequence_cost,
    balance: str = "greedy",
    shared_lengths: Mapping[int, int] | None = None,
) -> Plan:
    """Plan the packed microbatches of one optimizer step.

    Args:
        lengths: pair id -> (chosen row tokens, rejected row tokens) for the pairs of this step (the global batch,
            `policy.train_global_batch_size` pairs); full rows (prompt + response), unpadded.
        max_tokens_per_bin: bin capacity in padded tokens (both rows of a pair count).
        max_sequences_per_bin: bin capacity in pairs (1 = one chosen/rejected pair per bin).
        dp_size: data-parallel ranks; every rank gets the same number of bins.
        divisible_by: each row is padded to a multiple of this (packing.make_sequence_length_divisible_by).
        drop_oversized: drop (and count in `Plan.dropped`) pairs larger than a bin instead of raising.
        cost_fn: cost of one padded sequence, used to balance ranks; default `sequence_cost` (tokens plus the
            attention quadratic term), `token_cost` for tokens only.
        balance: "greedy" (largest cost first to the least-loaded rank) or "round_robin" (the baseline: bins in the
            order their pairs arrive in `lengths`, i.e. the step's data order, bin i to rank i % DP).
        shared_lengths: pair id -> tokens stored once per pair in the shared-prompt layout (`shared_prefix_length`;
            `packing.shared_prompt`), or None for separate rows. With it a pair's size is its [prompt | chosen |
            rejected] span, Lc + Lr - shared padded as a whole, and its cost that of `_shared_pair_sizes`.
    Returns:
        Plan with ranks[r] = list of Bin, and stats (see `Plan`).
    Raises:
        ValueError: an oversized pair (naming the pair, its chosen/rejected sizes after padding and the limit) unless
            drop_oversized; no pairs left; non-positive capacities or row lengths.
    """
    if max_tokens_per_bin < 1 or max_sequences_per_bin < 1 or dp_size < 1 or divisible_by < 1:
        raise ValueError(
            f"need positive capacities: max_tokens_per_bin={max_tokens_per_bin}, "
            f"max_sequences_per_bin={max_sequences_per_bin}, dp_size={dp_size}, divisible_by={divisible_by}"
        )
    for pid, lens in lengths.items():
        if len(lens) != 2 or min(lens) < 1:
            raise ValueError(f"pair {pid}: lengths {tuple(lens)} must be (chosen tokens, rejected tokens), both >= 1")
    if shared_lengths is None:
        info = {pid: _pair_sizes(tuple(lens), divisible_by, cost_fn) for pid, lens in lengths.items()}
    else:
        for pid, lens in lengths.items():
            k = shared_lengths.get(pid)
            if k is None or not 0 <= k < min(lens):
                raise ValueError(f"pair {pid}: shared length {k} must be in [0, {min(lens)}) for rows {tuple(lens)}")
        info = {pid: _shared_pair_sizes(tuple(lens), shared_lengths[pid], divisible_by, cost_fn)
                for pid, lens in lengths.items()}
    dropped = []
    for pid in sorted(info):
        if info[pid][0] > max_tokens_per_bin:
            if not drop_oversized:
                c, r = lengths[pid]
                how = (f"chosen {c} -> {padded_length(c, divisible_by)}, rejected {r} -> "
                       f"{padded_length(r, divisible_by)}" if shared_lengths is None else
                       f"chosen {c} + rejected {r} - shared prompt {shared_lengths[pid]} = {info[pid][1]} -> "
                       f"{info[pid][0]}")
                raise ValueError(
                    f"pair {pid} needs {info[pid][0]} tokens ({how} after padding to a multiple of {divisible_by})"
                    f" but packing.max_tokens_per_bin = {max_tokens_per_bin}; raise the limit, shorten "
                    "data.max_seq_length, or set packing.drop_oversized_pairs = true"
                )
            dropped.append(pid)
    dropped_set = set(dropped)
    kept = {pid: v for pid, v in info.items() if pid not in dropped_set}
    if not kept:
        raise ValueError(f"no pair of this step fits in a bin ({len(dropped)} dropped as oversized)")
    sizes = {pid: v[0] for pid, v in kept.items()}
    groups = first_fit_decreasing(sizes, max_tokens_per_bin, max_sequences_per_bin)
    ffd_bins = len(groups)
    groups, splits = _split_bins_to_multiple(groups, sizes, dp_size)

    def make_bin(ids: Sequence[int], dummy: bool = False) -> Bin:
        return Bin(
            pair_ids=tuple(ids),
            tokens=sum(kept[p][0] for p in ids),
            useful=0 if dummy else sum(kept[p][1] for p in ids),
            cost=sum(kept[p][2] for p in ids),
            dummy=dummy,
        )

    bins = [make_bin(g) for g in groups]
    # Dummy bins: a copy of the step's smallest pair (ties: smaller id), marked sample_mask 0 when packed; it runs
    # the normal code path (vision included) so no rank waits in a collective, and contributes nothing.
    smallest = min(sizes, key=lambda p: (sizes[p], p))
    n_dummy = (-len(bins)) % dp_size
    bins += [make_bin([smallest], dummy=True) for _ in range(n_dummy)]
    if balance == "greedy":
        ranks = deal_greedy(bins, dp_size)
    elif balance == "round_robin":
        arrival = {pid: i for i, pid in enumerate(lengths)}
        ranks = deal_round_robin(sorted(bins, key=lambda b: (b.dummy, min(arrival[p] for p in b.pair_ids))), dp_size)
    else:
        raise ValueError(f"balance = {balance!r}; choose 'greedy' or 'round_robin'")
    plan = Plan(ranks=ranks, num_microbatches=len(bins) // dp_size, dropped=dropped)
    plan.stats = {
        "pairs": len(kept),
        "dropped_oversized": len(dropped),
        "bins": len(bins),
        "bins_ffd": ffd_bins,
        "bin_splits": splits,
        "dummy_bins": n_dummy,
        "tokens_per_rank": [sum(b.tokens for b in r) for r in ranks],
        "imbalance_tokens": rank_imbalance(ranks, "tokens"),
        "imbalance_cost": rank_imbalance(ranks, "cost"),
        "efficiency": packing_efficiency(plan),
    }
    return plan


def resolve_shared_prompt(cfg, kernels) -> str:
    """Resolve `packing.shared_prompt = "auto"` in place to true or false, and describe the pair layout of the run.

    "auto" is on exactly where the shared-prompt layout runs the code that is checked exact against separate rows: the
    local spec with mamba_torch (tests/test_shared_prompt_model.py, on the CPU: log-prob sums, the MPO loss and every
    gradient to 1e-5, TP/DP included; on CUDA the same torch code, its attention SDPA with the same masks or, with
    `attention varlen`, one varlen FlashAttention call over gathered keys, whose checks are tests/test_gpu.py items 7
    and 8) and no context parallelism. It is off with the Transformer Engine spec (its shared-prompt
    attention, omni_model.shared_prompt_te_attention, is checked only against a CPU stand-in of TE), with mamba-ssm's
    kernels (the shared scan then runs causal-conv1d's compiled conv and mamba-ssm's Triton scan on the GPU, checked
    only through Triton's CPU interpreter, the conv not at all), with the Triton set (`mamba triton`: checked only in
    the interpreter so far) and with context parallelism (not supported). An
    explicit true or false is kept as it is (true with CP is refused later by `validate_packing_config`). Called once at
    start by train.main, before preflight, so config.json and the checkpoints record the resolved value; the tests'
    configs go through it too (tests/step_cases.tiny_config), bench.py sets true / false itself.

    Args:
        cfg: the Config (its `packing.shared_prompt` is rewritten when "auto"; `parallel` is read).
        kernels: kernel_selection.Kernels of this process (select_kernels()); its `spec` and `mamba` are read.

    Returns: the layout for the start-up `world` line: "shared prompt" / "separate rows", with "(auto)" or
        "(auto: <why not>)" when "auto" chose it.
    """
    pk = cfg.packing
    if pk.shared_prompt != "auto":
        return "shared prompt" if pk.shared_prompt else "separate rows"
    cp = cfg.parallel.context_parallel_size
    why = []
    if cp > 1:
        why.append(f"the shared-prompt layout is not supported with parallel.context_parallel_size = {cp}")
    if kernels.spec == "te":
        why.append("the Transformer Engine spec's shared-prompt attention has not run on a GPU yet")
    if kernels.mamba in ("mamba-ssm", "triton"):
        which = {"mamba-ssm": "mamba-ssm's kernels", "triton": "the Triton Mamba kernels"}[kernels.mamba]
        why.append(f"{which} in the shared-prompt scan have not run on a GPU yet")
    pk.shared_prompt = not why
    if not why:
        return "shared prompt (auto)"
    opt_in = "" if cp > 1 else "; packing.shared_prompt=true turns it on"
    return f"separate rows (auto: {'; '.join(why)}{opt_in})"


def shared_prompt_on(packing) -> bool:
    """`packing.shared_prompt` as resolved at start (`resolve_shared_prompt`).

    Raises: ValueError: it is still "auto" (a config that did not go through `resolve_shared_prompt`)."""
    if not isinstance(packing.shared_prompt, bool):
        raise ValueError(f"packing.shared_prompt = {packing.shared_prompt!r} is resolved at start by "
                         "pack.resolve_shared_prompt(cfg, kernel_selection.select_kernels()); call it before planning")
    return packing.shared_prompt


def plan_step(lengths: Mapping[int, tuple[int, int]], packing, dp_size: int,
              shared_lengths: Mapping[int, int] | None = None) -> Plan:
    """`plan_bins` with the capacities, padding, drop switch and layout of the `packing` section (config.PackingConfig,
    checked once at start by `validate_packing_config`, preflight.check_inputs). `shared_lengths` (as in `plan_bins`:
    prompt tokens stored once per pair) is used when `packing.shared_prompt` is on and ignored for separate rows.

    Raises: ValueError: `packing.shared_prompt` without `shared_lengths`, or still "auto" (`shared_prompt_on`); those
        of `plan_bins`."""
    pk = packing
    shared = shared_prompt_on(pk)
    if shared and shared_lengths is None:
        raise ValueError("packing.shared_prompt plans need shared_lengths (PairIndex.shared_lengths)")
    return plan_bins(
        lengths,
        pk.max_tokens_per_bin,
        pk.max_sequences_per_bin,
        dp_size,
        divisible_by=pk.make_sequence_length_divisible_by,
        drop_oversized=pk.drop_oversized_pairs,
        shared_lengths=shared_lengths if shared else None,
    )


# ======================================================================================================================
# Synthetic MMPR-like lengths (tests and benchmark)


def synthetic_mmpr_lengths(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int]]:
    """Pair id -> (chosen tokens, rejected tokens) modelling MMPR rows for Nemotron-Omni.

    Prompt = one image + 40..72 text tokens; the image grid (16-px patches) is gh x gw with gh in 32..128 and gw in
    32..104 (even), image tokens = gh*gw/4 (2x2 pixel shuffle) in 256..3328, so prompts span ~300..3400 tokens and are
    dominated by image tokens. Responses are log-uniform in 50..1500 tokens; the rejected response is the chosen
    length times exp(N(0, 0.3)), clipped to 50..1500. Deterministic for (n_pairs, seed).
    """
    return {i: (p + c, p + r) for i, (p, c, r) in synthetic_mmpr_parts(n_pairs, seed).items()}


def synthetic_mmpr_parts(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int, int]]:
    """Pair id -> (prompt tokens, chosen response tokens, rejected response tokens), the parts of
    `synthetic_mmpr_lengths` (same draws: its rows are prompt + response). For the shared-prompt layout's sizes."""
    rng = random.Random(seed)
    out = {}
    for i in range(n_pairs):
        gh, gw = 2 * rng.randint(16, 64), 2 * rng.randint(16, 52)
        prompt = gh * gw // 4 + rng.randint(40, 72)
        chosen = int(math.exp(rng.uniform(math.log(50), math.log(1500))))
        rejected = min(1500, max(50, int(chosen * math.exp(rng.gauss(0.0, 0.3)))))
        out[i] = (prompt, chosen, rejected)
    return out


# ======================================================================================================================
# Packing one bin into THD tensors


@dataclass
class PreferencePair:
    """One preference pair as the data module produces it (tensors on CPU).

    chosen_ids / rejected_ids: [L] int64, full rows (prompt + response), without padding.
    chosen_loss_mask / rejected_loss_mask: [L] bool, True where token t is a response token of the final assistant
        turn, i.e. a token the model must predict (from position t-1). Position 0 can never be True.
    pixel_values: [sum over images of gh*gw, 3*16*16] float, the pair's image patches (shared by both rows).
    image_grid_hw: [n_images, 2] int64, the patch grid (gh, gw) of each image.
    image_token_counts: [n_images] int64, `<image>` tokens each image expands to in the rows.
    """

    pair_index: int
    chosen_ids: torch.Tensor
    rejected_ids: torch.Tensor
    chosen_loss_mask: torch.Tensor
    rejected_loss_mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_hw: torch.Tensor
    image_token_counts: torch.Tensor


@dataclass
class PackedBatch:
    """One packed THD microbatch of S = 2 * P sequences (P pairs, each chosen then rejected), T tokens in all.

    Token tensors, [1, T]:
        input_ids (int64): the rows, each padded with pad_token_id to a multiple of divisible_by.
        labels (int64): pre-rolled per sequence, labels[t] = input_ids[t + 1] when t + 1 is in the same sequence's real
            tokens; IGNORE_INDEX (-100) at the last real token of a sequence and on padding. Never crosses sequences.
        loss_mask (bool): loss_mask[t] is True iff log p(labels[t] | tokens <= t) counts, i.e. the row's response mask
            shifted by one (loss_mask[t] = row_loss_mask[t + 1]); False on padding and at each sequence's last token.
            Where True, labels[t] is a real token id.
        position_ids (int64): 0, 1, ... restarting at each sequence start (padding continues the count).
    Sequence metadata:
        cu_seqlens (int32 [S+1]): cumulative real lengths; cu_seqlens_padded (int32 [S+1]): cumulative padded lengths
            (sequence s occupies input_ids[0, cu_seqlens_padded[s]:cu_seqlens_padded[s+1]]); max_seqlen (int): the
            largest padded sequence length.
        pair_index (int64 [S]): the pair of each sequence (-1 for a dummy bin); is_chosen (bool [S]);
        sample_mask (float32 [S]): 1 for real sequences, 0 for a dummy bin (no gradient, no count).
    Media, stored once per pair (vision once per pair; both rows of pair p use the same images):
        pixel_values (float [N_patches, 3*16*16]): the pairs' patches in pair order.
        image_grid_hw (int64 [N_images, 2]); image_token_counts (int64 [N_images]).
        media_index (int64 [S]): media slot (= pair position in the bin, 0..P-1) of each sequence.
        media_image_offsets (int64 [P+1]): images of slot m are image_grid_hw[offsets[m]:offsets[m+1]]; the
            `<image>` tokens of a sequence take their embeddings from those images, in order.
        media_patch_offsets (int64 [P+1]): the same in rows of pixel_values.

    Shared-prompt layout (`pack_shared`, `packing.shared_prompt`; `segment_cu_seqlens_padded` is not None): each pair
    is ONE THD sequence [prompt | chosen response | rejected response | padding], the prompt (and its `<image>` tokens)
    stored once. Then cu_seqlens / cu_seqlens_padded / max_seqlen describe the pair spans ([P+1]), media_index is
    arange(P) (one media slot per span), and pair_index / is_chosen / sample_mask stay per response ([2P], chosen then
    rejected, as in the separate layout, so `mpo_loss` takes them unchanged). The extra fields:
        segment_cu_seqlens (int32 [3P+1]): cumulative real lengths of the segments prompt_0, chosen_0, rejected_0,
            prompt_1, ...; segment_cu_seqlens_padded (int32 [3P+1]): their boundaries in the row (segment j of pair i
            is input_ids[0, b[3i+j]:b[3i+j+1]]; the pair's padding belongs to its rejected segment, so
            segment_cu_seqlens_padded[3i] = cu_seqlens_padded[i]).

    host: the batch as built, on the CPU, kept by `to` (None until the batch is moved): what the step needs as host
    numbers (offsets, image grids, image-token positions) is read from it, never from the device copy, so the step
    does not wait for the GPU to read them back (`host_view`).
    The chosen sequence is prompt + chosen segment, the rejected sequence prompt + rejected segment: the rejected
    tokens must see the prompt but never the chosen segment (attention: local_spec.shared_prompt_attention in
    ThdDotProductAttention; Mamba: `mamba_torch.mamba_split_conv1d_scan_shared_prompt`), and their log-probs are
    summed with `response_sequence_ids`.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    pair_index: torch.Tensor
    is_chosen: torch.Tensor
    sample_mask: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_hw: torch.Tensor
    image_token_counts: torch.Tensor
    media_index: torch.Tensor
    media_image_offsets: torch.Tensor
    media_patch_offsets: torch.Tensor
    segment_cu_seqlens: torch.Tensor | None = None
    segment_cu_seqlens_padded: torch.Tensor | None = None
    host: PackedBatch | None = field(default=None, repr=False, compare=False)

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def shared_prompt(self) -> bool:
        """True for the shared-prompt layout (`pack_shared`)."""
        return self.segment_cu_seqlens_padded is not None

    @property
    def num_responses(self) -> int:
        """Sequences the loss sees (chosen and rejected rows, 2 per pair) in either layout: len(pair_index)."""
        return self.pair_index.numel()

    def loss_seq_ids(self) -> torch.Tensor:
        """Each token's loss-sequence index (its response's index in pair_index, 0 .. S-1; mpo_loss's `seq_ids`), int64
        [T] on the batch's device: token_sequence_ids for separate rows, response_sequence_ids for the shared-prompt
        layout (prompt tokens map to the dropped id S)."""
        T = self.input_ids.shape[1]
        if self.shared_prompt:
            return response_sequence_ids(self.segment_cu_seqlens_padded, T)
        return token_sequence_ids(self.cu_seqlens_padded, T, check=False)

    @property
    def num_pairs(self) -> int:
        """Pairs in the bin, P (dummy pairs included; `mpo_loss.count_valid_pairs` counts the valid ones)."""
        return self.media_image_offsets.numel() - 1

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        """Copy of the batch with every tensor moved to `device`: the one move of a step's batch (train.load_bins;
        the device rule is stated in train.py's docstring). The copy's `host` is this batch (or its own host): new
        tensors even on the CPU, so the CPU path keeps the host copy and the step's tensors apart as a GPU does."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device, non_blocking=non_blocking, copy=True) if isinstance(v, torch.Tensor) else v
        kw["host"] = self.host if self.host is not None else self
        return PackedBatch(**kw)


def _check_pair(p: PreferencePair, image_token_id: int) -> None:
    for side in ("chosen", "rejected"):
        ids, mask = getattr(p, f"{side}_ids"), getattr(p, f"{side}_loss_mask")
        if ids.dim() != 1 or ids.dtype != torch.int64 or ids.numel() < 1:
            raise ValueError(
                f"pair {p.pair_index}: {side}_ids must be a non-empty 1-D int64 tensor, got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        if mask.shape != ids.shape or mask.dtype != torch.bool:
            raise ValueError(
                f"pair {p.pair_index}: {side}_loss_mask must be bool of shape {tuple(ids.shape)}, got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
        if bool(mask[0]):
            raise ValueError(
                f"pair {p.pair_index}: {side}_loss_mask[0] is True but the first token of a row has no "
                "preceding token to predict it from"
            )
    grid = p.image_grid_hw
    if grid.dim() != 2 or grid.shape[1] != 2:
        raise ValueError(f"pair {p.pair_index}: image_grid_hw must be [n_images, 2], got {tuple(grid.shape)}")
    n_img = grid.shape[0]
    if p.image_token_counts.shape != (n_img,):
        raise ValueError(
            f"pair {p.pair_index}: image_token_counts has shape {tuple(p.image_token_counts.shape)}, "
            f"expected ({n_img},) for {n_img} images"
        )
    patches = int(grid.prod(dim=-1).sum())
    if p.pixel_values.shape[0] != patches:
        raise ValueError(
            f"pair {p.pair_index}: pixel_values has {p.pixel_values.shape[0]} patch rows but the grids "
            f"{p.image_grid_hw.tolist()} need {patches}"
        )
    expected = int(p.image_token_counts.sum())
    for side in ("chosen", "rejected"):
        found = int((getattr(p, f"{side}_ids") == image_token_id).sum())
        if found != expected:
            raise ValueError(
                f"pair {p.pair_index}: the {side} row has {found} <image> tokens (id {image_token_id}) "
                f"but its {n_img} image(s) expand to {expected} tokens "
                f"(image_token_counts {p.image_token_counts.tolist()})"
            )


def _check_bin(pairs: Sequence[PreferencePair], divisible_by: int) -> None:
    """The checks `pack` and `pack_shared` make before packing: a non-empty bin, divisible_by >= 1 (ValueError)."""
    if not pairs:
        raise ValueError("cannot pack an empty bin")
    if divisible_by < 1:
        raise ValueError(f"divisible_by = {divisible_by} must be >= 1")


def _packed_batch(pairs: Sequence[PreferencePair], token_parts: tuple[list, list, list, list], cu: list[int],
                  cu_pad: list[int], pair_index: list[int], is_chosen: list[bool], dummy: bool,
                  media_index: torch.Tensor, **segments: torch.Tensor) -> PackedBatch:
    """The PackedBatch of `pack` / `pack_shared` from their per-piece token tensors (ids, labels, loss masks,
    positions: lists of 1-D tensors concatenated in order), offsets and per-sequence pair metadata; the images of
    `pairs` are stored once per pair, in pair order. `segments`: the shared-prompt layout's segment offsets."""
    ids, labels, lmask, pos = (torch.cat(t) for t in token_parts)
    cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int64)
    return PackedBatch(
        input_ids=ids[None],
        labels=labels[None],
        loss_mask=lmask[None],
        position_ids=pos.to(torch.int64)[None],
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_padded=cu_pad_t,
        max_seqlen=int((cu_pad_t[1:] - cu_pad_t[:-1]).max()),
        pair_index=torch.tensor(pair_index, dtype=torch.int64),
        is_chosen=torch.tensor(is_chosen, dtype=torch.bool),
        sample_mask=torch.full((len(is_chosen),), 0.0 if dummy else 1.0, dtype=torch.float32),
        pixel_values=torch.cat([p.pixel_values for p in pairs], dim=0),
        image_grid_hw=torch.cat([p.image_grid_hw.to(torch.int64) for p in pairs], dim=0),
        image_token_counts=torch.cat([p.image_token_counts.to(torch.int64) for p in pairs], dim=0),
        media_index=media_index,
        media_image_offsets=torch.cat([zero, torch.tensor([p.image_grid_hw.shape[0] for p in pairs]).cumsum(0)]),
        media_patch_offsets=torch.cat([zero, torch.tensor([p.pixel_values.shape[0] for p in pairs]).cumsum(0)]),
        **segments,
    )


def pack(
    pairs: Sequence[PreferencePair],
    divisible_by: int,
    image_token_id: int,
    pad_token_id: int = 0,
    dummy: bool = False,
) -> PackedBatch:
    """Pack the pairs of one bin into a THD microbatch (layout: see `PackedBatch`).

    Sequence order: pair 0 chosen, pair 0 rejected, pair 1 chosen, ... Each row is padded to a multiple of
    `divisible_by` (pad tokens: input pad_token_id, label IGNORE_INDEX, loss_mask False); the pack itself is not padded
    to the bin size. With `dummy=True` (a Plan's dummy bin) every sequence gets sample_mask 0 and pair_index -1.

    Raises:
        ValueError: empty bin; malformed pair tensors; a response mask set on position 0; pixel rows that do not match
            the grids; a row whose `<image>` token count differs from the sum of its pair's image_token_counts (both
            counts in the message).
    """
    _check_bin(pairs, divisible_by)
    ids, labels, lmask, pos = [], [], [], []
    cu, cu_pad = [0], [0]
    pair_index, is_chosen = [], []
    for p in pairs:
        _check_pair(p, image_token_id)
        for chosen in (True, False):
            row = p.chosen_ids if chosen else p.rejected_ids
            rmask = p.chosen_loss_mask if chosen else p.rejected_loss_mask
            n = row.numel()
            n_pad = padded_length(n, divisible_by)
            seq_ids = torch.full((n_pad,), pad_token_id, dtype=torch.int64)
            seq_ids[:n] = row
            seq_labels = torch.full((n_pad,), IGNORE_INDEX, dtype=torch.int64)
            seq_labels[: n - 1] = row[1:]
            seq_mask = torch.zeros(n_pad, dtype=torch.bool)
            seq_mask[: n - 1] = rmask[1:]
            ids.append(seq_ids)
            labels.append(seq_labels)
            lmask.append(seq_mask)
            pos.append(torch.arange(n_pad, dtype=torch.int64))
            cu.append(cu[-1] + n)
            cu_pad.append(cu_pad[-1] + n_pad)
            pair_index.append(-1 if dummy else p.pair_index)
            is_chosen.append(chosen)
    # Gaps between real sequences (padding) make cu_seqlens and cu_seqlens_padded differ; attention uses both.
    return _packed_batch(pairs, (ids, labels, lmask, pos), cu, cu_pad, pair_index, is_chosen, dummy,
                         media_index=torch.arange(len(is_chosen), dtype=torch.int64) // 2)


def unpack(batch: PackedBatch) -> list[dict[str, torch.Tensor]]:
    """Split a PackedBatch back into its sequences (real tokens only, padding removed): the inverse of `pack`, used by
    the tests as the oracle of packing (training never unpacks).

    Returns, per sequence s: input_ids, labels, loss_mask, position_ids ([L_s] each), plus `row_loss_mask` [L_s] bool,
    the un-shifted response mask (row_loss_mask[t + 1] = loss_mask[t], row_loss_mask[0] = False), so that
    unpack(pack(pairs)) gives back the pairs' ids and loss masks.
    """
    out = []
    for s in range(batch.num_sequences):
        a = int(batch.cu_seqlens_padded[s])
        n = int(batch.cu_seqlens[s + 1] - batch.cu_seqlens[s])
        d = {k: getattr(batch, k)[0, a : a + n] for k in ("input_ids", "labels", "loss_mask", "position_ids")}
        row_mask = torch.zeros(n, dtype=torch.bool)
        row_mask[1:] = d["loss_mask"][: n - 1]
        d["row_loss_mask"] = row_mask
        out.append(d)
    return out


def packed_seq_params(batch: PackedBatch):
    """megatron-core `PackedSeqParams` for a PackedBatch; see `thd_packed_seq_params`. A convenience the tests use
    (OmniModel builds its PackedSeqParams with `thd_packed_seq_params` directly)."""
    return thd_packed_seq_params(batch.cu_seqlens, batch.cu_seqlens_padded, batch.max_seqlen)


def thd_packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int,
                          host: tuple[list[int], list[int]] | None = None):
    """megatron-core `PackedSeqParams` of one packed THD row (self-attention: q and kv share cu_seqlens).

    Args: cu_seqlens / cu_seqlens_padded: [S+1] real / padded sequence boundaries (cast to int32). max_seqlen: the
        longest padded sequence, in tokens. host: the same two offsets as lists of ints (from the batch's host copy),
        or None to read them from the tensors.
    Returns: PackedSeqParams (qkv_format "thd"). Its `total_tokens` field is the full (un-CP-sliced) packed length
        T = cu_seqlens_padded[-1], and `seq_idx` [1, T] int32 the sequence of each token (megatron-core's Mamba
        layers read it; without it, sequences mix inside them), computed here on the offsets' device with its size
        known (megatron-core's own derivation sizes it from the data: a read back from the GPU); `pad_between_seqs`
        tells TE that padded and real boundaries differ. `cu_seqlens_padded_host` (an attribute added here) holds the
        host offsets for local_spec's varlen attention.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cu_pad = cu_seqlens.to(torch.int32), cu_seqlens_padded.to(torch.int32)
    cu_h, cu_pad_h = host if host is not None else (cu.tolist(), cu_pad.tolist())
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=int(max_seqlen),
        max_seqlen_kv=int(max_seqlen),
        pad_between_seqs=cu_h != cu_pad_h,
    )
    psp.total_tokens = cu_pad_h[-1]
    lengths = (cu_pad[1:] - cu_pad[:-1]).long()
    psp.seq_idx = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_pad.device, dtype=torch.int32),
                                          lengths, output_size=cu_pad_h[-1]).unsqueeze(0)
    psp.cu_seqlens_padded_host = tuple(cu_pad_h)
    return psp


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; a CPU tensor goes to a GPU from pinned memory without blocking (a copy from pageable memory
    waits for the GPU's queue to drain: a host synchronisation)."""
    device = torch.device(device)
    if t.device == device or device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_view(batch):
    """The CPU copy of a batch for host reads: PackedBatch.host when the batch was moved, else the batch itself (a
    CPU batch, or a dict of tensors as the tests build them)."""
    return getattr(batch, "host", None) or batch


def token_sequence_ids(cu_seqlens_padded: torch.Tensor, total_tokens: int, check: bool = True) -> torch.Tensor:
    """The sequence index of every token of a packed THD row.

    Args:
        cu_seqlens_padded: [S+1] int32/int64 cumulative padded sequence lengths, starting at 0.
        total_tokens: T, the row length; tokens at or after cu_seqlens_padded[-1] (bin padding) get the id S.

    Returns:
        [T] int64 in [0, S]. With context parallelism, index this with the same CP partition index as input_ids.

    Raises:
        ValueError (with `check`): cu_seqlens_padded not starting at 0, decreasing, or longer than total_tokens. The
            step passes check=False for a batch's own offsets (built by `pack`; reading them back from the device
            would wait for the GPU).
    """
    cu = cu_seqlens_padded.long()  # computed where cu_seqlens_padded lives (train.py's device rule)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens_padded must be a non-empty 1-D tensor; got shape {tuple(cu.shape)}")
    if check and (cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1] > total_tokens):
        raise ValueError(f"cu_seqlens_padded must rise from 0 to at most T = {total_tokens}; got {cu.tolist()}")
    lengths = torch.cat([cu[1:] - cu[:-1], total_tokens - cu[-1:]])
    return torch.repeat_interleave(torch.arange(cu.numel(), dtype=torch.long, device=cu.device), lengths,
                                   output_size=total_tokens)


def routing_padding_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, total_tokens: int,
                         sample_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens of a packed THD row that must take no part in MoE routing statistics (megatron-core's
    `padding_mask` convention: True = padding, excluded from the expert-bias token counts, the aux loss and the z-loss).

    Args:
        cu_seqlens: [S+1] cumulative real lengths; cu_seqlens_padded: [S+1] cumulative padded lengths.
        total_tokens: T, the row length; tokens at or after cu_seqlens_padded[-1] are padding.
        sample_mask: optional float [S]; every token of a sequence with weight 0 (a dummy bin) is padding too.

    Returns:
        bool [T] on cu_seqlens_padded's device: True at each sequence's padding (between cu_seqlens_padded[s] +
        real length and cu_seqlens_padded[s+1]), past the last sequence, and on zero-weight sequences. The offsets
        are taken as `pack` builds them (not read back from the device to be checked).
    """
    seq_ids = token_sequence_ids(cu_seqlens_padded, total_tokens, check=False)
    cu, cu_pad = cu_seqlens.long().to(seq_ids.device), cu_seqlens_padded.long().to(seq_ids.device)
    real = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])  # the trailing run (id S) has no real token
    start = torch.cat([cu_pad[:-1], cu_pad[-1:]])
    pos = torch.arange(total_tokens, device=seq_ids.device) - start[seq_ids]
    pad = pos >= real[seq_ids]
    if sample_mask is not None:
        dead = torch.cat([sample_mask.to(seq_ids.device) == 0, torch.ones(1, dtype=torch.bool, device=seq_ids.device)])
        pad |= dead[seq_ids]
    return pad


# ======================================================================================================================
# Context-parallel slicing


def cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token positions of the packed sequence that context-parallel rank `cp_rank` keeps.

    Each sequence's padded length L is cut into 2*CP equal chunks of L/(2*CP) tokens; rank r keeps chunk r then
    chunk 2*CP-1-r (the load-balanced causal layout of megatron-core / Transformer Engine's
    `thd_get_partitioned_indices`), sequence after sequence. Use as `x.index_select(dim, index)` on ids, labels,
    masks, position ids or embeddings (the sequence dim).

    Args:
        cu_seqlens_padded: int [S+1] cumulative padded lengths, starting at 0 (every length divisible by 2*CP).
    Returns:
        LongTensor [T / CP] on cu_seqlens_padded's device.
    Raises:
        ValueError: cp_rank out of range, offsets that do not start at 0, or a padded length not divisible by 2*CP.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank = {cp_rank} not in [0, cp_size = {cp_size})")
    cu = cu_seqlens_padded.to(torch.int64)
    if cu.numel() == 0 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0 (the row's first token); got {cu[:1].tolist()} first")
    lens = cu[1:] - cu[:-1]
    if bool((lens % (2 * cp_size)).any()):
        raise ValueError(f"padded sequence lengths {lens.tolist()} must all be divisible by 2*CP = {2 * cp_size}")
    chunk = lens // (2 * cp_size)
    # Starts of the two kept chunks of every sequence, then each expanded to `chunk` consecutive positions.
    starts = torch.stack([cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk], dim=1).reshape(-1)
    reps = chunk.repeat_interleave(2)
    offsets = torch.arange(int(reps.sum()), device=cu.device) - torch.repeat_interleave(
        torch.cumsum(reps, 0) - reps, reps
    )
    return torch.repeat_interleave(starts, reps) + offsets


def cp_gather(slices: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of the CP slicing: put the per-rank slices (slices[r] = x.index_select(dim, cp_partition_index(.., r)))
    back in the full packed order along `dim`. The tests' oracle of the CP layout (training never gathers a CP-sliced
    row; a caller that needs one would all-gather the slices, then call this)."""
    cp_size = len(slices)
    index = torch.cat([cp_partition_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)]).to(slices[0].device)
    cat = torch.cat(list(slices), dim=dim)
    out = torch.empty_like(cat)
    out.index_copy_(dim, index, cat)
    return out


# ======================================================================================================================
# Shared-prompt layout: [prompt | chosen | rejected] per pair, the prompt stored and computed once


def shared_prefix_length(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_loss_mask: torch.Tensor,
                         rejected_loss_mask: torch.Tensor) -> int:
    """Tokens of a pair stored once in the shared-prompt layout: k = m - 1, where m is the longest common prefix of
    the two rows on which both response masks are False (the prompt, `<image>` tokens and assistant header included).

    Why m - 1: the last common token predicts the first response token, which differs between the rows, so it
    starts each response segment instead (stored twice, positions unchanged) and every position keeps one label.
    Args: [L_c] / [L_r] int64 ids and bool masks of one pair. Returns k in [0, min(L_c, L_r) - 1].
    """
    n = min(chosen_ids.numel(), rejected_ids.numel())
    same = (chosen_ids[:n] == rejected_ids[:n]) & ~chosen_loss_mask[:n] & ~rejected_loss_mask[:n]
    m = int(same.long().cumprod(0).sum())
    return max(m - 1, 0)


def pack_shared(
    pairs: Sequence[PreferencePair],
    divisible_by: int,
    image_token_id: int,
    pad_token_id: int = 0,
    dummy: bool = False,
) -> PackedBatch:
    """Pack the pairs of one bin in the shared-prompt layout (see `PackedBatch`): per pair one THD sequence
    [prompt (k = `shared_prefix_length` tokens) | chosen row[k:] | rejected row[k:] | padding to divisible_by].

    Labels and loss masks are those of the separate rows, position by position (labels never cross a segment: the
    last token of each response segment gets IGNORE_INDEX; the prompt's last label is row[k], the first token of both
    response segments). position_ids: prompt 0..k-1, both responses k, k+1, ... (each continues from the prompt's
    end), padding continues the rejected count. Images are stored once per pair, their `<image>` tokens once (in the
    prompt). pair_index / is_chosen / sample_mask are per response [2P] as in `pack`.

    Raises:
        ValueError: as `pack`, plus a pair whose rows share no prompt token (k = 0) or whose `<image>` tokens are not
            all inside the shared prompt.
    """
    _check_bin(pairs, divisible_by)
    ids, labels, lmask, pos = [], [], [], []
    cu, cu_pad, seg, seg_pad = [0], [0], [0], [0]
    pair_index, is_chosen = [], []
    for p in pairs:
        _check_pair(p, image_token_id)
        k = shared_prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask)
        if k < 1:
            raise ValueError(f"pair {p.pair_index}: the chosen and rejected rows share no prompt token "
                             "(shared_prefix_length 0); use the separate-rows layout for such data")
        n_img = int(p.image_token_counts.sum())
        if int((p.chosen_ids[:k] == image_token_id).sum()) != n_img:
            raise ValueError(f"pair {p.pair_index}: {n_img} <image> tokens expected inside the shared prompt "
                             f"(first {k} tokens), found {int((p.chosen_ids[:k] == image_token_id).sum())}")
        row_c, row_r = p.chosen_ids, p.rejected_ids
        # Labels and masks of the whole rows first (pre-rolled as in `pack`), then cut into segments.
        parts = [(row_c[:k], row_c[1:k + 1], p.chosen_loss_mask[1:k + 1], torch.arange(k))]
        for row, rmask in ((row_c, p.chosen_loss_mask), (row_r, p.rejected_loss_mask)):
            n = row.numel()
            lab = torch.full((n - k,), IGNORE_INDEX, dtype=torch.int64)
            lab[: n - k - 1] = row[k + 1:]
            msk = torch.zeros(n - k, dtype=torch.bool)
            msk[: n - k - 1] = rmask[k + 1:]
            parts.append((row[k:], lab, msk, torch.arange(k, n)))
        real = sum(t[0].numel() for t in parts)
        n_pad = padded_length(real, divisible_by) - real
        last = row_r.numel()
        parts.append((torch.full((n_pad,), pad_token_id, dtype=torch.int64),
                      torch.full((n_pad,), IGNORE_INDEX, dtype=torch.int64),
                      torch.zeros(n_pad, dtype=torch.bool), torch.arange(last, last + n_pad)))
        for a, b, c, d in parts:
            ids.append(a)
            labels.append(b)
            lmask.append(c)
            pos.append(d)
        lens = [t[0].numel() for t in parts[:3]]
        for j, n in enumerate(lens):
            seg.append(seg[-1] + n)
            seg_pad.append(seg_pad[-1] + n + (n_pad if j == 2 else 0))
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + real + n_pad)
        pair_index += [-1 if dummy else p.pair_index] * 2
        is_chosen += [True, False]
    return _packed_batch(pairs, (ids, labels, lmask, pos), cu, cu_pad, pair_index, is_chosen, dummy,
                         media_index=torch.arange(len(pairs), dtype=torch.int64),
                         segment_cu_seqlens=torch.tensor(seg, dtype=torch.int32),
                         segment_cu_seqlens_padded=torch.tensor(seg_pad, dtype=torch.int32))


def shared_prompt_spans(segment_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> list[tuple[int, int, int, int]]:
    """(prompt start, chosen start, rejected start, end) row offsets of every pair of a shared-prompt row, as ints.

    Args: segment_cu_seqlens_padded: int [3P+1] (`PackedBatch.segment_cu_seqlens_padded`); total_tokens: T.
    Raises ValueError unless it has 3P+1 entries rising from 0 to at most T.
    """
    b = [int(v) for v in segment_cu_seqlens_padded.flatten().tolist()]
    if len(b) % 3 != 1 or b[0] != 0 or any(y < x for x, y in zip(b[:-1], b[1:], strict=True)) or b[-1] > total_tokens:
        raise ValueError(f"segment_cu_seqlens_padded must hold 3P+1 offsets rising from 0 to at most T = "
                         f"{total_tokens}; got {b}")
    return [tuple(b[i:i + 4]) for i in range(0, len(b) - 1, 3)]


def response_sequence_ids(segment_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The loss sequence of every token of a shared-prompt row: 2i on pair i's chosen segment, 2i+1 on its rejected
    segment (padding included), 2P (dropped by `mpo_loss.sequence_sums`) on prompts and after the last pair.

    The shared-layout replacement of `token_sequence_ids` for the loss: mpo_loss.sequence_logprobs(logprobs, loss_mask,
    response_sequence_ids(..)[cp_index], 2P) gives the per-response sums in the order of pair_index / is_chosen.
    Prompt tokens have loss_mask False, so nothing is lost. Returns [T] int64 on the offsets' device.
    """
    spans = shared_prompt_spans(segment_cu_seqlens_padded, total_tokens)
    n = 2 * len(spans)
    b = segment_cu_seqlens_padded.long()
    lengths = torch.cat([b[1:] - b[:-1], total_tokens - b[-1:]])
    role = torch.arange(lengths.numel(), device=b.device)
    ids = torch.where(role % 3 == 0, n, 2 * (role // 3) + (role % 3) - 1)
    ids[-1] = n
    return torch.repeat_interleave(ids, lengths, output_size=total_tokens)


def unpack_shared(batch: PackedBatch) -> list[dict[str, torch.Tensor]]:
    """The separate rows of a shared-prompt batch: per response (chosen 0, rejected 0, chosen 1, ...) the dict of
    `unpack` (input_ids, labels, loss_mask, position_ids, row_loss_mask over prompt + response, padding removed): the
    inverse of `pack_shared`, used by the tests as the oracle of the shared-prompt layout (training never unpacks)."""
    out = []
    seg = batch.segment_cu_seqlens.long()
    for i, (a, c0, r0, _) in enumerate(shared_prompt_spans(batch.segment_cu_seqlens_padded, batch.input_ids.shape[1])):
        k = int(seg[3 * i + 1] - seg[3 * i])
        for start, n in ((c0, int(seg[3 * i + 2] - seg[3 * i + 1])), (r0, int(seg[3 * i + 3] - seg[3 * i + 2]))):
            d = {f: torch.cat([getattr(batch, f)[0, a:a + k], getattr(batch, f)[0, start:start + n]])
                 for f in ("input_ids", "labels", "loss_mask", "position_ids")}
            row_mask = torch.zeros(k + n, dtype=torch.bool)
            row_mask[1:] = d["loss_mask"][:-1]
            d["row_loss_mask"] = row_mask
            out.append(d)
    return out


def shared_prompt_token_counts(parts: Mapping[int, tuple[int, int, int]], max_tokens_per_bin: int,
                               max_sequences_per_bin: int, dp_size: int, divisible_by: int = 1) -> dict:
    """Tokens the language model computes for the same pairs, separate rows vs the shared-prompt layout, each planned
    with `plan_bins` under the same bin budget (a CPU measure for the benchmark; no tensors).

    Args: parts: pair id -> (prompt tokens, chosen response tokens, rejected response tokens), e.g.
        `synthetic_mmpr_parts`; the rows are prompt + response and the shared layout stores k = prompt - 1 tokens
        once (`shared_prefix_length`: the last prompt token starts both responses). Other args as `plan_bins`.
    Returns: dict with tokens_separate / tokens_shared (padded tokens over all bins, dummies included), real tokens
        of each, bins of each, and token_ratio = tokens_separate / tokens_shared.
    """
    lengths = {i: (p + c, p + r) for i, (p, c, r) in parts.items()}
    shared = {i: p - 1 for i, (p, _, _) in parts.items()}
    sep = plan_bins(lengths, max_tokens_per_bin, max_sequences_per_bin, dp_size, divisible_by)
    shr = plan_bins(lengths, max_tokens_per_bin, max_sequences_per_bin, dp_size, divisible_by, shared_lengths=shared)

    def total(plan, key):
        return sum(getattr(b, key) for r in plan.ranks for b in r)

    out = {"tokens_separate": total(sep, "tokens"), "tokens_shared": total(shr, "tokens"),
           "useful_separate": total(sep, "useful"), "useful_shared": total(shr, "useful"),
           "bins_separate": sep.stats["bins"], "bins_shared": shr.stats["bins"]}
    out["token_ratio"] = out["tokens_separate"] / out["tokens_shared"]
    return out


# ======================================================================================================================


if __name__ == "__main__":
    lengths = synthetic_mmpr_lengths(256, seed=0)
    for cost_name, fn in (("tokens", token_cost), ("tokens+attention", sequence_cost)):
        for bal in ("greedy", "round_robin"):
            plan = plan_bins(lengths, 10240, 1, 8, divisible_by=8, cost_fn=fn, balance=bal)
            print(
                f"cost={cost_name:17s} balance={bal:11s} efficiency={plan.stats['efficiency']:.4f} "
                f"imbalance tokens={plan.stats['imbalance_tokens']:.4f} cost={plan.stats['imbalance_cost']:.4f}"
            )
