"""Tests of the shared-prompt pair format: packing, Mamba-2, attention and loss accounting.

Every check compares the shared format [prompt | chosen | rejected] against the separate-sequences format computed
independently in float64: a token-by-token Mamba-2 recurrence, an explicit softmax attention, the existing packed
mixer and `pack.pack`, and a toy causal model (embedding, Mamba mixer, GQA attention, LM head) through the MPO loss.

Run: `pytest tests/test_shared_prompt.py` (CPU, seconds).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import oracles
import pytest
import torch
import torch.nn.functional as F
from conftest import raises_naming

import mpo_loss
import pack
import preflight
from backend import mamba_torch as mt
from backend import shared_prompt
from bench import packing, workload
from config import ConfigError

F64 = torch.float64
IMG = 99
PATCH_DIM = 3 * 16 * 16

# (prompt, chosen, rejected, padding) span lengths of the rows used by the Mamba and attention tests: prompts not
# multiples of the chunk size (4), a chosen span shorter than the conv window (1), a one-token prompt, padding.
SPANS = [(5, 3, 7, 1), (9, 1, 2, 0), (1, 4, 4, 2), (6, 6, 1, 3)]


def row_offsets(spans, tail=0):
    """span_cu_seqlens_padded [3P+1] and the row length for (prompt, chosen, rejected, pad) spans + bin tail."""
    seg = [0]
    for p, c, r, pad in spans:
        seg += [seg[-1] + p, seg[-1] + p + c, seg[-1] + p + c + r + pad]
    return torch.tensor(seg, dtype=torch.int32), seg[-1] + tail


def separate_sequences(seg, T):
    """Token indices of the separate sequences a shared row stands for: per pair [prompt | chosen] and
    [prompt | rejected], then the bin tail; with the row positions each sequence's outputs land on
    (the rejected sequence's prompt outputs are not part of the shared row)."""
    out = []
    for a, c0, r0, e in pack.pair_spans(seg, T):
        out.append((torch.arange(a, r0), torch.arange(a, r0)))
        idx = torch.cat([torch.arange(a, c0), torch.arange(r0, e)])
        out.append((idx, torch.arange(r0, e)))
    end = int(seg[-1])
    if end < T:
        out.append((torch.arange(end, T), torch.arange(end, T)))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Mamba-2


def recurrence(x, dt, A, B, C):
    """Token-by-token Mamba-2 SSM of ONE sequence (float64, independent of mamba_torch): h_t = exp(dt_t·A)·h_{t−1}
    + dt_t·x_t⊗B_t, y_t = h_t·C_t. x [l, h, p], dt [l, h] (processed), B/C [l, g, n]. Returns y [l, h, p]."""
    r = x.shape[1] // B.shape[1]
    Bh, Ch = B.repeat_interleave(r, 1), C.repeat_interleave(r, 1)
    st = x.new_zeros(x.shape[1], x.shape[2], B.shape[2])
    ys = []
    for t in range(x.shape[0]):
        st = torch.exp(dt[t] * A)[:, None, None] * st + dt[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None, :]
        ys.append((st * Ch[t][:, None, :]).sum(-1))
    return torch.stack(ys)


@pytest.mark.parametrize("generic", [False, True], ids=["torch-states", "generic-kernel"])
@pytest.mark.parametrize("chunk_size", [4, 8])
def test_scan_equals_separate_sequences_values_and_gradients(chunk_size, generic):
    # generic: a scan_fn is given (mamba-ssm's on a GPU; here this module's), so the prompt state is summed over the
    # prompt; default: this module's scan returns it.
    seg, T = row_offsets(SPANS, tail=3)
    h, p, g, n = 4, 3, 2, 5
    gen = torch.Generator().manual_seed(0)
    leaves = dict(
        x=torch.randn(1, T, h, p, generator=gen, dtype=F64),
        dt=torch.randn(1, T, h, generator=gen, dtype=F64) * 0.5,
        A=-(torch.rand(h, generator=gen, dtype=F64) * 2 + 0.1),
        B=torch.randn(1, T, g, n, generator=gen, dtype=F64),
        C=torch.randn(1, T, g, n, generator=gen, dtype=F64),
        D=torch.randn(h, generator=gen, dtype=F64),
        z=torch.randn(1, T, h, p, generator=gen, dtype=F64),
        dt_bias=torch.randn(h, generator=gen, dtype=F64) * 0.3,
    )
    weight = torch.randn(1, T, h, p, generator=gen, dtype=F64)
    shared = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
    out = shared_prompt.mamba_chunk_scan(
        shared["x"], shared["dt"], shared["A"], shared["B"], shared["C"], chunk_size, seg, D=shared["D"],
        z=shared["z"], dt_bias=shared["dt_bias"], dt_softplus=True,
        scan_fn=mt.mamba_chunk_scan_combined if generic else None)
    (out * weight).sum().backward()

    ref = {k: v.clone().requires_grad_(True) for k, v in leaves.items()}
    expected = torch.zeros(T, h, p, dtype=F64)
    loss = 0.0
    for idx, dest in separate_sequences(seg, T):
        dtp = F.softplus(ref["dt"][0, idx] + ref["dt_bias"])
        y = recurrence(ref["x"][0, idx], dtp, ref["A"], ref["B"][0, idx], ref["C"][0, idx])
        y = (y + ref["D"][:, None] * ref["x"][0, idx]) * F.silu(ref["z"][0, idx])
        y = y[idx.numel() - dest.numel():]
        expected[dest] = y.detach()
        loss = loss + (y * weight[0, dest]).sum()
    loss.backward()
    assert (out[0] - expected).abs().max() < 1e-12
    for k in leaves:
        assert (shared[k].grad - ref[k].grad).abs().max() < 1e-10, k

    # The prompt's state matters: a plain packed scan that restarts at each rejected span differs there.
    split = shared_prompt.RowSpans(seg, T, "cpu").seq_idx(split_rejected=True)
    plain = mt.mamba_chunk_scan_combined(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size, D=leaves["D"], z=leaves["z"],
        dt_bias=leaves["dt_bias"], dt_softplus=True, seq_idx=split)
    assert (plain[0] - expected).abs().max() > 1e-3


def explicit_conv(x, w, b):
    """Causal depthwise conv of ONE sequence, tap by tap: x [dim, l], w [dim, W] -> [dim, l] (no activation)."""
    W = w.shape[1]
    out = b[:, None].expand_as(x).clone()
    for s in range(W):  # tap W-1-s reads s tokens back
        out[:, s:] = out[:, s:] + w[:, W - 1 - s: W - s] * x[:, : x.shape[1] - s]
    return out


def test_conv_rejected_sees_the_prompt_window():
    seg, T = row_offsets(SPANS, tail=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, T, generator=gen, dtype=F64)
    w = torch.randn(6, 4, generator=gen, dtype=F64)
    b = torch.randn(6, generator=gen, dtype=F64)
    out = shared_prompt.causal_conv1d(x, w, b, seg, activation="silu")
    for idx, dest in separate_sequences(seg, T):
        y = F.silu(explicit_conv(x[0][:, idx], w, b))[:, idx.numel() - dest.numel():]
        assert (out[0][:, dest] - y).abs().max() < 1e-13
    with raises_naming(ValueError, "span_cu_seqlens_padded", "3P+1 offsets", f"T = {T}"):
        shared_prompt.causal_conv1d(x, w, b, seg[:-1], activation="silu")


def mixer_tensors(T, h=4, p=2, g=2, n=3, width=4, seed=4):
    gen = torch.Generator().manual_seed(seed)
    dim = h * p
    conv_dim = dim + 2 * g * n
    return dict(
        zxbcdt=torch.randn(1, T, 2 * dim + 2 * g * n + h, generator=gen, dtype=F64),
        conv1d_weight=torch.randn(conv_dim, width, generator=gen, dtype=F64) * 0.5,
        conv1d_bias=torch.randn(conv_dim, generator=gen, dtype=F64) * 0.1,
        dt_bias=torch.randn(h, generator=gen, dtype=F64) * 0.5,
        A=-(torch.rand(h, generator=gen, dtype=F64) + 0.5),
        D=torch.randn(h, generator=gen, dtype=F64),
        rmsnorm_weight=torch.rand(dim, generator=gen, dtype=F64) + 0.5,
        outproj_weight=torch.randn(5, dim, generator=gen, dtype=F64),
    ), dict(headdim=p, ngroups=g, norm_before_gate=False, rmsnorm_eps=1e-5)


def test_mixer_equals_separate_sequences_with_conv_gradients():
    """The fused mixer body on a shared row equals the existing mixer on each separate row, outputs and the gradients
    of zxbcdt (so of x, B, C, z, dt), conv weight and bias, dt_bias, A, D, norm weight and out_proj."""
    seg, T = row_offsets(SPANS, tail=1)
    tensors, kw = mixer_tensors(T)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(1, T, 5, generator=gen, dtype=F64)
    a = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    out = shared_prompt.mamba_split_conv1d_scan(**a, chunk_size=4, row_spans=seg, **kw)
    (out * weight).sum().backward()
    b = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    loss = 0.0
    for idx, dest in separate_sequences(seg, T):
        alone = mt.mamba_split_conv1d_scan_combined(**dict(b, zxbcdt=b["zxbcdt"][:, idx]), chunk_size=4, **kw)
        alone = alone[:, idx.numel() - dest.numel():]
        assert (out[:, dest] - alone).abs().max() < 1e-12
        loss = loss + (alone * weight[:, dest]).sum()
    loss.backward()
    for k in tensors:
        assert (a[k].grad - b[k].grad).abs().max() < 1e-10, k
    # megatron-core's keywords: the pair spans' seq_idx (from cu_seqlens_padded of the spans) is accepted, another not
    spans = torch.tensor([0] + [int(e) for *_, e in pack.pair_spans(seg, T)], dtype=torch.int32)
    same = shared_prompt.mamba_split_conv1d_scan(**tensors, chunk_size=4, row_spans=seg, **kw,
                                                    seq_idx=mt.seq_idx_from_cu_seqlens(spans, T),
                                                    state_dtype=torch.float32)
    assert torch.equal(same, out.detach())
    with raises_naming(ValueError, "seq_idx", "spans", "cu_seqlens_padded"):
        shared_prompt.mamba_split_conv1d_scan(**tensors, chunk_size=4, row_spans=seg, **kw,
                                                 seq_idx=mt.seq_idx_from_cu_seqlens(seg, T))


def test_mixer_bf16_agrees_with_float64():
    """bf16 (the recipe's dtype): the shared-prompt mixer is finite and as close to the float64 separate sequences as
    the existing packed mixer in bf16 is (its error is bf16 rounding, not a format error)."""
    seg, T = row_offsets(SPANS)
    tensors, kw = mixer_tensors(T)
    exact = shared_prompt.mamba_split_conv1d_scan(**tensors, chunk_size=4, row_spans=seg, **kw)
    low = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    shared = shared_prompt.mamba_split_conv1d_scan(**low, chunk_size=4, row_spans=seg, **kw)
    assert shared.dtype == torch.bfloat16 and bool(torch.isfinite(shared).all())
    err_shared = (shared.double() - exact).abs().max()
    err_sep = 0.0
    for idx, dest in separate_sequences(seg, T):
        alone = mt.mamba_split_conv1d_scan_combined(**dict(low, zxbcdt=low["zxbcdt"][:, idx]), chunk_size=4, **kw)
        err_sep = max(err_sep, float((alone[:, idx.numel() - dest.numel():].double() - exact[:, dest]).abs().max()))
    scale = float(exact.abs().max())
    assert err_shared < 0.02 * scale and err_shared < 2 * err_sep + 1e-3 * scale


# ----------------------------------------------------------------------------------------------------------------------
# Attention


def explicit_attention(q, k, v, scale):
    """Causal softmax attention of ONE sequence with explicit matrices: q [l, h, d], k/v [l, g, d] -> [l, h·d]."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", a, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2)])
def test_attention_equals_separate_sequences_values_and_gradients(heads, groups):
    seg, T = row_offsets(SPANS, tail=2)
    d = 6
    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(T, heads, d, generator=gen, dtype=F64), torch.randn(T, groups, d, generator=gen, dtype=F64),
              torch.randn(T, groups, d, generator=gen, dtype=F64)]
    weight = torch.randn(T, heads * d, generator=gen, dtype=F64)
    q, k, v = (t.clone().requires_grad_(True) for t in leaves)
    out = shared_prompt.attention(q, k, v, seg, scale=0.3)
    assert out.shape == (T, heads * d)
    (out * weight).sum().backward()
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in leaves)
    loss = 0.0
    for idx, dest in separate_sequences(seg, T):
        y = explicit_attention(q2[idx], k2[idx], v2[idx], 0.3)[idx.numel() - dest.numel():]
        assert (out[dest] - y).abs().max() < 1e-12
        loss = loss + (y * weight[dest]).sum()
    loss.backward()
    for got, want in ((q, q2), (k, k2), (v, v2)):
        assert (got.grad - want.grad).abs().max() < 1e-12
    # The rejected tokens never see the chosen span: changing chosen keys leaves every rejected output unchanged.
    a, c0, r0, e = pack.pair_spans(seg, T)[0]
    k3 = leaves[1].clone()
    k3[c0:r0] += 5.0
    out3 = shared_prompt.attention(leaves[0], k3, leaves[2], seg, scale=0.3)
    base = shared_prompt.attention(*leaves, seg, scale=0.3)
    assert torch.equal(out3[r0:e], base[r0:e]) and (out3[c0:r0] - base[c0:r0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------------------
# Packing


def make_pair(pid, prompt_len, c_len, r_len, images=(), rng=None):
    """A PreferencePair whose rows share a prompt ([<image> tokens, text]) and end in different responses."""
    rng = rng or random.Random(pid)
    counts = [gh * gw // 4 for gh, gw in images]
    prompt = [IMG] * sum(counts) + [rng.randint(100, 999) for _ in range(prompt_len)]

    def row(n):
        ids = torch.tensor(prompt + [rng.randint(100, 999) for _ in range(n)], dtype=torch.int64)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[len(prompt):] = True
        return ids, mask

    (ci, cm), (ri, rm) = row(c_len), row(r_len)
    patches = sum(gh * gw for gh, gw in images)
    return pack.PreferencePair(
        pair_id=pid, chosen_ids=ci, rejected_ids=ri, chosen_loss_mask=cm, rejected_loss_mask=rm,
        pixel_values=torch.randn(patches, PATCH_DIM),
        image_grid_hw=torch.tensor(list(images), dtype=torch.int64).reshape(-1, 2),
        image_token_counts=torch.tensor(counts, dtype=torch.int64),
    )


PAIRS = [((7, 3, 5), [(4, 4)]), ((5, 6, 2), []), ((11, 1, 4), [(2, 4), (4, 2)])]


def make_pairs():
    return [make_pair(i, *lens, images=imgs) for i, (lens, imgs) in enumerate(PAIRS)]


def test_shared_prefix_length_closed_form():
    p = make_pair(0, 7, 3, 5, images=[(4, 4)])  # 4 image + 7 text tokens of prompt: k = 11 - 1
    assert pack.prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask) == 10
    ids = torch.tensor([1, 2, 3, 4])
    mask = torch.tensor([False, False, True, True])
    # identical rows: the common prefix stops at the first response token
    assert pack.prefix_length(ids, ids, mask, mask) == 1
    assert pack.prefix_length(ids, torch.tensor([5, 2, 3]), mask, mask[:3]) == 0


@pytest.mark.parametrize("div", [1, 8])
def test_pack_shared_matches_separate_sequences(div):
    pairs = make_pairs()
    sep = pack.pack(pairs, div, IMG)
    shr = pack.pack_shared_prompt(pairs, div, IMG)
    assert shr.shared_prompt and not sep.shared_prompt
    moved = shr.to("cpu")
    assert torch.equal(moved.span_cu_seqlens_padded, shr.span_cu_seqlens_padded) and moved.shared_prompt
    assert shr.num_responses == sep.num_responses == 6 and shr.num_sequences == 3
    for a, b in zip(oracles.unpack_shared(shr), oracles.unpack(sep), strict=True):
        for key in ("input_ids", "labels", "loss_mask", "position_ids", "seq_loss_mask"):
            assert torch.equal(a[key], b[key]), key
    for key in ("pair_index", "is_chosen", "sample_mask", "pixel_values", "image_grid_hw", "image_token_counts",
                "media_image_offsets", "media_patch_offsets"):
        assert torch.equal(getattr(shr, key), getattr(sep, key)), key
    assert shr.media_index.tolist() == [0, 1, 2]
    # images once: each pair span holds its <image> tokens once
    img_per_pair = [int((shr.input_ids[0, a:e] == IMG).sum()) for a, _, _, e in
                    pack.pair_spans(shr.span_cu_seqlens_padded, shr.input_ids.shape[1])]
    assert img_per_pair == [4, 0, 4]
    # spans: pair 0 has k = 4 + 7 - 1 = 10, chosen 11 + 3 - 10 = 4, rejected 11 + 5 - 10 = 6 tokens
    assert shr.span_cu_seqlens[:4].tolist() == [0, 10, 14, 20]
    real = [10 + 4 + 6, 4 + 7 + 3, 14 + 2 + 5]
    pads = [pack.padded_length(n, div) for n in real]
    assert shr.cu_seqlens.tolist() == [0, 20, 34, 55]
    assert shr.cu_seqlens_padded.tolist() == [0, pads[0], pads[0] + pads[1], sum(pads)]
    assert shr.span_cu_seqlens_padded[3::3].tolist() == shr.cu_seqlens_padded[1:].tolist()
    assert shr.input_ids.shape[1] == sum(pads) and shr.max_seqlen == max(pads)
    # positions: both responses continue from the prompt's end
    assert shr.position_ids[0, 10:20].tolist() == [10, 11, 12, 13, 10, 11, 12, 13, 14, 15]
    # routing padding of the new format: the span padding only
    pad = pack.routing_padding_mask(shr.cu_seqlens, shr.cu_seqlens_padded, shr.input_ids.shape[1])
    assert int(pad.sum()) == sum(pads) - sum(real)


def test_pack_shared_errors_and_dummy():
    p = make_pair(3, 4, 2, 2)
    bad = pack.PreferencePair(**{**p.__dict__, "rejected_ids": p.rejected_ids.clone()})
    bad.rejected_ids[0] = 7
    with raises_naming(ValueError, "pair 3: ", "pack.prefix_length 0"):
        pack.pack_shared_prompt([bad], 1, IMG)
    with pytest.raises(AssertionError):
        pack.pack_shared_prompt([], 1, IMG)
    d = pack.pack_shared_prompt([p], 4, IMG, dummy=True)
    assert d.pair_index.tolist() == [-1, -1] and d.sample_mask.tolist() == [0.0, 0.0]


def test_response_sequence_ids():
    seg = torch.tensor([0, 3, 5, 8, 10, 11, 13], dtype=torch.int32)
    ids = pack.response_sequence_ids(seg, 15)
    assert ids.tolist() == [4, 4, 4, 0, 0, 1, 1, 1, 4, 4, 2, 3, 3, 4, 4]


def test_planner_sizes_match_packed_rows():
    pairs = make_pairs()
    lengths = {p.pair_id: (p.chosen_ids.numel(), p.rejected_ids.numel()) for p in pairs}
    shared = {p.pair_id: pack.prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask,
                                                      p.rejected_loss_mask) for p in pairs}
    plan = pack.plan_bins(lengths, 64, 3, 1, divisible_by=8, shared_lengths=shared)
    (b,) = plan.ranks[0]
    packed = pack.pack_shared_prompt([pairs[i] for i in b.pair_ids], 8, IMG)
    assert b.tokens == packed.input_ids.shape[1] == 24 + 16 + 24
    assert b.useful == int(packed.cu_seqlens[-1]) == 55
    # cost: chosen sequence Lc, rejected sequence Lr + padding, prompt once
    pads = (4, 2, 3)
    assert b.cost == pytest.approx(sum(pack.sequence_cost(c) + pack.sequence_cost(r + pad) - pack.sequence_cost(k)
                                       for (c, r), k, pad in zip(lengths.values(), shared.values(), pads, strict=True)))
    with raises_naming(ValueError, "pair 0 needs 24 tokens (22 real", "packing.max_tokens_per_bin = 20"):
        pack.plan_bins({0: (15, 17)}, 20, 1, 1, divisible_by=8, shared_lengths={0: 10})
    with pytest.raises(AssertionError):
        pack.plan_bins({0: (15, 17)}, 100, 1, 1, shared_lengths={0: 15})


def test_synthetic_mmpr_token_ratio():
    """The issue's measure: on 10,000 MMPR-like pairs separate sequences hold 1.62x the tokens of the shared format."""
    parts = workload.synthetic_mmpr_parts(10_000, seed=0)
    assert workload.synthetic_mmpr_lengths(10_000, seed=0) == {i: (p + c, p + r) for i, (p, c, r) in parts.items()}
    separate = sum(2 * p + c + r for p, c, r in parts.values())
    shared = sum(p + 1 + c + r for p, c, r in parts.values())  # k = p - 1 tokens once, the last one twice
    assert separate / shared == pytest.approx(1.6214, abs=1e-4)
    counts = packing.shared_prompt_token_counts(parts, 10**6, 1, 1)
    assert (counts["tokens_separate"], counts["tokens_shared"]) == (separate, shared)
    assert counts["token_ratio"] == pytest.approx(separate / shared)


# ----------------------------------------------------------------------------------------------------------------------
# A toy causal model through the MPO loss: both formats give the same log-prob sums, loss and gradients


def toy_params(V=1000, H=12, heads=4, groups=2, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mix, kw = mixer_tensors(1, h=4, p=2, g=2, n=3, seed=seed + 1)
    mix.pop("zxbcdt")
    mix["outproj_weight"] = torch.randn(H, 8, generator=gen, dtype=F64) * 0.3
    zdim = 2 * 8 + 2 * 2 * 3 + 4
    params = dict(emb=torch.randn(V, H, generator=gen, dtype=F64) * 0.5,
                  in_proj=torch.randn(zdim, H, generator=gen, dtype=F64) * 0.3,
                  wq=torch.randn(heads * d, H, generator=gen, dtype=F64) * 0.3,
                  wk=torch.randn(groups * d, H, generator=gen, dtype=F64) * 0.3,
                  wv=torch.randn(groups * d, H, generator=gen, dtype=F64) * 0.3,
                  wo=torch.randn(H, heads * d, generator=gen, dtype=F64) * 0.3,
                  head=torch.randn(V, H, generator=gen, dtype=F64) * 0.3, **mix)
    return {k: v.requires_grad_(True) for k, v in params.items()}, kw, (heads, groups, d)


def toy_logits(params, kw, dims, batch):
    heads, groups, d = dims
    T = batch.input_ids.shape[1]
    h = params["emb"][batch.input_ids[0]]
    mix = {k: params[k] for k in ("conv1d_weight", "conv1d_bias", "dt_bias", "A", "D", "rmsnorm_weight",
                                  "outproj_weight")}
    zx = (h @ params["in_proj"].T)[None]
    if batch.shared_prompt:
        h = h + shared_prompt.mamba_split_conv1d_scan(zx, **mix, chunk_size=4,
                                                         row_spans=batch.span_cu_seqlens_padded,
                                                         **kw)[0]
    else:
        seq_idx = mt.seq_idx_from_cu_seqlens(batch.cu_seqlens_padded, T)
        h = h + mt.mamba_split_conv1d_scan_combined(zx, **mix, chunk_size=4, seq_idx=seq_idx, **kw)[0]
    q = (h @ params["wq"].T).view(T, heads, d)
    k = (h @ params["wk"].T).view(T, groups, d)
    v = (h @ params["wv"].T).view(T, groups, d)
    if batch.shared_prompt:
        o = shared_prompt.attention(q, k, v, batch.span_cu_seqlens_padded, scale=0.5)
    else:
        cu = batch.cu_seqlens_padded.tolist()
        o = torch.cat([explicit_attention(q[a:b], k[a:b], v[a:b], 0.5) for a, b in zip(cu[:-1], cu[1:], strict=True)])
    h = h + o @ params["wo"].T
    return h @ params["head"].T


def test_toy_model_mpo_loss_and_gradients_equal_separate_sequences():
    pairs = make_pairs()
    cfg = SimpleNamespace(reference_policy_kl_penalty=0.1, preference_loss_weight=0.8, bco_loss_weight=0.2,
                          sft_loss_weight=0.5, preference_average_log_probs=False, quality_average_log_probs=True,
                          sft_average_log_probs=True)
    results = []
    for pair_format in ("separate", "shared"):
        batch = pack.pack_shared_prompt(pairs, 8, IMG) if pair_format == "shared" else pack.pack(pairs, 8, IMG)
        params, kw, dims = toy_params()
        ref_params, _, _ = toy_params(seed=5)
        T = batch.input_ids.shape[1]
        if batch.shared_prompt:
            seq_ids, S = pack.response_sequence_ids(batch.span_cu_seqlens_padded, T), batch.num_responses
        else:
            seq_ids, S = pack.token_sequence_ids(batch.cu_seqlens_padded, T), batch.num_sequences
        labels, mask = batch.labels[0], batch.loss_mask[0]
        logprobs, n = mpo_loss.packed_sequence_logprobs(toy_logits(params, kw, dims, batch), labels, mask, seq_ids, S)
        with torch.no_grad():
            ref_logits = toy_logits(ref_params, kw, dims, batch)
            ref, _ = mpo_loss.packed_sequence_logprobs(ref_logits, labels, mask, seq_ids, S)
        loss, metrics, stats = mpo_loss.mpo_loss(logprobs, ref, n, batch.pair_index, batch.is_chosen, batch.sample_mask,
                                                 cfg, reward_shift=0.05, num_global_pairs=3)
        loss.backward()
        results.append((logprobs.detach(), ref, n, loss.detach(), {k: v.grad for k, v in params.items()}, T))
    (lp_a, ref_a, n_a, loss_a, g_a, T_a), (lp_b, ref_b, n_b, loss_b, g_b, T_b) = results
    assert T_b < T_a  # the prompts are stored once
    assert torch.equal(n_a, n_b) and n_a.tolist() == [3, 5, 6, 2, 1, 4]
    assert (lp_a - lp_b).abs().max() < 1e-10 and (ref_a - ref_b).abs().max() < 1e-10
    assert abs(float(loss_a - loss_b)) < 1e-12
    for k in g_a:
        assert (g_a[k] - g_b[k]).abs().max() < 1e-10, k


def test_shared_prompt_with_context_parallelism_is_a_config_error():
    def cfg(shared, cp):
        return SimpleNamespace(
            packing=SimpleNamespace(pair_grouping_key="pair_index", make_sequence_length_divisible_by=8,
                                    shared_prompt=shared),
            parallel=SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=cp, sequence_parallel=False))

    preflight.check_packing(cfg(True, 1))
    preflight.check_packing(cfg(False, 2))
    with raises_naming(ConfigError, "packing.shared_prompt = true", "parallel.context_parallel_size = 2"):
        preflight.check_packing(cfg(True, 2))


def test_head_shards_compute_their_heads_alone():
    """Tensor parallelism splits heads (and their B/C groups, K/V groups): the shared-prompt scan and attention are
    head-local, so a shard of heads gives exactly the full computation's heads (TP = 2 layout)."""
    seg, T = row_offsets(SPANS)
    h, p, g, n = 4, 2, 2, 3
    gen = torch.Generator().manual_seed(9)
    x, z = torch.randn(1, T, h, p, generator=gen, dtype=F64), torch.randn(1, T, h, p, generator=gen, dtype=F64)
    dt = torch.randn(1, T, h, generator=gen, dtype=F64)
    A, D = -torch.rand(h, generator=gen, dtype=F64) - 0.2, torch.randn(h, generator=gen, dtype=F64)
    B, C = torch.randn(1, T, g, n, generator=gen, dtype=F64), torch.randn(1, T, g, n, generator=gen, dtype=F64)
    full = shared_prompt.mamba_chunk_scan(x, dt, A, B, C, 4, seg, D=D, z=z, dt_softplus=True)
    for r in range(2):
        hs, gs = slice(2 * r, 2 * r + 2), slice(r, r + 1)
        part = shared_prompt.mamba_chunk_scan(x[:, :, hs], dt[:, :, hs], A[hs], B[:, :, gs], C[:, :, gs], 4, seg,
                                                 D=D[hs], z=z[:, :, hs], dt_softplus=True)
        assert (part - full[:, :, hs]).abs().max() < 1e-13
    q, k, v = (torch.randn(T, m, 5, generator=gen, dtype=F64) for m in (8, 2, 2))
    full = shared_prompt.attention(q, k, v, seg).view(T, 8, 5)
    for r in range(2):
        part = shared_prompt.attention(q[:, 4 * r:4 * r + 4], k[:, r:r + 1], v[:, r:r + 1], seg)
        assert (part.view(T, 4, 5) - full[:, 4 * r:4 * r + 4]).abs().max() < 1e-13
