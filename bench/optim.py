"""Item 8, optimizer: the precision-aware optimizer (precision_adam.py). Its state bytes per trained parameter read
from the optimizer's own state tensors (the tiny bf16 policy in megatron-core's distributed optimizer, each setting);
its step time against torch's AdamW on the same shard (CPU, one run); and the update's error against a float64 Adam
after 1, 10 and 100 steps on the tiny model's real gradients (fp32 or bf16 moments, fp32 or bf16 gradient buffers)."""

from __future__ import annotations

import time

import torch

import pack
from bench.common import ROOT, TINY, interleaved_times, sample_pairs
from bench.grads import _grad_policy

SETTINGS = {  # name: [optimizer] overrides of a bf16 run
    "fp32 master (megatron-core's path)": [],
    "remainders, fp32 moments": ["optimizer.use_precision_aware_optimizer=true"],
    "remainders, bf16 moments": ["optimizer.use_precision_aware_optimizer=true", "optimizer.exp_avg_dtype=bf16",
                                 "optimizer.exp_avg_sq_dtype=bf16"],
}  # fmt: skip
STEP_NUMEL = 1 << 24  # the timed shard: 16M parameters
STEP_NUMEL_QUICK = 1 << 20
ERROR_STEPS = (1, 10, 100)
ERROR_STEPS_QUICK = (1, 10)
PAIRS, PAIRS_PER_STEP = 16, 8  # distinct pair gradients; each step sums PAIRS_PER_STEP of them (a rotation)
PAIRS_QUICK, PAIRS_PER_STEP_QUICK = 4, 2
NANO_ADAM = dict(lr=8e-7, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)  # configs/nano.toml, constant lr


def _cfg(*overrides: str):
    import config as config_mod

    return config_mod.load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"model.hf_path={TINY}", "model.params_dtype=bfloat16", "packing.shared_prompt=false", *overrides])  # fmt: skip


def state_bytes() -> dict:
    """Per SETTINGS entry: bytes per trained parameter the optimizer holds beside the model's bf16 weights, summed
    over its state tensors and the fp32 parameters it owns (megatron-core's fp32 masters), after one step."""
    import checkpoint
    import distributed
    import hf_weights
    import omni_model as om
    import train

    distributed.init_distributed(device=torch.device("cpu"))
    out = {}
    for name, overrides in SETTINGS.items():
        cfg = _cfg(*overrides)
        policy = om.build_model(cfg.model.hf_path, cfg.model, cfg.parallel)
        hf_weights.load_hf_weights(policy, cfg.model.hf_path)
        ddp, opt, _ = train.build_optimizer(policy, cfg)
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        for o in checkpoint._inner_optimizers(opt):
            o._init_optimizer_states_with_dummy_values()  # a step with zero gradients: the state exists
        weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        held, seen = 0, set()
        for o in checkpoint._inner_optimizers(opt):
            tensors = [p for g in o.optimizer.param_groups for p in g["params"]]
            tensors += [v for st in o.optimizer.state.values() for k, v in st.items() if k != "step"]
            for t in tensors:
                if t.untyped_storage().data_ptr() not in weights and id(t) not in seen:
                    seen.add(id(t))
                    held += t.numel() * t.element_size()
        out[name] = {"bytes_per_param": held / trained, "optimizer": type(opt.optimizer).__name__}
    return out


def step_time(numel: int, device: str = "cpu") -> dict:
    """One AdamW step over a flat shard of `numel` parameters on `device`, ours (bf16 weight + int16 remainder, fp32
    moments and bf16 moments, the gradient read from an fp32 buffer) against torch.optim.AdamW on the fp32 master
    (megatron-core's path without TE); minimum of 5 interleaved rounds, with torch's intra-op threads as set
    ("seconds", "ratio") and, on the CPU, with one ("one_thread": on shared cores each parallel op waits for its
    slowest thread, and ours runs 15 elementwise ops to torch's 8, so contention from other processes inflates the
    first ratio)."""
    from backend import precision_adam

    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(numel, generator=gen) * 0.02).to(device)
    grad = torch.randn(numel, generator=gen).to(device)
    ref = torch.nn.Parameter(master.clone())
    ref.grad = grad
    torch_opt = torch.optim.AdamW([ref], **NANO_ADAM)
    ours = {}
    for name, dtype in (("fp32 moments", torch.float32), ("bf16 moments", torch.bfloat16)):
        p = master.bfloat16()
        p.decoupled_grad = grad
        ours[name] = precision_adam.PrecisionAwareAdam([p], **NANO_ADAM, master_weights=True, use_decoupled_grad=True,
                                                       store_param_remainders=True, exp_avg_dtype=dtype,
                                                       exp_avg_sq_dtype=dtype)  # fmt: skip
    fns = {"torch AdamW (fp32 master)": torch_opt.step, **{f"ours, {k}": o.step for k, o in ours.items()}}
    out: dict = {"numel": numel, "device": device, "threads": torch.get_num_threads()}
    threads = out["threads"]
    for key, n in ((None, threads), ("one_thread", 1))[: 2 if device == "cpu" else 1]:
        torch.set_num_threads(n)
        try:
            times = interleaved_times(fns, reps=5)
        finally:
            torch.set_num_threads(threads)
        base = times["torch AdamW (fp32 master)"]["min"]
        res = {"seconds": {k: v["min"] for k, v in times.items()},
               "ratio": {k: v["min"] / base for k, v in times.items() if k.startswith("ours")}}
        if key is None:
            out.update(res)
        else:
            out[key] = res
    return out


def _pair_gradients(cfg, n_pairs: int, per_step: int) -> list[torch.Tensor]:
    """The policy's bf16 weights and `n_pairs` bf16 gradients of the MPO loss at step 1 (policy = reference, δ = 0,
    denominator `per_step`), one pair each, as train's backward leaves them; all flat."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    import distributed
    import reference_logprobs
    import train

    ctx = distributed.Ctx.current(cfg, torch.device("cpu"))
    pairs, ids = sample_pairs(TINY, n_pairs)
    policy, _ = _grad_policy(cfg, None)
    reference, _ = _grad_policy(cfg, None)
    reference.eval().requires_grad_(False)
    params = [p for p in policy.parameters() if p.requires_grad]
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((), 1.0 / per_step))
    grads = []
    for pair in (pairs[i] for i in range(n_pairs)):
        batch = pack.pack([pair], cfg.packing.make_sequence_length_divisible_by, ids["image"], ids["pad"])
        ref = reference_logprobs.sums(reference, [batch], ctx)
        train.policy_forward_backward([batch], ref, policy, ctx, 0.0, per_step, backward=True)
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]))
        for p in params:
            p.grad = None
    return [torch.cat([p.detach().reshape(-1) for p in params]), *grads]


def update_errors(steps: tuple[int, ...], n_pairs: int = PAIRS, per_step: int = PAIRS_PER_STEP) -> dict:
    """The update master_n - master_0 after n in `steps` steps of each variant against torch's Adam arithmetic in
    float64 on the float64 gradient sums (the same formula and constants, NANO_ADAM): relative L2 and max-abs errors,
    and the fraction of bf16 weights unlike the float64 master's round to nearest. Step t sums the pair gradients
    t, t+1, ..., t+per_step-1 (mod n_pairs) in the buffer's dtype (fp32 or bf16, as megatron DDP adds them) or in
    float64; the weights the gradients were taken at do not move (the optimizer's arithmetic alone)."""
    from torch.optim.adam import adam as torch_adam

    import distributed
    from backend import precision_adam

    distributed.init_distributed(device=torch.device("cpu"))
    cfg = _cfg()
    distributed.seed_everything(cfg.mpo.seed)
    weights, *grads = _pair_gradients(cfg, n_pairs, per_step)
    variants = {"fp32 moments, fp32 buffers": (torch.float32, torch.float32),
                "bf16 moments, fp32 buffers": (torch.bfloat16, torch.float32),
                "fp32 moments, bf16 buffers": (torch.float32, torch.bfloat16),
                "bf16 moments, bf16 buffers": (torch.bfloat16, torch.bfloat16)}  # fmt: skip
    opts, params = {}, {}
    for name, (moments, _) in variants.items():
        params[name] = weights.clone()
        opts[name] = precision_adam.PrecisionAwareAdam([params[name]], **NANO_ADAM, master_weights=True,
                                                       use_decoupled_grad=True, store_param_remainders=True,
                                                       exp_avg_dtype=moments, exp_avg_sq_dtype=moments)  # fmt: skip
    exact = weights.double()
    m64, v64, step64 = torch.zeros_like(exact), torch.zeros_like(exact), torch.tensor(0.0, dtype=torch.float64)
    out: dict = {}
    for t in range(max(steps)):
        chosen = [grads[(t + k) % n_pairs] for k in range(per_step)]
        sums = {d: torch.zeros_like(weights, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float64)}
        for g in chosen:
            for s in sums.values():
                s.add_(g)
        torch_adam([exact], [sums[torch.float64]], [m64], [v64], [], [step64], foreach=False,
                   decoupled_weight_decay=True, amsgrad=False, beta1=NANO_ADAM["betas"][0],
                   beta2=NANO_ADAM["betas"][1], lr=NANO_ADAM["lr"], weight_decay=NANO_ADAM["weight_decay"],
                   eps=NANO_ADAM["eps"], maximize=False)  # fmt: skip
        for name, (_, buffers) in variants.items():
            params[name].decoupled_grad = sums[buffers]
            opts[name].step()
        if t + 1 in steps:
            want = exact - weights.double()
            row = {}
            for name, o in opts.items():
                err = (o.master(params[name]).double() - weights.double()) - want
                row[name] = {"rel_l2": float(err.norm() / want.norm()), "rel_max": float(err.abs().max() /
                                                                                          want.abs().max()),
                             "weights_off": float((params[name] != exact.float().bfloat16()).double().mean())}
            out[str(t + 1)] = row
    return {"steps": list(steps), "params": weights.numel(), "pairs": n_pairs, "pairs_per_step": per_step,
            "adam": {k: list(v) if isinstance(v, tuple) else v for k, v in NANO_ADAM.items()}, "errors": out}


def bench_optimizer(quick: bool) -> dict:
    """state_bytes, step_time (on the CPU, and with CUDA on the GPU) and update_errors (--quick: a 1M shard, 1 and 10
    steps of 2 of 4 pairs)."""
    t = time.perf_counter()
    quick_errors = (ERROR_STEPS_QUICK, PAIRS_QUICK, PAIRS_PER_STEP_QUICK)
    errors = update_errors(*quick_errors) if quick else update_errors(ERROR_STEPS)
    numel = STEP_NUMEL_QUICK if quick else STEP_NUMEL
    res = {"state": state_bytes(), "step": step_time(numel), "errors": errors}
    if torch.cuda.is_available():  # the step on the GPU as well (the pip path there, where TE is absent)
        res["step_cuda"] = step_time(numel, "cuda")
    res["seconds"] = time.perf_counter() - t
    return res
