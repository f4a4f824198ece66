"""The GPU item's MPO step (mpo_step_bench): one optimizer step of our system (train.train_step, separate sequences and
the shared-prompt format) against transformers' padded per-pair step on the same text pairs, with the step-1 losses
against their closed form next to the noise floor measured in the same run; and the set-up the profile and the kernel
ablation share (_step_setup, _ours_system, _drop_system). Runs on the CPU at a small shape too (tests)."""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

import pack
from bench.baseline import _conventional_mpo_loss, _padded_pair, _row_logprobs, _torch_adam
from bench.common import (
    ROOT,
    TINY,
    _held_memory,
    _mib,
    _peak_memory,
    _release,
    _reset_peak,
    _sync,
    _tmp,
)
from bench.workload import pair_lengths, shared_lengths, text_pairs


def _shape_checkpoint(shape: dict) -> Path:
    """A folder with the tiny asset's config.json widened by shape["llm"] (no weights: both models init randomly)."""
    out = _tmp() / f"gpu_shape_{len(list(_tmp().iterdir()))}"
    out.mkdir()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["llm_config"].update(shape["llm"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _ours_system(device, cfg, ckpt):
    """Our system as train.main sets it up (one rank): policy in megatron DDP with its optimizer and scheduler, and the
    frozen reference with the policy's weights. Returns (ddp, reference, optimizer, scheduler, ctx, policy)."""
    import distributed
    import omni_model as om
    import train

    distributed.seed_everything(cfg.mpo.seed)
    policy = om.build_model(ckpt, cfg.model, cfg.parallel)
    reference = om.build_model(ckpt, cfg.model, cfg.parallel)
    reference.load_state_dict(policy.state_dict())
    reference.eval().requires_grad_(False)
    ddp, optimizer, scheduler = train.build_optimizer(policy, cfg)
    ddp.train()
    return ddp, reference, optimizer, scheduler, distributed.Ctx.current(cfg, device), policy


def _drop_system(ddp) -> None:
    """Let a finished system be freed: break the cycle megatron-core leaves between the MoE routers and DDP."""
    # megatron-core's MoE token dispatchers keep their last forward's routing probabilities, whose autograd graph
    # reaches each router weight's AccumulateGrad node; megatron's DDP keeps every such node (`grad_accs`) and hooks
    # each one with a closure over the DDP. The cycle runs through autograd's C++ nodes, out of sight of Python's
    # garbage collector: the policy, its gradient buffers and the optimizer outlived their section (the next GPU section
    # ran out of memory).
    ddp.grad_accs.clear()
    for module in ddp.modules():
        if (dispatcher := getattr(module, "token_dispatcher", None)) is not None:
            for name, value in list(vars(dispatcher).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(dispatcher, name, None)


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max |a - b| over lists of per-sequence log-prob sums (one [S] tensor per microbatch)."""
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True))


def _check_closed_form(what: str, loss: float, want: float, tol: float | None) -> float:
    """|loss - want|; raises AssertionError naming `what` when `tol` is given (the CPU) and the deviation exceeds it."""
    dev = abs(loss - want)
    assert tol is None or dev <= tol, f"gpu step: {what} step-1 loss {loss} != {want} (tolerance {tol})"
    return dev


def _ours_step_bench(device, setup: dict, tol: float | None, timed, timed_steps) -> dict:
    """mpo_step_bench's system under test: train.train_step as train.main sets it up (one rank), with separate sequences
    (the default) and with the shared-prompt format; and the noise floor of its step-1 loss: the reference forward
    twice on the same bins and the policy (before any update, no grad) against the reference, as the max |difference|
    of the per-sequence log-prob sums."""
    ddp, reference, optimizer, scheduler, ctx, policy = _ours_system(device, setup["cfg"], setup["ckpt"])
    try:
        return _ours_steps(device, setup, tol, timed, timed_steps, ddp, reference, optimizer, scheduler, ctx, policy)
    finally:
        _drop_system(ddp)


def _ours_steps(device, setup, tol, timed, timed_steps, ddp, reference, optimizer, scheduler, ctx, policy) -> dict:
    """_ours_step_bench's measurements on the built system."""
    import dataclasses

    import monitor
    import mpo_loss
    import reference_logprobs
    import train

    cfg, pairs, ids, want = setup["cfg"], setup["pairs"], setup["ids"], setup["want"]
    n_active = monitor.active_params(policy, setup["hf"])
    plan = pack.plan_step(setup["lengths"], cfg.packing, 1)
    state = {"shift": cfg.mpo.reward_shift}

    def step_of(plan, ctx):
        """One timed MPO step of `plan`'s bins under `ctx` (its pair format), δ carried across steps."""
        def step() -> dict:
            batches = pack.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
            metrics, state["shift"] = train.train_step(ddp, reference, optimizer, scheduler, batches, ctx,
                                                       state["shift"])
            return metrics
        return step

    ours_step = step_of(plan, ctx)

    # The noise floor, before any update (policy = reference): a no-grad policy forward leaves the routers' expert-bias
    # counts alone, as the reference's does.
    batches = pack.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
    ref_a = reference_logprobs.sums(reference, batches, ctx)
    ref_b = reference_logprobs.sums(reference, batches, ctx)
    with torch.no_grad():
        pol = [mpo_loss.forward_logprobs(ddp, b, ctx)[0] for b in batches]
    noise = dict(noise_ref_repeat_max_abs_diff=_max_abs_diff(ref_a, ref_b),
                 noise_policy_vs_ref_max_abs_diff=_max_abs_diff(pol, ref_a),
                 logprob_sum_max_abs=max(float(r.abs().max()) for r in ref_a))
    del batches, ref_a, ref_b, pol

    # The shared-prompt format (packing.shared_prompt) on the same pairs and bin budget, its step-1 loss computed before
    # any update (policy = reference: the closed-form loss), timed after the separate-sequences steps.
    cfg_shared = copy.deepcopy(cfg)
    cfg_shared.packing.shared_prompt = True
    ctx_shared = dataclasses.replace(ctx, cfg=cfg_shared)
    plan_shared = pack.plan_step(setup["lengths"], cfg_shared.packing, 1, shared_lengths(pairs))
    batches = pack.load_bins(plan_shared, pairs, ctx_shared, ids["image"], ids["pad"])
    n = mpo_loss.count_global_pairs(batches, ctx_shared)
    loss_shared = train.policy_forward_backward(batches, reference_logprobs.sums(reference, batches, ctx_shared),
                                                ddp, ctx_shared, state["shift"], n, backward=False)[0]["loss"]
    dev_shared = _check_closed_form("shared-prompt", loss_shared, want, tol)
    tokens_shared = sum(int(b.cu_seqlens[-1]) for b in batches)
    del batches
    shared_step = step_of(plan_shared, ctx_shared)

    _reset_peak(device)
    m1 = ours_step()
    dev_ours = _check_closed_form("ours", m1["loss"], want, tol)
    t_ours = timed_steps(ours_step, timed)
    peak, held = _peak_memory(device), _held_memory(device, "ours")
    _reset_peak(device)
    t_shared = timed_steps(shared_step, timed)
    return dict(loss_ours=m1["loss"], loss_ours_abs_dev=dev_ours, microbatches_ours=len(plan.ranks[0]),
                n_active=n_active, **noise, step_s_ours=min(t_ours), peak_bytes_ours=peak, **held,
                loss_shared=loss_shared,
                loss_shared_abs_dev=dev_shared, microbatches_shared=len(plan_shared.ranks[0]),
                tokens_shared=tokens_shared, step_s_shared=min(t_shared), peak_bytes_shared=_peak_memory(device))


def _baseline_step_bench(device, setup: dict, tol: float | None, timed, timed_steps) -> dict:
    """mpo_step_bench's baseline: transformers' model, one padded [2, L] batch per pair, torch Adam. Its noise floor:
    max |policy - reference| of the per-sequence log-prob sums at step 1."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    cfg, pairs, ids, want = setup["cfg"], setup["pairs"], setup["ids"], setup["want"]
    hcfg = NemotronH_Omni_Reasoning_V3_Config(**json.loads((setup["ckpt"] / "config.json").read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        hf_pol = NemotronH_Omni_Reasoning_V3(hcfg).to(setup["dtype"]).train()
    hf_ref = copy.deepcopy(hf_pol).eval().requires_grad_(False)
    params = [p for p in hf_pol.parameters() if p.requires_grad]
    o = cfg.optimizer
    hf_opt = _torch_adam(params, o)

    def base_step() -> dict:
        hf_opt.zero_grad(set_to_none=True)
        total, diff = 0.0, 0.0
        for p in pairs.values():
            input_ids, attn, resp = _padded_pair(p, ids["pad"], device)
            with torch.no_grad():
                ref, _ = _row_logprobs(hf_ref(input_ids=input_ids, attention_mask=attn).logits, input_ids, resp)
            pol, n_tok = _row_logprobs(hf_pol(input_ids=input_ids, attention_mask=attn).logits, input_ids, resp)
            loss = _conventional_mpo_loss(pol, ref, n_tok, cfg.mpo) / len(pairs)
            loss.backward()
            total += loss.item()
            diff = max(diff, float((pol.detach() - ref).abs().max()))
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        hf_opt.step()
        return {"loss": total, "policy_vs_ref": diff}

    _reset_peak(device)
    b1 = base_step()
    dev = _check_closed_form("baseline", b1["loss"], want, tol)
    t_base = timed_steps(base_step, timed)
    return dict(loss_baseline=b1["loss"], loss_baseline_abs_dev=dev,
                noise_baseline_policy_vs_ref_max_abs_diff=b1["policy_vs_ref"], loss_expected=want,
                step_s_baseline=min(t_base), peak_bytes_baseline=_peak_memory(device), timed_steps=timed)


def _step_setup(device: torch.device, shape: dict) -> dict:
    """What both systems of mpo_step_bench (and profile_step) share: the config (configs/tiny.toml at `shape`, separate
    sequences), the checkpoint folder of `shape`, its HF config, dtype, the text pairs, their sequence lengths, token
    ids and the closed-form step-1 loss `want` = w_p·ln 2 + w_q·2 ln 2 (policy = reference, δ = 0, no SFT term)."""
    import math

    import distributed
    import omni_model as om

    distributed.init_distributed(device=device)
    ckpt = _shape_checkpoint(shape)
    hf = om.read_hf_config(ckpt)
    cfg = step_config(ckpt, shape)
    m = cfg.mpo
    pairs = text_pairs(shape["pairs"], shape["prompt"], shape["response"], hf.text.vocab_size)
    return dict(cfg=cfg, ckpt=ckpt, hf=hf, dtype=getattr(torch, shape["dtype"]), pairs=pairs,
                lengths=pair_lengths(pairs),
                ids={"image": hf.image_token_id, "pad": 0},
                want=m.preference_loss_weight * math.log(2) + m.bco_loss_weight * 2 * math.log(2))


def step_config(ckpt, shape: dict):
    """The config of the GPU step (mpo_step_bench, profile_step; plan.py's calibration): configs/tiny.toml with the
    checkpoint folder `ckpt` of `shape`, its dtype, pairs and pairs per bin, separate sequences (shared timed apart)."""
    import config as config_mod

    return config_mod.load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"model.hf_path={ckpt}", f"model.params_dtype={shape['dtype']}",
        f"policy.train_global_batch_size={shape['pairs']}", f"packing.max_sequences_per_bin={shape['pairs_per_bin']}",
        "packing.max_tokens_per_bin=65536", "scheduler.lr_warmup_steps=0", "mpo.max_num_steps=100",
        "policy.logprob_chunk_size=1024", "packing.shared_prompt=false"])


def closed_form_tolerance(device: torch.device, shape: dict, want: float) -> float | None:
    """The tolerance of the step-1 loss against its closed form: (3 + pairs_per_bin) float32 ulps of the loss on the
    CPU, None on CUDA (not exact by construction)."""
    # On the CPU the policy and the reference compute bit-identical log-prob sums (same weights, deterministic kernels),
    # so every log-ratio is exactly 0 and only float32 rounding of the loss arithmetic remains: per pair a few roundings
    # (ln 2 from logsigmoid(0), the weights, the sum of the terms: 3 ulps) plus one per pair summed in a microbatch
    # (pairs_per_bin), eps·|want| bounding one ulp. On CUDA the kernels are not deterministic (atomic adds, e.g.
    # combining MoE outputs): the deviation is recorded next to the measured noise floor, never asserted.
    if device.type != "cpu":
        return None
    return (3 + shape["pairs_per_bin"]) * torch.finfo(torch.float32).eps * abs(want)


def mpo_step_bench(device, shape: dict, timed: int) -> dict:
    """One MPO optimizer step (policy fwd+bwd, frozen reference fwd, fused loss, distributed Adam: train.train_step) on
    `shape`'s text pairs packed `pairs_per_bin` pairs per THD microbatch, vs transformers' model doing the conventional
    step (each pair one padded [2, L] batch, log_softmax + gather, torch Adam), both on `device`.

    Both systems start with policy = reference (random weights, the same within a system), so the step-1 loss of
    both is w_p·ln 2 + w_q·2 ln 2 (configs/tiny.toml's loss weights, no SFT term). Recorded: each step-1 loss and its
    deviation from that closed form (`loss_*_abs_dev`), next to the noise floor measured in the same run
    (`noise_*`: max |difference| of per-sequence log-prob sums, reference forward twice on the same bins, and policy
    vs reference before any update; `logprob_sum_max_abs` for their scale). Asserted only on the CPU, where it is exact
    by construction (closed_form_tolerance, recorded as `loss_tolerance`; None on CUDA).
    Returns tokens/s, pairs/s, step seconds (min of `timed` steps after step 1), peak memory (CUDA), MFU
    (8·N_active·tokens / s / peak bf16 FLOP/s, monitor.mfu; N_active = monitor.active_params: the language model's
    parameters without the input embedding table (a lookup) - output layer, every dense parameter and the shared
    expert whole, plus top_k/n_routed of the routed experts; the vision tower is not counted), and the speed
    ratio; plus our step in the shared-prompt format (packing.shared_prompt, same pairs and bin budget; its loss
    before any update is the same closed form): its tokens, step seconds, pairs/s, peak memory and the speed ratio
    over our separate-sequences step (the shared-prompt format's GPU ratio).
    Raises AssertionError when a step-1 loss is off on the CPU.
    """
    import monitor

    device = torch.device(device)
    setup = _step_setup(device, shape)
    hf, pairs = setup["hf"], setup["pairs"]
    tol = closed_form_tolerance(device, shape, setup["want"])
    tokens = sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in pairs.values())
    out = {"device": str(device), "dtype": shape["dtype"], "pairs": shape["pairs"], "tokens": tokens,
           "pattern": hf.pattern, "hidden_size": hf.text.hidden_size, "vocab_size": hf.text.vocab_size,
           "loss_tolerance": tol, "loss_expected": setup["want"]}

    def timed_steps(step, n: int) -> list[float]:
        times = []
        for _ in range(n):
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t)
        return times

    out.update(_ours_step_bench(device, setup, tol, timed, timed_steps))
    print(f"[bench] gpu step ours {json.dumps(out)}", file=sys.stderr, flush=True)  # kept if the baseline times out
    _release(device)
    try:
        out.update(_baseline_step_bench(device, setup, tol, timed, timed_steps))
    except torch.cuda.OutOfMemoryError as e:  # transformers' padded step is not planned: recorded, ours stands
        out["baseline_error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    _release(device)
    s_o = out["step_s_ours"]
    out.update(tokens_per_s_ours=tokens / s_o, pairs_per_s_ours=len(pairs) / s_o,
               mfu_ours=monitor.mfu(tokens, s_o, out["n_active"], 1) if device.type == "cuda" else None,
               pairs_per_s_shared=len(pairs) / out["step_s_shared"], shared_speed_ratio=s_o / out["step_s_shared"])
    if "step_s_baseline" in out:
        s_b = out["step_s_baseline"]
        out.update(tokens_per_s_baseline=tokens / s_b, pairs_per_s_baseline=len(pairs) / s_b, speed_ratio=s_b / s_o,
                   mfu_baseline=monitor.mfu(tokens, s_b, out["n_active"], 1) if device.type == "cuda" else None)
    return out


def gpu_step_rows(st: dict) -> list[tuple[str, ...]]:
    """The table rows of mpo_step_bench's result: speed, memory, the shared-prompt ratio, the step-1 losses against
    their closed form and the noise floor measured beside them."""
    what = f"MPO step {st['pattern']} h{st['hidden_size']} {st['dtype']} vs transformers"
    mfu = f" (MFU {100 * st['mfu_ours']:.1f}%)" if st.get("mfu_ours") is not None else ""

    def base(key: str, fmt: str) -> str:  # transformers' number, or what stopped its step
        return format(st[key], fmt) if key in st else "out of memory" if "baseline_error" in st else ""

    peak = ("", "")  # CUDA only
    if st["peak_bytes_ours"]:
        peak = (_mib(st["peak_bytes_ours"]),
                _mib(st["peak_bytes_baseline"]) if "peak_bytes_baseline" in st else base("peak_bytes_baseline", ""))
    ratio = f"{st['speed_ratio']:.2f}x the speed" if "speed_ratio" in st else ""
    return [
        (what, f"tokens/s ({st['pairs']} pairs, {st['tokens']} tokens)", f"{st['tokens_per_s_ours']:.0f}{mfu}",
         base("tokens_per_s_baseline", ".0f"), ratio),
        (what, "pairs/s", f"{st['pairs_per_s_ours']:.2f}", base("pairs_per_s_baseline", ".2f"), ratio),
        (what, "peak memory", *peak, ""),
        ("shared prompt vs separate sequences (ours)", f"pairs/s ({st['tokens_shared']} vs {st['tokens']} tokens)",
         f"{st['pairs_per_s_shared']:.2f}", f"{st['pairs_per_s_ours']:.2f}",
         f"{st['shared_speed_ratio']:.2f}x the speed"),
        (what, "step-1 loss (policy = reference)", f"{st['loss_ours']:.6f}", base("loss_baseline", ".6f"),
         f"want {st['loss_expected']:.6f}"),
        (what, "step-1 loss: abs deviation from want (asserted on the CPU only)", f"{st['loss_ours_abs_dev']:.1e}",
         base("loss_baseline_abs_dev", ".1e"), f"shared prompt {st['loss_shared_abs_dev']:.1e}"),
        (what, "noise floor: max abs diff of log-prob sums, policy vs reference at step 1",
         f"{st['noise_policy_vs_ref_max_abs_diff']:.1e}", base("noise_baseline_policy_vs_ref_max_abs_diff", ".1e"),
         f"reference twice {st['noise_ref_repeat_max_abs_diff']:.1e} (sums up to {st['logprob_sum_max_abs']:.0f})"),
    ]
