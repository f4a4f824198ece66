"""Full-size checks without weights: the shipped Nano config (assets/nano-omni-config) against the published
parameter counts and transformers' model, the HF key map at TP 1 and TP 8 / EP 8, plan.py's table of
configs/nano.toml (golden), its calibration against the recorded H200 benchmark, and its layout errors.

Every model here is built on the meta device (plan.fake_rank / plan.build_rank): no weights, no model memory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import raises_naming

import config as config_mod
import hf_weights
import omni_model
import plan

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "assets" / "nano-omni-config"
GOLDEN = Path(__file__).resolve().parent / "golden" / "plan_nano.txt"
NANO_ARGS = ["configs/nano.toml", f"model.hf_path={NANO}"]


def nano_cfg(*overrides: str):
    return config_mod.load_config(ROOT / "configs" / "nano.toml", [f"model.hf_path={NANO}", *overrides])


@pytest.fixture(scope="module")
def transformers_model():
    """transformers' NemotronH_Omni_Reasoning_V3 of the shipped config on the meta device."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    raw = json.loads((NANO / "config.json").read_text())
    cfg = NemotronH_Omni_Reasoning_V3_Config(**{k: v for k, v in raw.items() if k not in ("architectures",
                                                                                          "model_type")})
    with torch.device("meta"):
        return NemotronH_Omni_Reasoning_V3(cfg)


@pytest.fixture(scope="module")
def hub_shapes(transformers_model):
    """{hub checkpoint key: shape} of transformers' model, through transformers' own inverse of its load-time key
    conversion (the names and layout of the hub checkpoint that hf_weights reads)."""
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(transformers_model, transformers_model.state_dict())
    return {k: tuple(v.shape) for k, v in sd.items()}


# transformers-only tensors: the RADIO blocks' layer scales (identity, absent from the hub checkpoint:
# test_foundation checks they load as ones)
def _transformers_only(key: str) -> bool:
    return "layer_scale" in key


@pytest.fixture(scope="module", params=[(1, 1), (8, 8)], ids=["tp1", "tp8-ep8"])
def megatron_rank(request):
    """(hf_param_map, {name: local shape}, global counts, TP, EP) of rank 0 of nano.toml's layout at (TP, EP)."""
    tp, ep = request.param
    cfg = nano_cfg(f"parallel.tensor_model_parallel_size={tp}", f"parallel.expert_model_parallel_size={ep}",
                   f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}")
    hf = omni_model.read_hf_config(NANO)
    with plan.fake_rank(cfg, max(tp, ep), 0, hf.text.n_routed_experts):
        with plan._MetaAllocations():
            model = omni_model.build_model(NANO, cfg.model, cfg.parallel)
        maps = hf_weights.hf_param_map(model)
        shapes = {n: tuple(t.shape) for n, t in hf_weights._model_tensors(model).items()}
        counts = plan.global_counts(model, hf)
    return maps, shapes, counts, tp, ep


def test_parameter_counts_match_transformers_and_the_published_totals(transformers_model, hub_shapes):
    """Exact: the megatron model's global counts per component equal transformers' model of the same config (its
    vision tower, video embedder included, without the identity layer scales). Published:
    - 33,015,546,816 parameters in the hub checkpoint (transformers' parameters less its 81,920 layer-scale ones):
      Megatron-Bridge's verification card of the converted Omni checkpoint (examples/model_verification_cards/
      nemotron-3-nano-omni-30b-a3b-reasoning/card.yaml, an earlier revision than the one stored here);
    - 6,243 tensors of the language model: Megatron-Bridge's Nemotron-3-Nano-30B-A3B card ("all 6,243 exported BF16
      weights", examples/model_verification_cards/nemotron-3-nano-30b-a3b/card.yaml);
    - 31.6B total and about 3.2B active parameters per token (3.6B with the embeddings): NVIDIA's Nemotron 3 Nano
      30B-A3B model card, i.e. the language model (active: monitor.active_params, without the input embedding)."""
    hf = omni_model.read_hf_config(NANO)
    cfg = nano_cfg()
    with plan.fake_rank(cfg, 8, 0, hf.text.n_routed_experts):
        with plan._MetaAllocations():
            model = omni_model.build_model(NANO, cfg.model, cfg.parallel)
        counts = plan.global_counts(model, hf)

    def tf(prefix: str, skip=("layer_scale",)) -> int:
        return sum(p.numel() for n, p in transformers_model.named_parameters()
                   if n.startswith(prefix) and not any(s in n for s in skip))

    assert counts["language_model"] == tf("language_model.") == 31_577_937_344
    assert counts["vision_model"] == tf("vision_model.")
    assert counts["vision_projection"] == tf("multi_modal_projector.")
    assert counts["sound_encoder"] == tf("audio_tower.") and counts["sound_projection"] == tf("embed_audio.")
    assert tf("") == 33_015_546_816 == counts["total"] + tf("vision_model.", ("layer_scale",)) - counts["vision_model"]
    assert sum(k.startswith("language_model.") for k in hub_shapes) == 6243
    assert round(counts["language_model"] / 1e9, 1) == 31.6
    embedding = hf.text.vocab_size * hf.text.hidden_size
    assert round(counts["active"] / 1e9, 1) == 3.2 and round((counts["active"] + embedding) / 1e9, 1) == 3.6


def test_every_hub_key_maps_to_megatron_slices_and_back(megatron_rank, hub_shapes):
    """Import and export are one bijection at full size: every megatron tensor of every rank of its group is the
    concatenation of hub slices of matching shape, and the slices of all ranks tile each mapped hub tensor exactly
    once (what export lays back). What no slice covers is exactly the untrained components (hf_weights'
    UNTOUCHED_PREFIXES: RADIO's summary indices; NeMo's mel featurizer buffers of the hub checkpoint
    are no transformers tensors), which
    load_hf_weights keeps aside and export_hf writes back unchanged; transformers' identity layer scales are not
    hub keys."""
    maps, shapes, _, tp, ep = megatron_rank
    assert set(maps) == set(shapes)
    spans: dict[str, list[tuple[int, int, int]]] = {}  # hub key -> (dim, start, end) of every slice
    for name, pm in maps.items():
        size = {"tp": tp, "ep": ep, None: 1}[pm.group]
        for r in range(size):
            if not shapes[name]:  # a 0-d tensor (BatchNorm's num_batches_tracked): whole
                (s,) = pm.slices(r, size)
                assert hub_shapes[s.key] == () and s.length is None, name
                spans.setdefault(s.key, []).append((0, 0, 0))
                continue
            along = 0
            for s in pm.slices(r, size):
                full = hub_shapes[s.key]
                n = full[pm.dim] if s.length is None else s.length
                assert s.start + n <= full[pm.dim], (name, s)
                rest = [d for i, d in enumerate(full) if i != pm.dim]
                assert rest == [d for i, d in enumerate(shapes[name]) if i != pm.dim], (name, s.key, full)
                spans.setdefault(s.key, []).append((pm.dim, s.start, s.start + n))
                along += n
            assert along == shapes[name][pm.dim], (name, r)
    for key, parts in spans.items():
        parts.sort()
        assert len({d for d, _, _ in parts}) == 1, key
        dim = parts[0][0]
        assert parts[0][1] == 0 and parts[-1][2] == (hub_shapes[key][dim] if hub_shapes[key] else 0), (key, parts[:3])
        # no gap, no overlap
        assert all(a[2] == b[1] for a, b in zip(parts[:-1], parts[1:], strict=True)), (key, parts[:3])
    left = {k for k in hub_shapes if k not in spans and not _transformers_only(k)}
    assert any(k.startswith(("sound_encoder.", "sound_projection.")) for k in spans)  # the sound towers are mapped
    assert all(k.startswith(hf_weights.UNTOUCHED_PREFIXES) for k in left)
    assert left == {"vision_model.radio_model.summary_idxs"}


def test_plan_of_nano_is_the_golden_table(capsys):
    """`python plan.py configs/nano.toml model.hf_path=assets/nano-omni-config` in-process, in under two minutes;
    its output changes only when the layout, the model or the formula does (regenerate the file then)."""
    t0 = time.perf_counter()
    assert plan.main(NANO_ARGS) == 0
    seconds = time.perf_counter() - t0
    out = capsys.readouterr().out.replace(str(NANO), "assets/nano-omni-config")
    assert out == GOLDEN.read_text()
    assert seconds < 120


def test_plan_predicts_the_recorded_gpu_peak_within_15_percent():
    """The plan of `python -m bench --gpu`'s step (its config and checkpoint folder: gpu_step.step_config, one rank,
    the same pairs and bins) against the peak memory the H200 run recorded (bench/gpu_results.json;
    docs/PERFORMANCE.md, First GPU numbers): max_memory_allocated over the policy + reference + distributed Adam
    step."""
    import pack
    from bench import gpu, gpu_step, workload

    recorded = json.loads((ROOT / "bench" / "gpu_results.json").read_text())["gpu"]["step"]
    shape = gpu.GPU_SHAPE
    ckpt = gpu_step._shape_checkpoint(shape)
    cfg = gpu_step.step_config(ckpt, shape)
    hf = omni_model.read_hf_config(ckpt)
    assert (recorded["pattern"], recorded["hidden_size"], recorded["vocab_size"], recorded["dtype"]) == (
        hf.pattern, hf.text.hidden_size, hf.text.vocab_size, cfg.model.params_dtype)
    lengths = workload.pair_lengths(workload.text_pairs(shape["pairs"], shape["prompt"], shape["response"],
                                                  hf.text.vocab_size))
    step = pack.plan_step(lengths, cfg.packing, 1)
    sizes = pack.pair_bin_tokens(lengths, cfg.packing.make_sequence_length_divisible_by)
    bins = [sum(sizes[p] for p in b.pair_ids) for b in step.ranks[0]]
    assert len(bins) == recorded["microbatches_ours"] and recorded["pairs"] == shape["pairs"]
    assert 0 <= sum(bins) - recorded["tokens"] < len(lengths) * 2 * cfg.packing.make_sequence_length_divisible_by
    planned = gpu.plan_gpu_step(shape, plan.GPUS["141 GB"])  # what gpu.sized_gpu_shape asks
    assert planned["largest_bin"] == max(bins)
    predicted = planned["planned_bytes"]
    assert abs(predicted / recorded["peak_bytes_ours"] - 1) < 0.15, (predicted, recorded["peak_bytes_ours"])


@pytest.mark.parametrize("overrides, key", [
    (["parallel.expert_model_parallel_size=7"], "parallel.expert_model_parallel_size"),  # 128 experts
    (["parallel.tensor_model_parallel_size=3", "packing.make_sequence_length_divisible_by=24"],  # 32 heads
     "parallel.tensor_model_parallel_size"),
])
def test_a_wrong_layout_is_trains_one_line_config_error(overrides, key, capsys):
    """plan.py stops with the one line train.py prints for the same layout (the same checks in train.py's order:
    the packing rule, preflight.check_model_config, config.validate_parallel with the expert count), before any
    model is built."""
    import preflight

    assert plan.main([*NANO_ARGS, *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ConfigError: ") and key in err[0]
    cfg = nano_cfg(*overrides)
    hf = omni_model.read_hf_config(NANO)
    with pytest.raises(config_mod.ConfigError) as train_error:
        preflight.check_packing(cfg)
        preflight.check_model_config(cfg, hf)
        config_mod.validate_parallel(cfg, plan.default_world(cfg), hf.text.n_routed_experts)
    assert err[0] == f"error: ConfigError: {train_error.value}"


@pytest.mark.parametrize("content, names", [
    (None, "no config.json"),  # a missing folder
    ("{not json", "not a Hugging Face model config"),
    ('{"foo": 1}', "not a Hugging Face model config"),
    ('{"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 768}', "'bert'"),
])
def test_a_model_folder_that_is_not_an_omni_checkpoint_is_one_line(tmp_path, content, names, capsys):
    """Another architecture's config.json was a TypeError deep in omni_model.read_hf_config (train.py and
    plan.py), invalid JSON or a missing folder a traceback in plan.py; each is one ConfigError naming model.hf_path."""
    model = tmp_path / "model"
    if content is not None:
        model.mkdir()
        (model / "config.json").write_text(content)
    assert plan.main([str(ROOT / "configs" / "nano.toml"), f"model.hf_path={model}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: ConfigError: model.hf_path = '{model}': ") and names in err[0]


def test_an_unsupported_omni_setting_is_one_config_error_naming_the_key(tmp_path):
    import preflight

    hub = json.loads((NANO / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hub, "ps_version": "v1"}))
    with pytest.raises(config_mod.ConfigError) as e:
        preflight.read_model_config(str(tmp_path))
    assert str(e.value).startswith(f"model.hf_path = '{tmp_path}': ") and "ps_version" in str(e.value)
    assert preflight.read_model_config(str(NANO)).pattern == omni_model.read_hf_config(NANO).pattern


@pytest.mark.parametrize("pattern", ["M*EQ-E", "M*E"])  # an unknown layer symbol; 3 layers, the weights hold 6
def test_a_malformed_layer_pattern_is_one_line_in_plan_and_train(tmp_path, pattern, capsys):
    import preflight

    tiny = ROOT / "assets" / "tiny-omni"
    model = tmp_path / "model"
    shutil.copytree(tiny, model, ignore=lambda d, names: [n for n in names if n == "config.json"])
    hub = json.loads((tiny / "config.json").read_text())
    hub["llm_config"]["hybrid_override_pattern"] = pattern
    (model / "config.json").write_text(json.dumps(hub))
    with raises_naming(config_mod.ConfigError, "hybrid_override_pattern", model):
        preflight.read_model_config(str(model))  # train.py's check_inputs reads it so
    assert plan.main([str(ROOT / "configs" / "tiny.toml"), f"model.hf_path={model}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hybrid_override_pattern" in err[0]


@pytest.mark.parametrize("flags, flag", [(["--gpus", "-2"], "--gpus"), (["--gpus", "0"], "--gpus"),
                                         (["--image-tokens", "-5"], "--image-tokens"),
                                         (["--video-frames", "-1"], "--video-frames"),
                                         (["--audio-seconds", "nan"], "--audio-seconds"),
                                         (["--audio-seconds", "inf"], "--audio-seconds")])
def test_plan_flags_out_of_range_are_one_line(flags, flag, capsys):
    """--gpus -2 was torch's AssertionError, --gpus 0 silently the default, --image-tokens -5 accepted."""
    assert plan.main([*NANO_ARGS, *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: ConfigError: {flag} = ")


def test_a_world_of_one_before_the_plan_is_a_world_of_one_after():
    """A process that already has a world (a tool, another test) keeps one: the plan's fake worlds replace it while
    they run, then distributed.init_distributed makes a world of one again."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import distributed

    distributed.init_distributed()
    hf = omni_model.read_hf_config(NANO)
    with plan.fake_rank(nano_cfg(), 8, 3, hf.text.n_routed_experts):
        assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
        assert parallel_state.get_tensor_model_parallel_world_size() == 8
    assert (dist.get_world_size(), dist.get_rank()) == (1, 0)
    assert parallel_state.get_tensor_model_parallel_world_size() == 1


def test_two_nodes_shard_the_optimizer_over_dp():
    """16 GPUs (DP 2): megatron's gloo side groups run in the fake world too, and the distributed optimizer's masters
    (nano.toml: int16 remainders) of DP ranks 0 (rank 0) and 1 (rank 15) partition the rank's bf16 parameters
    exactly (padding holds no main parameter), as do the (bf16) moments; the fp32 gradient buffer stays whole on each
    DP rank."""
    p = plan.make_plan(nano_cfg("model.freeze_sound_encoder=false", "model.freeze_sound_projector=false"), 16)
    first, last = p.ranks if len(p.ranks) == 2 else (p.ranks[0], p.ranks[0])
    assert first.params == last.params
    assert first.master + last.master == 2 * first.params
    assert first.moments + last.moments == 2 * 2 * first.params
    assert first.grads >= 4 * first.params


def test_reserve_counts_the_communicators_and_the_verdict_keeps_its_margin():
    """The plan said "fits" with 0.6 GiB left and nothing counted for the CUDA context, NCCL's buffers or
    the allocator. The reserve is stated per GPU; "fits" needs plan.MARGIN to spare after it."""
    assert plan.communicators(nano_cfg(), 8) == ["world", "TP", "EP"]  # DP = CP = expert DP = 1: no communicator
    assert plan.communicators(nano_cfg(), 16) == ["world", "TP", "DP x CP", "EP", "expert DP"]
    connection = 4 * 2**20 + 4_915_200 + 524_288  # NCCL's Simple, LL128 and LL buffers at their defaults
    res = plan.reserve(nano_cfg(), 8)
    assert res.nccl == 3 * 32 * 2 * connection
    assert res.total(10 * plan.GiB) == plan.CUDA_CONTEXT + res.nccl + 0.05 * 10 * plan.GiB
    p = plan.make_plan(nano_cfg(), 8)
    (rank,) = p.ranks
    total = rank.total(p.activations(p.bin_tokens, p.image_tokens))
    for cap in plan.GPUS.values():
        assert p.spare(cap) == cap - total - (plan.CUDA_CONTEXT + res.nccl + 0.05 * total)
        assert p.fits(cap) == (p.spare(cap) >= plan.MARGIN)
        best = p.largest_bin(cap, 8)
        assert best == 0 or (p.spare(cap, best) >= plan.MARGIN > p.spare(cap, best + 8))
    assert plan.verdict(-plan.GiB).startswith("does NOT fit")
    assert plan.verdict(plan.MARGIN - 1).startswith("too tight")
    assert plan.verdict(plan.MARGIN).startswith("fits, 4.0 GiB to spare")


def test_image_tokens_come_from_the_data_index_else_the_processors_largest_image():
    """The plan counted text alone unless --image-tokens was given."""
    import mmpr_index

    hf = omni_model.read_hf_config(NANO)
    n, source = plan.image_tokens_per_bin(nano_cfg(), hf)  # no data index: one 13312-patch image, 2x2 shuffled
    assert n == 13312 // 4 and "13312 patches" in source
    assert plan.image_tokens_per_bin(nano_cfg("packing.max_sequences_per_bin=2"), hf)[0] == 2 * 3328
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [])
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    cfg.data.train.data_path = str(ROOT / cfg.data.train.data_path)
    train_split, _ = mmpr_index.load_splits(mmpr_index.load_processor(cfg.model.hf_path, "model.hf_path"), cfg.data)
    want = max(int(train_split.index.image_tokens[i]) for i in train_split.pair_ids)
    n, source = plan.image_tokens_per_bin(cfg, omni_model.read_hf_config(cfg.model.hf_path))
    assert n == want > 0 and cfg.data.train.data_path in source


def test_the_bins_plan_advises_are_bins_it_plans_as_fitting_and_train_accepts(capsys):
    """nano.toml, no data index (one image of 3328 tokens per pair): bins of 8 tokens hold no pair (train.py refuses
    them), and the largest bin the plan of 8 advises is one whose own plan fits, at its own image tokens."""
    small = plan.make_plan(nano_cfg("packing.max_tokens_per_bin=8"), 8)
    assert small.min_bin_tokens == 3328 and not small.fits(plan.GPUS["141 GB"])
    best = small.largest_bin(plan.GPUS["141 GB"], 8)
    assert best >= 3328
    advised = plan.make_plan(nano_cfg(f"packing.max_tokens_per_bin={best}"), 8)
    assert advised.image_tokens == 3328 and advised.fits(plan.GPUS["141 GB"])
    assert advised.largest_bin(plan.GPUS["141 GB"], 8) == best
    assert plan.main([*NANO_ARGS, "packing.max_tokens_per_bin=8"]) == 0
    out = capsys.readouterr().out
    assert "fits" not in out.split("141 GB GPUs")[1].split(";")[0] and "packing.max_tokens_per_bin" in out


def test_plan_of_nano_toml_as_shipped_uses_the_shipped_config(capsys):
    """`python plan.py configs/nano.toml` (model.hf_path, the hub id) was a FileNotFoundError traceback."""
    assert plan.main(["configs/nano.toml"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[-1].endswith("is a hub id not in the hub cache: planning with its config.json shipped in "
                                         "assets/nano-omni-config")
    assert out.replace(str(NANO), "assets/nano-omni-config") == GOLDEN.read_text()


def test_train_sets_expandable_segments_unless_the_user_chose_an_allocator_setting():
    """The reserve assumes expandable segments (plan.ALLOC_CONF); a user's PYTORCH_(CUDA_)ALLOC_CONF is kept."""
    import subprocess
    import sys

    probe = "import os, train; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    for env, want in (({}, plan.ALLOC_CONF), ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}, "backend:native"),
                      ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "None")):
        base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**base, **env}, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == want


FP32_MASTER = ("optimizer.use_precision_aware_optimizer=false", "optimizer.exp_avg_dtype=fp32",
               "optimizer.exp_avg_sq_dtype=fp32")  # megatron-core's fp32-master optimizer


def test_precision_aware_optimizer_counts_remainders_moments_in_their_dtype_and_no_gradient_copy():
    """nano.toml's precision-aware optimizer holds per parameter of this DP shard a 2-byte remainder (the fp32
    master's 4) and two bf16 moments (4 bytes, fp32's 8); with bf16 gradient buffers it reads them in place: the step
    adds only its chunk's temporaries, not megatron-core's fp32 copy."""
    from backend import precision_adam

    (full,) = plan.make_plan(nano_cfg(*FP32_MASTER), 8).ranks
    (pa,) = plan.make_plan(nano_cfg(), 8).ranks
    (pa16,) = plan.make_plan(nano_cfg("optimizer.grad_reduce_in_fp32=false", "optimizer.exp_avg_dtype=fp32",
                                      "optimizer.exp_avg_sq_dtype=fp32"), 8).ranks  # fmt: skip
    assert 2 * pa.master == full.master and 2 * pa.moments == full.moments == pa16.moments
    assert pa.grads == full.grads == 2 * pa16.grads and pa.master == pa16.master
    assert pa.grads_copy == pa16.grads_copy == precision_adam.STEP_TEMPORARY_BYTES and full.grads_copy == 0


def test_bf16_gradient_buffers_count_the_fp32_copy_of_the_optimizer_step():
    """megatron-core's optimizer gives each fp32 main parameter a fresh fp32 copy of its bf16 gradient at the step
    (docs/PERFORMANCE.md, Gradient buffers): the plan's peak holds it in place of the activations it outlives."""
    p32 = plan.make_plan(nano_cfg(*FP32_MASTER), 8)
    p16 = plan.make_plan(nano_cfg(*FP32_MASTER, "optimizer.grad_reduce_in_fp32=false"), 8)
    (r32,), (r16,) = p32.ranks, p16.ranks
    assert r32.grads == 2 * r16.grads and r32.grads_copy == 0 and r16.grads_copy == r16.master == r32.master
    act = p16.activations(p16.bin_tokens, p16.image_tokens)
    assert r16.total(act) == r16.static() + max(act, r16.master) == r32.total(act) - r16.grads + r16.master - act


def test_the_reference_pass_is_planned_apart_from_training():
    """With reference.logprobs = precomputed training holds no reference; the pass at the start holds the reference
    and a forward's activations without gradients at reference.max_tokens_per_bin, which `forward_only` counts."""
    online = plan.make_plan(nano_cfg("reference.logprobs=online"), 8)
    stored = plan.make_plan(nano_cfg("reference.logprobs=precomputed", "reference.max_tokens_per_bin=32768"), 8)
    (r_on,), (r_st,) = online.ranks, stored.ranks
    assert r_st.reference == 0 and r_st.reference_pass == r_on.reference == r_on.weights
    assert online.pass_total() == 0 and stored.pass_bin_tokens == 32768
    act = stored.activations
    assert stored.pass_total() == r_on.reference + act.forward_only(32768, stored.pass_image_tokens)
    for tokens in (4096, 16384, 65536):  # a forward keeps one layer's working set; training keeps every layer's input
        assert act.forward_only(tokens) < act(tokens)
    slope = act.forward_only(2 * 16384) - act.forward_only(16384)
    assert act.forward_only(4 * 16384) - act.forward_only(3 * 16384) == pytest.approx(slope, rel=1e-12)


def test_the_gpu_benchmark_sizes_its_step_to_the_device():
    """The GPU step at its full shape (about 106 GiB) did not fit an 80 GB H100. gpu.sized_gpu_shape
    takes the largest shape of the ladder that the plan fits in the device's memory: the full one on a 141 GB H200,
    a smaller one on an 80 GB H100, each within the plan (plan.MARGIN to spare after the reserve)."""
    from bench import gpu

    ladder = gpu.gpu_shape_ladder()
    assert ladder[0] == gpu.GPU_SHAPE
    planned = [gpu.plan_gpu_step(shape, plan.GPUS["80 GB"])["planned_bytes"] for shape in ladder]
    assert planned == sorted(planned, reverse=True)  # each rung plans less memory than the one before
    for capacity in plan.GPUS.values():
        shape, got = gpu.sized_gpu_shape(capacity)
        assert got["fits"] and got["capacity_bytes"] == capacity
        assert got["planned_bytes"] + got["reserve_bytes"] + plan.MARGIN <= capacity
        before = ladder[: ladder.index(shape)]  # every larger rung does not fit
        assert not any(gpu.plan_gpu_step(s, capacity)["fits"] for s in before)
    assert gpu.sized_gpu_shape(plan.GPUS["141 GB"])[0] == gpu.GPU_SHAPE
    assert gpu.sized_gpu_shape(plan.GPUS["80 GB"])[0] != gpu.GPU_SHAPE


# ---- LoRA (configs/nano-lora.toml) ----------
NANO_LORA_ARGS = ["configs/nano-lora.toml", f"model.hf_path={NANO}"]
GOLDEN_LORA = Path(__file__).resolve().parent / "golden" / "plan_nano_lora.txt"
TWO_GPUS = ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2",
            "parallel.sequence_parallel=true"]  # nano-lora.toml's layout for two 80 GB GPUs (its header)


def nano_lora_cfg(*overrides: str):
    return config_mod.load_config(ROOT / "configs" / "nano-lora.toml", [f"model.hf_path={NANO}", *overrides])


def lora_layer_shapes(hf) -> dict[str, tuple[str, int, int, int]]:
    """{target: (kind, in, out, layers)} of nano-lora.toml's adapted linears, from the model config alone: Mamba in_proj
    (z, x, B, C, dt) and out_proj, attention linear_qkv (GQA) and linear_proj, the shared expert's fc1 / fc2."""
    t = hf.text
    di, q = t.mamba_num_heads * t.mamba_head_dim, t.num_attention_heads * t.head_dim
    kv = t.num_key_value_heads * t.head_dim
    h, fs, n = t.hidden_size, t.moe_shared_expert_intermediate_size, hf.pattern.count
    return {"in_proj": ("column", h, 2 * di + 2 * t.n_groups * t.ssm_state_size + t.mamba_num_heads, n("M")),
            "out_proj": ("row", di, h, n("M")), "linear_qkv": ("column", h, q + 2 * kv, n("*")),
            "linear_proj": ("row", q, h, n("*")), "linear_fc1": ("column", h, fs, n("E")),
            "linear_fc2": ("row", fs, h, n("E"))}


@pytest.fixture(scope="module")
def lora_two_gpus():
    """plan.make_plan of nano-lora.toml at TP 2 + SP, EP 2 on 2 ranks."""
    return plan.make_plan(nano_lora_cfg(*TWO_GPUS), 2)


def test_lora_plan_counts_the_adapters_and_no_base_gradients_or_reference(lora_two_gpus):
    """Closed forms at TP 2: an adapter of a [out, in] weight has r·(in + out) parameters; this rank holds r·in +
    r·out/TP of a column-parallel one (A whole, B's rows) and r·in/TP + r·out of a row-parallel one. The base is
    frozen: the fp32 gradient buffer, master copies and Adam moments hold the adapters alone (4, 4 and 8 bytes per
    parameter at DP 1); no reference model; the weights are the base's bf16 bytes (plus the fp32 expert bias) and the
    adapters'."""
    p, hf, r = lora_two_gpus, omni_model.read_hf_config(NANO), 16
    shapes = lora_layer_shapes(hf)
    want_global = sum(r * (i + o) * n for _, i, o, n in shapes.values())
    want_rank = sum((r * i + r * o // 2 if k == "column" else r * i // 2 + r * o) * n for k, i, o, n in shapes.values())
    assert p.lora.adapter_params == want_global == 13_339_648
    assert p.lora.layers == {t: n for t, (_, _, _, n) in shapes.items()}
    assert p.lora.checkpoint_ratio == want_global / p.counts["total"] < 0.02
    assert p.lora.bytes_per_param == 2 + 4 + 8
    assert p.counts["language_model"] == 31_577_937_344  # the base model's count, the adapters apart
    (row,) = p.ranks
    assert row.adapter_params == want_rank and row.adapters == 2 * want_rank
    assert (row.grads, row.master, row.moments) == (4 * want_rank, 4 * want_rank, 8 * want_rank)
    assert row.reference == row.reference_params == row.reference_offloaded == row.grads_copy == 0
    expert_bias = hf.pattern.count("E") * hf.text.n_routed_experts * 4
    assert row.weights == 2 * row.params + expert_bias + row.adapters
    assert row.reference_pass == row.weights - row.adapters  # the reference pass: the base model
    assert not p.reference_forward and p.step_activations() == p.activations(p.bin_tokens, p.image_tokens)


def test_lora_activations_add_the_adapters_saved_tensors(lora_two_gpus):
    """Per layer and rank-token (b = 2 bytes, SP 2): a column-parallel adapter saves u = x·Aᵀ after the SP gather (r·b),
    plus, where the norm is fused into the base (in_proj, linear_qkv), its own norm's fp32 input, bf16 output and fp32
    1/rms ((4 + b)·h/SP + 4/SP); a row-parallel one u after the reduce-scatter (r·b/SP). The reference (adapters off)
    is a forward without them; online, a step's peak is the larger of the policy's and that forward's."""
    p, hf, r, b, sp = lora_two_gpus, omni_model.read_hf_config(NANO), 16, 2, 2
    h = hf.text.hidden_size
    norm = ((4 + b) * h + 4) / sp
    assert p.activations.adapters == {"M": r * b + norm + r * b / sp, "*": r * b + norm + r * b / sp,
                                      "E": r * b + r * b / sp}
    assert p.activations.vit_adapters_per_image_token == 0
    act = p.activations
    full = plan.ActivationModel(**{**vars(act), "adapters": {}})
    for tokens in (4096, 16384):
        largest, largest_full = (max(a.layer(k, tokens) for k in "M*E") for a in (act, full))
        assert act(tokens, 100) - full(tokens, 100) == pytest.approx(2 * (largest - largest_full))  # full recompute
        assert act.forward_only(tokens, 100) == full.forward_only(tokens, 100) < act(tokens, 100)
    online = plan.MemoryPlan(**{**vars(p), "reference_forward": True})
    assert online.step_activations() == max(act(p.bin_tokens, p.image_tokens),
                                            act.forward_only(p.bin_tokens, p.image_tokens))


def test_nano_lora_fits_two_80gb_gpus_with_12_gib_to_spare(lora_two_gpus, capsys):
    """What the LoRA recipe is for: nano-lora.toml at TP 2 + SP, EP 2 leaves at least 12 GiB per 80 GB GPU after the
    reserve at its 16384-token bins; the printed plan has no reference column's bytes and says the checkpoint ratio."""
    assert lora_two_gpus.bin_tokens == 16384
    assert lora_two_gpus.spare(plan.GPUS["80 GB"]) >= 12 * plan.GiB
    out = plan.format_plan(lora_two_gpus, nano_lora_cfg(*TWO_GPUS))
    assert "adapters / none" in out and "LoRA checkpoint:" in out and ": 0.040%." in out


def test_plan_of_nano_lora_is_the_golden_table_and_fits_one_141gb_gpu(capsys):
    """`python plan.py configs/nano-lora.toml model.hf_path=assets/nano-omni-config`: one GPU, golden; a 141 GB GPU
    keeps at least 12 GiB after the reserve; one 80 GB GPU does not fit its 16384-token bins, and the plan names the
    largest bin that does."""
    assert plan.main(NANO_LORA_ARGS) == 0
    out = capsys.readouterr().out.replace(str(NANO), "assets/nano-omni-config")
    assert out == GOLDEN_LORA.read_text()
    p = plan.make_plan(nano_lora_cfg())
    assert p.world == 1 and p.bin_tokens == 16384
    assert p.spare(plan.GPUS["141 GB"]) >= 12 * plan.GiB
    assert not p.fits(plan.GPUS["80 GB"])
    best = p.largest_bin(plan.GPUS["80 GB"], 8)
    assert 0 < best < 16384 and f"the largest packing.max_tokens_per_bin that fits: {best}\n" in out


def test_lora_optimizer_state_is_sharded_over_dp():
    """TP 1, EP 2 on 2 GPUs (DP 2): the distributed optimizer's fp32 master copies and moments of DP ranks 0 and 1
    partition the (replicated) adapters; each rank's fp32 gradient buffer holds them whole."""
    p = plan.make_plan(nano_lora_cfg("parallel.expert_model_parallel_size=2"), 2)
    first, last = p.ranks if len(p.ranks) == 2 else (p.ranks[0], p.ranks[0])
    n = p.lora.adapter_params
    assert first.adapter_params == last.adapter_params == n
    assert first.master + last.master == 4 * n and first.moments + last.moments == 8 * n
    assert first.grads >= 4 * n


# ---- Video and audio per bin ----------
def tiny_media_cfg(data_path: str, *overrides: str):
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"data.train.data_path={ROOT / data_path}",
                                                                  *overrides])
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    return cfg


def test_video_frames_and_audio_seconds_flags_plan_the_processors_tokens_and_the_encoders_memory(capsys):
    """nano.toml with --video-frames 32 --audio-seconds 30, no processor files (transformers' defaults): 32 frames are
    16 tubelets of the 1024-patch tile (32 x 32 patches, 2x2 shuffled: 256 tokens), 4096 ViT tokens beside the 3328
    of the image; 30 s at 16 kHz are 1 + 480000 // 160 = 3001 mel frames, (n - 1) // 2 + 1 three times: 1501, 751, 376
    <so_embedding> tokens. Frozen sound towers (nano.toml) keep nothing and hold S(1), one layer's forward (S(l): the
    saved bytes of an l-layer encoder); the activations are the image-only model's plus the ViT's bytes of the video
    tokens plus that. Trained (model.freeze_sound_* = false; TP 8, DP 1): the fp32 gradient buffer grows by 4 bytes,
    the int16 remainders by 2 and the two bf16 moments by 4 per sound parameter on the rank (the replicated encoder
    whole, the projection's TP shard and its input norm's h_s weights); the activations keep S(1) + 23 (S(2) - S(1)),
    which is a 24-layer encoder's measured whole, and the projection's 2·h_s + 2·f/TP bf16 elements per token."""
    import plan_media

    hf = omni_model.read_hf_config(NANO)
    frozen = plan.make_plan(nano_cfg(), 8, video_frames=32, audio_seconds=30)
    m, act = frozen.media, frozen.activations
    assert (m.video_frames, m.video_tokens, m.image_tokens, frozen.image_tokens) == (32, 16 * 256, 3328, 3328 + 4096)
    assert (m.audio_samples, m.audio_tokens, m.audio_seconds) == ([480000], 376, 30.0)
    s1, s2 = (plan_media.sound_saved_bytes(hf.sound, torch.bfloat16, 3001, k) for k in (1, 2))
    assert act.sound_kept == act.sound_working == s1 > 0
    images_only = plan.ActivationModel(**{**vars(act), "sound_kept": 0.0, "sound_working": 0.0})
    assert frozen.step_activations() == images_only(frozen.bin_tokens, 3328) + act.vit_per_image_token * 4096 + s1

    trained = plan.make_plan(nano_cfg("model.freeze_sound_encoder=false", "model.freeze_sound_projector=false"), 8,
                             audio_seconds=30)
    (f,), (t,) = frozen.ranks, trained.ranks
    h_s, f_s = hf.sound.hidden_size, hf.sound.projection_hidden_size
    n = trained.counts["sound_encoder"] + (trained.counts["sound_projection"] - h_s) // 8 + h_s
    assert (t.grads - f.grads, t.master - f.master, t.moments - f.moments) == (4 * n, 2 * n, 4 * n)
    assert t.weights == f.weights and t.params == f.params
    assert s1 + 23 * (s2 - s1) == plan_media.sound_saved_bytes(hf.sound, torch.bfloat16, 3001, 24)
    assert trained.activations.sound_kept == s1 + 23 * (s2 - s1) + 376 * (2 * h_s + 2 * f_s / 8) * 2
    assert trained.activations.sound_working == s1

    assert plan.main([*NANO_ARGS, "--video-frames", "32", "--audio-seconds", "30"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("media per bin: 32 video frames (4096 of the 7424 image tokens); 30.0 s of audio in 1 "
                           "clip(s) (376 <so_embedding> tokens; sound encoder frozen, projection frozen")


@pytest.mark.parametrize("data_path, overrides", [
    ("data/mmpr_sample/MMPR-audio/meta.json", ()),
    ("data/mmpr_video_sample/MMPR-video-sample/meta.json", ("data.video.target_num_patches=24",)),
], ids=["audio", "video"])
def test_video_frames_and_audio_come_from_the_data_index(data_path, overrides, tmp_path, monkeypatch):
    """tiny.toml, two pairs per bin: the two pairs with the most image + video tokens give the ViT's tokens and the
    frames, the two with the most audio samples give the clips (each pair's files summed from the index here)."""
    import mmpr_index

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    cfg = tiny_media_cfg(data_path, "packing.max_sequences_per_bin=2", "data.train.split_validation_size=0", *overrides)
    train_split, _ = mmpr_index.load_splits(mmpr_index.load_processor(cfg.model.hf_path, "model.hf_path"), cfg.data)
    ix, ids = train_split.index, train_split.pair_ids
    vit = sorted(ids, key=lambda i: -int(ix.image_tokens[i] + ix.video_tokens[i]))[:2]
    samples = {i: [int(ix.audio_samples[j]) for j in range(int(ix.audio_start[i]), int(ix.audio_start[i] +
                                                                                       ix.num_audio[i]))] for i in ids}
    loud = sorted(ids, key=lambda i: -sum(samples[i]))[:2]
    m = plan.plan_media.media_inputs(cfg, omni_model.read_hf_config(cfg.model.hf_path))
    assert (m.image_tokens, m.video_tokens) == (sum(int(ix.image_tokens[i]) for i in vit),
                                                sum(int(ix.video_tokens[i]) for i in vit))
    assert m.video_frames == sum(int(ix.video_frames[i]) for i in vit)
    assert sorted(m.audio_samples) == sorted(n for i in loud for n in samples[i])
    assert (m.video_frames > 0) == ("video" in data_path) and (m.audio_tokens > 0) == ("audio" in data_path)
    assert m.media_source == f"the training data's index ({cfg.data.train.data_path})"


def test_audio_for_a_model_without_a_sound_encoder_is_one_line(tmp_path, capsys):
    tiny = ROOT / "assets" / "tiny-omni"
    model = tmp_path / "model"
    shutil.copytree(tiny, model, ignore=lambda d, names: [n for n in names if n == "config.json"])
    hub = json.loads((tiny / "config.json").read_text())
    del hub["sound_config"]
    (model / "config.json").write_text(json.dumps(hub))
    assert plan.main([str(ROOT / "configs" / "tiny.toml"), f"model.hf_path={model}", "--audio-seconds", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ConfigError: model.hf_path = ") and "sound_config" in err[0]
