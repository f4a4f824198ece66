"""What a user sees on the console: one error line printed once and last, the resolved config
written to the run directory, known library warnings kept out, Ctrl-C saving like SIGTERM, metrics.jsonl never
restarted silently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import config as config_mod
import monitor

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, TORCHDYNAMO_DISABLE="1", WANDB_MODE="disabled")
ENV.pop(config_mod.SHOW_WARNINGS_ENV, None)
TORCHRUN_ENV = {config_mod.SHOW_WARNINGS_ENV: None}  # the torchrun fixture's environment, known warnings quiet


def test_misspelled_config_path_is_one_line_and_nothing_else():
    proc = subprocess.run([sys.executable, "train.py", "configs/tiny.tom"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1  # one line, nothing else: the error's type, the path and where it was looked for
    err = proc.stderr
    assert err.startswith("error: ConfigError: config file 'configs/tiny.tom' ") and err.count("\n") == 1, err
    assert f"{ROOT};" in err and "configs/)" in err, err
    assert proc.stdout == ""


def test_help_prints_the_usage_and_a_missing_config_is_a_usage_error():
    """`python train.py --help` said "config file '--help' not found"; help is the usage on stdout (exit 0)."""
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert " ".join(proc.stdout.split()).startswith("usage: torchrun --standalone --nproc-per-node N train.py [-h] "
                                                    "CONFIG.toml [section.key=value ...] MPO training")
    proc = subprocess.run([sys.executable, "train.py"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        "torchrun --standalone --nproc-per-node N train.py: error: the following arguments are required: CONFIG.toml")


def test_error_under_torchrun_is_printed_once_and_ends_the_report(torchrun):
    proc = torchrun("train.py", "configs/tiny.tom", env=TORCHRUN_ENV, check=False)
    assert proc.returncode == 1
    msg = "error: ConfigError: config file 'configs/tiny.tom' not found"
    lines = proc.stderr.splitlines()
    assert sum(line.startswith(msg) for line in lines) == 1  # rank 0 only
    assert 'train.py", line' not in proc.stderr and "config.py" not in proc.stderr  # no traceback from the ranks
    last = [line for line in lines if line.strip() and not set(line) <= {"="}][-1]
    assert last.startswith(f"  traceback : {msg}")  # torchrun's root cause is our line, not a docs link


def test_metrics_log_never_restarts_a_file_silently(tmp_path, capsys):
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    old = "".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n" for s in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(old)
    (tmp_path / "metrics.1.jsonl").write_text("earlier\n")
    log = monitor.MetricsLog(cfg, None, resumed_step=0, rank=0)  # a fresh start over lines of a run that never saved
    log.log(1, {"loss": 0.5})
    assert (tmp_path / "metrics.2.jsonl").read_text() == old
    assert (tmp_path / "metrics.1.jsonl").read_text() == "earlier\n"
    assert [json.loads(r)["loss"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0.5]
    assert capsys.readouterr().out == (f"metrics: {tmp_path / 'metrics.jsonl'} held 3 lines of an earlier run without "
                                       "a checkpoint; moved to metrics.2.jsonl, this run starts a new metrics.jsonl\n")
    (tmp_path / "metrics.jsonl").write_text(old)
    log = monitor.MetricsLog(cfg, None, resumed_step=2, rank=0)
    assert (tmp_path / "metrics.jsonl").read_text() == old  # a start refused before its first line changes nothing
    assert capsys.readouterr().out == ""
    log.log(3, {"loss": 0.25})
    assert capsys.readouterr().out == (f"metrics: dropped 1 line after step 2 from {tmp_path / 'metrics.jsonl'} "
                                       "(logged after the checkpoint this run resumes from: a segment that stopped "
                                       "before saving them, or a later checkpoint moved away)\n")
    assert [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "split": "train", "loss": 1.0}, {"step": 2, "split": "train", "loss": 1.0},
        {"step": 3, "split": "train", "loss": 0.25}]
    monitor.MetricsLog(cfg, None, resumed_step=3, rank=0).log(4, {"loss": 0.125})  # nothing to drop: nothing said
    assert capsys.readouterr().out == ""
    assert [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_metrics_log_keeps_lines_it_cannot_read(tmp_path, capsys):
    """A hand-edited metrics.jsonl (a line that is not JSON, or has no integer step) is kept by a resume, never a
    traceback; the readable lines after the resumed step are dropped as usual."""
    cfg = config_mod.load_config(None, [f"checkpoint.dir={tmp_path}"])
    lines = ['{"step": 1}', "# my note", '{"step": "2"}', '[3]', '{"step": true}', '{"step": 2}', '{"step": 5}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    monitor.MetricsLog(cfg, None, resumed_step=1, rank=0).log(2, {"loss": 0.5})
    got = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert got == lines[:5] + [json.dumps({"step": 2, "split": "train", "loss": 0.5})]
    assert "dropped 2 lines after step 1" in capsys.readouterr().out
    # QA: bytes that are not UTF-8 were a UnicodeDecodeError traceback after the step; a last line cut off mid-write
    # (no newline) had the next line appended to it, so that line was lost too
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\x00\xff\xfe\n{"step": 2}\n{"step": 3, "split": "tr')
    monitor.MetricsLog(cfg, None, resumed_step=2, rank=0).log(3, {"loss": 0.5})
    assert path.read_bytes() == b'{"step": 1}\n\x00\xff\xfe\n{"step": 2}\n' + json.dumps(
        {"step": 3, "split": "train", "loss": 0.5}).encode() + b"\n"
    assert capsys.readouterr().out == (f"metrics: dropped the cut-off last line of {path} (a write that did not "
                                       "finish): '{\"step\": 3, \"split\": \"tr'\n")
    path.write_text('{"step": 1}')  # a whole last line without its newline (an editor's save) is kept
    monitor.MetricsLog(cfg, None, resumed_step=1, rank=0).log(2, {"loss": 0.5})
    assert [json.loads(r)["step"] for r in path.read_text().splitlines()] == [1, 2] and not capsys.readouterr().out


def test_quiet_known_warnings_respects_the_switch(monkeypatch):
    monkeypatch.setenv(config_mod.SHOW_WARNINGS_ENV, "1")
    assert config_mod.quiet_known_warnings() is False


@pytest.mark.parametrize("offload", [False, True])
def test_layout_lines_say_when_reference_offload_is_ignored(offload, capsys):
    """`reference.offload = true` on the CPU was silently ignored; the layout lines now say so."""
    from types import SimpleNamespace

    from backend import kernel_selection

    cfg = config_mod.load_config(ROOT / "configs" / "tiny.toml", [f"reference.offload={str(offload).lower()}"])
    ctx = SimpleNamespace(cfg=cfg, dp=2, device=torch.device("cpu"))
    kernels = kernel_selection.select_kernels()
    monitor.print_layout(ctx, 2, kernels, "shared prompt (auto)")
    lines = [kernels.line(), "world 2: TP 1 CP 1 DP 2 EP 1 on cpu; pairs: shared prompt (auto)"]
    if offload:
        lines.append("reference.offload = true is ignored on the CPU: the reference model is in CPU memory already")
    assert capsys.readouterr().out.splitlines() == lines


def test_a_failed_save_leaves_megatron_writer_errors_off_the_console(monkeypatch):
    """A full disk printed megatron's writer errors (4 lines) before checkpoint.save's one CheckpointError line;
    those records are filtered, any other record of that logger still prints."""
    import io
    import logging

    monkeypatch.delenv(config_mod.SHOW_WARNINGS_ENV, raising=False)
    logger = logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "handlers", [logging.StreamHandler(out := io.StringIO())])
    assert config_mod.quiet_known_warnings() is True
    logger.error("Local worker 0 encountered an error: [Errno 28] No space left on device")
    logger.error("An error is caught while starting worker 0, error: <class 'RuntimeError'>")
    logger.error("FileSystemWriterAsync: something else")
    assert out.getvalue() == "FileSystemWriterAsync: something else\n"


def test_ctrl_c_under_torchrun_finishes_the_step_saves_and_the_console_is_short(torchrun, tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does), DataLoader workers included."""
    run_dir = tmp_path / "run"
    proc = torchrun.start("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", "mpo.max_num_steps=20",
                          "data.num_workers=1", "mpo.val_at_end=false", env=TORCHRUN_ENV)  # fmt: skip
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=300)
    lines = [json.loads(r) for r in metrics.read_text().splitlines()]
    last = lines[-1]["step"]
    assert 2 <= last < 20
    assert f"stopped after step {last} (signal)" in out and f"saved {run_dir / f'step_{last}'}" in out
    assert json.loads((run_dir / f"step_{last}" / "run_state.json").read_text())["step"] == last
    # torchrun itself exits 1 after forwarding the signal (its SignalException report), the ranks exit 0
    assert proc.returncode == 1 and "SignalException" in err, err[-3000:]
    assert "KeyboardInterrupt" not in err and "UserWarning" not in err and "Rewrapping ModuleSpec" not in err
    # the resolved config is a file in the run directory, announced in one line
    assert f"config: {run_dir / 'config.json'}\n" in out
    saved = config_mod.from_dict(json.loads((run_dir / "config.json").read_text()))
    assert saved.mpo.max_num_steps == 20 and saved.data.num_workers == 1
    assert len(out.splitlines()) <= 6 + last  # world, config, data, one line per step, saved, stopped


def test_tensor_parallel_run_prints_only_its_own_lines(torchrun, tmp_path):
    """A TP = 2 sequence-parallel run printed megatron-core's "`sequence_parallel` is set to `True`, but
    tensor model parallel size is 1" (its expert linears, ETP = 1; the filter lacked the backticks) and "... set the
    environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 ..." (train.py now sets it when unset) on both ranks.
    OMP_NUM_THREADS is set, so torchrun's own notice is absent too: stderr is empty."""
    run_dir = tmp_path / "run"
    env = {**TORCHRUN_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": None, "OMP_NUM_THREADS": "1"}
    proc = torchrun("train.py", "configs/tiny.toml", f"checkpoint.dir={run_dir}", "mpo.max_num_steps=2",
                    "scheduler.lr_warmup_steps=1", "mpo.val_at_end=false", "parallel.tensor_model_parallel_size=2",
                    "parallel.sequence_parallel=true", env=env, timeout=240)  # fmt: skip
    assert proc.stderr == "", proc.stderr[-3000:]
    assert [line.split(" ")[0] for line in proc.stdout.splitlines()] == [
        "kernels:", "world", "data:", "config:", "step", "step", "saved", "stopped"], proc.stdout  # fmt: skip
    assert "world 2: TP 2 CP 1 DP 1 EP 1 on cpu; pairs: separate sequences\n" in proc.stdout


@pytest.mark.parametrize("value, shown", [(0.3851, " mfu 38.5% "), (2.3e-6, " mfu 0.00023% "), (None, None)])
def test_console_line_shows_mfu_in_significant_digits(value, shown):
    """A GPU run of the tiny model printed `mfu 0.0%`."""
    cfg = config_mod.load_config(None, [])
    m = {"loss": 0.7, "preference_loss": 0.69, "bco_loss": 0.69, "sft_loss": 1.2, "accuracy": 0.5,
         "rewards/margin": 0.01, "reward_shift": 0.0, "lr": 1e-6, "grad_norm": 1.0, "pairs_per_s": 2.0,
         "tokens_per_s": 900.0, "mfu": value, "step_time": 4.0, "eta_s": 60.0}  # fmt: skip
    line = monitor.format_line(1, cfg, m)
    assert shown in line if shown else " mfu " not in line


def test_a_console_that_is_gone_sends_the_output_to_dev_null_and_other_errors_still_raise():
    """monitor.Console: a write to a closed pipe (EPIPE; a hung-up terminal gives EIO) points the descriptor at
    /dev/null and returns; an error that is not a lost console (a full disk) is raised."""
    import errno

    read, write = os.pipe()
    os.close(read)  # `| tee` ended
    stream = os.fdopen(write, "w", buffering=1)
    console = monitor.Console(stream)
    try:
        assert console.write("step 3\n") == len("step 3\n")
        console.write("step 4\n")
        console.flush()
        assert os.fstat(write).st_rdev == os.stat(os.devnull).st_rdev and console.fileno() == write
    finally:
        stream.close()

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        monitor.Console(FullDisk()).write("x")
    assert e.value.errno == errno.ENOSPC
