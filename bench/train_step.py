"""Item 4, train: one MPO optimizer step on the shipped sample with the small Omni config (common.SMALL_LLM: hidden
256, 8 layers M*EM-M*E, ViT 2 blocks): ours (train.train_step: packed THD microbatches, reference forward without
grad, vision once per pair, megatron DDP + Adam) vs transformers' NemotronH_Omni_Reasoning_V3 with the same weights
doing the conventional step (baseline.py: each pair a padded [2, L] batch, the image once per sequence, policy and
reference forwards, log_softmax+gather, torch Adam). Same step-1 loss to 1e-4 and gradient norm to 1e-4 relative
(asserted); pairs/s, tokens/s and the speed ratio. Also, interleaved with them on the same bins: our step with the
reference's sums stored (reference.logprobs = "precomputed": no reference forward; the stored sums equal the forward's,
asserted) and the reference pass alone (reference_logprobs.score)."""

from __future__ import annotations

import copy

import torch

import pack
from bench.baseline import _conventional_mpo_loss, _padded_pair, _row_logprobs, _torch_adam
from bench.common import (
    _bench_cfg,
    _build_ours,
    _device,
    _tmp,
    interleaved_times,
    no_progress_bars,
    sample_pairs,
    small_checkpoint,
)

LOSS_TOL = 1e-4  # step-1 loss of ours vs the transformers baseline


STORED_REFERENCE_GOAL = 1.25  # the step with stored reference sums, pairs/s over the online step (CPU)


def bench_train(quick: bool) -> dict:
    """One optimizer step, ours vs the transformers baseline: step-1 loss and gradient norm equal, pairs/s, tokens/s."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import distributed
    import reference_logprobs
    import train

    distributed.init_distributed(device=_device())
    n_pairs, timed = (6, 2) if quick else (16, 5)
    pol_dir, ref_dir = small_checkpoint("policy", seed=1234), small_checkpoint("reference", seed=4321)
    pairs, ids = sample_pairs(pol_dir, n_pairs)
    cfg = _bench_cfg(pol_dir, n_pairs)
    tokens = sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in pairs.values())
    o = cfg.optimizer

    # -- ours: train.train_step as train.main sets it up (one rank) --------------------------------------------------
    policy, reference = _build_ours(pol_dir), _build_ours(ref_dir)
    reference.eval().requires_grad_(False)
    ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)  # fp32, distributed Adam: the config's defaults
    ctx = distributed.Ctx.current(cfg, _device())
    ddp.train()
    lengths = {i: (p.chosen_ids.numel(), p.rejected_ids.numel()) for i, p in pairs.items()}
    state = {"shift": cfg.mpo.reward_shift}

    cfg_packed = copy.deepcopy(cfg)
    cfg_packed.packing.max_sequences_per_bin = 8  # up to 8 pairs (16 sequences) in one THD microbatch

    def bins(plan_cfg=cfg) -> list[pack.PackedBatch]:
        return pack.load_bins(pack.plan_step(lengths, plan_cfg.packing, 1), pairs, ctx, ids["image"], ids["pad"])

    def ours_step(plan_cfg=cfg, ref=reference) -> dict:
        batches = bins(plan_cfg)
        m, state["shift"] = train.train_step(ddp, ref, optimizer, scheduler, batches, ctx, state["shift"])
        m["microbatches"] = len(batches)
        return m

    # reference.logprobs = "precomputed": the reference pass's values of these pairs, then the step that reads them
    stored = reference_logprobs.Stored.from_scores(_tmp(), max(pairs) + 1,
                                                   reference_logprobs.score(reference, bins(), ctx))
    assert all(torch.equal(a, b) for a, b in zip(reference_logprobs.sums(stored, bins(), ctx),
                                                 reference_logprobs.sums(reference, bins(), ctx), strict=True))

    # -- baseline: transformers, conventional padded per-pair step ---------------------------------------------------
    with no_progress_bars():
        hf_pol = NemotronH_Omni_Reasoning_V3.from_pretrained(pol_dir, dtype=torch.float32).to(ctx.device).train()
        hf_ref = NemotronH_Omni_Reasoning_V3.from_pretrained(ref_dir, dtype=torch.float32).to(ctx.device).eval()
    hf_ref.requires_grad_(False)
    params = [p for p in hf_pol.parameters() if p.requires_grad]
    hf_opt = _torch_adam(params, o)

    def base_step() -> dict:
        hf_opt.zero_grad(set_to_none=True)
        total = 0.0
        for p in pairs.values():
            input_ids, attn, resp = _padded_pair(p, ids["pad"], ctx.device)
            kw = dict(input_ids=input_ids, attention_mask=attn, pixel_values=torch.cat([p.pixel_values] * 2),
                      image_grid_hw=torch.cat([p.image_grid_hw] * 2))  # the image encoded once per sequence
            kw.update(pixel_values=kw["pixel_values"].to(ctx.device), image_grid_hw=kw["image_grid_hw"].to(ctx.device))
            with torch.no_grad():
                ref, _ = _row_logprobs(hf_ref(**kw).logits, input_ids, resp)
            pol, n_tok = _row_logprobs(hf_pol(**kw).logits, input_ids, resp)
            loss = _conventional_mpo_loss(pol, ref, n_tok, cfg.mpo) / len(pairs)
            loss.backward()
            total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        hf_opt.step()
        return {"loss": total, "grad_norm": float(grad_norm)}

    m_ours, m_base = ours_step(), base_step()  # step 1: the equality check (and warm-up)
    loss_diff = abs(m_ours["loss"] - m_base["loss"])
    assert loss_diff <= LOSS_TOL, f"train: step-1 loss ours {m_ours['loss']} vs baseline {m_base['loss']}"
    gn_rel = abs(m_ours["grad_norm"] - m_base["grad_norm"]) / max(m_base["grad_norm"], 1e-12)
    assert gn_rel <= LOSS_TOL, f"train: step-1 grad norm ours {m_ours['grad_norm']} vs baseline {m_base['grad_norm']}"
    t = interleaved_times({"ours": ours_step, "ours_8_per_bin": lambda: ours_step(cfg_packed),
                           "baseline": base_step, "ours_stored_reference": lambda: ours_step(ref=stored),
                           "reference_pass": lambda: reference_logprobs.score(reference, bins(), ctx)}, timed)
    t_ours, t_base, t_packed = t["ours"]["min"], t["baseline"]["min"], t["ours_8_per_bin"]["min"]
    t_stored, t_pass = t["ours_stored_reference"]["min"], t["reference_pass"]["min"]
    return {"pairs": n_pairs, "tokens": tokens, "microbatches_ours": m_ours["microbatches"],
            "microbatches_baseline": n_pairs, "loss_ours": m_ours["loss"], "loss_baseline": m_base["loss"],
            "loss_abs_diff": loss_diff, "grad_norm_ours": m_ours["grad_norm"],
            "grad_norm_baseline": m_base["grad_norm"],
            "grad_norm_rel_diff": gn_rel, "step_s_ours": t_ours, "step_s_baseline": t_base,
            "pairs_per_s_ours": n_pairs / t_ours, "pairs_per_s_baseline": n_pairs / t_base,
            "tokens_per_s_ours": tokens / t_ours, "tokens_per_s_baseline": tokens / t_base,
            "speed_ratio": t_base / t_ours, "step_s_ours_8_per_bin": t_packed,
            "microbatches_ours_8_per_bin": len(pack.plan_step(lengths, cfg_packed.packing, 1).ranks[0]),
            "speed_ratio_8_per_bin": t_base / t_packed, "step_s_stored_reference": t_stored,
            "pairs_per_s_stored_reference": n_pairs / t_stored, "stored_reference_speed_ratio": t_ours / t_stored,
            "stored_reference_goal": STORED_REFERENCE_GOAL, "pass_s": t_pass, "pairs_per_s_reference_pass":
            n_pairs / t_pass, "pass_over_step_speed_ratio": t_ours / t_pass, "timed_steps": timed,
            "step_s_median": t}
