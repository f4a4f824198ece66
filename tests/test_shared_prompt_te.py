"""The shared-prompt attention as one variable-length call (the Transformer Engine path) on CPU.

shared_prompt.RowSpans.varlen_args turns a shared-prompt THD row into query / key-value sequences with
bottom-right causal masks; shared_prompt.varlen_attention runs them through a backend callable;
shared_prompt.te_attention calls Transformer Engine's DotProductAttention.forward with that argument set.
TE does not import here (no CUDA), so the module is checked against a stand-in base class that records the call and
computes it with the reference backend (`varlen_sdpa`, here); tests/test_gpu.py compares the real TE call with the
local attention on a GPU.

Run: `pytest tests/test_shared_prompt_te.py` (CPU, seconds).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import raises_naming
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from backend import shared_prompt

F64 = torch.float64

def varlen_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int, scale: float | None = None,
                dropout_p: float = 0.0) -> torch.Tensor:
    """Reference varlen attention, SDPA per sequence, causal bottom-right. query [T_q, heads, d],
    key/value [T_kv, groups, d], cu_seqlens_* int [S+1] -> [T_q, heads * d]; max_seqlen_* unused (TE's signature)."""
    cq, ckv = [int(v) for v in cu_seqlens_q.tolist()], [int(v) for v in cu_seqlens_kv.tolist()]
    lq = [b - a for a, b in zip(cq[:-1], cq[1:], strict=True)]
    lkv = [b - a for a, b in zip(ckv[:-1], ckv[1:], strict=True)]
    if len(lq) != len(lkv) or cq[-1] != query.shape[0] or ckv[-1] != key.shape[0] or \
            any(n < m for m, n in zip(lq, lkv, strict=True)):
        raise ValueError(f"cu_seqlens_q {cq} / cu_seqlens_kv {ckv} do not describe query [{query.shape[0]}] and "
                         f"key [{key.shape[0]}] sequences with n_q <= n_kv")
    h, d = query.shape[1], query.shape[2]
    rep = h // key.shape[1]
    q = query.permute(1, 0, 2)
    k = key.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    v = value.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    outs = []
    for qs, ks, vs in zip(q.split(lq, dim=1), k.split(lkv, dim=1), v.split(lkv, dim=1), strict=True):
        n_q, n_kv = qs.shape[1], ks.shape[1]
        if n_q == 0:
            continue
        mask = None
        if n_kv != n_q:
            mask = shared_prompt.bottom_right_causal_mask(n_q, n_kv, q.device)
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, dropout_p=dropout_p,
                                                   is_causal=mask is None, scale=scale)[0])  # 4-D: fused kernels
    out = torch.cat(outs, dim=1) if outs else q.new_zeros(h, 0, d)
    return out.permute(1, 0, 2).reshape(query.shape[0], h * d)


# (prompt, chosen, rejected, padding) per pair: an empty chosen response, an empty rejected response, a one-token
# prompt, padding after the rejected span; plus trailing bin padding (the row's tail) in the tests.
SPANS = [(5, 3, 7, 1), (4, 0, 3, 0), (6, 2, 0, 2), (1, 4, 4, 2), (9, 1, 2, 0)]


def row_offsets(spans, tail=0):
    """span_cu_seqlens_padded [3P+1] (int32) and the row length for (prompt, chosen, rejected, pad) + tail."""
    seg = [0]
    for p, c, r, pad in spans:
        seg += [seg[-1] + p, seg[-1] + p + c, seg[-1] + p + c + r + pad]
    return torch.tensor(seg, dtype=torch.int32), seg[-1] + tail


def test_varlen_args_closed_form():
    # pair 0: prompt 0..1, chosen 2, rejected 3..5; pair 1: prompt 6..8, no chosen, rejected 9; tail 10..11
    seg = torch.tensor([0, 2, 3, 6, 9, 9, 10], dtype=torch.int32)
    lay = shared_prompt.RowSpans(seg, 12, "cpu").varlen_args()
    assert lay["kv_index"].tolist() == [0, 1, 2, 0, 1, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 11]
    assert lay["cu_seqlens_q"].tolist() == [0, 3, 6, 9, 10, 12]  # the row in order: no scatter back
    assert lay["cu_seqlens_kv"].tolist() == [0, 3, 8, 11, 15, 17]
    assert (lay["max_seqlen_q"], lay["max_seqlen_kv"]) == (3, 5)
    assert lay["cu_seqlens_q"].dtype == lay["cu_seqlens_kv"].dtype == torch.int32
    # an empty rejected response is no sequence at all; no tail when the pairs fill the row
    lay = shared_prompt.RowSpans(torch.tensor([0, 2, 4, 4]), 4, "cpu").varlen_args()
    assert lay["cu_seqlens_q"].tolist() == [0, 4] and lay["cu_seqlens_kv"].tolist() == [0, 4]
    with raises_naming(ValueError, "span_cu_seqlens_padded", "3P+1 offsets", "T = 4", "[0, 2, 4]"):
        shared_prompt.RowSpans(torch.tensor([0, 2, 4]), 4, "cpu")


def test_reference_backend_masks_bottom_right():
    # one sequence of 2 queries over 3 keys: query 0 sees keys 0..1, query 1 sees 0..2 (explicit softmax)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 1, 4, generator=g, dtype=F64), torch.randn(3, 1, 4, generator=g, dtype=F64), \
        torch.randn(3, 1, 4, generator=g, dtype=F64)
    out = varlen_sdpa(q, k, v, torch.tensor([0, 2]), torch.tensor([0, 3]), 2, 3, scale=0.5)
    s = (q[:, 0] @ k[:, 0].T) * 0.5
    s[0, 2] = float("-inf")
    want = torch.softmax(s, dim=-1) @ v[:, 0]
    assert (out - want).abs().max() < 1e-12
    with raises_naming(ValueError, "cu_seqlens_q [0, 2]", "cu_seqlens_kv [0, 1, 3]"):
        varlen_sdpa(q, k, v, torch.tensor([0, 2]), torch.tensor([0, 1, 3]), 2, 3)
    with raises_naming(ValueError, "cu_seqlens_q [0, 3]", "cu_seqlens_kv [0, 2]", "n_q <= n_kv"):  # more queries
        varlen_sdpa(k, q, q, torch.tensor([0, 3]), torch.tensor([0, 2]), 3, 2)


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2)])
def test_varlen_call_equals_local_shared_prompt_attention(dtype, tol, heads, groups):
    seg, T = row_offsets(SPANS, tail=3)
    d = 8
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(T, n, d, generator=gen, dtype=dtype) for n in (heads, groups, groups)]
    weight = torch.randn(T, heads * d, generator=gen, dtype=dtype)
    q, k, v = (t.clone().requires_grad_(True) for t in leaves)
    want = shared_prompt.attention(q, k, v, seg, scale=0.3)
    (want * weight).sum().backward()
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in leaves)
    got = shared_prompt.varlen_attention(q2, k2, v2, seg, partial(varlen_sdpa, scale=0.3))
    (got * weight).sum().backward()
    assert got.shape == (T, heads * d) and got.dtype == dtype
    assert (got - want).abs().max() < tol
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert (a.grad - b.grad).abs().max() < tol
    # the prompt's keys get gradient from both of their sequences, the chosen keys only from [prompt | chosen]
    a0, c0, r0 = 0, 5, 8
    assert k2.grad[a0:c0].abs().sum() > 0 and k2.grad[c0:r0].abs().sum() > 0


class FakeTEDotProductAttention(torch.nn.Module):
    """Stands in for transformer_engine.pytorch.DotProductAttention: forward records its arguments and computes the
    bottom-right-masked THD attention with the reference backend (checking TE's contract on the way)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.te_calls = []
        self.attention_type = "self"  # TE's attribute, and its three backends' (megatron builds self-attention)
        self.flash_attention, self.fused_attention, self.unfused_attention = (
            SimpleNamespace(attention_type="self") for _ in range(3))

    def attention_types(self) -> list[str]:
        return [m.attention_type for m in (self, self.flash_attention, self.fused_attention, self.unfused_attention)]

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, **kwargs):
        self.te_calls.append(dict(kwargs, attention_mask=attention_mask, q_tokens=query_layer.shape[0],
                                  kv_tokens=key_layer.shape[0], attention_types=self.attention_types()))
        assert kwargs["qkv_format"] == "thd" and kwargs["attn_mask_type"] == "padding_causal_bottom_right"
        return varlen_sdpa(query_layer, key_layer, value_layer, kwargs["cu_seqlens_q"],
                                      kwargs["cu_seqlens_kv"], kwargs["max_seqlen_q"], kwargs["max_seqlen_kv"])


class FakeMegatronTEDotProductAttention(FakeTEDotProductAttention):
    """Stands in for megatron-core's TEDotProductAttention (its forward signature; records that it ran)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None, packed_seq_params=None):
        self.megatron_calls = getattr(self, "megatron_calls", 0) + 1
        return torch.zeros(query.shape[0], query.shape[1] * query.shape[2], dtype=query.dtype)


def test_te_module_calls_te_forward_with_the_varlen_arguments():
    cls = shared_prompt.te_attention(FakeMegatronTEDotProductAttention)
    assert issubclass(cls, FakeMegatronTEDotProductAttention)
    module = cls(SimpleNamespace(context_parallel_size=1))
    seg, T = row_offsets(SPANS, tail=3)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(T, n, 8, generator=gen) for n in (8, 2, 2))
    cu = torch.tensor([0, int(seg[-1]), T], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=T, max_seqlen_kv=T)
    # without the shared-prompt format: megatron's forward, TE not called directly
    out = module(q, k, v, None, AttnMaskType.causal, packed_seq_params=psp)
    assert module.megatron_calls == 1 and module.te_calls == [] and torch.equal(out, torch.zeros(T, 64))
    token = shared_prompt.ROW_SPANS.set(seg)
    try:
        out = module(q, k, v, None, AttnMaskType.causal, packed_seq_params=psp)
        with pytest.raises(AssertionError):
            module(q, k, v, None, AttnMaskType.causal, attention_bias=torch.zeros(1), packed_seq_params=psp)
        with pytest.raises(AssertionError):
            module(q, k, v, None, AttnMaskType.no_mask, packed_seq_params=psp)
        module.config.context_parallel_size = 2
        with pytest.raises(AssertionError):
            module(q, k, v, None, AttnMaskType.causal, packed_seq_params=psp)
    finally:
        shared_prompt.ROW_SPANS.reset(token)
    assert module.megatron_calls == 1 and len(module.te_calls) == 1
    call = module.te_calls[0]
    lay = shared_prompt.RowSpans(seg, T, seg.device).varlen_args()
    assert set(call) == {"qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                         "max_seqlen_q", "max_seqlen_kv", "attn_mask_type", "attention_mask", "q_tokens", "kv_tokens",
                         "attention_types"}
    # TE's cross-attention masks during the call (keys outnumber queries), its self-attention again afterwards, also
    # after the calls that raised
    assert call["attention_types"] == ["cross"] * 4 and module.attention_types() == ["self"] * 4
    assert call["attention_mask"] is None and call["attn_mask_type"] == "padding_causal_bottom_right"
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert torch.equal(call[name], lay[name]) and torch.equal(call[f"{name}_padded"], lay[name])
    assert (call["max_seqlen_q"], call["max_seqlen_kv"]) == (lay["max_seqlen_q"], lay["max_seqlen_kv"])
    assert (call["q_tokens"], call["kv_tokens"]) == (T, lay["kv_index"].numel())
    want = shared_prompt.attention(q, k, v, seg)
    assert (out - want).abs().max() < 1e-5
