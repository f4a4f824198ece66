"""2-rank check of the MoE alltoall dispatcher with EP = 2 on CPU (run by tests/test_megatron_patches.py through the
`torchrun` fixture): the split-size shim only matters when tokens cross ranks.

A megatron-core MoE layer (4 experts, top-2, hidden 16) with known weights, 2 experts per rank; each rank compares its
tokens' output with the explicit mixture Σ_e p_e·routed_e·fc2_e(gelu(fc1_e x)) and reports (tests/dist/report.py) the
max-abs error and how many of its token-expert assignments went to the other rank's experts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_megatron_patches.small_config
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, first

from backend import megatron_patches  # noqa: E402

megatron_patches.apply()

import report  # noqa: E402  (tests/dist/report.py, beside this file)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from test_megatron_patches import small_config  # noqa: E402  (the in-process tests' layer config)


def main() -> None:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(5)
    cfg = small_config(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=8, moe_ffn_hidden_size=8,
                       moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, expert_model_parallel_size=2,
                       moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_permute_fusion=False,
                       bias_activation_fusion=False)
    moe = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)(
        config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    gen = torch.Generator().manual_seed(0)
    router_w = torch.randn(4, 16, generator=gen)
    fc1 = [torch.randn(8, 16, generator=gen) * 0.3 for _ in range(4)]
    fc2 = [torch.randn(16, 8, generator=gen) * 0.3 for _ in range(4)]
    with torch.no_grad():
        moe.router.weight.copy_(router_w)
        for local, expert in enumerate(moe.experts.local_experts):
            expert.linear_fc1.weight.copy_(fc1[2 * rank + local])
            expert.linear_fc2.weight.copy_(fc2[2 * rank + local])
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(100 + rank))
    out, _ = moe(x)
    flat = x.view(-1, 16)
    probs, routing_map = moe.router(flat)
    expected = sum(probs[:, e : e + 1] * routing_map[:, e : e + 1] * (F.gelu(flat @ fc1[e].T) @ fc2[e].T)
                   for e in range(4))
    remote = int(routing_map[:, 2 * (1 - rank) : 2 * (1 - rank) + 2].sum())
    err = (out.view(-1, 16) - expected).abs().max().item()
    print(f"EP2 rank {rank} max_err {err:.3e} remote_assignments {remote}", flush=True)
    report.write({"max_err": err, "remote_assignments": remote})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
