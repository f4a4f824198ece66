"""Tests of the pure-torch Mamba-2 path (mamba_torch.py) against a float64 token-by-token recurrence, against itself
on packed vs separate sequences, with gradcheck, and against transformers' own torch Mamba-2 functions.

Run: `pytest tests/test_mamba_torch.py` (a few seconds, CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import raises_naming

from backend import mamba_torch as mt

F64 = torch.float64


def recurrence(x, dt, A, B, C, D, seq_idx=None, initial_states=None):
    """Token-by-token Mamba-2 SSM in the dtype of x: h_t = exp(dt_t·A)·h_{t−1} + dt_t·x_t⊗B_t, y_t = h_t·C_t + D·x_t.

    dt is already processed (softplus/clamp). The state is zeroed where seq_idx changes. Returns y, final states.
    """
    b, seqlen, h, p = x.shape
    r = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(r, 2), C.repeat_interleave(r, 2)
    y = torch.zeros_like(x)
    finals = []
    for bi in range(b):
        st = initial_states[bi].clone() if initial_states is not None else x.new_zeros(h, p, B.shape[3])
        for t in range(seqlen):
            if t > 0 and seq_idx is not None and seq_idx[bi, t] != seq_idx[bi, t - 1]:
                st = torch.zeros_like(st)
            st = torch.exp(dt[bi, t] * A)[:, None, None] * st + dt[bi, t][:, None, None] * (
                x[bi, t][:, :, None] * Bh[bi, t][:, None, :]
            )
            y[bi, t] = (st * Ch[bi, t][:, None, :]).sum(-1) + D[:, None] * x[bi, t]
        finals.append(st)
    return y, torch.stack(finals)


def packed_seq_idx(lengths_per_row):
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(L)), torch.tensor(L)) for L in lengths_per_row]
    ).to(torch.int32)


def scan_inputs(b=2, seqlen=37, h=4, p=3, g=2, n=5, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, seqlen, h, p, generator=gen, dtype=dtype)
    dt = torch.rand(b, seqlen, h, generator=gen, dtype=dtype) * 0.5
    A = -(torch.rand(h, generator=gen, dtype=dtype) * 2 + 0.1)
    B = torch.randn(b, seqlen, g, n, generator=gen, dtype=dtype)
    C = torch.randn(b, seqlen, g, n, generator=gen, dtype=dtype)
    D = torch.randn(h, generator=gen, dtype=dtype)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_scan_matches_recurrence_with_seq_idx(chunk_size):
    x, dt, A, B, C, D = scan_inputs()
    # Unequal lengths, none a multiple of the chunk size; row 2 is a single sequence.
    seq_idx = packed_seq_idx([[5, 13, 19], [37]])
    init = torch.randn(2, 4, 3, 5, dtype=F64, generator=torch.Generator().manual_seed(1))
    y, final = mt.mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, seq_idx=seq_idx, initial_states=init, return_final_states=True
    )
    y_ref, final_ref = recurrence(x, dt, A, B, C, D, seq_idx, init)
    assert (y - y_ref).abs().max() < 1e-10
    assert (final - final_ref).abs().max() < 1e-10
    assert y.dtype == F64 and final.shape == (2, 4, 3, 5)


def test_scan_dt_processing_and_gate():
    """dt_bias + softplus + dt_limit clamp, D per channel [h, p], and the silu(z) gate, against the recurrence."""
    x, dt_raw, A, B, C, _ = scan_inputs(seqlen=20)
    gen = torch.Generator().manual_seed(2)
    dt_raw = torch.randn(2, 20, 4, generator=gen, dtype=F64) * 3
    dt_bias = torch.randn(4, generator=gen, dtype=F64)
    D2 = torch.randn(4, 3, generator=gen, dtype=F64)
    z = torch.randn_like(x)
    limit = (0.3, 2.0)
    dt = F.softplus(dt_raw + dt_bias).clamp(*limit)
    assert (dt == limit[0]).any() and (dt == limit[1]).any()  # the clamp is exercised at both ends
    y_ref, _ = recurrence(x, dt, A, B, C, torch.zeros(4, dtype=F64))
    y_ref = (y_ref + D2 * x) * F.silu(z)
    y = mt.mamba_chunk_scan_combined(x, dt_raw, A, B, C, 8, D=D2, z=z, dt_bias=dt_bias, dt_softplus=True,
                                     dt_limit=limit)
    assert (y - y_ref).abs().max() < 1e-10


def test_cu_seqlens_equals_seq_idx_and_varlen_states():
    x, dt, A, B, C, D = scan_inputs(b=1)
    cu = torch.tensor([0, 5, 18, 37])
    y_cu, final, varlen = mt.mamba_chunk_scan_combined(
        x, dt, A, B, C, 8, D=D, cu_seqlens=cu, return_final_states=True, return_varlen_states=True
    )
    y_idx = mt.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D=D, seq_idx=packed_seq_idx([[5, 13, 19]]))
    assert torch.equal(y_cu, y_idx)
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        _, alone = recurrence(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D)
        assert (varlen[i] - alone[0]).abs().max() < 1e-12
    assert (varlen[-1] - final[0]).abs().max() < 1e-12
    # Padding after the last sequence becomes a sequence of its own.
    assert mt.seq_idx_from_cu_seqlens(torch.tensor([0, 2, 3]), 5).tolist() == [[0, 0, 1, 2, 2]]


def test_bad_packing_is_rejected():
    x, dt, A, B, C, D = scan_inputs(b=1, seqlen=6)
    with raises_naming(ValueError, "seq_idx", "row 0 falls from 1 to 0 at position 4"):
        mt.mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=torch.tensor([[0, 0, 1, 1, 0, 0]]))
    with raises_naming(ValueError, "cu_seqlens", "seqlen = 6", "[0, 4, 9]"):
        mt.mamba_chunk_scan_combined(x, dt, A, B, C, 4, cu_seqlens=torch.tensor([0, 4, 9]))
    with raises_naming(ValueError, "seq_idx", "(1, 6)", "got (1, 5)"):
        mt.mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=torch.zeros(1, 5, dtype=torch.int32))


def test_causal_conv1d_seq_idx_and_states():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 11, generator=gen, dtype=F64)
    w = torch.randn(6, 4, generator=gen, dtype=F64)
    bias = torch.randn(6, generator=gen, dtype=F64)
    lengths = [[2, 6, 3], [11]]
    out = mt.causal_conv1d_fn(x, w, bias, seq_idx=packed_seq_idx(lengths), activation="silu")
    for row, L in enumerate(lengths):
        start = 0
        for n in L:
            seg = x[row : row + 1, :, start : start + n]
            # Each sequence alone through torch's conv1d with left zero padding (its own causal start).
            ref = F.silu(F.conv1d(F.pad(seg, (3, 0)), w.unsqueeze(1), bias, groups=6))
            assert (out[row : row + 1, :, start : start + n] - ref).abs().max() < 1e-14
            start += n
    # initial_states continue a previous call: conv over [a, b] in two calls equals one call.
    full = mt.causal_conv1d_fn(x, w, bias)
    first, state = mt.causal_conv1d_fn(x[:, :, :7], w, bias, return_final_states=True)
    second = mt.causal_conv1d_fn(x[:, :, 7:], w, bias, initial_states=state)
    assert (torch.cat([first, second], -1) - full).abs().max() < 1e-14


def mixer_inputs(b=2, seqlen=23, h=4, p=2, g=2, n=3, width=4, dtype=F64, seed=4):
    gen = torch.Generator().manual_seed(seed)
    dim = h * p
    conv_dim = dim + 2 * g * n
    return dict(
        zxbcdt=torch.randn(b, seqlen, 2 * dim + 2 * g * n + h, generator=gen, dtype=dtype),
        conv1d_weight=torch.randn(conv_dim, width, generator=gen, dtype=dtype) * 0.5,
        conv1d_bias=torch.randn(conv_dim, generator=gen, dtype=dtype) * 0.1,
        dt_bias=torch.randn(h, generator=gen, dtype=dtype) * 0.5,
        A=-(torch.rand(h, generator=gen, dtype=dtype) + 0.5),
        D=torch.randn(h, generator=gen, dtype=dtype),
        rmsnorm_weight=torch.rand(dim, generator=gen, dtype=dtype) + 0.5,
    ), dict(headdim=p, ngroups=g, norm_before_gate=False, rmsnorm_eps=1e-5)


def test_packed_equals_each_sequence_alone():
    """The whole mixer body (conv, scan, gated norm) on a packed row equals each sequence run on its own."""
    tensors, kw = mixer_inputs(b=1, seqlen=23)
    lengths = [7, 1, 15]
    seq_idx = packed_seq_idx([lengths])
    packed = mt.mamba_split_conv1d_scan_combined(**tensors, chunk_size=4, seq_idx=seq_idx, **kw)
    start = 0
    for n in lengths:
        alone_t = dict(tensors, zxbcdt=tensors["zxbcdt"][:, start : start + n])
        alone = mt.mamba_split_conv1d_scan_combined(**alone_t, chunk_size=4, **kw)
        assert (packed[:, start : start + n] - alone).abs().max() < 1e-12
        start += n
    # Without seq_idx the sequences do interact (the test above can fail).
    unpacked = mt.mamba_split_conv1d_scan_combined(**tensors, chunk_size=4, **kw)
    assert (unpacked[:, 7:] - packed[:, 7:]).abs().max() > 1e-3


def test_gradcheck_split_conv1d_scan_with_seq_idx():
    tensors, kw = mixer_inputs(b=1, seqlen=9, h=2, p=2, g=1, n=2)
    seq_idx = packed_seq_idx([[4, 5]])
    names = list(tensors)
    inputs = tuple(tensors[k].clone().requires_grad_(True) for k in names)

    def f(*args):
        named = dict(zip(names, args, strict=True))
        return mt.mamba_split_conv1d_scan_combined(**named, chunk_size=3, seq_idx=seq_idx, **kw)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_against_transformers_torch_functions():
    """transformers' NemotronH pure-torch scan, conv and gated RMSNorm (no packing: they refuse seq_idx)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as tf

    x, dt_raw, A, B, C, D = scan_inputs(b=2, seqlen=45, dtype=torch.float32)
    dt_bias = torch.randn(4) * 0.5
    init = torch.randn(2, 4, 3, 5)
    limit = (0.05, float("inf"))
    ref, ref_final = tf.mamba2_chunk_scan(x, dt_raw, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias, dt_softplus=True,
                                          dt_limit=limit, initial_states=init, return_final_states=True)
    ours, final = mt.mamba_chunk_scan_combined(x, dt_raw, A, B, C, 16, D=D, dt_bias=dt_bias, dt_softplus=True,
                                               dt_limit=limit, initial_states=init, return_final_states=True)
    assert (ours - ref).abs().max() < 1e-4 and (final - ref_final).abs().max() < 1e-4

    gen = torch.Generator().manual_seed(5)
    xc, w, bias = torch.randn(2, 6, 10, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6)
    assert (mt.causal_conv1d_fn(xc, w, bias, activation="silu")
            - tf.causal_conv1d_fn(xc, w, bias, activation="silu")).abs().max() < 1e-5

    norm = tf.NemotronHRMSNormGated(12, group_size=4, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(12) + 0.5)
    y, z = torch.randn(3, 7, 12), torch.randn(3, 7, 12)
    ours = mt.RMSNormGated(12, eps=1e-5, group_size=4, norm_before_gate=False)
    ours.load_state_dict(norm.state_dict())
    assert (ours(y, z) - norm(y, z)).abs().max() < 1e-5
    assert ours.state_dict().keys() == {"weight"}


def test_norm_before_gate_and_swiglu_prefix():
    """The two gate orders of the gated norm, and the d_nonssm swiglu prefix of the fused function."""
    gen = torch.Generator().manual_seed(6)
    y, z, w = torch.randn(5, 8, generator=gen, dtype=F64), torch.randn(5, 8, generator=gen, dtype=F64), torch.rand(8)
    rms = lambda v: v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    after = mt.rmsnorm_fn(y, w, z=z, group_size=4, norm_before_gate=True)
    exp = (rms(y.view(5, 2, 4)).view(5, 8) * w * F.silu(z))
    assert (after - exp).abs().max() < 1e-12
    tensors, kw = mixer_inputs(b=1, seqlen=6)
    prefix = torch.randn(1, 6, 4, dtype=F64)
    base = mt.mamba_split_conv1d_scan_combined(**tensors, chunk_size=4, **kw)
    t2 = dict(tensors, zxbcdt=torch.cat([prefix, tensors["zxbcdt"]], -1))
    out = mt.mamba_split_conv1d_scan_combined(**t2, chunk_size=4, **kw)
    assert torch.equal(out[..., 2:], base)
    assert (out[..., :2] - F.silu(prefix[..., :2]) * prefix[..., 2:]).abs().max() < 1e-14


def simple_gla_recurrence(q, k, v, g, cu_seqlens):
    """The simple-GLA contract token by token (fla-core's chunk_simple_gla, scale 1): S_t = exp(g_t)·S_{t−1} +
    k_tᵀv_t, o_t = q_t·S_t, S = 0 at each cu_seqlens start. q, k [1,T,H,N], v [1,T,H,P], g [1,T,H]."""
    T, H, N, P = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    starts = set(cu_seqlens.tolist()) if cu_seqlens is not None else {0}
    o = torch.zeros(1, T, H, P, dtype=v.dtype)
    S = torch.zeros(H, N, P, dtype=v.dtype)
    for t in range(T):
        if t in starts:
            S = torch.zeros_like(S)
        S = torch.exp(g[0, t])[:, None, None] * S + k[0, t][:, :, None] * v[0, t][:, None, :]
        o[0, t] = (q[0, t][:, :, None] * S).sum(1)
    return o


def test_mamba_scan_as_simple_gla_matches_the_scan():
    """The mapping a portable simple-GLA kernel (fla-core) would be evaluated through: output and gradients equal
    mamba_chunk_scan_combined's on packed sequences with dt_bias, softplus, dt_limit, D and z."""
    from backend.mamba_triton import mamba_chunk_scan_via_simple_gla

    x, dt_raw, A, B, C, D = scan_inputs(b=1, seqlen=29)
    seq_idx = packed_seq_idx([[9, 13, 7]])
    gen = torch.Generator().manual_seed(5)
    dt_bias = torch.randn(4, generator=gen, dtype=F64)
    z = torch.randn_like(x)
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True, seq_idx=seq_idx, dt_limit=(0.3, float("inf")))
    outs = []
    for fn in (mt.mamba_chunk_scan_combined,
               lambda *a, **k: mamba_chunk_scan_via_simple_gla(*a, **k, gla=simple_gla_recurrence)):
        xx, dd = x.clone().requires_grad_(True), dt_raw.clone().requires_grad_(True)
        y = fn(xx, dd, A, B, C, 8, **kw)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), xx.grad, dd.grad))
    for a, b in zip(*outs, strict=True):
        assert (a - b).abs().max() < 1e-10
    with raises_naming(ValueError, "seq_idx", "batch 1, got 2"):
        mamba_chunk_scan_via_simple_gla(*scan_inputs()[:5], 8, seq_idx=packed_seq_idx([[37], [37]]),
                                        gla=simple_gla_recurrence)
