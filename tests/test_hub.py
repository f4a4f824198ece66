"""model.hf_path as a hub id, without a network: model_hub.resolve_model / model_dir / hub_snapshot against a hub cache
laid out as huggingface_hub writes it (conftest.make_hub_cache), the one-line errors, the location-independent model
identity (model_hub.model_files), plan.py's and mmpr_index.py's use. Training and resuming from a hub id, and its
export: tests/test_train.py (the `segments` fixture)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import filelock
import huggingface_hub
import pytest
from conftest import HUB_ID, HUB_REVISION, make_hub_cache, raises_naming
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors

import config as config_mod
import mmpr_index
import mmpr_records
import model_hub
import plan
import preflight

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "tiny-omni"
NANO_ID = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"  # configs/nano.toml's model.hf_path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache this process resolves from (HF_HUB_OFFLINE is set by conftest); no resolution remembered."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_hub, "_snapshots", {})
    return tmp_path / "hub"


def _cfg(hf_path: str, *overrides: str):
    return config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"model.hf_path={hf_path}", *overrides])


def test_hub_id_resolves_from_the_cache_and_pins_its_commit(cache, capsys):
    snap = make_hub_cache(cache)
    cfg = _cfg(HUB_ID)
    assert model_hub.resolve_model(cfg) == model_hub.Snapshot(HUB_ID, HUB_REVISION, str(snap.resolve()))
    assert cfg.model.hf_revision == HUB_REVISION and model_hub.model_dir(cfg.model) == str(snap.resolve())
    assert model_hub.resolve_model(cfg).path == str(snap.resolve())  # once a process: printed once
    assert capsys.readouterr().out.count(f"model.hf_path = {HUB_ID}: hub snapshot {HUB_REVISION} in ") == 1
    assert preflight.read_model_config(model_hub.model_dir(cfg.model)).image_token_id  # a readable model


def test_hub_id_missing_offline_is_one_line(cache):
    make_hub_cache(cache)
    with raises_naming(config_mod.ConfigError, "model.hf_path = 'omni-mpo-test/absent'", "HF_HUB_OFFLINE=1",
                       str(cache), "hf download omni-mpo-test/absent"):  # fmt: skip
        preflight.check_inputs(_cfg("omni-mpo-test/absent"))
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", "revision v2"):  # another revision
        model_hub.resolve_model(_cfg(HUB_ID, "model.hf_revision=v2"))


def test_train_with_a_missing_hub_id_offline_is_one_line(tmp_path):
    """`python train.py configs/tiny.toml model.hf_path=<id not cached>` with HF_HUB_OFFLINE=1: exit 1, one line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    proc = subprocess.run([sys.executable, "train.py", "configs/tiny.toml", "model.hf_path=omni-mpo-test/absent",
                           f"checkpoint.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ConfigError: model.hf_path = 'omni-mpo-test/absent': ") and \
        "HF_HUB_OFFLINE=1" in lines[-1], lines[-1]


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(cache, tmp_path, monkeypatch):
    make_hub_cache(cache)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(TINY, tmp_path / HUB_ID)
    cfg = _cfg(HUB_ID)
    assert not model_hub.is_hub_id(HUB_ID) and model_hub.resolve_model(cfg) is None
    assert model_hub.model_dir(cfg.model) == HUB_ID and cfg.model.hf_revision == ""
    # a path whose first folder exists is a path: its missing folder is the local error, no hub lookup
    with raises_naming(config_mod.ConfigError, "model.hf_path = 'omni-mpo-test/other'", "no config.json"):
        preflight.check_inputs(_cfg("omni-mpo-test/other"))


def test_hub_snapshot_and_its_files_copied_are_one_model(cache, tmp_path):
    """The identity is the job's files' names, sizes and sha256 (the blob's name for an LFS file), not their place."""
    snap = make_hub_cache(cache)
    copy = tmp_path / "copy"
    shutil.copytree(snap, copy)  # symlinks followed: plain files
    (copy / "README.md").write_text("not a file the job reads")
    hashes = model_hub.model_file_hashes(snap)
    assert hashes == model_hub.model_file_hashes(copy) == model_hub.model_file_hashes(TINY)
    assert model_hub.model_files(snap) == model_hub.model_files(copy)
    assert model_hub.base_model_digest(snap) == model_hub.base_model_digest(copy)
    weights = (snap / "model.safetensors").resolve()
    assert weights.parent.name == "blobs" and model_hub.model_file_hashes(copy)["model.safetensors"] == \
        f"{weights.stat().st_size}:{weights.name}"
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")  # other content
    assert model_hub.model_files(copy) != model_hub.model_files(snap)
    assert model_hub.base_model_digest(copy) != model_hub.base_model_digest(snap)


def test_local_dir_download_records_are_the_hashes_of_unchanged_files(tmp_path):
    """`hf download --local-dir` keeps each file's etag (an LFS file's sha256): used while the file is not newer."""
    shutil.copytree(TINY, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    record = tmp_path / "m" / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    record.parent.mkdir(parents=True)
    record.write_text(f"{HUB_REVISION}\n{'f' * 64}\n{weights.stat().st_mtime + 10}\n")
    assert model_hub.content_sha256(weights) == "f" * 64
    os.utime(weights, (time.time() + 100, time.time() + 100))  # changed after the download: read
    assert model_hub.content_sha256(weights) == model_hub.content_sha256(TINY / "model.safetensors") != "f" * 64


def _raising(error: BaseException):
    def download(*args, **kwargs):
        raise error

    return download


def _hub_error(cls):  # the hub's HTTP errors carry a response this test has no use for
    e = cls.__new__(cls)
    Exception.__init__(e, "from the hub")
    return e


@pytest.mark.parametrize(("error", "names"), [
    (_hub_error(hub_errors.GatedRepoError), ["gated", "HF_TOKEN", f"https://huggingface.co/{HUB_ID}"]),
    (_hub_error(hub_errors.RepositoryNotFoundError), ["neither a local directory", "HF_TOKEN"]),
    (_hub_error(hub_errors.RevisionNotFoundError), ["model.hf_revision = 'v9'"]),
    (OSError(errno.ENOSPC, "No space left on device"), ["no space left", "HF_HUB_CACHE"]),
    (hub_errors.IncompleteSnapshotError("partial", "/cache/x"), ["no complete copy of revision v9", "hf download"]),
])  # fmt: skip
def test_hub_errors_are_one_line_naming_the_id(cache, monkeypatch, error, names):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raising(error))
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", *names) as e:
        model_hub.resolve_model(_cfg(HUB_ID, "model.hf_revision=v9"))
    assert "\n" not in str(e.value)


def test_waiting_for_another_download_times_out_in_one_line_naming_the_id(cache, monkeypatch):
    make_hub_cache(cache)
    monkeypatch.setenv(model_hub.HUB_WAIT_ENV, "0.2")
    lock = cache / ".locks" / f"omni-mpo--{HUB_ID.replace('/', '--')}.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import filelock, sys, time\nwith filelock.FileLock(sys.argv[1]):"
                               "\n    print(flush=True)\n    time.sleep(60)", str(lock)], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # the other process holds the lock
        with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", str(lock), model_hub.HUB_WAIT_ENV):
            model_hub.resolve_model(_cfg(HUB_ID))
    finally:
        holder.kill()
        holder.wait()
    with filelock.FileLock(lock, timeout=5):  # released with its holder
        pass


def test_plan_reads_a_cached_snapshot_first_then_the_shipped_config(cache, capsys):
    cfg = config_mod.load_config(ROOT / "configs" / "nano.toml")
    assert plan.plan_model_dir(cfg) == str(plan.SHIPPED_CONFIGS[NANO_ID])  # nothing cached: the shipped config
    assert "not in the hub cache" in capsys.readouterr().err
    snap = make_hub_cache(cache, ROOT / "assets" / "nano-omni-config", NANO_ID)  # a cached snapshot: used first
    assert plan.plan_model_dir(config_mod.load_config(ROOT / "configs" / "nano.toml")) == str(snap.resolve())
    tiny = make_hub_cache(cache)
    assert plan.main(["configs/tiny.toml", f"model.hf_path={HUB_ID}"]) == 0
    assert f"\nmodel {tiny.resolve()}: language model " in capsys.readouterr().out


def test_mmpr_index_model_may_be_a_hub_id(cache, capsys):
    make_hub_cache(cache)
    meta = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "meta.json"
    assert mmpr_index.main([str(meta), "--model", HUB_ID, "--max-samples", "2", "--num-workers", "0",
                            "--no-cache"]) == 0  # fmt: skip
    assert "pairs" in capsys.readouterr().out
    with raises_naming(mmpr_records.DataError, "--model = 'omni-mpo-test/absent'", "HF_HUB_OFFLINE=1"):
        mmpr_index.main([str(meta), "--model", "omni-mpo-test/absent"])


def test_ranks_that_resolved_other_commits_stop_in_one_line(monkeypatch):
    """Nodes resolve a hub id apart: a branch that moved between them is refused on every rank (train.py)."""
    import train

    other = "f" * 40
    monkeypatch.setattr(train.dist, "all_gather_object", lambda out, value: out.__setitem__(slice(None),
                                                                                          [value, other]))
    cfg = _cfg(HUB_ID, f"model.hf_revision={HUB_REVISION}")
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", HUB_REVISION, other,
                       "model.hf_revision"):  # fmt: skip
        train.check_one_model_revision(cfg, 2)
    monkeypatch.setattr(train.dist, "all_gather_object", lambda out, value: out.__setitem__(slice(None),
                                                                                          [value, value]))
    train.check_one_model_revision(cfg, 2)  # one commit: nothing said


def test_local_rank_0_resolves_and_the_node_waits_for_its_commit(cache, tmp_path, monkeypatch):
    """Under torchrun LOCAL_RANK 0 downloads and records its commit; the node's other ranks wait for it (up to
    OMNI_MPO_HUB_WAIT_S: one line naming the id), then read that commit from the cache."""
    import tempfile

    snap = make_hub_cache(cache)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv(model_hub.HUB_WAIT_ENV, "0.2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", "local rank 0", model_hub.HUB_WAIT_ENV):
        model_hub.hub_snapshot(HUB_ID)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert model_hub.hub_snapshot(HUB_ID).revision == HUB_REVISION
    marker = model_hub._node_marker(HUB_ID)
    assert marker.parent == tmp_path and marker.read_text() == f'"{HUB_REVISION}"'
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert model_hub.hub_snapshot(HUB_ID) == model_hub.Snapshot(HUB_ID, HUB_REVISION, str(snap.resolve()))
    marker.write_text("null")  # local rank 0 failed: its own line says why
    with raises_naming(config_mod.ConfigError, f"model.hf_path = '{HUB_ID}'", "local rank 0 could not resolve"):
        model_hub.hub_snapshot(HUB_ID)
