"""bench.py --quick end to end: the equalities every benchmark relies on and the log-prob memory ratio.

Run: `pytest tests/test_bench.py` (one `python bench.py --quick` subprocess: 57 s measured on 2 shared CPU cores,
longer when they are busy; marked slow). Only what holds regardless of machine load is asserted: value equalities
(log-probs and their gradients, vision once per pair, the step-1 loss against transformers, the cached data index),
the exact packing arithmetic and the log-prob memory ratio (memory is deterministic). Timing ratios are printed by
bench.py, never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench_results.json"
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--quick", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout)
    return json.loads(out.read_text())


pytestmark = pytest.mark.slow


def test_every_item_ran(results):
    assert {"packing", "vision", "logprobs", "train", "shared", "data", "gpu"} <= set(results)
    assert results["quick"] is True and results["command"] == "python bench.py --quick"


def test_logprobs_values_and_memory(results):
    lp = results["logprobs"]
    assert lp["values_max_abs_diff"] <= 1e-5
    assert lp["grads_max_rel_diff"] <= 1e-5
    assert lp["values_ours_vs_fp64"] <= 1e-5
    # The naive path holds log_softmax's [T, V] output, gather's [T, V] gradient and the [T, V] logits gradient;
    # the chunked path writes the logits gradient into the logits buffer and adds only O(chunk x V).
    assert lp["memory_ratio"] >= 4.0, lp  # the goal, whole forward + backward
    assert lp["working_memory_ratio"] >= 2.0, lp  # even if the naive path got its gradient buffer for free
    # the measurement sees the buffers it must see
    assert lp["peak_bytes_ours"] <= 0.5 * lp["logits_bytes"]  # no [T, V]-sized buffer beyond the logits
    assert 2.5 * lp["logits_bytes"] <= lp["peak_bytes_naive"] <= 4 * lp["logits_bytes"]


def test_vision_once_per_pair_matches_per_row(results):
    v = results["vision"]
    assert v["logits_max_abs_diff"] <= 1e-5
    assert v["grads_max_rel_diff"] <= 1e-5


def test_training_step_matches_transformers(results):
    t = results["train"]
    assert t["loss_abs_diff"] <= 1e-4
    assert t["grad_norm_rel_diff"] <= 1e-4
    assert t["loss_ours"] > 0 and t["pairs"] >= 2


def test_shared_prompt_item(results):
    sh = results["shared"]
    assert sh["loss_abs_diff"] <= 1e-5  # the step-1 loss of both layouts (asserted by bench.py too)
    # exact arithmetic: each prompt once; the 1.62x on the MMPR-like mix (2,000 pairs in --quick)
    assert sh["count_tokens_shared"] < sh["count_tokens_separate"] and 1.5 < sh["count_token_ratio"] < 1.75
    # the timed step's tokens: separate rows hold each prompt (minus the shared last token) twice
    assert sh["tokens_separate"] > sh["tokens_shared"] and sh["pairs"] == 8


def test_packing_arithmetic(results):
    p = results["packing"]
    a, b, c = p["ours"], p["round_robin"], p["padded"]
    assert a["tokens"] == b["tokens"]  # the same bins, only dealt differently
    assert a["useful_fraction"] > c["useful_fraction"]  # THD packing pads rows to 8, not to the longer row
    assert a["busiest_rank_share"] <= b["busiest_rank_share"]  # greedy balancing never loses to round-robin here
    assert 1 / 8 <= a["busiest_rank_share"] < 0.13


def test_data_cache(results):
    d = results["data"]
    assert d["rows"] == 34 * 15  # the sample (34 pairs) repeated 15 times in --quick, nothing dropped
    assert d["build_over_load"] > 1


GPU_SKIP = "no CUDA device: the GPU step time, tokens/s and MFU need an accelerator"


def test_gpu_skipped_with_a_message(results, tmp_path, monkeypatch, capsys):
    """Without CUDA the GPU item is a skip record whose message reaches the JSON, the table and the last line; with
    CUDA the --quick run measured the step instead. The no-CUDA path is also forced in-process, so a GPU machine
    checks it too."""
    import torch

    import bench

    if not torch.cuda.is_available():
        assert "no CUDA device" in results["gpu"]["skipped"]
        assert results["gpu"]["skipped"] == GPU_SKIP and set(results["gpu"]) == {"skipped", "bench_seconds"}
    else:
        assert "skipped" not in results["gpu"] and results["gpu"]["step"]["pairs"] == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    assert bench.main(["--quick", "--only", "gpu"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"gpu: skipped ({GPU_SKIP})"
    assert any(line.startswith("| GPU |") and GPU_SKIP in line for line in out.splitlines()), out
    written = json.loads((tmp_path / "results" / "bench_results.json").read_text())
    assert written["gpu"]["skipped"] == GPU_SKIP and set(written) == {"quick", "machine", "date", "command", "gpu"}


def test_gpu_bench_at_a_tiny_shape_on_the_cpu():
    """bench.bench_gpu's code path (the MPO step ours vs transformers, the Mamba scans) at the tiny asset's width on
    the CPU: both step-1 losses are the closed form of policy = reference, w_p·ln 2 + w_q·2 ln 2."""
    import math

    import bench

    r = bench.bench_gpu(True, device="cpu", shape=bench.TINY_GPU_SHAPE)
    st = r["step"]
    want = 0.8 * math.log(2) + 0.2 * 2 * math.log(2)  # configs/tiny.toml's weights
    assert st["loss_expected"] == pytest.approx(want, abs=1e-12)
    assert st["loss_ours"] == pytest.approx(want, abs=1e-5) and st["loss_baseline"] == pytest.approx(want, abs=1e-5)
    assert st["pairs"] == 8 and st["microbatches_ours"] == 2  # 4 pairs per bin
    assert st["tokens"] == sum(p.chosen_ids.numel() + p.rejected_ids.numel() for p in bench.text_pairs(
        8, (20, 60), (5, 20), 1024).values())
    assert st["mfu_ours"] is None and st["peak_bytes_ours"] is None  # CUDA-only numbers
    # the shared-prompt layout on the same pairs: same closed-form loss, each prompt computed once
    assert st["loss_shared"] == pytest.approx(want, abs=1e-5)
    assert 0 < st["tokens_shared"] < st["tokens"] and st["microbatches_shared"] >= 1
    assert st["shared_speed_ratio"] == pytest.approx(st["step_s_ours"] / st["step_s_shared"])
    assert "shared prompt vs separate rows (ours)" in bench.table({"gpu": r})
    assert r["kernels"] == "kernels: spec local; mamba torch; device cpu"
    assert set(k for k in r["scan"] if isinstance(r["scan"][k], dict)) == {"torch"}
    assert r["scan"]["torch"]["fwd_bwd_s"] > 0


def test_scan_bench_records_a_failing_kernel_and_times_the_others(monkeypatch, capsys):
    """A kernel that raised (a Triton build error, an out-of-memory) ended bench.py --gpu and lost every number; it is
    now recorded as an error row while the other kernels are timed, each result printed on stderr as it ends."""
    import bench
    import mamba_torch

    def broken(*args, **kwargs):
        raise RuntimeError("PassManager::run failed\nsecond line")

    monkeypatch.setattr(bench, "mamba_scan_kernels", lambda device: {"torch": mamba_torch.mamba_chunk_scan_combined,
                                                                     "mamba-ssm-src": broken})  # fmt: skip
    monkeypatch.setenv("MAMBA_DETERMINISTIC", "1")
    sc = bench.scan_bench("cpu", bench.TINY_GPU_SHAPE, reps=1)
    assert sc["mamba-ssm-src"] == {"error": "RuntimeError: PassManager::run failed"}
    assert sc["torch"]["fwd_bwd_s"] > 0 and sc["mamba_deterministic"] == "1"
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[bench] gpu scan ")]
    assert [ln.split()[3] for ln in err] == ["torch", "mamba-ssm-src"]
    assert json.loads(err[1].split(" ", 4)[4]) == sc["mamba-ssm-src"]
    rows = bench.scan_rows(sc)
    assert [r[0] for r in rows] == ["Mamba-2 scan torch, T=512 float32", "Mamba-2 scan mamba-ssm-src, T=512 float32"]
    assert rows[1][1:4] == ("fwd+bwd", "failed", "RuntimeError: PassManager::run failed")
    sc["mamba-ssm-src"] = dict(sc["torch"])  # as if it ran: labelled with mamba-ssm's fixed configs
    assert bench.scan_rows(sc)[1][0] == "Mamba-2 scan mamba-ssm-src (fixed configs), T=512 float32"


def test_gpu_flag_without_cuda_is_one_line_and_nonzero(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA message is not reachable")
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--gpu", "--quick", "--json", str(out)], cwd=ROOT,
                          env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("bench.py --gpu: no CUDA device here (torch.cuda.is_available() "
                                                    "is False); run it on a GPU machine")
    assert "Traceback" not in proc.stderr and not out.exists()


def test_quick_and_partial_runs_never_replace_the_full_results(tmp_path, monkeypatch, capsys):
    import bench

    monkeypatch.setattr(bench, "ROOT", tmp_path)
    full = {"quick": False, "date": "2026-01-01", "machine": "m", "command": "python bench.py",
            "packing": bench.bench_packing(False)}  # fmt: skip
    (tmp_path / "bench_results.json").write_text(json.dumps(full))
    assert bench.main(["--quick", "--only", "packing"]) == 0
    assert f"wrote {tmp_path / 'results' / 'bench_results.json'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "bench_results.json").read_text()) == full  # untouched
    assert json.loads((tmp_path / "results" / "bench_results.json").read_text())["quick"] is True
    assert bench.main(["--print"]) == 0  # no argument: the committed full results
    out = capsys.readouterr().out
    assert out.startswith("omni-mpo bench (full), 2026-01-01, m: `python bench.py`")


def test_print_of_a_file_that_is_not_a_results_file_is_one_line(tmp_path, capsys):
    """`python bench.py --print README.md` ended in a JSONDecodeError traceback; a JSON file of another shape in a
    KeyError one. Both are one `error:` line and exit 1."""
    import bench

    assert bench.main(["--print", str(ROOT / "README.md")]) == 1
    assert capsys.readouterr().err == (
        f"error: {ROOT / 'README.md'}: invalid JSON: Expecting value: line 1 column 1 (char 0)\n")
    other = tmp_path / "other.json"
    other.write_text('{"quick": false}')
    assert bench.main(["--print", str(other)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {other}: not a bench.py results file (KeyError: 'date')\n"


def test_only_without_an_item_is_a_usage_error(capsys):
    """`python bench.py --only ""` ran every item and wrote over the committed bench_results.json; an --only that names
    no item is argparse's usage error (exit 2), before any work."""
    import bench

    for value in ("", " , "):
        with pytest.raises(SystemExit) as e:
            bench.main(["--only", value])
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"python bench.py: error: --only {value!r} names no item; choose from {list(bench.ITEMS)}")


def test_mamba_ssm_triton_from_source_is_off_without_the_variable_and_one_error_for_a_wrong_directory(
        tmp_path, monkeypatch):
    """Unset: None (nothing imported). A directory without mamba-ssm's sources: one ImportError naming it. (With the
    real sources, tests/test_mamba_ssm_interpret.py imports and runs the kernels through this function.)"""
    import bench

    monkeypatch.delenv("OMNI_MAMBA_SSM_SRC", raising=False)
    assert bench.mamba_ssm_triton_from_source() is None
    monkeypatch.setenv("OMNI_MAMBA_SSM_SRC", str(tmp_path))
    with pytest.raises(ImportError, match=f"OMNI_MAMBA_SSM_SRC={tmp_path} does not hold mamba-ssm's sources"):
        bench.mamba_ssm_triton_from_source()


def test_bench_checkpoints_are_written_without_progress_bars(monkeypatch, capfd):
    """Issue 36, point 3: save_pretrained's "Writing model shards" bars landed in bench.py's table output."""
    import shutil

    from transformers.utils import logging as hf_logging

    import bench

    monkeypatch.setattr(bench, "_STATE", {})
    assert hf_logging.is_progress_bar_enabled()
    try:
        bench.small_checkpoint("policy", seed=1)
    finally:
        shutil.rmtree(bench._STATE["tmp"], ignore_errors=True)
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # switched off only inside the block
