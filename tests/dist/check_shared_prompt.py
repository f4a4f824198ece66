"""2-rank check of the shared-prompt format (run by tests/test_shared_prompt_model.py through the `torchrun` fixture; by
hand: `torchrun --standalone --nproc-per-node 2 tests/dist/check_shared_prompt.py`).

In ONE launch, for each layout (TP = 2 with sequence parallelism; DP = 2): set up megatron-core's parallel_state, build
the tiny model from assets/tiny-omni, and run the same bins (tests/shared_prompt_cases.py: image and text-only pairs,
prompts not a multiple of the Mamba chunk; one bin of several pairs, then bins of one pair) through train.py's
count_global_pairs / reference_logprobs / forward_logprobs / policy_forward_backward in the separate-sequences and in
the shared-prompt format. DP = 2: rank r takes bins r, r + 2, ...; gradients are summed over DP (what
finalize_model_grads does), over TP for the sequence-parallel (replicated) parameters, and the experts' over the
expert-DP group (ETP = 1: every rank that splits the tokens). Each rank reports the max-abs differences of
its logprobs, metrics and gradient shards between the two formats (tests/dist/report.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared_prompt_cases, step_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, first


def run_layout(tp: int, dp: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from shared_prompt_cases import TINY, make_pairs, max_differences, mpo_step
    from step_cases import tiny_config

    import distributed
    import hf_weights
    import omni_model as om

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    cfg = tiny_config(f"parallel.tensor_model_parallel_size={tp}", f"parallel.sequence_parallel={tp > 1}",
                      "packing.shared_prompt=true")
    model = om.build_model(TINY, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(model, TINY)
    ctx = distributed.Ctx.current(cfg, torch.device("cpu"))
    assert (ctx.dp, dist.get_world_size() // tp) == (dp, dp)
    pairs = make_pairs()
    out = {}
    for name, bins in (("bins_of_2", [pairs[:2], pairs[2:]]), ("bins_of_1", [[p] for p in pairs])):
        mine = bins[ctx.dp_rank::dp]
        res = []
        for shared in (False, True):
            r = mpo_step(model, ctx, mine, shared)
            # every trainable parameter, in the same order on every rank (a rank without images has no ViT grads)
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                g = r["grads"].setdefault(n, torch.zeros_like(p, dtype=torch.float64))
                if not getattr(p, "allreduce", True):  # experts: summed over the expert-DP group (TP x DP here)
                    dist.all_reduce(g, group=parallel_state.get_expert_data_parallel_group())
                    continue
                if tp > 1 and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(g, group=ctx.tp_group)
                if dp > 1:
                    dist.all_reduce(g, group=ctx.dp_group)
            res.append(r)
        out[name] = max_differences(*res)
        out[name]["num_global_pairs"] = [r["num_global_pairs"] for r in res]
    destroy_moe_metrics_tracker()
    parallel_state.destroy_model_parallel()
    return out


def main() -> None:
    import report
    import torch.distributed as dist

    from backend import megatron_patches

    megatron_patches.apply()
    dist.init_process_group("gloo")
    result = {}
    for name, (tp, dp) in {"tp2_sp": (2, 1), "dp2": (1, 2)}.items():
        try:
            result[name] = run_layout(tp, dp)
        except Exception as e:  # reported, and the test fails on it
            result[name] = report.failure(e)
    report.write(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
