"""Item 2, vision: one pair through the Omni model with the image encoded once and shared by chosen and rejected
vs encoded once per sequence: vision tower + projector time per pair, whole forward+backward time; the logits and every
gradient must match (asserted)."""

from __future__ import annotations

import torch

import pack
from bench.common import VALUE_TOL, _build_ours, _device, interleaved_times, sample_pairs, small_checkpoint


def _per_row_media(batch: pack.PackedBatch) -> dict:
    """The same packed pair with each sequence holding its own copy of the images (the reference system's format)."""
    d = {k: getattr(batch, k) for k in ("input_ids", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")}
    s = batch.num_sequences
    n_img = batch.image_grid_hw.shape[0]
    dev = batch.input_ids.device
    d.update(pixel_values=torch.cat([batch.pixel_values] * s), image_grid_hw=torch.cat([batch.image_grid_hw] * s),
             image_token_counts=torch.cat([batch.image_token_counts] * s), media_index=torch.arange(s, device=dev),
             media_image_offsets=torch.arange(s + 1, device=dev) * n_img)
    return d


def bench_vision(quick: bool) -> dict:
    """Vision tower + projector cost per pair, shared vs per sequence, and the equality of logits and gradients."""
    import distributed

    distributed.init_distributed(device=_device())
    model_dir = small_checkpoint("policy", seed=1234)
    pairs, ids = sample_pairs(model_dir, 1)
    model = _build_ours(model_dir).train()
    shared = pack.pack([pairs[0]], 8, ids["image"], ids["pad"]).to(_device())
    per_row = _per_row_media(shared)

    def fwd_bwd(batch):
        model.zero_grad(set_to_none=True)
        logits = model(batch)
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(11)).to(logits.device)
        (logits * w).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    l1, g1 = fwd_bwd(shared)
    l2, g2 = fwd_bwd(per_row)
    logits_diff = (l1 - l2).abs().max().item()
    assert logits_diff <= VALUE_TOL, f"vision: shared vs per-sequence logits differ by {logits_diff}"
    assert set(g1) == set(g2) and any(n.startswith("vision_model.") for n in g1), "vision: gradient sets differ"
    grad_rel = max((g1[n] - g2[n]).abs().max().item() / max(g2[n].abs().max().item(), 1e-6) for n in g1)
    assert grad_rel <= VALUE_TOL, f"vision: shared vs per-sequence gradients differ by {grad_rel} (relative)"

    def encode(copies: int):
        model.zero_grad(set_to_none=True)
        feats = model.encode_images(torch.cat([shared.pixel_values] * copies),
                                    torch.cat([shared.image_grid_hw] * copies))
        torch.cat(feats).sum().backward()

    reps = 5 if quick else 15
    encode(1)  # warm-up
    t = interleaved_times({"once": lambda: encode(1), "twice": lambda: encode(2), "shared": lambda: fwd_bwd(shared),
                           "per_row": lambda: fwd_bwd(per_row)}, reps)
    t_once, t_twice, t_step_shared, t_step_per_row = (t[k]["min"] for k in ("once", "twice", "shared", "per_row"))
    return {"image_patches": int(shared.pixel_values.shape[0]), "image_tokens": int(shared.image_token_counts.sum()),
            "pair_tokens": int(shared.cu_seqlens[-1]), "logits_max_abs_diff": logits_diff,
            "grads_max_rel_diff": grad_rel, "vision_fwd_bwd_s_shared": t_once, "vision_fwd_bwd_s_per_row": t_twice,
            "vision_cost_ratio": t_twice / t_once, "pair_fwd_bwd_s_shared": t_step_shared,
            "pair_fwd_bwd_s_per_row": t_step_per_row, "pair_step_ratio": t_step_per_row / t_step_shared}
