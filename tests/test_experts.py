"""local_spec.GroupedExperts (one grouped GEMM per projection) against megatron-core's SequentialMLP (the loop over
experts, the reference): the same output and every gradient bit for bit on the CPU (torch's CPU grouped GEMM is a
loop of matmuls over the same operands), the same parameters and checkpoint keys, and a tiny model built with either
gives the same logits and gradients.

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

import kernel_selection  # noqa: E402
import megatron_patches  # noqa: E402

megatron_patches.apply()

from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402

import local_spec  # noqa: E402


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
    """SequentialMLP and GroupedExperts of `cfg` with the same weights (the grouped one loads the other's state)."""
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    seq = SequentialMLP(cfg.num_moe_experts, cfg, sub, pg_collection=pgs)
    grp = local_spec.GroupedExperts(cfg.num_moe_experts, cfg, sub, pg_collection=pgs)
    grp.load_state_dict(seq.state_dict())
    return seq, grp


def _run(module, x, counts, probs, grad_out):
    """Forward + backward with a contiguous upstream gradient: (output, input grad, probs grad, {param: grad})."""
    module.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(grad_out)
    return out.detach(), x.grad, probs.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("case", ["squared_relu", "gated_silu", "probs_on_input"])
@pytest.mark.parametrize("counts", [[5, 0, 7, 2], [0, 9, 0, 0], [0, 0, 0, 0]])
def test_grouped_experts_equal_sequential_mlp_exactly(case, counts):
    """fp32, experts with zero tokens (and a rank with no tokens at all): output, input and probs gradients and every
    parameter gradient equal SequentialMLP's exactly; parameter names, state_dict and sharded_state_dict keys are
    SequentialMLP's."""
    overrides = {"squared_relu": {}, "gated_silu": {"gated_linear_unit": True, "activation_func": F.silu},
                 "probs_on_input": {"moe_apply_probs_on_input": True, "moe_router_topk": 1,
                                    "moe_router_pre_softmax": True}}[case]
    cfg = _config(**overrides)
    torch.manual_seed(0)
    seq, grp = _pair(cfg)
    gen = torch.Generator().manual_seed(1)
    T = sum(counts)
    x = torch.randn(T, 16, generator=gen)
    probs = torch.rand(T, generator=gen)
    grad_out = torch.randn(T, 16, generator=gen)
    tokens_per_expert = torch.tensor(counts)
    ref = _run(seq, x, tokens_per_expert, probs, grad_out)
    got = _run(grp, x, tokens_per_expert, probs, grad_out)
    assert ref[0].shape == got[0].shape == (T, 16)
    for a, b in zip(ref[:3], got[:3], strict=True):
        assert torch.equal(a, b)
    assert ref[3].keys() == got[3].keys() and len(ref[3]) == 2 * cfg.num_moe_experts
    for n, g in ref[3].items():  # experts without tokens: a zero gradient in both
        assert torch.equal(g, got[3][n]), n
    assert all(not ref[3][f"local_experts.{e}.linear_fc{i}.weight"].any() for e, n in enumerate(counts) if not n
               for i in (1, 2))
    if T:
        assert ref[0].abs().sum() > 0 and any(g.abs().sum() > 0 for g in ref[3].values())
    assert list(seq.state_dict()) == list(grp.state_dict())
    s_ref, s_got = seq.sharded_state_dict(prefix="experts."), grp.sharded_state_dict(prefix="experts.")
    assert s_ref.keys() == s_got.keys()
    for k, a in s_ref.items():  # ShardedTensor, or the gated fc1's ShardedTensorFactory: the same key and offsets
        b = s_got[k]
        assert type(a) is type(b) and a.key == b.key
        assert getattr(a, "global_offset", None) == getattr(b, "global_offset", None)


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
    """The tiny Omni model (2 MoE layers, 4 experts, top-2) with GroupedExperts: the same parameter names, logits and
    every gradient as with SequentialMLP, exactly (fp32, CPU), training mode."""
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    models = {}
    for experts in ("sequential", "grouped"):
        kernels = kernel_selection.Kernels("local", "torch", "cpu", attention="sdpa", experts=experts)
        m = om.build_model(TINY, ModelConfig(), ParallelConfig(), kernels=kernels)
        hf_weights.load_hf_weights(m, TINY)
        models[experts] = m.train()
    n_grouped = sum(isinstance(x, local_spec.GroupedExperts) for x in models["grouped"].modules())
    assert n_grouped == 2 and not any(isinstance(x, local_spec.GroupedExperts) for x in models["sequential"].modules())
    assert list(models["sequential"].state_dict()) == list(models["grouped"].state_dict())
    batch = make_pair_batch(seed=5)
    l1, g1 = logits_and_grads(models["sequential"], batch)
    l2, g2 = logits_and_grads(models["grouped"], batch)
    assert torch.equal(l1, l2)
    assert g1.keys() == g2.keys() and any(".experts.local_experts." in n for n in g1)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n
