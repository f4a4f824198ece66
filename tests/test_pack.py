"""Tests of pack.py: pair-atomic planning, DP balancing, THD format, media bookkeeping and CP slicing.

Run: `pytest tests/test_pack.py` (CPU, a few seconds).
"""

import random
from types import SimpleNamespace

import oracles
import pytest
import torch
from conftest import raises_naming
from hypothesis import given, settings
from hypothesis import strategies as st

import pack
import preflight
from bench import packing, workload
from config import ConfigError, load_config

IMG = 99  # <image> token id used by the tests; ordinary tokens are drawn from 100..999
PATCH_DIM = 3 * 16 * 16


def make_pair(pid, c_len, r_len, images=(), resp=(3, 2), rng=None):
    """A PreferencePair with rows [IMG * image tokens, text..., response...]; the last resp[i] tokens are the response.

    images: list of (gh, gw) grids; each contributes gh*gw/4 <image> tokens to both rows (vision once per pair).
    """
    rng = rng or random.Random(pid)
    counts = [gh * gw // 4 for gh, gw in images]
    n_img = sum(counts)

    def row(n, n_resp):
        n = max(n, n_img + 1)
        ids = torch.tensor([IMG] * n_img + [rng.randint(100, 999) for _ in range(n - n_img)], dtype=torch.int64)
        mask = torch.zeros(n, dtype=torch.bool)
        n_resp = min(n_resp, n - n_img - 1) if n - n_img > 1 else 0
        if n_resp > 0:
            mask[n - n_resp :] = True
        return ids, mask

    ci, cm = row(c_len, resp[0])
    ri, rm = row(r_len, resp[1])
    patches = sum(gh * gw for gh, gw in images)
    return pack.PreferencePair(
        pair_id=pid,
        chosen_ids=ci,
        rejected_ids=ri,
        chosen_loss_mask=cm,
        rejected_loss_mask=rm,
        pixel_values=torch.randn(patches, PATCH_DIM),
        image_grid_hw=torch.tensor(list(images), dtype=torch.int64).reshape(-1, 2),
        image_token_counts=torch.tensor(counts, dtype=torch.int64),
    )


def naive_ffd(sizes, cap, max_items):
    """Textbook first-fit-decreasing (scan every bin), the reference for pack.first_fit_decreasing."""
    bins, loads = [], []
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        for b in range(len(bins)):
            if loads[b] + sizes[i] <= cap and len(bins[b]) < max_items:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def real_pairs(plan):
    return [p for r in plan.ranks for b in r if not b.dummy for p in b.pair_ids]


# ----------------------------------------------------------------------------------------------------------------------
# Planning


def test_two_pairs_of_50_token_rows_pack_without_bin_padding():
    plan = pack.plan_bins({0: (50, 50), 1: (50, 50)}, 500, 2, 1)
    assert [b.pair_ids for b in plan.ranks[0]] == [(0, 1)]
    assert plan.ranks[0][0].tokens == 200
    pairs = [make_pair(p, 50, 50) for p in plan.ranks[0][0].pair_ids]
    b = pack.pack(pairs, divisible_by=1, image_token_id=IMG)
    assert b.cu_seqlens.tolist() == [0, 50, 100, 150, 200]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens_padded.dtype == torch.int32
    assert b.cu_seqlens_padded.tolist() == [0, 50, 100, 150, 200]
    assert b.input_ids.shape == (1, 200)  # not padded to the 500-token bin
    b8 = pack.pack(pairs, divisible_by=8, image_token_id=IMG)
    assert b8.cu_seqlens.tolist() == [0, 50, 100, 150, 200]
    assert b8.cu_seqlens_padded.tolist() == [0, 56, 112, 168, 224]
    assert b8.max_seqlen == 56 and b8.input_ids.shape == (1, 224)
    assert b8.pair_index.tolist() == [0, 0, 1, 1] and b8.is_chosen.tolist() == [True, False, True, False]


def test_first_fit_decreasing_closed_form():
    # capacity 10: 6 opens bin A, 5 opens B, 4 -> A (10), 3 -> B (8), 2 -> B (10)
    bins = pack.first_fit_decreasing({10: 4, 11: 6, 12: 2, 13: 5, 14: 3}, 10, 5)
    assert bins == [[11, 10], [13, 14, 12]]
    # the pair cap forces a third bin
    assert pack.first_fit_decreasing({10: 4, 11: 6, 12: 2, 13: 5, 14: 3}, 10, 2) == [[11, 10], [13, 14], [12]]


def test_pair_size_is_sum_of_padded_rows():
    plan = pack.plan_bins({7: (13, 9)}, 100, 1, 1, divisible_by=8)
    b = plan.ranks[0][0]
    assert (b.tokens, b.useful) == (16 + 16, 22)
    assert b.cost == pytest.approx(pack.sequence_cost(16) * 2)


def test_split_instead_of_dummy_and_dummy_when_unsplittable():
    # 4 small pairs fit one bin; with DP=2 the bin is split (no dummy), each rank gets real work
    plan = pack.plan_bins({i: (10, 10) for i in range(4)}, 1000, 4, 2)
    assert len(pack.first_fit_decreasing({i: 20 for i in range(4)}, 1000, 4)) == 1
    assert not any(b.dummy for r in plan.ranks for b in r)
    assert sorted(len(r[0].pair_ids) for r in plan.ranks) == [2, 2]
    # 3 pairs, one per bin, DP=2: one zero-weight dummy bin repeating the smallest pair (id 2)
    plan = pack.plan_bins({0: (30, 30), 1: (20, 20), 2: (10, 12)}, 1000, 1, 2)
    dummies = [b for r in plan.ranks for b in r if b.dummy]
    assert plan.num_microbatches == 2 and len(dummies) == 1
    assert dummies[0].pair_ids == (2,) and dummies[0].useful == 0 and dummies[0].tokens == 22
    assert sorted(real_pairs(plan)) == [0, 1, 2]
    # the dummy bin packs with sample_mask 0 and pair_index -1
    d = pack.pack([make_pair(2, 10, 12)], 1, IMG, dummy=True)
    assert d.sample_mask.tolist() == [0.0, 0.0] and d.pair_index.tolist() == [-1, -1]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=40),
    max_tokens=st.integers(64, 1200),
    max_seqs=st.integers(1, 6),
    dp=st.integers(1, 8),
    div=st.sampled_from([1, 2, 8, 16]),
)
def test_plan_invariants(lens, max_tokens, max_seqs, dp, div):
    lengths = {100 + i: v for i, v in enumerate(lens)}
    pad = lambda n: -(-n // div) * div
    oversized = sorted(p for p, (c, r) in lengths.items() if pad(c) + pad(r) > max_tokens)
    if len(oversized) == len(lengths):
        with raises_naming(ValueError, f"packing.max_tokens_per_bin = {max_tokens}", f"{len(oversized)} dropped"):
            pack.plan_bins(lengths, max_tokens, max_seqs, dp, div, drop_oversized=True)
        return
    if oversized:
        with raises_naming(ValueError, f"pair {oversized[0]} needs", f"packing.max_tokens_per_bin = {max_tokens}"):
            pack.plan_bins(lengths, max_tokens, max_seqs, dp, div)
    plan = pack.plan_bins(lengths, max_tokens, max_seqs, dp, div, drop_oversized=True)
    assert plan.dropped == oversized
    # every kept pair exactly once per step, in real bins only
    assert sorted(real_pairs(plan)) == sorted(set(lengths) - set(oversized))
    # same number of microbatches on every rank; capacities hold; bin sizes are sums of padded rows
    assert all(len(r) == plan.num_microbatches for r in plan.ranks) and len(plan.ranks) == dp
    for r in plan.ranks:
        for b in r:
            assert len(b.pair_ids) <= max_seqs
            assert b.tokens == sum(pad(lengths[p][0]) + pad(lengths[p][1]) for p in b.pair_ids) <= max_tokens
            assert b.useful == (0 if b.dummy else sum(sum(lengths[p]) for p in b.pair_ids))
    # dummy bins only fill up to a multiple of DP
    assert sum(b.dummy for r in plan.ranks for b in r) < dp
    kept = {p: pad(c) + pad(r) for p, (c, r) in lengths.items() if p not in oversized}
    assert pack.first_fit_decreasing(kept, max_tokens, max_seqs) == naive_ffd(kept, max_tokens, max_seqs)
    n_ffd = len(naive_ffd(kept, max_tokens, max_seqs))
    assert n_ffd <= dp * plan.num_microbatches < n_ffd + dp  # bins split or dummies added up to a multiple of DP
    # deterministic, also for another insertion order of the same pairs
    again = pack.plan_bins(dict(reversed(list(lengths.items()))), max_tokens, max_seqs, dp, div, drop_oversized=True)
    assert again.ranks == plan.ranks


def test_oversized_pair_error_names_pair_sizes_and_limit():
    with pytest.raises(ValueError) as e:
        pack.plan_bins({0: (10, 10), 5: (300, 250)}, 512, 1, 1, divisible_by=8)
    msg = str(e.value)
    assert "pair 5 needs 560 tokens (550 real" in msg
    assert "max_tokens_per_bin = 512" in msg and "drop_oversized_pairs" in msg
    with pytest.raises(AssertionError):
        pack.plan_bins({3: (0, 5)}, 512, 1, 1)


def test_divisibility_rule():
    """preflight.check_packing: make_sequence_length_divisible_by is a multiple of 2*CP (CP > 1), times TP under SP."""
    def cfg(divisible_by, tp, cp, sp):
        return SimpleNamespace(packing=SimpleNamespace(make_sequence_length_divisible_by=divisible_by,
                                                       shared_prompt=False),
                               parallel=SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                        sequence_parallel=sp))

    for ok in ((8, 1, 1, False), (8, 4, 2, False), (16, 4, 2, True), (4, 4, 1, True)):  # SP off: TP does not matter
        preflight.check_packing(cfg(*ok))
    for bad, need in (((8, 4, 2, True), 16), ((4, 1, 4, False), 8), ((3, 2, 1, True), 2)):
        with raises_naming(ConfigError, f"packing.make_sequence_length_divisible_by = {bad[0]}", f"multiple of {need}"):
            preflight.check_packing(cfg(*bad))
    with raises_naming(ConfigError, "packing.make_sequence_length_divisible_by = 0", ">= 1"):  # config.validate's rule
        load_config(None, ["packing.make_sequence_length_divisible_by=0"])


def test_config_entry_points():
    cfg = load_config(None, ["packing.max_tokens_per_bin=64", "packing.make_sequence_length_divisible_by=8",
                             "packing.shared_prompt=false"])
    with raises_naming(ValueError, "pair 1 needs 72 tokens", "packing.max_tokens_per_bin = 64"):
        pack.plan_step({0: (20, 20), 1: (60, 2)}, cfg.packing, dp_size=1)
    cfg = load_config(None, ["packing.max_tokens_per_bin=64", "packing.drop_oversized_pairs=true",
                             "packing.shared_prompt=false"])
    plan = pack.plan_step({0: (20, 20), 1: (60, 2)}, cfg.packing, dp_size=1)
    assert plan.dropped == [1] and real_pairs(plan) == [0]
    cfg = load_config(None, ["parallel.context_parallel_size=8"])  # default divisible_by 8 < 2*CP = 16
    with raises_naming(ConfigError, "packing.make_sequence_length_divisible_by = 8", "multiple of 16", "CP = 8"):
        preflight.check_packing(cfg)
    with raises_naming(ConfigError, "packing.pair_grouping_key = 'prompt'", "['pair_index']"):  # config's Literal
        load_config(None, ["packing.pair_grouping_key=prompt"])


# ----------------------------------------------------------------------------------------------------------------------
# Efficiency and balancing on a realistic length mix (shared with the benchmark)


def test_synthetic_mmpr_lengths_ranges():
    lengths = workload.synthetic_mmpr_lengths(512, seed=3)
    assert lengths == workload.synthetic_mmpr_lengths(512, seed=3)
    rows = [n for c_r in lengths.values() for n in c_r]
    assert 300 + 50 <= min(rows) and max(rows) <= 3400 + 1500
    assert min(rows) < 700 and max(rows) > 3500  # the mix spans the range


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_efficiency_and_dp_balance(seed):
    lengths = workload.synthetic_mmpr_lengths(256, seed=seed)
    greedy = pack.plan_bins(lengths, 10240, 1, 8, divisible_by=8)
    rr = packing.round_robin_ranks(greedy, lengths)
    assert not any(b.dummy for r in greedy.ranks for b in r) and greedy.num_microbatches == 32
    assert oracles.packing_efficiency(greedy) >= 0.99
    assert packing.rank_imbalance(greedy.ranks) <= 1.03
    # the same bins dealt round-robin in data order: clearly worse (about 1.1)
    assert sorted(b.pair_ids for r in rr for b in r) == sorted(b.pair_ids for r in greedy.ranks for b in r)
    assert packing.rank_imbalance(rr) >= 1.05
    assert packing.rank_imbalance(greedy.ranks) < packing.rank_imbalance(rr)
    # multi-pair bins keep the efficiency (THD packs are not padded to the bin)
    multi = pack.plan_bins(lengths, 16384, 4, 8, divisible_by=8)
    assert oracles.packing_efficiency(multi) >= 0.99


def test_imbalance_and_efficiency_closed_form():
    bins = [pack.Bin((i,), t, t - 1, float(t)) for i, t in enumerate([10, 20, 30, 40])]
    ranks = packing.deal_round_robin(bins, 2)  # rank 0: 10 + 30, rank 1: 20 + 40
    assert packing.rank_imbalance(ranks) == pytest.approx(60 / 50)
    greedy = pack.deal_greedy(bins, 2)  # 40 -> r0, 30 -> r1, 20 -> r1, 10 -> r0: 50 / 50
    assert [[b.tokens for b in r] for r in greedy] == [[40, 10], [30, 20]]
    assert packing.rank_imbalance(greedy) == 1.0
    plan = pack.BinPlan(ranks=greedy, num_microbatches=2)
    assert oracles.packing_efficiency(plan) == pytest.approx(96 / 100)


# ----------------------------------------------------------------------------------------------------------------------
# THD format


pair_spec = st.tuples(
    st.integers(1, 40),
    st.integers(1, 40),
    st.lists(st.sampled_from([(2, 2), (4, 2), (2, 6)]), max_size=2),
    st.tuples(st.integers(0, 10), st.integers(0, 10)),
)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(pair_spec, min_size=1, max_size=4), div=st.sampled_from([1, 2, 8]))
def test_pack_unpack_roundtrip_and_labels(specs, div):
    pairs = [make_pair(10 + i, c, r, imgs, resp) for i, (c, r, imgs, resp) in enumerate(specs)]
    b = pack.pack(pairs, divisible_by=div, image_token_id=IMG, pad_token_id=7)
    rows = [
        (p.pair_id, ch, getattr(p, f"{ch}_ids"), getattr(p, f"{ch}_loss_mask"))
        for p in pairs
        for ch in ("chosen", "rejected")
    ]
    seqs = oracles.unpack(b)
    assert len(seqs) == len(rows) == b.num_sequences and b.num_pairs == len(pairs)
    T = b.input_ids.shape[1]
    assert int(b.cu_seqlens_padded[-1]) == T and all(t.shape == (1, T) for t in (b.labels, b.loss_mask, b.position_ids))
    seq_of = torch.full((T,), -1)
    for s, ((pid, ch, ids, mask), d) in enumerate(zip(rows, seqs, strict=True)):
        n = ids.numel()
        a, e = int(b.cu_seqlens_padded[s]), int(b.cu_seqlens_padded[s + 1])
        assert (e - a) % div == 0 and e - a - n < div and int(b.cu_seqlens[s + 1] - b.cu_seqlens[s]) == n
        seq_of[a : a + n] = s
        assert torch.equal(d["input_ids"], ids) and torch.equal(d["seq_loss_mask"], mask)
        assert torch.equal(d["labels"][:-1], ids[1:]) and int(d["labels"][-1]) == pack.IGNORE_INDEX
        assert torch.equal(d["loss_mask"][:-1], mask[1:]) and not bool(d["loss_mask"][-1])
        assert torch.equal(b.position_ids[0, a:e], torch.arange(e - a))
        # padding: pad ids, ignore labels, never a response token
        assert (b.input_ids[0, a + n : e] == 7).all() and (b.labels[0, a + n : e] == pack.IGNORE_INDEX).all()
        assert not b.loss_mask[0, a + n : e].any()
        assert int(b.pair_index[s]) == pid and bool(b.is_chosen[s]) == (ch == "chosen")
    assert b.sample_mask.tolist() == [1.0] * len(rows)
    # labels never cross a sequence boundary: every counted prediction t -> t+1 stays inside one sequence's real tokens
    t = torch.nonzero(b.loss_mask[0]).flatten()
    assert (seq_of[t] >= 0).all() and (t + 1 < T).all() and torch.equal(seq_of[t], seq_of[t + 1])
    assert torch.equal(b.labels[0, t], b.input_ids[0, t + 1])
    # the number of counted tokens equals the number of response tokens of the rows
    assert int(b.loss_mask.sum()) == sum(int(m.sum()) for *_, m in rows)


def test_media_stored_once_per_pair():
    pairs = [make_pair(0, 30, 25, [(4, 2), (2, 2)]), make_pair(1, 20, 22, []), make_pair(2, 30, 40, [(2, 6)])]
    b = pack.pack(pairs, divisible_by=8, image_token_id=IMG)
    assert b.pixel_values.shape == (8 + 4 + 12, PATCH_DIM)  # once per pair, not per row
    assert torch.equal(b.pixel_values, torch.cat([p.pixel_values for p in pairs]))
    assert b.image_grid_hw.tolist() == [[4, 2], [2, 2], [2, 6]] and b.image_token_counts.tolist() == [2, 1, 3]
    assert b.media_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert b.media_image_offsets.tolist() == [0, 2, 2, 3] and b.media_patch_offsets.tolist() == [0, 12, 12, 24]
    # every sequence's <image> count equals its media slot's token total
    for s in range(b.num_sequences):
        m = int(b.media_index[s])
        lo, hi = int(b.media_image_offsets[m]), int(b.media_image_offsets[m + 1])
        seg = b.input_ids[0, int(b.cu_seqlens_padded[s]) : int(b.cu_seqlens_padded[s + 1])]
        assert int((seg == IMG).sum()) == int(b.image_token_counts[lo:hi].sum())


def test_pair_invariants_are_asserted():
    p = make_pair(4, 30, 30, [(4, 2)])  # 2 <image> tokens per row
    p.rejected_ids[5] = IMG
    with raises_naming(AssertionError, "pair 4: <image> tokens"):
        pack.pack([p], 8, IMG)
    p = make_pair(4, 30, 30, [(4, 2)])
    p.pixel_values = p.pixel_values[:5]
    with raises_naming(AssertionError, "pair 4: pixel_values"):
        pack.pack([p], 8, IMG)
    p = make_pair(4, 30, 30)
    p.chosen_loss_mask[0] = True
    with raises_naming(AssertionError, "pair 4: mask"):
        pack.pack([p], 8, IMG)
    p = make_pair(4, 30, 30)
    p.rejected_loss_mask = p.rejected_loss_mask[:-1]
    with raises_naming(AssertionError, "pair 4: mask"):
        pack.pack([p], 8, IMG)
    with pytest.raises(AssertionError):
        pack.pack([], 8, IMG)


def test_packed_seq_params():
    b = pack.pack([make_pair(0, 13, 6)], divisible_by=8, image_token_id=IMG)
    psp = pack.thd_packed_seq_params(b.cu_seqlens, b.cu_seqlens_padded, b.max_seqlen)
    assert psp.qkv_format == "thd" and psp.max_seqlen_q == psp.max_seqlen_kv == 16
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 13, 19]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 16, 24]
    assert psp.total_tokens == 24 and psp.pad_between_seqs is True
    # megatron-core derives the Mamba sequence index from the padded boundaries
    assert psp.seq_idx.tolist() == [[0] * 16 + [1] * 8]


def test_routing_padding_mask_marks_padding_tail_and_dummy_bins():
    """True (megatron-core's "padding") at each row's padding, past the last sequence, and on a dummy bin."""
    b = pack.pack([make_pair(0, 13, 6)], divisible_by=8, image_token_id=IMG)  # rows 13 -> 16 and 6 -> 8 tokens
    want = [False] * 13 + [True] * 3 + [False] * 6 + [True] * 2
    assert pack.routing_padding_mask(b.cu_seqlens, b.cu_seqlens_padded, 24, b.sample_mask).tolist() == want
    assert pack.routing_padding_mask(b.cu_seqlens, b.cu_seqlens_padded, 28).tolist() == want + [True] * 4
    dummy = pack.pack([make_pair(0, 13, 6)], divisible_by=8, image_token_id=IMG, dummy=True)
    assert pack.routing_padding_mask(dummy.cu_seqlens, dummy.cu_seqlens_padded, 24, dummy.sample_mask).all()


# ----------------------------------------------------------------------------------------------------------------------
# Context parallelism


def reference_cp_index(padded_lens, cp, r):
    """Independent loop version of the r / 2CP-1-r rule."""
    out, start = [], 0
    for n in padded_lens:
        c = n // (2 * cp)
        out += list(range(start + r * c, start + (r + 1) * c))
        out += list(range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c))
        start += n
    return out


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=5), cp=st.sampled_from([1, 2, 4]))
def test_cp_slice_then_gather_is_identity(chunks, cp):
    lens = [2 * cp * c for c in chunks]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(lens)
    ids = torch.randint(0, 1000, (1, T))
    emb = torch.randn(1, T, 3)
    idxs = [pack.cp_partition_index(cu, cp, r) for r in range(cp)]
    for r, idx in enumerate(idxs):
        assert idx.dtype == torch.int64 and idx.numel() == T // cp
        assert idx.tolist() == reference_cp_index(lens, cp, r)
    assert sorted(torch.cat(idxs).tolist()) == list(range(T))  # each token on exactly one rank
    for x in (ids, emb):
        assert torch.equal(oracles.cp_gather([x.index_select(1, i) for i in idxs], cu, dim=1), x)


def test_cp_chunk_ownership_example_and_megatron_reference(monkeypatch):
    # one sequence of 8 tokens, CP=2: chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert pack.cp_partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert pack.cp_partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # megatron-core's per-sequence zigzag split, applied sequence by sequence, is the same order
    from megatron.core import utils as mcu

    lens = [8, 24, 16]
    cu = torch.tensor([0, 8, 32, 48], dtype=torch.int32)
    x = torch.arange(48)[None]
    for cp in (2, 4):
        for r in range(cp):
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None, cp=cp: cp)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
            ref, a = [], 0
            for n in lens:
                out = mcu._get_batch_on_this_cp_rank_per_sequence_balancing({"tokens": x[:, a : a + n]}, None)
                ref.append(out["tokens"])
                a += n
            assert torch.equal(x.index_select(1, pack.cp_partition_index(cu, cp, r)), torch.cat(ref, dim=1))


def test_cp_errors():
    with raises_naming(AssertionError, "2*CP = 4"):
        pack.cp_partition_index(torch.tensor([0, 8, 14], dtype=torch.int32), 2, 0)
    with raises_naming(AssertionError, "cp_rank = 2"):
        pack.cp_partition_index(torch.tensor([0, 8], dtype=torch.int32), 2, 2)
    for bad in (torch.tensor([2, 6]), torch.tensor([], dtype=torch.int32)):  # not from 0, or empty
        with raises_naming(AssertionError, "cu_seqlens_padded"):
            pack.cp_partition_index(bad, 1, 0)


def test_cp_on_a_packed_batch():
    pairs = [make_pair(0, 13, 30, [(4, 2)], (4, 9)), make_pair(1, 7, 9, [], (2, 2))]
    b = pack.pack(pairs, divisible_by=8, image_token_id=IMG)
    cp = 4
    for name in ("input_ids", "labels", "loss_mask", "position_ids"):
        full = getattr(b, name)
        parts = [full.index_select(1, pack.cp_partition_index(b.cu_seqlens_padded, cp, r)) for r in range(cp)]
        assert all(p.shape == (1, full.shape[1] // cp) for p in parts)
        assert torch.equal(oracles.cp_gather(parts, b.cu_seqlens_padded), full)
    # the counted tokens are preserved across the CP split
    total = sum(
        int(b.loss_mask.index_select(1, pack.cp_partition_index(b.cu_seqlens_padded, cp, r)).sum()) for r in range(cp)
    )
    assert total == int(b.loss_mask.sum())
