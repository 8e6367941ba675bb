#!/bin/bash -l
#PBS -N train
#PBS -l select=1
#PBS -l place=scatter
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:eagle
#PBS -q by-node
#PBS -A YOUR_PROJECT
#PBS -j oe
# One training run on every GPU of the job, on Sophia (ThetaGPU's DGX A100 nodes, 8 A100 per node,
# Open MPI mpirun).
# Written from ALCF's Sophia guide as read on 2026-11-25; not yet run there.
#
#   qsub -A <project> submissions/sophia/train.sh                         # DDP on 1 node: 8 ranks
#   qsub -A <project> -l select=2 -v EXAMPLE=horovod-pytorch submissions/sophia/train.sh
#   DRY_RUN=1 bash submissions/sophia/train.sh      # print the commands (outside a job: for 1 node)
# Your own training script: change the SCRIPT= line. Options: submissions/README.md (Sophia).

# PBS runs a copy of this script: the repository is where you ran qsub, or REPO_DIR.
for REPO_DIR in "${REPO_DIR:-}" "${PBS_O_WORKDIR:-}" "$(dirname "$0")/../.." "$PWD"; do
  [[ -f "$REPO_DIR/submissions/plumbing.sh" ]] && break
done
[[ -f "$REPO_DIR/submissions/plumbing.sh" ]] ||
  { echo "error: repository not found: qsub from inside it, or set REPO_DIR" >&2; exit 1; }
# shellcheck source=submissions/plumbing.sh
source "$REPO_DIR/submissions/plumbing.sh"  # dry run, log folders, end-of-job report

# --- what runs ------------------------------------------------------------------------------------
EXAMPLE=${EXAMPLE:-ddp}
SCRIPT=$(example_script "$EXAMPLE")  # your own: SCRIPT=/path/to/train.py
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # qsub passes no arguments: -v TRAIN_ARGS="..."
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: PyTorch, TensorFlow, Horovod, DeepSpeed and Open MPI from ALCF's conda module ---
step module use /soft/modulefiles
step module load conda
step conda activate base
refuse_laptop_venv sophia

# --- ranks: one per GPU ---------------------------------------------------------------------------
NNODES=$(nodes_in "$PBS_NODEFILE")
RANKS_PER_NODE=${RANKS_PER_NODE:-8}      # 8 A100 per node (a by-gpu job: the GPUs you asked for)
NRANKS=$((NNODES * RANKS_PER_NODE))
step export OMP_NUM_THREADS=16           # 2 x 64 cores, 16 per GPU
# rank 0 runs on the node file's first host (a dry run outside a job: this host)
# and listens on 29500 + the job number mod 1000: by-gpu jobs share nodes, and so would one port
JOB_NUMBER=${PBS_JOBID%%[!0-9]*}
step export MASTER_ADDR="$(head -n 1 "$PBS_NODEFILE" 2>/dev/null || hostname)" \
  MASTER_PORT="${MASTER_PORT:-$((29500 + 10#${JOB_NUMBER:-0} % 1000))}"

# --- launch: all ranks at once (scale.sh: one run at 1, 2, 4, ... ranks each) ---------------------
# Open MPI passes no environment on by itself (Cray MPICH's mpiexec and srun pass all of it): -x
# names what the ranks need, and these where set: libraries, conda, the course's COURSE_VERBOSE=1
# and TensorFlow's log level
FORWARD=()
for name in LD_LIBRARY_PATH PYTHONPATH CONDA_PREFIX COURSE_VERBOSE TF_CPP_MIN_LOG_LEVEL; do
  if [[ -n "$(printenv "$name")" ]]; then FORWARD+=(-x "$name"); fi
done
RANKS=$(ranks_to_run "$NRANKS")  # all at once; scale.sh: 1 2 4 ...
for NRANKS in $RANKS; do
  PPN=$((NRANKS < RANKS_PER_NODE ? NRANKS : RANKS_PER_NODE))
  new_run sophia "$NRANKS" "$PPN"  # RUN_DIR; COURSE_FLAGS for the examples
  launch mpirun -n "$NRANKS" -N "$PPN" --hostfile "$PBS_NODEFILE" -x PATH -x OMP_NUM_THREADS \
    -x MASTER_ADDR -x MASTER_PORT "${FORWARD[@]}" python "$SCRIPT" "${COURSE_FLAGS[@]}" "$@"
done
