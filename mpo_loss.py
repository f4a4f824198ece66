"""The MPO objective on packed, vocab-parallel logits, and the BCO reward shift δ.

Mixed Preference Optimization (Wang et al. 2024, "Enhancing the Reasoning Ability of Multimodal LLMs via Mixed
Preference Optimization", arXiv 2411.10442) trains on (chosen c, rejected r) response pairs with

    total = w_p · pref + w_q · bco + w_g · sft
    pref  = −log σ(β·(L_c − L_r))                          DPO, sigmoid form (Rafailov et al. 2023, arXiv 2305.18290)
    bco   = −log σ(β·L_c − δ) − log σ(−(β·L_r − δ))         paired BCO with reward shift δ (Jung et al. 2024,
                                                           "Binary Classifier Optimization", arXiv 2404.04656); no ½
    sft   = −Σ_t log πθ(c_t)   (÷ |c| when sft_average_log_probs)
    L_y   = Σ_t (log πθ(y_t) − log π_ref(y_t)) over the response tokens of row y (÷ the row's own response-token
            count when the term's *_average_log_probs flag is set)

with the semantics of NeMo-RL's MPOLossFn (NVIDIA-NeMo/RL branch linglinj/nemotron-omni-mpo at 1ca5ab861,
nemo_rl/algorithms/loss/loss_functions.py).

Denominator contract (stated here once; the other modules point to it): every term is a sum over the valid pairs of
this microbatch divided by the number of valid pairs of the whole optimizer step (all microbatches, all data-parallel
ranks: `num_global_pairs`), so gradients do not depend on how pairs are split, and the DP/CP gradient reduction sums
(see the gradient reduction contract below). δ is constant within an optimizer step: the loss only returns its
sufficient statistics and the training loop updates δ once after `optimizer.step()` with `update_reward_shift`.

The pipeline for one packed microbatch (THD: one row of T tokens holding S sequences); `packed_sequence_logprobs` is
`token_logprobs` (fp32 [T_local] from vocab-parallel logits, chunked) followed by `sequence_logprobs` (segment sums):

    seq_ids = pack.token_sequence_ids(cu_seqlens_padded, T)[cp_index]   # [T_local]; cp_index = this CP rank's tokens
    pol, n  = packed_sequence_logprobs(logits, labels, loss_mask, seq_ids, S, tp_group, cp_group, chunk_size)  # [S] x2
    with torch.no_grad():                                            # the reference model's logits, same layout
        ref, _ = packed_sequence_logprobs(ref_logits, labels, loss_mask, seq_ids, S, tp_group, cp_group, chunk_size)
    loss, metrics, (reward_sum, reward_count) = mpo_loss(pol, ref, n, pair_index, is_chosen, sample_mask,
                                                         cfg.mpo, reward_shift, num_global_pairs)

Shared-prompt layout (`shared_prompt.pack`, `packing.shared_prompt`: each pair one THD span [prompt | chosen |
rejected]): only the token -> sequence map changes. Use `shared_prompt.response_sequence_ids(segment_cu_seqlens_padded,
T)` (chosen segment of pair i -> 2i, rejected -> 2i+1, prompt tokens -> dropped) in place of `token_sequence_ids`
(both: `PackedBatch.loss_seq_ids()`), and S = batch.num_responses
(2P) in place of batch.num_sequences (P spans there). pair_index, is_chosen and sample_mask are per response as in the
separate layout, so `count_valid_pairs`, `mpo_loss`, δ and the metrics take them unchanged; the per-response sums
equal the separate rows' (tests/test_shared_prompt.py).

Gradient reduction contract (for train.py): `loss` is already divided by the global number of valid pairs, so the
data-parallel gradient reduction must SUM (not average) the per-rank gradients. With context parallelism every CP rank
returns the same (replicated) loss and the gradient of its local tokens is exact (the CP all-reduce of per-sequence
sums has an identity backward), so gradients must also be summed, not averaged, over the CP group; report the loss of
one CP rank only.

Run the tests: `pytest tests/test_mpo_loss.py` (the multi-rank checks launch tests/dist/check_mpo_loss.py with
torchrun).
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
from distributed import group_rank_size

# ----------------------------------------------------------------------------------------------------------------------
# Fused, chunked, vocab-parallel token log-probabilities


class _VocabParallelTokenLogprobs(torch.autograd.Function):
    """log softmax(logits)[label] over a TP-sharded vocabulary, chunked over tokens in forward *and* backward.

    Why not `megatron.core.tensor_parallel.vocab_parallel_cross_entropy` as is: (1) it works in place on its input
    (`.float()` is a no-op on fp32 logits, then `-=`, `exp(out=)` and `div_`), so the caller's fp32 logits come back
    overwritten by their softmax (checked with megatron-core 0.19.2: rows sum to 1; bf16 inputs are copied by
    `.float()` and survive) — the cause of a later F.cross_entropy on the same tensor disagreeing; (2) it saves the
    full softmax for backward, so calling it chunk by chunk under autograd still keeps O(T·V/TP) fp32 alive until
    backward. Here each chunk is copied to fp32 first and megatron-core's own pieces
    (`VocabParallelCrossEntropy.calculate_predicted_logits` forward, `prepare_gradient_calculation_operands` /
    `calculate_gradients` backward) do the math; only the per-token log-normaliser lse [T] is saved, and backward
    rebuilds each chunk's softmax as exp(logits − lse) without any communication. Extra memory: O(chunk·V/TP).
    """

    @staticmethod
    def forward(ctx, logits, labels, tp_group, chunk_size, inplace_backward):
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
        ctx.save_for_backward(logits, labels, lse, valid)
        ctx.vocab_range = (vocab_start, vocab_end)
        ctx.chunk_size = chunk_size
        ctx.inplace_backward = inplace_backward
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        logits, labels, lse, valid = ctx.saved_tensors
        vocab_start, vocab_end = ctx.vocab_range
        compute_dtype = lse.dtype
        # In place: chunk s:e of the logits is copied before its gradient overwrites it, and nothing else reads the
        # logits after this backward (the output layer's backward needs its input and weight, not its output; any
        # other autograd user of the logits would fail autograd's version check instead of reading garbage).
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        # d logp / d logits = onehot(label) − softmax; megatron's helpers compute (softmax − onehot)·grad_output.
        neg_grad = -(grad_logprobs.to(compute_dtype) * valid)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = min(logits.shape[0], s + ctx.chunk_size)
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
    """Per-token log-probabilities log πθ(label_t | ·) from vocab-parallel logits, in token chunks.

    Args:
        logits: [T_local, V/TP], bf16, fp32 or fp64; this rank's vocabulary shard (rank r holds ids
            [r·V/TP, (r+1)·V/TP), megatron-core's layout). Not modified by the forward; gradients flow back to it.
        labels: [T_local] int64, the pre-rolled target token ids (full-vocabulary ids). Ids outside [0, V), such as
            −100 at padding, get log-prob 0 and no gradient; callers mask them with the loss mask anyway.
        tp_group: the tensor-parallel group the vocabulary is sharded over; None = the whole vocabulary is local.
        chunk_size: tokens per chunk (`policy.logprob_chunk_size`); extra memory beyond the logits and their gradient
            is O(chunk_size·V/TP) in forward and backward.
        inplace_backward: write the logits' gradient into the logits tensor itself during backward instead of a new
            [T_local, V/TP] buffer (what megatron-core's own cross entropy does), so the only [T, V]-sized tensor
            alive is the logits. The caller's logits hold the gradient after backward: use it when nothing reads the
            logits afterwards (the training step). Values and gradients are identical either way.

    Returns:
        [T_local] log-probs in fp32 (fp64 for fp64 logits), identical on every TP rank.

    Raises:
        ValueError: wrong ranks/shapes or a non-positive chunk_size.

    Uses megatron-core's vocab-parallel cross-entropy pieces (`VocabParallelCrossEntropy`): the vocabulary is never
    all-gathered, only [chunk] max / target-logit / sum-exp vectors are all-reduced over `tp_group`.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T_local, V/TP]; got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be [T_local] = [{logits.shape[0]}]; got shape {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size = {chunk_size} must be > 0 (policy.logprob_chunk_size)")
    return _VocabParallelTokenLogprobs.apply(logits, labels.long(), tp_group, int(chunk_size), bool(inplace_backward))


# ----------------------------------------------------------------------------------------------------------------------
# Segment reduction over the packed row


def sequence_sums(
    values: torch.Tensor,
    seq_ids: torch.Tensor,
    num_sequences: int,
    cp_group: torch.distributed.ProcessGroup | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Differentiable per-sequence sums of per-token values: out[s] = Σ_{t: seq_ids[t] = s} values[t].

    Args:
        values: [T_local] float (any dtype; the sum keeps it).
        seq_ids: [T_local] int64 in [0, S]; id S (bin padding) is dropped.
        num_sequences: S.
        cp_group: the context-parallel group when tokens are a CP slice; the partial sums are all-reduced with
            megatron-core's `reduce_from_tensor_model_parallel_region` (forward all-reduce, backward identity):
            each CP rank then holds the whole-sequence sums, computes the same loss, and the gradient reaching its
            local tokens is the exact gradient of that replicated loss (a torch.distributed.nn all_reduce would
            multiply it by CP).

    Returns:
        [S] sums, identical on every CP rank.
    Raises:
        ValueError (with `check`): an id outside [0, S] (index_add would fail deep inside, or assert on a GPU). The
            step passes check=False for a batch's own ids (pack.PackedBatch.loss_seq_ids: read back from the device,
            the check would wait for the GPU).
    """
    if check and seq_ids.numel() and bool(((seq_ids < 0) | (seq_ids > num_sequences)).any()):
        raise ValueError(
            f"seq_ids must be in [0, S = {num_sequences}] (S: the dropped padding id); got ids "
            f"{int(seq_ids.min())} .. {int(seq_ids.max())}"
        )
    out = torch.zeros(num_sequences + 1, dtype=values.dtype, device=values.device)
    out = out.index_add(0, seq_ids, values)[:num_sequences].contiguous()
    if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
        out = reduce_from_tensor_model_parallel_region(out.clone(), group=cp_group)
    return out


def sequence_logprobs(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_sequences: int,
    cp_group: torch.distributed.ProcessGroup | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence response log-prob sums Σ_t log π(y_t) and response-token counts.

    Args:
        logprobs: [T_local] fp32 per-token log-probs (`token_logprobs`; policy or reference).
        loss_mask: [T_local] bool/int, 1 on response tokens (the final assistant turn) of the pre-rolled labels.
        seq_ids: [T_local] int64 sequence index of each token (`pack.token_sequence_ids`, CP-sliced like the tokens).
        num_sequences: S, sequences in the packed row.
        cp_group: context-parallel group (see `sequence_sums`); check: check the ids (see `sequence_sums`).

    Returns:
        (logprob_sums [S] in logprobs' dtype, num_response_tokens [S] int64), whole-sequence values on every CP
        rank.
    """
    if not (logprobs.shape == loss_mask.shape == seq_ids.shape) or logprobs.dim() != 1:
        raise ValueError(
            f"logprobs, loss_mask and seq_ids must all be [T_local]; got {tuple(logprobs.shape)}, "
            f"{tuple(loss_mask.shape)}, {tuple(seq_ids.shape)}"
        )
    mask = loss_mask.bool()
    # where, not multiply: a non-finite log-prob at a masked position must not become NaN (0·inf).
    masked = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    sums = sequence_sums(masked, seq_ids, num_sequences, cp_group, check)
    with torch.no_grad():
        counts = sequence_sums(mask.to(torch.float64), seq_ids, num_sequences, cp_group, check=False)
    return sums, counts.round().long()


def packed_sequence_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_sequences: int,
    tp_group: torch.distributed.ProcessGroup | None = None,
    cp_group: torch.distributed.ProcessGroup | None = None,
    chunk_size: int = 1024,
    inplace_backward: bool = False,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` then `sequence_logprobs`: logits [T_local, V/TP] of one packed microbatch → (Σ_t log π over each
    sequence's response tokens [S] fp32, response-token counts [S] int64). Run it under torch.no_grad() for the
    reference model; `inplace_backward` as in `token_logprobs`, `check` as in `sequence_sums`."""
    logprobs = token_logprobs(logits, labels, tp_group, chunk_size, inplace_backward)
    return sequence_logprobs(logprobs, loss_mask, seq_ids, num_sequences, cp_group, check)


def sequence_logratios(
    policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, num_response_tokens: torch.Tensor, average: bool
) -> torch.Tensor:
    """L_y = Σ_t (log πθ − log π_ref) per sequence, ÷ max(1, response tokens) when `average` (NeMo-RL's MPOLossFn
    rule, so a row with no response token gives 0, never NaN). Shapes [S] → [S]."""
    ratio = policy_logprobs - ref_logprobs
    if average:
        ratio = ratio / num_response_tokens.clamp_min(1).to(ratio.dtype)
    return ratio


# ----------------------------------------------------------------------------------------------------------------------
# Pair layout and validity


def pair_layout(pair_index: torch.Tensor, is_chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Match each pair's chosen and rejected rows inside a bin (any row order).

    Args:
        pair_index: [S] int, the pair id of each sequence (any integers, e.g. dataset pair ids).
        is_chosen: [S] bool/int, 1 for the chosen row.

    Returns:
        (chosen [P] int64, rejected [P] int64, pair_ids [P]) — sequence indices of each pair's rows, pairs in
        ascending pair id order.

    Raises:
        ValueError: naming the first pair that does not have exactly one chosen and one rejected row, or on
            mismatched shapes.
    """
    if pair_index.dim() != 1 or pair_index.shape != is_chosen.shape:
        raise ValueError(
            f"pair_index and is_chosen must both be [S]; got {tuple(pair_index.shape)}, {tuple(is_chosen.shape)}"
        )
    pair_ids, inverse = torch.unique(pair_index, return_inverse=True)
    chosen_mask = is_chosen.bool()
    num_pairs = pair_ids.numel()
    n_chosen = torch.bincount(inverse[chosen_mask], minlength=num_pairs)
    n_rejected = torch.bincount(inverse[~chosen_mask], minlength=num_pairs)
    bad = (n_chosen != 1) | (n_rejected != 1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"pair {int(pair_ids[k])} must have exactly one chosen and one rejected row in the bin; it has "
            f"{int(n_chosen[k])} chosen and {int(n_rejected[k])} rejected (pair_index={pair_index.tolist()}, "
            f"is_chosen={chosen_mask.long().tolist()})"
        )
    rows = torch.arange(pair_index.numel(), device=pair_index.device)
    chosen = torch.empty(num_pairs, dtype=torch.long, device=pair_index.device)
    rejected = torch.empty_like(chosen)
    chosen[inverse[chosen_mask]] = rows[chosen_mask]
    rejected[inverse[~chosen_mask]] = rows[~chosen_mask]
    return chosen, rejected, pair_ids


def valid_pairs(
    num_response_tokens: torch.Tensor, pair_index: torch.Tensor, is_chosen: torch.Tensor, sample_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P], valid [P] bool): a pair is valid when both rows have sample_mask 1 and at least
    one response token. Raises ValueError for malformed pair metadata (see `pair_layout`)."""
    if sample_mask.shape != pair_index.shape or num_response_tokens.shape != pair_index.shape:
        raise ValueError(
            f"num_response_tokens, pair_index and sample_mask must all be [S]; got "
            f"{tuple(num_response_tokens.shape)}, {tuple(pair_index.shape)}, {tuple(sample_mask.shape)}"
        )
    chosen, rejected, _ = pair_layout(pair_index, is_chosen)
    row_ok = sample_mask.bool() & (num_response_tokens > 0)
    return chosen, rejected, row_ok[chosen] & row_ok[rejected]


def count_valid_pairs(
    num_response_tokens: torch.Tensor, pair_index: torch.Tensor, is_chosen: torch.Tensor, sample_mask: torch.Tensor
) -> int:
    """Valid pairs of one bin (int). train.py sums this over the step's microbatches and all-reduces it over DP to
    get `num_global_pairs` before the first forward. `num_response_tokens` [S] is the per-sequence count of
    loss_mask over the whole (un-CP-sliced) row: `sequence_sums(loss_mask, batch.loss_seq_ids(), S)`
    (`pack.token_sequence_ids`, or `shared_prompt.response_sequence_ids` for the shared-prompt layout, S = 2P)."""
    return int(valid_pairs(num_response_tokens, pair_index, is_chosen, sample_mask)[2].sum())


# ----------------------------------------------------------------------------------------------------------------------
# The MPO loss

# How the training loop combines a step's per-microbatch metrics (and then the DP ranks): every "mean" metric is
# already divided by num_global_pairs, so its sum over microbatches and DP ranks is the step mean; "count" metrics
# are plain sums; "constant" metrics are equal in every microbatch (take one, do not sum).
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
    """The MPO loss of one packed microbatch ("fused": all its pairs at once).

    Args:
        policy_logprobs: [S] Σ_t log πθ over each sequence's response tokens (fp32; carries the gradient).
        ref_logprobs: [S] Σ_t log π_ref, same layout (no gradient needed).
        num_response_tokens: [S] int response-token count of each sequence (its own loss-mask count, never padding).
        pair_index, is_chosen, sample_mask: [S] pair metadata; every pair id must have exactly one chosen and one
            rejected row (any order); sample_mask 0 marks dummy rows. On the CPU (the batch's host copy,
            pack.host_view, as train.py passes them) the pairs are matched there and only their row indices go to
            the device: matching them on a GPU reads data-dependent sizes back (torch.unique, boolean masks).
        mpo_cfg: config.MPOConfig (reference_policy_kl_penalty β, *_loss_weight, *_average_log_probs).
        reward_shift: δ of this optimizer step (a float, constant over the step).
        num_global_pairs: valid pairs of the whole optimizer step over all microbatches and DP ranks
            (`count_valid_pairs` summed); the denominator of every term.

    Returns:
        loss: 0-dim, Σ over this microbatch's valid pairs of w_p·pref + w_q·bco + w_g·sft, ÷ num_global_pairs.
            Invalid pairs (sample_mask 0 or no response token) contribute exactly 0 and are not counted.
        metrics: dict of detached 0-dim tensors, combined across microbatches as METRIC_REDUCTION says.
            rewards/* are β·L with mpo.preference_average_log_probs (the DPO implicit reward); accuracy is
            L_c > L_r (strict); logprobs/* are policy Σ log πθ per row; nll/chosen is the chosen row's token-mean NLL
            (always reported); bco/reward_mean is the mean BCO reward β·L (mpo.quality_average_log_probs) over the
            valid chosen and rejected rows; reward_shift_used is the δ this loss used (`reward_shift`).
        (reward_sum, reward_count): detached 0-dim tensors, the BCO rewards' Σ β·L_y over the valid chosen and
            rejected rows and their count (2 per valid pair) — δ's sufficient statistics for `update_reward_shift`.

    Raises:
        ValueError: malformed pair metadata (names the pair) or a shape mismatch. RuntimeError (torch._assert_async,
            checked on the device: on a GPU it surfaces at the step's next read): num_global_pairs smaller than this
            microbatch's valid pairs.

    Formulas: MPO (Wang et al. 2024, arXiv 2411.10442 §3.2), DPO (Rafailov et al. 2023), paired BCO with reward shift
    (Jung et al. 2024); term semantics, flags and the δ statistics follow NeMo-RL's MPOLossFn.
    All log-sigmoids use softplus forms, finite for β·Δ = ±1000.
    """
    if not (policy_logprobs.shape == ref_logprobs.shape == num_response_tokens.shape) or policy_logprobs.dim() != 1:
        raise ValueError(
            f"policy_logprobs, ref_logprobs and num_response_tokens must all be [S]; got "
            f"{tuple(policy_logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(num_response_tokens.shape)}"
        )
    device = policy_logprobs.device
    num_response_tokens = num_response_tokens.to(device)
    if not (pair_index.shape == sample_mask.shape == num_response_tokens.shape):
        raise ValueError(
            f"num_response_tokens, pair_index and sample_mask must all be [S]; got "
            f"{tuple(num_response_tokens.shape)}, {tuple(pair_index.shape)}, {tuple(sample_mask.shape)}"
        )
    chosen, rejected, _ = pair_layout(pair_index, is_chosen)  # where the metadata is (the host in training)
    chosen, rejected = pack.to_device(chosen, device), pack.to_device(rejected, device)
    row_ok = pack.to_device(sample_mask, device).bool() & (num_response_tokens > 0)
    valid = row_ok[chosen] & row_ok[rejected]
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
            "reward_shift_used": torch.tensor(delta, dtype=policy_logprobs.dtype, device=device),
        }
        metrics = {k: v.detach() for k, v in metrics.items()}
        reward_sum = torch.where(valid, q_c + q_r, zero).sum().detach()
        reward_count = 2.0 * num_local.to(policy_logprobs.dtype)
    return loss, metrics, (reward_sum, reward_count)


def combine_metrics(per_microbatch: Iterable[Mapping[str, torch.Tensor | float]],
                    read: bool = True) -> dict[str, float] | dict[str, torch.Tensor]:
    """Combine one rank's per-microbatch metric dicts of a step as METRIC_REDUCTION says (sum "mean" and "count"
    metrics in float64, in microbatch order, keep the first "constant"). Across DP ranks, all-reduce (SUM) the summed
    keys the same way (monitor.reduce_metrics). Returns Python floats (one read of the device), or with read=False
    0-d float64 tensors where the metrics are (nothing read)."""
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


def update_reward_shift(
    shift: float, reward_sum: float | torch.Tensor, reward_count: float | torch.Tensor, momentum: float
) -> float:
    """One EMA step of the BCO reward shift after `optimizer.step()`: δ' = m·δ + (1 − m)·(Σ/count).

    Args:
        shift: δ used by the step just taken.
        reward_sum: Σ β·L_y over the step's valid chosen and rejected rows, summed over all microbatches and DP ranks.
        reward_count: the number of those rows (2 per valid pair).
        momentum: m = mpo.reward_shift_momentum, in [0, 1).

    Returns:
        the new δ (float); unchanged when reward_count == 0 (an empty step).

    Raises:
        ValueError: momentum outside [0, 1) (NaN included), a non-finite shift, a negative count, or a non-finite
            statistic.

    Source: NeMo-RL MPOLossFn.update_reward_shift: the δ of step t only uses rewards of steps
    < t; the MPO paper (arXiv 2411.10442) describes δ as a moving average of previous rewards.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"reward_shift_momentum = {momentum} must be in [0, 1)")
    if not math.isfinite(float(shift)):
        raise ValueError(f"reward_shift = {float(shift)} must be a finite number")
    total, count = float(reward_sum), float(reward_count)
    if count < 0 or not math.isfinite(total) or not math.isfinite(count):
        raise ValueError(f"invalid reward-shift statistics: reward_sum = {total}, reward_count = {count}")
    if count == 0:
        return float(shift)
    return momentum * float(shift) + (1.0 - momentum) * (total / count)
