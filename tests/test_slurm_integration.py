"""slurm/train.sbatch and slurm/chain.sh on a real Slurm: job, chain, early stop signal, failed segment, scancel.

Run: python -m pytest -q tests/test_slurm_integration.py   (about 4 min on 2 CPU cores; CPU ranks, tiny config)

Needs a Slurm that answers `sinfo` with an idle node able to run 2 CPU ranks of the tiny config, e.g. the one-node
cluster of ../shared/slurm_local/start.sh (Slurm 22.05). Skipped otherwise (CI), like the GPU tests. The jobs run the
working tree's train.py (REPO_DIR), write their logs (slurm-<id>.out) and HF cache into a temporary directory, and
never request GPUs (GPUS_PER_NODE=0). The fake-sbatch tests in test_slurm.py cover the same logic without Slurm.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest


def _sinfo_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and any(s.strip("*~#") in ("idle", "mix", "alloc") for s in r.stdout.split())


pytestmark = pytest.mark.skipif(not _sinfo_answers(), reason="no Slurm here (sinfo does not answer)")

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
CHAIN = ROOT / "slurm" / "chain.sh"
DATA = ROOT / "data" / "mmpr_sample" / "MMPR-sample" / "meta.json"
BASE = {
    "CONFIG": "configs/tiny.toml", "MPO_DATA_PATH": str(DATA), "WANDB_MODE": "disabled", "GPUS_PER_NODE": "0",
    "CPU_RANKS_PER_NODE": "2", "SBATCH_TIME": "00:10:00", "SBATCH_SIGNAL": "B:USR1@60", "TORCHDYNAMO_DISABLE": "1",
}  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MPO_", "WANDB_", "CHAIN_"))}
    return {**env, **BASE, **extra}


def _submit(cwd: Path, env: dict[str, str], *args: str) -> str:
    r = subprocess.run(["bash", str(SBATCH), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and re.fullmatch(r"\d+\n", r.stdout), r.stdout + r.stderr
    return r.stdout.strip()


def _job(job: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, Reason, ExitCode, ...); the local cluster keeps records an hour."""
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)


def _wait_end(job: str, log: Path | None = None, timeout: float = 600) -> dict[str, str]:
    deadline = time.time() + timeout
    while True:
        info = _job(job)
        if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return info
        if time.time() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            text = log.read_text() if log is not None and log.exists() else ""
            pytest.fail(f"job {job} still {info['JobState']} ({info.get('Reason')}) after {timeout} s\n{text[-4000:]}")
        time.sleep(1)


def _wait_log(log: Path, text: str, job: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (log.exists() and text in log.read_text()):
        assert _job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), log.read_text()
        assert time.time() < deadline, f"no {text!r} in {log} after {timeout} s"
        time.sleep(0.2)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


KEYS = ("loss", "preference_loss", "bco_loss", "sft_loss", "accuracy", "rewards/margin", "reward_shift",
        "reward_shift_used", "lr", "grad_norm", "bco/reward_sum", "consumed_pairs")  # fmt: skip


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A one-node job of 4 steps, uninterrupted."""
    cwd = tmp_path_factory.mktemp("straight")
    job = _submit(cwd, _env(MPO_MAX_NUM_STEPS="4", RESULTS_DIR=str(cwd / "run")))
    info = _wait_end(job, cwd / f"slurm-{job}.out")
    log = (cwd / f"slurm-{job}.out").read_text()
    return info, log, cwd / "run"


def test_one_node_job(straight):
    info, log, run = straight
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "1 node(s) x 2 CPU rank(s), no GPUs, results" in log
    assert "stopped after step 4 (max_num_steps)" in log
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4] and (run / "step_4").is_dir()


def test_two_segment_chain_equals_the_uninterrupted_run(straight, tmp_path):
    _, _, run = straight
    env = _env(CHAIN_SEGMENTS="2", CHAIN_STEP_TARGETS="2,4", RESULTS_DIR=str(tmp_path / "run"))
    r = subprocess.run(["bash", str(CHAIN)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs = re.search(r"chain: jobs (\d+) (\d+);", r.stdout).groups()
    assert _job(jobs[1])["Dependency"] == f"afterok:{jobs[0]}(unfulfilled)"
    for job in jobs:
        info = _wait_end(job, tmp_path / f"slurm-{job}.out")
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), (tmp_path / f"slurm-{job}.out").read_text()
    assert "stopped after step 2 (stop_after_step)" in (tmp_path / f"slurm-{jobs[0]}.out").read_text()
    assert "resumed from" in (tmp_path / f"slurm-{jobs[1]}.out").read_text()
    chained = _rows(tmp_path / "run")
    assert [r["step"] for r in chained] == [1, 2, 3, 4]
    for a, b in zip(_rows(run), chained, strict=True):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, a["step"]
    s1 = json.loads((run / "step_4" / "run_state.json").read_text())
    s2 = json.loads((tmp_path / "run" / "step_4" / "run_state.json").read_text())
    for k in ("reward_shift", "reward_shift_num_updates", "consumed_pairs", "sampler", "scheduler"):
        assert s1[k] == s2[k], k


def test_stop_signal_during_start_up_is_kept_and_the_job_completes(tmp_path):
    """SIGUSR1 to the batch shell right after the job starts (srun not yet started, the ranks
    still importing) stops the run after its first step, saves, and the job COMPLETES (an afterok chain goes on)."""
    env = _env(SBATCH_TIME="00:03:00", SBATCH_SIGNAL="B:USR1@30", MPO_MAX_NUM_STEPS="100000",
               RESULTS_DIR=str(tmp_path / "run"))  # fmt: skip
    job = _submit(tmp_path, env, "data.num_workers=1")  # a DataLoader worker
    log = tmp_path / f"slurm-{job}.out"
    _wait_log(log, "train.sbatch: job ", job)
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    t0 = time.time()
    info = _wait_end(job, log)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text[-4000:]
    assert time.time() - t0 < 120, text[-4000:]  # not at the 3-min hard limit
    stopped = re.search(r"stopped after step (\d+) \(signal\)", text)
    assert stopped and int(stopped.group(1)) <= 3, text[-4000:]  # the first step(s) after start-up, not 100000
    assert f"saved {tmp_path / 'run'}/step_{stopped.group(1)}" in text
    assert "train.sbatch: SIGUSR1 (stop request) -> srun" in text and text.count(": SIGUSR1 -> rank pid ") == 2


def test_failed_first_segment_cancels_the_rest_and_can_be_resubmitted(tmp_path):
    """Segment 1 fails (no such data file); segment 2 is cancelled, not left pending forever,
    and the same chain can be submitted again into the same results directory without CHAIN_CONTINUE."""
    env = _env(CHAIN_SEGMENTS="2", CHAIN_STEP_TARGETS="2,4", RESULTS_DIR=str(tmp_path / "run"),
               MPO_DATA_PATH=str(tmp_path / "missing" / "meta.json"))  # fmt: skip
    r = subprocess.run(["bash", str(CHAIN)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resume with CHAIN_CONTINUE=1 RESULTS_DIR={tmp_path / 'run'}" in r.stdout
    first, second = re.search(r"chain: jobs (\d+) (\d+);", r.stdout).groups()
    info = _wait_end(first, tmp_path / f"slurm-{first}.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", info
    info2 = _wait_end(second, timeout=120)
    assert info2["JobState"] == "CANCELLED", info2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["chain.env"]
    again = subprocess.run(["bash", str(CHAIN)], cwd=tmp_path, env={**env, "DRY_RUN": "1"}, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr


def test_scancel_saves_and_the_log_says_so(tmp_path):
    """After scancel (SIGTERM) the ranks save; the log's last word is one line saying that
    torchrun's SignalException traceback only reports the signal. Also with a DataLoader worker, which
    scancel's SIGTERM reaches too (it killed the worker and the rank's step: nothing saved)."""
    job = _submit(tmp_path, _env(MPO_MAX_NUM_STEPS="100000", RESULTS_DIR=str(tmp_path / "run")),
                  "data.num_workers=1")  # scancel signals the DataLoader workers too
    log = tmp_path / f"slurm-{job}.out"
    _wait_log(log, "step 2/100000", job)
    subprocess.run(["scancel", job], timeout=30, check=True)
    info = _wait_end(job, log)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED", info
    saved = re.search(r"saved (\S+)/step_(\d+)\n", text)
    assert saved and (tmp_path / "run" / f"step_{saved.group(2)}").is_dir(), text[-4000:]
    last = text.strip().splitlines()[-1]
    assert last == (f"train.sbatch: SIGTERM (scancel or the time limit); latest complete checkpoint: {saved.group(1)}"
                    f"/step_{saved.group(2)} (the ranks save after their step on SIGTERM); torchrun's SignalException"
                    " traceback above only reports the signal"), text[-4000:]  # fmt: skip
