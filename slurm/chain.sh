#!/usr/bin/env bash
# Split one long run into Slurm jobs that each end at a step boundary, chained with afterok dependencies.
#
#   CHAIN_SEGMENTS=3 CHAIN_STEP_TARGETS=2000,4500,7000 MPO_DATA_PATH=/lustre/MMPR/meta.json \
#       MPO_MODEL_NAME=/lustre/ckpt/Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16 slurm/chain.sh [section.key=value ...]
#   DRY_RUN=1 ...  slurm/chain.sh      # print every segment's sbatch/srun/torchrun lines; submit nothing
#
# Every segment gets the same MPO_MAX_NUM_STEPS (the LR schedule horizon never changes), the same RESULTS_DIR
# (checkpoint.dir: each segment resumes from the latest checkpoint there) and the same WANDB_RUN_ID (one W&B curve),
# and MPO_STOP_AFTER_STEP=<its target>; segment i starts only after segment i-1 ended successfully (afterok).
# A segment cut short by the time-limit signal still exits 0 after saving; the next one resumes from that step.
# A segment that fails, is cancelled or hits the hard time limit makes Slurm cancel every later segment
# (--kill-on-invalid-dep=yes; they never wait forever in PD DependencyNeverSatisfied). Resume the run with
# CHAIN_CONTINUE=1 RESULTS_DIR=<the same directory> slurm/chain.sh (the command is printed at submission).
#
#   CHAIN_SEGMENTS (2)        number of jobs
#   CHAIN_STEP_TARGETS        comma list of cumulative step boundaries, strictly increasing, one per segment, the last
#                             equal to MPO_MAX_NUM_STEPS (which defaults to it); optional when CHAIN_SEGMENTS=1
#   RESULTS_DIR               default $PWD/results/omni-mpo-<run id>; must be empty, absent or hold only chain.env (a
#                             chain whose first job failed before it saved anything) unless CHAIN_CONTINUE=1
#   CHAIN_CONTINUE (0)        1 = add segments to the run already in RESULTS_DIR (its chain.env fixes the run id and
#                             MPO_MAX_NUM_STEPS; targets continue from where it stands)
#   WANDB_RUN_ID              default mpo<6 hex digits>; letters, digits, '_' and '-' only
#   everything else           passed to slurm/train.sbatch unchanged (see its header), e.g. CONTAINER, NUM_NODES;
#                             so are the arguments (section.key=value), except mpo.stop_after_step, mpo.max_num_steps
#                             and checkpoint.dir (the chain's own: CHAIN_STEP_TARGETS, MPO_MAX_NUM_STEPS, RESULTS_DIR)
#
# Exit status: 2 for any invalid input (nothing is submitted), 1 when sbatch fails part-way (the ids of the jobs
# already submitted are printed), 0 otherwise. Prints the job ids, the W&B run id and the results path.

set -euo pipefail

die() {
    echo "chain.sh: error: $*" >&2
    exit 2
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

is_positive_int() { # plain decimal digits (no sign, exponent or blank), at most 9 of them, value >= 1
    [[ "$1" =~ ^[0-9]{1,9}$ ]] && ((10#$1 >= 1))
}

# --- validate every input before anything is submitted ---------------------------------------------------------------
CHAIN_SEGMENTS=${CHAIN_SEGMENTS:-2}
is_positive_int "$CHAIN_SEGMENTS" || die "CHAIN_SEGMENTS='$CHAIN_SEGMENTS' must be a positive integer"
segments=$((10#$CHAIN_SEGMENTS))
[[ -z "${MPO_STOP_AFTER_STEP:-}" ]] ||
    die "MPO_STOP_AFTER_STEP is set per segment by the chain; unset it and use CHAIN_STEP_TARGETS"
# The keys the chain sets for every segment: an override argument would win over them (train.sbatch appends the
# arguments last) and silently break the chain (every segment stopping at one step, another horizon or directory).
for arg in "$@"; do
    key=${arg%%=*}
    key=${key//[[:space:]]/}
    case "$key" in
    mpo.stop_after_step) die "the argument '$arg': the chain sets it per segment from CHAIN_STEP_TARGETS" ;;
    mpo.max_num_steps) die "the argument '$arg': set MPO_MAX_NUM_STEPS instead (the chain's LR horizon)" ;;
    checkpoint.dir) die "the argument '$arg': set RESULTS_DIR instead (the chain's results directory)" ;;
    esac
done
if [[ -n "${MPO_MAX_NUM_STEPS:-}" ]]; then
    is_positive_int "$MPO_MAX_NUM_STEPS" || die "MPO_MAX_NUM_STEPS='$MPO_MAX_NUM_STEPS' must be a positive integer"
fi
targets_text=${CHAIN_STEP_TARGETS:-}
if [[ -z "${targets_text// /}" ]]; then
    if ((segments == 1)) && [[ -n "${MPO_MAX_NUM_STEPS:-}" ]]; then
        targets_text=$MPO_MAX_NUM_STEPS
    else
        die "CHAIN_STEP_TARGETS is required: $segments comma-separated cumulative step targets (e.g. 2000,4500,7000)"
    fi
fi
targets=()
rest="$targets_text,"
while [[ -n "$rest" ]]; do
    item=${rest%%,*}
    rest=${rest#*,}
    item=${item// /}
    is_positive_int "$item" || die "CHAIN_STEP_TARGETS='$targets_text': '$item' is not a positive integer"
    targets+=($((10#$item)))
done
((${#targets[@]} == segments)) ||
    die "CHAIN_STEP_TARGETS='$targets_text' has ${#targets[@]} targets but CHAIN_SEGMENTS=$segments"
for ((i = 1; i < segments; i++)); do
    ((targets[i] > targets[i - 1])) ||
        die "CHAIN_STEP_TARGETS='$targets_text' is not strictly increasing (${targets[i - 1]} then ${targets[i]})"
done
last=${targets[segments - 1]}
max_steps=$((10#${MPO_MAX_NUM_STEPS:-$last}))
((last == max_steps)) ||
    die "the last target $last must equal MPO_MAX_NUM_STEPS=$max_steps (the LR horizon of every segment)"

# One results directory and one W&B run for the whole chain; chain.env in it records both for CHAIN_CONTINUE.
continue_run=${CHAIN_CONTINUE:-0}
[[ "$continue_run" == 0 || "$continue_run" == 1 ]] || die "CHAIN_CONTINUE='$continue_run' must be 0 or 1"
if [[ "$continue_run" == 1 && -z "${RESULTS_DIR:-}" ]]; then
    die "CHAIN_CONTINUE=1 needs RESULTS_DIR (the run to continue)"
fi
rewrite_marker=0
marker_value() { # KEY FILE: the value of KEY=... in FILE (never sourced)
    sed -n "s/^$1=//p" "$2" | tail -n1
}
if [[ -n "${RESULTS_DIR:-}" ]]; then
    [[ "$RESULTS_DIR" == /* ]] || RESULTS_DIR="$PWD/$RESULTS_DIR"
    marker="$RESULTS_DIR/chain.env"
    if [[ "$(ls -A "$RESULTS_DIR" 2>/dev/null)" == chain.env ]]; then
        # Only what chain.sh wrote before its first job failed (nothing was saved): start the chain again; keep the
        # recorded run id unless one is given, and rewrite chain.env with this chain's MPO_MAX_NUM_STEPS.
        WANDB_RUN_ID=${WANDB_RUN_ID:-$(marker_value WANDB_RUN_ID "$marker")}
        rewrite_marker=1
    elif [[ -d "$RESULTS_DIR" && -n "$(ls -A "$RESULTS_DIR")" ]]; then
        [[ "$continue_run" == 1 ]] || die "RESULTS_DIR=$RESULTS_DIR already holds a run; set CHAIN_CONTINUE=1 to" \
            "continue it, or choose another RESULTS_DIR"
        if [[ -f "$marker" ]]; then
            old_id=$(marker_value WANDB_RUN_ID "$marker")
            old_max=$(marker_value MPO_MAX_NUM_STEPS "$marker")
            [[ -z "${WANDB_RUN_ID:-}" || "$WANDB_RUN_ID" == "$old_id" ]] ||
                die "WANDB_RUN_ID=$WANDB_RUN_ID differs from the run in $marker ($old_id)"
            [[ "$old_max" == "$max_steps" ]] ||
                die "MPO_MAX_NUM_STEPS=$max_steps differs from the run in $marker ($old_max): the LR horizon is fixed"
            WANDB_RUN_ID=$old_id
        elif [[ -z "${WANDB_RUN_ID:-}" ]]; then
            die "$RESULTS_DIR has no chain.env: set WANDB_RUN_ID to the id of the run being continued"
        fi
    fi
fi
WANDB_RUN_ID=${WANDB_RUN_ID:-mpo$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')}
[[ "$WANDB_RUN_ID" =~ ^[A-Za-z0-9_-]+$ ]] || die "WANDB_RUN_ID='$WANDB_RUN_ID' may only hold letters, digits, '_' and '-'"
RESULTS_DIR=${RESULTS_DIR:-$PWD/results/omni-mpo-$WANDB_RUN_ID}
job_name=${SBATCH_JOB_NAME:-omni-mpo-$WANDB_RUN_ID}
export RESULTS_DIR WANDB_RUN_ID MPO_MAX_NUM_STEPS=$max_steps

# segment I DEPENDENCY MODE: train.sbatch for segment I (1-based) with its stop target; MODE=dry prints it.
segment() {
    local i=$1 dep=$2 mode=$3
    MPO_STOP_AFTER_STEP=${targets[i - 1]} SBATCH_DEPENDENCY=$dep SBATCH_JOB_NAME="$job_name-$i-of-$segments" \
        DRY_RUN=$([[ "$mode" == dry ]] && echo 1 || echo 0) bash "$here/train.sbatch" "${@:4}"
}

# train.sbatch validates the remaining knobs (integers, data path, W&B credentials); run it dry for every segment
# first so that a bad knob stops the chain before the first submission.
for ((i = 1; i <= segments; i++)); do
    dep=""
    ((i == 1)) || dep="\$SEGMENT_$((i - 1))_JOB_ID"
    out=$(segment "$i" "$dep" dry "$@") || exit 2
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        from=1
        ((i == 1)) || from=$((targets[i - 2] + 1))
        echo "# segment $i/$segments: steps $from..${targets[i - 1]} of $max_steps"
        printf '%s\n' "$out"
    fi
done
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "chain (dry run): W&B run id $WANDB_RUN_ID, results $RESULTS_DIR, $segments segment(s), nothing submitted"
    exit 0
fi

mkdir -p "$RESULTS_DIR"
[[ -f "$RESULTS_DIR/chain.env" && "$rewrite_marker" == 0 ]] ||
    printf 'WANDB_RUN_ID=%s\nMPO_MAX_NUM_STEPS=%s\n' "$WANDB_RUN_ID" "$max_steps" >"$RESULTS_DIR/chain.env"
jobs=()
prev=""
for ((i = 1; i <= segments; i++)); do
    if ! job=$(segment "$i" "$prev" submit "$@") || [[ ! "$job" =~ ^[0-9]+$ ]]; then
        echo "chain.sh: submitting segment $i failed (output: '${job:-}'); already submitted: ${jobs[*]:-none}" >&2
        exit 1
    fi
    jobs+=("$job")
    prev=$job
    echo "segment $i/$segments: job $job (stop after step ${targets[i - 1]})"
done
echo "chain: jobs ${jobs[*]}; W&B run id $WANDB_RUN_ID; results $RESULTS_DIR"
echo "chain: if a segment fails, Slurm cancels the later ones; resume with CHAIN_CONTINUE=1 RESULTS_DIR=$RESULTS_DIR" \
    "CHAIN_SEGMENTS=<n> CHAIN_STEP_TARGETS=<...,$max_steps> $0 (each segment resumes from the latest checkpoint)"
