"""The shared-prompt pair layout (`packing.shared_prompt`): each pair is one THD span [prompt | chosen | rejected].

The prompt is stored and computed once; the rejected segment attends to the prompt but not to the chosen one, so each
response token sees what it sees as a separate row, with the same labels, loss mask and positions.
- Switch: `resolve` ("auto" at start), `on`, `check_parallel`. Planning: `span_sizes`.
- Packing: `prefix_length`, `pack`. Offsets: `spans`, `response_sequence_ids`.
Reasons: docs/DESIGN.md, "Packing". Tests: tests/test_shared_prompt.py, tests/test_shared_prompt_model.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pack import IGNORE_INDEX, PackedBatch, PreferencePair, _check_pair, _packed_batch, padded_length

# ======================================================================================================================
# The switch


def resolve(cfg, kernels) -> str:
    """Resolve "auto" in place (true with the local spec, mamba_torch and no CP); returns the `world` line's text."""
    pk = cfg.packing
    if pk.shared_prompt != "auto":
        return "shared prompt" if pk.shared_prompt else "separate rows"
    cp = cfg.parallel.context_parallel_size
    why = []
    if cp > 1:
        why.append(f"the shared-prompt layout is not supported with parallel.context_parallel_size = {cp}")
    if kernels.spec == "te":
        why.append("the Transformer Engine spec's shared-prompt attention has not run on a GPU yet")
    if kernels.mamba in ("mamba-ssm", "triton"):
        which = {"mamba-ssm": "mamba-ssm's kernels", "triton": "the Triton Mamba kernels"}[kernels.mamba]
        why.append(f"{which} in the shared-prompt scan have not run on a GPU yet")
    pk.shared_prompt = not why
    if not why:
        return "shared prompt (auto)"
    opt_in = "" if cp > 1 else "; packing.shared_prompt=true turns it on"
    return f"separate rows (auto: {'; '.join(why)}{opt_in})"


def on(packing) -> bool:
    """The resolved switch; ValueError while `packing.shared_prompt` is still "auto"."""
    if not isinstance(packing.shared_prompt, bool):
        raise ValueError(f"packing.shared_prompt = {packing.shared_prompt!r} is resolved at start by "
                         "shared_prompt.resolve(cfg, kernel_selection.select_kernels()); call it before planning")
    return packing.shared_prompt


def check_parallel(cfg) -> None:
    """ValueError for packing.shared_prompt = true with CP > 1."""
    cp = cfg.parallel.context_parallel_size
    if getattr(cfg.packing, "shared_prompt", False) is True and cp > 1:
        raise ValueError(
            f"packing.shared_prompt = true is not supported with parallel.context_parallel_size = {cp} yet; set "
            "packing.shared_prompt = \"auto\" (separate rows with CP) or false, or context_parallel_size = 1"
        )


# ======================================================================================================================
# Planning


def span_sizes(lengths: Mapping[int, tuple[int, int]], shared_lengths: Mapping[int, int], divisible_by: int,
               cost_fn: Callable[[int], float]) -> dict[int, tuple[int, int, float]]:
    """Pair id -> (padded tokens, real tokens, cost) of its span, the prompt's `shared` tokens counted once."""
    out = {}
    for pid, (c, r) in lengths.items():
        shared = shared_lengths.get(pid, -1)
        assert 0 <= shared < min(c, r)
        real = c + r - shared
        padded = padded_length(real, divisible_by)
        out[pid] = padded, real, cost_fn(c) + cost_fn(r + padded - real) - cost_fn(shared)
    return out


# ======================================================================================================================
# Packing one bin


def prefix_length(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_loss_mask: torch.Tensor,
                  rejected_loss_mask: torch.Tensor) -> int:
    """k = m - 1, m the rows' common prefix outside both response masks (row[k] starts each response)."""
    n = min(chosen_ids.numel(), rejected_ids.numel())
    same = (chosen_ids[:n] == rejected_ids[:n]) & ~chosen_loss_mask[:n] & ~rejected_loss_mask[:n]
    m = int(same.long().cumprod(0).sum())
    return max(m - 1, 0)


def pack(
    pairs: Sequence[PreferencePair],
    divisible_by: int,
    image_token_id: int,
    pad_token_id: int = 0,
    dummy: bool = False,
) -> PackedBatch:
    """Pack one bin: per pair [row[:k] | chosen[k:] | rejected[k:] | padding], k = `prefix_length`.
    ValueError: k = 0, or `<image>` past the prompt."""
    assert pairs and divisible_by >= 1
    ids, labels, lmask, pos = [], [], [], []
    cu, cu_pad, seg, seg_pad = [0], [0], [0], [0]
    pair_index, is_chosen = [], []
    for p in pairs:
        _check_pair(p, image_token_id)
        k = prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask)
        if k < 1:
            raise ValueError(f"pair {p.pair_index}: the chosen and rejected rows share no prompt token "
                             "(shared_prompt.prefix_length 0); use the separate-rows layout for such data")
        n_img = int(p.image_token_counts.sum())
        if int((p.chosen_ids[:k] == image_token_id).sum()) != n_img:
            raise ValueError(f"pair {p.pair_index}: {n_img} <image> tokens expected inside the shared prompt "
                             f"(first {k} tokens), found {int((p.chosen_ids[:k] == image_token_id).sum())}")
        row_c, row_r = p.chosen_ids, p.rejected_ids
        # Labels and masks of the whole rows first (pre-rolled as in pack.pack), then cut into segments.
        parts = [(row_c[:k], row_c[1:k + 1], p.chosen_loss_mask[1:k + 1], torch.arange(k))]
        for row, rmask in ((row_c, p.chosen_loss_mask), (row_r, p.rejected_loss_mask)):
            n = row.numel()
            lab = torch.full((n - k,), IGNORE_INDEX, dtype=torch.int64)
            lab[: n - k - 1] = row[k + 1:]
            msk = torch.zeros(n - k, dtype=torch.bool)
            msk[: n - k - 1] = rmask[k + 1:]
            parts.append((row[k:], lab, msk, torch.arange(k, n)))
        real = sum(t[0].numel() for t in parts)
        n_pad = padded_length(real, divisible_by) - real
        last = row_r.numel()
        parts.append((torch.full((n_pad,), pad_token_id, dtype=torch.int64),
                      torch.full((n_pad,), IGNORE_INDEX, dtype=torch.int64),
                      torch.zeros(n_pad, dtype=torch.bool), torch.arange(last, last + n_pad)))
        for a, b, c, d in parts:
            ids.append(a)
            labels.append(b)
            lmask.append(c)
            pos.append(d)
        lens = [t[0].numel() for t in parts[:3]]
        for j, n in enumerate(lens):
            seg.append(seg[-1] + n)
            seg_pad.append(seg_pad[-1] + n + (n_pad if j == 2 else 0))
        cu.append(cu[-1] + real)
        cu_pad.append(cu_pad[-1] + real + n_pad)
        pair_index += [-1 if dummy else p.pair_index] * 2
        is_chosen += [True, False]
    return _packed_batch(pairs, (ids, labels, lmask, pos), cu, cu_pad, pair_index, is_chosen, dummy,
                         media_index=torch.arange(len(pairs), dtype=torch.int64),
                         segment_cu_seqlens=torch.tensor(seg, dtype=torch.int32),
                         segment_cu_seqlens_padded=torch.tensor(seg_pad, dtype=torch.int32))


# ======================================================================================================================
# Offsets of a packed row


def spans(segment_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> list[tuple[int, int, int, int]]:
    """(prompt, chosen, rejected, end) offsets of each pair; ValueError if malformed."""
    b = [int(v) for v in segment_cu_seqlens_padded.flatten().tolist()]
    if len(b) % 3 != 1 or b[0] != 0 or any(y < x for x, y in zip(b[:-1], b[1:], strict=True)) or b[-1] > total_tokens:
        raise ValueError(f"segment_cu_seqlens_padded must hold 3P+1 offsets rising from 0 to at most T = "
                         f"{total_tokens}; got {b}")
    return [tuple(b[i:i + 4]) for i in range(0, len(b) - 1, 3)]


def response_sequence_ids(segment_cu_seqlens_padded: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """int64 [T]: 2i on pair i's chosen segment, 2i+1 on its rejected one, 2P on prompts and the tail."""
    n = 2 * len(spans(segment_cu_seqlens_padded, total_tokens))
    b = segment_cu_seqlens_padded.long()
    lengths = torch.cat([b[1:] - b[:-1], total_tokens - b[-1:]])
    role = torch.arange(lengths.numel(), device=b.device)
    ids = torch.where(role % 3 == 0, n, 2 * (role // 3) + (role % 3) - 1)
    ids[-1] = n
    return torch.repeat_interleave(ids, lengths, output_size=total_tokens)
