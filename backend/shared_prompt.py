"""The layers of a shared-prompt row (`packing.shared_prompt`; the format, one THD span [prompt | chosen | rejected] per
pair, is pack.py's `pack_shared_prompt`): each response token sees what it sees as a separate sequence.

- Switch: `resolve` ("auto" at start, by the kernels); at run time `ROW_SPANS`, set by OmniModel.forward around the
  language model; `RowSpans`, a row's offsets as the index tensors its layers need.
- Attention: `attention` / `varlen_attention` (local spec), `te_attention` (TE spec); `bottom_right_causal_mask`.
- Mamba-2: the conv and scan `causal_conv1d`, `mamba_chunk_scan`, `mamba_split_conv1d_scan` on the kernels of
  `mamba_kernels` (megatron_patches' scan hook calls them).
Reasons: docs/DESIGN.md, "Packing". Tests: tests/test_shared_prompt.py, tests/test_shared_prompt_model.py,
tests/test_shared_prompt_te.py.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backend.mamba_torch import (
    NO_LIMIT,
    causal_conv1d_fn,
    compute_dtype,
    mixer_dims,
    mixer_tail,
    processed_dt,
    rmsnorm_fn,
    seq_idx_from_cu_seqlens,
    ssd_scan,
)
from pack import pair_spans, to_device

# ======================================================================================================================
# The switch


def resolve(cfg, kernels) -> tuple[bool, str]:
    """(the value of `cfg.packing.shared_prompt`, the `world` line's text): "auto" is true with the local spec,
    mamba_torch and no CP; a bool is itself. kernels: kernel_selection.Kernels. The caller stores the value."""
    pk = cfg.packing
    if pk.shared_prompt != "auto":
        return pk.shared_prompt, "shared prompt" if pk.shared_prompt else "separate sequences"
    cp = cfg.parallel.context_parallel_size
    why = []
    if cp > 1:
        why.append(f"the shared-prompt format is not supported with parallel.context_parallel_size = {cp}")
    if kernels.spec == "te":
        why.append("the Transformer Engine spec's shared-prompt attention has not run on a GPU yet")
    if kernels.mamba in ("mamba-ssm", "triton"):
        which = {"mamba-ssm": "mamba-ssm's kernels", "triton": "the Triton Mamba kernels"}[kernels.mamba]
        why.append(f"{which} in the shared-prompt scan have not run on a GPU yet")
    if not why:
        return True, "shared prompt (auto)"
    opt_in = "" if cp > 1 else "; packing.shared_prompt=true turns it on"
    return False, f"separate sequences (auto: {'; '.join(why)}{opt_in})"


# The `RowSpans` of the shared-prompt row running now; None: separate sequences. A context variable, so activation
# recomputation sees it too (megatron_patches._recompute_in_forward_context).
ROW_SPANS: contextvars.ContextVar = contextvars.ContextVar("omni_shared_prompt_row_spans", default=None)


def span_sample_mask(sample_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Per response [2P] -> per pair span [P] (the routers see one sequence per span; both sequences share it)."""
    return None if sample_mask is None else sample_mask.view(-1, 2).amax(dim=1)


# ======================================================================================================================
# A row's offsets, as its layers read them


class RowSpans:
    """A shared-prompt row's offsets for its layers: `bounds` (pack.pair_spans, host ints) and the index tensors the
    layers need, each made on the host once per forward and moved to `device` without a host synchronisation
    (pack.to_device). packed: (seq_idx [1, T] int32 on the device, its host cu_seqlens_padded) of the row's
    PackedSeqParams, taken as the pair spans' seq_idx; ValueError when those offsets are not the pair spans'."""

    def __init__(self, span_cu_seqlens_padded: torch.Tensor, total_tokens: int, device,
                 packed: tuple[torch.Tensor, Sequence[int]] | None = None):
        self.bounds = pair_spans(span_cu_seqlens_padded, total_tokens)
        self.total_tokens, self.device = total_tokens, torch.device(device)
        self._made = {}
        if packed is not None:
            seq_idx, offsets = packed
            if list(offsets) != [0] + [e for *_, e in self.bounds] or not self.bounds or \
                    self.bounds[-1][3] != total_tokens:
                raise ValueError(f"cu_seqlens_padded {list(offsets)} are not the pair spans of the shared-prompt "
                                 f"row {[0] + [e for *_, e in self.bounds]} (T = {total_tokens})")
            assert seq_idx.shape == (1, total_tokens) and seq_idx.dtype == torch.int32, seq_idx
            self._made[("seq_idx", False)] = seq_idx

    def _make(self, key, build: Callable[[], dict | torch.Tensor | None]):
        if key not in self._made:
            out = build()
            move = lambda v: to_device(v, self.device) if isinstance(v, torch.Tensor) else v  # noqa: E731
            self._made[key] = {k: move(v) for k, v in out.items()} if isinstance(out, dict) else move(out)
        return self._made[key]

    def seq_idx(self, split_rejected: bool) -> torch.Tensor:
        """int32 [1, T]: one id per pair span, or with split_rejected one for [prompt | chosen] and one for
        [rejected]."""
        def build():
            cuts = [0] + [c for _, _, r0, e in self.bounds for c in ((r0, e) if split_rejected else (e,))]
            return seq_idx_from_cu_seqlens(torch.tensor(cuts, device="cpu"), self.total_tokens)

        return self._make(("seq_idx", split_rejected), build)

    def varlen_args(self) -> dict:
        """The row as one varlen call: per pair the queries [prompt | chosen], [rejected] against keys
        [prompt | chosen], [prompt | rejected], then the tail. kv_index int64 [T_kv], cu_seqlens_q / cu_seqlens_kv
        int32 [S+1], max_seqlen_q / max_seqlen_kv."""
        return self._make("varlen", self._varlen_args)

    def _varlen_args(self) -> dict:
        T, q_lens, kv_parts = self.total_tokens, [], []  # kv_parts: per sequence, the row ranges of its keys
        for a, c0, r0, e in self.bounds:
            if r0 > a:
                q_lens.append(r0 - a)
                kv_parts.append([(a, r0)])
            if e > r0:
                q_lens.append(e - r0)
                kv_parts.append([(a, c0), (r0, e)])
        end = self.bounds[-1][3] if self.bounds else 0
        if end < T:
            q_lens.append(T - end)
            kv_parts.append([(end, T)])
        kv_lens = [sum(hi - lo for lo, hi in parts) for parts in kv_parts]
        ranges = [torch.arange(lo, hi, device="cpu") for parts in kv_parts for lo, hi in parts]
        cu = [torch.tensor([0] + lens, device="cpu").cumsum(0).to(torch.int32) for lens in (q_lens, kv_lens)]
        return {"kv_index": torch.cat(ranges) if ranges else torch.zeros(0, dtype=torch.int64, device="cpu"),
                "cu_seqlens_q": cu[0], "cu_seqlens_kv": cu[1],
                "max_seqlen_q": max(q_lens, default=0), "max_seqlen_kv": max(kv_lens, default=0)}

    def conv_taps(self, width: int) -> dict | None:
        """The conv taps a rejected span reads from the chosen one instead of the prompt (`causal_conv1d`): per
        tap its row t, the position it must read (add) and the one the packed conv read (sub; -1: before the pair,
        0), its weight column tap; int64 [n] each. None: no tap to correct."""
        return self._make(("conv", width), lambda: self._conv_taps(width))

    def _conv_taps(self, width: int) -> dict | None:
        # Rejected token r0 + j, tap reaching s tokens back with s > j: the packed conv read row position r0 + j - s
        # (chosen, or prompt when the chosen span is shorter), the pair's sequence needs c0 + j - s (prompt); a
        # position before the pair start a reads 0 in both.
        taps = {"t": [], "add": [], "sub": [], "tap": []}
        for a, c0, r0, e in self.bounds:
            if r0 == c0:
                continue
            for j in range(min(width - 1, e - r0)):
                for s in range(j + 1, width):
                    taps["t"].append(r0 + j)
                    taps["add"].append(c0 + j - s if c0 + j - s >= a else -1)
                    taps["sub"].append(r0 + j - s if r0 + j - s >= a else -1)
                    taps["tap"].append(width - 1 - s)
        return {k: torch.tensor(v, device="cpu") for k, v in taps.items()} if taps["t"] else None


def _row_spans(row_spans: RowSpans | torch.Tensor, total_tokens: int, device) -> RowSpans:
    """`row_spans` as RowSpans (offsets int [3P+1] are read on the host: tests and the reference paths)."""
    if isinstance(row_spans, RowSpans):
        assert row_spans.total_tokens == total_tokens and row_spans.device == torch.device(device), \
            (row_spans.total_tokens, total_tokens, row_spans.device, device)
        return row_spans
    return RowSpans(row_spans, total_tokens, device)


# ======================================================================================================================
# Attention


def bottom_right_causal_mask(n_q: int, n_kv: int, device) -> torch.Tensor:
    """bool [n_q, n_kv]: query j sees keys 0 .. n_kv - n_q + j (TE's causal_bottom_right)."""
    return torch.arange(n_kv, device=device)[None, :] <= torch.arange(n_q, device=device)[:, None] + (n_kv - n_q)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row_spans: RowSpans | torch.Tensor,
              scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of a shared-prompt row (pack.pack_shared_prompt): [prompt | chosen] causal, rejected queries against
    [prompt | rejected] bottom-right causal, the tail causal; two SDPA calls per pair. query [T, heads, d],
    key/value [T, groups, d], row_spans: `RowSpans` or the offsets int [3P+1] -> [T, heads * d]."""
    T, h, d = query.shape
    assert key.shape[0] == T and key.shape == value.shape and h % key.shape[1] == 0, (query.shape, key.shape)
    bounds = _row_spans(row_spans, T, query.device).bounds
    rep = h // key.shape[1]
    q = query.permute(1, 0, 2)  # [h, T, d]
    k = key.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    v = value.permute(1, 0, 2).repeat_interleave(rep, dim=0)
    # torch.split views, not slices: a split's backward is one concatenation, not a zero-filled row per slice.
    # Query runs: per pair [prompt | chosen], [rejected]; then the tail. Keys: the spans prompt, chosen, rejected.
    end = bounds[-1][3] if bounds else 0
    runs = [n for a, c0, r0, e in bounds for n in (r0 - a, e - r0)] + [T - end]
    segs = [n for a, c0, r0, e in bounds for n in (c0 - a, r0 - c0, e - r0)] + [T - end]
    q_runs = q.split(runs, dim=1)
    k_runs, v_runs = k.split(runs, dim=1), v.split(runs, dim=1)
    k_segs, v_segs = k.split(segs, dim=1), v.split(segs, dim=1)
    outs = []

    def sdpa(qs, ks, vs, mask=None):  # as [1, h, n, d]: torch's fused kernels (flash, memory-efficient) take 4-D only
        return torch.nn.functional.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                                                dropout_p=dropout_p, is_causal=mask is None,
                                                                scale=scale)[0]

    for i, (a, c0, r0, e) in enumerate(bounds):
        if r0 > a:
            outs.append(sdpa(q_runs[2 * i], k_runs[2 * i], v_runs[2 * i]))
        if e > r0:
            n_p, n_r = c0 - a, e - r0
            keys = torch.cat([k_segs[3 * i], k_segs[3 * i + 2]], dim=1)
            vals = torch.cat([v_segs[3 * i], v_segs[3 * i + 2]], dim=1)
            mask = bottom_right_causal_mask(n_r, n_p + n_r, q.device)
            outs.append(sdpa(q_runs[2 * i + 1], keys, vals, mask))
    if end < T:
        outs.append(sdpa(q_runs[-1], k_runs[-1], v_runs[-1]))
    out = torch.cat(outs, dim=1) if outs else q.new_zeros(h, 0, d)
    return out.permute(1, 0, 2).reshape(T, h * d)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     row_spans: RowSpans | torch.Tensor, attention_fn) -> torch.Tensor:
    """`attention` as one call of attention_fn (local_spec.varlen_attention, or TE's in `te_attention`; the tests'
    reference is tests/test_shared_prompt_te.py::varlen_sdpa) over `RowSpans.varlen_args`."""
    T, h, _ = query.shape
    assert key.shape[0] == T and key.shape == value.shape and h % key.shape[1] == 0, (query.shape, key.shape)
    lay = _row_spans(row_spans, T, query.device).varlen_args()
    return attention_fn(query, key.index_select(0, lay["kv_index"]), value.index_select(0, lay["kv_index"]),
                        lay["cu_seqlens_q"], lay["cu_seqlens_kv"], lay["max_seqlen_q"], lay["max_seqlen_kv"])


def te_attention(base: type) -> type:
    """A subclass of `base` (megatron's TEDotProductAttention) that runs a shared-prompt THD forward (`ROW_SPANS` set)
    as ONE TE varlen call of `varlen_attention` (attn_mask_type "padding_causal_bottom_right", attention_type "cross"
    during the call: docs/DESIGN.md); any other forward is `base`'s. Checked against a TE stand-in
    (tests/test_shared_prompt_te.py) and tests/test_gpu.py."""
    from megatron.core.transformer.enums import AttnMaskType

    class SharedPromptTEDotProductAttention(base):
        def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            """As `base.forward`; shared prompt: query [t, heads, d], key/value [t, groups, d] -> [t, heads * d]."""
            row_spans = ROW_SPANS.get()
            if row_spans is None or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
            assert attention_bias is None and self.config.context_parallel_size == 1  # CP: preflight.check_packing
            assert attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal), attn_mask_type
            te_forward = super(base, self).forward  # transformer_engine.pytorch.DotProductAttention.forward

            def attend(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv):
                return te_forward(q, k, v, None, qkv_format="thd", cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q,
                                  cu_seqlens_kv_padded=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_kv=max_seqlen_kv, attn_mask_type="padding_causal_bottom_right")

            # fewer queries than keys: TE's cross-attention masks (docs/DESIGN.md)
            modules = [self] + [m for m in (getattr(self, n, None) for n in
                                            ("flash_attention", "fused_attention", "unfused_attention"))
                                if m is not None]
            saved = [m.attention_type for m in modules]
            for m in modules:
                m.attention_type = "cross"
            try:
                return varlen_attention(query, key, value, row_spans, attend)
            finally:
                for m, kind in zip(modules, saved, strict=True):
                    m.attention_type = kind

    return SharedPromptTEDotProductAttention


# ======================================================================================================================
# Mamba-2: per pair [prompt | chosen | rejected], the sequences are prompt + chosen and prompt + rejected.
# Mamba-2 is linear in its state, so a rejected token's output is (a) the packed scan restarted at the rejected
# span plus (b) the prompt's final state h_P carried into it:
#     y_t += exp(Σ_{s=r0..t} dt_s·A) · (C_t · h_P),   h_P = Σ_{s∈prompt} exp(Σ_{u=s+1..end} dt_u·A) dt_s x_s ⊗ B_s
# The conv likewise: the packed conv per pair span, then the first W-1 rejected taps swapped to the prompt's inputs.


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    row_spans: RowSpans | torch.Tensor,
    activation: str | None = None,
    conv_fn=None,
) -> torch.Tensor:
    """Causal conv1d of a shared-prompt row: each rejected span sees the prompt's last W-1 inputs, never the chosen
    span's. x [1, dim, seqlen]; row_spans: `RowSpans` or the offsets int [3P+1]; conv_fn: the packed conv to
    correct. Returns [1, dim, seqlen] in x.dtype (the correction is added in the conv's dtype)."""
    if x.shape[0] != 1:
        raise ValueError(f"a shared-prompt row is one packed row; got batch {x.shape[0]}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    conv_fn = conv_fn or causal_conv1d_fn
    seqlen, width = x.shape[-1], weight.shape[1]
    cdt = compute_dtype(x)
    row_spans = _row_spans(row_spans, seqlen, x.device)
    out = conv_fn(x, weight, bias, seq_idx=row_spans.seq_idx(split_rejected=False), activation=None)
    taps = row_spans.conv_taps(width)
    if taps is not None:
        # only the few columns the taps read are gathered, in one gather (its backward is one full-row gradient, not
        # one per gather); index -1 reads 0
        both = torch.cat([taps["add"], taps["sub"]])
        x_add, x_sub = (x[0][:, both.clamp_min(0)].to(cdt) * (both >= 0)).split(taps["add"].numel(), dim=1)
        terms = (x_add - x_sub) * weight.to(cdt)[:, taps["tap"]]  # [dim, n]
        out = out.index_add(2, taps["t"], terms.to(out.dtype)[None])
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    row_spans: RowSpans | torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    scan_fn=None,
) -> torch.Tensor:
    """SSD scan of a shared-prompt row: [prompt | chosen] as one sequence, each rejected span continuing the
    prompt's final state. Arguments as `mamba_chunk_scan_combined` (batch 1) plus row_spans (as `causal_conv1d`);
    scan_fn: the packed scan (None: this module's, which also returns the prompt states). Returns out in x.dtype."""
    batch, seqlen, nheads, headdim = x.shape
    if batch != 1:
        raise ValueError(f"a shared-prompt row is one packed row; got batch {batch}")
    if B.shape[:2] != (1, seqlen) or B.shape != C.shape or nheads % B.shape[2] or dt.shape != (1, seqlen, nheads):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)}")
    cdt = compute_dtype(x)
    dtf = processed_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    row_spans = _row_spans(row_spans, seqlen, x.device)
    seq_idx, bounds = row_spans.seq_idx(split_rejected=True), row_spans.bounds
    # pairs whose rejected response continues a prompt (an empty prompt or rejected response needs no correction)
    corrected = [i for i, (a, c0, r0, e) in enumerate(bounds) if c0 > a and e > r0]
    # The kernel applies D and the gate itself; the prompt-state term is linear in y, so it joins afterwards as
    # corr · silu(z) on the rejected rows only: (y + corr + D·x)·silu(z) = kernel output + corr·silu(z).
    if scan_fn is None:
        # this module's scan also returns h_P (the state after each prompt), so it is not summed over the prompt again
        out, _, h_ps = ssd_scan(x, dtf, A, B, C, chunk_size, D, z, seq_idx, None, [bounds[i][1] - 1 for i in corrected])
    else:
        out, h_ps = scan_fn(x, dtf, A, B, C, chunk_size, D=D, z=z, seq_idx=seq_idx), None
    g = B.shape[2]
    r = nheads // g
    Af = A.to(cdt)
    # Per pair, on torch.split views of its spans (their backward is one concatenation per tensor, not a
    # zero-filled full-row gradient per slice); heads as [group, head in group].
    end = bounds[-1][3] if bounds else 0
    segs = [n for a, c0, r0, e in bounds for n in (c0 - a, r0 - c0, e - r0)] + [seqlen - end]
    xs, dts, Bs, Cs = (t[0].split(segs) for t in (x, dtf, B, C))
    zs = z[0].split(segs) if z is not None else None
    rows, corrs = [], []
    for j, i in enumerate(corrected):
        a, c0, r0, e = bounds[i]
        if h_ps is not None:
            h_p = h_ps[j].view(g, r, headdim, -1)  # state after the prompt, from the scan
        else:
            dt_p = dts[3 * i]
            cum_p = torch.cumsum(dt_p * Af, dim=0)  # [k, h] log-decay from the prompt start, inclusive
            w = torch.exp(cum_p[-1:] - cum_p) * dt_p  # weight of token s in the state after the prompt
            x_p = xs[3 * i].to(cdt).view(c0 - a, g, r, headdim)
            h_p = torch.einsum("sgr,sgrp,sgn->grpn", w.view(c0 - a, g, r), x_p, Bs[3 * i].to(cdt))
        dt_r = dts[3 * i + 2]
        cum_r = torch.cumsum(dt_r * Af, dim=0)  # [n_r, h]
        read = torch.einsum("tgn,grpn->tgrp", Cs[3 * i + 2].to(cdt), h_p).reshape(e - r0, nheads, headdim)
        corr = torch.exp(cum_r)[..., None] * read
        if zs is not None:
            corr = corr * F.silu(zs[3 * i + 2].to(cdt))
        corrs.append(corr)
        rows.append(torch.arange(r0, e, device=x.device))
    if corrs:
        out = out.index_add(1, torch.cat(rows), torch.cat(corrs).to(out.dtype)[None])
    return out


def mamba_split_conv1d_scan(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    row_spans: RowSpans | torch.Tensor,
    dt_limit: tuple[float, float] = NO_LIMIT,
    activation: str = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    seq_idx: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    conv_fn=None,
    scan_fn=None,
    norm_fn=None,
) -> torch.Tensor:
    """`mamba_split_conv1d_scan_combined` for a shared-prompt row (batch 1), with the shared-prompt conv and scan; it
    takes megatron's keywords, so it can replace the fused call: seq_idx, when given, must be the pair spans' (checked
    on the device unless it is the one `row_spans` holds)."""
    batch, seqlen, total = zxbcdt.shape
    row_spans = _row_spans(row_spans, seqlen, zxbcdt.device)
    want = row_spans.seq_idx(split_rejected=False)
    if seq_idx is not None and seq_idx is not want and (
            seq_idx.shape != want.shape or not torch.equal(seq_idx.to(want.dtype), want)):
        raise ValueError("seq_idx does not separate the pair spans of row_spans (pass the pair spans as "
                         "cu_seqlens_padded of the PackedSeqParams)")
    nheads, headdim, dim, dstate, d_nonssm = mixer_dims(zxbcdt, conv1d_weight, dt_bias, A, D, headdim, ngroups)
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, row_spans, activation=activation,
                        conv_fn=conv_fn).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    y = mamba_chunk_scan(
        x.reshape(batch, seqlen, nheads, headdim), dt, A, B.reshape(batch, seqlen, ngroups, dstate),
        C.reshape(batch, seqlen, ngroups, dstate), chunk_size, row_spans, D=D,
        z=None if rmsnorm_weight is not None else z.reshape(batch, seqlen, nheads, headdim), dt_bias=dt_bias,
        dt_softplus=True, dt_limit=dt_limit, scan_fn=scan_fn,
    )
    return mixer_tail(y.reshape(batch, seqlen, dim), z, zx0, d_nonssm, rmsnorm_weight, rmsnorm_eps, dim, ngroups,
                      norm_before_gate, outproj_weight, outproj_bias, norm_fn or rmsnorm_fn)


def mamba_kernels(fn) -> dict:
    """The conv_fn / scan_fn / norm_fn of `mamba_split_conv1d_scan` that match the fused Mamba function `fn`
    megatron calls (megatron_patches.install_mamba_scan_hook)."""
    from backend import mamba_torch, mamba_triton

    if fn is mamba_torch.mamba_split_conv1d_scan_combined:
        return {}
    if fn is mamba_triton.mamba_split_conv1d_scan_combined:
        return mamba_triton.kernels()
    import causal_conv1d as cc
    from mamba_ssm.ops.triton import layernorm_gated, ssd_combined

    return {"conv_fn": cc.causal_conv1d_fn, "scan_fn": ssd_combined.mamba_chunk_scan_combined,
            "norm_fn": layernorm_gated.rmsnorm_fn}
