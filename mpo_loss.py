"""The MPO loss on packed, vocab-parallel logits, and the BCO reward shift δ.

MPO (Wang et al. 2024, arXiv 2411.10442 §3.2) on (chosen c, rejected r) pairs, as NeMo-RL's MPOLossFn computes it:
    total = w_p · pref + w_q · bco + w_g · sft
    pref  = −log σ(β·(L_c − L_r))                          DPO (Rafailov et al. 2023, arXiv 2305.18290)
    bco   = −log σ(β·L_c − δ) − log σ(−(β·L_r − δ))         paired BCO, no ½ (Jung et al. 2024, arXiv 2404.04656)
    sft   = −Σ_t log πθ(c_t)   (÷ |c| when sft_average_log_probs)
    L_y   = Σ_t (log πθ(y_t) − log π_ref(y_t)) over y's response tokens (÷ their count with *_average_log_probs)

Denominator: each term's sum over a microbatch's valid pairs ÷ `num_global_pairs` (`count_global_pairs`: the whole
step's, all microbatches and DP ranks); DP and CP gradients are summed. δ changes only between steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility

import pack
from distributed import Ctx, group_rank_size

# ----------------------------------------------------------------------------------------------------------------------
# Fused, chunked, vocab-parallel token log-probabilities


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[label] over a TP-sharded vocabulary in token chunks; saves only lse [T] for backward."""

    @staticmethod
    def forward(fn_ctx, logits, labels, tp_group, chunk_size, inplace_backward):
        num_local_tokens, partition_vocab = logits.shape
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 for bf16/fp32, fp64 in tests
        rank, world = group_rank_size(tp_group)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab, rank, world)
        logprobs = torch.empty(num_local_tokens, dtype=compute_dtype, device=logits.device)
        lse = torch.empty(num_local_tokens, dtype=compute_dtype, device=logits.device)
        for s in range(0, num_local_tokens, chunk_size):
            e = min(num_local_tokens, s + chunk_size)
            # A private fp32 copy: megatron-core's helpers shift and exponentiate their input in place.
            x = logits[s:e].to(compute_dtype, copy=True)
            x_max = x.max(dim=-1).values
            if world > 1:
                torch.distributed.all_reduce(x_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            _, _, predicted, sum_exp, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
                x, labels[s:e], x_max, vocab_start, vocab_end
            )
            del x
            if world > 1:  # one collective for both partial sums
                both = torch.stack([predicted, sum_exp])
                torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM, group=tp_group)
                predicted, sum_exp = both[0], both[1]
            log_z = torch.log(sum_exp)
            logprobs[s:e] = predicted - log_z  # predicted is already shifted by x_max
            lse[s:e] = x_max + log_z
        valid = (labels >= 0) & (labels < partition_vocab * world)  # e.g. −100 at padding positions
        logprobs = torch.where(valid, logprobs, torch.zeros((), dtype=compute_dtype, device=logprobs.device))
        fn_ctx.save_for_backward(logits, labels, lse, valid)
        fn_ctx.vocab_range = (vocab_start, vocab_end)
        fn_ctx.chunk_size = chunk_size
        fn_ctx.inplace_backward = inplace_backward
        return logprobs

    @staticmethod
    def backward(fn_ctx, grad_logprobs):
        logits, labels, lse, valid = fn_ctx.saved_tensors
        vocab_start, vocab_end = fn_ctx.vocab_range
        compute_dtype = lse.dtype
        # in place: chunk s:e is copied before its gradient overwrites it (another reader fails the version check)
        grad_logits = logits if fn_ctx.inplace_backward else torch.empty_like(logits)
        # d logp / d logits = onehot(label) − softmax; megatron's helpers compute (softmax − onehot)·grad_output.
        neg_grad = -(grad_logprobs.to(compute_dtype) * valid)
        for s in range(0, logits.shape[0], fn_ctx.chunk_size):
            e = min(logits.shape[0], s + fn_ctx.chunk_size)
            softmax = logits[s:e].to(compute_dtype, copy=True)
            softmax.sub_(lse[s:e].unsqueeze(-1)).exp_()
            target = labels[s:e]
            target_mask = (target < vocab_start) | (target >= vocab_end)
            masked_target_1d = (target - vocab_start).masked_fill(target_mask, 0).view(-1)
            grad_2d, arange_1d, softmax_update, grad_input = (
                VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
            )
            grad_logits[s:e] = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, neg_grad[s:e]
            )
        return grad_logits, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup | None = None,
    chunk_size: int = 1024,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """log πθ(label_t): logits [T_local, V/TP] (this rank's vocabulary shard), labels [T_local] (ids outside [0, V)
    give 0) -> [T_local] fp32, the same on every TP rank; extra memory O(chunk_size·V/TP). `inplace_backward` writes
    the logits' gradient into the logits, as megatron-core's own cross entropy does."""
    assert logits.dim() == 2 and labels.shape == logits.shape[:1] and chunk_size > 0, (logits.shape, labels.shape)
    return _VocabParallelTokenLogprobs.apply(logits, labels.long(), tp_group, int(chunk_size), bool(inplace_backward))


# ----------------------------------------------------------------------------------------------------------------------
# Per-response reduction over the packed row


def sequence_sums(
    values: torch.Tensor,
    seq_ids: torch.Tensor,
    num_responses: int,
    cp_group: torch.distributed.ProcessGroup | None = None,
    check: bool = True,
) -> torch.Tensor:
    """out[s] = Σ_{t: seq_ids[t] = s} values[t] -> [S] (id S, bin padding, dropped). With `cp_group`: all-reduced
    with an identity backward, so each CP rank gets the exact gradient of the replicated loss."""
    if check and seq_ids.numel() and bool(((seq_ids < 0) | (seq_ids > num_responses)).any()):
        raise ValueError(
            f"seq_ids must be in [0, S = {num_responses}] (S: the dropped padding id); got ids "
            f"{int(seq_ids.min())} .. {int(seq_ids.max())}"
        )
    out = torch.zeros(num_responses + 1, dtype=values.dtype, device=values.device)
    out = out.index_add(0, seq_ids, values)[:num_responses].contiguous()
    if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        out = reduce_from_tensor_model_parallel_region(out.clone(), group=cp_group)
    return out


def sequence_logprobs(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_responses: int,
    cp_group: torch.distributed.ProcessGroup | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_t log π(y_t) over each sequence's response tokens (loss_mask) and their counts -> ([S], [S] int64)."""
    assert logprobs.dim() == 1 and logprobs.shape == loss_mask.shape == seq_ids.shape
    mask = loss_mask.bool()
    # where, not multiply: a non-finite log-prob at a masked position must not become NaN (0·inf).
    masked = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    sums = sequence_sums(masked, seq_ids, num_responses, cp_group, check)
    with torch.no_grad():
        counts = sequence_sums(mask.to(torch.float64), seq_ids, num_responses, cp_group, check=False)
    return sums, counts.round().long()


def packed_sequence_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_responses: int,
    tp_group: torch.distributed.ProcessGroup | None = None,
    cp_group: torch.distributed.ProcessGroup | None = None,
    chunk_size: int = 1024,
    inplace_backward: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` then `sequence_logprobs`: logits [T_local, V/TP] -> ([S] fp32 sums, [S] int64 counts)."""
    logprobs = token_logprobs(logits, labels, tp_group, chunk_size, inplace_backward)
    return sequence_logprobs(logprobs, loss_mask, seq_ids, num_responses, cp_group, check)


def sequence_logratios(
    policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, num_response_tokens: torch.Tensor, average: bool
) -> torch.Tensor:
    """L_y = Σ_t (log πθ − log π_ref), ÷ max(1, response tokens) when `average` (NeMo-RL's rule). [S] -> [S]."""
    ratio = policy_logprobs - ref_logprobs
    if average:
        ratio = ratio / num_response_tokens.clamp_min(1).to(ratio.dtype)
    return ratio


def forward_logprobs(model, batch: pack.PackedBatch, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-response log-prob sums [S] (fp32) and response-token counts [S] of `model` (the policy or the reference) on
    one packed microbatch, S = num_responses; this CP rank's tokens, the sums reduced over TP and CP."""
    logits = model(batch)  # [T_local, V/TP]: this CP rank's tokens, this TP rank's vocabulary shard
    labels, loss_mask, seq_ids = batch.labels[0], batch.loss_mask[0], batch.loss_seq_ids()
    if ctx.cp > 1:
        index = pack.cp_partition_index(batch.cu_seqlens_padded, ctx.cp, ctx.cp_rank).to(labels.device)
        labels, loss_mask, seq_ids = labels[index], loss_mask[index], seq_ids[index]
    cp_group, chunk = ctx.cp_group if ctx.cp > 1 else None, ctx.cfg.policy.logprob_chunk_size
    return packed_sequence_logprobs(logits, labels, loss_mask, seq_ids, batch.num_responses, ctx.tp_group, cp_group,
                                    chunk, inplace_backward=True, check=False)  # logits: read once


# ----------------------------------------------------------------------------------------------------------------------
# Pair sequences and validity


def pair_sequences(pair_index: torch.Tensor,
                   is_chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pair_index [S], is_chosen [S] -> (chosen [P], rejected [P]: each pair's sequences; pair_ids [P] ascending)."""
    assert pair_index.dim() == 1 and pair_index.shape == is_chosen.shape, (pair_index.shape, is_chosen.shape)
    pair_ids, inverse = torch.unique(pair_index, return_inverse=True)
    chosen_mask = is_chosen.bool()
    num_pairs = pair_ids.numel()
    n_chosen = torch.bincount(inverse[chosen_mask], minlength=num_pairs)
    n_rejected = torch.bincount(inverse[~chosen_mask], minlength=num_pairs)
    bad = (n_chosen != 1) | (n_rejected != 1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"pair {int(pair_ids[k])} must have exactly one chosen and one rejected sequence in the bin; it has "
            f"{int(n_chosen[k])} chosen and {int(n_rejected[k])} rejected (pair_index={pair_index.tolist()}, "
            f"is_chosen={chosen_mask.long().tolist()})"
        )
    seqs = torch.arange(pair_index.numel(), device=pair_index.device)
    chosen = torch.empty(num_pairs, dtype=torch.long, device=pair_index.device)
    rejected = torch.empty_like(chosen)
    chosen[inverse[chosen_mask]] = seqs[chosen_mask]
    rejected[inverse[~chosen_mask]] = seqs[~chosen_mask]
    return chosen, rejected, pair_ids


def valid_pairs(
    num_response_tokens: torch.Tensor, pair_index: torch.Tensor, is_chosen: torch.Tensor, sample_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P], valid [P] bool): valid = both sequences have sample_mask 1 and a response token."""
    assert sample_mask.shape == pair_index.shape == num_response_tokens.shape
    chosen, rejected, _ = pair_sequences(pair_index, is_chosen)
    seq_ok = sample_mask.bool() & (num_response_tokens > 0)
    return chosen, rejected, seq_ok[chosen] & seq_ok[rejected]


def count_valid_pairs(
    num_response_tokens: torch.Tensor, pair_index: torch.Tensor, is_chosen: torch.Tensor, sample_mask: torch.Tensor
) -> int:
    """Valid pairs of one bin; summed over the step's microbatches and DP ranks it is `num_global_pairs`."""
    return int(valid_pairs(num_response_tokens, pair_index, is_chosen, sample_mask)[2].sum())


def count_global_pairs(batches: list[pack.PackedBatch], ctx: Ctx) -> int:
    """`num_global_pairs`: the step's valid pairs over all its microbatches and DP ranks, counted on the host copies
    (one all-reduce over DP)."""
    local = 0
    for b in map(pack.host_view, batches):
        num_response_tokens = sequence_sums(b.loss_mask[0].long(), b.loss_seq_ids(), b.num_responses)
        local += count_valid_pairs(num_response_tokens, b.pair_index, b.is_chosen, b.sample_mask)
    n = torch.full((1,), local, dtype=torch.long, device=ctx.device)
    torch.distributed.all_reduce(n, group=ctx.dp_group)
    return int(n.item())


# ----------------------------------------------------------------------------------------------------------------------
# The MPO loss

# How a step's microbatch (then DP) metrics combine: "mean" ones are already ÷ num_global_pairs and "count" ones are
# summed; "constant" ones are the same in every microbatch (take one).
METRIC_REDUCTION: dict[str, str] = {
    "loss": "mean",
    "preference_loss": "mean",
    "bco_loss": "mean",
    "sft_loss": "mean",
    "accuracy": "mean",
    "rewards/chosen": "mean",
    "rewards/rejected": "mean",
    "rewards/margin": "mean",
    "logprobs/chosen": "mean",
    "logprobs/rejected": "mean",
    "nll/chosen": "mean",
    "bco/reward_mean": "mean",
    "num_valid_pairs": "count",
    "reward_shift_used": "constant",
}


def mpo_loss(
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    num_response_tokens: torch.Tensor,
    pair_index: torch.Tensor,
    is_chosen: torch.Tensor,
    sample_mask: torch.Tensor,
    mpo_cfg: Any,
    reward_shift: float,
    num_global_pairs: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The MPO loss of one packed microbatch. Inputs [S] (policy_logprobs, ref_logprobs: Σ_t log π over each sequence's
    response tokens; pair metadata on the CPU in training). Returns (loss = Σ over valid pairs ÷ num_global_pairs,
    metrics as METRIC_REDUCTION says, (Σ β·L_y over valid sequences, their count): δ's statistics)."""
    assert policy_logprobs.dim() == 1 and policy_logprobs.shape == ref_logprobs.shape == num_response_tokens.shape
    assert pair_index.shape == sample_mask.shape == num_response_tokens.shape
    device = policy_logprobs.device
    num_response_tokens = num_response_tokens.to(device)
    chosen, rejected, _ = pair_sequences(pair_index, is_chosen)  # where the metadata is (the host in training)
    chosen, rejected = pack.to_device(chosen, device), pack.to_device(rejected, device)
    seq_ok = pack.to_device(sample_mask, device).bool() & (num_response_tokens > 0)
    valid = seq_ok[chosen] & seq_ok[rejected]
    num_local = valid.sum()  # on the device: checked there, read with the step's metrics
    torch._assert_async(num_local <= num_global_pairs, "num_global_pairs is smaller than this microbatch's valid pairs")
    denom = float(max(int(num_global_pairs), 1))  # 0 only when no pair anywhere is valid: the loss is then 0
    beta = float(mpo_cfg.reference_policy_kl_penalty)
    delta = float(reward_shift)
    ref_logprobs = ref_logprobs.detach().to(policy_logprobs.dtype)

    n_resp = num_response_tokens
    l_pref = sequence_logratios(policy_logprobs, ref_logprobs, n_resp, mpo_cfg.preference_average_log_probs)
    l_bco = sequence_logratios(policy_logprobs, ref_logprobs, n_resp, mpo_cfg.quality_average_log_probs)
    # −log σ(x) = softplus(−x), stable for |x| large.
    pref = F.softplus(-beta * (l_pref[chosen] - l_pref[rejected]))
    q_c, q_r = beta * l_bco[chosen], beta * l_bco[rejected]  # the BCO rewards (the paper's quality rewards)
    bco = F.softplus(-(q_c - delta)) + F.softplus(q_r - delta)  # −log σ(q_c − δ) − log σ(−(q_r − δ))
    nll_c = -policy_logprobs[chosen] / n_resp[chosen].clamp_min(1).to(policy_logprobs.dtype)  # token-mean NLL
    sft = nll_c if mpo_cfg.sft_average_log_probs else -policy_logprobs[chosen]
    per_pair = (
        mpo_cfg.preference_loss_weight * pref + mpo_cfg.bco_loss_weight * bco + mpo_cfg.sft_loss_weight * sft
    )

    zero = torch.zeros((), dtype=policy_logprobs.dtype, device=device)

    def mean(x: torch.Tensor) -> torch.Tensor:  # Σ over valid local pairs ÷ global valid pairs; invalid → exactly 0
        return torch.where(valid, x, zero).sum() / denom

    loss = mean(per_pair)
    with torch.no_grad():
        r_c, r_r = beta * l_pref[chosen], beta * l_pref[rejected]
        metrics = {
            "loss": loss.detach(),
            "preference_loss": mean(pref),
            "bco_loss": mean(bco),
            "sft_loss": mean(sft),
            "accuracy": mean((l_pref[chosen] > l_pref[rejected]).to(policy_logprobs.dtype)),
            "rewards/chosen": mean(r_c),
            "rewards/rejected": mean(r_r),
            "rewards/margin": mean(r_c - r_r),
            "logprobs/chosen": mean(policy_logprobs[chosen]),
            "logprobs/rejected": mean(policy_logprobs[rejected]),
            "nll/chosen": mean(nll_c),
            "bco/reward_mean": mean(q_c + q_r) / 2,
            "num_valid_pairs": num_local.to(policy_logprobs.dtype),
            "reward_shift_used": torch.full((), delta, dtype=policy_logprobs.dtype, device=device),
        }
        metrics = {k: v.detach() for k, v in metrics.items()}
        reward_sum = torch.where(valid, q_c + q_r, zero).sum().detach()
        reward_count = 2.0 * num_local.to(policy_logprobs.dtype)
    return loss, metrics, (reward_sum, reward_count)


def combine_metrics(per_microbatch: Iterable[Mapping[str, torch.Tensor | float]],
                    read: bool = True) -> dict[str, float] | dict[str, torch.Tensor]:
    """A step's microbatch metrics combined as METRIC_REDUCTION says -> floats, or 0-d float64 tensors (read=False)."""
    out: dict[str, torch.Tensor] = {}
    for m in per_microbatch:
        for k, v in m.items():
            v = v.double() if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64, device="cpu")
            if METRIC_REDUCTION.get(k, "mean") == "constant":
                out.setdefault(k, v)
            else:
                out[k] = out[k] + v if k in out else v
    if not read or not out:
        return out
    return dict(zip(out, torch.stack(list(out.values())).tolist(), strict=True))


def reduce_metrics(local: dict[str, float | torch.Tensor], group, device: torch.device) -> dict[str, float]:
    """One rank's summed step metrics (floats or 0-d tensors) over the DP `group`, one all-reduce and one read:
    "mean" and "count" ones (METRIC_REDUCTION) summed, counts as ints, "constant" ones kept."""
    keys = sorted(k for k in local if METRIC_REDUCTION.get(k, "mean") != "constant")
    kept = [k for k in local if k not in keys]

    def stacked(names):
        return torch.stack([torch.as_tensor(local[k], dtype=torch.float64, device=device).reshape(()) for k in names]) \
            if names else torch.zeros(0, dtype=torch.float64, device=device)

    vals = stacked(keys)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(vals, group=group)
    values = dict(zip(keys + kept, torch.cat([vals, stacked(kept)]).tolist(), strict=True))
    out = {k: values[k] for k in local}  # the caller's key order
    for k in keys:
        if METRIC_REDUCTION.get(k) == "count":
            out[k] = round(out[k])  # a sum of whole numbers (float64: exact)
    return out


def update_reward_shift(
    shift: float, reward_sum: float | torch.Tensor, reward_count: float | torch.Tensor, momentum: float
) -> float:
    """δ' = m·δ + (1 − m)·reward_sum / reward_count (step totals), unchanged on an empty step (NeMo-RL's
    MPOLossFn.update_reward_shift: δ of step t uses the rewards of steps < t)."""
    assert 0.0 <= momentum < 1.0, f"reward_shift_momentum = {momentum}"  # config.validate refuses others
    if not math.isfinite(float(shift)):
        raise ValueError(f"reward_shift = {float(shift)} must be a finite number")
    total, count = float(reward_sum), float(reward_count)
    if count < 0 or not math.isfinite(total) or not math.isfinite(count):
        raise ValueError(f"invalid reward-shift statistics: reward_sum = {total}, reward_count = {count}")
    if count == 0:
        return float(shift)
    return momentum * float(shift) + (1.0 - momentum) * (total / count)
