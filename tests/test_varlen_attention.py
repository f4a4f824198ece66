"""local_spec's varlen attention backend (torch.nn.attention.varlen.varlen_attn, one call per THD row) on the CPU.

varlen_attn runs on CUDA only, so these tests replace it with a stand-in of each signature torch has had (2.10's
`is_causal`, 2.11's `window_size`, 2.12's `enable_gqa`) that checks the call's contract - int32 offsets covering the
tensors, the longest lengths, the causal window, K/V heads - and computes each sequence with torch's SDPA and
FlashAttention's bottom-right causal mask. ThdDotProductAttention(attention="varlen") through the stand-in then equals
the per-sequence SDPA path (the reference) exactly, outputs and q/k/v gradients, on a packed row (an empty sequence,
trailing padding), causal and not, GQA, and on the shared-prompt format. tests/test_gpu.py compares the real call.

Run: `pytest tests/test_varlen_attention.py` (CPU, seconds).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.attention.varlen as torch_varlen
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from backend import local_spec, shared_prompt


def _stand_in(signature: str, calls: list):
    """A varlen_attn of torch `signature` ("2.10", "2.11", "2.12") that records its calls and computes them per
    sequence with SDPA (causal aligned bottom-right)."""

    def compute(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, gqa):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == q.device and len(cu_q) == len(cu_k)
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        assert cu_q[0] == cu_k[0] == 0 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
        assert max_q == max(lq) and max_k == max(lk) and min(lq) > 0
        assert k.shape[1] == q.shape[1] or (gqa and q.shape[1] % k.shape[1] == 0), (q.shape, k.shape, gqa)
        rep = q.shape[1] // k.shape[1]
        calls.append(dict(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, scale=scale,
                          causal=causal, kv_heads=k.shape[1]))
        outs = []
        for qs, ks, vs in zip(q.split(lq), k.split(lk), v.split(lk), strict=True):
            qs, ks, vs = qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            mask = None
            if causal and qs.shape[2] != ks.shape[2]:
                mask = shared_prompt.bottom_right_causal_mask(qs.shape[2], ks.shape[2], q.device)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                       is_causal=causal and mask is None)[0].transpose(0, 1))
        return torch.cat(outs)

    def window(window_size):
        assert tuple(window_size) in ((-1, -1), (-1, 0)), window_size
        return tuple(window_size) == (-1, 0)

    if signature == "2.10":  # is_causal; 2.10 itself had no scale (kernel_selection.have_varlen_attn refuses it)
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None,
                        scale=None):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, is_causal, False)
    elif signature == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window(window_size), False)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window(window_size),
                           enable_gqa)
    return varlen_attn


def _attention(kind: str, causal: bool, groups: int = 2, dropout: float = 0.0, cp: int = 1):
    cfg = SimpleNamespace(num_attention_heads=4, num_query_groups=groups, kv_channels=8, attention_dropout=dropout,
                          context_parallel_size=cp)
    pgs = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=SimpleNamespace(size=lambda: cp, rank=lambda: 0))
    mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return local_spec.ThdDotProductAttention(cfg, 1, mask_type, pg_collection=pgs, attention=kind)


def _run(module, leaves, psp, weight, row_spans=None):
    q, k, v = (t.clone().requires_grad_(True) for t in leaves)
    token = shared_prompt.ROW_SPANS.set(row_spans)
    try:
        out = module(q, k, v, packed_seq_params=psp)
    finally:
        shared_prompt.ROW_SPANS.reset(token)
    (out.float() * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("signature", ["2.10", "2.11", "2.12"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [2, 4])
def test_varlen_backend_equals_per_sequence_sdpa(signature, causal, groups, monkeypatch):
    """A packed row of sequences 5, 0, 9, 2 plus 3 trailing padding tokens, bf16: ONE varlen call (offsets
    [0, 5, 14, 16, 19] int32 - the empty sequence left out, the padding its own sequence -, longest 9, window (-1, 0)
    or is_causal when causal, K/V heads repeated unless the signature has enable_gqa) equals the SDPA path exactly."""
    calls = []
    monkeypatch.setattr(torch_varlen, "varlen_attn", _stand_in(signature, calls))
    monkeypatch.setattr(local_spec, "VARLEN_DEVICE_TYPES", frozenset({"cpu"}))
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 14, 16], dtype=torch.int32)
    T = 19
    leaves = [torch.randn(T, h, 8, generator=gen).to(torch.bfloat16) for h in (4, groups, groups)]
    weight = torch.randn(T, 32, generator=gen)
    psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=cu, cu_seqlens_q=cu)
    want = _run(_attention("sdpa", causal, groups), leaves, psp, weight)
    assert not calls
    got = _run(_attention("varlen", causal, groups), leaves, psp, weight)
    assert calls == [dict(cu_q=[0, 5, 14, 16, 19], cu_k=[0, 5, 14, 16, 19], max_q=9, max_k=9, scale=1 / math.sqrt(8),
                          causal=causal, kv_heads=groups if signature == "2.12" else 4)]
    assert got[0].shape == (T, 32) and got[0].dtype == torch.bfloat16
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_varlen_backend_takes_the_host_offsets_of_the_packed_seq_params(monkeypatch):
    """PackedSeqParams from pack.thd_packed_seq_params carry the padded offsets on the host
    (`cu_seqlens_padded_host`): where they tile the row without an empty sequence, the varlen call takes them and the
    device offsets as they are (nothing is read back from the device: the path through _query_runs, which reads them,
    is not taken), with the same result as the SDPA path."""
    import pack

    calls = []
    monkeypatch.setattr(torch_varlen, "varlen_attn", _stand_in("2.12", calls))
    monkeypatch.setattr(local_spec, "VARLEN_DEVICE_TYPES", frozenset({"cpu"}))
    gen = torch.Generator().manual_seed(0)
    cu_h, T = [0, 5, 14, 16, 19], 19
    leaves = [torch.randn(T, h, 8, generator=gen).to(torch.bfloat16) for h in (4, 2, 2)]
    weight = torch.randn(T, 32, generator=gen)
    cu = torch.tensor(cu_h, dtype=torch.int32)
    psp = pack.thd_packed_seq_params(cu, cu, max_seqlen=9, host=(cu_h, cu_h))
    assert psp.cu_seqlens_padded_host == tuple(cu_h) and psp.total_tokens == T
    from megatron.core.packed_seq_params import PackedSeqParams  # its own seq_idx, sized from the data

    assert torch.equal(psp.seq_idx, PackedSeqParams(cu_seqlens_q_padded=cu, total_tokens=T).seq_idx)
    want = _run(_attention("sdpa", True, 2), leaves, psp, weight)
    monkeypatch.setattr(local_spec, "_query_runs", lambda *a: pytest.fail("the device offsets were read"))
    got = _run(_attention("varlen", True, 2), leaves, psp, weight)
    assert [c["cu_q"] for c in calls] == [cu_h] and calls[0]["max_q"] == 9
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("signature", ["2.11", "2.12"])
def test_varlen_backend_runs_the_shared_prompt_format(signature, monkeypatch):
    """The shared-prompt row (tests/test_shared_prompt_te.SPANS: empty responses, padding, a bin tail) through ONE
    varlen call of gathered keys ([prompt | chosen], [prompt | rejected] per pair, bottom-right causal) equals
    shared_prompt.attention (the SDPA path), fp32 rounding apart, outputs and q/k/v gradients."""
    from test_shared_prompt_te import SPANS, row_offsets

    calls = []
    monkeypatch.setattr(torch_varlen, "varlen_attn", _stand_in(signature, calls))
    monkeypatch.setattr(local_spec, "VARLEN_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(local_spec.ThdDotProductAttention, "_varlen",
                        lambda self, q, thd: self.attention == "varlen" and thd)  # fp32 here: rounding-level check
    seg, T = row_offsets(SPANS, tail=3)
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(T, h, 8, generator=gen) for h in (4, 2, 2)]
    weight = torch.randn(T, 32, generator=gen)
    psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, T], dtype=torch.int32),
                          cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32))
    want = _run(_attention("sdpa", True), leaves, psp, weight, row_spans=seg)
    got = _run(_attention("varlen", True), leaves, psp, weight, row_spans=seg)
    lay = shared_prompt.RowSpans(seg, T, seg.device).varlen_args()
    assert len(calls) == 1 and calls[0]["causal"] and calls[0]["cu_q"] == lay["cu_seqlens_q"].tolist()
    assert calls[0]["cu_k"] == lay["cu_seqlens_kv"].tolist() and calls[0]["max_k"] == lay["max_seqlen_kv"]
    for a, b in zip(got, want, strict=True):  # fp32: the softmax sums in another order (bound: ~10 ulp of 1)
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_varlen_backend_only_where_flash_attention_applies(monkeypatch):
    """The varlen backend takes THD calls in bf16/fp16 on its devices without CP or training dropout; everything
    else stays on SDPA (the reference). The default backend never calls varlen."""
    q16, q32 = torch.zeros(4, 4, 8, dtype=torch.bfloat16), torch.zeros(4, 4, 8)
    assert not _attention("varlen", True)._varlen(q16, True)  # the CPU is not a varlen device
    monkeypatch.setattr(local_spec, "VARLEN_DEVICE_TYPES", frozenset({"cpu"}))
    assert _attention("varlen", True)._varlen(q16, True)
    assert _attention("varlen", True)._varlen(q16.half(), True)
    assert not _attention("varlen", True)._varlen(q32, True)
    assert not _attention("varlen", True)._varlen(q16, False)  # BSHD
    assert not _attention("varlen", True)._varlen(q16[:0], True)
    assert not _attention("varlen", True, cp=2)._varlen(q16, True)
    assert _attention("varlen", True, dropout=0.1).eval()._varlen(q16, True)
    assert not _attention("varlen", True, dropout=0.1).train()._varlen(q16, True)
    assert not _attention("sdpa", True)._varlen(q16, True)
