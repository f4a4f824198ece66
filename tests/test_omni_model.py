"""omni_model: parity with transformers, packing / vision-once-per-pair invariances, HF import/export, 2 ranks.

Run: `pytest tests/test_omni_model.py` (CPU, fp32, gloo; about a minute: one in-process world of size 1 plus one
2-rank torchrun launch). The reference is transformers' own implementation loaded from the same files
(`NemotronH_Omni_Reasoning_V3`, whose `.language_model` is `NemotronHForCausalLM`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import raises_naming  # noqa: E402
from omni_model_cases import TINY, image_text_inputs, logits_and_grads, make_pair_batch  # noqa: E402

import pack  # noqa: E402

PARITY = 1e-4  # logits max-abs vs transformers
INVARIANCE = 1e-5  # packed = unpacked, TP/EP/CP = 1 rank, vision once per pair


@pytest.fixture(scope="module")
def world():
    import distributed

    distributed.init_distributed()


@pytest.fixture(scope="module")
def model(world):
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(), ParallelConfig())
    report = hf_weights.load_hf_weights(m, TINY)
    m.load_report = report
    return m.eval()


@pytest.fixture(scope="module")
def reference():
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    return NemotronH_Omni_Reasoning_V3.from_pretrained(TINY).eval()


@pytest.fixture(scope="module")
def image_text_batch():
    return image_text_inputs()


# ----------------------------------------------------------------------------------------------------------------------
# parity with transformers


def test_text_logits_match_transformers(model, reference):
    from transformers import NemotronHForCausalLM

    lm = reference.language_model
    assert isinstance(lm, NemotronHForCausalLM)
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model({"input_ids": ids})
        ref = lm(input_ids=ids).logits[0]
    assert ours.shape == ref.shape == (40, 1024)
    assert (ours - ref).abs().max().item() <= PARITY


def test_image_text_logits_match_transformers(model, reference, image_text_batch):
    b = image_text_batch
    gh, gw = b["image_grid_hw"][0].tolist()
    assert gh != gw  # a non-square grid: catches a wrong pixel-shuffle order
    with torch.no_grad():
        ref = reference(**b).logits[0]
        ours = model({"input_ids": b["input_ids"], "pixel_values": b["pixel_values"],
                      "image_grid_hw": b["image_grid_hw"]})
        text_only = model({"input_ids": b["input_ids"].masked_fill(b["input_ids"] == 18, 100)})
    assert (ours - ref).abs().max().item() <= PARITY
    assert (text_only - ref).abs().max().item() > 1e-2  # the image features matter


def test_active_params_counts_the_language_models_matmul_parameters(model, reference):
    """monitor.active_params (the N of MFU) = transformers' NemotronHForCausalLM parameters (the same checkpoint) less
    the input embedding table, with num_experts_per_tok / n_routed_experts of the routed experts (the shared expert
    whole, the LM head kept); the RADIO ViT and the projector are not counted."""
    import monitor

    text = json.loads((TINY / "config.json").read_text())["llm_config"]
    lm = reference.language_model
    assert not text["tie_word_embeddings"]
    total = sum(p.numel() for p in lm.parameters())
    embedding = lm.get_input_embeddings().weight.numel()
    routed = sum(p.numel() for n, p in lm.named_parameters() if ".mixer.experts." in n)
    assert (total, embedding, routed) == (262256, 1024 * 64, 2 * 4 * 2 * 32 * 64)
    want = total - embedding - routed + routed * text["num_experts_per_tok"] // text["n_routed_experts"]
    assert monitor.active_params(model, model.hf) == want == 180336
    towers = (model.vision_model, model.vision_projection, model.sound_encoder, model.sound_projection)
    media = sum(p.numel() for m in towers for p in m.parameters())
    assert media > 0 and sum(p.numel() for p in model.parameters()) == total + media  # the encoders are left out


def test_mamba_dt_clamp_follows_the_switch(model, reference):
    """The clamp min(softplus(dt + dt_bias)) >= limit reaches megatron's scan: with a limit large enough to bind
    (2.0; the checkpoint's time_step_min 0.001 rarely binds on random weights) ours = transformers with the same
    time_step_limit, ours without clamp = transformers with (0, inf), and the two differ."""
    ids = torch.randint(32, 1000, (1, 24), generator=torch.Generator().manual_seed(1))
    mixers = [(layer.mixer, reference.language_model.model.layers[i].mixer)
              for i, layer in enumerate(model.language_model.decoder.layers) if hasattr(layer, "mixer")]
    assert len(mixers) == 2
    assert all(ours.dt_limit == (0.001, float("inf")) for ours, _ in mixers)  # default = the reference's semantics
    saved = [ref.time_step_limit for _, ref in mixers]
    out = {}
    try:
        for limit in ((2.0, float("inf")), None):
            for ours, ref in mixers:
                ours.dt_limit, ref.time_step_limit = limit, limit or (0.0, float("inf"))
            with torch.no_grad():
                out[limit] = model({"input_ids": ids}), reference.language_model(input_ids=ids).logits[0]
    finally:
        for (ours, ref), lim in zip(mixers, saved, strict=True):
            ours.dt_limit, ref.time_step_limit = (0.001, float("inf")), lim
    (clamped, ref_clamped), (free, ref_free) = out[(2.0, float("inf"))], out[None]
    # the Mamba share of these tiny random logits is small: compare against a tolerance 10x below the switch's effect
    effect = (clamped - free).abs().max().item()
    assert effect > 2e-5
    assert (clamped - ref_clamped).abs().max().item() <= effect / 10
    assert (free - ref_free).abs().max().item() <= effect / 10


# ----------------------------------------------------------------------------------------------------------------------
# invariances


def _alone(batch: dict, s: int) -> tuple[dict, int, int]:
    """Sequence s of a packed batch as its own batch (its own media slot); returns (batch, start, real length)."""
    a, b = int(batch["cu_seqlens_padded"][s]), int(batch["cu_seqlens_padded"][s + 1])
    n = int(batch["cu_seqlens"][s + 1] - batch["cu_seqlens"][s])
    one = {"input_ids": batch["input_ids"][:, a:b], "cu_seqlens": torch.tensor([0, n], dtype=torch.int32),
           "cu_seqlens_padded": torch.tensor([0, b - a], dtype=torch.int32)}
    slot = int(batch["media_index"][s])
    lo, hi = batch["media_image_offsets"][slot:slot + 2].tolist()
    grids = batch["image_grid_hw"]
    p0 = int(grids[:lo].prod(-1).sum())
    p1 = p0 + int(grids[lo:hi].prod(-1).sum())
    one.update(pixel_values=batch["pixel_values"][p0:p1], image_grid_hw=grids[lo:hi], media_index=torch.tensor([0]),
               media_image_offsets=torch.tensor([0, hi - lo]))
    return one, a, n


def test_packed_equals_unpacked(model):
    """Two sequences (with images, padded) in one THD row give the logits of each run alone: no conv / SSM state or
    attention crosses the boundary."""
    batch = make_pair_batch(seed=5, lens=(19, 27), divisible_by=8)
    assert not torch.equal(batch["cu_seqlens"], batch["cu_seqlens_padded"])  # real padding between sequences
    with torch.no_grad():
        packed = model(batch)
        for s in range(2):
            one, a, n = _alone(batch, s)
            alone = model(one)
            assert (packed[a:a + n] - alone[:n]).abs().max().item() <= INVARIANCE
        # the boundary is real: the same second row after a different first row changes nothing, while a model
        # without packing metadata (one long sequence) does see the first row
        whole = model({k: v for k, v in batch.items() if k not in ("cu_seqlens", "cu_seqlens_padded",
                                                                      "media_index", "media_image_offsets")}
                      | {"pixel_values": torch.cat([batch["pixel_values"]] * 2),
                         "image_grid_hw": torch.cat([batch["image_grid_hw"]] * 2)})
    a, n = int(batch["cu_seqlens_padded"][1]), int(batch["cu_seqlens"][2] - batch["cu_seqlens"][1])
    assert (whole[a:a + n] - packed[a:a + n]).abs().max().item() > 1e-3


def test_vision_once_per_pair_equals_per_sequence_encoding(model):
    shared = make_pair_batch(seed=9, lens=(21, 30))
    per_row = make_pair_batch(seed=9, lens=(21, 30), duplicate_media=True)
    assert torch.equal(shared["input_ids"], per_row["input_ids"])
    l1, g1 = logits_and_grads(model, shared)
    l2, g2 = logits_and_grads(model, per_row)
    assert (l1 - l2).abs().max().item() <= INVARIANCE
    assert set(g1) == set(g2) and any(n.startswith("vision_model.") for n in g1)
    for n in g1:
        scale = max(g2[n].abs().max().item(), 1e-6)
        assert (g1[n] - g2[n]).abs().max().item() / scale <= INVARIANCE, n


def _routers(m) -> list:
    return [x for x in m.language_model.modules() if hasattr(x, "expert_bias")]


def _routing_step(m, batch, weight: float = 1.0):
    """Training-mode forward + backward of a fixed scalar of the real tokens' logits (times `weight`): the routers'
    token counts [n_routers, E] and their weight gradients (main loss + aux loss)."""
    for r in _routers(m):
        r.local_tokens_per_expert.zero_()
    m.zero_grad(set_to_none=True)
    logits = m(batch)
    real = ~pack.routing_padding_mask(batch["cu_seqlens"], batch["cu_seqlens_padded"], logits.shape[0])
    w = torch.randn(int(real.sum()), logits.shape[1], generator=torch.Generator().manual_seed(11))
    ((logits[real] * w).sum() * weight).backward()
    counts = torch.stack([r.local_tokens_per_expert.clone() for r in _routers(m)])
    grads = torch.stack([r.weight.grad.detach().clone() for r in _routers(m)])
    return counts, grads


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_padding_and_dummy_bins_take_no_part_in_routing_statistics(world, recompute):
    """The expert-bias token counts and the aux loss see only real tokens. The same pair padded to a
    multiple of 8 or of 64 gives the same counts (sum = real tokens x top-k) and the same router gradients; a dummy
    bin (sample_mask 0, loss weight 0) counts nothing and adds no gradient (before: its aux loss did). With
    activation recomputation too (before: the recomputed forward ran the routers in training mode, and the dummy
    bin's aux loss of 0 tokens gave NaN router gradients)."""
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    m = om.build_model(TINY, ModelConfig(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1,
                                         recompute=recompute), ParallelConfig())
    hf_weights.load_hf_weights(m, TINY)
    m.train()
    topk, n_real = m.lm_config.moe_router_topk, 21 + 30
    c8, g8 = _routing_step(m, make_pair_batch(seed=3, lens=(21, 30), divisible_by=8))
    c64, g64 = _routing_step(m, make_pair_batch(seed=3, lens=(21, 30), divisible_by=64))
    assert len(c8) == 2 and c8.sum(dim=1).tolist() == [n_real * topk] * 2
    assert torch.equal(c8, c64)
    assert (g8 - g64).abs().max().item() <= INVARIANCE * g8.abs().max().item()
    dummy = make_pair_batch(seed=3, lens=(21, 30), divisible_by=8) | {"sample_mask": torch.zeros(2)}
    cd, gd = _routing_step(m, dummy, weight=0.0)
    assert not cd.any() and not gd.any() and torch.isfinite(gd).all()
    assert all(r.training for r in _routers(m))  # back in training mode for the next row


def test_image_token_count_mismatch_names_both_counts(model):
    batch = make_pair_batch(seed=2)
    first = int((batch["input_ids"][0] == 18).nonzero()[0])
    batch["input_ids"] = batch["input_ids"].clone()
    batch["input_ids"][0, first] = 100
    with raises_naming(ValueError, "sequence 0: ", "5 <image> tokens (id 18)", "media slot 0 gives 6"):
        model(batch)
    flat = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_hw")}
    with raises_naming(ValueError, "11 <image> tokens (id 18)", "6 features"):
        model(flat)
    odd = make_pair_batch(seed=2, grid=(3, 4))
    with raises_naming(ValueError, "image grid 3x4"):
        model(odd)


# ----------------------------------------------------------------------------------------------------------------------
# config mapping, options


def test_config_mapping_hub_and_native_layouts(tmp_path, model):
    import omni_model as om

    hub = json.loads((TINY / "config.json").read_text())
    llm = dict(hub["llm_config"])
    pattern = llm.pop("hybrid_override_pattern")
    llm["layers_block_type"] = [{"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}[c] for c in pattern]
    native = {"model_type": "nemotron_h_omni", "text_config": llm, "vision_config": hub["vision_config"],
              "vision_hidden_size": 32, "projector_hidden_size": 96, "downsample_ratio": 0.5, "image_token_id": 18}
    (tmp_path / "config.json").write_text(json.dumps(native))
    a, b = om.read_hf_config(TINY), om.read_hf_config(tmp_path)
    assert a.pattern == b.pattern == "M*EM-E"
    assert (a.vision_hidden_size, a.projector_hidden_size, a.image_token_id, a.num_prefix_tokens) == \
        (b.vision_hidden_size, b.projector_hidden_size, b.image_token_id, b.num_prefix_tokens) == (32, 96, 18, 10)
    c = model.lm_config
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (6, 64, 4, 2, 16)
    assert (c.mamba_num_heads, c.mamba_head_dim, c.mamba_state_dim, c.mamba_num_groups) == (8, 16, 16, 2)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size) == \
        (4, 2, 32, 48)
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_topk_scaling_factor) == \
        ("sigmoid", True, 2.5)
    v = model.vit_config
    assert (v.num_layers, v.hidden_size, v.ffn_hidden_size, v.layernorm_epsilon, v.normalization) == \
        (2, 32, 128, 1e-6, "LayerNorm")
    (tmp_path / "config.json").write_text(json.dumps(hub | {"video_pruning_rate": 0.7}))  # the hub checkpoint's EVS
    assert (a.video_pruning_rate, om.read_hf_config(tmp_path).video_pruning_rate) == (0.0, 0.7)
    (tmp_path / "config.json").write_text(json.dumps(hub | {"video_pruning_rate": -0.5}))
    with raises_naming(ValueError, f"{tmp_path / 'config.json'}: ", "video_pruning_rate -0.5", "[0, 1]"):
        om.read_hf_config(tmp_path)
    hub["ps_version"] = "v1"
    (tmp_path / "config.json").write_text(json.dumps(hub))
    with raises_naming(ValueError, f"{tmp_path / 'config.json'}: ", "ps_version 'v1'", "'v2'"):
        om.read_hf_config(tmp_path)


def test_options_freeze_and_no_dt_clamp(world):
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    cfg = ModelConfig(freeze_vision_encoder=True, freeze_vision_projector=True, mamba_dt_clamp=False)
    m = om.build_model(TINY, cfg, ParallelConfig())
    trainable = {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {"language_model", "sound_encoder", "sound_projection"}
    assert all(layer.mixer.dt_limit is None for layer in m.language_model.decoder.layers if hasattr(layer, "mixer"))
    m = om.build_model(TINY, ModelConfig(freeze_language_model=True), ParallelConfig())
    assert {n.split(".")[0] for n, p in m.named_parameters() if p.requires_grad} == {
        "vision_model", "vision_projection", "sound_encoder", "sound_projection"}


@pytest.mark.parametrize("n_shared", [1, 2])
def test_shared_expert_width_is_the_checkpoints_total(world, tmp_path, n_shared):
    """`moe_shared_expert_intermediate_size` is already the total shared-expert width (transformers builds
    one shared MLP of that width whatever n_shared_experts says), so a checkpoint with n_shared_experts = 2 loads
    (before: megatron shape (96, 64) vs (48, 64)) and gives transformers' logits."""
    import shutil

    from transformers import NemotronHForCausalLM
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    hf_dir = tmp_path / "tiny"
    shutil.copytree(TINY, hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["llm_config"]["n_shared_experts"] = n_shared
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    ref = NemotronH_Omni_Reasoning_V3.from_pretrained(hf_dir).eval().language_model
    assert isinstance(ref, NemotronHForCausalLM) and ref.config.n_shared_experts == n_shared
    shared = ref.model.layers[2].mixer.shared_experts.up_proj.weight
    m = om.build_model(hf_dir, ModelConfig(), ParallelConfig())
    hf_weights.load_hf_weights(m, hf_dir)
    mine = m.language_model.decoder.layers[2].mlp.shared_experts.linear_fc1.weight
    assert m.lm_config.moe_shared_expert_intermediate_size == 48 and mine.shape == shared.shape == (48, 64)
    ids = torch.randint(32, 1000, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (m.eval()({"input_ids": ids}) - ref(input_ids=ids).logits[0]).abs().max().item() <= PARITY


def test_bias_update_rate_is_a_key_and_frozen_with_the_language_model():
    """megatron-core's moe_router_bias_update_rate comes from model.moe_router_bias_update_rate (default
    megatron-core's 1e-3) and is 0 when the language model is frozen."""
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    hf = om.read_hf_config(TINY)
    rate = [om.language_config(hf, m, ParallelConfig(), False).moe_router_bias_update_rate
            for m in (ModelConfig(), ModelConfig(moe_router_bias_update_rate=0.01),
                      ModelConfig(moe_router_bias_update_rate=0.01, freeze_language_model=True))]
    assert rate == [1e-3, 0.01, 0.0]


# ----------------------------------------------------------------------------------------------------------------------
# HF import / export


def test_import_export_is_bit_identical_and_reloads_in_transformers(model, reference, image_text_batch, tmp_path):
    from safetensors import safe_open
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import hf_weights

    assert model.load_report["untouched"] == {"sound_encoder.encoder.feature_extractor.": 2,
                                              "vision_model.radio_model.input_conditioner.": 2,
                                              "vision_model.radio_model.summary_idxs": 1}
    out = tmp_path / "export"
    hf_weights.export_hf(model, out, TINY)
    src_index = json.loads((TINY / "model.safetensors.index.json").read_text())["weight_map"]
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == src_index
    with safe_open(TINY / "model.safetensors", "pt") as a, safe_open(out / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and torch.equal(x, y), k
    reloaded = NemotronH_Omni_Reasoning_V3.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**image_text_batch).logits, reference(**image_text_batch).logits)


def test_unknown_checkpoint_key_is_an_error(model, tmp_path):
    from safetensors.torch import load_file, save_file

    import hf_weights

    sd = load_file(TINY / "model.safetensors")
    sd["language_model.backbone.layers.0.mixer.extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())
    with raises_naming(ValueError, f"{tmp_path}: ", "1 checkpoint keys",
                       "language_model.backbone.layers.0.mixer.extra.weight"):
        hf_weights.load_hf_weights(model, tmp_path)
    hf_weights.load_hf_weights(model, TINY)  # restore the module fixture's tensors and untouched-key list


# ----------------------------------------------------------------------------------------------------------------------
# core attention of the local spec: per-sequence SDPA against a dense block-diagonal float64 reference


def _dense_attention(q, k, v, seg, causal):
    """softmax(q k^T / sqrt(d) + mask) v over the whole row, [t, h, d] (k/v groups repeated), float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    pos = torch.arange(q.shape[0])
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v).flatten(1)


def _core_attention(causal, cp=1, cp_rank=0):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from backend import local_spec

    cfg = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=8, attention_dropout=0.0,
                          context_parallel_size=cp)
    group = SimpleNamespace(size=lambda: cp, rank=lambda: cp_rank)
    pgs = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=group)
    mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return local_spec.ThdDotProductAttention(cfg, 1, mask_type, pg_collection=pgs)


@pytest.mark.parametrize("causal", [True, False])
def test_core_attention_per_sequence_equals_dense_reference(causal, monkeypatch):
    """Packed row of sequences 5, 0, 9, 2 plus 3 trailing padding tokens (their own sequence), GQA 4/2 heads; and
    CP = 2 on a padded row (8, 16, 4), each rank's output and gradients against the same dense reference."""
    from types import SimpleNamespace

    import megatron.core.tensor_parallel.mappings as mappings

    from pack import cp_partition_index

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 14, 16], dtype=torch.int32)
    T = 19
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    seg = pack.token_sequence_ids(cu, T)
    psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=cu, cu_seqlens_q=cu)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = _core_attention(causal)(qs, ks, vs, packed_seq_params=psp)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = _dense_attention(qr, kr, vr, seg, causal)
    assert (out - ref).abs().max() < 1e-12
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        assert (a.grad - b.grad).abs().max() < 1e-12

    # CP = 2: rank r holds chunks r and 3-r of every sequence; the K/V all-gather returns the rank-major slices
    cu = torch.tensor([0, 8, 24, 28], dtype=torch.int32)
    T = 28
    q, k, v = (torch.randn(T, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    ref = _dense_attention(q, k, v, pack.token_sequence_ids(cu, T), causal)
    idx = [cp_partition_index(cu, 2, r) for r in range(2)]
    gathered = []
    monkeypatch.setattr(mappings, "gather_from_sequence_parallel_region", lambda t, *a, **kw: gathered.pop(0))
    psp = SimpleNamespace(qkv_format="thd", cu_seqlens_q_padded=cu, cu_seqlens_q=cu)
    for r in range(2):
        gathered[:] = [torch.cat([t[i] for i in idx]).unsqueeze(1) for t in (k, v)]  # THD: [t, 1, h, d]
        out = _core_attention(causal, cp=2, cp_rank=r)(q[idx[r]], k[idx[r]], v[idx[r]], packed_seq_params=psp)
        assert not gathered and (out - ref[idx[r]]).abs().max() < 1e-12


# ----------------------------------------------------------------------------------------------------------------------
# 2 ranks: TP=2 (+SP), EP=2, CP=2, DP=2 against one rank, weights from the same HF files


def test_two_rank_layouts_match_one_rank(torchrun):
    worker = Path(__file__).resolve().parent / "dist" / "check_omni_model.py"
    result = torchrun(worker, env={"OMP_NUM_THREADS": "1"}).result
    assert set(result) == {"tp2_sp", "ep2", "cp2", "dp2"}
    for layout, r in result.items():
        pairs = 2 if layout == "dp2" else 1  # DP=2: one pair per rank, the reference both
        assert "error" not in r, (layout, r)
        assert r["logits"] <= INVARIANCE, (layout, r)
        assert max(r["grads_rel"].values()) <= INVARIANCE, (layout, r)
        assert any(k.startswith("sound_encoder.") for k in r["grads_rel"]), r  # the replicated sound encoder too
        # expert-bias token counts: the real tokens (32 + 40 a pair) x top-2 per router, padding excluded, in every
        # layout
        assert r["tokens_per_expert"] == r["ref_tokens_per_expert"], (layout, r)
        assert [sum(c) for c in r["ref_tokens_per_expert"]] == [pairs * (32 + 40) * 2] * 2, (layout, r)
        # monitor.active_params is global: the one-rank count (test_active_params_...) in every layout
        assert r["active_params"] == r["ref_active_params"] == 180336, (layout, r)


def test_recompute_full_gives_the_same_gradients(model, world):
    import hf_weights
    import omni_model as om
    from config import ModelConfig, ParallelConfig

    r = om.build_model(TINY, ModelConfig(recompute="full"), ParallelConfig())
    hf_weights.load_hf_weights(r, TINY)
    r.train()
    assert r.lm_config.recompute_granularity == "full"
    batch = make_pair_batch(seed=4)
    l1, g1 = logits_and_grads(model, batch)
    l2, g2 = logits_and_grads(r, batch)
    assert torch.equal(l1, l2)
    assert set(g1) == set(g2) and all(torch.allclose(g1[n], g2[n], rtol=0, atol=1e-6) for n in g1)


@pytest.mark.parametrize("script", ["hf_weights.py"])
def test_smoke_script_help_and_missing_checkpoint(script, tmp_path):
    """The smoke run (`python hf_weights.py`): argparse answers --help and a directory without config.json (exit 2,
    one line) before any model work or process group."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run([sys.executable, script, *a], cwd=root, capture_output=True, text=True,  # noqa: E731
                                    timeout=60)  # fmt: skip
    help_ = run("--help")
    assert help_.returncode == 0 and help_.stdout.startswith(f"usage: python {script} [-h] [hf_dir]")
    bad = run(str(tmp_path))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[-1] == (
        f"python {script}: error: {tmp_path}: no config.json (not an HF checkpoint directory)")
