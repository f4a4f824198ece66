"""2-rank resume of the precision-aware optimizer (run by tests/test_precision_adam.py through the `torchrun` fixture;
by hand: `torchrun --standalone --nproc-per-node 2 tests/dist/check_precision_resume.py WORK_DIR`).

In ONE launch, for each layout (TP = 2 with sequence parallelism; EP = 2, so DP = 2 for the dense parameters) and
each moment dtype (fp32, bf16; int16 remainders, the tiny policy in bf16): tests/step_cases.tiny_step's setup runs
steps 1-4 with a checkpoint after step 2; a second setup built afresh loads it and runs steps 3-4. Each rank reports
whether the metrics, its weights and its optimizer state (every state tensor of its shard, with dtype) are equal
bit for bit (tests/dist/report.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: step_cases
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, first

LAYOUTS = {"tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
           "ep2": ["parallel.expert_model_parallel_size=2"]}  # fmt: skip
MOMENTS = {"m32": [], "m16": ["optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"]}
COMMON = ["model.params_dtype=bfloat16", "optimizer.use_precision_aware_optimizer=true",
          "policy.train_global_batch_size=2"]  # fmt: skip


def _state(s) -> list:
    """This rank's weights and its inner optimizers' state tensors, in order."""
    import checkpoint

    out = [(f"param {n}", p.detach().clone()) for n, p in s["policy"].named_parameters()]
    for i, o in enumerate(checkpoint._inner_optimizers(s["optimizer"])):
        for j, p in enumerate(p for g in o.optimizer.param_groups for p in g["params"]):
            out += [(f"opt {i}.{j}.{k}", v.clone()) for k, v in sorted(o.optimizer.state[p].items())]
    return out


def run_case(layout: list[str], overrides: list[str], work: Path) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from step_cases import tiny_config, tiny_step

    import checkpoint
    import config as config_mod
    import distributed

    cfg = tiny_config(*COMMON, *layout, *overrides)
    distributed.init_distributed(cfg)  # this layout's parallel state (tiny_step's own call then keeps it)
    a = tiny_step("cpu", *COMMON, *layout, *overrides)
    run_state = {"step": 2, "world_size": dist.get_world_size(), "consumed_pairs": 0, "reward_shift": 0.0,
                 "reward_shift_num_updates": 0, "sampler": {}, "scheduler": {}, "config": config_mod.to_dict(cfg)}
    shift, rows = 0.0, []
    for step in range(1, 5):
        m, shift = a["run"](a["batches"], shift)
        rows.append(m)
        if step == 2:
            path = checkpoint.save(work, 2, a["ddp"], a["optimizer"], a["scheduler"], run_state)
            shift_2 = shift
    b = tiny_step("cpu", *COMMON, *layout, *overrides)
    checkpoint.load(path, b["ddp"], b["optimizer"], b["scheduler"])
    again = []
    for _ in range(2):
        m, shift_2 = b["run"](b["batches"], shift_2)
        again.append(m)
    straight, resumed = _state(a), _state(b)
    out = {"metrics_equal": again == rows[2:], "trained": rows[3]["loss"] != rows[1]["loss"],
           "opt_dtypes": sorted({f"{k.rsplit('.', 1)[1]} {v.dtype}" for k, v in straight if k.startswith("opt")}),
           "unequal": [k for (k, x), (_, y) in zip(straight, resumed, strict=True)
                       if x.dtype != y.dtype or not torch.equal(x, y)],
           "count": len(straight), "world": [parallel_state.get_tensor_model_parallel_world_size(),
                                             parallel_state.get_expert_model_parallel_world_size(),
                                             parallel_state.get_data_parallel_world_size()]}  # fmt: skip
    destroy_moe_metrics_tracker()
    parallel_state.destroy_model_parallel()
    return out


def main() -> None:
    import report
    import torch.distributed as dist

    from backend import megatron_patches

    megatron_patches.apply()
    dist.init_process_group("gloo")
    work, result = Path(sys.argv[1]), {}
    for name, layout in LAYOUTS.items():
        for moments, overrides in MOMENTS.items():
            try:
                result[f"{name}-{moments}"] = run_case(layout, overrides, work / f"{name}-{moments}")
            except Exception as e:  # reported, and the test fails on it
                result[f"{name}-{moments}"] = report.failure(e)
    report.write(result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
