"""Tests of checkpoint.py: layout, latest resolution, refusal to overwrite, RNG round trip, and (one torchrun launch
of tests/dist/check_checkpoint.py on 2 gloo ranks) exact resume of a megatron-core model + DDP + (distributed) Adam,
including the Adam-step trap, keep_last, a leftover .tmp, the schedule-horizon check and TP resharding of the model
part; without a launcher: the one-line refusals of a resume with another layout or β / *_average_log_probs, the
notice and kept config of a resume with other loss weights, and the export's refusal of the run's own directories
and model.hf_path. The run-directory lock (a held lock, no flock support, a refused torchrun launch), removal
of unfinished step_N.tmp saves, a failed save on one rank (in the harness), damaged checkpoints refused naming the
missing files, and a rank whose launcher died stopping after its step (distributed.StopSignal). Files that
differ from their saved checksums (1 and 2 ranks), a non-finite first step after a resume, full disks (metrics.jsonl,
torch's zip writer, the export).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import raises_naming

import checkpoint
import hf_export

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int, config: dict, world_size: int = 1) -> dict:
    """A run_state.json that `checkpoint.read_run_state` accepts: step `step` of a run with the resolved `config`."""
    return {"step": step, "world_size": world_size, "consumed_pairs": 4 * step, "reward_shift": 0.0,
            "reward_shift_num_updates": step, "sampler": {"epoch": 0, "offset": 4 * step}, "scheduler": {},
            "config": config}  # fmt: skip


def _fake_ckpt(run_dir: Path, name: str, complete: bool = True) -> Path:
    p = run_dir / name
    (p / checkpoint.MODEL_OPTIM_DIR).mkdir(parents=True)
    if complete:
        (p / checkpoint.RUN_STATE_FILE).write_text(json.dumps({"step": 0}))
    return p


def test_cli_help_usage_and_one_line_errors(tmp_path, capsys):
    """`python hf_export.py --help` exits 0 and says what RUN_DIR may be, a wrong command line is argparse's usage +
    one error line (exit 2), a missing checkpoint one error line (exit 1)."""
    with pytest.raises(SystemExit) as e:
        hf_export.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python hf_export.py [-h] [--adapter] RUN_DIR OUT_DIR")
    assert "a run directory (checkpoint.dir: its latest step_<N>) or one step_<N>" in " ".join(out.split())
    for argv, names in (([], ["RUN_DIR, OUT_DIR"]), (["a"], ["OUT_DIR"]),
                        (["a", "b", "c"], ["unrecognized arguments: c"])):
        with pytest.raises(SystemExit) as e:
            hf_export.main(argv)
        last = capsys.readouterr().err.splitlines()[-1]
        assert e.value.code == 2 and last.startswith("python hf_export.py: error: ") and all(n in last for n in names)
    assert hf_export.main([str(tmp_path / "none"), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'none'}: ") and err.count("\n") == 1 and "run_state.json" in err, err
    assert not (tmp_path / "hf").exists()


def test_latest_is_highest_complete_step_and_ignores_tmp(tmp_path, capsys):
    for name in ("step_2", "step_10", "step_9"):
        _fake_ckpt(tmp_path, name)
    _fake_ckpt(tmp_path, "step_12.tmp")  # killed mid-save: has files, but the name says incomplete
    _fake_ckpt(tmp_path, "step_5", complete=False)  # no run_state.json: damaged, below the latest
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "step_x").mkdir()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 9, 10]
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_10"
    assert "step_5" in capsys.readouterr().err  # the damaged one is reported, not silently skipped
    assert checkpoint.latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.parametrize("missing", [checkpoint.RUN_STATE_FILE, checkpoint.MODEL_OPTIM_DIR])
def test_a_damaged_newest_step_is_refused_not_taken_for_an_unfinished_save(tmp_path, missing):
    """A step_<N> without run_state.json was skipped as "incomplete": the run resumed from the previous
    step (or afresh) and its next save of step N wrote over the trained weights. Saves are renamed from step_<N>.tmp
    when complete, so such a folder is damage: refused, naming it and the previous checkpoint."""
    _fake_ckpt(tmp_path, "step_1")
    bad = _fake_ckpt(tmp_path, "step_2")
    if missing == checkpoint.MODEL_OPTIM_DIR:
        shutil.rmtree(bad / missing)
    else:
        (bad / missing).unlink()
    for find in (checkpoint.latest_checkpoint, lambda d: checkpoint.resume_path(d, resume=True)):
        with raises_naming(checkpoint.CheckpointError, f"{bad} ", tmp_path / "step_1"):
            find(tmp_path)
    shutil.rmtree(tmp_path / "step_1")  # the only checkpoint: still refused, never a fresh start over it
    with raises_naming(checkpoint.CheckpointError, bad, f"{bad}.damaged"):
        checkpoint.latest_checkpoint(tmp_path)
    bad.rename(tmp_path / "step_2.damaged")  # the way out the line names
    assert checkpoint.latest_checkpoint(tmp_path) is None


def test_resume_false_refuses_existing_checkpoint(tmp_path):
    assert checkpoint.resume_path(tmp_path, resume=False) is None  # empty dir: a fresh start is fine
    _fake_ckpt(tmp_path, "step_3.tmp")
    assert checkpoint.resume_path(tmp_path, resume=False) is None  # only an unfinished save: nothing to protect
    _fake_ckpt(tmp_path, "step_3")
    with raises_naming(checkpoint.CheckpointError, "step_3", "checkpoint.resume"):
        checkpoint.resume_path(tmp_path, resume=False)
    assert checkpoint.resume_path(tmp_path, resume=True) == tmp_path / "step_3"


def test_export_names_a_model_dir_missing_from_the_working_directory(tmp_path, monkeypatch):
    import config as config_mod

    step = _fake_ckpt(tmp_path / "run", "step_4")
    cfg = config_mod.to_dict(config_mod.load_config(ROOT / "configs" / "tiny.toml"))  # hf_path = "assets/tiny-omni"
    (step / checkpoint.RUN_STATE_FILE).write_text(json.dumps(_state(4, cfg)))
    monkeypatch.chdir(tmp_path)  # not the repository root: the relative model path does not resolve here
    with raises_naming(checkpoint.CheckpointError, "model.hf_path", "'assets/tiny-omni'", "config.json", tmp_path):
        hf_export.export(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_of_a_config_this_version_cannot_load_is_one_line(tmp_path, capsys):
    """A saved config with a key this version lacks (a checkpoint of another version) ended in a ConfigError
    traceback, a run_state.json without "config" in KeyError: 'config'; both are a CheckpointError naming the file."""
    import config as config_mod

    run = tmp_path / "run"
    step = _fake_ckpt(run, "step_4")
    state = step / checkpoint.RUN_STATE_FILE
    cfg = config_mod.to_dict(config_mod.load_config(ROOT / "configs" / "tiny.toml"))
    cfg["mpo"]["old_key"] = 1
    state.write_text(json.dumps(_state(4, cfg)))
    with raises_naming(checkpoint.CheckpointError, state, "'mpo.old_key'"):
        hf_export.export(run, tmp_path / "hf")
    state.write_text(json.dumps({k: v for k, v in _state(4, cfg).items() if k != "config"}))
    capsys.readouterr()  # what the direct export call above let through (a library's first-import log line)
    assert hf_export.main([str(run), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {state} ") and "'config'" in err and len(err.splitlines()) == 1
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


def test_check_resume_refuses_layout_reward_units_and_schedule_and_notes_the_rest(tmp_path, capsys):
    """RESUME_RULES: a changed layout (it failed deep in dist_checkpointing), β or quality flag (δ is an
    EMA of rewards in the saved units) or LR schedule (chained segments) is refused in one error naming every refused
    key; the loss weights, δ's momentum, the DPO / SFT flags, the pair format and model.hf_path are returned as
    notices (and the gradient buffers' dtype); another DP size (no setting) and a key the saved config lacks are no
    change."""
    import config as config_mod

    tiny = ROOT / "configs" / "tiny.toml"
    saved = ["model.params_dtype=bfloat16", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
             "packing.shared_prompt=false"]  # fmt: skip
    step = _step_with_config(tmp_path / "run", 3, *saved)
    state = checkpoint.read_run_state(step)
    assert checkpoint.check_resume(state, config_mod.load_config(tiny, saved)) == {}  # the same (any world size)
    refused = {"model.params_dtype": "float32", "parallel.tensor_model_parallel_size": "1",
               "parallel.sequence_parallel": "false", "mpo.reference_policy_kl_penalty": "0.1",
               "mpo.quality_average_log_probs": "true", "optimizer.lr": "0.5", "mpo.max_num_steps": "7",
               "model.freeze_vision_encoder": "true"}  # fmt: skip
    named = [k for k in refused if k != "parallel.sequence_parallel"]
    with raises_naming(checkpoint.CheckpointError, step, *named) as e:
        checkpoint.check_resume(state, config_mod.load_config(tiny, [f"{k}={v}" for k, v in refused.items()]))
    assert "parallel.sequence_parallel" not in str(e.value)  # no RESUME_RULES key: SP follows TP here
    notices = ["mpo.bco_loss_weight=0.5", "mpo.sft_loss_weight=0.1", "packing.shared_prompt=true",
               "mpo.reward_shift_momentum=0.9", "mpo.preference_average_log_probs=true",
               "mpo.sft_average_log_probs=false", "model.hf_path=/elsewhere",
               "optimizer.grad_reduce_in_fp32=false", "lora.dropout=0.3"]  # fmt: skip
    assert checkpoint.check_resume(state, config_mod.load_config(tiny, saved + notices)) == {
        "lora.dropout": (0.0, 0.3),
        "model.hf_path": ("assets/tiny-omni", "/elsewhere"), "mpo.bco_loss_weight": (0.2, 0.5),
        "mpo.sft_loss_weight": (0.0, 0.1), "mpo.reward_shift_momentum": (0.99, 0.9),
        "mpo.preference_average_log_probs": (False, True), "mpo.sft_average_log_probs": (True, False),
        "packing.shared_prompt": (False, True), "optimizer.grad_reduce_in_fp32": (True, False),
    }  # fmt: skip
    import monitor

    for lora_rank, says in ((0, "the frozen reference model"), (4, "the base model under the adapters")):
        lora_state = dataclasses.replace(state, config={**state.config, "lora": {"rank": lora_rank}})
        monitor.print_resume(lora_state, {"model.hf_path": ("a", "b")}, None, rank=0)
        assert says in capsys.readouterr().out
    older = dict(state.config, optimizer={k: v for k, v in state.config["optimizer"].items() if k != "lr"})
    older_state = dataclasses.replace(state, config=older)  # saved before optimizer.lr existed
    assert checkpoint.check_resume(older_state, config_mod.load_config(tiny, [*saved, "optimizer.lr=0.5"])) == {}


def test_model_reshards_tp1_to_tp2(dist_result):
    r = dist_result["reshard"]
    assert r["tp2_fresh"] != pytest.approx(r["tp1"], abs=1e-3)  # the load changes something
    assert r["tp2"] == pytest.approx(r["tp1"], abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Resume with another layout, export target, damaged shards


def _step_with_config(run_dir: Path, step: int, *overrides: str, world_size: int = 2) -> Path:
    import config as config_mod

    p = _fake_ckpt(run_dir, f"step_{step}")
    cfg = config_mod.to_dict(config_mod.load_config(ROOT / "configs" / "tiny.toml", list(overrides)))
    (p / checkpoint.RUN_STATE_FILE).write_text(json.dumps(_state(step, cfg, world_size)))
    return p


def test_export_refuses_a_directory_that_holds_a_run(tmp_path):
    run = tmp_path / "run"
    step = _step_with_config(run, 2)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    for out, named in [(run, "config.json"), (step, "(step_2)"), (step / "hf", "(step_2)"),
                       (run / "step_9", "inside the run directory"), (run / "hf", "inside the run directory")]:
        with raises_naming(checkpoint.CheckpointError, f"export directory {out} ", named):
            hf_export.check_export_dir(out, step)
    other = tmp_path / "other"  # another run: config.json + a checkpoint, no metrics
    _fake_ckpt(other, "step_7")
    (other / "config.json").write_text("{}")
    with raises_naming(checkpoint.CheckpointError, f"export directory {other} ", "(config.json, step_7)"):
        hf_export.check_export_dir(other, step)
    with pytest.raises(checkpoint.CheckpointError, match="is the run directory of the checkpoint it exports"):
        hf_export.check_export_dir(run / "." / ".." / "run", step / ".." / "step_2")  # the same, spelled otherwise
    logged = tmp_path / "logged"  # a run that logged steps but saved no checkpoint
    logged.mkdir()
    (logged / "config.json").write_text("{}")
    (logged / "metrics.jsonl").write_text("")
    with raises_naming(checkpoint.CheckpointError, logged, "(config.json, metrics.jsonl)"):
        hf_export.check_export_dir(logged, step)
    (tmp_path / "old_export").mkdir()
    (tmp_path / "old_export" / "config.json").write_text("{}")
    (tmp_path / "old_export" / checkpoint.EXPORT_INFO_FILE).write_text("{}")  # an earlier export: overwritten
    for fine in (tmp_path / "new", tmp_path / "old_export"):
        hf_export.check_export_dir(fine, step)
    with pytest.raises(checkpoint.CheckpointError, match="is the run directory of the checkpoint"):
        hf_export.export(run, run)  # before any model is built
    assert (run / "config.json").read_text() == "{}"


def test_export_refuses_a_file_or_a_directory_that_is_not_an_earlier_export(tmp_path, capsys):
    """`export RUN OUT` wrote over the files of any existing OUT (an unrelated config.json; OUT=/tmp put the model
    files straight into /tmp), and OUT an existing file ended in a FileExistsError traceback. OUT must be new, empty or
    an earlier export (it holds checkpoint.EXPORT_INFO_FILE); the refusals come before anything is written."""
    step = _step_with_config(tmp_path / "run", 2)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "config.json").write_text('{"mine": 1}')
    busy = tmp_path / "busy"  # like /tmp: many entries
    busy.mkdir()
    for name in ("e", "d", "c", "b", "a"):
        (busy / name).write_text("")
    (busy / "sub").mkdir()
    for out, names in [(a_file, []), (unrelated, ["(config.json)", checkpoint.EXPORT_INFO_FILE]),
                       (busy, ["(a, b, c, ... (6 entries))", checkpoint.EXPORT_INFO_FILE])]:  # fmt: skip
        with raises_naming(checkpoint.CheckpointError, f"export directory {out} ", *names) as e:
            hf_export.check_export_dir(out, step)
        assert hf_export.main([str(tmp_path / "run"), str(out)]) == 1  # before any model is built
        assert capsys.readouterr().err == f"error: {e.value}\n"  # the CLI's format: the error, one line, no traceback
    assert a_file.read_text() == "mine" and (unrelated / "config.json").read_text() == '{"mine": 1}'
    assert sorted(p.name for p in unrelated.iterdir()) == ["config.json"] and len(list(busy.iterdir())) == 6
    empty = tmp_path / "empty"
    empty.mkdir()
    earlier = tmp_path / "earlier"  # an earlier export (even an interrupted one) may be exported over
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    (earlier / checkpoint.EXPORT_INFO_FILE).write_text('{"complete": false}')
    for fine in (empty, earlier, tmp_path / "new" / "hf"):
        hf_export.check_export_dir(fine, step)
    with raises_naming(checkpoint.CheckpointError, a_file / "hf", "Not a directory") as e:  # a file parent
        hf_export._write_export_info(a_file / "hf.tmp", {}, a_file / "hf")
    assert "\n" not in str(e.value)  # one line, no traceback


def test_export_refuses_the_runs_model_hf_path_before_writing(tmp_path, monkeypatch):
    """`export RUN OUT` with OUT = the run's model.hf_path ended in shutil.SameFileError (a traceback from
    hf_weights.export_hf, after the export had started writing)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"marker": 1}')
    (tmp_path / "link").symlink_to(src)
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # a relative model.hf_path resolves from the working directory, as in the export
    for hf_path in (str(src), "src", "link"):
        step = _step_with_config(run, 2, f"model.hf_path={hf_path}")
        for out in (src, tmp_path / "link", tmp_path / "x" / ".." / "src", "src"):
            with raises_naming(checkpoint.CheckpointError, f"export directory {out} ", f"model.hf_path ({hf_path}"):
                hf_export.export(run, out)
        hf_export.check_export_dir(tmp_path / "other", step, hf_path)
        hf_export.check_export_dir(src / "hf", step, hf_path)  # a new directory inside it writes nothing of it
        shutil.rmtree(run)
    assert sorted(p.name for p in src.iterdir()) == ["config.json"] and (src / "config.json").read_text() == (
        '{"marker": 1}'
    )
    assert not (tmp_path / "x").exists()
    assert hf_export.main([str(_step_with_config(run, 2, f"model.hf_path={src}")), str(src)]) == 1


@pytest.fixture(scope="module")
def loss_change(tmp_path_factory):
    """One step of the tiny run (one process), then resumes with a changed β (refused) and with a changed
    bco_loss_weight and shared-prompt format (one more step)."""
    run = tmp_path_factory.mktemp("loss_change")
    short = ["mpo.max_num_steps=2", "scheduler.lr_warmup_steps=1", "data.train.split_validation_size=0",
             "mpo.val_at_end=false"]  # fmt: skip
    # the first segment in separate sequences (tiny.toml's), resumed in the shared format ("auto" on the CPU)
    first = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", *short, "mpo.stop_after_step=1",
                 "packing.shared_prompt=false")  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    config_1 = (run / "config.json").read_text()
    beta = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", *short, "mpo.reference_policy_kl_penalty=0.1",
                "packing.shared_prompt=false")  # fmt: skip
    config_after_beta = (run / "config.json").read_text()
    second = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", *short, "mpo.bco_loss_weight=0.5",
                  "packing.shared_prompt=auto")  # fmt: skip
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    return SimpleNamespace(dir=run, config_1=config_1, beta=beta, config_after_beta=config_after_beta, second=second)


def test_resume_with_another_beta_is_refused_in_one_line(loss_change):
    run, proc = loss_change.dir, loss_change.beta
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: CheckpointError: cannot resume {run / 'step_1'} ")
    assert "mpo.reference_policy_kl_penalty 0.05 -> 0.1" in last
    assert loss_change.config_after_beta == loss_change.config_1  # a refused resume leaves the run's config


def test_resume_with_another_loss_weight_prints_the_change_and_keeps_the_old_config(loss_change):
    run, out = loss_change.dir, loss_change.second.stdout.splitlines()
    notice = [x for x in out if x.startswith("resume:")]
    assert notice == ["resume: changed settings from step 2 on: mpo.bco_loss_weight 0.2 -> 0.5, packing."
                      "shared_prompt False -> True; the settings of steps up to 1: config.step_1.json"]  # fmt: skip
    assert out.index(notice[0]) == out.index(next(x for x in out if x.startswith("resumed from"))) + 1
    old = json.loads((run / "config.step_1.json").read_text())
    assert (run / "config.step_1.json").read_text() == loss_change.config_1  # the first segment's config.json
    assert old == json.loads((run / "step_1" / checkpoint.RUN_STATE_FILE).read_text())["config"]
    assert (old["mpo"]["bco_loss_weight"], old["packing"]["shared_prompt"]) == (0.2, False)
    new = json.loads((run / "config.json").read_text())
    assert (new["mpo"]["bco_loss_weight"], new["packing"]["shared_prompt"]) == (0.5, True)
    assert json.loads((run / "step_2" / checkpoint.RUN_STATE_FILE).read_text())["config"] == new
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "config.step_1.json", "metrics.jsonl",
                                                      "step_1", "step_2"]  # fmt: skip
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # step 2's loss uses the new weight: w_p·pref + w_q·bco + w_g·sft with w_q = 0.5 (tiny.toml: w_p 0.8, w_g 0)
    assert rows[1]["loss"] == pytest.approx(0.8 * rows[1]["preference_loss"] + 0.5 * rows[1]["bco_loss"], rel=1e-6)


@pytest.fixture(scope="module")
def bf16_segment(torchrun, tmp_path_factory):
    """One bf16 step of the tiny run on 2 ranks (DP = 2): step_1."""
    run_dir = tmp_path_factory.mktemp("bf16_segment")
    torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", "model.params_dtype=bfloat16",
             "mpo.stop_after_step=1")  # fmt: skip
    return run_dir


def _cli(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=None if umask is None else (lambda: os.umask(umask)))  # fmt: skip


def test_resume_with_another_dtype_or_tp_ep_is_one_line_and_another_dp_resumes(bf16_segment, torchrun):
    """A changed params_dtype / TP / EP failed deep in dist_checkpointing (KeyError ... bucket_idx_0.param)."""
    run = bf16_segment
    config_before = (run / "config.json").read_text()
    for overrides, diff in [
        ([], "model.params_dtype 'bfloat16' -> 'float32'"),
        (["model.params_dtype=bfloat16", "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
         "parallel.tensor_model_parallel_size 1 -> 2"),
        (["model.params_dtype=bfloat16", "parallel.expert_model_parallel_size=2"],
         "parallel.expert_model_parallel_size 1 -> 2"),
    ]:  # fmt: skip
        proc = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", "mpo.stop_after_step=2", *overrides,
                        check=False)  # fmt: skip
        assert proc.returncode == 1
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("error: ")]
        assert len(lines) == 1 and lines[0].startswith(f"error: CheckpointError: cannot resume {run / 'step_1'} ")
        assert diff in lines[0]
        assert "Connection closed" not in proc.stderr and "KeyError" not in proc.stderr
    assert (run / "config.json").read_text() == config_before  # a refused resume leaves the run's config
    assert not (run / "step_2").exists()
    # DP = 2 -> DP = 1 (one process, no launcher), fp32 -> bf16 gradient buffers: resumes, the latter a notice
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", "model.params_dtype=bfloat16",
                "mpo.stop_after_step=2", "optimizer.grad_reduce_in_fp32=false")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {run / 'step_1'} (step 1" in proc.stdout and (run / "step_2").is_dir()
    notice = [x for x in proc.stdout.splitlines() if x.startswith("resume: changed settings")]
    assert len(notice) == 1 and "optimizer.grad_reduce_in_fp32 True -> False" in notice[0]


def test_export_refuses_the_run_dir_and_writes_files_readable_as_the_umask_allows(bf16_segment, tmp_path):
    """`export RUN RUN` replaced the run's config.json with the HF one; model.safetensors was 0600."""
    run = bf16_segment
    config_before = (run / "config.json").read_text()
    proc = _cli("hf_export.py", str(run), str(run))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"error: export directory {run} ") and "config.json" in last, last
    assert (run / "config.json").read_text() == config_before
    out = tmp_path / "hf"
    proc = _cli("hf_export.py", str(run), str(out), umask=0o027)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o640  # 0666 & ~umask, as open() creates files
    assert modes["model.safetensors.index.json"] == 0o640
    info = json.loads((out / checkpoint.EXPORT_INFO_FILE).read_text())  # the provenance that marks an export
    latest = checkpoint.list_checkpoints(run)[-1]  # step_1, or step_2 after the module's resume test
    assert info.pop("date")[:2] == "20" and info == {
        "source": str(latest[1]), "step": latest[0], "model.hf_path": str(ROOT / "assets" / "tiny-omni"),
        "model_snapshot": None, "complete": True}  # fmt: skip (a local folder: no hub snapshot)
    before = (out / "model.safetensors").read_bytes()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"x")  # a shard of an earlier export of another base
    proc = _cli("hf_export.py", str(run), str(out))  # into an earlier export: allowed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"exported {out}" and (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # the unlisted shard is gone


def test_truncated_shard_is_named(bf16_segment, tmp_path):
    """A truncated shard gave "EOFError: Ran out of input" with no file name (resume and export)."""
    import shutil

    latest = checkpoint.latest_checkpoint(bf16_segment)
    broken = tmp_path / "run" / latest.name
    shutil.copytree(latest, broken)
    shard = sorted((broken / checkpoint.MODEL_OPTIM_DIR).glob("*.distcp"))[0]
    need = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(1000)
    damaged = [f"({broken})", f"model_optim/{shard.name} has 1000 bytes", f"needs {need}", f"{broken}.damaged"]
    proc = _cli("hf_export.py", str(broken), str(tmp_path / "hf"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: ") and all(n in last for n in damaged), last
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={broken.parent}", "model.params_dtype=bfloat16",
                f"mpo.stop_after_step={int(latest.name[5:]) + 1}")  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert last.startswith("error: CheckpointError: ") and all(n in last for n in damaged), last


# ----------------------------------------------------------------------------------------------------------------------
# One run per checkpoint.dir, unfinished saves, failed saves, damaged checkpoints, orphan ranks

HOLD_LOCK = """
import sys, time
sys.path.insert(0, sys.argv[2])
import checkpoint
checkpoint.lock_run_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def own_lock(monkeypatch):
    """This process's run-dir lock starts free and is released after the test."""
    monkeypatch.setattr(checkpoint, "_held_lock", None)
    yield
    if checkpoint._held_lock is not None:
        os.close(checkpoint._held_lock[1])


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, SLURM_JOB_ID="4242")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir), str(ROOT)], env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline() == "held\n"
    return holder


def test_lock_run_dir_refuses_a_held_dir_and_is_free_once_the_holder_dies(tmp_path, own_lock, capsys):
    """Two runs in one checkpoint.dir corrupted each other's checkpoints and metrics."""
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        info = json.loads((run / ".lock").read_text())
        assert (info["pid"], info["slurm_job_id"]) == (holder.pid, "4242")
        with raises_naming(checkpoint.CheckpointError, f"checkpoint.dir = {run} ", f"pid {holder.pid}", info["host"],
                           "4242", info["started"], run / ".lock"):  # fmt: skip
            checkpoint.lock_run_dir(run)
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock
        holder.wait()
    checkpoint.lock_run_dir(run)
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    checkpoint.lock_run_dir(run)  # held by this process already: fine
    assert capsys.readouterr().err == ""


def test_lock_run_dir_without_flock_support_is_one_notice(tmp_path, own_lock, monkeypatch, capsys):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    checkpoint.lock_run_dir(tmp_path / "run")
    err = capsys.readouterr().err  # one notice line naming the directory and the OS's reason
    assert err.startswith("checkpoint: ") and err.count("\n") == 1, err
    assert all(n in err for n in (f"{tmp_path / 'run'} ", "(No locks available)", "checkpoint.dir")), err
    assert json.loads((tmp_path / "run" / ".lock").read_text())["pid"] == os.getpid()


def test_lock_run_dir_removes_unfinished_saves(tmp_path, own_lock, capsys):
    """A killed save's step_N.tmp (a full checkpoint's size) stayed for good."""
    for name in ("step_2", "step_3.tmp", "step_10.tmp", "step_2.old", "step_5.old"):
        _fake_ckpt(tmp_path, name)
    (tmp_path / "step_5.old" / "marker").write_text("5")
    (tmp_path / "step_4.tmp").write_text("")  # a file, not a save: left alone
    checkpoint.lock_run_dir(tmp_path)
    # step_5.old: a replacing save killed between its renames, restored; step_2.old beside step_2: removed
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_2", "step_4.tmp", "step_5"]
    assert (tmp_path / "step_5" / "marker").read_text() == "5"
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_5"
    restored, removed = capsys.readouterr().err.splitlines()  # one notice each, naming the folders
    assert restored.startswith("checkpoint: restored ") and restored.endswith(f"{tmp_path}: step_5.old"), restored
    assert removed.startswith("checkpoint: removed ") and removed.endswith(
        f"{tmp_path}: step_10.tmp, step_2.old, step_3.tmp"), removed  # fmt: skip
    checkpoint.lock_run_dir(tmp_path)  # nothing left: no line
    assert capsys.readouterr().err == ""


def test_train_refuses_a_checkpoint_dir_in_use_on_every_rank(torchrun, tmp_path):
    run = tmp_path / "run"
    holder = _hold_lock(run)
    try:
        info = json.loads((run / ".lock").read_text())
        proc = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", check=False, timeout=180)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1 and 'train.py", line' not in proc.stderr  # no traceback from the ranks
    [msg] = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("error: ")]  # rank 0 once
    assert msg.startswith(f"error: CheckpointError: checkpoint.dir = {run} "), msg
    assert all(n in msg for n in (f"pid {holder.pid}", info["host"], "4242", info["started"], str(run / ".lock"))), msg
    assert f"  traceback : {msg}" in proc.stderr.splitlines()  # torchrun's root cause: both ranks raised it
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing written by the refused run


def test_failed_save_is_one_line_on_every_rank_and_removes_its_tmp(dist_result):
    """A full disk gave "RuntimeError ... unexpected pos 704 vs 598" and left step_N.tmp behind. The harness
    makes one rank's shard writer raise OSError(ENOSPC) while saving step 3 (rank 1; rank 0 with the plain
    optimizer, where rank 1 writes no shard)."""
    import re

    for variant in ("dopt1", "dopt0"):
        r = dist_result[variant]
        run = Path(r["run_dir"])
        for key in ("failed_save_errors", "failed_metadata_errors"):  # the peer printed a traceback
            assert [printed for _, printed in r[key]] == ["", ""]  # the error line alone, on every rank
        errors = [e for e, _ in r["failed_save_errors"]]
        assert r["failed_save_dirs"] == ["step_2"]  # step_3.tmp removed, the complete checkpoint kept
        assert errors[0] == errors[1]  # the same line on both ranks
        names = (f"{run / 'step_3.tmp'} ", f"rank {r['failed_rank']}: OSError: [Errno 28] No space left on device (")
        assert "\n" not in errors[0] and all(n in errors[0] for n in names), errors[0]
        assert re.search(rf"\(\d+ bytes free on {re.escape(str(run))}\)", errors[0]), errors[0]
        # rank 0's write of model_optim/.metadata fails: the same line (rank 0), megatron's save had returned there
        errors = [e for e, _ in r["failed_metadata_errors"]]
        assert r["failed_metadata_dirs"] == ["step_2"]
        assert errors[0] == errors[1]
        names = (f"{run / 'step_3.tmp'} ", "rank 0: OSError: [Errno 28] No space left on device (")
        assert "\n" not in errors[0] and all(n in errors[0] for n in names), errors[0]
        assert re.search(rf"\(\d+ bytes free on {re.escape(str(run))}\)", errors[0]), errors[0]


def test_save_failure_other_than_a_write_prints_its_traceback(tmp_path, monkeypatch, capsys):
    """A save failing on a bug (not an OSError) was one CheckpointError line, its traceback lost; a failed write
    (OSError, also as the cause of another exception) stays one line."""
    def broken_state(model, optimizer, is_loading):
        raise TypeError("cannot shard a tensor on cuda:0 with one on cpu")

    monkeypatch.setattr(checkpoint, "_sharded_state_dict", broken_state)
    with raises_naming(checkpoint.CheckpointError, tmp_path / "step_7.tmp",
                       "TypeError: cannot shard a tensor on cuda:0 with one on cpu"):  # fmt: skip
        checkpoint.save(tmp_path, 7, torch.nn.Linear(2, 2), None, None, {"reward_shift": 0.0})
    err = capsys.readouterr().err.splitlines()
    # after the warnings of a first megatron-core import, if any
    header = next(x for x in err if x.startswith("checkpoint: rank 0: ") and "step 7" in x)
    err = err[err.index(header):]
    assert err[1] == "Traceback (most recent call last):" and 'in broken_state' in "\n".join(err)
    assert err[-1] == "TypeError: cannot shard a tensor on cuda:0 with one on cpu"
    assert not (tmp_path / "step_7.tmp").exists()

    def full_disk(model, optimizer, is_loading):
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner

    monkeypatch.setattr(checkpoint, "_sharded_state_dict", full_disk)
    with raises_naming(checkpoint.CheckpointError, tmp_path / "step_7.tmp",
                       "OSError: [Errno 28] No space left on device ("):  # fmt: skip
        checkpoint.save(tmp_path, 7, torch.nn.Linear(2, 2), None, None, {"reward_shift": 0.0})
    assert capsys.readouterr().err == ""


def test_save_killed_while_replacing_a_step_keeps_that_step(dist_result):
    """A run killed inside a second save of step 2, between `step_2 -> step_2.old` and `step_2.tmp -> step_2`, left no
    `step_2`: the resume fell back to an older checkpoint or none, and step_2.old stayed for good. The next run's
    clean-up renames it back; the exact-resume checks above load that restored step_2."""
    for variant in ("dopt1", "dopt0"):
        r = dist_result[variant]
        assert r["killed_renames"] == ["step_2", "step_2.tmp"]  # rank 0's (the report's)
        assert r["killed_dirs"] == ["step_2.old", "step_2.tmp"]
        assert r["restored_dirs"] == ["step_2"]
        assert r["latest"] == "step_2"


def _check_complete(step: Path, world_size: int | None) -> None:
    checkpoint.check_complete(checkpoint.read_run_state(step), world_size)


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """One step of the tiny run (one process, world size 1): step_1 with model_optim/ and rng/rank_00000.pt."""
    run = tmp_path_factory.mktemp("one_step")
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", "mpo.max_num_steps=2",
                "scheduler.lr_warmup_steps=1", "mpo.stop_after_step=1", "mpo.val_at_end=false")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run / "step_1"


def test_damaged_checkpoint_is_refused_naming_the_missing_files(one_step, tmp_path):
    """A missing .metadata or shard file ended in tracebacks (or a rank waiting in a collective), a
    missing RNG file of another rank was skipped without a word."""
    def damaged(name: str, *remove: str) -> Path:
        step = tmp_path / name / "step_1"
        shutil.copytree(one_step, step)
        for f in remove:
            (step / f).unlink()
        return step

    def refused(step: Path, *names: str):  # names the step, each damaged file, and the way out (<step>.damaged)
        return raises_naming(checkpoint.CheckpointError, f"step_1 ({step})", *names, f"{step}.damaged")

    step = damaged("meta", "model_optim/.metadata")
    with refused(step, "missing model_optim/.metadata;"):
        _check_complete(step, 1)
    step = damaged("config", "model_optim/metadata.json")  # QA: megatron's CheckpointingException traceback
    with refused(step, "missing model_optim/metadata.json;"):
        _check_complete(step, 1)
    step = damaged("config_cut")  # QA: a JSONDecodeError traceback
    (step / "model_optim" / "metadata.json").write_text((one_step / "model_optim" / "metadata.json").read_text()[:10])
    with refused(step, "model_optim/metadata.json ", "(JSONDecodeError: "):
        _check_complete(step, 1)
    (step / "model_optim" / "metadata.json").write_text("[]")  # QA: JSON of another shape, a traceback after the build
    with refused(step, "model_optim/metadata.json ", "(ValueError: "):
        _check_complete(step, 1)
    step = damaged("garbled")
    (step / "model_optim" / ".metadata").write_bytes(b"not a pickle")
    with refused(step, "model_optim/.metadata "):
        _check_complete(step, 1)
    shards = sorted(p.name for p in (one_step / "model_optim").glob("*.distcp"))
    step = damaged("shard", f"model_optim/{shards[0]}")
    with refused(step, f"missing model_optim/{shards[0]};"):
        _check_complete(step, 1)
    # a saved world size of 2 (the same as now): rank 1's RNG file is required; at another world size it is not
    step = damaged("rng", "rng/rank_00000.pt")
    with refused(step, "missing rng/rank_00000.pt, rng/rank_00001.pt;"):
        _check_complete(step, 2)
    _check_complete(step, None)
    _check_complete(one_step, 1)  # the intact one passes
    # end to end: the resume is refused in one line before the models load any state
    step = damaged("e2e", f"model_optim/{shards[-1]}")
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={step.parent}", "mpo.max_num_steps=2",
                "scheduler.lr_warmup_steps=1", "mpo.val_at_end=false")  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert last.startswith(f"error: CheckpointError: checkpoint step_1 ({step}) ") and all(
        n in last for n in (f"model_optim/{shards[-1]}", f"{step}.damaged")), last  # fmt: skip
    # QA: random bytes as an RNG file ended in torch's UnpicklingError traceback, whose advice (weights_only=False)
    # does not apply to a damaged file
    step = damaged("rng_garbage")
    _without_checksums(step)  # with them, the changed file is named before the load (below)
    rng = step / "rng" / "rank_00000.pt"
    rng.write_bytes(bytes(range(256)) * 100)
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={step.parent}", "mpo.max_num_steps=2",
                "scheduler.lr_warmup_steps=1", "mpo.val_at_end=false")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: CheckpointError: {rng}: ") and "weights_only" not in last, last
    assert f"{step}.damaged" in last, last


def test_run_state_that_a_resume_cannot_use_is_one_line(tmp_path):
    """QA: a run_state.json without "sampler" (KeyError traceback after the models loaded), holding a list
    (AttributeError) or a NaN reward shift (accepted, the loss then NaN and blamed on the LR): one CheckpointError
    naming the file and each bad key."""
    good = _state(4, {})
    file = tmp_path / checkpoint.RUN_STATE_FILE

    def read(state):
        file.write_text(json.dumps(state))
        return checkpoint.read_run_state(tmp_path)

    assert read(good) == checkpoint.RunState(path=tmp_path, **good)
    assert read(dict(good, reward_shift=1)).reward_shift == 1  # JSON writes 1.0 as 1 only if asked: fine
    for state, names in (
        ([], ["list"]),
        ({k: v for k, v in good.items() if k != "sampler"}, ["'sampler'"]),
        (dict(good, reward_shift=float("nan"), step=-1), ["'step'", "'reward_shift'"]),
        (dict(good, step="4", sampler=[]), ["'step'", "'sampler'"]),
        (dict(good, consumed_pairs=True), ["'consumed_pairs'"]),
    ):
        with raises_naming(checkpoint.CheckpointError, f"{file} ", *names):
            read(state)
    file.write_text("{")
    with raises_naming(checkpoint.CheckpointError, file, "JSONDecodeError"):
        checkpoint.read_run_state(tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# Checksums, a non-finite first step after a resume, full disks


def _rewrite_tensors(step: Path, match, change) -> int:
    """Apply `change` (float32 array -> float32 array) in place to the data of every saved tensor whose key `match`
    accepts (torch.distributed.checkpoint stores each as a torch.save zip inside a .distcp file); files keep their
    sizes. Returns how many."""
    import io
    import struct
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    shards = step / checkpoint.MODEL_OPTIM_DIR
    storage = FileSystemReader(str(shards)).read_metadata().storage_data
    found = [info for index, info in storage.items() if match(index.fqn)]
    for info in found:
        shard = shards / info.relative_path
        data = bytearray(shard.read_bytes())
        region = bytes(data[info.offset : info.offset + info.length])
        entry = next(z for z in zipfile.ZipFile(io.BytesIO(region)).infolist() if z.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack("<HH", region[entry.header_offset + 26 : entry.header_offset + 30])
        start = info.offset + entry.header_offset + 30 + name_len + extra_len
        old = np.frombuffer(bytes(data[start : start + entry.file_size]), dtype=np.float32)
        data[start : start + entry.file_size] = change(old).tobytes()
        shard.write_bytes(bytes(data))
    return len(found)


def _embedding(fqn: str) -> bool:
    return fqn == "language_model.embedding.word_embeddings.weight"


def _without_checksums(step: Path) -> None:
    """Make `step` look like a checkpoint saved before checksums were written."""
    state = json.loads((step / checkpoint.RUN_STATE_FILE).read_text())
    del state["checksums"]
    (step / checkpoint.RUN_STATE_FILE).write_text(json.dumps(state))


def test_changed_file_is_refused_naming_it_and_the_previous_checkpoint(one_step, tmp_path, monkeypatch, capsys):
    """A flipped bit in a shard (same size) or a tensor scaled in place resumed silently. Every file of
    a save is hashed into run_state.json and checked before the load; the error names the file and the previous
    complete checkpoint. Checkpoints without checksums (saved before them) still resume, with one notice."""
    saved = json.loads((one_step / checkpoint.RUN_STATE_FILE).read_text())["checksums"]
    assert saved["algorithm"] == checkpoint.CHECKSUM_ALGORITHM
    assert sorted(saved["files"]) == ["model_optim/.metadata", "model_optim/__0_0.distcp",
                                      "model_optim/metadata.json", "rng/rank_00000.pt"]  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(one_step, run / "step_0")  # the previous complete checkpoint
    step = run / "step_1"

    def refused(name: str) -> None:  # names the step, the file, the way out and the previous checkpoint
        with raises_naming(checkpoint.CheckpointError, f"step_1 ({step})", f"{name} ", f"{step}.damaged",
                           f"previous checkpoint, {run / 'step_0'}") as e:  # fmt: skip
            _check_complete(step, 1)
        assert "checksum" in str(e.value)  # which check found it: the checksum, not a missing or short file

    shutil.copytree(one_step, step)
    shard = step / "model_optim" / "__0_0.distcp"
    size = shard.stat().st_size
    assert _rewrite_tensors(step, _embedding, lambda w: w.view(np.uint32) ^ np.uint32(1 << 3)) == 1  # a mantissa bit
    assert shard.stat().st_size == size
    refused("model_optim/__0_0.distcp")
    shutil.rmtree(step)
    shutil.copytree(one_step, step)
    assert _rewrite_tensors(step, _embedding, lambda w: w * np.float32(1.01)) == 1  # scaled in place
    refused("model_optim/__0_0.distcp")
    shutil.rmtree(step)
    shutil.copytree(one_step, step)
    rng = step / "rng" / "rank_00000.pt"
    rng.write_bytes(rng.read_bytes()[:-1] + b"!")
    refused("rng/rank_00000.pt")
    _check_complete(step, None)  # an RNG file is read (and verified) only at the saved world size
    capsys.readouterr()
    _without_checksums(step)  # saved before checksums: resumes, one notice
    _check_complete(step, 1)
    err = capsys.readouterr().err
    assert err.startswith(f"checkpoint: {step} ") and err.count("\n") == 1 and "checksums" in err, err  # one notice
    _check_complete(one_step, 1)  # intact
    assert capsys.readouterr().err == ""
    # zlib's crc32 where xxhash does not import; an xxh3_64 manifest there is not verified (one notice)
    monkeypatch.setattr(checkpoint, "xxhash", None)
    _check_complete(one_step, 1)
    if checkpoint.CHECKSUM_ALGORITHM == "xxh3_64":
        assert "xxh3_64" in capsys.readouterr().err
    crc = {n: checkpoint.file_checksum(one_step / n, "crc32") for n in saved["files"]}
    assert all(len(v) == 8 for v in crc.values())
    state = json.loads((step / checkpoint.RUN_STATE_FILE).read_text())
    state["checksums"] = {"algorithm": "crc32", "files": crc}  # of the intact files: step's RNG file differs
    (step / checkpoint.RUN_STATE_FILE).write_text(json.dumps(state))
    refused("rng/rank_00000.pt")


def test_changed_file_is_refused_on_every_rank(dist_result):
    """Checksums at 2 ranks: each rank hashes its own files at the save and verifies every other file at the load;
    a bit flipped in rank 1's shard is the same error on both ranks, naming the file and the previous checkpoint."""
    r = dist_result["damaged"]
    assert {"model_optim/.metadata", "model_optim/metadata.json", "model_optim/__0_0.distcp",
            "model_optim/__1_0.distcp", "rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(r["checksum_files"])
    error = r["flipped_errors"][0]
    assert r["flipped_errors"][1] == error and "checksum" in error, error
    assert all(n in error for n in (f"step_2 ({r['flipped_path']})", "model_optim/__1_0.distcp ",
                                    f"{r['flipped_path']}.damaged", f"checkpoint, {r['flipped_previous']}")), error


def test_metrics_log_on_a_full_disk_is_one_line_on_every_rank(dist_result, tmp_path, monkeypatch):
    """A full disk while appending to metrics.jsonl was a raw OSError on rank 0 and a gloo traceback on
    rank 1. It is one MetricsError on every rank naming the file and the free space (train.py prints it as one line)."""
    r = dist_result["damaged"]
    assert r["metrics_errors"][0] == r["metrics_errors"][1]
    names = ("step 1 ", f"{r['metrics_path']}: ", "OSError: [Errno 28] No space left on device (")
    assert all(n in r["metrics_errors"][0] for n in names), r["metrics_errors"]
    import config as config_mod
    import monitor

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    log = monitor.MetricsLog(config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", "logging.wandb=disabled"]),
                             None, 0, 0)  # fmt: skip
    monkeypatch.setattr(monitor, "open", full, raising=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=512))
    with raises_naming(monitor.MetricsError, "step 4 ", f"{tmp_path / 'metrics.jsonl'}: ",
                       f"OSError: [Errno 28] No space left on device (512 bytes free on {tmp_path}"):  # fmt: skip
        log.log(4, {"loss": 0.5})


def test_save_failing_in_torchs_zip_writer_is_a_full_disk_in_one_line(tmp_path, monkeypatch, capsys):
    """A full disk during a save printed interleaved tracebacks and ended in torch's `RuntimeError:
    [enforce fail at inline_container.cc:672] . unexpected pos ...` (torch.save's zip writer keeps no errno). With
    the file system full it is the ENOSPC OSError the README promises; otherwise a failed write, still one line."""
    torch_text = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"  # torch 2.14, /dev/full

    def zip_writer_fails(model, optimizer, is_loading):
        raise RuntimeError(torch_text)

    from megatron.core import dist_checkpointing  # noqa: F401 - its first import logs torch's CUDA_HOME line

    capsys.readouterr()
    monkeypatch.setattr(checkpoint, "_sharded_state_dict", zip_writer_fails)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 30, used=1 << 30, free=0))
    with raises_naming(checkpoint.CheckpointError, f"{tmp_path / 'step_7.tmp'} ",
                       f"OSError: [Errno 28] No space left on device (0 bytes free on {tmp_path}"):  # fmt: skip
        checkpoint.save(tmp_path, 7, torch.nn.Linear(2, 2), None, None, {"reward_shift": 0.0})
    assert capsys.readouterr().err == "" and not (tmp_path / "step_7.tmp").exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=0, free=1 << 40))
    with raises_naming(checkpoint.CheckpointError, f"{tmp_path / 'step_7.tmp'} ", "OSError", torch_text,
                       f"({1 << 40} bytes free on"):  # fmt: skip
        checkpoint.save(tmp_path, 7, torch.nn.Linear(2, 2), None, None, {"reward_shift": 0.0})
    assert capsys.readouterr().err == ""


EXPORT_ON_A_FULL_DISK = """
import errno, os, sys
sys.path.insert(0, os.getcwd())
import hf_export, hf_weights
from safetensors import SafetensorError
run, out = sys.argv[1:3]
assert hf_export.main([run, out]) == 0
real = hf_weights.save_file

def full(tensors, path, metadata=None):  # what safetensors raises when the disk fills mid-write
    open(path, "wb").write(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

hf_weights.save_file = full
sys.exit(hf_export.main([run, out]))
"""


def test_export_on_a_full_disk_is_one_line_and_keeps_the_earlier_export(one_step, tmp_path):
    """A full disk during `python hf_export.py RUN OUT` was a raw SafetensorError with OUT left
    "complete": false. The export is written to OUT.tmp and renamed when complete: a failure is one line naming the
    free space, OUT.tmp is removed and the earlier export in OUT stays whole."""
    out = tmp_path / "hf"
    proc = _cli("-c", EXPORT_ON_A_FULL_DISK, str(one_step), str(out))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(n in last for n in (
        f"{one_step} ", f"{out} ", "OSError: [Errno 28] No space left on device (", f"bytes free on {tmp_path}",
        "hf.tmp")), last  # fmt: skip
    assert json.loads((out / checkpoint.EXPORT_INFO_FILE).read_text())["complete"] is True
    assert (out / "model.safetensors").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


EXPORT_WHILE_PRUNED = """
import os, shutil, sys
sys.path.insert(0, os.getcwd())
import hf_export
from megatron.core import dist_checkpointing
step, out = sys.argv[1:3]
real = dist_checkpointing.load

def pruned(sharded, path, *args, **kwargs):  # a running job's checkpoint.keep_last removes the step meanwhile
    shutil.rmtree(step)
    return real(sharded, path, *args, **kwargs)

dist_checkpointing.load = pruned
sys.exit(hf_export.main([step, out]))
"""


def test_export_of_a_step_pruned_meanwhile_or_under_torchrun_is_one_line(one_step, tmp_path):
    """Break-it pass: a step pruned by the running job while exported ended in megatron's CheckpointingException with
    OUT.tmp left behind; `torchrun --nproc-per-node 2 hf_export.py` let both processes rename OUT (an export
    without weights, or none). Both are one line now, and nothing is left."""
    step = tmp_path / "run" / "step_1"
    shutil.copytree(one_step, step)
    out = tmp_path / "hf"
    proc = _cli("-c", EXPORT_WHILE_PRUNED, str(step), str(out))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {step} ") and "keep_last" in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    proc = subprocess.run([sys.executable, "hf_export.py", str(one_step), str(out)], cwd=ROOT,
                          env=dict(os.environ, WORLD_SIZE="2", RANK="0"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "python hf_export.py" in last and "2 (torchrun)" in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_non_finite_first_step_after_a_resume_names_the_checkpoint_not_the_lr(one_step, tmp_path):
    """Random bytes in a shard (of a checkpoint without checksums, which resumes with a notice) gave
    `DivergedError: step N: ... start a new run with a lower optimizer.lr`. At the first step after a resume the
    line names the checkpoint and offers the previous one."""
    run = tmp_path / "run"
    shutil.copytree(one_step, run / "step_0")
    step = run / "step_1"
    shutil.copytree(one_step, step)
    _without_checksums(step)
    # NaN weights: the model's and the distributed optimizer's fp32 copies (a resume loads the weights from the latter)
    assert _rewrite_tensors(step, lambda k: k.endswith((".weight", ".param")),
                            lambda w: np.full_like(w, np.nan)) > 2  # fmt: skip
    proc = _cli("train.py", "configs/tiny.toml", f"checkpoint.dir={run}", "mpo.max_num_steps=2",
                "scheduler.lr_warmup_steps=1", "mpo.val_at_end=false")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint: {step} holds no checksums" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: DivergedError: step 2: ") and "optimizer.lr" not in last, last
    assert all(n in last for n in (f"resuming from {step}", f"{step}.damaged", f"checkpoint, {run / 'step_0'}")), last


ORPHAN = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, distributed
stopper = distributed.StopSignal()
print("ready", os.getpid(), flush=True)
deadline = time.time() + 60
while time.time() < deadline and not stopper.should_stop(torch.device("cpu")):  # one "step" each
    time.sleep(0.05)
print("stopped by signal", stopper.received, flush=True)
"""

LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout, stderr=sys.stderr)
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR1])
def test_rank_whose_launcher_died_stops_after_its_step(tmp_path, sig):
    """After `kill -9` of torchrun the ranks (in sessions of their own) trained on; after
    `kill -USR1` of torchrun (which dies of it) they trained up to 5 s more (a polling thread). A stand-in launcher
    starts a stand-in rank (LOCAL_RANK set, StopSignal installed) and is killed; the rank stops after its next step."""
    out, err = tmp_path / "out", tmp_path / "err"
    env = dict(os.environ, LOCAL_RANK="0", RANK="3")
    env.pop("TORCHELASTIC_RUN_ID", None)
    with open(out, "w") as fo, open(err, "w") as fe:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, ORPHAN, str(ROOT)], env=env, stdout=fo,
                                    stderr=fe)  # fmt: skip
    deadline = time.time() + 60
    while time.time() < deadline and not out.read_text().startswith("ready"):
        time.sleep(0.1)
    rank_pid = int(out.read_text().split()[1])
    launcher.send_signal(sig)
    launcher.wait()
    killed, deadline = time.time(), time.time() + 60
    while time.time() < deadline and "stopped" not in out.read_text():
        time.sleep(0.05)
    assert time.time() - killed < 3.0  # the next step's check, not a poll every few seconds
    assert out.read_text().splitlines() == [f"ready {rank_pid}", f"stopped by signal {int(signal.SIGTERM)}"]
    notices = [x for x in err.read_text().splitlines() if "launcher" in x]  # (import-time warnings aside)
    assert len(notices) == 1 and notices[0].startswith(f"rank 3: the launcher (pid {launcher.pid}) "), notices


def test_launcher_check_only_under_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    import distributed

    previous = {sig: signal.getsignal(sig) for sig in distributed.StopSignal.SIGNALS}
    try:
        assert distributed.StopSignal().launcher is None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_optimizer_state_loads_only_into_its_parameter_digest(tmp_path):
    """The distributed optimizer's dp_reshardable state is stored in parameter order: a step saved with megatron's
    SequentialMLP loaded into GroupedExperts' 3-D weights without a complaint, every expert's Adam moments in the
    wrong places (measured). `load` now refuses a checkpoint whose `parameter_digest` differs, or that has none (saved
    before it was written, with per-expert weights) for a model with GroupedExperts, naming the digest; the same
    digest loads and every moment is restored exactly, as does a checkpoint without a digest into per-expert weights."""
    import functools

    import omni_model as om
    from backend import kernel_selection

    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    def system(experts):
        k = kernel_selection.Kernels("local", "torch", "cpu", attention="sdpa", experts=experts)
        build = om.build_model
        om.build_model = functools.partial(build, kernels=k)
        try:
            return tiny_step("cpu")
        finally:
            om.build_model = build

    def moments(s) -> list[torch.Tensor]:
        (opt,) = checkpoint._inner_optimizers(s["optimizer"])
        return [st["exp_avg"].clone() for st in opt.optimizer.state.values()]

    a = system("sequential")
    a["run"](a["batches"], 0.0)
    path = checkpoint.save(tmp_path, 1, a["ddp"], a["optimizer"], a["scheduler"], _state(1, {}))
    saved = checkpoint.read_run_state(path).parameter_digest
    assert saved == checkpoint.parameter_digest(a["ddp"]) == checkpoint.parameter_digest(a["policy"])
    b = system("grouped-loop")
    here = checkpoint.parameter_digest(b["policy"])
    assert here != saved
    with raises_naming(checkpoint.CheckpointError, path, saved, here, f"hf_export.py {path.parent} OUT"):
        checkpoint.load(path, b["ddp"], b["optimizer"], b["scheduler"])
    checkpoint.load(path, b["policy"])  # the model part alone: SequentialMLP's keys load into the 3-D weights
    for name, w in b["policy"].named_parameters():
        if name.endswith(".experts.weight1"):
            mlp = dict(a["policy"].named_modules())[name.removesuffix(".weight1")]
            assert torch.equal(w, torch.stack([e.linear_fc1.weight for e in mlp.local_experts]))
    c = system("sequential")
    checkpoint.load(path, c["ddp"], c["optimizer"], c["scheduler"])
    want, got = moments(a), moments(c)
    assert len(want) == len(got) > 0 and all(torch.equal(x, y) for x, y in zip(want, got, strict=True))
    raw = json.loads((path / checkpoint.RUN_STATE_FILE).read_text())
    del raw["parameter_digest"]  # as saved before the digest existed: SequentialMLP's parameters, which c has
    (path / checkpoint.RUN_STATE_FILE).write_text(json.dumps(raw))
    checkpoint.load(path, c["ddp"], c["optimizer"], c["scheduler"])
    assert all(torch.equal(x, y) for x, y in zip(want, moments(c), strict=True))
    with raises_naming(checkpoint.CheckpointError, path, f"hf_export.py {path.parent} OUT"):
        checkpoint.load(path, b["ddp"], b["optimizer"], b["scheduler"])  # into GroupedExperts: refused


def test_optimizer_state_loads_across_gradient_buffer_dtypes(tmp_path):
    """megatron names the distributed optimizer's saved buckets by (param dtype, grad dtype): a bf16 checkpoint of fp32
    gradient buffers failed to load with bf16 ones (KeyError ...dtype_(torch.bfloat16, torch.bfloat16)...), though
    the state (fp32 master weights, Adam moments) is the same. `load` names the keys as saved: a step saved with
    either optimizer.grad_reduce_in_fp32 loads with the other, every weight and optimizer tensor bit for bit."""
    sys.path.insert(0, str(ROOT / "tests"))
    from step_cases import tiny_step

    def state(s) -> list[tuple[str, torch.Tensor]]:
        (opt,) = checkpoint._inner_optimizers(s["optimizer"])
        moments = [(f"{i}.{k}", v.clone()) for i, st in enumerate(opt.optimizer.state.values())
                   for k, v in sorted(st.items())]  # fmt: skip
        return moments + [(n, p.detach().clone()) for n, p in s["policy"].named_parameters()]

    def equal(a, b) -> bool:
        same = [k for k, _ in a] == [k for k, _ in b]
        return same and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))

    fp32 = tiny_step("cpu", "model.params_dtype=bfloat16")
    bf16 = tiny_step("cpu", "model.params_dtype=bfloat16", "optimizer.grad_reduce_in_fp32=false")
    assert [b.grad_dtype for b in fp32["ddp"].buffers] == [torch.float32]
    assert [b.grad_dtype for b in bf16["ddp"].buffers] == [torch.bfloat16]
    for step, (src, dst) in enumerate([(fp32, bf16), (bf16, fp32)], start=1):
        src["run"](src["batches"], 0.0)
        config = {"optimizer": {"grad_reduce_in_fp32": src is fp32}}
        path = checkpoint.save(tmp_path, step, src["ddp"], src["optimizer"], src["scheduler"], _state(step, config))
        want = state(src)
        assert not equal(want, state(dst))  # before the load
        checkpoint.load(path, dst["ddp"], dst["optimizer"], dst["scheduler"])
        assert sum(k.endswith("exp_avg_sq") for k, _ in want) > 10 and equal(state(dst), want)


def test_run_state_written_before_the_digest_rename_still_resumes(tmp_path):
    """An older run_state.json holds the trainable parameters' digest under the key's earlier name: it is still read,
    so `load` checks the digest as before; the new key is read too."""
    file = tmp_path / checkpoint.RUN_STATE_FILE
    file.write_text(json.dumps(dict(_state(4, {}), parameter_layout="abc")))  # the key's earlier name
    assert checkpoint.read_run_state(tmp_path).parameter_digest == "abc"
    file.write_text(json.dumps(dict(_state(4, {}), parameter_digest="def")))
    assert checkpoint.read_run_state(tmp_path).parameter_digest == "def"
