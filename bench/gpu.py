"""Item 6, gpu (CUDA; `--gpu` runs it alone, into bench/gpu_results.json; a skip record otherwise): one MPO step of a
Nano-width model at reduced depth on 16 MMPR-like text pairs against transformers' padded per-pair step
(gpu_step.py), the Mamba-2 scans (scan.py), with --profile the device time by region (profiling.py), with --ablation
each fast kernel swapped back (ablation.py)."""
# GPU_SHAPE: hidden 2688, pattern MEM*EM, Mamba 64x64 heads, 8 groups, d_state 128, attention 32/2 heads of 128, 128
# experts top-6 of 1856 + shared 3712, vocabulary 131072, bf16, random weights; 16 pairs packed 4 per bin. Recorded:
# tokens/s, pairs/s, MFU, peak memory, step-1 losses and their deviation from the ln 2 closed form next to the noise
# floor measured in the same run (asserted on the CPU only: GPU kernels are not deterministic); the Mamba-2 scan fwd+bwd
# of every available kernel at T = 16384. The step is sized to the device's free memory by plan.py (sized_gpu_shape).

from __future__ import annotations

import functools
import json
import sys

import torch

from bench.ablation import kernel_ablation
from bench.common import _release, run_section
from bench.gpu_step import _shape_checkpoint, mpo_step_bench, step_config
from bench.profiling import profile_step
from bench.scan import scan_bench
from bench.workload import pair_lengths, text_pairs

# The GPU step: Nano width at reduced depth (pattern MEM*EM), random weights.
NANO_WIDTH_LLM = dict(hidden_size=2688, hybrid_override_pattern="MEM*EM", num_attention_heads=32,
                      num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128,
                      n_groups=8, chunk_size=128, intermediate_size=1856, moe_intermediate_size=1856,
                      moe_shared_expert_intermediate_size=3712, n_routed_experts=128, num_experts_per_tok=6,
                      vocab_size=131072)
GPU_SHAPE = dict(llm=NANO_WIDTH_LLM, dtype="bfloat16", pairs=16, pairs_per_bin=4, prompt=(600, 2400),
                 response=(100, 700), scan_tokens=16384, scan_sequences=8)


def gpu_shape_ladder(base: dict = GPU_SHAPE) -> list[dict]:
    """Shapes of the GPU step, largest first: `base`, then fewer pairs per bin (4, 2, 1: activations), then fewer
    routed experts (64, 32 of 128, one pair per bin: the weights and optimizer state). Width, depth, vocabulary, top-k
    and the pairs' lengths stay the Nano's."""
    out = [{**base, "pairs_per_bin": k} for k in (4, 2, 1) if k <= base["pairs_per_bin"]]
    return out + [{**base, "pairs_per_bin": 1, "llm": {**base["llm"], "n_routed_experts": e}}
                  for e in (64, 32) if e < base["llm"]["n_routed_experts"]]


def plan_gpu_step(shape: dict, capacity: float) -> dict:
    """plan.py's numbers for the GPU step of `shape` (one rank: the policy, the reference, megatron's Adam and the
    largest bin's activations) on a device of `capacity` bytes: planned bytes, reserve, spare and whether it fits
    (plan.MemoryPlan.fits: plan.MARGIN to spare after the reserve)."""
    import omni_model as om
    import pack
    import plan

    ckpt = _shape_checkpoint(shape)
    cfg = step_config(ckpt, shape)
    pairs = text_pairs(shape["pairs"], shape["prompt"], shape["response"], om.read_hf_config(ckpt).text.vocab_size)
    bins = [b.tokens for b in pack.plan_step(pair_lengths(pairs), cfg.packing, 1).ranks[0]]
    p = plan.make_plan(cfg, 1, image_tokens=0)
    (rank,) = p.ranks
    total = rank.total(p.activations(max(bins)))
    return {"capacity_bytes": capacity, "planned_bytes": total, "reserve_bytes": p.reserve.total(total),
            "spare_bytes": p.spare(capacity, max(bins)), "largest_bin": max(bins), "fits": p.fits(capacity, max(bins))}


def sized_gpu_shape(capacity: float, base: dict = GPU_SHAPE) -> tuple[dict, dict]:
    """The largest shape of `gpu_shape_ladder(base)` whose step plan.py fits in `capacity` bytes (a device's free
    memory), with its plan (`plan_gpu_step`); the smallest shape and its plan when none fits."""
    for shape in gpu_shape_ladder(base):
        planned = plan_gpu_step(shape, capacity)
        if planned["fits"]:
            break
    return shape, planned


def bench_gpu(quick: bool, device=None, shape: dict | None = None, profile: bool = False, timed: int | None = None,
              out: dict | None = None, ablation: bool = False) -> dict:
    """Item 6 on a CUDA device, in sections recorded in `out` as each ends (a failing one as {"error": ...}, the next
    still runs): "step", with `profile` "profile", with `ablation` "ablation", and "scan". Without CUDA (and no
    `device`), a skip record."""
    # The sections: step (mpo_step_bench, `timed` steps after step 1: default 1 with `quick`, else 5), profile
    # (profile_step; before the scans, whose Triton compilation from a cold cache is the slowest part), ablation
    # (kernel_ablation), scan (scan_bench); cli.main passes its results entry as `out` (run_section). `device`/`shape`
    # let a CPU test run it at a tiny shape.
    import omni_model as om
    from backend import kernel_selection

    out = {} if out is None else out
    if device is None:
        if not torch.cuda.is_available():
            out["skipped"] = "no CUDA device: the GPU step time, tokens/s and MFU need an accelerator"
            return out
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if shape is None:  # the largest step plan.py fits in the free memory; --quick: 8 pairs, one timed step and scan
        base = {**GPU_SHAPE, "pairs": 8} if quick else GPU_SHAPE
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
        shape, out["planned"] = sized_gpu_shape(free, base)
        out["shape"] = {"pairs": shape["pairs"], "pairs_per_bin": shape["pairs_per_bin"],
                        "n_routed_experts": shape["llm"]["n_routed_experts"]}
        print(f"[bench] gpu shape {json.dumps(out['shape'])}, planned {json.dumps(out['planned'])}", file=sys.stderr,
              flush=True)
    kernels = kernel_selection.select_kernels(cuda=device.type == "cuda", dtype=om.torch_dtype(shape["dtype"]))
    out.update(kernels=kernels.line(), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
               versions=versions())
    timed = timed or (1 if quick else 5)
    sections = [("step", mpo_step_bench, (device, shape, timed))]
    if profile:
        sections.append(("profile", profile_step, (device, shape)))
    if ablation:
        sections.append(("ablation", functools.partial(kernel_ablation, out=out.setdefault("ablation", {})),
                         (device, shape, timed)))
    sections.append(("scan", scan_bench, (device, shape, timed)))
    for key, fn, args in sections:
        run_section(out, key, fn, *args)
        print(f"[bench] gpu {key} {json.dumps(out[key])}", file=sys.stderr, flush=True)
        _release(device)
    return out


def versions() -> dict:
    """The versions a GPU number depends on: torch, its CUDA, Triton (None where absent)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}
