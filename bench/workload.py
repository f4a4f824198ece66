"""The benchmark's synthetic inputs: MMPR-like lengths and text pairs, with their sequence and shared-prompt lengths."""

from __future__ import annotations

import math
import random

import torch

import pack


def synthetic_mmpr_parts(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int, int]]:
    """Pair id -> (prompt, chosen, rejected) tokens like Nemotron-Omni MMPR records, fixed by (n_pairs, seed)."""
    # Prompt = one image of gh x gw 16-px patches (gh in 32..128, gw in 32..104, even; gh*gw/4 tokens after the 2x2
    # pixel shuffle) + 40..72 text tokens; responses log-uniform in 50..1500, the rejected one the chosen length times
    # exp(N(0, 0.3)), clipped to 50..1500.
    rng = random.Random(seed)
    out = {}
    for i in range(n_pairs):
        gh, gw = 2 * rng.randint(16, 64), 2 * rng.randint(16, 52)
        prompt = gh * gw // 4 + rng.randint(40, 72)
        chosen = int(math.exp(rng.uniform(math.log(50), math.log(1500))))
        rejected = min(1500, max(50, int(chosen * math.exp(rng.gauss(0.0, 0.3)))))
        out[i] = (prompt, chosen, rejected)
    return out


def synthetic_mmpr_lengths(n_pairs: int, seed: int = 0) -> dict[int, tuple[int, int]]:
    """Pair id -> (chosen, rejected) sequence tokens: prompt + response of `synthetic_mmpr_parts`."""
    return {i: (p + c, p + r) for i, (p, c, r) in synthetic_mmpr_parts(n_pairs, seed).items()}


def mmpr_like_text_pairs(parts: dict, scale: int, vocab: int, seed: int = 0) -> dict:
    """Text pairs (pack.PreferencePair, random ids >= 32) with the lengths of `parts` (synthetic_mmpr_parts) divided by
    `scale` (at least 2 / 1 / 1 tokens)."""
    # The prompt's image tokens become text tokens: the language model's work is the same, and vision runs once per pair
    # in both formats.
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for i, (p, c, r) in parts.items():
        prompt = torch.randint(32, vocab, (max(2, p // scale),), generator=g)
        resp = [torch.randint(32, vocab, (max(1, n // scale),), generator=g) for n in (c, r)]
        resp[1][0] = 32 + (int(resp[0][0]) - 31) % (vocab - 32)  # the responses differ from their first token
        pairs[i] = text_pair(i, prompt, *resp)
    return pairs


def text_pair(pair_id: int, prompt: torch.Tensor, chosen: torch.Tensor,
              rejected: torch.Tensor) -> pack.PreferencePair:
    """A text-only pair: sequences [prompt | response] (int64 ids), loss masks on the responses, no image."""
    seqs = [torch.cat([prompt, x]) for x in (chosen, rejected)]
    masks = [torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(x.numel(), dtype=torch.bool)])
             for x in (chosen, rejected)]
    return pack.PreferencePair(pair_id=pair_id, chosen_ids=seqs[0], rejected_ids=seqs[1],
                               chosen_loss_mask=masks[0], rejected_loss_mask=masks[1],
                               pixel_values=torch.zeros(0, 3 * 16 * 16),
                               image_grid_hw=torch.zeros(0, 2, dtype=torch.int64),
                               image_token_counts=torch.zeros(0, dtype=torch.int64))


def shared_lengths(pairs: dict) -> dict[int, int]:
    """{pair id: tokens stored once in the shared-prompt format} by pack.prefix_length: plan_step's shared_lengths."""
    return {i: pack.prefix_length(p.chosen_ids, p.rejected_ids, p.chosen_loss_mask, p.rejected_loss_mask)
            for i, p in pairs.items()}


def text_pairs(n: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int, seed: int = 0) -> dict:
    """n text-only pairs: one U[prompt]-token prompt for both sequences, then each its U[response]-token response."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo_hi):
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (), generator=g))

    pairs = {}
    for i in range(n):
        p = torch.randint(32, vocab, (rint(prompt),), generator=g)
        responses = [torch.randint(32, vocab, (rint(response),), generator=g) for _ in range(2)]
        pairs[i] = text_pair(i, p, *responses)
    return pairs


def pair_lengths(pairs: dict) -> dict:
    """{pair id: (chosen, rejected) sequence tokens} of pack.PreferencePairs (pack.plan_step's lengths)."""
    return {i: (p.chosen_ids.numel(), p.rejected_ids.numel()) for i, p in pairs.items()}
