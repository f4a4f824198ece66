"""Tests of checkpoint.py: layout, latest resolution, refusal to overwrite, RNG round trip, and (one torchrun launch
of tests/dist/check_checkpoint.py on 2 gloo ranks) exact resume of a megatron-core model + DDP + (distributed) Adam,
including the Adam-step trap, keep_last, a leftover .tmp, the schedule-horizon check and TP resharding of the model
part.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _fake_ckpt(run_dir: Path, name: str, complete: bool = True) -> Path:
    p = run_dir / name
    (p / checkpoint.MODEL_OPTIM_DIR).mkdir(parents=True)
    if complete:
        (p / checkpoint.RUN_STATE_FILE).write_text(json.dumps({"step": 0}))
    return p


def test_latest_is_highest_complete_step_and_ignores_tmp(tmp_path, capsys):
    for name in ("step_2", "step_10", "step_9"):
        _fake_ckpt(tmp_path, name)
    _fake_ckpt(tmp_path, "step_12.tmp")  # killed mid-save: has files, but the name says incomplete
    _fake_ckpt(tmp_path, "step_11", complete=False)  # no run_state.json
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "step_x").mkdir()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 9, 10]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_10"
    assert "step_11" in capsys.readouterr().err  # the incomplete one is reported, not silently skipped
    assert checkpoint.latest_checkpoint(tmp_path / "missing") is None


def test_resume_false_refuses_existing_checkpoint(tmp_path):
    assert checkpoint.resume_path(tmp_path, resume=False) is None  # empty dir: a fresh start is fine
    _fake_ckpt(tmp_path, "step_3.tmp")
    assert checkpoint.resume_path(tmp_path, resume=False) is None  # only an unfinished save: nothing to protect
    _fake_ckpt(tmp_path, "step_3")
    with pytest.raises(checkpoint.CheckpointError, match="step_3.*checkpoint.resume = false"):
        checkpoint.resume_path(tmp_path, resume=False)
    assert checkpoint.resume_path(tmp_path, resume=True) == tmp_path / "step_3"


def test_export_names_a_model_dir_missing_from_the_working_directory(tmp_path, monkeypatch):
    import config as config_mod

    step = _fake_ckpt(tmp_path / "run", "step_4")
    cfg = config_mod.to_dict(config_mod.load_config(ROOT / "configs" / "tiny.toml"))  # hf_path = "assets/tiny-omni"
    (step / checkpoint.RUN_STATE_FILE).write_text(json.dumps({"step": 4, "config": cfg}))
    monkeypatch.chdir(tmp_path)  # not the repository root: the relative model path does not resolve here
    with pytest.raises(checkpoint.CheckpointError, match="model.hf_path = 'assets/tiny-omni' has no config.json seen"):
        checkpoint.export(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 5, 7):
        _fake_ckpt(tmp_path, f"step_{s}")
    tmp = _fake_ckpt(tmp_path, "step_8.tmp")
    assert checkpoint.prune(tmp_path, 0) == []
    removed = checkpoint.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "step_7", "step_8.tmp"]
    assert tmp.exists()


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    draws = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])


@pytest.fixture(scope="module")
def dist_result(torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_ckpt")
    return torchrun(ROOT / "tests" / "dist" / "check_checkpoint.py", out).result


@pytest.mark.parametrize("variant", ["dopt1", "dopt0"])
def test_exact_resume(dist_result, variant):
    r = dist_result[variant]
    # steps 3-4 after resume equal the uninterrupted run bit for bit (loss, grad norm, lr) ...
    assert r["resumed"] == r["straight"][2:]
    assert r["first"] == r["straight"][:2]
    # ... and so do the final weights and every optimizer tensor (fp32 main params, exp_avg, exp_avg_sq, step)
    assert r["final_count"] > 20 and r["final_max_diff"] == 0.0
    # the lr follows warmup (1 step from 0) then cosine to min_lr over the 4-step horizon, also across the resume
    lrs = [s["lr"] for s in r["straight"]]
    cos = lambda n: 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (n - 1) / 3))  # noqa: E731
    assert lrs == pytest.approx([0.0, 1e-2, cos(2), cos(3)], abs=1e-15)
    assert r["sched_num_steps"] == 2


@pytest.mark.parametrize("variant", ["dopt1", "dopt0"])
def test_resume_restores_adam_step_per_parameter(dist_result, variant):
    r = dist_result[variant]
    assert r["saved_steps"] == [2.0] * r["num_params"]
    assert r["loaded_steps"] == [2.0] * r["num_params"]
    assert r["loaded_step_tensors"] == r["num_params"]  # one tensor per parameter, not one shared tensor


def test_upstream_distributed_optimizer_step_trap_is_present(dist_result):
    """megatron-core 0.19.2 without TE/Apex: the distributed optimizer alone brings `step` back as 1 in one shared
    tensor. If this starts failing after an upgrade, the trap is fixed upstream."""
    r = dist_result["dopt1"]
    assert r["upstream_steps"] == [1.0] * r["num_params"]
    assert r["upstream_step_tensors"] == 1


@pytest.mark.parametrize("variant", ["dopt1", "dopt0"])
def test_run_state_tmp_and_keep_last(dist_result, variant):
    r = dist_result[variant]
    assert r["dirs"] == ["step_2", "step_3.tmp"]  # keep_last=1 removed step_1; the fake killed save stays, ignored
    assert r["latest"] == "step_2"
    assert r["state"]["step"] == 2
    assert r["state"]["reward_shift"] == r["reward_shift_expected"]  # JSON round-trips the float exactly
    assert r["state"]["sampler"] == {"epoch": 0, "offset": 8} and r["state"]["wandb_run_id"] == "abc123"
    assert r["state"]["consumed_pairs"] == 8


@pytest.mark.parametrize("variant", ["dopt1", "dopt0"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("horizon", "(saved, now): {'lr_decay_steps': (4, 5), 'wd_incr_steps': (4, 5)}; set mpo.max_num_steps back"),
        ("lr", "(saved, now): {'max_lr': (0.01, 0.005)}; set optimizer.lr back"),
        ("min_lr", "(saved, now): {'min_lr': (0.001, 0.0001)}; set optimizer.min_lr back"),
    ],
)
def test_changed_schedule_is_refused_before_any_state_is_loaded(dist_result, variant, change, message):
    r = dist_result[variant]
    assert r[f"{change}_error"] is not None and message in r[f"{change}_error"]
    assert r[f"{change}_untouched"]  # the optimizer's tensors and the scheduler are as built


def test_check_schedule_names_every_changed_setting(tmp_path):
    saved = {"max_lr": 1e-4, "min_lr": 1e-6, "init_lr": 0.0, "lr_warmup_steps": 2, "lr_decay_steps": 6,
             "lr_decay_style": "cosine", "start_wd": 0.0, "end_wd": 0.0, "wd_incr_steps": 6,
             "wd_incr_style": "constant", "num_steps": 2}  # fmt: skip
    checkpoint.check_schedule(tmp_path, saved, dict(saved, num_steps=0))  # the step count is not a setting
    checkpoint.check_schedule(tmp_path, {k: v for k, v in saved.items() if k != "init_lr"}, dict(saved, init_lr=1e-5))
    now = dict(saved, init_lr=1e-5, lr_decay_style="linear", start_wd=0.1, end_wd=0.1)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.check_schedule(tmp_path / "step_2", saved, now)
    assert str(e.value).startswith(
        f"the LR schedule of {tmp_path / 'step_2'} differs from this run's (saved, now): {{'init_lr': (0.0, 1e-05), "
        "'lr_decay_style': ('cosine', 'linear'), 'start_wd': (0.0, 0.1), 'end_wd': (0.0, 0.1)}; set "
        "scheduler.lr_warmup_init, scheduler.lr_decay_style, optimizer.weight_decay back to the saved values"
    )
    with pytest.raises(checkpoint.CheckpointError, match="run_state.json has no scheduler state"):
        checkpoint.check_schedule(tmp_path, None, saved)


def test_model_reshards_tp1_to_tp2(dist_result):
    r = dist_result["reshard"]
    assert r["tp2_fresh"] != pytest.approx(r["tp1"], abs=1e-3)  # the load changes something
    assert r["tp2"] == pytest.approx(r["tp1"], abs=1e-6)
