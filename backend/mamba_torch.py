"""Pure-torch Mamba-2: chunked SSD scan, causal depthwise conv1d and gated grouped RMSNorm, with packed sequences.

Drop-ins (same names and keywords) for the kernels megatron-core's MambaMixer calls: causal-conv1d's `causal_conv1d_fn`,
mamba-ssm's `mamba_chunk_scan_combined`, `mamba_split_conv1d_scan_combined`, `rmsnorm_fn` / `RMSNormGated`. Packed rows:
`seq_idx` [batch, seqlen] (non-decreasing) or `cu_seqlens` [S + 1] for batch 1; sequences never interact.

The scan is Mamba-2's SSD block decomposition (Dao & Gu 2024, "Transformers are SSMs", §6), per head h, computed in
float32 (float64 for float64 inputs), returned in x's dtype; shared_prompt.py's conv and scan build on these kernels:
    dt_t = clamp(softplus(dt_t + dt_bias_h), *dt_limit)
    h_t  = exp(dt_t · A_h) · h_{t-1} + dt_t · x_t ⊗ B_t          (zero at each sequence start)
    y_t  = h_t · C_t + D_h · x_t,   then · silu(z_t) if z is given
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_fn", "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "rmsnorm_fn",
           "RMSNormGated", "seq_idx_from_cu_seqlens"]  # the drop-ins; the shared-prompt conv and scan also use
# NO_LIMIT, compute_dtype, processed_dt, ssd_scan, mixer_dims and mixer_tail

NO_LIMIT = (0.0, float("inf"))  # dt_limit that clamps nothing


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the kernels compute in for inputs of t's dtype: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def processed_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float],
                 cdt: torch.dtype) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias), *dt_limit) in `cdt`, each step only when asked."""
    dtf = dt.to(cdt)
    if dt_bias is not None:
        dtf = dtf + dt_bias.to(cdt)
    if dt_softplus:
        dtf = F.softplus(dtf)
    if tuple(dt_limit) != NO_LIMIT:
        dtf = dtf.clamp(min=dt_limit[0], max=dt_limit[1])
    return dtf


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """cu_seqlens [num_seqs + 1] (rising from 0 to at most seqlen) → seq_idx [1, seqlen] int32: each token's sequence,
    num_seqs on the padding past cu_seqlens[-1]. ValueError on bad offsets."""
    cu = cu_seqlens.flatten().long()
    if cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be a non-empty 1-D tensor; got shape {tuple(cu_seqlens.shape)}")
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or cu[-1] > seqlen:
        raise ValueError(f"cu_seqlens must rise from 0 to at most seqlen = {seqlen}; got {cu.tolist()}")
    lengths = torch.cat([cu[1:] - cu[:-1], seqlen - cu[-1:]])
    ids = torch.repeat_interleave(torch.arange(cu.numel(), dtype=torch.long, device=cu.device), lengths,
                                  output_size=seqlen)
    return ids.to(torch.int32).unsqueeze(0)


def _check_seq_idx(seq_idx: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    if seq_idx.shape != (batch, seqlen):
        raise ValueError(f"seq_idx must have shape (batch, seqlen)=({batch}, {seqlen}), got {tuple(seq_idx.shape)}")
    if seqlen > 1 and bool((falls := seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        r, t = falls.nonzero()[0].tolist()
        raise ValueError(f"seq_idx must be non-decreasing along each row (one contiguous run per sequence); row {r} "
                         f"falls from {int(seq_idx[r, t])} to {int(seq_idx[r, t + 1])} at position {t + 1}")
    return seq_idx


def _resolve_seq_idx(seq_idx, cu_seqlens, batch: int, seqlen: int):
    if seq_idx is None and cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens describes one packed row; got batch={batch}")
        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, seqlen)
    if seq_idx is not None:
        seq_idx = _check_seq_idx(seq_idx, batch, seqlen)
    return seq_idx


# ---------------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
):
    """Causal depthwise conv1d: out[b, d, t] = act(bias[d] + Σ_k weight[d, k] · x[b, d, t - (W-1) + k]).

    x [batch, dim, seqlen]; weight [dim, W]; bias [dim] or None; seq_idx [batch, seqlen] (taps reaching another sequence
    read 0); initial_states [batch, dim, W-1] (not with seq_idx); activation None, "silu" or "swish". Returns out in
    x.dtype, or (out, the last W-1 inputs [batch, dim, W-1]) with return_final_states."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    batch, dim, seqlen = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [dim={dim}, width], got {tuple(weight.shape)}")
    width = weight.shape[1]
    cdt = compute_dtype(x)
    xf, wf = x.to(cdt), weight.to(cdt)
    if initial_states is not None and seq_idx is not None:
        raise ValueError("initial_states with seq_idx is not supported (as in causal-conv1d)")
    if initial_states is None:
        initial_states = xf.new_zeros(batch, dim, width - 1)
    xpad = torch.cat([initial_states.to(cdt), xf], dim=-1)  # [b, d, W-1+l]
    out = F.conv1d(xpad, wf.unsqueeze(1), None if bias is None else bias.to(cdt), groups=dim)
    if seq_idx is not None:
        seq_idx = _check_seq_idx(seq_idx, batch, seqlen)
        # Tap k of token t reads x[t - s], s = W-1-k. The plain conv above also summed the taps that reach a token of
        # another sequence; those (t, s) pairs lie within W-1 tokens after a sequence start, so they are few: find
        # them on the [b, l] ids and subtract their terms (one gather and one scatter-add instead of a pass per tap).
        bs, ts, ss = [], [], []
        for s in range(1, min(width, seqlen)):
            cross = (seq_idx[:, s:] != seq_idx[:, :-s]).nonzero()  # [k, 2]: (row, t - s)
            bs.append(cross[:, 0])
            ts.append(cross[:, 1] + s)
            ss.append(torch.full_like(cross[:, 0], s))
        if bs and sum(t.numel() for t in ts):
            bi, ti, si = torch.cat(bs), torch.cat(ts), torch.cat(ss)
            terms = xf[bi, :, ti - si] * wf[:, width - 1 - si].T  # [k, dim]
            out = out.transpose(1, 2).index_put((bi, ti), -terms, accumulate=True).transpose(1, 2)
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = xpad[:, :, -(width - 1) :].to(x.dtype) if width > 1 else x.new_zeros(batch, dim, 0)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


# ---------------------------------------------------------------------------------------------------------------------
# Chunked SSD scan


def _pad_len(t: torch.Tensor, pad: int, dim: int = 1, value: float = 0.0) -> torch.Tensor:
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _ssd(x, dt, A, B, C, chunk_size, seq_idx, initial_states, state_positions=None):
    """Core SSD scan: x [b,l,h,p], dt [b,l,h] (processed), A [h], B/C [b,l,g,n], one float dtype. Returns y
    [b,l,h,p] (no D, no z), the final state [b,h,p,n] and the states after `state_positions` (batch 0) [len,h,p,n]."""
    b, seqlen, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    Q = chunk_size
    pad = (-seqlen) % Q
    nc = (seqlen + pad) // Q
    # Padding tokens have dt = 0 (no decay, no input), so they leave the state unchanged.
    xdt = (x * dt[..., None])
    xdt = _pad_len(xdt, pad).view(b, nc, Q, h, p).permute(0, 3, 1, 2, 4)  # [b, h, nc, Q, p]
    dt = _pad_len(dt, pad).view(b, nc, Q, h).permute(0, 3, 1, 2)  # [b, h, nc, Q]
    B = _pad_len(B, pad).view(b, nc, Q, g, n).permute(0, 3, 1, 2, 4)  # [b, g, nc, Q, n]
    C = _pad_len(C, pad).view(b, nc, Q, g, n).permute(0, 3, 1, 2, 4)
    cum = torch.cumsum(dt * A[:, None, None], dim=-1)  # [b, h, nc, Q]: log-decay from the chunk start (inclusive)

    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    if seq_idx is not None:
        sid = _pad_len(seq_idx, pad, value=0)
        if pad:
            sid[:, seqlen:] = seq_idx[:, -1:]
        sid = sid.view(b, nc, Q)
        mask = (causal & (sid[:, :, :, None] == sid[:, :, None, :]))[:, None]  # [b, 1, nc, l, s]
    else:
        mask = causal
    # 1. Within a chunk: y_l = Σ_{s≤l, same seq} (C_l·B_s) exp(cum_l − cum_s) dt_s x_s.
    decay = cum[..., :, None] - cum[..., None, :]  # [b, h, nc, l, s]
    decay = decay.masked_fill_(~mask, float("-inf")).exp_()  # in place: the subtraction saves nothing for backward
    CB = torch.matmul(C, B.transpose(-1, -2))  # [b, g, nc, l, s]
    W = (decay.view(b, g, r, nc, Q, Q) * CB[:, :, None]).view(b, h, nc, Q, Q)
    y = torch.matmul(W, xdt)  # [b, h, nc, Q, p]

    # 2. Each chunk's own contribution to the state at its last token (tokens of the last token's sequence only).
    to_end = torch.exp(cum[..., -1:] - cum)  # [b, h, nc, Q]
    if seq_idx is not None:
        to_end = to_end * (sid == sid[:, :, -1:]).to(x.dtype)[:, None]
    Bh = B[:, :, None].expand(b, g, r, nc, Q, n).reshape(b, h, nc, Q, n)
    chunk_states = torch.matmul((xdt * to_end[..., None]).transpose(-1, -2), Bh)  # [b, h, nc, p, n]

    # 3. Between chunks: the state at boundary c (before chunk c; boundary nc = after the last chunk) is
    #    Σ_{k≤c} exp(Z_c − Z_k) S_k over sources k of the same sequence, S_0 = initial state, S_k = chunk_states[k−1].
    Z = F.pad(torch.cumsum(cum[..., -1], dim=-1), (1, 0))  # [b, h, nc+1]
    bmask = torch.ones(nc + 1, nc + 1, dtype=torch.bool, device=x.device).tril()
    if seq_idx is not None:
        # Boundary 0 belongs to the row's first sequence (the initial state continues it); boundary c ≥ 1 to the
        # sequence of chunk c−1's last token.
        sb = torch.cat([sid[:, :1, 0], sid[:, :, -1]], dim=1)  # [b, nc+1]
        bmask = (bmask & (sb[:, :, None] == sb[:, None, :]))[:, None]
    bdecay = (Z[..., :, None] - Z[..., None, :]).masked_fill_(~bmask, float("-inf")).exp_()  # [b, h, nc+1, nc+1]
    if initial_states is None:
        S0 = chunk_states.new_zeros(b, h, 1, p, n)
    else:
        S0 = initial_states.to(x.dtype).view(b, h, 1, p, n)
    S = torch.cat([S0, chunk_states], dim=2).view(b, h, nc + 1, p * n)
    bstates = torch.matmul(bdecay, S).view(b, h, nc + 1, p, n)
    start_states = bstates[:, :, :-1]
    final = bstates[:, :, -1]

    # 4. State → output: y_l += exp(cum_l) C_l · state(chunk start), for tokens of the boundary's sequence.
    from_start = torch.exp(cum)  # [b, h, nc, Q]
    if seq_idx is not None:
        from_start = from_start * (sid == sb[:, :-1, None]).to(x.dtype)[:, None]
    Ch = C[:, :, None] * from_start.view(b, g, r, nc, Q)[..., None]  # [b, g, r, nc, Q, n]
    y = y + torch.matmul(Ch.view(b, h, nc, Q, n), start_states.transpose(-1, -2))
    y = y.permute(0, 2, 3, 1, 4).reshape(b, nc * Q, h, p)[:, :seqlen]

    pos_states = None
    if state_positions is not None:
        # State after token t: the chunk-start state decayed to t plus the tokens s ≤ t of t's chunk. One gather per
        # tensor for all positions (a gather's backward is one full-size gradient; one per position would be many).
        t = torch.tensor([int(v) for v in state_positions], dtype=torch.int64, device=x.device)
        c, pos = t // Q, t % Q
        cum_c = cum[0, :, c]  # [h, k, Q]
        w = (cum_c.gather(2, pos[None, :, None].expand(h, -1, 1)) - cum_c)  # [h, k, Q]: log-decay s -> t
        keep = (torch.arange(Q, device=x.device)[None, :] <= pos[:, None])
        if seq_idx is not None:
            keep = keep & (sid[0, c] == sid[0, c].gather(1, pos[:, None]))
        w = w.masked_fill(~keep[None], float("-inf")).exp()
        Bc = B[0, :, c][:, None].expand(g, r, -1, Q, n).reshape(h, -1, Q, n)
        local = torch.einsum("hks,hksn,hksp->khpn", w, Bc, xdt[0, :, c])
        carry = from_start[0, :, c, pos].T[:, :, None, None] * start_states[0, :, c].transpose(0, 1)
        pos_states = local + carry  # [len, h, p, n]
    return y, final, pos_states


def ssd_scan(x, dtf, A, B, C, chunk_size, D, z, seq_idx, initial_states, positions):
    """`mamba_chunk_scan_combined` after its checks, on dtf = `processed_dt`: (out [b,l,h,p] in x.dtype, the final
    state [b,h,p,n], the states after `positions` (batch 0) [len(positions),h,p,n] or None)."""
    cdt = dtf.dtype
    xf = x.to(cdt)
    y, final, states = _ssd(xf, dtf, A.to(cdt), B.to(cdt), C.to(cdt), chunk_size, seq_idx, initial_states,
                            positions)
    if D is not None:
        Df = D.to(cdt)
        y = y + xf * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y.to(x.dtype), final, states


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
):
    """Mamba-2 SSD scan (mamba_ssm's mamba_chunk_scan_combined).

    x [batch, seqlen, nheads, headdim]; dt [batch, seqlen, nheads]; A [nheads]; B, C [batch, seqlen, ngroups, dstate]
    (head i uses group i // (nheads // ngroups)); D [nheads] or [nheads, headdim]; z like x; dt_bias [nheads];
    initial_states [batch, nheads, headdim, dstate]; dt_limit (0, inf) means no clamp. Returns out in x.dtype, then
    the final state and the state after each sequence of cu_seqlens when asked (in state_dtype, default float32)."""
    batch, seqlen, nheads, headdim = x.shape
    if B.shape[:2] != (batch, seqlen) or B.shape != C.shape or nheads % B.shape[2] != 0:
        raise ValueError(f"B/C must be [batch, seqlen, ngroups | nheads, dstate]; x {tuple(x.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}")
    if dt.shape != (batch, seqlen, nheads) or A.shape != (nheads,):
        raise ValueError(f"dt must be {(batch, seqlen, nheads)} and A ({nheads},); got {tuple(dt.shape)}, "
                         f"{tuple(A.shape)}")
    if return_varlen_states and cu_seqlens is None:
        raise ValueError("return_varlen_states needs cu_seqlens")
    seq_idx = _resolve_seq_idx(seq_idx, cu_seqlens, batch, seqlen)
    cdt = compute_dtype(x)
    dtf = processed_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    positions = None
    if return_varlen_states:
        cu = cu_seqlens.to(torch.int64).flatten().tolist()
        positions = [end - 1 for end in cu[1:]]
        if any(cu[i + 1] <= cu[i] for i in range(len(cu) - 1)):
            raise ValueError("return_varlen_states needs non-empty sequences in cu_seqlens")
    out, final, varlen = ssd_scan(x, dtf, A, B, C, chunk_size, D, z, seq_idx, initial_states, positions)
    sdt = state_dtype or cdt
    result = [out]
    if return_final_states:
        result.append(final.to(sdt))
    if return_varlen_states:
        result.append(varlen.to(sdt))
    return out if len(result) == 1 else tuple(result)


# ---------------------------------------------------------------------------------------------------------------------
# Gated grouped RMSNorm


def rmsnorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels (mamba_ssm's layernorm_gated.rmsnorm_fn): RMSNorm_g(x ·
    silu(z)) · weight when norm_before_gate is False (Nemotron-H), else RMSNorm_g(x) · weight · silu(z)."""
    dim = x.shape[-1]
    group_size = dim if group_size is None else group_size
    if dim % group_size != 0:
        raise ValueError(f"dim {dim} is not a multiple of group_size {group_size}")
    cdt = compute_dtype(x)
    xf = x.to(cdt)
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.to(cdt))
    xg = xf.view(*xf.shape[:-1], dim // group_size, group_size)
    xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
    out = xg.view(xf.shape) * weight.to(cdt)
    if bias is not None:
        out = out + bias.to(cdt)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(cdt))
    return out.to(x.dtype)


class RMSNormGated(torch.nn.Module):
    """Gated grouped RMSNorm module with mamba_ssm's layernorm_gated.RMSNorm constructor."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        """x, z: [..., hidden_size] → [..., hidden_size] in x.dtype."""
        return rmsnorm_fn(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                          norm_before_gate=self.norm_before_gate)


# ---------------------------------------------------------------------------------------------------------------------
# Fused mixer body


def mamba_split_conv1d_scan_combined(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = NO_LIMIT,
    return_final_states: bool = False,
    activation: str = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    state_dtype: torch.dtype | None = None,
    cu_seqlens: torch.Tensor | None = None,
    conv_fn=None,
    scan_fn=None,
    norm_fn=None,
):
    """Mamba-2 mixer body after in_proj (mamba_ssm's mamba_split_conv1d_scan_combined).

    zxbcdt [batch, seqlen, 2·d_nonssm + 2·dim + 2·ngroups·dstate + nheads] splits into [zx0 | z | xBC | dt]; xBC goes
    through the causal conv and splits into x, B, C for the scan; then the gated norm (with rmsnorm_weight) or the gate,
    the swiglu of zx0 and out_proj. conv_fn / scan_fn / norm_fn: the kernels (default this module's; mamba_triton's on a
    GPU without compiled mamba-ssm). Returns out [batch, seqlen, out], or (out, final_states)."""
    batch, seqlen, total = zxbcdt.shape
    nheads, headdim, dim, dstate, d_nonssm = mixer_dims(zxbcdt, conv1d_weight, dt_bias, A, D, headdim, ngroups)
    seq_idx = _resolve_seq_idx(seq_idx, cu_seqlens, batch, seqlen)
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = (conv_fn or causal_conv1d_fn)(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                                        activation=activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, seqlen, nheads, headdim)
    B = B.reshape(batch, seqlen, ngroups, dstate)
    C = C.reshape(batch, seqlen, ngroups, dstate)
    z4 = z.reshape(batch, seqlen, nheads, headdim)
    res = (scan_fn or mamba_chunk_scan_combined)(
        x, dt, A, B, C, chunk_size, D=D, z=None if rmsnorm_weight is not None else z4, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, **({} if state_dtype is None else {"state_dtype": state_dtype}),
    )
    y, final = (res if return_final_states else (res, None))
    y = mixer_tail(y.reshape(batch, seqlen, dim), z, zx0, d_nonssm, rmsnorm_weight, rmsnorm_eps, dim, ngroups,
                   norm_before_gate, outproj_weight, outproj_bias, norm_fn or rmsnorm_fn)
    return (y, final) if return_final_states else y


def mixer_dims(zxbcdt, conv1d_weight, dt_bias, A, D, headdim, ngroups):
    """(nheads, headdim, dim, dstate, d_nonssm) of a fused mixer call."""
    total = zxbcdt.shape[-1]
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim is required when D is [nheads]")
        nheads = D.shape[0]
    else:
        nheads, headdim = D.shape
    if nheads % ngroups != 0:
        raise ValueError(f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (total - 2 * dim - 2 * ngroups * dstate - nheads) // 2
    if d_nonssm < 0 or total != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads or dstate <= 0:
        raise ValueError(f"zxbcdt last dim {total} does not match nheads={nheads}, headdim={headdim}, "
                         f"ngroups={ngroups}, conv channels={conv1d_weight.shape[0]}")
    if dt_bias.shape != (nheads,) or A.shape != (nheads,):
        raise ValueError(f"dt_bias and A must be ({nheads},)")
    return nheads, headdim, dim, dstate, d_nonssm


def mixer_tail(y, z, zx0, d_nonssm, rmsnorm_weight, rmsnorm_eps, dim, ngroups, norm_before_gate, outproj_weight,
               outproj_bias, norm_fn):
    """The gated norm (or nothing), the swiglu prefix of zx0 and the output projection."""
    if rmsnorm_weight is not None:
        y = norm_fn(y, rmsnorm_weight, None, z=z, eps=rmsnorm_eps, group_size=dim // ngroups,
                    norm_before_gate=norm_before_gate)
    if d_nonssm > 0:
        a, g = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(a) * g, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return y
