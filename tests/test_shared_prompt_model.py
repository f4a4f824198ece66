"""The shared-prompt format wired into the model and the step: `packing.shared_prompt`.

The tiny model (assets/tiny-omni: Mamba, attention, MoE and MLP layers) in fp32 on the CPU runs the same bins in the
separate-sequences format (pack.pack) and the shared-prompt format (pack.pack_shared_prompt) through train.py's own
functions (count_global_pairs, reference_logprobs, forward_logprobs, policy_forward_backward): per-response log-prob
sums, every MPO metric (the loss included) and every parameter gradient agree to 1e-5, for bins of one and of several
pairs with image and text-only pairs and prompts not a multiple of the Mamba chunk (16); in process (TP = DP = 1),
with activation recomputation (full, selective), and in a 2-rank launch (TP = 2 with sequence parallelism, DP = 2).
Also: the one training step of tests/step_cases.py with the switch on (ln 2 / 2 ln 2, the device rule, bins sized by
the planner), the main job's step-1 losses, and the refused combinations.

Run: `pytest tests/test_shared_prompt_model.py` (CPU, about a minute and a half: one 2-rank launch, one train.py run).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from conftest import raises_naming
from shared_prompt_cases import DIST_WORKER, PAIR_SPECS, TINY, make_pairs, max_differences, mpo_step

import config as config_mod

TOL = 1e-5


def check_equal(d: dict, n_params: int) -> None:
    """Assert one `max_differences` report: every difference <= TOL, all trainable parameters compared."""
    assert d["num_response_tokens_equal"]
    assert d["logprobs"] <= TOL, d
    assert max(d["metrics"].values()) <= TOL, d["metrics"]
    assert d["grad"] <= TOL, (d["grad"], d["grad_param"])
    assert d["grad_names_differ"] == [] and d["n_grads"] == n_params
    assert d["grad_scale"] > 1e-2  # the gradients compared are not all zero


def reached(model) -> int:
    """The trainable parameters the pairs' gradients reach: all but the sound towers and the ViT's video embedder (the
    pairs carry neither audio nor video)."""
    return sum(p.requires_grad for n, p in model.named_parameters()
               if not n.startswith(("sound_encoder.", "sound_projection.")) and "video_embedder" not in n)


@pytest.fixture(scope="module")
def tiny():
    from step_cases import tiny_config

    import distributed
    import hf_weights
    import omni_model as om

    cfg = tiny_config("packing.shared_prompt=true")
    distributed.init_distributed(device=torch.device("cpu"))
    model = om.build_model(str(TINY), cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(model, str(TINY))
    return model, distributed.Ctx.current(cfg, torch.device("cpu"))


def test_pairs_cover_the_cases():
    chunk = json.loads((TINY / "config.json").read_text())["llm_config"]["chunk_size"]
    assert all(p % chunk for p, _, _, _ in PAIR_SPECS)
    assert {bool(i) for _, i, _, _ in PAIR_SPECS} == {True, False}
    pairs = make_pairs()
    assert [int(p.image_token_counts.sum()) for p in pairs] == [6, 0, 6, 0]


@pytest.mark.parametrize("bins", ["bins_of_1", "one_bin_of_4"])
def test_shared_format_equals_separate_sequences_logprobs_loss_and_every_gradient(tiny, bins):
    model, ctx = tiny
    pairs = make_pairs()
    b = [[p] for p in pairs] if bins == "bins_of_1" else [pairs]
    sep = mpo_step(model, ctx, b, shared=False)
    shr = mpo_step(model, ctx, b, shared=True)
    check_equal(max_differences(sep, shr), reached(model))
    assert sep["num_global_pairs"] == shr["num_global_pairs"] == 4
    # each prompt computed once: the separate sequences hold every prompt's tokens twice (minus the one shared token
    # that starts both responses), nothing else changes
    assert sep["tokens"] - shr["tokens"] == sum(p - 1 for p, _, _, _ in PAIR_SPECS)


def test_a_rejected_response_that_sees_the_chosen_one_is_caught(tiny, monkeypatch):
    """The check is sensitive: with attention layers that ignore the spans (plain causal attention over each pair
    span, the Mamba layers unchanged) the rejected log-probs move by far more than the tolerance, the chosen ones
    not."""
    from types import SimpleNamespace

    from backend import local_spec

    model, ctx = tiny
    pairs = make_pairs()
    good = mpo_step(model, ctx, [pairs], shared=True)["logprobs"]
    no_row_spans = SimpleNamespace(ROW_SPANS=SimpleNamespace(get=lambda: None))
    monkeypatch.setattr(local_spec, "shared_prompt", no_row_spans)
    bad = mpo_step(model, ctx, [pairs], shared=True)["logprobs"]
    rejected = torch.tensor([False, True] * 4)
    assert (good - bad)[rejected].abs().min() > 100 * TOL
    assert (good - bad)[~rejected].abs().max() <= TOL


def test_offsets_that_are_not_the_pair_spans_are_refused(tiny):
    """The Mamba layers take the PackedSeqParams' seq_idx (from cu_seqlens_padded) as the pair spans' without reading
    it back: a shared-prompt row whose cu_seqlens_padded are not the pair spans' ends is a ValueError naming them,
    not a conv over the wrong sequences."""
    import dataclasses

    from shared_prompt_cases import IMAGE

    import pack

    model, _ = tiny
    b = pack.pack_shared_prompt(make_pairs([(13, 0, 22, 3), (6, 0, 17, 30), (19, 0, 9, 14)]), 8, IMAGE)  # text only
    T = b.input_ids.shape[1]
    whole = torch.tensor([0, T], dtype=torch.int32)
    with torch.no_grad():
        model.eval()(b)
        with raises_naming(ValueError, f"cu_seqlens_padded [0, {T}]", f"T = {T}"):
            model(dataclasses.replace(b, cu_seqlens=whole, cu_seqlens_padded=whole, max_seqlen=T))


def test_tp2_and_dp2_shared_format_equals_separate_sequences(torchrun):
    launch = torchrun(DIST_WORKER, timeout=600)
    for rank, result in launch.ranks.items():
        for layout, per_bins in result.items():
            assert "error" not in per_bins, (rank, layout, per_bins)
            for bins, d in per_bins.items():
                n_pairs = d["num_global_pairs"]
                assert n_pairs == [4, 4], (rank, layout, bins)
                assert d["n_grads"] > 50
                assert d["grad_names_differ"] == []
                assert d["num_response_tokens_equal"]
                assert d["logprobs"] <= TOL and d["grad"] <= TOL, (rank, layout, bins, d)
                assert max(d["metrics"].values()) <= TOL, (rank, layout, bins, d["metrics"])
    assert sorted(launch.ranks) == [0, 1]


def test_one_step_with_the_switch_is_ln2_keeps_the_device_rule_and_fills_the_planned_bins(monkeypatch, tmp_path):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from step_cases import DeviceAudit, tiny_step

    import mpo_loss

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    # the class-level aux-loss scale as megatron's MoE backward leaves it when it runs before any step (0-d): the step
    # sets it whatever shape it has
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", torch.tensor(0.5))
    s = tiny_step("cpu", "packing.shared_prompt=true")
    assert all(b.shared_prompt for b in s["batches"])
    # the planner's sizes (prompt - 1 stored once, MMPRIndex.shared_lengths) are the packed spans' sizes
    planned = [b.tokens for b in s["plan"].ranks[0]]
    assert [b.input_ids.shape[1] for b in s["batches"]] == planned
    audit = DeviceAudit("cpu", host=s["batches"])
    with audit:
        metrics, _ = s["run"](s["batches"], 0.0)
    assert audit.calls > 1000 and audit.violations == []
    # the layers' index tensors come from the host offsets (shared_prompt.RowSpans, made once per forward): the
    # project reads the device as in separate sequences (tests/test_train.py), plus mamba_torch's (the CPU set's) own
    sites = sorted({re.sub(r":\d+ ", " ", r) for r in audit.reads if not r.startswith("mamba_torch.py")})
    assert sites == ["mpo_loss.py count_global_pairs: TensorBase.item",
                     "mpo_loss.py reduce_metrics: TensorBase.tolist"], sites
    assert sum(not r.startswith("mamba_torch.py") for r in audit.reads) == 2
    assert metrics["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    assert mpo_loss.count_global_pairs(s["batches"], s["ctx"]) == 4
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    assert scale.shape == () and scale.item() == torch.tensor(1 / len(s["batches"])).item()  # DP = CP = 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_main_job_step_one_is_ln2_and_2ln2_with_the_switch(torchrun, tmp_path, dtype):
    """The README command (DP = 2) with the switch, one step then validation (policy = reference at step 1, so the
    losses are ln 2 / 2 ln 2 exactly in either dtype: both models take the same shared-prompt path)."""
    run_dir = tmp_path / "run"
    torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", "packing.shared_prompt=true",
             "mpo.max_num_steps=1", "scheduler.lr_warmup_steps=0", f"model.params_dtype={dtype}",
             env={"HF_DATASETS_CACHE": str(tmp_path / "hf")})
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    r = [r for r in rows if r["split"] == "train"][0]
    val = [r for r in rows if r["split"] == "validation"]
    assert len(val) == 1 and val[0]["num_valid_pairs"] == 4 and math.isfinite(val[0]["loss"])
    assert r["step"] == 1
    assert r["preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert r["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-5)
    assert r["num_global_pairs"] == 4
    assert json.loads((run_dir / "config.json").read_text())["packing"]["shared_prompt"] is True


def test_context_parallelism_is_a_config_error_at_start_and_te_is_not(monkeypatch):
    from step_cases import tiny_config

    import omni_model
    import preflight

    cfg = tiny_config("packing.shared_prompt=true", "parallel.context_parallel_size=2")
    with raises_naming(config_mod.ConfigError, "packing.shared_prompt = true", "parallel.context_parallel_size = 2"):
        preflight.check_inputs(cfg)
    # The Transformer Engine spec takes the shared-prompt format (shared_prompt.te_attention): no error at start.
    cfg = tiny_config("packing.shared_prompt=true")
    monkeypatch.setattr(omni_model, "uses_te_spec", lambda: True)
    hf = omni_model.read_hf_config(TINY)
    assert preflight.check_model_config(cfg, hf) is None


@pytest.mark.parametrize("spec, mamba, cp, want, pair_format", [
    ("local", "torch", 1, True, "shared prompt (auto)"),
    ("te", "torch", 1, False, "separate sequences (auto: the Transformer Engine spec's shared-prompt attention has "
                              "not run on a GPU yet; packing.shared_prompt=true turns it on)"),
    ("local", "mamba-ssm", 1, False, "separate sequences (auto: mamba-ssm's kernels in the shared-prompt scan have "
                                     "not run on a GPU yet; packing.shared_prompt=true turns it on)"),
    ("local", "triton", 1, False, "separate sequences (auto: the Triton Mamba kernels in the shared-prompt scan have "
                                  "not run on a GPU yet; packing.shared_prompt=true turns it on)"),
    ("te", "mamba-ssm", 1, False, "separate sequences (auto: the Transformer Engine spec's shared-prompt attention "
                                  "has not run on a GPU yet; mamba-ssm's kernels in the shared-prompt scan have not "
                                  "run on a GPU yet; packing.shared_prompt=true turns it on)"),
    ("local", "torch", 2, False, "separate sequences (auto: the shared-prompt format is not supported with "
                                 "parallel.context_parallel_size = 2)"),
])
def test_auto_is_on_exactly_where_the_format_is_checked_exact(spec, mamba, cp, want, pair_format):
    """packing.shared_prompt = "auto" (the default) resolves by the kernels of the process: on with the local spec and
    mamba_torch (this file's equalities), off elsewhere with the reason on the world line; the resolved value passes
    the start-up checks (auto with CP is separate sequences, not the ConfigError of an explicit true)."""
    from step_cases import TINY_TOML

    import pack
    import preflight
    from backend import kernel_selection, shared_prompt

    cfg = config_mod.load_config(TINY_TOML, [f"parallel.context_parallel_size={cp}", "packing.shared_prompt=auto"])
    assert cfg.packing.shared_prompt == "auto"
    with raises_naming(ValueError, "packing.shared_prompt = 'auto'", "shared_prompt.resolve("):
        pack.shared_prompt_on(cfg.packing)  # never read unresolved (a truthy "auto" would mean on)
    kernels = kernel_selection.Kernels(spec=spec, mamba=mamba, device="cuda")
    value, line = shared_prompt.resolve(cfg, kernels)
    assert line == pair_format
    cfg.packing.shared_prompt = value  # train.main stores it
    assert cfg.packing.shared_prompt is want and pack.shared_prompt_on(cfg.packing) is want
    assert config_mod.to_dict(cfg)["packing"]["shared_prompt"] is want  # what config.json records
    assert shared_prompt.resolve(cfg, kernels) == (want, "shared prompt" if want else "separate sequences")  # explicit
    preflight.check_packing(cfg)  # no error, CP included: auto chose separate sequences there


@pytest.mark.parametrize("value, want", [("auto", "auto"), ("true", True), ("false", False), ("'auto'", "auto")])
def test_shared_prompt_setting_takes_auto_or_a_bool(value, want, tmp_path):
    assert config_mod.load_config(None, [f"packing.shared_prompt={value}"]).packing.shared_prompt == want
    toml = tmp_path / "c.toml"
    toml.write_text(f"[packing]\nshared_prompt = {value if value in ('true', 'false') else repr(want)}\n")
    assert config_mod.load_config(toml).packing.shared_prompt == want
    saved = config_mod.to_dict(config_mod.load_config(None, [f"packing.shared_prompt={value}"]))
    assert config_mod.from_dict(saved).packing.shared_prompt == want


@pytest.mark.parametrize("value", ["on", "yes", "2", "'true'", "Auto"])
def test_shared_prompt_setting_refuses_anything_else_naming_the_choice(value, tmp_path):
    override = f"packing.shared_prompt={value}"
    with raises_naming(config_mod.ConfigError, f"override {override!r}: packing.shared_prompt = {value!r} ",
                       "bool | 'auto'"):  # the override, the key, its value and the choices  # fmt: skip
        config_mod.load_config(None, [f"packing.shared_prompt={value}"])
    toml = tmp_path / "c.toml"
    toml.write_text('[packing]\nshared_prompt = "true"\n')  # a TOML string, not the boolean
    with raises_naming(config_mod.ConfigError, f"{toml}: ", "packing.shared_prompt = 'true'",
                       "bool | 'auto' (true or false, without quotes)"):
        config_mod.load_config(toml)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_shared_format_with_activation_recompute_equals_separate_sequences(tiny, recompute):
    """Recomputation re-runs layers during backward, after OmniModel.forward has reset the shared-prompt spans:
    the recomputed attention and Mamba layers must still see them (_recompute_in_forward_context), or the
    rejected rows' gradients come from plain causal spans (a gradient 0.09 off on the tiny model before the fix)."""
    from step_cases import tiny_config

    import hf_weights
    import omni_model as om

    _, ctx = tiny
    cfg = tiny_config("packing.shared_prompt=true", f"model.recompute={recompute}")
    model = om.build_model(str(TINY), cfg.model, cfg.parallel)
    hf_weights.load_hf_weights(model, str(TINY))
    assert model.language_model.config.recompute_granularity == recompute
    pairs = make_pairs()
    sep = mpo_step(model, ctx, [pairs], shared=False)
    shr = mpo_step(model, ctx, [pairs], shared=True)
    check_equal(max_differences(sep, shr), reached(model))
