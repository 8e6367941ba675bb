#!/bin/bash
#SBATCH -J train
#SBATCH -N 1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -t 00:30:00
#SBATCH -q debug
#SBATCH -A YOUR_PROJECT
#SBATCH -C gpu
#SBATCH -o %x-%j.out
# One training run on every GPU of the job, on a Slurm cluster with 4 GPUs per node, launched with
# srun. Perlmutter-style directives (-C gpu -q debug); elsewhere your site's, e.g. -p batch.
#
#   sbatch -A <project> submissions/slurm/train.sh --epochs 4             # DDP on 1 node: 4 ranks
#   EXAMPLE=deepspeed sbatch -A <project> -N 2 submissions/slurm/train.sh
#   DRY_RUN=1 bash submissions/slurm/train.sh        # print the commands (inside a job: salloc ...)
#   SCRIPT=$PWD/train.py sbatch -A <project> train.sh  # your own script: this file alone will do
# Options, and your own script: submissions/README.md (Slurm, Your own training script).

# Slurm runs a copy of this script in the folder you ran sbatch from: the repository, or REPO_DIR.
# Not found (this file alone): the block after `else` stands in for plumbing.sh.
for REPO_DIR in "${REPO_DIR:-}" "$PWD" "$(dirname "$0")/../.."; do
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

# --- environment: your cluster's framework module ---------------------------------------------
# (ENV_SETUP replaces it, e.g. ENV_SETUP="source ~/torch/bin/activate")
step eval "${ENV_SETUP:-module load pytorch}"
refuse_laptop_venv slurm

# --- ranks: --ntasks-per-node on each node of the job ---------------------------------------------
NNODES=${SLURM_JOB_NUM_NODES:?run this inside a Slurm job (sbatch, or salloc)}
RANKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-4}
NRANKS=$((NNODES * RANKS_PER_NODE))
DEPTH=$((${SLURM_CPUS_ON_NODE:-$(nproc)} / RANKS_PER_NODE))  # the node's cores shared by its ranks
((DEPTH >= 1)) || DEPTH=1
step export OMP_NUM_THREADS="$DEPTH"
# every rank meets rank 0 on the job's first node
step export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"

# --- launch: all ranks at once (scale.sh: one run at 1, 2, 4, ... ranks each) ---------------------
# --kill-on-bad-exit: a rank that fails ends the step at once, instead of the others waiting for it
RANKS=$(ranks_to_run "$NRANKS")  # all at once; scale.sh: 1 2 4 ...
for NRANKS in $RANKS; do
  PPN=$((NRANKS < RANKS_PER_NODE ? NRANKS : RANKS_PER_NODE))
  new_run slurm "$NRANKS" "$PPN"  # RUN_DIR; COURSE_FLAGS for the examples
  launch srun -N "$(((NRANKS + PPN - 1) / PPN))" -n "$NRANKS" --ntasks-per-node "$PPN" \
    --cpus-per-task "$DEPTH" --cpu-bind=cores --kill-on-bad-exit=1 \
    python "$SCRIPT" "${COURSE_FLAGS[@]}" "$@"
done
