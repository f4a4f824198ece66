"""Tests of mpo_loss.py: closed-form values of every term and flag, the reward-shift EMA, invariances (microbatch,
row order, chunking), masking of invalid pairs, extreme margins, a float64 gradient check of the whole pipeline, and
one 2-rank torchrun launch (tests/dist/check_mpo_loss.py) for the TP / CP / DP checks.

Run: `pytest tests/test_mpo_loss.py`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import raises_naming

from config import MPOConfig
from mpo_loss import (
    METRIC_REDUCTION,
    combine_metrics,
    count_valid_pairs,
    mpo_loss,
    packed_sequence_logprobs,
    pair_sequences,
    sequence_logprobs,
    sequence_logratios,
    sequence_sums,
    token_logprobs,
    update_reward_shift,
)
from pack import token_sequence_ids

DIST = Path(__file__).resolve().parent / "dist"  # the multi-rank workers


def softplus(x: float) -> float:
    return math.log1p(math.exp(x)) if x < 30 else x + math.log1p(math.exp(-x))


def cfg(**kw) -> MPOConfig:
    base = dict(reference_policy_kl_penalty=0.1, preference_loss_weight=0.8, bco_loss_weight=0.2, sft_loss_weight=0.0,
                preference_average_log_probs=False, quality_average_log_probs=False, sft_average_log_probs=False)
    base.update(kw)
    return MPOConfig(**base)


def one_pair(l_c: float, l_r: float, c: MPOConfig, delta: float = 0.0, *, pol=(-5.0, -7.0), n=(3, 4),
             order=(0, 1), dtype=torch.float64):
    """A one-pair bin with log-ratios L_c, L_r (summed): policy sums `pol`, reference = policy − L."""
    pol_t = torch.tensor(pol, dtype=dtype)
    ref_t = pol_t - torch.tensor([l_c, l_r], dtype=dtype)
    o = list(order)
    return mpo_loss(pol_t[o], ref_t[o], torch.tensor(n)[o], torch.tensor([7, 7]), torch.tensor([1, 0])[o],
                    torch.ones(2), c, delta, 1)


# ----------------------------------------------------------------------------------------------------------------------
# Closed-form values


def test_policy_equals_reference_gives_ln2_terms():
    loss, m, (rsum, rcnt) = one_pair(0.0, 0.0, cfg(reference_policy_kl_penalty=0.05))
    assert m["preference_loss"].item() == pytest.approx(0.693147, abs=1e-6)
    assert m["bco_loss"].item() == pytest.approx(1.386294, abs=1e-6)
    assert loss.item() == pytest.approx(0.831777, abs=1e-6)
    assert (rsum.item(), rcnt.item()) == (0.0, 2.0)
    assert m["accuracy"].item() == 0.0  # strict: L_c == L_r is not a win


def test_beta_delta_closed_form():
    c = cfg(reference_policy_kl_penalty=0.1)
    loss, m, (rsum, rcnt) = one_pair(2.0, -1.0, c, delta=0.05)
    assert m["bco_loss"].item() == pytest.approx(1.241914, abs=1e-6)  # a dropped δ gives 1.242536
    assert m["preference_loss"].item() == pytest.approx(0.554355, abs=1e-6)
    assert loss.item() == pytest.approx(0.8 * 0.5543552444685271 + 0.2 * 1.2419140955790642, abs=1e-9)
    assert m["rewards/chosen"].item() == pytest.approx(0.2)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)
    assert m["rewards/margin"].item() == pytest.approx(0.3)
    assert m["accuracy"].item() == 1.0
    assert m["reward_shift_used"].item() == 0.05
    assert rsum.item() == pytest.approx(0.1) and rcnt.item() == 2.0  # β·(2 + (−1)) over 2 rows
    assert m["bco/reward_mean"].item() == pytest.approx(0.05)


def test_large_delta_separates_bco_terms():
    # δ = 2, β = 1, L_c = L_r = 0: chosen side −log σ(−2), rejected side −log σ(2).
    _, m, _ = one_pair(0.0, 0.0, cfg(reference_policy_kl_penalty=1.0), delta=2.0)
    assert m["bco_loss"].item() == pytest.approx(softplus(2.0) + softplus(-2.0), abs=1e-12)
    _, m, _ = one_pair(3.0, 0.0, cfg(reference_policy_kl_penalty=1.0), delta=2.0)
    assert m["bco_loss"].item() == pytest.approx(softplus(-1.0) + softplus(-2.0), abs=1e-12)
    _, m, _ = one_pair(0.0, 3.0, cfg(reference_policy_kl_penalty=1.0), delta=2.0)
    assert m["bco_loss"].item() == pytest.approx(softplus(2.0) + softplus(1.0), abs=1e-12)


@pytest.mark.parametrize("weights", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.3, 0.5, 0.7)])
def test_weights_pick_terms(weights):
    w_p, w_q, w_g = weights
    c = cfg(reference_policy_kl_penalty=0.1, preference_loss_weight=w_p, bco_loss_weight=w_q, sft_loss_weight=w_g)
    loss, m, _ = one_pair(2.0, -1.0, c, delta=0.05, pol=(-6.0, -2.0))
    expected = w_p * 0.5543552444685271 + w_q * 1.2419140955790642 + w_g * 6.0
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert m["sft_loss"].item() == pytest.approx(6.0)  # reported even with w_g = 0


# A pair with unequal response lengths: chosen 2 tokens, rejected 4; policy sums −3 / −10, reference −4 / −8, so
# L (sum) = +1 / −2 and L (mean) = +0.5 / −0.5. β = 0.5, δ = 0.1.
FLAG_PAIR = dict(l_c=1.0, l_r=-2.0, pol=(-3.0, -10.0), n=(2, 4))


@pytest.mark.parametrize("average", [False, True])
def test_preference_average_flag(average):
    c = cfg(reference_policy_kl_penalty=0.5, preference_loss_weight=1.0, bco_loss_weight=0.0,
            preference_average_log_probs=average)
    loss, m, _ = one_pair(FLAG_PAIR["l_c"], FLAG_PAIR["l_r"], c, 0.1, pol=FLAG_PAIR["pol"], n=FLAG_PAIR["n"])
    # sum: −log σ(0.5·(1 − (−2))) = softplus(−1.5); mean: −log σ(0.5·(0.5 − (−0.5))) = softplus(−0.5)
    expected = 0.4740769841801067 if average else 0.2014132779827524
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert m["rewards/chosen"].item() == pytest.approx(0.25 if average else 0.5)
    assert m["rewards/rejected"].item() == pytest.approx(-0.25 if average else -1.0)


@pytest.mark.parametrize("average", [False, True])
def test_quality_average_flag(average):
    c = cfg(reference_policy_kl_penalty=0.5, preference_loss_weight=0.0, bco_loss_weight=1.0,
            quality_average_log_probs=average)
    loss, m, (rsum, rcnt) = one_pair(FLAG_PAIR["l_c"], FLAG_PAIR["l_r"], c, 0.1, pol=FLAG_PAIR["pol"],
                                     n=FLAG_PAIR["n"])
    # sum: softplus(−(0.5 − 0.1)) + softplus(−1 − 0.1); mean: softplus(−(0.25 − 0.1)) + softplus(−0.25 − 0.1)
    expected = 1.154339203208309 if average else 0.8003505775153834
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert rsum.item() == pytest.approx(0.0 if average else -0.5) and rcnt.item() == 2.0
    # The preference rewards keep the (unset) preference flag whatever the quality flag is.
    assert m["rewards/chosen"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("average", [False, True])
def test_sft_average_flag(average):
    c = cfg(preference_loss_weight=0.0, bco_loss_weight=0.0, sft_loss_weight=1.0, sft_average_log_probs=average)
    loss, m, _ = one_pair(FLAG_PAIR["l_c"], FLAG_PAIR["l_r"], c, pol=FLAG_PAIR["pol"], n=FLAG_PAIR["n"])
    assert loss.item() == pytest.approx(1.5 if average else 3.0, abs=1e-12)  # −(−3) ÷ 2 chosen tokens
    assert m["nll/chosen"].item() == pytest.approx(1.5)  # always the token mean
    assert m["logprobs/chosen"].item() == -3.0 and m["logprobs/rejected"].item() == -10.0


def test_sequence_logratios():
    pol, ref, n = torch.tensor([-3.0, -10.0, 0.0]), torch.tensor([-4.0, -8.0, 0.0]), torch.tensor([2, 4, 0])
    assert sequence_logratios(pol, ref, n, False).tolist() == [1.0, -2.0, 0.0]
    assert sequence_logratios(pol, ref, n, True).tolist() == [0.5, -0.5, 0.0]


# ----------------------------------------------------------------------------------------------------------------------
# Reward shift


def test_update_reward_shift():
    assert update_reward_shift(1.0, -10.0, 4, 0.5) == pytest.approx(-0.75)
    assert update_reward_shift(1.0, torch.tensor(-10.0), torch.tensor(4.0), 0.5) == pytest.approx(-0.75)
    assert update_reward_shift(1.0, 0.0, 0, 0.5) == 1.0
    assert update_reward_shift(0.3, 5.0, 2, 0.0) == 2.5
    with raises_naming(AssertionError, "reward_shift_momentum = 1.0"):
        update_reward_shift(1.0, -10.0, 4, 1.0)
    with raises_naming(ValueError, "reward_sum = nan", "reward_count = 4"):
        update_reward_shift(1.0, float("nan"), 4, 0.5)
    for shift in (float("nan"), float("inf")):  # NaN in gave NaN out
        with raises_naming(ValueError, f"reward_shift = {shift} ", "finite"):
            update_reward_shift(shift, 1.0, 2, 0.5)
    for m in (float("nan"), float("inf")):
        with raises_naming(AssertionError, f"reward_shift_momentum = {m}"):
            update_reward_shift(1.0, 1.0, 2, m)


def test_loss_statistics_over_reordered_rows_match_seed_example():
    # The seed's unit example: rows rej(p1), cho(p0), rej(p0), cho(p1), 2 tokens each,
    # policy sums −4, −1, −3, −2, reference 0, β = 1 → reward_sum −10 over 4 rows; δ = 1, m = 0.5 → −0.75.
    pol = torch.tensor([-4.0, -1.0, -3.0, -2.0], dtype=torch.float64)
    c = cfg(reference_policy_kl_penalty=1.0, preference_loss_weight=1.0, sft_loss_weight=0.25, bco_loss_weight=0.5,
            reward_shift_momentum=0.5)
    _, m, (rsum, rcnt) = mpo_loss(pol, torch.zeros(4, dtype=torch.float64), torch.full((4,), 2),
                                  torch.tensor([1, 0, 0, 1]), torch.tensor([0, 1, 0, 1]), torch.ones(4), c, 1.0, 2)
    assert (rsum.item(), rcnt.item()) == (-10.0, 4.0)
    assert update_reward_shift(1.0, rsum, rcnt, c.reward_shift_momentum) == pytest.approx(-0.75)
    assert m["reward_shift_used"].item() == 1.0  # the δ used, not updated by the loss


# ----------------------------------------------------------------------------------------------------------------------
# Pair metadata, masking, extremes


def test_malformed_pair_metadata_raises_naming_the_pair():
    pol = torch.zeros(4)
    n = torch.full((4,), 2)
    with raises_naming(ValueError, "pair 0 ", "1 chosen and 0 rejected", "pair_index=[1, 0, 2, 1]"):
        mpo_loss(pol, pol, n, torch.tensor([1, 0, 2, 1]), torch.tensor([1, 1, 0, 0]), torch.ones(4), cfg(), 0.0, 2)
    with raises_naming(ValueError, "pair 5 ", "2 chosen and 0 rejected"):
        pair_sequences(torch.tensor([5, 5]), torch.tensor([1, 1]))
    with raises_naming(ValueError, "pair 3 ", "1 chosen and 2 rejected"):
        pair_sequences(torch.tensor([3, 3, 3]), torch.tensor([1, 0, 0]))
    with pytest.raises(AssertionError):
        pair_sequences(torch.tensor([3, 3]), torch.tensor([1, 0, 0]))


def test_pair_sequences_any_order():
    chosen, rejected, ids = pair_sequences(torch.tensor([9, 4, 4, 9]), torch.tensor([False, False, True, True]))
    assert ids.tolist() == [4, 9] and chosen.tolist() == [2, 3] and rejected.tolist() == [1, 0]


def test_invalid_pairs_contribute_exactly_zero():
    c = cfg(reference_policy_kl_penalty=0.3, sft_loss_weight=0.5)
    pol = torch.tensor([-2.0, -5.0, 1e30, -1e30, -3.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-3.0, -4.0, 0.0, 0.0, -2.0, 0.0], dtype=torch.float64)
    n = torch.tensor([2, 3, 4, 4, 5, 0])  # pair 2 (rows 4, 5): rejected row has no response token
    pidx, cho = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([1, 0, 1, 0, 1, 0])
    smask = torch.tensor([1, 1, 0, 0, 1, 1])  # pair 1 is a dummy pair
    loss, m, (rsum, rcnt) = mpo_loss(pol, ref, n, pidx, cho, smask, c, 0.2, 1)
    loss.backward()
    only, m1, (rsum1, rcnt1) = mpo_loss(pol[:2].detach(), ref[:2], n[:2], pidx[:2], cho[:2], smask[:2], c, 0.2, 1)
    assert loss.item() == only.item() and math.isfinite(loss.item())
    assert pol.grad[2:].tolist() == [0.0] * 4 and torch.isfinite(pol.grad).all()
    assert m["num_valid_pairs"].item() == 1.0 and (rsum.item(), rcnt.item()) == (rsum1.item(), rcnt1.item())
    assert count_valid_pairs(n, pidx, cho, smask) == 1
    with raises_naming(RuntimeError, "num_global_pairs"):  # torch._assert_async: on a GPU, at the next sync
        mpo_loss(pol, ref, n, pidx, cho, smask, c, 0.2, 0)


def test_bin_without_valid_pairs_has_zero_loss_and_gradient():
    pol = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, m, (rsum, rcnt) = mpo_loss(pol, torch.zeros(2), torch.tensor([0, 3]), torch.tensor([0, 0]),
                                     torch.tensor([1, 0]), torch.ones(2), cfg(), 0.0, 0)
    loss.backward()
    assert loss.item() == 0.0 and pol.grad.tolist() == [0.0, 0.0] and rcnt.item() == 0.0
    assert all(math.isfinite(v.item()) for v in m.values())


@pytest.mark.parametrize("margin", [1000.0, -1000.0])
def test_extreme_margins_are_finite(margin):
    c = cfg(reference_policy_kl_penalty=1.0, preference_loss_weight=0.8, bco_loss_weight=0.2)
    pol = torch.tensor([margin / 2, -margin / 2], dtype=torch.float32, requires_grad=True)
    loss, m, _ = mpo_loss(pol, torch.zeros(2), torch.tensor([3, 3]), torch.tensor([0, 0]), torch.tensor([1, 0]),
                          torch.ones(2), c, 0.0, 1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pol.grad).all()
    # Δ = +1000: pref → 0, bco → 0; Δ = −1000: pref → 1000, bco → 500 + 500.
    assert m["preference_loss"].item() == pytest.approx(0.0 if margin > 0 else 1000.0, abs=1e-3)
    assert m["bco_loss"].item() == pytest.approx(0.0 if margin > 0 else 1000.0, abs=1e-3)
    assert pol.grad.abs().max().item() == pytest.approx(0.0 if margin > 0 else 1.0, abs=1e-6)


def test_metrics_reduction_contract():
    assert set(METRIC_REDUCTION) == {
        "loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/chosen", "rewards/rejected",
        "rewards/margin", "logprobs/chosen", "logprobs/rejected", "nll/chosen", "bco/reward_mean", "reward_shift_used",
        "num_valid_pairs",
    }
    _, m, _ = one_pair(2.0, -1.0, cfg(), 0.05)
    assert set(m) == set(METRIC_REDUCTION) and all(not v.requires_grad and v.dim() == 0 for v in m.values())
    both = combine_metrics([m, m])
    assert both["reward_shift_used"] == 0.05 and both["num_valid_pairs"] == 2.0
    assert both["loss"] == pytest.approx(2 * m["loss"].item())


# ----------------------------------------------------------------------------------------------------------------------
# The packed pipeline: token log-probs → per-sequence sums → loss


def make_rows(num_pairs: int, V: int, seed: int, dtype=torch.float64):
    """Rows 2p (chosen) and 2p+1 (rejected) of pair p: (logits leaf [L, V], labels [L], loss_mask [L], ref [L])."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(2 * num_pairs):
        L = int(torch.randint(3, 9, (1,), generator=g))
        n = int(torch.randint(1, L, (1,), generator=g))
        mask = torch.zeros(L, dtype=torch.bool)
        mask[L - n - 1 : L - 1] = True
        rows.append((torch.randn(L, V, generator=g, dtype=dtype).requires_grad_(),
                     torch.randint(0, V, (L,), generator=g), mask, -torch.rand(L, generator=g, dtype=dtype) * 3))
    return rows


def bin_loss(rows, row_ids, c, delta, num_global, chunk=4):
    """Pack rows `row_ids` into one THD row and run the whole pipeline."""
    logits = torch.cat([rows[i][0] for i in row_ids])
    labels = torch.cat([rows[i][1] for i in row_ids])
    mask = torch.cat([rows[i][2] for i in row_ids])
    ref = torch.cat([rows[i][3] for i in row_ids])
    cu = torch.tensor([0, *torch.tensor([rows[i][0].shape[0] for i in row_ids]).cumsum(0).tolist()], dtype=torch.int32)
    seq = token_sequence_ids(cu, logits.shape[0])
    S = len(row_ids)
    pol, n = packed_sequence_logprobs(logits, labels, mask, seq, S, None, None, chunk)
    ref_s, _ = sequence_logprobs(ref, mask, seq, S)
    return mpo_loss(pol, ref_s, n, torch.tensor([i // 2 for i in row_ids]), torch.tensor([i % 2 == 0 for i in row_ids]),
                    torch.ones(S), c, delta, num_global)


def reference_loss(rows, c, delta):
    """Independent float64 reference: log_softmax + gather per row, then the MPO formulas pair by pair in Python."""
    total = 0.0
    num_pairs = len(rows) // 2
    for p in range(num_pairs):
        L, n, pol = {}, {}, {}
        for side, (logits, labels, mask, ref) in (("c", rows[2 * p]), ("r", rows[2 * p + 1])):
            lp = torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0]
            pol[side] = lp[mask].sum()
            L[side] = pol[side] - ref[mask].sum()
            n[side] = int(mask.sum())
        lp_ = {s: L[s] / n[s] if c.preference_average_log_probs else L[s] for s in L}
        lq = {s: L[s] / n[s] if c.quality_average_log_probs else L[s] for s in L}
        b = c.reference_policy_kl_penalty
        pref = -torch.nn.functional.logsigmoid(b * (lp_["c"] - lp_["r"]))
        logsig = torch.nn.functional.logsigmoid
        bco = -logsig(b * lq["c"] - delta) - logsig(-(b * lq["r"] - delta))
        sft = -pol["c"] / n["c"] if c.sft_average_log_probs else -pol["c"]
        total = total + c.preference_loss_weight * pref + c.bco_loss_weight * bco + c.sft_loss_weight * sft
    return total / num_pairs


FULL_CFG = cfg(reference_policy_kl_penalty=0.7, preference_loss_weight=0.8, bco_loss_weight=0.2, sft_loss_weight=0.4,
               preference_average_log_probs=True, quality_average_log_probs=False, sft_average_log_probs=True)


def grads(rows):
    return [r[0].grad.clone() for r in rows]


def zero_grads(rows):
    for r in rows:
        r[0].grad = None


def test_pipeline_matches_float64_reference_values_and_gradients():
    rows = make_rows(3, V=7, seed=0)
    loss, _, _ = bin_loss(rows, list(range(6)), FULL_CFG, 0.15, 3)
    loss.backward()
    got = grads(rows)
    zero_grads(rows)
    ref = reference_loss(rows, FULL_CFG, 0.15)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    for a, b in zip(got, grads(rows), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_gradcheck_whole_loss():
    rows = make_rows(2, V=5, seed=1)
    shapes = [r[0].shape for r in rows]
    flat0 = torch.cat([r[0].detach().reshape(-1) for r in rows]).requires_grad_()

    def f(flat):
        parts = torch.split(flat, [s.numel() for s in shapes])
        new = [(p.view(s), r[1], r[2], r[3]) for p, s, r in zip(parts, shapes, rows, strict=True)]
        return bin_loss(new, [2, 1, 0, 3], FULL_CFG, -0.3, 2, chunk=3)[0]

    assert torch.autograd.gradcheck(f, (flat0,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("split", [[[0, 1, 2, 3]], [[0], [1, 2, 3]], [[0, 1], [2, 3]]])
def test_microbatch_invariance(split):
    rows = make_rows(4, V=6, seed=2)
    one, _, (s1, c1) = bin_loss(rows, list(range(8)), FULL_CFG, 0.1, 4)
    one.backward()
    g1 = grads(rows)
    zero_grads(rows)
    total, rsum, rcnt = 0.0, 0.0, 0.0
    for pairs in split:
        loss, _, (s, c) = bin_loss(rows, [r for p in pairs for r in (2 * p, 2 * p + 1)], FULL_CFG, 0.1, 4)
        loss.backward()  # gradient accumulation
        total, rsum, rcnt = total + loss.item(), rsum + s.item(), rcnt + c.item()
    assert total == pytest.approx(one.item(), abs=1e-12)
    assert rsum == pytest.approx(s1.item(), abs=1e-12) and rcnt == c1.item() == 8
    for a, b in zip(grads(rows), g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_row_order_invariance():
    rows = make_rows(3, V=6, seed=3)
    base, m0, st0 = bin_loss(rows, [0, 1, 2, 3, 4, 5], FULL_CFG, 0.2, 3)
    base.backward()
    g0 = grads(rows)
    zero_grads(rows)
    perm, m1, st1 = bin_loss(rows, [5, 2, 0, 3, 4, 1], FULL_CFG, 0.2, 3)
    perm.backward()
    assert perm.item() == pytest.approx(base.item(), abs=1e-12)
    for k in m0:
        assert m1[k].item() == pytest.approx(m0[k].item(), abs=1e-12), k
    assert st1[0].item() == pytest.approx(st0[0].item(), abs=1e-12)
    for a, b in zip(grads(rows), g0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------------
# token_logprobs and per-response sums


def test_token_logprobs_chunked_equals_unchunked_and_reference():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(23, 50, generator=g) * 4
    labels = torch.randint(0, 50, (23,), generator=g)
    ref = torch.log_softmax(x.double(), -1).gather(1, labels[:, None])[:, 0]
    out = {}
    for chunk in (1, 5, 23, 100):
        xi = x.clone().requires_grad_()
        lp = token_logprobs(xi, labels, None, chunk)
        (lp * torch.arange(23.0)).sum().backward()
        out[chunk] = (lp.detach(), xi.grad)
        torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-6)
    for chunk in (1, 5, 100):
        torch.testing.assert_close(out[chunk][0], out[23][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[chunk][1], out[23][1], rtol=0, atol=1e-6)


def test_token_logprobs_bf16_gives_fp32_and_never_touches_logits():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(9, 32, generator=g) * 3).to(dtype).requires_grad_()
        before = x.detach().clone()
        labels = torch.randint(0, 32, (9,), generator=g)
        lp = token_logprobs(x, labels, None, 4)
        lp.sum().backward()
        assert lp.dtype == torch.float32 and x.grad.dtype == dtype
        assert torch.equal(x.detach(), before)  # megatron's cross entropy would have shifted fp32 logits in place
        ref = torch.log_softmax(before.double(), -1).gather(1, labels[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), ref, rtol=0, atol=1e-5)


def test_token_logprobs_inplace_backward_same_gradient_in_the_logits_buffer():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (11,), generator=g)
    labels[3] = -100
    coef = torch.randn(11, generator=g, dtype=torch.float64)
    grads = []
    for inplace in (False, True):
        h.grad = None
        logits = h @ w.T  # an LM head's output: its backward needs h and w, not the logits
        before = logits.detach().clone()
        lp = token_logprobs(logits, labels, None, 4, inplace_backward=inplace)
        assert torch.equal(logits.detach(), before)  # the forward never writes the logits
        logits.retain_grad()
        (lp * coef).sum().backward()
        assert torch.equal(logits.detach(), before) != inplace  # in place: the buffer now holds the gradient
        if inplace:
            assert torch.equal(logits.detach(), logits.grad)
        grads.append((lp.detach(), h.grad.clone(), logits.grad.clone()))
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    # a second autograd reader of the logits is refused by autograd's version check, never fed the gradient
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    logits = x * 2.0
    other = (logits * logits).sum()  # saves `logits` for its own backward
    lp = token_logprobs(logits, torch.zeros(5, dtype=torch.long), None, 2, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + other).backward()


def test_token_logprobs_padding_labels_and_errors():
    x = torch.randn(4, 6, requires_grad=True)
    lp = token_logprobs(x, torch.tensor([1, -100, 5, 6]), None, 2)  # 6 is outside V = 6
    lp.sum().backward()
    assert lp[1].item() == 0.0 and lp[3].item() == 0.0
    assert x.grad[1].abs().sum().item() == 0.0 and x.grad[3].abs().sum().item() == 0.0
    for bad in ((x, torch.zeros(4, dtype=torch.long), None, 0), (x, torch.zeros(5, dtype=torch.long), None, 2),
                (x[0], torch.zeros(6, dtype=torch.long), None, 2)):  # chunk_size 0, labels, logits
        with pytest.raises(AssertionError):
            token_logprobs(*bad)


def test_token_sequence_ids_and_sequence_logprobs():
    seq = token_sequence_ids(torch.tensor([0, 3, 5], dtype=torch.int32), 7)
    assert seq.tolist() == [0, 0, 0, 1, 1, 2, 2]
    with raises_naming(ValueError, "cu_seqlens_padded", "T = 7", "[0, 5, 3]"):
        token_sequence_ids(torch.tensor([0, 5, 3]), 7)
    with raises_naming(ValueError, "cu_seqlens_padded", "T = 7", "[0, 3, 9]"):
        token_sequence_ids(torch.tensor([0, 3, 9]), 7)
    logprobs = torch.tensor([-1.0, -2.0, float("-inf"), -4.0, -5.0, -6.0, -7.0], requires_grad=True)
    mask = torch.tensor([1, 1, 0, 0, 1, 1, 0])  # the −inf sits on a masked token; token 5 is bin padding
    sums, n = sequence_logprobs(logprobs, mask, seq, 2)
    sums.sum().backward()
    assert sums.tolist() == [-3.0, -5.0] and n.tolist() == [2, 1]
    assert logprobs.grad.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    for bad in ([0, 3], [-1, 0]):  # an id above S failed deep inside index_add (IndexError)
        with raises_naming(ValueError, "seq_ids ", "[0, S = 2]", f"{min(bad)} .. {max(bad)}"):  # range, ids got
            sequence_sums(torch.ones(2), torch.tensor(bad), 2)


# ----------------------------------------------------------------------------------------------------------------------
# Multi-rank (one torchrun launch): TP vocab-parallel, CP slices, DP invariance


def test_multi_rank_tp_cp_dp(torchrun):
    proc = torchrun(DIST / "check_mpo_loss.py", env={"OMP_NUM_THREADS": "1"}, timeout=240)
    for check in ("tp", "cp", "dp"):
        assert f"PASS {check}" in proc.stdout, proc.stdout[-3000:]
    assert proc.ranks == {0: {"passed": ["tp", "cp", "dp"]}, 1: {"passed": ["tp", "cp", "dp"]}}


LOSS_FIELDS = {"reference_policy_kl_penalty": 0.25, "preference_loss_weight": 0.5, "bco_loss_weight": 0.5,
               "sft_loss_weight": 0.5, "preference_average_log_probs": True, "quality_average_log_probs": True,
               "sft_average_log_probs": True}  # field -> a changed value (the base below has the other)


def test_mpo_config_fields_used_exist_and_each_moves_the_loss():
    """mpo_loss reads exactly the seven loss fields of MPOConfig (a namespace holding only them gives the same loss),
    and each one changes the loss of FLAG_PAIR (every term nonzero there); the δ fields are update_reward_shift's."""
    names = {f.name for f in dataclasses.fields(MPOConfig)}
    assert {"reference_policy_kl_penalty", "preference_loss_weight", "bco_loss_weight", "sft_loss_weight",
            "preference_average_log_probs", "quality_average_log_probs", "sft_average_log_probs",
            "reward_shift", "reward_shift_momentum"} <= names
    base = cfg(reference_policy_kl_penalty=0.5, preference_loss_weight=0.3, bco_loss_weight=0.2, sft_loss_weight=0.1)

    def loss_of(c) -> float:
        return one_pair(FLAG_PAIR["l_c"], FLAG_PAIR["l_r"], c, 0.1, pol=FLAG_PAIR["pol"], n=FLAG_PAIR["n"])[0].item()

    only = SimpleNamespace(**{k: getattr(base, k) for k in LOSS_FIELDS})  # AttributeError if mpo_loss read more
    want = 0.3 * 0.2014132779827524 + 0.2 * 0.8003505775153834 + 0.1 * 3.0  # the flag tests' closed forms
    assert loss_of(only) == loss_of(base) == pytest.approx(want, abs=1e-12)
    for field, value in LOSS_FIELDS.items():
        assert getattr(base, field) != value, field
        assert abs(loss_of(dataclasses.replace(base, **{field: value})) - loss_of(base)) > 1e-3, field
