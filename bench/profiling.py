"""The GPU item's "profile" section (--profile): torch.profiler over one MPO step of our system, its device time (CPU
time on the CPU) attributed to the regions of the step (Mamba projections, conv, scan, attention, MoE router,
dispatch, experts, LM head + fused log-probs, reference forward, optimizer, ...), backward work included."""

from __future__ import annotations

import contextlib
import functools

import torch

import pack
from backend import shared_prompt
from bench.common import _sync
from bench.gpu_step import _drop_system, _ours_system, _step_setup

# The regions of `profile_step`'s table, in its order. "Mamba other" is the mixer outside its projections, conv, scan
# and norm (gating, reshapes; a fused conv+scan kernel such as mamba-ssm's when it runs); "MoE other" the MoE layer
# outside its router, dispatcher, experts and shared expert; "other" what no region holds (loss, gradient reduction,
# bin loading, the step's host code on the CPU).
PROFILE_REGIONS = ("Mamba in/out projections", "Mamba conv", "Mamba scan", "Mamba norm", "Mamba other",
                   "attention (core)", "attention projections", "MoE router", "MoE dispatch (permute)",
                   "MoE expert GEMMs", "MoE combine (unpermute)", "MoE shared expert", "MoE other", "dense MLP",
                   "layer norms", "embedding", "LM head + fused log-probs", "reference forward", "optimizer step",
                   "gradient accumulation (DDP)", "other")
REGION_PREFIX = "omni_region::"  # the record_function ranges of profile_regions
STEP_RANGE = "omni_step"  # the record_function range around the profiled step
_BACKWARD_NODE = "autograd::engine::evaluate_function: "  # the autograd engine's range around one backward node


class _ItemAccess:
    """A dict's items as attributes (`profile_regions` wraps the entries of a dict of kernels like module functions)."""

    def __init__(self, d: dict):
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name):
        return self._d.get(name)

    def __setattr__(self, name, value):
        self._d[name] = value

    def __delattr__(self, name):
        del self._d[name]

    @property
    def __dict__(self):  # vars(): what `on_call` records to undo
        return self._d


@contextlib.contextmanager
def profile_regions(policy, optimizer):
    """record_function ranges named REGION_PREFIX + a PROFILE_REGIONS name around the parts of one MPO step, by module
    (forward pre/post hooks on megatron-core's module types inside `policy`) or by call (functions the modules call,
    dispatcher and optimizer methods); removed on exit. Regions nest (an expert MLP inside the MoE layer); the
    profile attributes each event to the innermost. Backward work is attributed through the autograd sequence numbers
    (attribute_profile), so only forward calls need ranges.

    Modules: MambaMixer (in_proj/out_proj, norm, the rest), Attention (core_attention, the rest: QKV and output
    projections), MoELayer (router, experts, shared_experts, the rest), MLPLayer's mlp, the layers' input_layernorm /
    pre_mlp_layernorm and the decoder's final_norm, HybridModel's embedding and output_layer. Calls: mamba_torch's
    causal conv and chunked scan (plain and shared-prompt), the `mamba triton` set's conv and scan, the MoE token
    dispatcher's dispatch_* / token_dispatch and combine_* / token_combine, mpo_loss.packed_sequence_logprobs,
    reference_logprobs.sums (the whole no-grad reference pass: it absorbs every region inside it) and
    `optimizer.step`."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import mpo_loss
    import reference_logprobs
    from backend import mamba_torch, mamba_triton

    handles, undo, missing = [], [], object()

    def on_module(module, region: str) -> None:
        if not isinstance(module, torch.nn.Module) or isinstance(module, IdentityOp):
            return
        stack = []

        def pre(m, args):
            stack.append(torch.profiler.record_function(REGION_PREFIX + region))
            stack[-1].__enter__()

        def post(m, args, output):
            stack.pop().__exit__(None, None, None)

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    def on_call(owner, name: str, region: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def ranged(*args, **kwargs):
            with torch.profiler.record_function(REGION_PREFIX + region):
                return fn(*args, **kwargs)

        undo.append((owner, name, vars(owner).get(name, missing)))
        setattr(owner, name, ranged)

    for m in policy.modules():
        if isinstance(m, MambaMixer):
            on_module(m, "Mamba other")
            on_module(m.in_proj, "Mamba in/out projections")
            on_module(m.out_proj, "Mamba in/out projections")
            on_module(getattr(m, "norm", None), "Mamba norm")
        elif isinstance(m, Attention):
            on_module(m, "attention projections")
            on_module(m.core_attention, "attention (core)")
        elif isinstance(m, MoELayer):
            on_module(m, "MoE other")
            on_module(m.router, "MoE router")
            on_module(m.experts, "MoE expert GEMMs")
            on_module(getattr(m, "shared_experts", None), "MoE shared expert")
            for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess"):
                on_call(m.token_dispatcher, name, "MoE dispatch (permute)")
            for name in ("combine_preprocess", "token_combine", "combine_postprocess"):
                on_call(m.token_dispatcher, name, "MoE combine (unpermute)")
        elif isinstance(m, HybridModel):
            on_module(m.embedding, "embedding")
            on_module(m.output_layer, "LM head + fused log-probs")
            on_module(getattr(m.decoder, "final_norm", None), "layer norms")
        if isinstance(m, MLPLayer):
            on_module(m.mlp, "dense MLP")
        if isinstance(m, (TransformerLayer, MambaLayer)):
            for name in ("input_layernorm", "pre_mlp_layernorm", "norm"):
                on_module(getattr(m, name, None), "layer norms")
    for owner, name in ((mamba_torch, "causal_conv1d_fn"), (shared_prompt, "causal_conv1d")):
        on_call(owner, name, "Mamba conv")
    for owner, name in ((mamba_torch, "mamba_chunk_scan_combined"), (shared_prompt, "mamba_chunk_scan")):
        on_call(owner, name, "Mamba scan")
    # the `mamba triton` set: its conv by name, its scan in the kernels dict mamba_triton.kernels() hands out
    on_call(mamba_triton, "causal_conv1d_fn", "Mamba conv")
    try:
        triton_set = mamba_triton.load_mamba_ssm_triton()
    except ImportError:  # sources that do not import here: that set is not used either
        triton_set = None
    if triton_set is not None:
        on_call(_ItemAccess(triton_set), "scan_fn", "Mamba scan")
    on_call(mpo_loss, "packed_sequence_logprobs", "LM head + fused log-probs")
    on_call(reference_logprobs, "sums", "reference forward")
    on_call(optimizer, "step", "optimizer step")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name, before in reversed(undo):
            if before is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def attribute_profile(events, cuda: bool) -> dict:
    """Time by PROFILE_REGIONS region of the profiled step (torch.profiler's `prof.events()` holding one STEP_RANGE):
    device time (each CPU op's own kernels, `self_device_time_total`) with `cuda`, else CPU time (`self_cpu_time_total`:
    on the CPU the step's ops run one after another on its thread, so the regions sum to the step's wall time; ops of
    other threads, e.g. gloo's copies, overlap them and are left out).

    An event inside region ranges belongs to the innermost one (everything inside "reference forward" to it); a
    backward event (inside the autograd engine's range of one node) to the region of the forward op that created the
    node: the op on the same thread with the node's sequence number that started last (ops that create no node carry
    the next node's number too, and run before it). AccumulateGrad nodes (gradients into megatron DDP's buffers) are
    "gradient accumulation (DDP)"; the rest "other". With `cuda`, kernels no CPU op launched are added to "other".

    Returns {"unit": "cuda" | "cpu", "step_wall_s": the step range's duration, "regions_s": {region: seconds} in
    PROFILE_REGIONS order, "total_s": their sum, "device_busy_s" (union of kernel intervals) and "host_gaps_s" (wall
    minus device busy; the profiler's own host overhead included) with `cuda`, else None}. Raises ValueError when the
    events hold no STEP_RANGE."""
    from torch.autograd import DeviceType

    step = next((e for e in events if e.name == STEP_RANGE), None)
    if step is None:
        raise ValueError(f"the profile holds no {STEP_RANGE!r} range")
    lo, hi = step.time_range.start, step.time_range.end
    ops = sorted((e for e in events if e.device_type == DeviceType.CPU and not e.is_async
                  and lo <= e.time_range.start <= hi and (cuda or e.thread == step.thread)),
                 key=lambda e: e.time_range.start)
    where: dict[int, tuple[str | None, object]] = {}  # id -> (innermost region range, innermost backward node range)

    def locate(e) -> tuple[str | None, object]:
        if id(e) not in where:
            region, node = locate(e.cpu_parent) if e.cpu_parent is not None else (None, None)
            if e.name.startswith(REGION_PREFIX) and region != "reference forward":
                region = e.name.removeprefix(REGION_PREFIX)
            elif e.name.startswith(_BACKWARD_NODE) and node is None:
                node = e
            where[id(e)] = (region, node)
        return where[id(e)]

    created: dict[tuple[int, int], str] = {}  # (thread, sequence number) -> region of the forward op
    for e in ops:
        region, node = locate(e)
        if node is None and e.sequence_nr >= 0:
            created[(e.thread, e.sequence_nr)] = region or "other"
    regions = dict.fromkeys(PROFILE_REGIONS, 0.0)
    for e in ops:
        region, node = locate(e)
        if region is None and node is not None:
            region = ("gradient accumulation (DDP)" if node.name.endswith("AccumulateGrad") else
                      created.get((node.fwd_thread, node.sequence_nr), "other"))  # fmt: skip
        regions[region or "other"] += (e.self_device_time_total if cuda else e.self_cpu_time_total) * 1e-6
    out = {"unit": "cuda" if cuda else "cpu", "step_wall_s": (hi - lo) * 1e-6, "device_busy_s": None,
           "host_gaps_s": None}
    if cuda:
        kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.device_type != DeviceType.CPU and lo <= e.time_range.start <= hi)
        regions["other"] += max(0.0, sum(b - a for a, b in kernels) * 1e-6 - sum(regions.values()))
        busy, end = 0.0, lo
        for a, b in kernels:  # the union of the kernel intervals
            busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
        out.update(device_busy_s=busy * 1e-6, host_gaps_s=(hi - lo - busy) * 1e-6)
    return {**out, "regions_s": regions, "total_s": sum(regions.values())}


def profile_step(device, shape: dict) -> dict:
    """torch.profiler over one MPO step of our system (train.train_step, separate sequences, `shape` as mpo_step_bench,
    after one unprofiled warm-up step: allocations, cuBLAS handles, Triton autotuning) with profile_regions' ranges:
    attribute_profile's time by region."""
    import train

    device = torch.device(device)
    setup = _step_setup(device, shape)
    cfg, pairs, ids = setup["cfg"], setup["pairs"], setup["ids"]
    ddp, reference, optimizer, scheduler, ctx, policy = _ours_system(device, cfg, setup["ckpt"])
    plan = pack.plan_step(setup["lengths"], cfg.packing, 1)

    def step(shift: float) -> float:
        batches = pack.load_bins(plan, pairs, ctx, ids["image"], ids["pad"])
        return train.train_step(ddp, reference, optimizer, scheduler, batches, ctx, shift)[1]

    shift = step(cfg.mpo.reward_shift)
    _sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with profile_regions(policy, optimizer), torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(STEP_RANGE):
                step(shift)
                _sync(device)
    finally:
        _drop_system(ddp)
    return attribute_profile(prof.events(), device.type == "cuda")


def profile_table(p: dict) -> str:
    """profile_step's result as a Markdown table: region | time (ms) | share of the regions' total."""
    unit = "device time (CUDA)" if p["unit"] == "cuda" else "CPU time"
    lines = [f"| region | {unit}, ms | share |", "|---|---|---|"]
    lines += [f"| {r} | {s * 1e3:.2f} | {100 * s / p['total_s']:.1f}% |" for r, s in p["regions_s"].items()]
    lines.append(f"| total | {p['total_s'] * 1e3:.2f} | 100% |")
    if p.get("host_gaps_s") is not None:
        lines.append(f"| host gaps (step wall {p['step_wall_s'] * 1e3:.2f} ms - device busy "
                     f"{p['device_busy_s'] * 1e3:.2f} ms) | {p['host_gaps_s'] * 1e3:.2f} | |")
    return "\n".join(lines)
