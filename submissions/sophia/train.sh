#!/bin/bash -l
#PBS -N train
#PBS -l select=1
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:eagle
#PBS -q by-node
#PBS -A YOUR_PROJECT
#PBS -j oe
# No place=: by-node gives whole nodes, and by-gpu puts every chunk (a GPU) on one node
# (docs/sophia/queueing-and-running-jobs/running-jobs.md), which scatter would contradict.
# One training run on every GPU of the job, on Sophia (ThetaGPU's DGX A100 nodes, 8 A100 per node,
# Open MPI mpirun).
# Written from ALCF's Sophia guide (docs/sophia/ in argonne-lcf/user-guides of 2026-08-19);
# not yet run there.
#
#   qsub -A <project> submissions/sophia/train.sh                         # DDP on 1 node: 8 ranks
#   qsub -A <project> -l select=2 -v EXAMPLE=horovod-pytorch submissions/sophia/train.sh
#   DRY_RUN=1 bash submissions/sophia/train.sh      # print the commands (outside a job: for 1 node)
#   qsub -A <project> -v SCRIPT=$PWD/train.py train.sh # your own script: this file alone will do
# Options, and your own script: submissions/README.md (Sophia, Your own training script).

# PBS runs a copy of this script: the repository is where you ran qsub, or REPO_DIR.
# Not found (this file alone): the block after `else` stands in for plumbing.sh.
for REPO_DIR in "${REPO_DIR:-}" "${PBS_O_WORKDIR:-}" "$(dirname "$0")/../.." "$PWD"; do
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
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # qsub passes no arguments: -v TRAIN_ARGS="..."
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: PyTorch, TensorFlow, Horovod, DeepSpeed and Open MPI from ALCF's conda module ---
MODULE=${MODULE:-conda}  # docs/sophia/ names no version: see module avail conda
step module use /soft/modulefiles
step module load "$MODULE" \
  || fail "'module load $MODULE' failed (the module system's lines above):" \
  "see 'module avail ${MODULE%%/*}' and give another with MODULE=..." \
  "(a system update can leave a module unloadable until ALCF rebuilds it)"
step conda activate base
# Open MPI's mpirun: where conda's environment has none, the module ALCF's Sophia pages load
# before conda to run MPI (docs/sophia/data-science/dask.md); no Sophia page shows a training
# launch, so this is unverified there
[[ "${DRY_RUN:-0}" == 1 ]] || command -v mpirun > /dev/null || step module load compilers/openmpi
refuse_laptop_venv sophia
# pure-Python extras the module lacks (tensorboardX, mlxtend): VENV, a venv on top of the module,
# made with --system-site-packages (ALCF's python.md): torch and MPI stay the module's
if [[ -n "${VENV:-}" ]]; then
  grep -qs "^include-system-site-packages = true" "$VENV/pyvenv.cfg" ||
    fail "VENV=$VENV is not a venv made with --system-site-packages: after 'module load $MODULE'," \
      "python -m venv --system-site-packages $VENV (submissions/README.md)"
  step source "$VENV/bin/activate"
fi
# a module that loads nothing can exit 0 (ezpz's utils.sh): check that python has what the job needs
case "$EXAMPLE" in
  horovod-pytorch) NEEDS=torch,horovod.torch ;;
  horovod-*) NEEDS=tensorflow,horovod.tensorflow ;;
  deepspeed | zero) NEEDS=torch,deepspeed ;;
  *) NEEDS=torch ;;
esac
[[ "${DRY_RUN:-0}" == 1 ]] || python -c "import $NEEDS" 2> /dev/null ||
  fail "python cannot import $NEEDS after 'module load $MODULE': see 'module avail ${MODULE%%/*}'" \
    "and pass another with qsub -v MODULE=..."
[[ "${DRY_RUN:-0}" == 1 || -z "${VENV:-}" ]] ||
  ! python -c "import ${NEEDS%%,*} as m; print(m.__file__)" 2> /dev/null | grep -q "^$VENV/" ||
  fail "VENV=$VENV has a ${NEEDS%%,*} of its own, which hides the module's: install only" \
    "pure-Python extras there (pip install tensorboardX mlxtend)"

# --- data: the compute nodes have no internet (only a proxy); MNIST goes there once, from a login
# node: python3 tools/get_data.py DIR (submissions/README.md); the examples read it with --data-dir
DATA_DIR=${DATA_DIR-${REPO_DIR:+$REPO_DIR/data}}
# or --download fetches it in the job, through ALCF's proxy (docs/polaris/getting-started.md):
# the compute nodes' only way out
if [[ " $* " == *" --download "* ]]; then
  DOWNLOADS=1 PROXY=http://proxy.alcf.anl.gov:3128
  step export HTTP_PROXY="${HTTP_PROXY:-$PROXY}" HTTPS_PROXY="${HTTPS_PROXY:-$PROXY}" \
    http_proxy="${http_proxy:-$PROXY}" https_proxy="${https_proxy:-$PROXY}"
fi

# --- ranks: one per GPU ---------------------------------------------------------------------------
NNODES=$(nodes_in "$PBS_NODEFILE")      # hosts: a by-gpu job's node file names one per GPU chunk
LINES=$(grep -c '[^[:space:]]' "$PBS_NODEFILE" 2>/dev/null || true)
if ((${LINES:-0} > NNODES)); then        # by-gpu (running-jobs.md): one rank per GPU chunk
  RANKS_PER_NODE=${RANKS_PER_NODE:-$((LINES / NNODES))}
fi
RANKS_PER_NODE=${RANKS_PER_NODE:-8}      # by-node: 8 A100 per node
NRANKS=$((NNODES * RANKS_PER_NODE))
step export OMP_NUM_THREADS=16           # 2 x 64 cores, 16 per GPU
# rank 0 runs on the node file's first host (a dry run outside a job: this host), by its name on
# the lab network (<host>.lab.alcf.anl.gov, as ezpz writes it), and listens on 29500 + the job
# number mod 1000: by-gpu jobs share nodes, and so would one port
JOB_NUMBER=${PBS_JOBID%%[!0-9]*}
FIRST_HOST=$(head -n 1 "$PBS_NODEFILE" 2>/dev/null || hostname)
step export MASTER_ADDR="${FIRST_HOST%%.*}${MASTER_DOMAIN-.lab.alcf.anl.gov}" \
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
