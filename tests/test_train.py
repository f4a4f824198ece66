"""Tests of train.py: the README command end to end (2 gloo ranks), step-1 values, the δ update, learning, exact
resume across a segment stop, a killed save, SIGUSR1, TP = 2 / DP = 2 = TP = 1 / DP = 1, and the HF export.

Launches are shared between tests (module fixtures, through the torchrun fixture of tests/conftest.py); each costs
~10 s of start-up on 2 cores:
    readme   torchrun -n 2 train.py configs/tiny.toml (+ checkpoint.save_period=4)       6 steps, DP = 2
             (separate sequences: tiny.toml's packing.shared_prompt = false)
    shared   the README command with packing.shared_prompt=auto (the shared-prompt format on the CPU)
    bias_off both formats with model.moe_router_bias_update_rate=0: the same training, step for step
    seg      the same config: stop_after_step=2, then (after a fake killed save) stop_after_step=4
    precomp  the README command with reference.logprobs=precomputed: stop_after_step=2 (the reference pass, 2 steps),
             then the rest (no pass, no reference model); every number equals the README run's (and the tp2 run's
             config with it: the pass on TP = 2, the same numbers as tp2)
    learn    DP = 2, lr 1e-3, 20 steps (loss goes down); its first steps are the DP = 2 reference
    tp2      TP = 2 (+ sequence parallel), the learn config, 3 steps
    tp1      `python train.py` (a world of one), the learn config, stopped by SIGUSR1 after step 3 is logged
    padding  2 steps on 1 rank at padding multiples 8 and 64, and on DP = 2 (states compared, expert bias included)
    frozen   1 rank, lr 0 and bias update rate 0, 7 steps of 4 on 27 pairs (an epoch boundary inside step 7)
The readme and shared runs are also golden traces: every metric of every step against recorded numbers (1e-6).
Unit tests (schedule, metric reduction, metrics.jsonl truncation, W&B mode and failure, the data-changed resume line)
run in-process; a failed wandb.init on 2 ranks (tests/dist/check_wandb_failure.py) and a finished run's "nothing to
do" (`python train.py`, no model built) are short launches of their own, as are the stops with DataLoader workers
(SIGTERM / a closed terminal's SIGHUP to torchrun, mid-run and before step 1) and a rank killed mid-run.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HUB_ID, HUB_REVISION, make_hub_cache, raises_naming

import checkpoint
import config as config_mod
import distributed
import model_hub
import monitor
import mpo_loss
import pack
import preflight
import train

ROOT = Path(__file__).resolve().parents[1]
LEARN = ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "mpo.max_num_steps=20", "mpo.val_at_end=false"]


# ----------------------------------------------------------------------------------------------------------------------
# Unit tests


class _Opt:
    def __init__(self):
        self.param_groups = [{"params": [], "default_config": True}, {"params": [], "wd_mult": 0.0}]


def test_schedule_warmup_then_cosine_to_min_lr_at_max_num_steps():
    cfg = config_mod.load_config(None, ["optimizer.lr=1e-3", "optimizer.min_lr=1e-5", "scheduler.lr_warmup_steps=4",
                                        "scheduler.lr_warmup_init=1e-4", "mpo.max_num_steps=20",
                                        "mpo.stop_after_step=7", "optimizer.weight_decay=0.1"])  # fmt: skip
    opt = _Opt()
    sched = train.build_scheduler(opt, cfg)
    got = []
    for _ in range(23):
        got.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    for n, lr in enumerate(got):  # lr of schedule step n; used by optimizer step n + 1
        if n <= 4:
            want = 1e-4 + (1e-3 - 1e-4) * n / 4
        elif n <= 20:  # horizon = max_num_steps (20), not stop_after_step (7)
            want = 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * (n - 4) / 16))
        else:
            want = 1e-5
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-18), n
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    with raises_naming(config_mod.ConfigError, "scheduler.lr_warmup_steps = 20", "< mpo.max_num_steps = 20"):
        config_mod.load_config(None, ["scheduler.lr_warmup_steps=20", "mpo.max_num_steps=20"])  # before any work


def test_reduce_metrics_without_group_keeps_values(monkeypatch):
    """No group (or a group of one): the values as given. A group of two ranks: "mean" and "count" metrics are summed
    (each rank's value is already divided by the global pair count), "constant" ones (δ) kept, in one all-reduce."""
    import torch.distributed as dist

    import mpo_loss

    m = {"loss": 0.5, "num_valid_pairs": 3.0, "reward_shift_used": 0.25}
    assert mpo_loss.reduce_metrics(m, None, torch.device("cpu")) == m
    other_rank = {"loss": 0.125, "num_valid_pairs": 1.0, "reward_shift_used": 0.25}
    calls = []

    def all_reduce(t, group=None):  # the other rank's sum, in the key order reduce_metrics sent
        calls.append((t.dtype, group))
        t += torch.tensor([other_rank[k] for k in sorted(k for k in m if k != "reward_shift_used")], dtype=t.dtype)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: {"one": 1, "two": 2}[group])
    assert mpo_loss.reduce_metrics(m, "one", torch.device("cpu")) == m and calls == []
    got = mpo_loss.reduce_metrics(m, "two", torch.device("cpu"))
    assert got == {"loss": 0.625, "num_valid_pairs": 4, "reward_shift_used": 0.25}
    assert type(got["num_valid_pairs"]) is int  # a count, like num_global_pairs (it was 4.0)
    assert calls == [(torch.float64, "two")]
    assert m == {"loss": 0.5, "num_valid_pairs": 3.0, "reward_shift_used": 0.25}  # the input is not modified


def test_metrics_log_drops_lines_after_the_resumed_step(tmp_path):
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 2, "split": "validation"}, {"step": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = monitor.MetricsLog(cfg, None, resumed_step=2, rank=0)
    log.log(3, {"loss": 0.5})
    got = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == rows[:3] + [{"step": 3, "split": "train", "loss": 0.5}]
    assert list(got[-1])[0] == "step"


# ----------------------------------------------------------------------------------------------------------------------
# Launches


# The _FakeIndex tests size pairs by their (chosen, rejected) sequences: the separate-sequences format (no prompt
# lengths)
SEPARATE = "packing.shared_prompt=false"


class _FakeIndex:
    """The part of mmpr_data.MMPRIndex that preflight.check_splits reads."""

    def __init__(self, lengths, annotation_files=("a.jsonl",)):
        self._lengths, self.annotation_files = lengths, list(annotation_files)

    def __len__(self):
        return len(self._lengths)

    def lengths(self, ids):
        return {i: self._lengths[i] for i in ids}

    def source(self, i):
        return f"a.jsonl:{i + 1}"


def test_check_inputs_names_the_key_before_any_distributed_work(tmp_path):
    import torch.distributed as dist

    was_initialized = dist.is_initialized()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"model.hf_path={tmp_path}"])
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{tmp_path}'", "config.json"):
        preflight.check_inputs(cfg)
    (tmp_path / "config.json").write_text("[]")
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{tmp_path}': {tmp_path / 'config.json'} ",
                       "model_type"):  # fmt: skip
        preflight.check_inputs(cfg)
    # QA: a run directory (its config.json is the resolved config) ended in a TypeError deep in read_hf_config
    (tmp_path / "config.json").write_text(json.dumps(config_mod.to_dict(cfg)))
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{tmp_path}'",
                       f"(python hf_export.py {tmp_path} OUT)", "model.hf_path=OUT"):  # fmt: skip
        preflight.check_inputs(cfg)
    (tmp_path / "config.json").write_text('{"model_type": "x"}')  # another architecture
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{tmp_path}': ", "model_type 'x'"):
        preflight.check_inputs(cfg)
    shutil.copy(ROOT / "assets" / "tiny-omni" / "config.json", tmp_path)  # QA: no weights: hf_weights' error
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{tmp_path}': ", "model.safetensors.index.json",
                       "*.safetensors"):  # fmt: skip
        preflight.check_inputs(cfg)
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"data.train.data_path={tmp_path}/meta.json"])
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    with raises_naming(config_mod.ConfigError, f"data.train.data_path = '{tmp_path}/meta.json'", "not a file"):
        preflight.check_inputs(cfg)
    cfg.data.train.data_path = " "
    with raises_naming(config_mod.ConfigError, "data.train.data_path ") as e:  # an empty path
        preflight.check_inputs(cfg)
    assert "meta-recipe ." not in str(e.value)  # not "cannot read the meta-recipe ."
    cfg.data.train.data_path = str(ROOT / "data/mmpr_sample/MMPR-sample/meta.json")
    cfg.parallel.context_parallel_size, cfg.packing.make_sequence_length_divisible_by = 2, 2
    with raises_naming(config_mod.ConfigError, "packing.make_sequence_length_divisible_by = 2", "multiple of 4"):
        preflight.check_inputs(cfg)
    cfg.packing.make_sequence_length_divisible_by = 8
    preflight.check_inputs(cfg)  # all good: no exception
    assert dist.is_initialized() == was_initialized  # nothing distributed was started


@pytest.mark.parametrize("overrides, names", [
    (["parallel.tensor_model_parallel_size=2"],  # megatron-core's MoELayer.forward refuses it at the first step
     ["parallel.tensor_model_parallel_size = 2", "parallel.sequence_parallel = true"]),
    (["parallel.tensor_model_parallel_size=4", "parallel.sequence_parallel=true"],  # the ViT's 2 heads
     ["vision encoder", "num_attention_heads (2)", "tensor_model_parallel_size (4)",
      "parallel.tensor_model_parallel_size = 4", "assets/tiny-omni/config.json"]),
    (["parallel.tensor_model_parallel_size=8", "parallel.sequence_parallel=true"],  # the language model's 4 heads
     ["language model", "num_attention_heads (4)", "tensor_model_parallel_size (8)"]),
    (["parallel.expert_tensor_parallel_size=2"], ["parallel.expert_tensor_parallel_size = 2"]),
    (["model.freeze_vision_encoder=true", "model.freeze_vision_projector=true", "model.freeze_language_model=true",
      "model.freeze_sound_encoder=true", "model.freeze_sound_projector=true"],
     ["model.freeze_vision_encoder", "model.freeze_vision_projector", "model.freeze_language_model",
      "model.freeze_sound_encoder", "model.freeze_sound_projector"]),
])
def test_megatron_constraints_are_config_errors_before_any_work(overrides, names):
    """megatron-core's own checks (its TransformerConfig __post_init__, and the rules it applies at build
    or at the first forward) fail in check_model_config, before any process group, data or model, naming our keys."""
    import torch.distributed as dist

    import omni_model

    was_initialized = dist.is_initialized()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", overrides)
    hf = omni_model.read_hf_config(ROOT / cfg.model.hf_path)
    with raises_naming(config_mod.ConfigError, *names) as e:
        preflight.check_model_config(cfg, hf)
    assert "\n" not in str(e.value)
    for fine in ([], ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
                 ["model.freeze_vision_encoder=true", "model.freeze_language_model=true"]):
        preflight.check_model_config(config_mod.load_config(ROOT / "configs" / "tiny.toml", fine), hf)  # no exception
    assert dist.is_initialized() == was_initialized


def test_seq_aux_loss_is_refused_with_the_reason():
    """megatron-core's seq_aux_loss treats a batch row as one sequence; a packed row holds several."""
    with raises_naming(config_mod.ConfigError, "model.moe_router_load_balancing_type = 'seq_aux_loss'"):
        config_mod.load_config(ROOT / "configs" / "tiny.toml", ["model.moe_router_load_balancing_type=seq_aux_loss"])


def test_allgather_dispatcher_is_refused_with_expert_parallelism():
    """The all-gather dispatcher gathers equal token counts over TP x EP; EP ranks hold different packed bins."""
    with raises_naming(config_mod.ConfigError, "model.moe_token_dispatcher_type = 'allgather'",
                       "parallel.expert_model_parallel_size = 1", "'alltoall'"):
        config_mod.load_config(ROOT / "configs" / "tiny.toml", ["model.moe_token_dispatcher_type=allgather",
                                                                "parallel.expert_model_parallel_size=2"])
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["model.moe_token_dispatcher_type=allgather",
                                                                   "parallel.tensor_model_parallel_size=2"])
    assert cfg.model.moe_token_dispatcher_type == "allgather"


def test_check_splits_refuses_repeats_and_late_oversized_pairs_and_drops_an_empty_validation_split():
    from mmpr_index import Split

    index = _FakeIndex({0: (100, 90), 1: (30, 30), 2: (200, 190), 3: (40, 41), 4: (10, 10)})
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["policy.train_global_batch_size=4", SEPARATE])
    train_split, val_split = Split(index, [0, 1, 2]), Split(index, [3])
    with raises_naming(config_mod.ConfigError, "policy.train_global_batch_size = 4", "only 3 training pairs"):
        preflight.check_splits(train_split, val_split, cfg)
    cfg.policy.train_global_batch_size = 2
    cfg.packing.max_tokens_per_bin = 256  # pair 2 pads to 200 + 192 = 392 tokens
    with raises_naming(config_mod.ConfigError, "1 of 3 training pairs", "packing.max_tokens_per_bin = 256",
                       "a.jsonl:3, 392 tokens", "packing.drop_oversized_pairs"):
        preflight.check_splits(train_split, val_split, cfg)
    cfg.packing.drop_oversized_pairs = True
    train, val, notes = preflight.check_splits(train_split, val_split, cfg)
    assert (train.pair_ids, train.dropped_oversized, train.index) == ([0, 1], 1, index) and val is val_split
    assert notes == [
        "training: 1 of 3 pairs exceed packing.max_tokens_per_bin = 256 and are dropped at start (largest: a.jsonl:3, "
        "392 tokens) (metrics: dropped_oversized)"
    ]
    assert train_split.pair_ids == [0, 1, 2]  # the input split is not changed
    train, val, notes = preflight.check_splits(Split(index, [0, 1, 4]), Split(index, []), cfg)  # e.g. 0.01 of 64 pairs
    assert val is None and notes == ["validation: data.train.split_validation_size = 4.0 of 5 pairs is 0 pairs: "
                                     "no validation"]  # fmt: skip
    assert (train.pair_ids, train.dropped_oversized) == ([0, 1, 4], 0)


def test_check_splits_notes_a_validation_meta_that_reads_training_files():
    """data.validation.data_path = the training meta-recipe gave 'data: 34 train pairs, 34 validation pairs' without
    a word that they are the same pairs."""
    from mmpr_index import Split

    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["policy.train_global_batch_size=2", SEPARATE])
    train = Split(_FakeIndex({0: (10, 10), 1: (10, 10)}, ["/d/a.jsonl", "/d/b.jsonl"]), [0, 1])
    for files, want in ((["/d/b.jsonl", "/d/c.jsonl"], ["validation: data.validation.data_path shares 1 annotation "
                                                        "file(s) with the training data (e.g. /d/b.jsonl): those "
                                                        "validation pairs are training pairs"]),
                        (["/e/a.jsonl"], [])):  # fmt: skip
        _, _, notes = preflight.check_splits(train, Split(_FakeIndex({0: (10, 10)}, files), [0]), cfg)
        assert notes == want, files
    cfg.mpo.val_period = 2  # QA: ignored without a word when there is no validation data
    assert preflight.check_splits(train, None, cfg)[2] == [
        "validation: mpo.val_period = 2 is ignored: there is no validation data (set data.validation.data_path or "
        "data.train.split_validation_size)"]
    assert preflight.check_splits(train, Split(_FakeIndex({0: (10, 10)}, ["/e/a.jsonl"]), [0]), cfg)[2] == []


def test_check_splits_notes_a_validation_split_larger_than_its_size_for_repeated_records():
    """repeat_time 30 and data.train.split_validation_size = 4: 30 validation pairs (a repeated record stays in one
    split), said in a note naming the key and both counts."""
    from mmpr_index import Split

    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["policy.train_global_batch_size=2", SEPARATE,
                                                                  "data.train.split_validation_size=2"])
    index = _FakeIndex({i: (10, 10) for i in range(6)})
    _, _, notes = preflight.check_splits(Split(index, [0, 1]), Split(index, [2, 3, 4, 5]), cfg)
    assert any("data.train.split_validation_size = 2" in n and "4 validation pairs" in n for n in notes), notes
    _, _, notes = preflight.check_splits(Split(index, [0, 1, 2, 3]), Split(index, [4, 5]), cfg)
    assert notes == []


def test_validation_max_samples_without_a_validation_meta_is_a_notice():
    """QA: data.validation.max_samples = 2 without data.validation.data_path left the 4 pairs of
    data.train.split_validation_size, without a word."""
    import mmpr_index
    import mmpr_records

    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["data.validation.max_samples=2"])
    cfg.data.train.data_path = str(ROOT / cfg.data.train.data_path)
    processor = mmpr_index.load_processor(ROOT / cfg.model.hf_path, "model.hf_path")
    with mmpr_records.data_warnings([]) as notes:
        train, val = mmpr_index.load_splits(processor, cfg.data)
    assert [str(n) for n in notes] == [
        "data.validation.max_samples = 2 is ignored without data.validation.data_path (a validation split of the "
        "training data has data.train.split_validation_size pairs)"]
    assert len(val.pair_ids) == 4 and len(train.pair_ids) == len(train.index) - 4


def test_check_splits_drops_oversized_pairs_up_front_so_no_step_or_validation_batch_is_empty():
    """With packing.drop_oversized_pairs, pairs larger than a bin leave both splits at start (counted,
    reported), so a step or validation batch can no longer hold only oversized pairs; the batch check counts the
    pairs left."""
    from mmpr_index import Split

    index = _FakeIndex({0: (100, 90), 1: (30, 30), 2: (200, 190), 3: (300, 41), 4: (10, 10), 5: (250, 250)})
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [
        "policy.train_global_batch_size=2", "packing.max_tokens_per_bin=256", "packing.drop_oversized_pairs=true",
        SEPARATE])
    train, val, notes = preflight.check_splits(Split(index, [0, 1, 2, 5]), Split(index, [3, 4]), cfg)
    assert (train.pair_ids, train.dropped_oversized, val.pair_ids, val.dropped_oversized) == ([0, 1], 2, [4], 1)
    assert notes == [
        "training: 2 of 4 pairs exceed packing.max_tokens_per_bin = 256 and are dropped at start (largest: a.jsonl:6, "
        "512 tokens) (metrics: dropped_oversized)",
        "validation: 1 of 2 pairs exceed packing.max_tokens_per_bin = 256 and are dropped at start (largest: "
        "a.jsonl:4, 352 tokens) (validation uses the other 1)",
    ]
    # every step of the sampler now plans (no "no pair of this step fits in a bin")
    for ids in ([0, 1], [4]):
        plan = pack.plan_step(index.lengths(ids), cfg.packing, 2)
        assert plan.dropped == [] and sorted(p for r in plan.ranks for b in r if not b.dummy for p in b.pair_ids) == ids
    cfg.policy.train_global_batch_size = 3
    with raises_naming(config_mod.ConfigError, "policy.train_global_batch_size = 3", "only 2 training pairs",
                       "data.train.max_samples = 0", "data.train.split_validation_size = 4.0", "2 oversized pairs"):
        preflight.check_splits(Split(index, [0, 1, 2, 5]), None, cfg)
    with raises_naming(config_mod.ConfigError, "every validation pair", "packing.max_tokens_per_bin = "):
        preflight.check_splits(Split(index, [0, 1]), Split(index, [3]), cfg)
    cfg.packing.drop_oversized_pairs = False  # the default: nothing dropped, every split unchanged
    cfg.packing.max_tokens_per_bin, cfg.policy.train_global_batch_size = 4096, 2
    train, val, notes = preflight.check_splits(Split(index, [0, 1, 2, 5]), Split(index, [3, 4]), cfg)
    assert (train.pair_ids, train.dropped_oversized, val.pair_ids, notes) == ([0, 1, 2, 5], 0, [3, 4], [])


def test_load_data_prints_data_warnings_once_as_plain_lines_on_rank_0(capsys):
    """A data notice is one plain line among the data lines of rank 0 (not a UserWarning with its source
    line on every rank)."""
    import warnings

    from step_cases import tiny_config  # packing.shared_prompt resolved as train.main does

    import omni_model

    meta = str(ROOT / "data/mmpr_sample/MMPR-sample/meta.json")
    cfg = tiny_config(
        f"data.train.data_path={meta}", f"data.validation.data_path={meta}", "data.validation.max_samples=4",
        "data.train.split_validation_size=2", "data.num_workers=0")
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    hf = omni_model.read_hf_config(cfg.model.hf_path)
    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = train.load_data(cfg, hf, rank)
        out = capsys.readouterr()
        assert not [w for w in caught if "split_validation_size" in str(w.message)] and "UserWarning" not in out.err
        lines = out.out.splitlines()
        if rank == 0:
            assert lines.count("data.validation.data_path is set: data.train.split_validation_size is ignored") == 1
            status = "cached" if data.train_split.index.cache_status == "hit" else "built"
            assert lines[0].startswith(f"data: {len(data.train_split.pair_ids)} train pairs, 4 validation pairs "
                                       f"(index {status}), dropped records {{")
        else:
            assert lines == []


def test_ctrl_c_while_starting_is_one_line(tmp_path):
    """Ctrl-C in the first seconds (train.py's imports) printed ~40 lines of KeyboardInterrupt traceback per rank."""
    proc = subprocess.Popen([sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={tmp_path / 'run'}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled"})  # fmt: skip
    time.sleep(1.0)  # inside the imports (several seconds); a faster machine is in main(), the other one-liner
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] in ("interrupted while starting: nothing saved",
                                            "interrupted before the first step: nothing saved")


def test_ctrl_c_while_the_models_load_stops_before_the_first_step(tmp_path):
    """QA: a Ctrl-C while the data and models loaded was remembered by the stop handler, so the run still trained a
    full step and saved it before stopping (exit 0); the README promises exit 130 and nothing saved."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled",
                                 "PYTHONUNBUFFERED": "1"})  # fmt: skip
    seen = []
    for line in proc.stdout:  # the data line: next come the policy and reference builds (seconds)
        seen.append(line)
        if line.startswith("data: "):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen, out, err[-3000:])
    assert err.strip().splitlines()[-1] == "interrupted before the first step: nothing saved"
    assert "Traceback" not in err and out == f"config: {run_dir / 'config.json'}\n"  # no step line
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.json"]  # no step_1, no metrics.jsonl


def test_cli_error_is_one_line_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/tiny.toml", f"model.hf_path={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"error: ConfigError: model.hf_path = '{tmp_path}'"), last
    assert "config.json" in last and "Traceback" not in proc.stderr
    # megatron-core's constraints too: before, data, models and optimizer were built and the first
    # forward raised megatron's ValueError as a traceback
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/tiny.toml", "parallel.tensor_model_parallel_size=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and last.startswith("error: ConfigError: "), last
    assert "parallel.tensor_model_parallel_size = 2" in last and "parallel.sequence_parallel = true" in last, last


def test_check_run_dir_refuses_an_empty_a_file_and_an_uncreatable_path(tmp_path, monkeypatch):
    """Checkpoint.dir empty (the run landed in the working directory), an existing file, or under a file
    (/dev/null/x) failed only when config.json was written, after the models were built."""
    (tmp_path / "file").write_text("")
    for value, names in [
        ("", ["checkpoint.dir ", "checkpoint.dir=results/my_run"]),  # empty: names the key and an example value
        (" ", ["checkpoint.dir ", "checkpoint.dir=results/my_run"]),
        (str(tmp_path / "file"), [f"checkpoint.dir = '{tmp_path / 'file'}' "]),
        ("/dev/null/x", ["checkpoint.dir = '/dev/null/x' ", "'/dev/null'"]),
        (str(tmp_path / "file" / "a" / "b"), [f"checkpoint.dir = '{tmp_path / 'file' / 'a' / 'b'}' ",
                                              f"'{tmp_path / 'file'}'"]),
    ]:  # fmt: skip
        with raises_naming(config_mod.ConfigError, *names):
            preflight.check_run_dir(value)
    preflight.check_run_dir(str(tmp_path / "new" / "run"))  # creatable: created
    preflight.check_run_dir(str(tmp_path))  # an existing directory
    assert (tmp_path / "new" / "run").is_dir()
    # root's os.access says /proc and /sys are writable, mkdir fails there (a traceback after the models)
    for value, root_error, top in (("/proc/omni_mpo_test/run", "No such file or directory", "/proc"),
                                   ("/sys/omni_mpo_test", "Operation not permitted", "/sys")):  # fmt: skip
        why = root_error if os.geteuid() == 0 else f"write permission on '{top}'"  # a user: os.access says no
        with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{value}' ", why):
            preflight.check_run_dir(value)
    denied = {tmp_path / "ro"}  # os.access as a non-root user without write permission (root passes every check)
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: Path(p) not in denied)
    (tmp_path / "ro").mkdir()
    with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{tmp_path / 'ro' / 'run'}'",
                       f"write permission on '{tmp_path / 'ro'}'"):
        preflight.check_run_dir(str(tmp_path / "ro" / "run"))
    with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{tmp_path / 'ro'}'",
                       f"write permission on '{tmp_path / 'ro'}'"):
        preflight.check_run_dir(str(tmp_path / "ro"))
    # a read-only mount (os.access says no for root too): named as such, not as a permission (QA)
    monkeypatch.setattr(preflight.os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{tmp_path / 'ro'}'",
                       f"read-only file system at '{tmp_path / 'ro'}'"):
        preflight.check_run_dir(str(tmp_path / "ro"))
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", ["checkpoint.dir="])
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    cfg.data.train.data_path = str(ROOT / cfg.data.train.data_path)
    with raises_naming(config_mod.ConfigError, "checkpoint.dir is empty"):
        preflight.check_inputs(cfg)  # part of the checks train.main runs first on every rank


def test_check_run_dir_refuses_a_model_an_export_and_a_checkpoint(tmp_path):
    """QA: checkpoint.dir = model.hf_path trained and wrote the run's config.json over the model's (the next start
    failed in read_hf_config); checkpoint.dir = RUN/step_6 started a new run inside that checkpoint."""
    import checkpoint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "NemotronH_Nano_Omni_Reasoning_V3"}')
    with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{model}' ", "model.hf_path"):
        preflight.check_run_dir(str(model), str(tmp_path / "." / "model"))
    for held in (model, tmp_path / "export"):  # any HF model; an export (its info file) even without config.json
        if held.name == "export":
            held.mkdir()
            (held / checkpoint.EXPORT_INFO_FILE).write_text("{}")
        with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{held}' ", "config.json") as e:
            preflight.check_run_dir(str(held), "assets/tiny-omni")
        assert "model.hf_path" not in str(e.value)  # an HF model, not the run's own model.hf_path
    step = tmp_path / "run" / "step_6"
    (step / checkpoint.MODEL_OPTIM_DIR).mkdir(parents=True)
    (step / checkpoint.RUN_STATE_FILE).write_text("{}")
    for value in (step, step / "sub" / "run"):
        with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{value}' ", f"checkpoint {step} ",
                           f"checkpoint.dir={tmp_path / 'run'}"):  # fmt: skip
            preflight.check_run_dir(str(value), "assets/tiny-omni")
    assert not (step / "sub").exists()
    for unfinished in ("step_9.tmp", "step_2.old"):  # the next start of RUN removes / renames these (QA)
        value = tmp_path / "run" / unfinished
        value.mkdir()
        with raises_naming(config_mod.ConfigError, f"checkpoint.dir = '{value}' ", f"checkpoint {value} "):
            preflight.check_run_dir(str(value), "assets/tiny-omni")
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_mod.to_dict(config_mod.Config())))
    preflight.check_run_dir(str(tmp_path / "run"), "assets/tiny-omni")  # a run directory itself: a resume
    (tmp_path / "step_3").mkdir()  # a folder merely named like a checkpoint
    preflight.check_run_dir(str(tmp_path / "step_3"), "assets/tiny-omni")


@pytest.mark.parametrize("value", [0, -1])
def test_val_batches_must_be_at_least_one(value):
    """0 crashed at the first validation (KeyError 'loss'), -1 sliced off the last batch."""
    with raises_naming(config_mod.ConfigError, f"mpo.val_batches = {value}", ">= 1"):
        config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"mpo.val_batches={value}"])


def test_wandb_online_needs_an_api_key(tmp_path, monkeypatch):
    """Logging.wandb=online without a key failed in wandb.init (UsageError) after the models were built."""
    import wandb

    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no .netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no settings file
    monkeypatch.setenv("WANDB_MODE", "disabled")  # conftest's; logging.wandb = online is what counts
    wandb.teardown()  # a fresh wandb singleton reads the settings above
    try:
        preflight.check_wandb("offline")  # no key needed
        preflight.check_wandb("disabled")
        with raises_naming(config_mod.ConfigError, "logging.wandb = 'online'", "WANDB_API_KEY", "~/.netrc",
                           "logging.wandb=offline"):  # fmt: skip
            preflight.check_wandb("online")
        monkeypatch.setenv("WANDB_API_KEY", "short")
        with raises_naming(config_mod.ConfigError, "logging.wandb = 'online'", "WANDB_API_KEY", "40"):
            preflight.check_wandb("online")
        monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)  # the format of a key; not verified (no network)
        preflight.check_wandb("online")
    finally:
        wandb.teardown()


def test_wandb_that_does_not_import_is_one_config_error(monkeypatch):
    """Found on the GPU machine's Python set (no wandb): logging.wandb=online stopped in preflight with a
    ModuleNotFoundError traceback, and offline only after the models were built (monitor.MetricsLog). Now both are one
    ConfigError before any work; disabled never imports wandb."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when it is not installed
    preflight.check_wandb("disabled")
    for mode in ("online", "offline"):
        with raises_naming(config_mod.ConfigError, f"logging.wandb = {mode!r}", "(ModuleNotFoundError: ",
                           "pip install wandb", "logging.wandb=disabled", "WANDB_MODE=disabled"):  # fmt: skip
            preflight.check_wandb(mode)


def test_wandb_mode_in_the_environment_overrides_logging_wandb(monkeypatch):
    """WANDB_MODE=offline with logging.wandb=online was refused for want of an API key; the variable now
    decides the mode (the resolved config holds it) and the key check follows it."""
    import wandb

    for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = config_mod.load_config(None, ["logging.wandb=online"])
    assert cfg.logging.wandb == "offline" and config_mod.to_dict(cfg)["logging"]["wandb"] == "offline"
    preflight.check_wandb(cfg.logging.wandb)  # offline: no key needed
    monkeypatch.setenv("WANDB_MODE", "")  # empty = not set
    assert config_mod.load_config(None, ["logging.wandb=online"]).logging.wandb == "online"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with raises_naming(config_mod.ConfigError, "WANDB_MODE = 'dryrun'", "logging.wandb", "online, offline, disabled"):
        config_mod.load_config(None, [])
    wandb.teardown()


def test_wandb_init_failure_is_one_config_error_line(tmp_path, monkeypatch):
    """Logging.wandb=online without network died ~2 minutes later inside wandb.init (a CommError traceback,
    after the models were built); now one ConfigError line says what failed and the remedy."""
    import wandb

    def fail(**kwargs):
        raise wandb.errors.CommError("Failed to get resume status for run x2lafkpm: context deadline exceeded\nmore")

    monkeypatch.setattr(wandb, "init", fail)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", "logging.wandb=online"])
    with raises_naming(config_mod.ConfigError, "logging.wandb = 'online'", "wandb.init",
                       "(CommError: Failed to get resume status for run x2lafkpm: context deadline exceeded)",
                       "logging.wandb=offline", "WANDB_MODE=offline",
                       f"wandb sync {tmp_path / 'wandb'}/offline-run-*") as e:  # fmt: skip
        monitor.MetricsLog(cfg, None, resumed_step=0, rank=0)
    assert "\n" not in str(e.value)  # the first line of wandb's message only


def test_wandb_init_failure_stops_every_rank(torchrun, tmp_path):
    """Only rank 0 calls wandb.init; rank 1 gets the same ConfigError (broadcast) instead of waiting forever."""
    worker = Path(__file__).resolve().parent / "dist" / "check_wandb_failure.py"
    res = torchrun(worker, env={"RUN_DIR": str(tmp_path), "WANDB_MODE": None}, timeout=180).ranks  # not conftest's
    assert res[0]["calls"] == ["online"] and res[1]["calls"] == []
    assert res[0]["err"] == res[1]["err"] and res[0]["err"].startswith(
        "logging.wandb = 'online': wandb.init failed (CommError: Failed to get resume status for run x2lafkpm: ")


def _run_state(cfg, step: int) -> dict:
    """A complete run_state.json of step `step` of a run with config `cfg` (world size 1, what checkpoint.save writes
    for the keys a resume reads)."""
    return {"step": step, "world_size": 1, "consumed_pairs": 4 * step, "reward_shift": 0.0,
            "reward_shift_num_updates": step, "sampler": {"epoch": 0, "offset": 4 * step}, "wandb_run_id": None,
            "scheduler": {}, "config": config_mod.to_dict(cfg)}


def test_a_finished_run_builds_nothing_and_opens_no_wandb_run(tmp_path):
    """Re-running a finished run opened another (offline) W&B run before saying "nothing to do"; it now
    stops right after the checkpoint checks, before W&B, data and models."""
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "step_6" / "model_optim").mkdir(parents=True)  # a complete checkpoint's layout (checkpoint.py)
    (tmp_path / "step_6" / "run_state.json").write_text(json.dumps(_run_state(cfg, 6)))
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={tmp_path}"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "nothing to do: step 6 already reached the stop step 6"
    # only the run-dir lock (checkpoint.lock_run_dir) besides the checkpoint: no wandb/, metrics.jsonl or config.json
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_6"]


def test_a_step_without_its_run_state_is_refused_and_never_written_over(tmp_path):
    """`rm step_2/run_state.json` made the next run resume from step_1 (or start afresh) and its save of
    step 2 replace step_2/model_optim. The run now stops before writing anything, naming step_2 and step_1."""
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "step_1" / "model_optim").mkdir(parents=True)
    (tmp_path / "step_1" / "run_state.json").write_text(json.dumps(_run_state(cfg, 1)))
    (tmp_path / "step_2" / "model_optim").mkdir(parents=True)
    (tmp_path / "step_2" / "model_optim" / "__0_0.distcp").write_bytes(b"trained")
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={tmp_path}"], cwd=ROOT,
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"error: CheckpointError: {tmp_path / 'step_2'} ")
    assert last.endswith(str(tmp_path / "step_1"))
    assert (tmp_path / "step_2" / "model_optim" / "__0_0.distcp").read_bytes() == b"trained"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_1", "step_2"]  # no metrics, config, wandb


def test_a_changed_schedule_is_refused_before_metrics_data_and_models(tmp_path):
    """A resume refused for a changed LR schedule (checkpoint.check_resume) used to be found in checkpoint.load,
    after metrics.jsonl had been trimmed to the resumed step and the models built; it is now refused right after the
    checkpoint checks, and metrics.jsonl keeps every line."""
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "step_2" / "model_optim").mkdir(parents=True)
    (tmp_path / "step_2" / "run_state.json").write_text(json.dumps(_run_state(cfg, 2)))
    rows = "".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(rows)  # step 3: a segment that died before saving
    proc = subprocess.run(
        [sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={tmp_path}", "optimizer.lr=0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )  # fmt: skip
    assert proc.returncode == 1
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: CheckpointError: ") and f"{tmp_path / 'step_2'} " in last, last
    assert f"optimizer.lr {cfg.optimizer.lr!r} -> 0.5" in last
    assert (tmp_path / "metrics.jsonl").read_text() == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "metrics.jsonl", "step_2"]  # no wandb/, config


def test_resume_notes_training_data_changed_with_the_same_pair_count(tmp_path, monkeypatch, capsys):
    """A resume over changed data with the same pair count trained on without a word; train.resume now
    prints one `resume:` line (the sampler state's index fingerprint differs) and continues."""
    import checkpoint
    import mmpr_data

    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    saved = mmpr_data.PairSampler(list(range(10)), seed=0, fingerprint="0123456789ab" + "0" * 52)
    saved.take(4)
    state = checkpoint.RunState(tmp_path / "step_2", step=2, world_size=1, consumed_pairs=8, reward_shift=0.25,
                                reward_shift_num_updates=2, sampler=saved.state_dict(), scheduler={},
                                config=config_mod.to_dict(cfg))  # fmt: skip
    monkeypatch.setattr(checkpoint, "load", lambda *args: state)
    sampler = mmpr_data.PairSampler(list(range(10)), seed=0, fingerprint="fedcba987654" + "0" * 52)
    run_state = train.resume(state, {}, None, None, None, sampler, cfg, rank=0)
    assert run_state["step"] == 2 and run_state["sampler"]["offset"] == 4
    assert capsys.readouterr().out.splitlines() == [
        f"resumed from {tmp_path / 'step_2'} (step 2, reward_shift 0.25)",
        "resume: the training data changed since step 2 (index fingerprint 0123456789ab -> fedcba987654: the "
        "meta-recipe, an annotation file (size or mtime), an image folder, the processor or a data setting differs; "
        "the same 10 pairs, so the run continues from the saved position)",
        f"config: {tmp_path / 'config.json'}",
    ]
    sampler = mmpr_data.PairSampler(list(range(10)), seed=0, fingerprint=saved.fingerprint)
    train.resume(state, {}, None, None, None, sampler, cfg, rank=0)
    assert "resume:" not in capsys.readouterr().out  # the same data: nothing said


def test_resume_from_another_model_hf_path_says_the_reference_changes(tmp_path, monkeypatch, capsys):
    """QA: a resume with another model.hf_path silently swapped the frozen reference model (step 5's loss and
    accuracy changed), and another global batch size went unsaid; both are `resume:` notices now, with the earlier
    config kept as config.step_<N>.json."""
    import checkpoint
    import mmpr_data

    saved_cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    export = tmp_path / "exports" / "step_4"
    shutil.copytree(ROOT / "assets" / "tiny-omni", export)
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", f"model.hf_path={export}",
                                        "policy.train_global_batch_size=8"])
    sampler = mmpr_data.PairSampler(list(range(10)), seed=0, fingerprint="0" * 64)
    state = checkpoint.RunState(tmp_path / "step_4", step=4, world_size=1, consumed_pairs=16, reward_shift=0.0,
                                reward_shift_num_updates=4, sampler=sampler.state_dict(), scheduler={},
                                config=config_mod.to_dict(saved_cfg))  # fmt: skip
    monkeypatch.setattr(checkpoint, "load", lambda *args: state)
    train.resume(state, checkpoint.check_resume(state, cfg), None, None, None, sampler, cfg, rank=0)
    notice = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resume:")]
    assert notice == [
        f"resume: changed settings from step 5 on: model.hf_path {saved_cfg.model.hf_path!r} -> '{export}' (the "
        "frozen reference model; the policy continues from the checkpoint), policy.train_global_batch_size "
        f"{saved_cfg.policy.train_global_batch_size} -> 8; the settings of steps up to 4: config.step_4.json"]
    assert json.loads((tmp_path / "config.step_4.json").read_text()) == config_mod.to_dict(saved_cfg)
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", f"model.hf_path={ROOT / 'assets/tiny-omni'}"])
    monkeypatch.chdir(ROOT)  # the saved relative path names the same folder from here: nothing changed (QA)
    train.resume(state, checkpoint.check_resume(state, cfg), None, None, None, sampler, cfg, rank=0)
    assert "resume:" not in capsys.readouterr().out
    # the same model.hf_path rewritten in place (break-it pass: a new export into the folder a run started from)
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", f"model.hf_path={export}"])
    files = model_hub.model_files(export)
    state = dataclasses.replace(state, config=config_mod.to_dict(cfg), model_files=files)
    assert checkpoint.check_resume(state, cfg) == {}
    (export / "README.md").write_text("a model card: not a file the job reads")
    assert model_hub.model_files(export) == files
    weights = export / "model.safetensors"  # the same size, other content
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    now = model_hub.model_files(export)
    assert now != files and checkpoint.check_resume(state, cfg) == {
        "model.hf_path": (f"{export} (files {files})", f"{export} (files {now})")}


def test_two_readme_commands_on_one_machine_do_not_wait_on_each_other(tmp_path):
    """Two runs of the README's command shared torchrun's default port 29500, so the second waited
    silently for the whole first run, then said "nothing to do". With --standalone each picks a free port, and the
    second stops at once on the run directory's lock while the first trains."""
    import shlex

    readme = (ROOT / "README.md").read_text()
    command = next(line.split("&& ", 1)[1] for line in readme.splitlines() if "&& torchrun" in line)
    argv = shlex.split(command)
    assert argv[0] == "torchrun" and "--standalone" in argv
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:], f"checkpoint.dir={tmp_path}",
            "mpo.max_num_steps=1000"]  # the first run outlives the second
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled"}
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "config.json").exists():  # written after the lock is held (train.resume)
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert first.poll() is None  # the second did not wait for the first to end
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 1
    errors = [x for x in second.stderr.splitlines() if x.startswith("error: ")]
    assert errors[0].startswith(f"error: CheckpointError: checkpoint.dir = {tmp_path} "), errors
    assert "(pid " in errors[0], errors


def test_a_full_disk_at_start_is_one_line_and_leaves_no_partial_config(tmp_path, monkeypatch):
    """A disk already full when the run starts: writing the resolved config is one CheckpointError naming the file and
    the free space (not a traceback), and no 0-byte config.json is left; an earlier config.json is kept whole."""
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    (tmp_path / "config.json").write_text('{"earlier": 1}\n')
    def full_disk(fd):  # the bytes were written, then the disk is full when they are synced
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    for previous in (None, (3, {"step": 3})):
        target = "config.json" if previous is None else "config.step_3.json"
        with raises_naming(checkpoint.CheckpointError, f"{tmp_path / target}: OSError: [Errno {errno.ENOSPC}]",
                           f"bytes free on {tmp_path}"):  # fmt: skip
            checkpoint.write_resolved_config(cfg, 0, previous)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
        assert (tmp_path / "config.json").read_text() == '{"earlier": 1}\n'
    monkeypatch.undo()
    assert checkpoint.write_resolved_config(cfg, 0, (3, {"step": 3})) == tmp_path / "config.json"
    assert json.loads((tmp_path / "config.json").read_text()) == config_mod.to_dict(cfg)
    assert json.loads((tmp_path / "config.step_3.json").read_text()) == {"step": 3}


@pytest.fixture(scope="module")
def env(torchrun, tmp_path_factory):
    """The launch environment of this module's runs (the harness's, with one data-index cache for all of them)."""
    return torchrun.env({"HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("hf_cache"))})


@pytest.fixture(scope="module")
def train_run(torchrun, env):
    """`train_run(nproc, run_dir, *overrides, extra_env=None)`: `train.py configs/tiny.toml checkpoint.dir=run_dir
    *overrides` on `nproc` ranks through the torchrun fixture, `extra_env` added to the environment; fails the test on
    a non-zero exit unless check=False."""

    def run(nproc: int, run_dir: Path, *overrides: str, timeout: int = 300, check: bool = True,
            extra_env: dict | None = None):  # fmt: skip
        return torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *overrides, nproc=nproc,
                        env={"HF_DATASETS_CACHE": env["HF_DATASETS_CACHE"], **(extra_env or {})}, timeout=timeout,
                        check=check)  # fmt: skip

    return run


def _rows(run_dir: Path, split: str = "train") -> list[dict]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == split]


def _loaded_state(step_dir: Path, *overrides: str) -> list[tuple[str, torch.Tensor]]:
    """Policy weights and every optimizer state tensor (fp32 main params, Adam moments, per-parameter step) after
    loading `step_dir` into a fresh tiny policy + DDP + optimizer in this process (a world of one: the DP = 2
    checkpoint reshards over DP). In-memory state, so the uninitialised padding megatron's `dp_reshardable` format
    writes between parameters in its buckets is not compared."""
    import checkpoint
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", overrides)  # the run's schedule
    policy = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    ddp, opt, sched = train.build_optimizer(policy, cfg)
    checkpoint.load(step_dir, ddp, opt, sched)
    out = [(f"param {n}", p.detach().clone()) for n, p in policy.named_parameters()]
    # the routers' expert bias is a buffer, moved by the step's token counts
    out += [(f"buffer {n}", b.detach().clone()) for n, b in policy.named_buffers() if n.endswith("expert_bias")]
    for i, o in enumerate(checkpoint._inner_optimizers(opt)):
        for g in o.optimizer.param_groups:
            for j, p in enumerate(g["params"]):
                out += [(f"opt {i}.{j}.{k}", v.detach().clone()) for k, v in sorted(o.optimizer.state[p].items())]
    return out


@pytest.fixture(scope="module")
def readme(train_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("readme")
    proc = train_run(2, run_dir, "checkpoint.save_period=4")
    return SimpleNamespace(dir=run_dir, out=proc.stdout, rows=_rows(run_dir), val=_rows(run_dir, "validation"))


@pytest.fixture(scope="module")
def shared(train_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("shared")
    proc = train_run(2, run_dir, "packing.shared_prompt=auto")
    return SimpleNamespace(dir=run_dir, out=proc.stdout, rows=_rows(run_dir), val=_rows(run_dir, "validation"))


@pytest.fixture(scope="module")
def bias_off(train_run, tmp_path_factory):
    """The README command without the expert-bias update, in both pair formats: {pair_format: (train, val rows)}."""
    runs = {}
    for pair_format in ("true", "false"):
        run_dir = tmp_path_factory.mktemp(f"bias_off_{pair_format}")
        train_run(2, run_dir, f"packing.shared_prompt={pair_format}", "model.moe_router_bias_update_rate=0")
        runs[pair_format] = (_rows(run_dir), _rows(run_dir, "validation"))
    return runs


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A hub cache (HF_HUB_CACHE) with assets/tiny-omni as the snapshot of hub id HUB_ID (conftest.make_hub_cache)."""
    cache = tmp_path_factory.mktemp("hub")
    make_hub_cache(cache)
    return cache


@pytest.fixture(scope="module")
def segments(train_run, hub_cache, tmp_path_factory):
    """The README command in two segments (steps 1-2, 3-4), the model given as hub id HUB_ID, offline from
    `hub_cache`: the resume test compares them with the README run (from the local folder) bit for bit."""
    run_dir = tmp_path_factory.mktemp("segments")
    # model.deterministic_mode on the CPU changes no number either
    hub = {"extra_env": {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}}
    first = train_run(2, run_dir, "mpo.stop_after_step=2", "model.deterministic_mode=true", f"model.hf_path={HUB_ID}",
                      **hub)
    after_first = sorted(p.name for p in run_dir.iterdir())
    killed = run_dir / "step_5.tmp"  # a save killed mid-way: files present, never renamed
    (killed / "model_optim").mkdir(parents=True)
    (killed / "run_state.json").write_text('{"step": 5}')
    with open(run_dir / "metrics.jsonl", "a") as f:  # a line logged by a segment that died before saving step 3
        f.write(json.dumps({"step": 3, "split": "train", "loss": 123.0}) + "\n")
    second = train_run(2, run_dir, "mpo.stop_after_step=4", "model.deterministic_mode=true", f"model.hf_path={HUB_ID}",
                       **hub)
    return SimpleNamespace(dir=run_dir, first=first.stdout, second=second.stdout, err=second.stderr,
                           after_first=after_first, rows=_rows(run_dir))  # fmt: skip


@pytest.fixture(scope="module")
def precomputed(train_run, tmp_path_factory):
    """The README command with reference.logprobs=precomputed, in two segments (steps 1-2 after the pass, 3-6)."""
    run_dir = tmp_path_factory.mktemp("precomputed")
    first = train_run(2, run_dir, "reference.logprobs=precomputed", "mpo.stop_after_step=2")
    second = train_run(2, run_dir, "reference.logprobs=precomputed")
    return SimpleNamespace(dir=run_dir, first=first.stdout, second=second.stdout, rows=_rows(run_dir),
                           val=_rows(run_dir, "validation"))  # fmt: skip


@pytest.fixture(scope="module")
def learn(train_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("learn")
    train_run(2, run_dir, *LEARN, "checkpoint.save_period=3", "checkpoint.keep_last=0")  # step_3: DP = 2 state
    return SimpleNamespace(dir=run_dir, rows=_rows(run_dir))


TP2 = [*LEARN, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "mpo.stop_after_step=3"]


@pytest.fixture(scope="module")
def tp2(train_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2")
    train_run(2, run_dir, *TP2)
    return _rows(run_dir)


# Parameters after Adam steps at other reduction orders: Adam moves each element by lr · m/(sqrt(v) + eps), which
# carries the gradient's relative rounding (~1e-6) except where |g| is itself within rounding of 0 (a gradient summed
# from cancelling terms): there the step's size and sign are noise, up to lr. Such elements are few (embedding rows
# of tokens the batch barely touches); the allowance is 1% of the lr summed over the steps, a fraction a real change
# of the update (any term of the loss, the clip, the schedule) exceeds in most parameters.
PARAM_ATOL_AFTER_3_STEPS = 0.01 * (0.0 + 5e-4 + 1e-3)  # LEARN's lr at steps 1-3 (a 2-step warm-up from 0 to 1e-3)
SHORT = ["mpo.max_num_steps=2", "scheduler.lr_warmup_steps=1", "data.train.split_validation_size=0",
         "mpo.val_at_end=false"]


@pytest.fixture(scope="module")
def padding(train_run, tmp_path_factory):
    """Two steps (lr 0, then 1e-4) with sequences padded to multiples of 8 and of 64 on one rank, and
    padded to 8 on DP = 2."""
    runs = {}
    for name, nproc, multiple in (("pad8", 1, 8), ("pad64", 1, 64), ("dp2", 2, 8)):
        run_dir = tmp_path_factory.mktemp(name)
        train_run(nproc, run_dir, *SHORT, f"packing.make_sequence_length_divisible_by={multiple}")
        runs[name] = SimpleNamespace(dir=run_dir, rows=_rows(run_dir))
    return runs


@pytest.fixture(scope="module")
def frozen(train_run, tmp_path_factory):
    """Issues 13.2 and 13.6: lr 0 and bias update rate 0 for 7 steps of 4 pairs on the first 27 sample pairs (step 7
    straddles the epoch boundary)."""
    run_dir = tmp_path_factory.mktemp("frozen")
    train_run(1, run_dir, "optimizer.lr=0", "optimizer.min_lr=0", "model.moe_router_bias_update_rate=0",
              "mpo.max_num_steps=7", "scheduler.lr_warmup_steps=0", "data.train.split_validation_size=0",
              "data.train.max_samples=27", "mpo.val_at_end=false")  # fmt: skip
    return SimpleNamespace(dir=run_dir, rows=_rows(run_dir))


@pytest.fixture(scope="module")
def tp1_signal(env, tmp_path_factory):
    """One process without torchrun, stopped with SIGUSR1 once step 3 is logged."""
    run_dir = tmp_path_factory.mktemp("tp1")
    cmd = [sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *LEARN,
           "checkpoint.save_period=3"]  # step_3: the DP = 1 state
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGUSR1)
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=300)
    return SimpleNamespace(dir=run_dir, rc=proc.returncode, out=out, err=err, rows=_rows(run_dir))


# ----------------------------------------------------------------------------------------------------------------------
# The README command


def test_readme_command_writes_metrics_and_checkpoints(readme):
    assert [r["step"] for r in readme.rows] == [1, 2, 3, 4, 5, 6]
    assert all(list(r)[0] == "step" for r in readme.rows + readme.val)
    assert len(readme.val) == 1 and readme.val[0]["step"] == 6 and readme.val[0]["num_valid_pairs"] == 4
    assert sorted(p.name for p in readme.dir.glob("step_*")) == ["step_4", "step_6"]
    state = json.loads((readme.dir / "step_6" / "run_state.json").read_text())
    assert (
        state["step"] == 6
        and state["consumed_pairs"] == 24
        and state["reward_shift"] == readme.rows[-1]["reward_shift"]
    )
    assert config_mod.from_dict(state["config"]).checkpoint.dir == str(readme.dir)
    for key in (
        "loss",
        "preference_loss",
        "bco_loss",
        "sft_loss",
        "accuracy",
        "rewards/margin",
        "reward_shift",
        "lr",
        "grad_norm",
        "pairs_per_s",
        "tokens_per_s",
        "step_time",
        "eta_s",
        "tokens",
    ):
        assert key in readme.rows[0], key
    assert "step 6/6 | loss" in readme.out and "stopped after step 6 (max_num_steps)" in readme.out
    assert readme.rows[0]["num_global_pairs"] == 4 and readme.rows[0]["tokens"] > 0


def test_step_one_is_ln2_and_2ln2_with_identical_policy_and_reference(readme):
    r = readme.rows[0]
    assert r["preference_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert r["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-5)
    assert r["rewards/margin"] == 0.0 and r["accuracy"] == 0.0  # L_c = L_r = 0 exactly
    assert r["loss"] == pytest.approx(0.8 * math.log(2) + 0.2 * 2 * math.log(2), abs=1e-5)


def test_reward_shift_after_step_one_is_one_percent_of_the_mean_reward(readme):
    r1, r2 = readme.rows[0], readme.rows[1]
    assert r1["reward_shift_used"] == 0.0
    assert r1["reward_shift"] == 0.01 * (r1["bco/reward_sum"] / r1["bco/reward_count"])  # exactly as logged
    assert r1["bco/reward_count"] == 8  # chosen and rejected rows of the 4 pairs
    m = 0.99
    assert r2["reward_shift_used"] == r1["reward_shift"]  # δ of step t comes from steps < t
    assert r2["reward_shift"] == m * r1["reward_shift"] + (1 - m) * (r2["bco/reward_sum"] / r2["bco/reward_count"])


def test_lr_follows_the_schedule(readme):
    lrs = [r["lr"] for r in readme.rows]  # tiny: warmup 2 steps from 0 to 1e-4, cosine to 1e-6 at step 6
    want = [0.0, 5e-5, 1e-4] + [1e-6 + 0.5 * (1e-4 - 1e-6) * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3)]
    assert lrs == pytest.approx(want, rel=1e-12)


# The golden traces: every metric of every step of the README command (configs/tiny.toml, 6 steps, DP = 2), and its
# validation row, in both pair formats. GOLDEN_TRAIN / GOLDEN_VALIDATION: the README command itself, separate sequences
# (tiny.toml's packing.shared_prompt = false), recorded 2026-12-01 (torchrun --standalone --nproc-per-node 2 train.py
# configs/tiny.toml). GOLDEN_SHARED / GOLDEN_SHARED_VALIDATION: the same command with packing.shared_prompt=auto, the
# shared-prompt format on the CPU, recorded 2026-12-03. Step 1 of both is the same (policy = reference;
# only `tokens` differs, each prompt computed once); from step 2 on they part by design: each prompt token is routed,
# and counted for the expert-bias update, once instead of twice (test_both_formats_train_alike_without_the_expert_bias_
# update checks the rest is equal). A change of behaviour
# anywhere on the step's path (data order, packing, model, loss, optimizer, schedule, δ update, metric reduction) moves
# some of these numbers; a refactor moves none. The timing-derived keys are not part of the traces. Two keys were
# renamed since (logps/chosen, logps/rejected -> logprobs/*: the field's name); every number is as recorded.
#
# Tolerances, derived from float32 rounding rather than from the machines seen so far. Another CPU rounds differently
# (its ISA as ATEN_CPU_CAPABILITY, MKL and oneDNN pick it, its thread count, its summation orders). Every traced number
# is a function of per-response log-prob sums S (float32) and of float32 gradients. The rule (golden_tolerance): each S
# may move by 4 eps |S| (eps = 2**-23, float32's machine epsilon); log-probs are <= 0, so a mean of such sums over
# pairs moves by at most 4 eps times its own magnitude, and e = 4 eps S_max, S_max the largest |logprobs/*| of the
# trace (257.4: e = 1.2e-4). Propagated to first order through each key's formula, with β the KL penalty
# (mpo.reference_policy_kl_penalty), w_p / w_q / w_g the loss weights, m the reward-shift momentum, t the step:
#   logprobs/chosen, logprobs/rejected    e                   a mean over pairs of sums S
#   rewards/chosen, rewards/rejected,     2βe                 β (S_policy - S_reference)
#     bco/reward_mean
#   rewards/margin, preference_loss       4βe                 two rewards; |d softplus(x)/dx| <= 1
#   bco_loss                              8βe                 softplus of (reward - δ) for chosen and rejected
#   bco/reward_sum                        count * 2βe         a sum of `bco/reward_count` rewards
#   reward_shift after step t             (1 - m**t) * 2βe    the EMA of reward means from δ = 0 (reward_shift_used:
#                                                             the previous step's)
#   sft_loss, nll/chosen                  4 eps of the value  a per-token mean of log-probs
#   loss                                  w_p 4βe + w_q 8βe + w_g (sft_loss's)
#   grad_norm                             4 sqrt(T) eps / 2   relative; each gradient entry sums ~T = `tokens` products
#   accuracy                              one pair (1/4)      a pair whose margin is within the rounding of 0 flips
#   lr                                    1e-12 relative      the schedule's float64 arithmetic; counts and tokens exact
# Step 1 runs policy and reference (equal weights) through the same kernels on the same inputs: every reward, δ and
# the accuracy are exactly 0 and the losses exactly ln 2 / 2 ln 2 in float32, so the keys built from rewards are
# exact there. Under seven kernel sets of one Intel Xeon (AVX-512 / AVX2 / default, MKL AVX2 / SSE4.2, 1 and 2 threads;
# 2026-12-04) every deviation stayed under 1/8 of its bound. A change of behaviour moves these numbers by far more: one
# token's log-prob is ~1-10 (~10**4 e), and a 1e-3 change of β or of the lr fails the trace
# (test_the_golden_trace_catches_a_1e3_change_of_beta_or_lr).
TIMING_KEYS = {"step_time", "pairs_per_s", "tokens_per_s", "eta_s", "mfu"}
GOLDEN_EPS = 4 * 2.0**-23  # the relative rounding allowed to each float32 log-prob sum, per-token mean and gradient
COUNT_KEYS = {"step", "tokens", "num_valid_pairs", "num_global_pairs", "bco/reward_count", "dropped_oversized",
              "consumed_pairs", "val_batches"}  # fmt: skip
REWARD_KEYS = {"rewards/chosen", "rewards/rejected", "rewards/margin", "bco/reward_mean", "bco/reward_sum",
               "reward_shift", "reward_shift_used", "preference_loss", "bco_loss", "accuracy"}  # fmt: skip


@functools.cache
def _trace_mpo():
    """configs/tiny.toml's mpo section: the traces' β, loss weights and reward-shift momentum (the rule assumes its
    averaging flags)."""
    mpo = config_mod.load_config(ROOT / "configs" / "tiny.toml", []).mpo
    assert mpo.sft_average_log_probs and not (mpo.preference_average_log_probs or mpo.quality_average_log_probs)
    return mpo


def golden_tolerance(key: str, row: dict, s_max: float) -> float:
    """The tolerance of one traced value by the rule above: absolute, but for grad_norm and lr (relative). `row` is
    the golden row the value belongs to (its step, split, tokens, counts, sft_loss); `s_max` the trace's largest
    |logprobs/*|."""
    mpo = _trace_mpo()
    first = row["step"] == 1 and row.get("split", "train") == "train"  # policy = reference: rewards exactly 0
    if key in COUNT_KEYS or (first and key in REWARD_KEYS):
        return 0.0
    e, beta, t = GOLDEN_EPS * s_max, mpo.reference_policy_kl_penalty, row["step"]
    sft = GOLDEN_EPS * abs(row["sft_loss"])
    rewards_in_loss = 0.0 if first else mpo.preference_loss_weight * 4 * beta * e + mpo.bco_loss_weight * 8 * beta * e
    tol = {
        "logprobs/chosen": e,
        "logprobs/rejected": e,
        "rewards/chosen": 2 * beta * e,
        "rewards/rejected": 2 * beta * e,
        "bco/reward_mean": 2 * beta * e,
        "rewards/margin": 4 * beta * e,
        "preference_loss": 4 * beta * e,
        "bco_loss": 8 * beta * e,
        "bco/reward_sum": row.get("bco/reward_count", 0) * 2 * beta * e,
        "reward_shift": (1 - mpo.reward_shift_momentum**t) * 2 * beta * e,
        "reward_shift_used": (1 - mpo.reward_shift_momentum ** (t - 1)) * 2 * beta * e,
        "sft_loss": sft,
        "nll/chosen": sft,
        "loss": rewards_in_loss + mpo.sft_loss_weight * sft,
        "accuracy": 1 / row.get("num_valid_pairs", 4),
        "grad_norm": GOLDEN_EPS / 2 * math.sqrt(row.get("tokens", 0)) * abs(row.get("grad_norm", 0)),
        "lr": 1e-12 * row.get("lr", 0),
    }
    return tol[key]


def largest_logprob_sum(rows: list[dict]) -> float:
    """S_max of the tolerance rule: the largest |logprobs/chosen| or |logprobs/rejected| of `rows`."""
    return max(abs(r[k]) for r in rows for k in ("logprobs/chosen", "logprobs/rejected"))


def golden_mismatches(run, golden: dict, golden_val: dict) -> list[str]:
    """Every traced value of `run` (train rows of steps 1..6, the one validation row) outside its tolerance, as
    'step key: got (golden ± tol)'; a metric gone or new, or a count that became a float, is one entry too."""
    wrong = []
    if [set(r) - TIMING_KEYS for r in run.rows] != [set(golden) | {"split"}] * 6:
        wrong.append(f"train keys {sorted(set(run.rows[0]) - TIMING_KEYS)} != {sorted(set(golden) | {'split'})}")
        return wrong
    [val] = run.val
    if set(val) != set(golden_val) | {"split"}:
        return [f"validation keys {sorted(val)} != {sorted(set(golden_val) | {'split'})}"]
    want_rows = [{k: v[i] for k, v in golden.items()} for i in range(6)]
    s_max = largest_logprob_sum([*want_rows, golden_val])
    for got, want in [*zip(run.rows, want_rows, strict=True), (val, {**golden_val, "split": "validation"})]:
        for key in [k for k in want if k != "split"]:
            tol = golden_tolerance(key, want, s_max)
            if abs(got[key] - want[key]) > tol or type(got[key]) is not type(want[key]):
                wrong.append(f"{got['split']} step {want['step']} {key}: {got[key]!r} ({want[key]!r} ± {tol:.2g})")
    return wrong


GOLDEN_TRAIN = {  # metrics.jsonl of the README command in separate sequences, recorded 2026-12-01: key -> steps 1..6
    "step": [1, 2, 3, 4, 5, 6],
    "loss": [
        0.8317766189575195, 0.8316849917173386, 0.8319676667451859, 0.8239318430423737, 0.8099147528409958,
        0.7964173704385757,
    ],
    "preference_loss": [
        0.6931471824645996, 0.6930555105209351, 0.6933378875255585, 0.6853062957525253, 0.671313539147377,
        0.6578790247440338,
    ],
    "bco_loss": [
        1.3862943649291992, 1.3862028121948242, 1.386486679315567, 1.378434032201767, 1.3643195629119873,
        1.3505707681179047,
    ],
    "sft_loss": [
        6.935289144515991, 6.929535865783691, 6.920889496803284, 6.956742167472839, 6.918849349021912,
        6.907892823219299,
    ],
    "accuracy": [0.0, 0.5, 0.5, 1.0, 1.0, 0.75],
    "rewards/chosen": [
        0.0, 0.00029716491189901717, -0.002969741850392893, 0.008215332054533064, 0.02557086991146207,
        0.032439995382446796,
    ],
    "rewards/rejected": [
        0.0, 0.00011367798651917838, -0.0025901794724632055, -0.007584762875922024, -0.018798066244926304,
        -0.0402156850323081,
    ],
    "rewards/margin": [
        0.0, 0.00018348693629377522, -0.00037956234882585704, 0.015800095163285732, 0.04436893644742668,
        0.07265568152070045,
    ],
    "logprobs/chosen": [
        -232.21193313598633, -213.1753158569336, -224.96408462524414, -236.3661003112793, -250.8388900756836,
        -257.3639144897461,
    ],
    "logprobs/rejected": [
        -189.3702507019043, -195.02611923217773, -205.60759735107422, -218.4793930053711, -237.12194442749023,
        -241.23694610595703,
    ],
    "nll/chosen": [
        6.935289144515991, 6.929535865783691, 6.920889496803284, 6.956742167472839, 6.918849349021912,
        6.907892823219299,
    ],
    "bco/reward_mean": [
        0.0, 0.00020542145466606598, -0.0027799606905318797, 0.00031528467661701143, 0.0033864020369946957,
        -0.0038878447376191616,
    ],
    "num_valid_pairs": [4, 4, 4, 4, 4, 4],
    "reward_shift": [
        0.0, 2.0542145466606618e-06, -2.5765934504124767e-05, -2.2355428392913403e-05, 1.1732146260962718e-05,
        -2.726362257783856e-05,
    ],
    "lr": [0.0, 5e-05, 0.0001, 8.55017856687341e-05, 5.05e-05, 1.54982143312659e-05],
    "grad_norm": [
        2.864051704781807, 2.9464952436557965, 2.417524700650062, 2.2201662513410456, 2.8733358127674755,
        3.635003854363876,
    ],
    "num_global_pairs": [4, 4, 4, 4, 4, 4],
    "reward_shift_used": [
        0.0, 0.0, 2.0542145466606618e-06, -2.5765934504124767e-05, -2.2355428392913403e-05, 1.1732146260962718e-05,
    ],
    "bco/reward_sum": [
        0.0, 0.0016433716373285279, -0.022239685524255037, 0.0025222774129360914, 0.027091216295957565,
        -0.031102757900953293,
    ],
    "bco/reward_count": [8.0, 8.0, 8.0, 8.0, 8.0, 8.0],
    "tokens": [1113, 1014, 1035, 1238, 1220, 1244],
    "dropped_oversized": [0, 0, 0, 0, 0, 0],
    "consumed_pairs": [4, 8, 12, 16, 20, 24],
}
GOLDEN_VALIDATION = {  # the val_at_end row after step 6
    "step": 6,
    "loss": 0.8033683598041534,
    "preference_loss": 0.6648219078779221,
    "bco_loss": 1.357554167509079,
    "sft_loss": 6.940609335899353,
    "accuracy": 0.75,
    "rewards/chosen": 0.021422386867925525,
    "rewards/rejected": -0.036983110127039254,
    "rewards/margin": 0.058405498741194606,
    "logprobs/chosen": -234.18470764160156,
    "logprobs/rejected": -222.03285217285156,
    "nll/chosen": 6.940609335899353,
    "bco/reward_mean": -0.007780361745972186,
    "num_valid_pairs": 4,
    "val_batches": 1,
}

GOLDEN_SHARED = {  # metrics.jsonl of the README command with packing.shared_prompt=auto, recorded 2026-12-03
    "step": [1, 2, 3, 4, 5, 6],
    "loss": [
        0.8317766189575195, 0.8316849917173386, 0.8318269997835159, 0.8240531235933304, 0.8098088651895523,
        0.7965574264526367,
    ],
    "preference_loss": [
        0.6931471824645996, 0.6930555105209351, 0.6931973844766617, 0.6854272335767746, 0.6712075471878052,
        0.6580180674791336,
    ],
    "bco_loss": [
        1.3862943649291992, 1.3862028121948242, 1.3863453269004822, 1.3785566091537476, 1.364213913679123,
        1.3507147431373596,
    ],
    "sft_loss": [
        6.935289144515991, 6.929535865783691, 6.920197367668152, 6.957082152366638, 6.918976545333862,
        6.908181667327881,
    ],
    "accuracy": [0.0, 0.5, 0.5, 1.0, 1.0, 0.75],
    "rewards/chosen": [
        0.0, 0.0002969741944980342, -0.0020130157645326108, 0.007696723914705217, 0.025264549534767866,
        0.031932450947351754,
    ],
    "rewards/rejected": [
        0.0, 0.0001134872691181954, -0.0019136429182253778, -0.007859802222810686, -0.019310760631924495,
        -0.04043159494176507,
    ],
    "rewards/margin": [
        0.0, 0.00018348693629377522, -9.937287541106343e-05, 0.015556526486761868, 0.044575310312211514,
        0.07236404623836279,
    ],
    "logprobs/chosen": [
        -232.21193313598633, -213.1753158569336, -224.94495010375977, -236.37648010253906, -250.8450164794922,
        -257.3740653991699,
    ],
    "logprobs/rejected": [
        -189.37025833129883, -195.02611923217773, -205.59406661987305, -218.48489379882812, -237.1322021484375,
        -241.24126434326172,
    ],
    "nll/chosen": [
        6.935289144515991, 6.929535865783691, 6.920197367668152, 6.957082152366638, 6.918976545333862,
        6.908181667327881,
    ],
    "bco/reward_mean": [
        0.0, 0.000205230737265083, -0.001963329326827079, -8.153909584507346e-05, 0.0029768943786621094,
        -0.004249571822583675,
    ],
    "num_valid_pairs": [4, 4, 4, 4, 4, 4],
    "reward_shift_used": [
        0.0, 0.0, 2.052307372650832e-06, -1.7601508969346486e-05, -1.8240884838103756e-05, 1.1710467796898401e-05,
    ],
    "lr": [0.0, 5e-05, 0.0001, 8.55017856687341e-05, 5.05e-05, 1.54982143312659e-05],
    "grad_norm": [
        2.8640513718009566, 2.9464954054877714, 2.419163225543599, 2.2205979079900366, 2.8796331142810137,
        3.631212895477922,
    ],
    "num_global_pairs": [4, 4, 4, 4, 4, 4],
    "reward_shift": [
        0.0, 2.052307372650832e-06, -1.7601508969346486e-05, -1.8240884838103756e-05, 1.1710467796898401e-05,
        -3.090235510690738e-05,
    ],
    "bco/reward_sum": [
        0.0, 0.001641845898120664, -0.015706634614616632, -0.0006523127667605877, 0.023815155029296875,
        -0.0339965745806694,
    ],
    "bco/reward_count": [8.0, 8.0, 8.0, 8.0, 8.0, 8.0],
    "tokens": [686, 633, 650, 758, 759, 774],
    "dropped_oversized": [0, 0, 0, 0, 0, 0],
    "consumed_pairs": [4, 8, 12, 16, 20, 24],
}
GOLDEN_SHARED_VALIDATION = {  # its val_at_end row after step 6
    "step": 6,
    "loss": 0.803458571434021,
    "preference_loss": 0.6649062037467957,
    "bco_loss": 1.3576678931713104,
    "sft_loss": 6.9406750202178955,
    "accuracy": 0.75,
    "rewards/chosen": 0.020480728417169303,
    "rewards/rejected": -0.037677001440897584,
    "rewards/margin": 0.05815772991627455,
    "logprobs/chosen": -234.20354843139648,
    "logprobs/rejected": -222.0467300415039,
    "nll/chosen": 6.9406750202178955,
    "bco/reward_mean": -0.00859813648276031,
    "num_valid_pairs": 4,
    "val_batches": 1,
}


def test_golden_trace_of_the_readme_command(readme):
    assert "; pairs: separate sequences\n" in readme.out
    assert golden_mismatches(readme, GOLDEN_TRAIN, GOLDEN_VALIDATION) == []


def test_golden_trace_of_the_shared_prompt_format(shared):
    assert "; pairs: shared prompt (auto)\n" in shared.out  # the pair format "auto" chose, on the world line
    assert json.loads((shared.dir / "config.json").read_text())["packing"]["shared_prompt"] is True  # resolved
    assert golden_mismatches(shared, GOLDEN_SHARED, GOLDEN_SHARED_VALIDATION) == []


def _other_kernel_sets() -> dict[str, dict[str, str]]:
    """Environments in which this CPU runs the README command with other kernels than its best (which the readme
    fixture uses, one thread per rank as torchrun sets it): ATen's, MKL's and oneDNN's ISA lowered to the portable
    baseline with two threads per rank, and to AVX2 where the CPU has AVX-512 (an AVX2-only CPU, e.g. AMD Zen 2/3)."""
    sets = {"default-2threads": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                                 "ONEDNN_MAX_CPU_ISA": "SSE41", "OMP_NUM_THREADS": "2"}}  # fmt: skip
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        sets["avx2"] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    return sets


@pytest.mark.slow
@pytest.mark.parametrize("kernels", sorted(_other_kernel_sets()))
def test_golden_trace_holds_under_another_cpu_kernel_set(train_run, tmp_path, kernels):
    """The bounds are the rule's, not one machine's: the README command keeps its trace when the CPU's kernels change
    (the machine's own kernel set is test_golden_trace_of_the_readme_command)."""
    env = _other_kernel_sets()[kernels]
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env={**os.environ, **env}, capture_output=True, text=True, check=True)  # fmt: skip
    assert probe.stdout.split()[-1] == env["ATEN_CPU_CAPABILITY"].upper()  # torch takes the setting
    train_run(2, tmp_path, extra_env=env)
    run = SimpleNamespace(rows=_rows(tmp_path), val=_rows(tmp_path, "validation"))
    assert golden_mismatches(run, GOLDEN_TRAIN, GOLDEN_VALIDATION) == []


@pytest.mark.slow
@pytest.mark.parametrize("change", ["mpo.reference_policy_kl_penalty=0.05005", "optimizer.lr=1.001e-4"])
def test_the_golden_trace_catches_a_1e3_change_of_beta_or_lr(train_run, tmp_path, change):
    """β or the peak lr 1.001 times the trace's: the trace fails beyond the schedule's own `lr` key. β moves step 1's
    grad_norm (the MPO gradient is proportional to β while policy = reference) and the later rewards; the lr moves the
    log-prob sums and rewards from step 4 on."""
    train_run(2, tmp_path, change)
    run = SimpleNamespace(rows=_rows(tmp_path), val=_rows(tmp_path, "validation"))
    wrong = [w for w in golden_mismatches(run, GOLDEN_TRAIN, GOLDEN_VALIDATION) if " lr: " not in w]
    assert any(" rewards/margin: " in w for w in wrong), wrong
    if change.startswith("mpo."):
        assert any(w.startswith("train step 1 grad_norm: ") for w in wrong), wrong
    else:
        assert any(" logprobs/chosen: " in w for w in wrong), wrong


def test_step_one_is_the_same_in_both_formats_with_fewer_tokens(readme, shared):
    """The shared-prompt format's step-1 check on the main job: policy = reference, so every loss term is the closed
    form in either format and the log-prob sums agree to fp32 rounding; the shared format computes each prompt once."""
    shared, sep = shared.rows[0], readme.rows[0]
    assert shared["preference_loss"] == pytest.approx(math.log(2), abs=2**-24)  # ln 2 in float32: one ulp
    assert shared["bco_loss"] == pytest.approx(2 * math.log(2), abs=2**-23)
    s_max = largest_logprob_sum([sep])
    for key in set(sep) - TIMING_KEYS - {"split", "tokens"}:  # two summation orders: the golden traces' rule
        assert shared[key] == pytest.approx(sep[key], rel=0, abs=golden_tolerance(key, sep, s_max)), key
    assert shared["tokens"] == GOLDEN_SHARED["tokens"][0] < sep["tokens"] == GOLDEN_TRAIN["tokens"][0]


def test_both_formats_train_alike_without_the_expert_bias_update(bias_off):
    """With model.moe_router_bias_update_rate = 0 the routers' statistics steer nothing, so the two formats are the
    same computation up to fp32 summation order for all 6 steps and validation (the golden traces' tolerance rule);
    with the update on they part from step 2 (the golden traces)."""
    (shared, shared_val), (sep, sep_val) = bias_off["true"], bias_off["false"]
    assert len(shared) == len(sep) == 6 and len(shared_val) == len(sep_val) == 1
    s_max = largest_logprob_sum(sep + sep_val)
    for a, b in zip(shared + shared_val, sep + sep_val, strict=True):
        assert set(a) == set(b)
        for key in set(a) - TIMING_KEYS - {"split", "tokens"}:
            tol = golden_tolerance(key, b, s_max)
            assert a[key] == pytest.approx(b[key], rel=0, abs=tol), (a["step"], a["split"], key)
        if a["split"] == "train":
            assert a["tokens"] < b["tokens"]


# ----------------------------------------------------------------------------------------------------------------------
# Resume


def test_segment_stop_saves_and_exits(segments):
    assert segments.after_first == [".lock", "config.json", "metrics.jsonl", "step_2"]
    assert "stopped after step 2 (stop_after_step)" in segments.first
    assert "resumed from" in segments.second and "step_2" in segments.second  # not the killed step_5.tmp
    assert sorted(p.name for p in segments.dir.glob("step_*")) == ["step_2", "step_4"]  # step_5.tmp removed at start
    assert f"checkpoint: removed 1 unfinished save(s) of an earlier run in {segments.dir}: step_5.tmp" in segments.err


def test_exact_resume_matches_uninterrupted_run(readme, segments):
    assert [r["step"] for r in segments.rows] == [1, 2, 3, 4]  # the dead segment's step-3 line was dropped
    keys = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift",
            "reward_shift_used", "lr", "grad_norm", "bco/reward_sum", "consumed_pairs")  # fmt: skip
    for a, b in zip(readme.rows[:4], segments.rows, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    # final weights, fp32 main params and Adam moments at step 4: bit for bit (a reset Adam step would differ here)
    straight, resumed = _loaded_state(readme.dir / "step_4"), _loaded_state(segments.dir / "step_4")
    assert [k for k, _ in straight] == [k for k, _ in resumed]
    assert (
        sum(k.endswith("exp_avg_sq") for k, _ in straight) > 10 and sum(k.startswith("param") for k, _ in straight) > 10
    )
    for (k, a), (_, b) in zip(straight, resumed, strict=True):
        assert torch.equal(a, b), k
    assert {float(v) for k, v in straight if k.endswith(".step")} == {4.0}
    s1 = json.loads((readme.dir / "step_4" / "run_state.json").read_text())
    s2 = json.loads((segments.dir / "step_4" / "run_state.json").read_text())
    for k in ("reward_shift", "reward_shift_num_updates", "consumed_pairs", "sampler", "scheduler", "model_files"):
        assert s1[k] == s2[k], k  # model_files: the hub snapshot and the local folder are one model


def test_hub_id_run_prints_and_records_its_snapshot(segments, hub_cache):
    """The segments ran with model.hf_path = HUB_ID from the hub cache, offline: each start printed the snapshot once;
    config.json records the id and the commit, each checkpoint the id, the commit and the folder."""
    snap = hub_cache.resolve() / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / HUB_REVISION
    line = f"model.hf_path = {HUB_ID}: hub snapshot {HUB_REVISION} in {snap}"
    assert segments.first.count(line) == 1 and segments.second.count(line) == 1
    saved = json.loads((segments.dir / "config.json").read_text())["model"]
    assert (saved["hf_path"], saved["hf_revision"]) == (HUB_ID, HUB_REVISION)
    for step in ("step_2", "step_4"):
        state = json.loads((segments.dir / step / "run_state.json").read_text())
        assert state["model_snapshot"] == {"id": HUB_ID, "revision": HUB_REVISION, "path": str(snap)}


def test_precomputed_reference_logprobs_train_as_the_online_reference_bit_for_bit(readme, precomputed):
    """The reference pass scores the same bins (one pair each) with the same forward, so the stored
    sums are the online ones and every metric of every step, validation included, is the README run's (the golden
    trace, step 1 at w_p ln 2 + w_q 2 ln 2), across a resume after step 2; the second segment builds no reference."""
    r = precomputed.rows[0]
    assert (r["preference_loss"], r["bco_loss"], r["rewards/margin"]) == (pytest.approx(math.log(2), abs=1e-6),
                                                                          pytest.approx(2 * math.log(2), abs=1e-6), 0.0)
    assert golden_mismatches(precomputed, GOLDEN_TRAIN, GOLDEN_VALIDATION) == []
    for a, b in zip(readme.rows + readme.val, precomputed.rows + precomputed.val, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {k: v for k, v in b.items()
                                                                        if k not in TIMING_KEYS}, a["step"]
    straight, resumed = _loaded_state(readme.dir / "step_6"), _loaded_state(precomputed.dir / "step_6")
    for (k, a), (_, b) in zip(straight, resumed, strict=True):
        assert torch.equal(a, b), k
    assert "reference pass: 34 of 34 pairs to compute" in precomputed.first
    assert "stopped after step 2 (stop_after_step)" in precomputed.first
    assert "reference: the log-probs of 34 pairs are stored in" in precomputed.second
    assert "reference pass" not in precomputed.second


# ----------------------------------------------------------------------------------------------------------------------
# Learning, parallel layouts, signals


def test_loss_goes_down_with_a_higher_lr(learn):
    assert len(learn.rows) == 20
    first, last = learn.rows[0], learn.rows[-6:]
    assert sum(r["loss"] for r in last) / 6 < 0.7 * first["loss"]
    assert sum(r["accuracy"] for r in last) / 6 >= 0.9
    assert sum(r["rewards/margin"] for r in last) / 6 > 0.5


def test_tp2_and_dp2_reproduce_tp1_dp1(learn, tp2, tp1_signal):
    tp1 = tp1_signal.rows
    assert len(tp1) >= 3 and len(tp2) == 3
    s_max = largest_logprob_sum(tp1[:3])
    for step in range(3):  # other reduction orders: the golden traces' tolerance rule
        for key in ("loss", "preference_loss", "bco_loss", "sft_loss", "rewards/margin", "reward_shift"):
            tol = golden_tolerance(key, tp1[step], s_max)
            assert learn.rows[step][key] == pytest.approx(tp1[step][key], rel=0, abs=tol), (step, key, "DP=2")
            assert tp2[step][key] == pytest.approx(tp1[step][key], rel=0, abs=tol), (step, key, "TP=2")
    # the state after step 3, the routers' expert bias (a buffer) included: DP = 2 as DP = 1
    _assert_same_state(_loaded_state(tp1_signal.dir / "step_3", *LEARN), _loaded_state(learn.dir / "step_3", *LEARN),
                       "DP=2", atol=PARAM_ATOL_AFTER_3_STEPS)


def test_the_reference_pass_runs_on_the_training_layout(train_run, tmp_path, tp2):
    """TP = 2 with sequence parallelism: the pass scores the step's bins on both TP ranks, TP rank 0 alone writes
    them, and the 3 steps are the online run's bit for bit."""
    train_run(2, tmp_path, *TP2, "reference.logprobs=precomputed")
    for a, b in zip(tp2, _rows(tmp_path), strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {k: v for k, v in b.items()
                                                                        if k not in TIMING_KEYS}, a["step"]
    assert sorted(p.name for p in (tmp_path / "reference_logprobs").iterdir()) == [
        ".lock", "manifest.json", "rank00000-000000.shard"]  # .lock: the store's owner (reference_logprobs)


def _assert_same_state(a: list, b: list, what: str, atol: float = 1e-7) -> None:
    """Parameters and optimizer state to float tolerance (other reduction orders), the expert bias exactly (a sum of
    ±rate steps decided by integer token counts)."""
    assert [k for k, _ in a] == [k for k, _ in b]
    assert sum(k.startswith("buffer") for k, _ in a) == 2
    for (k, x), (_, y) in zip(a, b, strict=True):
        if k.startswith("buffer"):
            assert torch.equal(x, y), (what, k, x.tolist(), y.tolist())
        else:
            assert torch.allclose(x, y, rtol=1e-4, atol=atol), (what, k, (x - y).abs().max().item())


def test_padding_multiple_and_dp2_give_the_same_state_buffers_included(padding):
    """Padding takes no part in routing statistics, so the padding multiple (8 vs 64) and the DP layout
    change neither the losses nor the weights nor the routers' expert bias (before: step 2 differed, and the exported
    e_score_correction_bias differed in sign for one expert)."""
    ref = padding["pad8"]
    assert len(ref.rows) == 2 and ref.rows[0]["lr"] == 0.0 and ref.rows[1]["lr"] > 0
    ref_state = _loaded_state(ref.dir / "step_2", *SHORT)
    assert any(k.startswith("buffer") and v.abs().max() > 0 for k, v in ref_state)  # the bias did move
    s_max = largest_logprob_sum(ref.rows)
    for name in ("pad64", "dp2"):
        run = padding[name]
        for a, b in zip(ref.rows, run.rows, strict=True):
            # other summation orders: the golden traces' rule (before: 4e-4 and 3e-3 apart at step 2)
            for key in ("loss", "preference_loss", "bco_loss", "grad_norm", "rewards/margin"):
                tol = golden_tolerance(key, a, s_max)
                assert a[key] == pytest.approx(b[key], rel=0, abs=tol), (name, a["step"], key)
        assert [r["num_global_pairs"] for r in run.rows] == [4, 4]
        # one Adam step at lr 1e-4 (PARAM_ATOL_AFTER_3_STEPS says why 1% of the lr)
        _assert_same_state(ref_state, _loaded_state(run.dir / "step_2", *SHORT), name, atol=1e-6)


def test_lr_zero_and_bias_rate_zero_keep_the_policy_equal_to_the_reference(frozen):
    """With optimizer.lr = 0 and model.moe_router_bias_update_rate = 0 nothing moves the policy: the
    margin stays exactly 0 and the losses stay ln 2 / 2 ln 2 for every step (before: the expert bias moved at lr 0)."""
    assert len(frozen.rows) == 7
    for r in frozen.rows:
        assert r["rewards/margin"] == 0.0 and r["accuracy"] == 0.0, r["step"]
        assert r["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_a_step_straddling_the_epoch_boundary_trains_four_distinct_pairs(frozen):
    """27 pairs, 4 per step: step 7 ends epoch 0 and starts epoch 1, whose first pair is already in the
    step; the sampler defers it, so every step trains 4 pairs and consumed_pairs counts exactly what was trained
    (before: step 7 trained 3 pairs beside a dummy bin while consumed_pairs added 4)."""
    assert [r["num_global_pairs"] for r in frozen.rows] == [4] * 7
    assert [r["consumed_pairs"] for r in frozen.rows] == [4 * k for k in range(1, 8)]
    assert [r["bco/reward_count"] for r in frozen.rows] == [8.0] * 7  # chosen + rejected of 4 real pairs
    state = json.loads((frozen.dir / "step_7" / "run_state.json").read_text())
    assert state["consumed_pairs"] == 28 and state["sampler"]["epoch"] == 1 and len(state["sampler"]["deferred"]) == 1


def test_sigusr1_finishes_the_step_saves_and_exits_zero(tp1_signal):
    assert tp1_signal.rc == 0, tp1_signal.err[-4000:]
    last = tp1_signal.rows[-1]["step"]
    assert 3 <= last < 20
    assert f"stopped after step {last} (signal)" in tp1_signal.out
    # the signal's save, beside the periodic step_3 (checkpoint.save_period=3)
    assert sorted(p.name for p in tp1_signal.dir.glob("step_*")) == sorted({"step_3", f"step_{last}"})


def _start_tiny(torchrun, env, run_dir: Path, *overrides: str, console: int | None = None):
    """torchrun on 2 ranks, 20 steps of configs/tiny.toml (no validation), unbuffered; its output in pipes, or on the
    terminal `console` (a pseudo-terminal's file descriptor)."""
    args = ("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", "mpo.max_num_steps=20",
            "mpo.val_at_end=false", *overrides)  # fmt: skip
    extra = {"HF_DATASETS_CACHE": env["HF_DATASETS_CACHE"], "PYTHONUNBUFFERED": "1",
             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}  # fmt: skip  # 30 s may not do on a loaded CI machine
    if console is None:
        return torchrun.start(*args, env=extra)
    return subprocess.Popen(torchrun.argv(*args), cwd=ROOT, env=torchrun.env(extra), stdout=console, stderr=console,
                            start_new_session=True)  # fmt: skip


def _after_step(proc, run_dir: Path, step: int, terminal: int | None = None) -> None:
    """Wait until `step` is in metrics.jsonl (or the launch ended), reading what comes to `terminal` (a pseudo-terminal
    master: unread, it would fill and block the ranks)."""
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        if terminal is not None and select.select([terminal], [], [], 0.2)[0]:
            os.read(terminal, 1 << 16)
        else:
            time.sleep(0.2)


@pytest.mark.parametrize("sig, when, workers", [(signal.SIGTERM, "step 2", 2), (signal.SIGHUP, "terminal closed", 1),
                                                (signal.SIGHUP, "pipe closed", 1),
                                                (signal.SIGTERM, "start", 1)])  # fmt: skip
def test_a_stop_signal_to_torchrun_with_data_workers_saves_the_step(torchrun, env, tmp_path, sig, when, workers):
    """torchrun forwards SIGTERM / SIGHUP to each rank's whole process group, DataLoader workers
    included; SIGTERM killed the workers and the ranks crashed in their step (nothing saved), SIGHUP killed the ranks
    at once. Now the ranks finish the step, save it and exit 0; before the first step: one step and its save. The
    SIGHUP cases are a closed terminal (the run's console is a pseudo-terminal) and a closed pipe (`| tee`, which the
    same hang-up ends), closed two steps before the signal: rank 0's step lines meet EIO / EPIPE first."""
    run_dir, terminal, console = tmp_path / "run", None, None
    if when == "terminal closed":
        terminal, console = os.openpty()
    proc = _start_tiny(torchrun, env, run_dir, f"data.num_workers={workers}", console=console)
    if when == "start":  # the models are built: the next thing is the first step
        while (line := proc.stdout.readline()) and not line.startswith("config: "):
            pass
    else:
        _after_step(proc, run_dir, 2, terminal)
    if when == "terminal closed":
        os.close(console)
        os.close(terminal)
    elif when == "pipe closed":
        proc.stdout.close()
        proc.stderr.close()
    if sig == signal.SIGHUP:
        _after_step(proc, run_dir, 4)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300) if sig != signal.SIGHUP else (None, None)
    proc.wait(timeout=300)
    last = _rows(run_dir)[-1]["step"]
    assert last == 1 if when == "start" else (4 if sig == signal.SIGHUP else 2) <= last < 20
    assert sorted(p.name for p in run_dir.glob("step_*")) == [f"step_{last}"], err and err[-3000:]
    assert json.loads((run_dir / f"step_{last}" / "run_state.json").read_text())["step"] == last
    assert proc.returncode == 1  # torchrun's, after its SignalException report; the ranks exit 0
    if out is not None:
        assert f"stopped after step {last} (signal)" in out and "SignalException" in err
        assert "killed by signal" not in err and 'train.py", line' not in err


def test_a_killed_rank_leaves_one_line_on_the_other(torchrun, env, tmp_path):
    """After `kill -9` of one rank the other printed a full gloo traceback (from its gradient reduction);
    now one line naming the error."""
    import psutil

    run_dir = tmp_path / "run"
    proc = _start_tiny(torchrun, env, run_dir, "data.num_workers=1")
    _after_step(proc, run_dir, 2)
    ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
    ranks[1].kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and 'train.py", line' not in err and "[rank0]:" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0: RuntimeError: "), errors


# ----------------------------------------------------------------------------------------------------------------------
# Export


def test_export_reloads_in_transformers_with_our_logits(readme, env, tmp_path):
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "hf_export.py", str(readme.dir), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for name in ("config.json", "tokenizer.json", "processor_config.json", "model.safetensors.index.json"):
        assert (out / name).is_file(), name

    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3

    import checkpoint
    import omni_model

    distributed.init_distributed()
    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml")
    ours = omni_model.build_model(ROOT / cfg.model.hf_path, cfg.model, cfg.parallel)
    checkpoint.load(readme.dir / "step_6", ours)
    ours.eval()
    ids = torch.randint(32, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    exported = NemotronH_Omni_Reasoning_V3.from_pretrained(out).eval()
    original = NemotronH_Omni_Reasoning_V3.from_pretrained(ROOT / cfg.model.hf_path).eval()
    with torch.no_grad():
        mine = ours({"input_ids": ids})
        theirs = exported.language_model(input_ids=ids).logits[0]
        before = original.language_model(input_ids=ids).logits[0]
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert (before - theirs).abs().max().item() > 1e-4  # training changed the weights: the check is not vacuous


def test_export_of_a_hub_id_run_is_the_export_of_the_local_folder_run(readme, segments, hub_cache, env, tmp_path):
    """hf_export.py of step 4 of the hub-id run (its base from the hub cache, offline) writes byte for byte what the
    export of step 4 of the README run (the local folder) writes, and records the id and its commit."""
    import checkpoint

    for name, step, extra in (("hub", segments.dir / "step_4", {"HF_HUB_CACHE": str(hub_cache)}),
                              ("local", readme.dir / "step_4", {})):
        proc = subprocess.run([sys.executable, "hf_export.py", str(step), str(tmp_path / name)], cwd=ROOT,
                              env={**env, **extra}, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    files = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name != checkpoint.EXPORT_INFO_FILE)
    assert "model.safetensors" in files
    assert sorted(p.name for p in (tmp_path / "hub").iterdir() if p.name != checkpoint.EXPORT_INFO_FILE) == files
    for name in files:
        assert (tmp_path / "hub" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    info = json.loads((tmp_path / "hub" / checkpoint.EXPORT_INFO_FILE).read_text())
    assert (info["model.hf_path"], info["model_snapshot"]["revision"]) == (HUB_ID, HUB_REVISION)


def test_wandb_offline_keeps_run_id_and_never_writes_the_api_key(tmp_path, monkeypatch):
    secret = "sk-test-0123456789abcdef-not-a-real-key"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "omni-mpo-test")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}", "logging.wandb=offline"])
    log = monitor.MetricsLog(cfg, None, resumed_step=0, rank=0)
    run_id = log.run_id
    assert run_id and log.run.project == "omni-mpo-test"
    log.log(1, {"loss": 0.5})
    log.finish()
    again = monitor.MetricsLog(cfg, run_id, resumed_step=1, rank=0)  # a resumed segment continues the same run
    assert again.run_id == run_id
    again.log(2, {"loss": 0.25})
    again.finish()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("wandb" in str(p) for p in files)
    for p in files:
        assert secret.encode() not in p.read_bytes(), p


# ----------------------------------------------------------------------------------------------------------------------
# The device rule (train.py's docstring), in process: every tensor of a step on the step's device


def _count_pairs_with_host_copies(batches, ctx):  # the pair count as it was when it failed on a GPU
    import mpo_loss
    import pack

    local = 0
    for b in batches:
        seq_ids = pack.token_sequence_ids(b.cu_seqlens_padded, b.input_ids.shape[1]).cpu()
        num_response_tokens = mpo_loss.sequence_sums(b.loss_mask[0].long().cpu(), seq_ids, b.num_sequences)
        local += mpo_loss.count_valid_pairs(num_response_tokens, b.pair_index, b.is_chosen, b.sample_mask)
    return local


def test_train_step_keeps_one_device(monkeypatch, tmp_path):
    from step_cases import DeviceAudit, tiny_step

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))  # the sample's index cache
    # separate sequences: the pair format of the first GPU run (the shared format's audit:
    # tests/test_shared_prompt_model.py)
    s = tiny_step("cpu", "packing.shared_prompt=false")
    audit = DeviceAudit("cpu", host=s["batches"])
    with audit:
        metrics, shift = s["run"](s["batches"], 0.0)
    assert audit.calls > 1000  # the audit saw the step's project code
    assert audit.violations == []
    # the step reads the device twice - the pair count before the first forward (the loss's denominator) and the
    # metrics once after the update (the finiteness check is a device-side assertion) - plus, with the CPU's Mamba
    # set (mamba_torch), its seq_idx check and conv correction; the GPU's `mamba triton` set reads nothing (its conv
    # offsets come from the batch's host copy: tests/test_mamba_triton.py)
    sites = sorted({re.sub(r":\d+ ", " ", r) for r in audit.reads})
    assert sites == ["mamba_torch.py _check_seq_idx: TensorBase.__bool__",
                     "mamba_torch.py causal_conv1d_fn: TensorBase.nonzero",
                     "mpo_loss.py count_global_pairs: TensorBase.item",
                     "mpo_loss.py reduce_metrics: TensorBase.tolist"], sites
    assert sum(not r.startswith("mamba_torch.py") for r in audit.reads) == 2
    # golden numbers: identical policy and reference
    assert metrics["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["bco_loss"] == pytest.approx(2 * math.log(2), abs=1e-6)
    # the audit flags the count that broke the first GPU run (a `.cpu()` of the loss mask and sequence ids)
    old = DeviceAudit("cpu", extra_files=[__file__])
    with old:
        n_old = _count_pairs_with_host_copies(s["batches"], s["ctx"])
    assert n_old == mpo_loss.count_global_pairs(s["batches"], s["ctx"]) == 4
    assert any("_count_pairs_with_host_copies: Tensor.cpu moves a tensor off cpu" in v for v in old.violations), \
        old.violations
    # ... and a blocking copy of host data to the step's device, and a comparison read on the host, as reads
    copies = DeviceAudit("cpu", extra_files=[__file__])
    with copies:
        _copy_and_compare(torch.device("cpu"))
    assert [re.sub(r":\d+ ", " ", r) for r in copies.reads] == [
        "test_train.py _copy_and_compare: _VariableFunctionsClass.tensor",
        "test_train.py _copy_and_compare: _VariableFunctionsClass.equal"], copies.reads
    # a blocking Tensor.to of host data onto the step's device (the meta device stands in for a GPU here)
    moves = DeviceAudit("meta", extra_files=[__file__], host=s["batches"])
    with moves:
        _move(s["batches"][0].host.cu_seqlens, torch.device("meta"))
    assert [re.sub(r":\d+ ", " ", r) for r in moves.reads] == ["test_train.py _move: TensorBase.to"], moves.reads


def _move(host: torch.Tensor, device: torch.device) -> None:
    host.to(device, non_blocking=True)  # from pinned memory on a GPU (pack.to_device): not a read
    host.to(device)  # a blocking copy: a read
    host.to(torch.device("cpu"))  # host to host


def _copy_and_compare(device: torch.device) -> bool:
    offsets = torch.tensor([0, 3, 5], device=device)  # a copy: waits for the device on a GPU
    host = torch.tensor([0, 3, 5], device="cpu")  # host code: not a read
    return torch.equal(offsets, offsets + 0) and bool(host[0] == 0)


# ----------------------------------------------------------------------------------------------------------------------
# Runs that stop on an error mid-way


def test_a_pair_that_fails_mid_run_stops_every_rank_in_one_line_and_keeps_the_finished_steps(
        train_run, env, tmp_path, monkeypatch):
    """An image emptied after the index was built, loaded at step 3 by one DP rank: that rank raised its DataError
    alone, rank 1 died in a gloo "Connection closed by peer" traceback (and when the bad pair was rank 1's, global
    rank 0 printed no error line at all), and steps 1-2 were lost. Now every rank raises the same DataError before
    step 3, after saving step 2. With a DataLoader worker torchrun's SIGTERM to the other rank killed its
    worker: a DataLoader traceback after the line."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "mmpr_sample", data)
    meta = data / "MMPR-sample" / "meta.json"
    over = [f"model.hf_path={ROOT / 'assets' / 'tiny-omni'}", f"data.train.data_path={meta}", "mpo.max_num_steps=6",
            "mpo.val_at_end=false", "data.num_workers=1"]  # fmt: skip
    # the pairs of step 3 as train.py samples them (the index built here is the one the run then loads from cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", env["HF_DATASETS_CACHE"])
    from step_cases import tiny_config  # the layout, hence the plans, of the run launched below

    cfg = tiny_config(*over)
    d = train.load_data(cfg, train.omni_model.read_hf_config(cfg.model.hf_path), rank=1)
    gbs = cfg.policy.train_global_batch_size
    seen = {p for _ in range(2) for p in d.sampler.take(gbs)}  # steps 1 and 2
    ix = d.train_split.index
    path_ids = lambda p: {int(ix.image_path_id[j]) for j in range(int(ix.image_start[p]),  # noqa: E731
                                                                   int(ix.image_start[p] + ix.num_images[p]))}
    used_before = set().union(*(path_ids(p) for p in seen))
    bad = next(i for p in d.sampler.take(gbs) for i in sorted(path_ids(p)) if i not in used_before)
    Path(ix.image_paths[bad]).write_bytes(b"")  # emptied after the index was built
    run = tmp_path / "run"
    proc = train_run(2, run, *over, check=False)
    assert proc.returncode == 1 and "Connection closed" not in proc.stderr
    assert 'train.py", line' not in proc.stderr  # no rank's traceback (torchrun's own report has one)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: DataError: ") and "image_unreadable" in errors[0], errors
    assert "step 3" in errors[0] and errors[0].endswith(f"{run / 'step_2'})"), errors  # the step and the checkpoint
    assert [r["step"] for r in _rows(run)] == [1, 2] and sorted(p.name for p in run.glob("step_*")) == ["step_2"]


def test_a_diverging_run_stops_before_the_update_in_one_line(train_run, tmp_path):
    """optimizer.lr = 100: step 4's gradients were NaN, megatron's Adam put them into the weights, metrics.jsonl got
    `"grad_norm": NaN` (not JSON), and step 5 died in a ValueError traceback of the reward-shift update on every rank.
    Now the step whose loss or gradients are not finite stops the run before its update, in one line."""
    run = tmp_path / "run"
    proc = train_run(2, run, "mpo.max_num_steps=10", "optimizer.lr=100", "checkpoint.save_period=2", check=False)
    assert proc.returncode == 1 and 'train.py", line' not in proc.stderr  # no rank's traceback
    rows = _rows(run)  # the finite steps (3 on the machines seen; where it diverges is the machine's rounding)
    assert len(rows) >= 2 and all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert "NaN" not in (run / "metrics.jsonl").read_text() and "Infinity" not in (run / "metrics.jsonl").read_text()
    saved = run / f"step_{2 * (len(rows) // 2)}"
    assert sorted(p.name for p in run.glob("step_*")) == [saved.name]  # step_N of save_period 2, no later write
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: DivergedError: step {len(rows) + 1}: "), errors
    assert f"{saved}" in errors[0], errors  # the latest checkpoint
    assert "optimizer.lr" in errors[0], errors  # the key to change
