"""Item 7, grads: optimizer.grad_reduce_in_fp32. The tiny model's bf16 gradient at step 1 summed over 1, 16 and 256
microbatches (--quick: 1, 4, 8) in bf16 and fp32 buffers against their float64 sum (grad_accumulation); megatron
DDP's buffers equal the measured sums (asserted)."""

from __future__ import annotations

import time

import torch

import pack
from bench.common import ROOT, TINY, sample_pairs

GRAD_COUNTS = (1, 16, 256)  # microbatches accumulated; 256: configs/nano.toml's pairs per step, one pair per bin
GRAD_COUNTS_QUICK = (1, 4, 8)
GRAD_PAIRS = 32  # distinct sample pairs, cycled through the microbatches
GRAD_DDP_CHECKED = 4  # microbatches also accumulated by megatron DDP of each setting, compared bit for bit


def _grad_policy(cfg, fp32: bool | None):
    """The tiny policy with its HF weights, bare (None) or in megatron DDP with fp32 (True) or params-dtype (False)
    gradient buffers, as train.build_optimizer makes it. Returns (the module a step calls, its DDP or None)."""
    import dataclasses

    import hf_weights
    import omni_model as om
    import train

    policy = om.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(policy, cfg.model.hf_path)
    if fp32 is None:
        return policy, None
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, grad_reduce_in_fp32=fp32))
    ddp = train.build_optimizer(policy, cfg)[0]
    ddp.train()
    return ddp, ddp


def grad_errors(acc: torch.Tensor, exact: torch.Tensor, abs_sum: torch.Tensor, n: int) -> dict:
    """Errors of a gradient accumulated in `acc`'s dtype against `exact` (the float64 sum of the same n microbatch
    gradients; all flat): rel_l2, rel_max, rel_median and bound_use (at most 1 by arithmetic)."""
    # rel_l2 = ||acc - exact|| / ||exact||, rel_max = max |acc - exact| / max |exact|, rel_median = the median of |acc -
    # exact| / |exact| over nonzero elements, and bound_use = max |acc - exact| / (γ_{n-1} Σ|g_i|) per element:
    # recursive summation's bound (Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4) with γ_k = k·u / (1
    # - k·u), u the buffer's unit roundoff (+ 2^-24 for bf16: torch adds bf16 in fp32, then rounds).
    u = torch.finfo(acc.dtype).eps / 2 + (2.0**-24 if acc.dtype == torch.bfloat16 else 0.0)
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    err = (acc.double() - exact).abs()
    nonzero = exact != 0
    use = torch.where(err == 0, 0.0, err / (gamma * abs_sum))  # inf where the bound is 0 and the error is not
    return {"rel_l2": float(err.norm() / exact.norm()), "rel_max": float(err.max() / exact.abs().max()),
            "rel_median": float((err[nonzero] / exact[nonzero].abs()).median()), "bound_use": float(use.max())}


def grad_accumulation(counts: tuple[int, ...] = GRAD_COUNTS) -> dict:
    """The step's gradient after each of `counts` microbatches, accumulated in bf16 and in fp32 buffers, against the
    float64 sum of the same microbatch gradients. Returns per count grad_errors' dict per buffer dtype and
    `sampling_noise`; and the seconds per microbatch."""
    # configs/tiny.toml in bf16 (one pair per bin; the sample's first GRAD_PAIRS pairs, images included, cycled), the
    # MPO loss at step 1 (policy = reference, δ = 0) with the denominator max(counts), so the first n microbatches are
    # the first n of one step (a power-of-two denominator scales every gradient exactly). Each microbatch's bf16
    # gradient (train.policy_forward_backward on the bare policy) is added as megatron DDP adds it
    # (`main_grad.add_(grad)`) to a bf16, an fp32 and a float64 sum; the first GRAD_DDP_CHECKED also run through
    # megatron DDP with each setting, whose buffers must equal the bf16 and fp32 sums bit for bit (asserted).
    # sampling_noise = ||even - odd|| / ||sum||, the float64 sums of the even and the odd microbatches (for independent
    # microbatches, E||even - odd||² = E||sum - E sum||²: the relative sampling noise of the step's gradient, of min(n,
    # GRAD_PAIRS) distinct pairs).
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import config as config_mod
    import distributed
    import reference_logprobs
    import train

    device, n_max = torch.device("cpu"), max(counts)
    distributed.init_distributed(device=device)
    cfg = config_mod.load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"model.hf_path={TINY}", "model.params_dtype=bfloat16", "packing.shared_prompt=false"])  # fmt: skip
    distributed.seed_everything(cfg.mpo.seed)
    ctx = distributed.Ctx.current(cfg, device)
    pairs, ids = sample_pairs(TINY, GRAD_PAIRS)
    policy, _ = _grad_policy(cfg, None)
    reference, _ = _grad_policy(cfg, None)
    reference.eval().requires_grad_(False)
    ddps = {fp32: _grad_policy(cfg, fp32) for fp32 in (True, False)}
    params = [p for p in policy.parameters() if p.requires_grad]
    acc = {d: [torch.zeros_like(p, dtype=d) for p in params] for d in (torch.bfloat16, torch.float32, torch.float64)}
    abs_sum = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    halves = [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(2)]  # even, odd microbatches
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 1.0 / n_max))  # train_step's scale for n_max microbatches
    refs, out, t = {}, {}, time.perf_counter()
    for i in range(n_max):
        pair = pairs[i % GRAD_PAIRS]
        batch = pack.pack([pair], cfg.packing.make_sequence_length_divisible_by, ids["image"], ids["pad"]).to(device)
        if i % GRAD_PAIRS not in refs:
            refs[i % GRAD_PAIRS] = reference_logprobs.sums(reference, [batch], ctx)
        models = [policy] + [m for m, _ in ddps.values()] * (i < GRAD_DDP_CHECKED)
        for model in models:
            train.policy_forward_backward([batch], refs[i % GRAD_PAIRS], model, ctx, 0.0, n_max, backward=True)
        for k, p in enumerate(params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            for a in acc.values():
                a[k].add_(g)
            abs_sum[k].add_(g.abs())
            halves[i % 2][k].add_(g)
            p.grad = None
        if i + 1 == GRAD_DDP_CHECKED:
            for fp32, (_, ddp) in ddps.items():
                sums = acc[torch.float32 if fp32 else torch.bfloat16]
                main = [p.main_grad for p in ddp.module.parameters() if p.requires_grad]
                assert all(torch.equal(a, m) for a, m in zip(sums, main, strict=True)), \
                    f"grads: megatron DDP's {'fp32' if fp32 else 'bf16'} buffer differs from the same accumulation"
        if i + 1 in counts:
            flat = {d: torch.cat([x.reshape(-1) for x in a]) for d, a in acc.items()}
            total = torch.cat([x.reshape(-1) for x in abs_sum])
            even, odd = (torch.cat([x.reshape(-1) for x in h]) for h in halves)
            out[i + 1] = {"bf16": grad_errors(flat[torch.bfloat16], flat[torch.float64], total, i + 1),
                          "fp32": grad_errors(flat[torch.float32], flat[torch.float64], total, i + 1),
                          "sampling_noise": float((even - odd).norm() / flat[torch.float64].norm())}
    return {"counts": list(counts), "pairs": GRAD_PAIRS, "params": sum(p.numel() for p in params),
            "s_per_microbatch": (time.perf_counter() - t) / (n_max + 2 * min(GRAD_DDP_CHECKED, n_max)),
            "errors": {str(n): out[n] for n in counts}}


def bench_grads(quick: bool) -> dict:
    """grad_accumulation at GRAD_COUNTS (--quick: GRAD_COUNTS_QUICK)."""
    return grad_accumulation(GRAD_COUNTS_QUICK if quick else GRAD_COUNTS)
