#!/usr/bin/env bash
# One training run on a workstation or laptop, NRANKS processes (default 2) with the course's .venv
# (`make setup`): its mpiexec (MPICH) starts every example.
#
#   bash submissions/local/train.sh --epochs 1
#   EXAMPLE=horovod-pytorch NRANKS=4 bash submissions/local/train.sh
#   DRY_RUN=1 bash submissions/local/train.sh        # print the commands
#   SCRIPT=train.py VENV=~/my-venv bash train.sh     # your own script: this file alone will do
# Your own script: submissions/README.md (Your own training script).

# The repository: REPO_DIR, or two folders up from this script. Not found (this file alone): the
# block after `else` stands in for plumbing.sh.
for REPO_DIR in "${REPO_DIR:-}" "$(dirname "$0")/../.."; do
  [[ -f "$REPO_DIR/submissions/plumbing.sh" ]] && break
done
if [[ -f "$REPO_DIR/submissions/plumbing.sh" ]]; then
  # shellcheck source=submissions/plumbing.sh
  source "$REPO_DIR/submissions/plumbing.sh"  # dry run, log folders, end-of-job report
else  # this file alone (submissions/README.md): it runs SCRIPT; no examples, sweep or report
  set -eo pipefail; REPO_DIR=
  dry() { [[ "${DRY_RUN:-0}" == 1 ]]; }
  if dry; then echo "dry run: nothing is executed"; fi
  fail() { echo "error: $*" >&2; exit 1; }
  example_script() { fail "SCRIPT=/path/to/train.py is needed: no course repository here"; }
  show() { local w; printf -v w ' %q' "$@"; if dry; then echo "${w:1}"; else echo "+$w"; fi; }
  step() { show "$@"; if ! dry || [[ "$1" == export ]]; then "$@"; fi; }
  nodes_in() {  # a dry run without a node file: 1
    if [[ -r "$1" ]]; then grep -c . "$1"; elif dry; then echo 1; else fail "no node file '$1'"; fi
  }
  ranks_to_run() { [[ "${SWEEP:-0}" != 1 ]] || fail "scale.sh needs the repository"; echo "$1"; }
  refuse_laptop_venv() { :; }  # the course's laptop .venv lives in its repository
  new_run() {  # RUN_DIR=runs/<machine>/<script's name>/<job id>.n<ranks>, made by launch
    local id=${PBS_JOBID:-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}
    RUN_DIR=${RUNS_DIR:-${PBS_O_WORKDIR:-$PWD}/runs}/$1/$(basename "${SCRIPT%.*}")/${id%%.*}.n$2
    COURSE_FLAGS=(); echo "# $2 rank(s), $3 per node, log dir $RUN_DIR"
  }
  launch() {
    local w
    for w in "$@"; do  # the files it names up to the script (not the script's arguments) must exist
      if [[ ("$w" == */* && "$w" != -*) || "$w" == "$SCRIPT" ]] && [[ ! -e "$w" ]]; then
        fail "no such file: $w (named on the launch line)"
      fi
      if [[ "$w" == "$SCRIPT" ]]; then break; fi
    done
    show "$@"; if dry; then return; fi
    mkdir -p "$RUN_DIR"; "$@" < /dev/null 2>&1 | tee "$RUN_DIR/output.log"
  }
fi

# --- what runs ------------------------------------------------------------------------------------
EXAMPLE=${EXAMPLE:-ddp}
SCRIPT=${SCRIPT:-$(example_script "$EXAMPLE")}  # yours: SCRIPT=/path/to/train.py
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # extra flags (arguments after the script work too)
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: the course's .venv (ALCF machines: their modules, submissions/aurora ...) ---
# (this file alone: VENV=/path/to/venv, or the python and mpiexec already on PATH)
[[ ! -d /soft/modulefiles ]] || fail "an ALCF machine: use submissions/aurora, polaris or sophia"
[[ -z "${VENV:-$REPO_DIR}" ]] || step source "${VENV:-$REPO_DIR/.venv}/bin/activate"

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
