"""lora: adapters on the tiny Omni model (CPU, fp32, gloo): B = 0 and adapters-off are the base model bit for bit,
merged weights give the adapted logits, only the adapters train, the [lora] config errors, the PEFT export loads in
transformers + peft with our logits, and TP 2 + SP equals one rank (one torchrun launch).

LoRA training (train.py with lora.rank > 0): only the adapters reach DDP and the optimizer, the step-1 losses are
w_p·ln 2 + w_q·2 ln 2, the adapters-off reference is the base model bit for bit; launches of configs/tiny.toml + LORA
on 2 ranks: a golden trace (tests/golden/lora_trace.json; OMNI_MPO_RECORD_GOLDEN=1 records it), resume 2 + 2 = 4 bit
for bit, checkpoints of adapters only, a resume over other base weights refused, the precomputed reference and the
shared-prompt format, and both exports (merged, PEFT) against transformers (+ peft). With the routed experts' adapters
too: TP = 2 (+ SP) and EP = 2 equal one rank over 3 steps, metrics and the trained adapters (three more launches).

Run: `pytest tests/test_lora.py` (a few minutes: eight training launches).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import raises_naming

sys.path.insert(0, str(Path(__file__).resolve().parent))
from omni_model_cases import TINY, audio_batch_fields, make_pair_batch, media_text_inputs, with_audio  # noqa: E402

PARITY = 1e-4  # tests/test_omni_model.py: logits vs transformers
INVARIANCE = 1e-5  # tests/test_omni_model.py: a reordering of the same fp32 sums (layouts, packing)
ALL = dict(rank=4, alpha=8.0, routed_experts=True, vision_tower=True, projector=True, sound_projector=True)  # all


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
    return with_audio(make_pair_batch())  # an image and a clip: every adapted component sees tokens


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
    # LM 16 (2 routed-expert pairs per MoE layer), ViT 8, mlp1 2, sound projection 2
    assert names == adapters and len(adapters) == 2 * 28
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
    from backend.local_spec import _norm

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
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.sound_projector=true",
      "model.freeze_sound_projector=true"], "model.freeze_sound_projector"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.targets=in_proj", "lora.sound_projector=true"],
     "lora.sound_projector"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "lora.targets=[]"], "lora.targets"),
    (["lora.rank=8"], "model.moe_router_bias_update_rate"),
    (["lora.rank=8", "model.moe_router_bias_update_rate=0", "reference.offload=true"], "reference.offload"),
])
def test_bad_lora_settings_are_one_line_config_errors(overrides, key):
    from config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides, names", [
    (["lora.language_model=false", "lora.targets=linear_qkv"], ["lora.targets", "linear_qkv"]),  # shared expert: fc
    (["lora.rank=1000000000"], ["lora.rank", "1000000000"]),
    (["lora.rank=50", "lora.targets=linear_fc1"], ["lora.rank", "shared_expert", "linear_fc1"]),  # 48 x 64; dense: 96
])  # fmt: skip
def test_lora_settings_the_model_cannot_take_are_one_line_in_train_and_plan(overrides, names, capsys):
    """Checked against model.hf_path's config.json (preflight.check_model_config, train.py's and plan.py's): a target
    no adapted component has, a rank above a targeted layer's smaller dimension (tiny-omni's shared expert: 48)."""
    import plan
    import preflight
    from config import ConfigError, load_config

    args = [str(ROOT / "configs" / "tiny.toml"), f"model.hf_path={ROOT / 'assets' / 'tiny-omni'}",
            "lora.rank=4", "model.moe_router_bias_update_rate=0", *overrides]
    cfg = load_config(args[0], args[1:])
    with raises_naming(ConfigError, *names):
        preflight.check_model_config(cfg, preflight.read_model_config(cfg.model.hf_path))
    assert plan.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(str(n) in err[0] for n in names), err
    cfg = load_config(args[0], [*args[1:4], "lora.rank=32", "lora.targets=linear_qkv"])  # the LM's qkv: 64 x 128
    preflight.check_model_config(cfg, preflight.read_model_config(cfg.model.hf_path))


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

    kw = dict(rank=4, alpha=8.0, sound_projector=True)  # the language model's targets, the shared experts, the sound
    # projection
    m = build(kw)
    randomize_b(m, std=0.05)
    lora.save_peft(m, tmp_path, TINY, LoraConfig(**kw))
    lora.save_peft(m, tmp_path / "relative", os.path.relpath(TINY), LoraConfig(**kw))  # what PEFT users load: absolute
    saved = json.loads((tmp_path / "relative" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert saved == os.path.abspath(TINY)
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    audio = media_text_inputs(1)
    sound = [ad for n, _, ad in lora.adapted(m) if n.startswith("sound_projection.")]
    ref = NemotronH_Omni_Reasoning_V3.from_pretrained(TINY).eval()
    with torch.no_grad():
        base = ref.language_model(input_ids=ids).logits[0]
        peft_model = PeftModel.from_pretrained(ref, tmp_path).eval()
        theirs = peft_model.base_model.model.language_model(input_ids=ids).logits[0]
        theirs_audio = peft_model(input_ids=audio["input_ids"], input_features=audio["input_features"],
                                  input_features_mask=audio["input_features_mask"]).logits[0]
        ours = m({"input_ids": ids})
        ours_audio = m({"input_ids": audio["input_ids"], **audio_batch_fields(audio)})
        for ad in sound:
            ad.enabled = False
        without_sound = m({"input_ids": audio["input_ids"], **audio_batch_fields(audio)})
    print(f"peft: vs base {(ours - base).abs().max():.3g}, vs transformers + peft {(ours - theirs).abs().max():.3g}")
    assert (ours - base).abs().max() > 100 * PARITY  # the adapters matter ...
    assert (ours - theirs).abs().max() <= PARITY  # ... and transformers + peft apply them as we do
    assert len(sound) == 2 and (ours_audio - without_sound).abs().max() > 100 * PARITY  # on audio prompts too
    assert (ours_audio - theirs_audio).abs().max() <= PARITY
    n_lora = sum(1 for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    # layers M * E M - E: in/out, q/k/v/o, shared up/down, in/out, up/down, ...; the sound projection's linear_1 / 2
    assert n_lora == 2 + 4 + 2 + 2 + 2 + 2 + 2
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


# ----------------------------------------------------------------------------------------------------------------------
# LoRA training: train.py with lora.rank > 0

ROOT = Path(__file__).resolve().parents[1]
LORA = ["lora.rank=4", "lora.alpha=8", "model.moe_router_bias_update_rate=0"]  # the language model + shared experts
GOLDEN = Path(__file__).resolve().parent / "golden" / "lora_trace.json"
TIMING_KEYS = {"step_time", "pairs_per_s", "tokens_per_s", "eta_s", "mfu"}


def _adapter_params(model) -> list[torch.nn.Parameter]:
    import lora

    return [p for _, _, ad in lora.adapted(model) for p in (ad.A, ad.B)]


@pytest.fixture(scope="module")
def lora_step():
    from step_cases import tiny_step

    return tiny_step("cpu", *LORA)


def test_only_the_adapters_reach_ddp_and_the_optimizer(lora_step):
    s = lora_step
    adapters = _adapter_params(s["policy"])
    in_buffers = [p for b in s["ddp"].buffers + s["ddp"].expert_parallel_buffers for p in b.params]
    optimized = [p for g in s["optimizer"].param_groups for p in g["params"]]
    assert {id(p) for p in in_buffers} == {id(p) for p in adapters}
    assert len(optimized) == len(adapters) == 2 * 12  # 12 adapted linears: in/out, q/k/v, o, shared fc1/fc2, ...
    assert sum(p.numel() for p in optimized) == sum(p.numel() for p in adapters)
    frozen = [p for p in s["policy"].parameters() if not p.requires_grad]
    assert frozen and not any(hasattr(p, "main_grad") for p in frozen)  # no gradient buffer for a base weight


def test_lora_step_one_losses_are_ln2_and_2ln2(lora_step):
    """B = 0: the policy is the reference (its adapters off) at step 1, every reward is exactly 0."""
    mpo = lora_step["cfg"].mpo
    m, _ = lora_step["run"](lora_step["batches"], 0.0)
    ln2 = torch.tensor(2.0).log().item()  # float32 ln 2, as the loss computes it
    assert m["preference_loss"] == pytest.approx(ln2, rel=1e-7)
    assert m["bco_loss"] == pytest.approx(2 * ln2, rel=1e-7)
    assert m["rewards/margin"] == 0.0 and m["rewards/chosen"] == 0.0 and m["bco/reward_sum"] == 0.0
    want = mpo.preference_loss_weight * math.log(2) + mpo.bco_loss_weight * 2 * math.log(2)
    assert m["loss"] == pytest.approx(want + mpo.sft_loss_weight * m["sft_loss"], abs=1e-6)
    print(f"LoRA step 1: loss {m['loss']!r} (closed form {want!r}), preference {m['preference_loss']!r}, "
          f"bco {m['bco_loss']!r}")


def test_adapters_off_reference_is_a_base_model_bit_for_bit(lora_step):
    """reference_logprobs.sums of the policy with trained-like adapters, adapters off, equals those of a base model
    built without adapters (as reference.logprobs=precomputed's pass builds it) bit for bit, and the policy's own
    log-probs differ."""
    import hf_weights
    import mpo_loss
    import omni_model as om
    import reference_logprobs

    s = lora_step
    policy, ctx, batches = s["policy"], s["ctx"], s["batches"]
    randomize_b(policy, seed=7, std=0.05)
    try:
        base = om.build_model(ROOT / s["cfg"].model.hf_path, s["cfg"].model, s["cfg"].parallel)
        hf_weights.load_hf_weights(base, ROOT / s["cfg"].model.hf_path)
        base.eval().requires_grad_(False)
        ours = reference_logprobs.sums(s["reference"], batches, ctx)
        theirs = reference_logprobs.sums(base, batches, ctx)
        assert policy.training  # the reference's eval mode is restored after
        with torch.no_grad():
            adapted = [mpo_loss.forward_logprobs(policy, b, ctx)[0] for b in batches]
    finally:
        with torch.no_grad():
            for p in _adapter_params(policy)[1::2]:
                p.zero_()
    for a, b, c in zip(ours, theirs, adapted, strict=True):
        assert torch.equal(a, b)
        assert (a - c).abs().max() > 1e-3


@pytest.fixture(scope="module")
def lora_runs(torchrun, tmp_path_factory):
    """configs/tiny.toml + LORA on 2 ranks: `straight` (6 steps, every 2nd saved, all kept), `segments` (2, then to
    4), `precomputed` (reference.logprobs=precomputed, 2 steps), `shared` (packing.shared_prompt=true, 1 step),
    `bf16_straight` / `bf16_segments` (model.params_dtype=bfloat16, 4 steps; 2, then to 4)."""
    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))}

    def run(name, *overrides):
        run_dir = tmp_path_factory.mktemp(name)
        proc = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *LORA, *overrides, env=env)
        return run_dir, proc

    out = {}
    d, p = run("straight", "checkpoint.save_period=2", "checkpoint.keep_last=0")
    out["straight"] = SimpleNamespace(dir=d, out=p.stdout, rows=_rows(d), val=_rows(d, "validation"))
    d, _ = run("segments", "mpo.stop_after_step=2")
    torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={d}", *LORA, "mpo.stop_after_step=4", env=env)
    out["segments"] = SimpleNamespace(dir=d, rows=_rows(d))
    d, p = run("precomputed", "reference.logprobs=precomputed", "mpo.stop_after_step=2")
    out["precomputed"] = SimpleNamespace(dir=d, out=p.stdout, rows=_rows(d))
    d, p = run("shared", "packing.shared_prompt=true", "mpo.stop_after_step=1")
    out["shared"] = SimpleNamespace(dir=d, out=p.stdout, rows=_rows(d))
    bf16 = ("model.params_dtype=bfloat16", "mpo.max_num_steps=4")
    d, _ = run("bf16_straight", *bf16)
    out["bf16_straight"] = SimpleNamespace(dir=d, rows=_rows(d))
    d, _ = run("bf16_segments", *bf16, "mpo.stop_after_step=2")
    torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={d}", *LORA, *bf16, env=env)
    out["bf16_segments"] = SimpleNamespace(dir=d, rows=_rows(d))
    out["env"] = env
    return out


def _rows(run_dir: Path, split: str = "train") -> list[dict]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}


def test_golden_trace_of_a_lora_run(lora_runs):
    """Every metric of the 6 steps and the validation row of configs/tiny.toml + LORA on 2 ranks, by
    tests/test_train.py's golden-trace rule (float32 rounding of the log-prob sums)."""
    from test_train import golden_mismatches

    run = lora_runs["straight"]
    trace = {"train": {k: [r[k] for r in run.rows] for k in _untimed(run.rows[0]) if k != "split"},
             "validation": {k: v for k, v in _untimed(run.val[0]).items() if k != "split"}}
    if os.environ.get("OMNI_MPO_RECORD_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"command": "torchrun --standalone --nproc-per-node 2 train.py configs/tiny.toml "
                                                 + " ".join(LORA), **trace}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden_mismatches(run, golden["train"], golden["validation"]) == []
    r = run.rows[0]  # step 1: the policy is the base model
    assert r["preference_loss"] == pytest.approx(math.log(2), abs=1e-6) and r["rewards/margin"] == 0.0
    assert r["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)


def test_lora_resume_two_plus_two_is_four_steps_bit_for_bit(lora_runs):
    straight, segments = lora_runs["straight"], lora_runs["segments"]
    assert [_untimed(r) for r in segments.rows] == [_untimed(r) for r in straight.rows[:4]]
    a, b = _loaded_state(straight.dir / "step_4"), _loaded_state(segments.dir / "step_4")
    assert [n for n, _ in a] == [n for n, _ in b] and len(a) > 24
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), name
    assert any(n.endswith(".B") and x.abs().max() > 0 for n, x in a)  # the adapters trained


def test_bf16_lora_resume_two_plus_two_is_four_steps_bit_for_bit(lora_runs):
    """The same with bf16 parameters: the adapters' fp32 master copies and Adam moments resume exactly."""
    straight, segments = lora_runs["bf16_straight"], lora_runs["bf16_segments"]
    assert len(straight.rows) == 4 and [_untimed(r) for r in segments.rows] == [_untimed(r) for r in straight.rows]
    assert straight.rows[-1]["loss"] != straight.rows[0]["loss"]  # it trained


def _loaded_state(step_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The adapters and every optimizer state tensor after loading `step_dir` into a fresh LoRA policy + DDP + Adam
    in this process (a world of one: the DP = 2 checkpoint reshards over DP)."""
    import checkpoint
    import config as config_mod
    import distributed
    import hf_weights
    import lora
    import omni_model
    import train

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", LORA)
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(policy, ROOT / cfg.model.hf_path)
    lora.apply_lora(policy, cfg.lora, seed=cfg.mpo.seed + 1)  # another initial A: the checkpoint's must replace it
    ddp, opt, sched = train.build_optimizer(policy, cfg)
    checkpoint.load(step_dir, ddp, opt, sched)
    out = [(n, p.detach().clone()) for n, p in policy.named_parameters() if p.requires_grad]
    for i, o in enumerate(checkpoint._inner_optimizers(opt)):
        for g in o.optimizer.param_groups:
            for j, p in enumerate(g["params"]):
                out += [(f"opt {i}.{j}.{k}", v.detach().clone()) for k, v in sorted(o.optimizer.state[p].items())]
    return out


def test_a_lora_checkpoint_holds_only_the_adapters_and_the_base_digest(lora_runs):
    from torch.distributed.checkpoint import FileSystemReader

    import checkpoint
    import model_hub

    step = lora_runs["straight"].dir / "step_6"
    keys = FileSystemReader(str(step / "model_optim")).read_metadata().state_dict_metadata
    model_keys = sorted(k for k in keys if not k.startswith(("optimizer.", "common_state")))
    pieces = tuple(f".in_proj.lora.B.{x}" for x in ("z", "x", "B", "C", "dt"))  # Mamba in_proj's B as megatron's W
    assert all(k.endswith((".lora.A", ".lora.B", *pieces)) for k in model_keys), model_keys[:5]
    assert len(model_keys) == 2 * 12 + 2 * 4  # the adapters' tensors (2 Mamba in_proj B in 5 pieces), no base weight
    state = checkpoint.read_run_state(step)
    assert state.base_model_digest == model_hub.base_model_digest(ROOT / "assets" / "tiny-omni")
    model_bytes = sum(keys[k].size.numel() * keys[k].properties.dtype.itemsize for k in model_keys)
    size = sum(p.stat().st_size for p in (step / "model_optim").rglob("*") if p.is_file())
    base = sum(p.stat().st_size for p in (ROOT / "assets" / "tiny-omni").glob("*.safetensors"))
    print(f"LoRA checkpoint: model part {model_bytes} bytes, model_optim/ {size} bytes (with Adam's state and "
          f"megatron's metadata); the base model's safetensors: {base} bytes")
    assert model_bytes < 0.05 * base


def test_resume_over_other_base_weights_is_refused_in_one_line(lora_runs, tmp_path):
    """A byte-identical copy of the base model elsewhere resumes (a notice); one changed weight is refused, naming
    model.hf_path."""
    from safetensors.torch import load_file, save_file

    import checkpoint
    import config as config_mod

    saved = checkpoint.read_run_state(lora_runs["straight"].dir / "step_2")
    copy = tmp_path / "base"
    shutil.copytree(ROOT / "assets" / "tiny-omni", copy)
    cfg = config_mod.from_dict(saved.config)
    cfg.model.hf_path = str(copy)
    assert "model.hf_path" in checkpoint.check_resume(saved, cfg)  # the same weights: a notice, not a refusal
    [shard] = sorted(copy.glob("*.safetensors"))[:1]
    tensors = load_file(shard)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with raises_naming(checkpoint.CheckpointError, "model.hf_path", copy) as e:
        checkpoint.check_resume(saved, cfg)
    assert "\n" not in str(e.value)


def test_precomputed_reference_trains_as_the_adapters_off_reference_bit_for_bit(lora_runs):
    assert "reference pass: 34 of 34 pairs to compute" in lora_runs["precomputed"].out
    assert [_untimed(r) for r in lora_runs["precomputed"].rows] == [_untimed(r) for r in lora_runs["straight"].rows[:2]]


def test_lora_in_the_shared_prompt_format_starts_at_ln2(lora_runs):
    run = lora_runs["shared"]
    assert "; pairs: shared prompt" in run.out
    [r] = run.rows
    assert r["preference_loss"] == pytest.approx(math.log(2), abs=1e-6) and r["rewards/margin"] == 0.0
    assert r["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    assert r["tokens"] < lora_runs["straight"].rows[0]["tokens"]  # each prompt computed once


def test_lora_exports_merged_and_as_peft_with_our_logits(lora_runs, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import checkpoint
    import config as config_mod
    import distributed
    import hf_weights
    import lora
    import omni_model

    run = lora_runs["straight"]
    outs = {}
    for name, flag in (("merged", []), ("peft", ["--adapter"])):
        outs[name] = tmp_path / name
        proc = subprocess.run([sys.executable, "hf_export.py", str(run.dir), str(outs[name]), *flag], cwd=ROOT,
                              env=dict(os.environ, **lora_runs["env"]), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert {p.name for p in outs["peft"].iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", LORA)
    ours = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(ours, ROOT / cfg.model.hf_path)
    lora.apply_lora(ours, cfg.lora, seed=cfg.mpo.seed)
    checkpoint.load(run.dir / "step_6", ours)
    ours.eval()
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours({"input_ids": ids})
        base = NemotronH_Omni_Reasoning_V3.from_pretrained(ROOT / cfg.model.hf_path).eval()
        before = base.language_model(input_ids=ids).logits[0]
        merged = NemotronH_Omni_Reasoning_V3.from_pretrained(outs["merged"]).eval().language_model(input_ids=ids)
        peft_model = PeftModel.from_pretrained(base, outs["peft"]).eval()
        adapted = peft_model.base_model.model.language_model(input_ids=ids).logits[0]
    print(f"LoRA export: ours vs base {(mine - before).abs().max():.3g}, vs merged "
          f"{(mine - merged.logits[0]).abs().max():.3g}, vs peft {(mine - adapted).abs().max():.3g}")
    assert (mine - merged.logits[0]).abs().max() <= PARITY
    assert (mine - adapted).abs().max() <= PARITY
    assert (mine - before).abs().max() > 1e-4  # the adapters changed the logits: the check is not vacuous


# ----------------------------------------------------------------------------------------------------------------------
# LoRA training on TP = 2 (+ SP) and on EP = 2: 3 steps equal to one rank

LAYOUTS = {"tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
           "ep2": ["parallel.expert_model_parallel_size=2"]}


@pytest.fixture(scope="module")
def lora_layout_runs(torchrun, tmp_path_factory):
    """configs/tiny.toml + LORA with the routed experts' adapters too, tests/test_train.py's LEARN schedule (lr 1e-3,
    so that 3 steps move the adapters) stopped after step 3 (step_3 saved): one rank, TP = 2 with SP, EP = 2."""
    from test_train import LEARN

    env = {"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache")), "OMP_NUM_THREADS": "1"}
    out = {}
    for name, nproc, overrides in (("tp1", 1, []), *((n, 2, o) for n, o in LAYOUTS.items())):
        run_dir = tmp_path_factory.mktemp(name)
        torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *LORA, "lora.routed_experts=true",
                 *LEARN, "mpo.stop_after_step=3", *overrides, nproc=nproc, env=env)
        out[name] = SimpleNamespace(dir=run_dir, rows=_rows(run_dir))
    return out


def _trained_adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    """The adapters of `step_dir` loaded into a one-rank LoRA policy in this process (hf_export's path: any saved
    layout resharded to TP = EP = 1), by parameter name."""
    import checkpoint
    import config as config_mod
    import distributed
    import hf_weights
    import lora
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [*LORA, "lora.routed_experts=true"])
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(policy, ROOT / cfg.model.hf_path)
    lora.apply_lora(policy, cfg.lora, seed=cfg.mpo.seed + 1)  # another initial A: the checkpoint's must replace it
    checkpoint.load(step_dir, policy)
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_on_tp2_and_ep2_equals_one_rank_over_three_steps(lora_layout_runs, layout):
    """Every metric of steps 1-3 within the golden traces' float32 rule (tests/test_train.py's TP = 2 / DP = 2 test),
    and the adapters after step 3 (routed experts' per-expert pairs included) within PARAM_ATOL_AFTER_3_STEPS."""
    from test_train import PARAM_ATOL_AFTER_3_STEPS, golden_tolerance, largest_logprob_sum

    ref, run = lora_layout_runs["tp1"], lora_layout_runs[layout]
    assert [r["step"] for r in ref.rows] == [r["step"] for r in run.rows] == [1, 2, 3]
    s_max = largest_logprob_sum(ref.rows)
    worst = {}
    for a, b in zip(ref.rows, run.rows, strict=True):
        assert set(a) == set(b)
        for key in set(a) - TIMING_KEYS - {"split"}:
            tol = golden_tolerance(key, a, s_max)
            worst[key] = max(worst.get(key, 0.0), abs(a[key] - b[key]))
            assert b[key] == pytest.approx(a[key], rel=0, abs=tol), (layout, a["step"], key)
    assert ref.rows[2]["rewards/margin"] != 0.0  # step 3 sees the adapters of step 2's update
    want, got = _trained_adapters(ref.dir / "step_3"), _trained_adapters(run.dir / "step_3")
    assert list(want) == list(got) and len(want) == 2 * 16  # 12 adapted linears + 2 routed-expert pairs per MoE layer
    diffs = {n: (want[n] - got[n]).abs().max().item() for n in want}
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-4, atol=PARAM_ATOL_AFTER_3_STEPS), (layout, n, diffs[n])
    assert all(want[n].abs().max() > 0 for n in want if n.endswith(".B"))  # every B trained (B starts at 0)
    print(f"LoRA {layout} vs one rank over 3 steps: metrics max |diff| {max(worst.values()):.3g} "
          f"({max(worst, key=worst.get)}), adapters max |diff| {max(diffs.values()):.3g} ({max(diffs, key=diffs.get)})")


def test_peft_export_of_routed_expert_adapters_is_refused_in_one_line(lora_layout_runs, tmp_path):
    """The PEFT format here maps the language model's linears and the shared expert: `--adapter` of a run with
    lora.routed_experts is one line naming the key, before anything is built or written; the merged export is the
    way out."""
    import hf_export

    step = lora_layout_runs["tp1"].dir / "step_3"
    with raises_naming(hf_export.CheckpointError, str(step), "lora.routed_experts", "without --adapter"):
        hf_export.export(step, tmp_path / "peft", adapter=True)
    assert not (tmp_path / "peft").exists()


def test_dropout_resumes_and_precomputes_bit_for_bit(tmp_path):
    """lora.dropout = 0.3 (one rank, `python train.py`, 16 pairs): 3 online steps, and a precomputed run stopped after
    2 and resumed to 3, have the same metrics: the reference pass and the data loader draw nothing from the training
    RNG."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled", "HF_DATASETS_CACHE": str(tmp_path)}
    common = [*LORA, "lora.dropout=0.3", "mpo.max_num_steps=3", "mpo.val_at_end=false", "data.train.max_samples=16"]

    def run(run_dir, *overrides):
        proc = subprocess.run([sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *common,
                               *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(tmp_path / "online")
    run(tmp_path / "stored", "reference.logprobs=precomputed", "mpo.stop_after_step=2")
    run(tmp_path / "stored", "reference.logprobs=precomputed")
    online, stored = _rows(tmp_path / "online"), _rows(tmp_path / "stored")
    assert len(online) == 3 and [_untimed(r) for r in stored] == [_untimed(r) for r in online]
