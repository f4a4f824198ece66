"""lora: adapters on the tiny Omni model (CPU, fp32, gloo): B = 0 and adapters-off are the base model bit for bit,
merged weights give the adapted logits, only the adapters train, the [lora] config errors, the PEFT export loads in
transformers + peft with our logits, and TP 2 + SP equals one rank (one torchrun launch).

Run: `pytest tests/test_lora.py` (about a minute).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from omni_model_cases import TINY, make_pair_batch  # noqa: E402

PARITY = 1e-4  # tests/test_omni_model.py: logits vs transformers
INVARIANCE = 1e-5  # tests/test_omni_model.py: a reordering of the same fp32 sums (layouts, packing)
ALL = dict(rank=4, alpha=8.0, routed_experts=True, vision_tower=True, projector=True)  # every component


@pytest.fixture(scope="module")
def world():
    import distributed

    distributed.init_distributed()


def build(lora_kw: dict | None = None):
    """The tiny model with its weights, in eval mode; with lora_kw, adapters of LoraConfig(**lora_kw) added."""
    import hf_weights
    import lora
    import omni_model as om
    from config import LoraConfig, ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(), ParallelConfig())
    hf_weights.load_hf_weights(m, TINY)
    if lora_kw is not None:
        lora.apply_lora(m, LoraConfig(**lora_kw))
    return m.eval()


def randomize_b(model, seed: int = 1, std: float = 0.1) -> None:
    """Every adapter's B drawn from N(0, std²) (a trained adapter)."""
    import lora

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, ad in lora.adapted(model):
            ad.B.copy_(torch.randn(ad.B.shape, generator=g) * std)


@pytest.fixture(scope="module")
def batch():
    return make_pair_batch()


@pytest.fixture(scope="module")
def base_logits(world, batch):
    with torch.no_grad():
        return build()(batch)


def test_zero_b_is_the_base_model_and_only_adapters_train(world, batch, base_logits):
    import lora

    m = build(ALL)
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    adapters = {f"{n}.{ad_name}.{x}" for n, mod, ad in lora.adapted(m) for ad_name, c in mod.named_children()
                if c is ad for x in ("A", "B")}
    assert names == adapters and len(adapters) == 2 * 26  # LM 16 (2 routed-expert pairs per MoE layer), ViT 8, mlp1 2
    logits = m(batch)
    assert torch.equal(logits.detach(), base_logits)  # B = 0: bit for bit
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
    for name, p in m.named_parameters():
        if name in names:  # B = 0 gives A no gradient; B gets one wherever the layer sees tokens
            assert p.grad is not None and (p.grad.abs().sum() > 0) == name.endswith(".B"), name
        else:
            assert p.grad is None, name


def test_disabled_adapters_are_the_base_model_bit_for_bit(world, batch, base_logits):
    import lora

    m = build(ALL)
    randomize_b(m)
    with torch.no_grad():
        adapted = m(batch)
        assert (adapted - base_logits).abs().max() > 0.1
        with lora.adapters_disabled(m):
            assert torch.equal(m(batch), base_logits)
        assert torch.equal(m(batch), adapted)  # back on after the block


def _linear_bound(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Elementwise bound on |x·W_mergedᵀ - (x·Wᵀ + s·(x·Aᵀ)·Bᵀ)| in fp32: each side is within γ_k·(|x|·|W|ᵀ +
    s·|x|·|A|ᵀ·|B|ᵀ) of the exact x·(W + s·B·A)ᵀ, k = in + r + 2 (Higham's dot-product bound, γ_k = k·u / (1 - k·u),
    u = 2⁻²⁴; s a power of two)."""
    k = x.shape[-1] + a.shape[0] + 2
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    x, w, a, b = (t.double().abs() for t in (x, w, a, b))
    return 2 * gamma * (x @ w.T + scale * (x @ a.T) @ b.T)


def test_merged_weights_give_the_adapted_outputs(world, batch):
    import lora
    from local_spec import _norm

    m = build(ALL)
    randomize_b(m)
    g = torch.Generator().manual_seed(5)
    merged = lora.merged_state(m)
    for name, module, ad in lora.adapted(m):  # every adapted linear against its merged weight, within the bound
        if ad.kind == "experts":
            continue
        x = torch.randn(7, 1, module.weight.shape[1], generator=g)
        with torch.no_grad():
            ours, _ = module(x)
            if getattr(module, "layer_norm_weight", None) is not None:
                c = module.config
                x = _norm(x, module.layer_norm_weight, module.layer_norm_bias, c.layernorm_epsilon, c.normalization)
            w = merged[f"{name}.weight"]
            bias = module.bias if getattr(module, "bias", None) is not None else 0
            ref = x @ w.T + bias
        bound = _linear_bound(x, module.weight, ad.A, ad.B, ad.scale) + 2.0 ** -23 * ref.abs()  # + the bias' add
        assert ((ours - ref).abs() <= bound).all(), name
    with torch.no_grad():
        adapted = m(batch)
        lora.merge(m)
        assert not list(lora.adapted(m)) and not any("lora" in n for n in m.state_dict())
        plain = build()
        assert m.state_dict().keys() == plain.state_dict().keys()
        out = m(batch)
    assert (out - adapted).abs().max() <= INVARIANCE  # the whole network: the same sums in another order


@pytest.mark.parametrize("overrides,key", [
    (["lora.rank=-1"], "lora.rank"),
    (["lora.targets=linear_qkv,q_proj"], "lora.targets"),
    (["lora.alpha=0"], "lora.alpha"),
    (["lora.alpha=-2"], "lora.alpha"),
    (["lora.dropout=1.0"], "lora.dropout"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "model.freeze_language_model=true"],
     "model.freeze_language_model"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.vision_tower=true",
      "model.freeze_vision_encoder=true"], "model.freeze_vision_encoder"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.projector=true",
      "model.freeze_vision_projector=true"], "model.freeze_vision_projector"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.targets=in_proj", "lora.projector=true"],
     "lora.projector"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.targets=[]"], "lora.targets"),
    (["lora.rank=8"], "model.moe_router_bias_update_rate"),
])
def test_bad_lora_settings_are_one_line_config_errors(overrides, key):
    from config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_lora_section_loads_from_toml_and_round_trips(tmp_path):
    from config import from_dict, load_config, to_dict

    path = tmp_path / "lora.toml"
    path.write_text('[model]\nmoe_router_bias_update_rate = 0.0\n[lora]\nrank = 16\nalpha = 32\n'
                    'targets = ["linear_qkv", "in_proj", "out_proj"]\n')
    cfg = load_config(path, ["lora.dropout=0.05"])
    assert (cfg.lora.rank, cfg.lora.targets, cfg.lora.dropout) == (16, ["linear_qkv", "in_proj", "out_proj"], 0.05)
    assert from_dict(to_dict(cfg)).lora == cfg.lora


def test_peft_export_loads_in_transformers_with_our_logits(world, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import lora
    from config import LoraConfig

    kw = dict(rank=4, alpha=8.0)  # the language model's targets and the shared experts
    m = build(kw)
    randomize_b(m, std=0.05)
    lora.save_peft(m, tmp_path, TINY, LoraConfig(**kw))
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = NemotronH_Omni_Reasoning_V3.from_pretrained(TINY).eval()
    with torch.no_grad():
        base = ref.language_model(input_ids=ids).logits[0]
        peft_model = PeftModel.from_pretrained(ref, tmp_path).eval()
        theirs = peft_model.base_model.model.language_model(input_ids=ids).logits[0]
        ours = m({"input_ids": ids})
    print(f"peft: vs base {(ours - base).abs().max():.3g}, vs transformers + peft {(ours - theirs).abs().max():.3g}")
    assert (ours - base).abs().max() > 100 * PARITY  # the adapters matter ...
    assert (ours - theirs).abs().max() <= PARITY  # ... and transformers + peft apply them as we do
    n_lora = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert n_lora == 2 + 4 + 2 + 2 + 2 + 2  # layers M * E M - E: in/out, q/k/v/o, shared up/down, in/out, up/down, ...
    # q / k / v share A; B is split by rows (GQA: k and v have half of q's rows here)
    sd = dict(peft_model.named_parameters())
    qa, ka = (sd[f"base_model.model.language_model.model.layers.1.mixer.{p}_proj.lora_A.default.weight"] for p in "qk")
    assert torch.equal(qa, ka)


def test_two_rank_tensor_parallel_adapters_match_one_rank(torchrun):
    worker = Path(__file__).resolve().parent / "dist" / "check_lora.py"
    result = torchrun(worker, env={"OMP_NUM_THREADS": "1"}).result
    assert set(result) == {"tp2_sp"}
    for layout, r in result.items():
        assert "error" not in r, (layout, r)
        assert r["logits"] <= INVARIANCE, (layout, r)
        assert r["adapter_grads_rel"] <= INVARIANCE, (layout, r)
        assert r["logits_changed"] > 0.01, (layout, r)
