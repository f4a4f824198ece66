"""Tests of reference_logprobs.py in process: the shards (round trip, a truncated or changed one refused), the
manifest (a changed setting named), the config rules, MFU's 6·N, and the reference pass on the tiny model in a world of
one: stopped after its first round and continued without computing a pair twice, a damaged shard computed again, the
stored values equal to the online forward's bit for bit, and validation reading them; `python train.py` stopped by
SIGTERM during the pass and started again. The tiny run in both modes, with a resume, is in tests/test_train.py.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import raises_naming

import config as config_mod
import monitor
import reference_logprobs as rl

ROOT = Path(__file__).resolve().parents[1]


def _values(pairs: list[int], offset: float = 0.0) -> dict:
    n = len(pairs)
    return {"k": {"pair_ids": torch.tensor(pairs), "sums": -torch.arange(2.0 * n).reshape(n, 2).double() - offset,
                  "tokens": torch.arange(2 * n).reshape(n, 2) + 1, "media": torch.zeros(n, dtype=torch.int64)}}


def test_a_shard_reads_back_whole_or_is_refused(tmp_path):
    good, short, changed, junk, untorch = (tmp_path / f"{n}.shard" for n in ("good", "short", "changed", "junk",
                                                                             "untorch"))
    rl.write_shard(good, _values([3, 1]))
    got = rl.read_shard(good)
    assert all(torch.equal(got["k"][f], _values([3, 1])["k"][f]) for f in ("pair_ids", "sums", "tokens", "media"))
    data = good.read_bytes()
    short.write_bytes(data[:-5])
    changed.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    junk.write_bytes(b"not a shard")
    payload = b"a checksum of its own, no torch file"  # a header that fits, a payload torch.load cannot read
    header = {"format": rl.FORMAT, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    untorch.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    for path, why in ((short, "truncated"), (changed, "checksum"), (junk, "shard header"), (untorch, "torch")):
        with raises_naming(rl.ShardError, why):  # the check that failed
            rl.read_shard(path)
    table = {"k": rl._Table.empty(4)}
    damaged = rl.load_shards(tmp_path, table)
    assert sorted(p.name for p, _ in damaged) == ["changed.shard", "junk.shard", "short.shard", "untorch.shard"]
    assert table["k"].missing([0, 1, 2, 3]) == [0, 2]  # only the good shard was read
    assert table["k"].sums[3].tolist() == [-0.0, -1.0] and table["k"].tokens[1].tolist() == [3, 4]
    assert not list(tmp_path.glob(".*.tmp"))  # written under a temporary name, then renamed


def test_the_manifest_is_written_once_and_names_what_differs(tmp_path):
    ident = {"model.hf_path files": "abc", "model.params_dtype": "float32", "data index of data.train.data_path": "f1"}
    folder = tmp_path / rl.FOLDER
    assert rl.check_manifest(folder, ident, {}) is None and (folder / rl.MANIFEST).is_file()
    assert rl.check_manifest(folder, ident, {}) is None
    refused = rl.check_manifest(folder, {**ident, "model.params_dtype": "bfloat16"}, {})
    assert "model.params_dtype 'float32' -> 'bfloat16'" in refused and "files" not in refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "rank00000-000000.shard").write_bytes(b"x")
    assert rl.MANIFEST in rl.check_manifest(other, ident, {})  # shards of unknown origin are not adopted
    (folder / rl.MANIFEST).write_text(json.dumps({"format": rl.FORMAT + 1, "identity": ident}))
    assert f"format {rl.FORMAT + 1}" in rl.check_manifest(folder, ident, {})  # a newer version's store: said so
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert str(a_file) in rl.check_manifest(a_file, ident, {})  # no FileExistsError


@pytest.mark.parametrize("overrides, key", [
    (["reference.logprobs=precomputed", "reference.offload=true"], "reference.offload"),
    (["reference.max_tokens_per_bin=1024"], "reference.max_tokens_per_bin"),  # tiny.toml's bins: 2048 tokens
])  # fmt: skip
def test_reference_settings_are_checked_at_load(overrides, key):
    with raises_naming(config_mod.ConfigError, f"{key} = "):
        config_mod.load_config(ROOT / "configs" / "tiny.toml", overrides)
    config_mod.load_config(ROOT / "configs" / "tiny.toml", ["reference.logprobs=precomputed",
                                                            "reference.max_tokens_per_bin=4096"])  # fine


def test_mfu_counts_6n_per_token_without_the_reference_forward(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    online, stored = (monitor.mfu(1000, 1.0, 10**9, 8, reference_forward=r) for r in (True, False))
    assert online == 8e12 / (8 * 989e12) and stored == pytest.approx(online * 6 / 8, rel=1e-15)


def test_the_plan_counts_no_reference_when_its_sums_are_precomputed():
    import plan

    for mode, held in (("online", True), ("precomputed", False)):
        cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"reference.logprobs={mode}"])
        cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
        [row] = plan.make_plan(cfg).ranks
        assert (row.reference > 0) == held and row.reference_offloaded == 0 and row.reference_params > 0, mode


# ----------------------------------------------------------------------------------------------------------------------
# The reference pass on the tiny model, a world of one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny.toml's data (30 training, 4 validation pairs) with reference.logprobs = precomputed, a world of one, and a
    model of model.hf_path (what the reference is, and the policy before any step)."""
    from step_cases import tiny_config

    import distributed
    import hf_weights
    import omni_model
    import train
    from backend import kernel_selection

    cfg = tiny_config("reference.logprobs=precomputed", f"checkpoint.dir={tmp_path_factory.mktemp('run')}")
    cfg.model.hf_path = str(ROOT / cfg.model.hf_path)
    cfg.data.train.data_path = str(ROOT / cfg.data.train.data_path)
    ctx = distributed.init_distributed(cfg)
    kernels = kernel_selection.select_kernels()
    data = train.load_data(cfg, omni_model.read_hf_config(cfg.model.hf_path), rank=1)  # rank 1: no data lines
    return SimpleNamespace(cfg=cfg, ctx=ctx, kernels=kernels, data=data, model=hf_weights.build_from_hf(cfg, kernels))


class _StopAfter:
    """distributed.StopSignal's should_stop, saying stop at its `n`-th call."""

    def __init__(self, n: int | None):
        self.n, self.calls = n, 0

    def should_stop(self, device) -> bool:
        self.calls += 1
        return self.calls == self.n


@pytest.fixture
def counted(monkeypatch):
    """The pair ids each reference forward of the pass scores (dummy bins left out), in call order."""
    import mpo_loss
    import pack

    seen, forward = [], mpo_loss.forward_logprobs

    def counting(model, batch, ctx):
        seen.extend(p for p in dict.fromkeys(pack.host_view(batch).pair_index.tolist()) if p >= 0)
        return forward(model, batch, ctx)

    monkeypatch.setattr(mpo_loss, "forward_logprobs", counting)
    return seen


def test_a_stopped_pass_continues_without_computing_a_pair_twice(tiny, counted, capsys):
    folder = Path(tiny.cfg.checkpoint.dir) / rl.FOLDER
    assert rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(1)) is None  # after round 1
    first = list(counted)
    assert len(first) == tiny.cfg.policy.train_global_batch_size == 4 and len(list(folder.glob("*.shard"))) == 1
    assert "reference pass: stopped after 4 of 34 pairs (signal)" in capsys.readouterr().out
    counted.clear()
    train_stored, val_stored = rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    want = set(tiny.data.train_split.pair_ids)
    assert sorted(counted + first) == sorted(want | set(tiny.data.val_split.pair_ids))  # each pair once
    assert val_stored is train_stored  # one data index (tiny.toml splits the training data): one table
    assert not train_stored.tokens[sorted(want)].lt(1).any()

    # a damaged shard: moved aside, its pairs (and only those) computed again, the same values
    before = train_stored.sums.clone()
    shard = sorted(folder.glob("*.shard"))[0]
    shard.write_bytes(shard.read_bytes()[:-3])
    counted.clear()
    capsys.readouterr()
    train_stored, _ = rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    out = capsys.readouterr().out
    assert f"reference: {shard} is damaged (truncated: " in out and shard.with_name(shard.name + ".damaged").exists()
    assert sorted(counted) == sorted(first)
    assert torch.equal(train_stored.sums.nan_to_num(), before.nan_to_num())

    counted.clear()  # everything stored: no model, one line
    rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    assert counted == [] and "reference: the log-probs of 34 pairs are stored" in capsys.readouterr().out

    other = copy.deepcopy(tiny.cfg)
    other.data.max_seq_length = 1024  # other tokens: refused before any model is built
    with raises_naming(rl.checkpoint.CheckpointError, "data.max_seq_length 2048 -> 1024", folder) as e:
        rl.precompute(other, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    assert str(folder) in str(e.value) and "\n" not in str(e.value) and counted == []


def test_a_pair_whose_image_changed_is_computed_again_alone(tiny, counted, tmp_path, capsys):
    """An image rewritten in place (inverted, same pixel size) after the pass: the pairs reading it, and only those,
    are computed again, to the values the model gives now."""
    from PIL import Image, ImageOps

    import omni_model
    import train

    shutil.copytree(ROOT / "data" / "mmpr_sample", tmp_path / "data")
    cfg = copy.deepcopy(tiny.cfg)
    cfg.checkpoint.dir, cfg.data.train.data_path = str(tmp_path / "run"), str(tmp_path / "data/MMPR-sample/meta.json")
    cfg.mpo.val_at_end, cfg.data.train.max_samples = False, 12
    data = train.load_data(cfg, omni_model.read_hf_config(cfg.model.hf_path), rank=1)
    before, _ = rl.precompute(cfg, tiny.ctx, tiny.kernels, data, _StopAfter(None))
    index = data.train_split.index
    image = Path(index.images(data.train_split.pair_ids[0])[0])
    readers = sorted(p for p in data.train_split.pair_ids if str(image) in index.images(p))
    ImageOps.invert(Image.open(image).convert("RGB")).save(image)
    counted.clear()
    capsys.readouterr()
    after, _ = rl.precompute(cfg, tiny.ctx, tiny.kernels, data, _StopAfter(None))
    assert sorted(counted) == readers and f"{len(readers)} pairs read media files changed" in capsys.readouterr().out
    now = {}
    for pair_ids, sums, _ in rl.score(tiny.model, _bins(tiny, data.train_split, readers, data.train_set), tiny.ctx):
        now.update(zip(pair_ids.tolist(), sums, strict=True))
    for p in readers:
        assert torch.equal(after.sums[p], now[p].double()) and not torch.equal(after.sums[p], before.sums[p])
    others = sorted(set(data.train_split.pair_ids) - set(readers))
    assert torch.equal(after.sums[others], before.sums[others])


def test_a_pair_whose_video_changed_is_computed_again_alone(tiny, counted, tmp_path, capsys):
    """The image test's twin for video: a clip file replaced by another clip of the same frames and size, and one
    frame image of a frame-list video inverted, after the pass: the pairs reading either, and only those, are computed
    again, to the values the model gives now."""
    from PIL import Image, ImageOps

    import omni_model
    import train

    shutil.copytree(ROOT / "data" / "mmpr_video_sample", tmp_path / "data")
    cfg = copy.deepcopy(tiny.cfg)
    cfg.checkpoint.dir = str(tmp_path / "run")
    cfg.data.train.data_path = str(tmp_path / "data/MMPR-video-sample/meta.json")
    cfg.data.video.target_num_patches, cfg.data.train.split_validation_size, cfg.mpo.val_at_end = 24, 0, False
    data = train.load_data(cfg, omni_model.read_hf_config(cfg.model.hf_path), rank=1)
    before, _ = rl.precompute(cfg, tiny.ctx, tiny.kernels, data, _StopAfter(None))
    index, ids = data.train_split.index, data.train_split.pair_ids
    media = tmp_path / "data/MMPR-video-sample/media"
    clip, frame = media / "clips/clip_0.mp4", media / "frames/clip_2_1.png"
    readers = sorted(p for p in ids if str(clip) in index.videos(p) or str(frame) in index.videos(p))
    assert len(readers) == 3  # clip_0 in a clip row and an image + clip row; the frame in one frame list
    clip.write_bytes((media / "clips/clip_1.mp4").read_bytes())
    ImageOps.invert(Image.open(frame).convert("RGB")).save(frame)
    counted.clear()
    capsys.readouterr()
    after, _ = rl.precompute(cfg, tiny.ctx, tiny.kernels, data, _StopAfter(None))
    assert sorted(counted) == readers and f"{len(readers)} pairs read media files changed" in capsys.readouterr().out
    now = {}
    for pair_ids, sums, _ in rl.score(tiny.model, _bins(tiny, data.train_split, readers, data.train_set), tiny.ctx):
        now.update(zip(pair_ids.tolist(), sums, strict=True))
    for p in readers:
        assert torch.equal(after.sums[p], now[p].double()) and not torch.equal(after.sums[p], before.sums[p])
    others = sorted(set(ids) - set(readers))
    assert torch.equal(after.sums[others], before.sums[others])


def test_a_store_whose_pass_another_run_holds_is_refused_in_one_line(tiny, counted):
    """Two runs sharing one store (a symlink): the second start's pass waits for none and writes no shard."""
    import fcntl

    folder = Path(tiny.cfg.checkpoint.dir) / rl.FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other run's pass
    try:
        with raises_naming(rl.checkpoint.CheckpointError, folder.resolve(), "another run"):
            rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    finally:
        os.close(fd)
    assert counted == []


def test_a_full_disk_during_the_pass_is_one_line(tiny, monkeypatch, tmp_path):
    def full(path, values):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rl, "write_shard", full)
    cfg = copy.deepcopy(tiny.cfg)
    cfg.checkpoint.dir = str(tmp_path)
    with raises_naming(rl.checkpoint.CheckpointError, tmp_path / rl.FOLDER / "rank00000-000000.shard",
                       os.strerror(errno.ENOSPC)) as e:
        rl.precompute(cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(1))  # the stop writes the first round
    assert "\n" not in str(e.value)


def _bins(tiny, split, pair_ids, dataset=None):
    import pack

    plan = pack.plan_step(split.index.lengths(pair_ids), tiny.cfg.packing, 1, split.index.shared_lengths(pair_ids))
    dataset = dataset or (tiny.data.train_set if split is tiny.data.train_split else tiny.data.val_set)
    pairs = {p: dataset[p] for b in plan.ranks[0] for p in b.pair_ids}
    return pack.load_bins(plan, pairs, tiny.ctx, tiny.data.ids["image"], tiny.data.ids["pad"])


def test_stored_values_are_the_online_forwards_and_validation_reads_them(tiny):
    train_stored, val_stored = rl.precompute(tiny.cfg, tiny.ctx, tiny.kernels, tiny.data, _StopAfter(None))
    batches = _bins(tiny, tiny.data.train_split, tiny.data.train_split.pair_ids[:4])
    from step_cases import DeviceAudit

    audit = DeviceAudit("cpu", extra_files=[rl.__file__], host=[*batches, SimpleNamespace(host=train_stored)])
    with audit:  # the lookup reads host data only and makes nothing off the step's device
        looked_up = rl.sums(train_stored, batches, tiny.ctx)
    assert audit.calls > 10 and audit.violations == [] and audit.reads == [], (audit.violations, audit.reads)
    for got, want in zip(looked_up, rl.sums(tiny.model, batches, tiny.ctx), strict=True):
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)

    import pack
    import train

    pair = tiny.data.train_set[tiny.data.train_split.pair_ids[0]]  # a DP rank's dummy bin: its copy of a real pair
    dummy = pack.pack([pair], 8, tiny.data.ids["image"], tiny.data.ids["pad"], dummy=True)
    [(pair_ids, scored, _)] = rl.score(tiny.model, [dummy, batches[0]], tiny.ctx)  # the dummy scores nothing
    assert pair_ids.tolist() == [int(batches[0].pair_index[0])] and torch.equal(scored[0], looked_up[0])
    assert rl.sums(train_stored, [dummy], tiny.ctx)[0].tolist() == [0.0, 0.0]  # sample_mask 0: never in the loss

    val = tiny.data.val_split
    online = train.run_validation(tiny.model, tiny.model, val, tiny.data.val_set, tiny.ctx, 0.0, tiny.data.ids)
    assert train.run_validation(tiny.model, val_stored, val, tiny.data.val_set, tiny.ctx, 0.0, tiny.data.ids) == online
    assert online["rewards/chosen"] == 0.0 and online["preference_loss"] == pytest.approx(math.log(2), abs=1e-7)
    shifted = rl.Stored(val_stored.folder, val_stored.sums + torch.tensor([1.0, 0.0]), val_stored.tokens)
    vm = train.run_validation(tiny.model, shifted, val, tiny.data.val_set, tiny.ctx, 0.0, tiny.data.ids)
    beta = tiny.cfg.mpo.reference_policy_kl_penalty  # L_c = log π − (log π_ref + 1) = −1 on every pair
    assert vm["rewards/chosen"] == pytest.approx(-beta, rel=1e-6) and vm["rewards/rejected"] == 0.0

    wrong = rl.Stored(val_stored.folder, val_stored.sums, val_stored.tokens + 1)  # other tokens than the batch's
    import mmpr_records

    with raises_naming(mmpr_records.DataError, val_stored.folder, "response tokens"):
        rl.sums(wrong, _bins(tiny, val, val.pair_ids), tiny.ctx)


def test_a_stop_signal_during_the_pass_keeps_its_shards_and_the_next_start_continues(tmp_path):
    """SIGTERM while the reference loads (`python train.py`, one rank): the pass scores one round, writes it, exits 0
    without a step; the next start computes only the rest, then trains."""
    run_dir = tmp_path / "run"
    settings = ["reference.logprobs=precomputed", "mpo.max_num_steps=2", "scheduler.lr_warmup_steps=1",
                "mpo.val_at_end=false"]
    cmd = [sys.executable, "train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", *settings]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the data line: the reference model is built next
        if line.startswith("data: "):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "reference pass: stopped after 4 of 30 pairs (signal)" in out and "step 1/" not in out
    assert [p.name for p in (run_dir / rl.FOLDER).iterdir() if p.suffix == ".shard"] == ["rank00000-000000.shard"]
    assert not list(run_dir.glob("step_*")) and not (run_dir / "metrics.jsonl").exists()
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"reference pass: 26 of 30 pairs to compute (4 stored in {run_dir / rl.FOLDER})" in again.stdout
    assert "stopped after step 2 (max_num_steps)" in again.stdout
