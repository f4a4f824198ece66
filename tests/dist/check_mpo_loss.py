"""Multi-rank checks of mpo_loss.py in one 2-rank gloo world (the world plays TP, then CP, then DP).

Run: `torchrun --standalone --nproc-per-node 2 tests/dist/check_mpo_loss.py` (tests/test_mpo_loss.py does, through
the `torchrun` fixture). Every rank checks against a single-process float64 reference it computes itself; rank 0 prints
`PASS <check>` per check, every rank reports the checks it passed (tests/dist/report.py: {"passed": [...]}), and any
mismatch raises (non-zero exit).

- tp: vocab-parallel token log-probs (V split over 2 ranks, fp32 logits, chunked) equal the full-vocabulary float64
  log_softmax gather to 1e-6, gradients of each vocabulary shard included.
- cp: per-sequence sums from megatron's load-balanced THD CP split (each sequence's padded length cut into 2·CP chunks,
  rank r keeps chunks r and 2·CP−1−r) equal the unsliced sums, and the MPO-loss gradient of each rank's tokens equals
  the matching rows of the unsliced gradient (float64, 1e-12).
- dp: 2 ranks with 2 pairs each (num_global_pairs = 4, gradients summed) give the gradients and the δ update of one
  rank holding all 4 pairs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import report  # noqa: E402  (tests/dist/report.py, beside this file)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from config import MPOConfig  # noqa: E402
from mpo_loss import (  # noqa: E402
    count_valid_pairs,
    mpo_loss,
    sequence_logprobs,
    token_logprobs,
    update_reward_shift,
)
from pack import token_sequence_ids  # noqa: E402


def cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices kept by `cp_rank` under megatron's load-balanced THD split (test reference, written from the
    split's definition)."""
    idx = []
    cu = cu_seqlens_padded.tolist()
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        chunk = (end - start) // (2 * cp_size)
        assert chunk * 2 * cp_size == end - start
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            idx.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return torch.tensor(idx, dtype=torch.long)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def check_tp(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(1)
    T, V = 13, 16
    full = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (T,), generator=g)
    labels[4] = -100  # padding id: log-prob 0, no gradient
    w = torch.randn(T, generator=g, dtype=torch.float64)
    ref_full = full.clone().requires_grad_()
    ref = torch.log_softmax(ref_full, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    ref = torch.where(labels >= 0, ref, torch.zeros((), dtype=ref.dtype))
    (ref * w).sum().backward()
    shard = V // world
    for chunk in (T, 4):
        local = full[:, rank * shard : (rank + 1) * shard].float().requires_grad_()
        lp = token_logprobs(local, labels, dist.group.WORLD, chunk)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp.double(), ref.detach(), rtol=0, atol=1e-6)
        (lp * w.float()).sum().backward()
        torch.testing.assert_close(
            local.grad.double(), ref_full.grad[:, rank * shard : (rank + 1) * shard], rtol=0, atol=1e-6
        )
    log(rank, "PASS tp")


def pairs_batch(g: torch.Generator, lengths: list[int], resp: list[int], V: int):
    """A packed row: sequences of padded `lengths`, the last `resp[i]` tokens of each are response tokens."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    loss_mask = torch.zeros(T, dtype=torch.bool)
    for i, n in enumerate(resp):
        if n:
            loss_mask[int(cu[i + 1]) - n - 1 : int(cu[i + 1]) - 1] = True  # keep the last (pad) token masked
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    ref_logprobs = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    return cu, loss_mask, logits, labels, ref_logprobs


def check_cp(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(2)
    V = 9
    cfg = MPOConfig(reference_policy_kl_penalty=0.7, preference_loss_weight=0.8, bco_loss_weight=0.2,
                    sft_loss_weight=0.5, quality_average_log_probs=True)
    cu, loss_mask, logits, labels, ref_tok = pairs_batch(g, [8, 12, 16, 4], [5, 7, 9, 2], V)
    pair_index, is_chosen = torch.tensor([3, 3, 8, 8]), torch.tensor([1, 0, 0, 1])
    sample_mask = torch.ones(4)
    T, S = int(cu[-1]), 4
    seq = token_sequence_ids(cu, T)

    def run(lg, lab, lm, sid, ref, group):
        pol, n = sequence_logprobs(token_logprobs(lg, lab, None, 5), lm, sid, S, group)
        rs, _ = sequence_logprobs(ref, lm, sid, S, group)
        loss, _, _ = mpo_loss(pol, rs, n, pair_index, is_chosen, sample_mask, cfg, 0.3, 2)
        return loss, pol, n

    full = logits.clone().requires_grad_()
    loss_ref, pol_ref, n_ref = run(full, labels, loss_mask, seq, ref_tok, None)
    loss_ref.backward()
    idx = cp_partition_index(cu, world, rank)
    local = logits[idx].clone().requires_grad_()
    loss, pol, n = run(local, labels[idx], loss_mask[idx], seq[idx], ref_tok[idx], dist.group.WORLD)
    loss.backward()
    torch.testing.assert_close(pol, pol_ref, rtol=0, atol=1e-12)
    assert torch.equal(n, n_ref), (n, n_ref)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(local.grad, full.grad[idx], rtol=0, atol=1e-12)
    log(rank, "PASS cp")


def check_dp(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(3)
    V, H = 11, 5
    cfg = MPOConfig(reference_policy_kl_penalty=0.4, sft_loss_weight=0.3, preference_average_log_probs=True)
    weight0 = torch.randn(H, V, generator=g, dtype=torch.float64)
    # 4 pairs = 8 rows; pair p has rows 2p (chosen) and 2p+1 (rejected).
    lengths = [4, 6, 8, 4, 6, 6, 4, 8]
    resp = [3, 5, 6, 2, 4, 5, 3, 7]
    rows = []
    for L, n in zip(lengths, resp, strict=True):
        h = torch.randn(L, H, generator=g, dtype=torch.float64)
        lab = torch.randint(0, V, (L,), generator=g)
        m = torch.zeros(L, dtype=torch.bool)
        m[L - n - 1 : L - 1] = True
        ref = -torch.rand(L, generator=g, dtype=torch.float64) * 2
        rows.append((h, lab, m, ref))

    def step(row_ids: list[int], weight: torch.Tensor, num_global: int):
        h = torch.cat([rows[i][0] for i in row_ids])
        lab = torch.cat([rows[i][1] for i in row_ids])
        m = torch.cat([rows[i][2] for i in row_ids])
        ref = torch.cat([rows[i][3] for i in row_ids])
        cu = torch.tensor([0, *torch.tensor([lengths[i] for i in row_ids]).cumsum(0).tolist()])
        seq = token_sequence_ids(cu, int(cu[-1]))
        S = len(row_ids)
        pol, n = sequence_logprobs(token_logprobs(h @ weight, lab, None, 7), m, seq, S)
        rs, _ = sequence_logprobs(ref, m, seq, S)
        pidx = torch.tensor([i // 2 for i in row_ids])
        cho = torch.tensor([i % 2 == 0 for i in row_ids])
        return mpo_loss(pol, rs, n, pidx, cho, torch.ones(S), cfg, -0.2, num_global)

    w_ref = weight0.clone().requires_grad_()
    loss_ref, _, (rsum_ref, rcnt_ref) = step(list(range(8)), w_ref, 4)
    loss_ref.backward()
    delta_ref = update_reward_shift(-0.2, rsum_ref, rcnt_ref, 0.9)

    mine = list(range(4 * rank, 4 * rank + 4))
    w = weight0.clone().requires_grad_()
    # num_global_pairs as train.py computes it: local valid pairs, all-reduced over DP.
    n = torch.tensor([resp[i] for i in mine])
    pidx, cho = torch.tensor([i // 2 for i in mine]), torch.tensor([i % 2 == 0 for i in mine])
    num_global = torch.tensor([count_valid_pairs(n, pidx, cho, torch.ones(len(mine)))], dtype=torch.float64)
    dist.all_reduce(num_global)
    assert int(num_global) == 4
    loss, _, (rsum, rcnt) = step(mine, w, int(num_global))
    loss.backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    stats = torch.stack([loss.detach(), rsum, rcnt])
    dist.all_reduce(stats)
    torch.testing.assert_close(grad, w_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(stats[0], loss_ref.detach(), rtol=0, atol=1e-12)
    delta = update_reward_shift(-0.2, stats[1], stats[2], 0.9)
    assert abs(delta - delta_ref) < 1e-12, (delta, delta_ref)
    log(rank, "PASS dp")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "run with --nproc-per-node 2"
    check_tp(rank, world)
    check_cp(rank, world)
    check_dp(rank, world)
    report.write({"passed": ["tp", "cp", "dp"]})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
