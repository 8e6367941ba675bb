#!/usr/bin/env bash
# One training run on a workstation or laptop, NRANKS processes (default 2) with the course's .venv
# (`make setup`): its mpiexec (MPICH) starts every example.
#
#   bash submissions/local/train.sh --epochs 1
#   EXAMPLE=horovod-pytorch NRANKS=4 bash submissions/local/train.sh
#   DRY_RUN=1 bash submissions/local/train.sh        # print the commands
# Your own training script: change the SCRIPT= line.

REPO_DIR=${REPO_DIR:-$(dirname "$0")/../..}
# shellcheck source=submissions/plumbing.sh
source "$REPO_DIR/submissions/plumbing.sh"  # dry run, log folders, end-of-job report

# --- what runs ------------------------------------------------------------------------------------
EXAMPLE=${EXAMPLE:-ddp}
SCRIPT=$(example_script "$EXAMPLE")  # your own: SCRIPT=/path/to/train.py
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # extra flags (arguments after the script work too)
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: the course's .venv (ALCF machines: their modules, submissions/aurora ...) ---
[[ ! -d /soft/modulefiles ]] || fail "an ALCF machine: use submissions/aurora, polaris or sophia"
step source "${VENV:-$REPO_DIR/.venv}/bin/activate"

# --- ranks: NRANKS processes on this machine, its cores shared among them -------------------------
NRANKS=${NRANKS:-2}
THREADS=$(($(nproc) / NRANKS))
step export OMP_NUM_THREADS=$((THREADS > 0 ? THREADS : 1))

# --- launch: all ranks at once (scale.sh: one run at 1, 2, 4, ... ranks each) ---------------------
RANKS=$(ranks_to_run "$NRANKS")  # all at once; scale.sh: 1 2 4 ...
for NRANKS in $RANKS; do
  new_run local "$NRANKS" "$NRANKS"  # RUN_DIR; COURSE_FLAGS for the examples
  launch mpiexec -n "$NRANKS" python "$SCRIPT" "${COURSE_FLAGS[@]}" "$@"
done
