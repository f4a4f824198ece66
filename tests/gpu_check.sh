#!/usr/bin/env bash
# The GPU check, for a fresh CUDA machine without network. From the repo root:
#   bash tests/gpu_check.sh WHEEL_DIR          # WHEEL_DIR: the wheels this machine lacks (docs/PERFORMANCE.md, "GPU check")
# 1. installs every wheel of WHEEL_DIR (no index, no dependency resolution) into $OMNI_SITE (default /tmp/omni_site),
#    put first on PYTHONPATH, and checks that the project's Python dependencies import at the pinned versions; a
#    mamba-ssm sdist there (mamba_ssm-*.tar.gz) is unpacked for its Triton kernels ($OMNI_MAMBA_SSM_SRC);
# 2. prints the kernel selection (kernel_selection.select_kernels);
# 3. runs tests/test_gpu.py's in-process checks (<= 150 s), the Triton Mamba kernels against mamba_torch (<= 180 s:
#    mamba-ssm's and fla-core's Triton kernels compile from a cold cache; items 5, 7 and 9), `python -m bench
#    --gpu --profile --ablation` at the largest shape plan.py fits on the device (2 timed steps; <= 200 s; results to $OMNI_OUT, default
#    /tmp/omni_gpu_check, never over the committed bench files; each section is written to its JSON as it ends), then
#    the five train.py launches (<= 240 s: they train on the kernel line's set, `mamba triton` where the sources are);
#    every limit is cut to what is left of OMNI_GPU_CHECK_SECONDS (default 560: one device call may run 600 s);
# 4. prints a short table, then the benchmark's tables from that JSON (the profile's device time by region among
#    them); exits non-zero when any step fails. The parts ran in 7.8 minutes on an H200 on 2026-12-04 (before the
#    Triton Mamba part existed).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${1:?usage: bash tests/gpu_check.sh WHEEL_DIR (a folder of .whl files; see docs/PERFORMANCE.md, GPU check)}
SITE=${OMNI_SITE:-/tmp/omni_site}
OUT=${OMNI_OUT:-/tmp/omni_gpu_check}
PY=${PYTHON:-python3}
# the whole check ends within this many seconds (a device call may run 600 s): each part's limit is cut to what is left
BUDGET=${OMNI_GPU_CHECK_SECONDS:-560}
START=$SECONDS
limit() { local left=$((BUDGET - (SECONDS - START))); [ "$left" -lt 20 ] && left=20; echo $(("$1" < left ? "$1" : left)); }
export TORCHDYNAMO_DISABLE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
# mamba-ssm's Triton kernels (its sdist, or a compiled mamba-ssm) with one fixed config each: from a cold cache its
# autotuning compiles ~40 forward and ~100 backward configs per dtype and shape (minutes), more than the time limits
# below; the benchmark's mamba-ssm scan times are then those of the fixed configs (the benchmark records the variable)
export MAMBA_DETERMINISTIC=${MAMBA_DETERMINISTIC:-1}
mkdir -p "$OUT"
declare -a ROWS
FAILED=0
row() { ROWS+=("$(printf '%-34s %-6s %7s  %s' "$1" "$2" "${3:+${3}s}" "$4")"); [ "$2" = ok ] || [ "$2" = skip ] || FAILED=1; }

# -- 1. GPU and dependencies ------------------------------------------------------------------------------------------
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to $PY (torch.cuda.is_available() is False)" >&2
  exit 1
fi
t0=$SECONDS
shopt -s nullglob
whls=("$WHEELS"/*.whl)
if [ ${#whls[@]} -gt 0 ]; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --ignore-requires-python \
      --target "$SITE" "${whls[@]}" \
      >"$OUT/pip.log" 2>&1; then
    row "install ${#whls[@]} wheels" ok $((SECONDS - t0)) "into $SITE"
  else
    row "install ${#whls[@]} wheels" FAIL $((SECONDS - t0)) "see $OUT/pip.log"
  fi
else
  row "install wheels" ok 0 "none in $WHEELS"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# mamba-ssm's sdist (no compiled kernels needed): its pure-Triton Mamba-2 scan and gated RMSNorm, with fla-core's
# Triton conv the `mamba triton` kernel set that trains when the compiled mamba-ssm is missing
# (mamba_triton.load_mamba_ssm_triton; tests/test_gpu.py items 5, 7 and 9, and the train.py launches)
sdists=("$WHEELS"/mamba_ssm-*.tar.gz)
if [ ${#sdists[@]} -gt 0 ] && [ -z "${OMNI_MAMBA_SSM_SRC:-}" ]; then
  t0=$SECONDS
  src="$SITE.mamba_ssm_src"
  rm -rf "$src" && mkdir -p "$src"
  if tar -xzf "${sdists[0]}" -C "$src" --strip-components=1 --wildcards '*/mamba_ssm/*' 2>"$OUT/sdist.log"; then
    export OMNI_MAMBA_SSM_SRC="$src"
    row "mamba-ssm sources" ok $((SECONDS - t0)) "$(basename "${sdists[0]}") -> $src"
  else
    row "mamba-ssm sources" FAIL $((SECONDS - t0)) "see $OUT/sdist.log"
  fi
fi
t0=$SECONDS
deps=$("$PY" -W ignore - <<'PY' 2>"$OUT/deps.log" | tail -1
# the project's requirements that this check needs (torch, torchvision and numpy stay the machine's own CUDA builds)
import importlib.metadata as md
need = {"megatron-core": "0.19.2", "transformers": "5.23.0", "fla-core": "0.6.0", "einops": None, "psutil": None,
        "safetensors": None, "pillow": None, "tqdm": None, "pytest": None}
bad = []
for name, version in need.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        bad.append(f"{name} missing")
        continue
    if version and have != version:
        bad.append(f"{name} {have} != {version}")
extra = []
for name in ("transformer-engine", "mamba-ssm", "causal-conv1d"):
    try:
        extra.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
if not bad:  # importable, not only installed: transformers checks its own dependencies (huggingface-hub, tokenizers)
    for module in ("transformers", "megatron.core", "torchvision"):
        try:
            __import__(module)
        except Exception as e:  # ImportError, or a version check's error
            bad.append(f"import {module}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
print("; ".join(bad) if bad else "ok " + ", ".join(extra))
PY
)
case "$deps" in
  ok*) row "dependencies" ok $((SECONDS - t0)) "${deps#ok }" ;;
  *) row "dependencies" FAIL $((SECONDS - t0)) "$deps (add the wheels to $WHEELS)" ;;
esac
kernels=$("$PY" -c "import kernel_selection; print(kernel_selection.select_kernels().line())" 2>"$OUT/kernels.log" | tail -1)
row "kernel selection" "$([ -n "$kernels" ] && echo ok || echo FAIL)" 0 "${kernels:-see $OUT/kernels.log}"

# -- 2. tests/test_gpu.py: the in-process checks first, then the train.py launches (each part its own time limit, so a
# slow launch part still leaves the parity, audit and kernel results) --------------------------------------------------
LAUNCHES="main_job or resume or bf16_trains"  # the tests of the `runs` fixture: five train.py launches
TRITON="triton or fla_conv or every_mamba_kernel or shared_prompt_mamba"  # the Triton Mamba kernels against mamba_torch
gpu_tests() {  # name, time limit (cut to the budget left), -k expression
  local t0=$SECONDS rc summary last reason log="$OUT/test_gpu_$1.log" lim
  lim=$(limit "$2")
  # -v: one line per test as it ends, so a part killed at its time limit still reports the tests it finished
  COLUMNS=240 timeout "$lim" "$PY" -m pytest -v -rfEs -p no:cacheprovider tests/test_gpu.py -k "$3" >"$log" 2>&1
  rc=$?
  summary=$(tail -1 "$log" | sed -E 's/^=+ //; s/ =+$//')
  [ $rc -eq 124 ] && summary="killed at the ${lim}s limit"
  row "tests/test_gpu.py ($1)" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)) "rc $rc: $summary"
  while read -r name status rest; do
    rest=$(sed -E 's/ *\[ *[0-9]+%\]$//' <<<"$rest")  # the progress column
    case "$status" in
      PASSED) row "  ${name#tests/test_gpu.py::}" ok "" "" ;;
      SKIPPED) row "  ${name#tests/test_gpu.py::}" skip "" "${rest:0:90}" ;;
      FAILED|ERROR)  # the reason from pytest's short summary (-rfE): "FAILED tests/test_gpu.py::name - reason"
        reason=$(grep -F "$status $name - " "$log" | head -1)
        row "  ${name#tests/test_gpu.py::}" FAIL "" "${reason:+${reason#*" - "}}"
        ROWS[-1]="${ROWS[-1]:0:200}" ;;
    esac
  done < <(grep -E '^tests/test_gpu\.py::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED)' "$log")
  last=$(grep -E '^tests/test_gpu\.py::' "$log" | tail -1)
  if [ $rc -eq 124 ] && [ -n "$last" ] && ! grep -qE ' (PASSED|FAILED|ERROR|SKIPPED)' <<<"$last"; then
    row "  ${last#tests/test_gpu.py::}" FAIL "" "running when killed"
  fi
}
gpu_tests in-process 150 "not ($LAUNCHES or $TRITON)"
gpu_tests triton-mamba 180 "$TRITON"

# -- 3. python -m bench --gpu --profile --ablation (sized to the device), before the launches: its numbers are the ones no other part
# gives (the ablation: the step with each fast kernel swapped back to its portable fallback) ---------------------------
t0=$SECONDS
lim=$(limit 200)
timeout "$lim" "$PY" -m bench --gpu --profile --ablation --timed-steps 2 --json "$OUT/bench_gpu.json" \
  >"$OUT/bench.log" 2>&1
rc=$?
note="rc $rc, $OUT/bench_gpu.json"
[ $rc -eq 124 ] && note="killed at the ${lim}s limit (the sections that ended are in $OUT/bench_gpu.json)"
failed=$(sed -nE 's/^bench: failed: ([^(]*) \(.*/\1/p' "$OUT/bench.log" | head -1)
[ -n "$failed" ] && note="rc $rc, failed sections: $failed (errors in $OUT/bench_gpu.json; see $OUT/bench.log)"
row "python -m bench --gpu --profile --ablation" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)) "$note"
gpu_tests launches 240 "$LAUNCHES"

# -- 4. table ---------------------------------------------------------------------------------------------------------
echo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
printf '%-34s %-6s %7s  %s\n' check result time note
for r in "${ROWS[@]}"; do echo "$r"; done
echo
# the benchmark's tables (its results and the profile's device time by region) from what its JSON holds
"$PY" -m bench --print "$OUT/bench_gpu.json" 2>/dev/null || grep -E '^\[bench\]' "$OUT/bench.log" \
  || tail -5 "$OUT/bench.log"
[ $FAILED -eq 0 ] || { echo "gpu_check: FAILED (logs in $OUT)"; tail -n 15 "$OUT"/test_gpu_*.log; }
exit $FAILED
