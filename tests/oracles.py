"""Test oracles of pack.py: the inverses of packing and of the CP slicing, and plan measures.

`unpack` / `unpack_shared` give back the separate sequences of a `pack.pack` / `pack.pack_shared_prompt` batch;
`cp_gather` puts the CP ranks' slices (`pack.cp_partition_index`) back in row order; `packing_efficiency` is a plan's
useful-token fraction.
Training uses none of these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import pack

TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids")


def unpack(batch: pack.PackedBatch) -> list[dict[str, torch.Tensor]]:
    """The sequences of a `pack` batch, padding removed: per sequence input_ids, labels, loss_mask, position_ids
    ([L_s] each) and seq_loss_mask [L_s] bool, the un-shifted response mask (seq_loss_mask[t + 1] = loss_mask[t])."""
    out = []
    for s in range(batch.num_sequences):
        a = int(batch.cu_seqlens_padded[s])
        n = int(batch.cu_seqlens[s + 1] - batch.cu_seqlens[s])
        d = {k: getattr(batch, k)[0, a : a + n] for k in TOKEN_FIELDS}
        seq_mask = torch.zeros(n, dtype=torch.bool)
        seq_mask[1:] = d["loss_mask"][: n - 1]
        d["seq_loss_mask"] = seq_mask
        out.append(d)
    return out


def unpack_shared(batch: pack.PackedBatch) -> list[dict[str, torch.Tensor]]:
    """The separate sequences of a `pack.pack_shared_prompt` batch, per response (chosen 0, rejected 0, chosen 1, ...),
    as `unpack`."""
    out = []
    seg = batch.span_cu_seqlens.long()
    spans = pack.pair_spans(batch.span_cu_seqlens_padded, batch.input_ids.shape[1])
    for i, (a, c0, r0, _) in enumerate(spans):
        k = int(seg[3 * i + 1] - seg[3 * i])
        for start, n in ((c0, int(seg[3 * i + 2] - seg[3 * i + 1])), (r0, int(seg[3 * i + 3] - seg[3 * i + 2]))):
            d = {f: torch.cat([getattr(batch, f)[0, a:a + k], getattr(batch, f)[0, start:start + n]])
                 for f in TOKEN_FIELDS}
            seq_mask = torch.zeros(k + n, dtype=torch.bool)
            seq_mask[1:] = d["loss_mask"][:-1]
            d["seq_loss_mask"] = seq_mask
            out.append(d)
    return out


def cp_gather(slices: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of the CP slicing: slices[r] = x.index_select(dim, cp_partition_index(.., r)) back to x."""
    cp_size = len(slices)
    index = torch.cat([pack.cp_partition_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    cat = torch.cat(list(slices), dim=dim)
    out = torch.empty_like(cat)
    out.index_copy_(dim, index.to(cat.device), cat)
    return out


def packing_efficiency(plan: pack.BinPlan) -> float:
    """Real tokens of real pairs / padded tokens of all bins (dummies included)."""
    total = sum(b.tokens for r in plan.ranks for b in r)
    useful = sum(b.useful for r in plan.ranks for b in r)
    return useful / total if total else 1.0
