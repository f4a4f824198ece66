"""local_spec.GroupedExperts (3-D expert weights, one grouped GEMM per projection) against megatron-core's
SequentialMLP (the loop over experts, the reference): the same initial weights, output and every gradient bit for bit
on the CPU (torch's CPU grouped GEMM is a loop of matmuls over the same operands), checkpoints that load into either,
and a tiny model built with either gives the same logits and gradients.

Runs in-process on a gloo world of size 1. Run: `pytest tests/test_experts.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from omni_model_cases import TINY, logits_and_grads, make_pair_batch  # noqa: E402

from backend import (
    kernel_selection,  # noqa: E402
    megatron_patches,  # noqa: E402
)

megatron_patches.apply()

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

from backend import local_spec  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def world():
    import distributed

    distributed.init_distributed()


def _config(**overrides) -> TransformerConfig:
    kw = dict(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True, add_bias_linear=False,
              bias_dropout_fusion=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
              num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=12, moe_ffn_hidden_size=12,
              activation_func=lambda x: F.relu(x).square())
    kw.update(overrides)
    return TransformerConfig(**kw)


def _pair(cfg) -> tuple[SequentialMLP, local_spec.GroupedExperts]:
    """SequentialMLP and GroupedExperts of `cfg`, each built after the same seed (the same weights)."""
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    seq = SequentialMLP(cfg.num_moe_experts, cfg, sub, pg_collection=pgs)
    torch.manual_seed(0)
    grp = local_spec.GroupedExperts(cfg.num_moe_experts, cfg, sub, pg_collection=pgs)
    return seq, grp


def _stacked(seq: SequentialMLP, fc: int, grad: bool = False) -> torch.Tensor:
    """SequentialMLP's fc`fc` weights (or their gradients) as GroupedExperts' [E, rows, cols]."""
    ws = [getattr(e, f"linear_fc{fc}").weight for e in seq.local_experts]
    return torch.stack([w.grad for w in ws] if grad else ws)


def _run(module, x, counts, probs, grad_out):
    """Forward + backward with a contiguous upstream gradient: (output, input grad, probs grad)."""
    module.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(grad_out)
    return out.detach(), x.grad, probs.grad


CASES = {"squared_relu": {}, "gated_silu": {"gated_linear_unit": True, "activation_func": F.silu},
         "probs_on_input": {"moe_apply_probs_on_input": True, "moe_router_topk": 1, "moe_router_pre_softmax": True}}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("counts", [[5, 0, 7, 2], [0, 9, 0, 0], [0, 0, 0, 0]])
def test_grouped_experts_equal_sequential_mlp_exactly(case, counts):
    """fp32, experts with zero tokens (and a rank with no tokens at all): the same initial weights after the same
    seed; output, input and probs gradients and every expert's weight gradient equal SequentialMLP's exactly."""
    cfg = _config(**CASES[case])
    seq, grp = _pair(cfg)
    fc1_rows = 24 if case == "gated_silu" else 12
    assert grp.weight1.shape == (4, fc1_rows, 16) and grp.weight2.shape == (4, 16, 12)
    for fc, w in ((1, grp.weight1), (2, grp.weight2)):
        assert torch.equal(w, _stacked(seq, fc)) and w.abs().sum() > 0
    gen = torch.Generator().manual_seed(1)
    T = sum(counts)
    x = torch.randn(T, 16, generator=gen)
    probs = torch.rand(T, generator=gen)
    grad_out = torch.randn(T, 16, generator=gen)
    tokens_per_expert = torch.tensor(counts)
    ref = _run(seq, x, tokens_per_expert, probs, grad_out)
    got = _run(grp, x, tokens_per_expert, probs, grad_out)
    assert ref[0].shape == got[0].shape == (T, 16)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    for fc, w in ((1, grp.weight1), (2, grp.weight2)):
        assert torch.equal(w.grad, _stacked(seq, fc, grad=True)), fc
        assert all(not w.grad[e].any() for e, n in enumerate(counts) if not n)  # experts without tokens: zero
    if T:
        assert ref[0].abs().sum() > 0 and grp.weight1.grad.abs().sum() > 0


@pytest.mark.parametrize("layout", [{}, {"expert_model_parallel_size": 2},
                                    {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}],
                         ids=["ep1", "ep2", "tp2_etp1"])
def test_expert_parameters_carry_megatrons_expert_attributes(layout):
    """The 3-D weights are tagged as megatron tags its expert linears (DDP's expert buffers, grad-norm dedup):
    reduced with the dense parameters only at EP = 1 with ETP = TP, tensor-parallel along their output rows."""
    seq, grp = _pair(_config(**layout))
    for fc, w in ((1, grp.weight1), (2, grp.weight2)):
        ref = getattr(seq.local_experts[0], f"linear_fc{fc}").weight
        want = (not layout, True)
        assert (w.allreduce, w.tensor_model_parallel) == (ref.allreduce, ref.tensor_model_parallel) == want
        assert w.partition_dim == ref.partition_dim + 1


@pytest.mark.parametrize("case", ["squared_relu", "gated_silu"])
def test_sharded_tensors_of_an_expert_parallel_rank_cover_sequential_mlps_shards(case):
    """EP rank 1 of 2 (expert-DP rank 3) under a prepended layer offset: GroupedExperts' one ShardedTensor per
    projection has the global shape, offset and replica id that SequentialMLP's per-expert shards cover (groups
    stubbed: the offsets are arithmetic of ranks and sizes)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    seq, grp = _pair(_config(**CASES[case]))

    def group(rank, size):
        return type("G", (), {"rank": lambda self: rank, "size": lambda self: size})()

    for m in (seq, grp):
        m.ep_group, m.dp_group = group(1, 2), group(3, 4)
    layer = (0, 5, 7)  # layer 5 of 7
    shards = {m: [sh for sh in m.sharded_state_dict("mlp.experts.", (layer,)).values() if not isinstance(sh, dict)]
              for m in (seq, grp)}
    for fc, w in ((1, grp.weight1), (2, grp.weight2)):
        key = f"mlp.experts.experts.linear_fc{fc}.weight"
        (mine,) = [sh for sh in shards[grp] if sh.key == key]
        assert isinstance(mine, ShardedTensor)
        assert mine.global_shape == (7, 8, *w.shape[1:]) and mine.global_offset == (5, 4, 0, 0)
        assert mine.replica_id == (0, 0, 3) and mine.data is w
        theirs = [sh for sh in shards[seq] if getattr(sh, "key", None) == key]
        assert len(theirs) == 4  # SequentialMLP: one shard (or gated factory) per local expert
        for e, sh in enumerate(theirs):
            if isinstance(sh, ShardedTensor):
                assert sh.global_shape == mine.global_shape and sh.global_offset == (5, 4 + e, 0, 0)
                assert sh.replica_id == mine.replica_id
            else:  # the gated fc1's ShardedTensorFactory: the same expert's matrix
                assert torch.equal(sh.data, w[e])


@pytest.mark.parametrize("case", ["squared_relu", "gated_silu"])
@pytest.mark.parametrize("saved_by", ["sequential", "grouped"])
def test_distributed_checkpoints_load_into_either_expert_module(case, saved_by, tmp_path):
    """SequentialMLP's checkpoint keys: a dist_checkpointing save of one module loads into the other, every expert
    matrix exactly (`export` reads a checkpoint whichever expert module wrote it). GroupedExperts writes no
    `_extra_state` (SequentialMLP's linears hold None there), so SequentialMLP loads its weights only."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    cfg = _config(**CASES[case])
    seq, grp = _pair(cfg)
    with torch.no_grad():  # distinct weights per module, so a load that does nothing fails
        for p in seq.parameters():
            p.add_(1.0)
    src, dst = (seq, grp) if saved_by == "sequential" else (grp, seq)

    def sharded(m):
        return {k: v for k, v in m.sharded_state_dict(prefix="mlp.experts.").items()
                if not isinstance(v, ShardedObject)}  # SequentialMLP's gated fc1: a ShardedTensorFactory

    keys = {m: {sh.key for sh in sharded(m).values()} for m in (seq, grp)}
    assert keys[seq] == keys[grp] == {"mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"}
    dist_checkpointing.save(src.sharded_state_dict(prefix="mlp.experts."), str(tmp_path))
    loaded = dist_checkpointing.load(sharded(dst), str(tmp_path))
    dst.load_state_dict({k.removeprefix("mlp.experts."): v for k, v in loaded.items()}, strict=dst is grp)
    for fc, w in ((1, grp.weight1), (2, grp.weight2)):
        assert torch.equal(w, _stacked(seq, fc)), fc


@pytest.mark.parametrize("setting", [{"add_bias_linear": True}, {"bias_activation_fusion": True,
                                                                  "gated_linear_unit": True,
                                                                  "activation_func": F.silu}])
def test_grouped_experts_refuse_what_they_do_not_compute(setting):
    """Linear biases and the fused bias-activation (SequentialMLP's other paths) are refused at construction."""
    cfg = _config(**setting)
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    with pytest.raises(AssertionError):
        local_spec.GroupedExperts(4, cfg, sub, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def test_spec_names_are_checked():
    with pytest.raises(AssertionError):
        local_spec.local_hybrid_stack_spec(object, {}, 4, experts="loop")
    with pytest.raises(AssertionError):
        local_spec.local_hybrid_stack_spec(object, {}, 4, attention="flash")


def test_tiny_model_with_grouped_experts_equals_sequential():
    """The tiny Omni model (2 MoE layers, 4 experts, top-2) with GroupedExperts and with SequentialMLP, both loaded
    from the HF checkpoint: the same logits and every gradient (an expert's as the 3-D weight's slice) exactly (fp32,
    CPU), training mode."""
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    models = {}
    for experts in ("sequential", "grouped-loop"):
        kernels = kernel_selection.Kernels("local", "torch", "cpu", attention="sdpa", experts=experts)
        m = om.build_model(TINY, ModelConfig(), ParallelConfig(), kernels=kernels)
        hf_weights.load_hf_weights(m, TINY)
        models[experts] = m.train()
    n_grouped = sum(isinstance(x, local_spec.GroupedExperts) for x in models["grouped-loop"].modules())
    assert n_grouped == 2 and not any(isinstance(x, local_spec.GroupedExperts) for x in models["sequential"].modules())
    batch = make_pair_batch(seed=5)
    l1, g1 = logits_and_grads(models["sequential"], batch)
    l2, g2 = logits_and_grads(models["grouped-loop"], batch)
    assert torch.equal(l1, l2)
    experts = {n: g for n, g in g2.items() if ".experts.weight" in n}
    assert len(experts) == 4 and g1.keys() - g2.keys() == {
        n.replace(".weight" + fc, f".local_experts.{e}.linear_fc{fc}.weight") for n in experts for fc in "12"
        if n.endswith(fc) for e in range(4)}
    for n, g in g2.items():
        want = torch.stack([g1[n.replace(".weight" + n[-1], f".local_experts.{e}.linear_fc{n[-1]}.weight")]
                            for e in range(4)]) if n in experts else g1[n]
        assert torch.equal(g, want), n
