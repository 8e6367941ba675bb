#!/bin/bash -l
#PBS -N train
#PBS -l select=1
#PBS -l place=scatter
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:flare
#PBS -k doe
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# One training run on every GPU tile of the job, on Aurora (6 Intel GPU Max per node = 12 tiles,
# Cray MPICH mpiexec, PyTorch's xccl backend over oneCCL).
# Written from ALCF's Aurora guides (docs/aurora/ in argonne-lcf/user-guides of 2026-08-19);
# not yet run there.
#
#   qsub -A <project> submissions/aurora/train.sh                         # DDP on 1 node: 12 ranks
#   qsub -A <project> -l select=2 -v EXAMPLE=deepspeed submissions/aurora/train.sh
#   qsub -A <project> -v TRAIN_ARGS="--epochs 4" submissions/aurora/train.sh
#   DRY_RUN=1 bash submissions/aurora/train.sh      # print the commands (outside a job: for 1 node)
#   qsub -A <project> -v SCRIPT=$PWD/train.py train.sh # your own script: this file alone will do
# Options, and your own script: submissions/README.md (Aurora, Your own training script).

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
case "$EXAMPLE" in  # Horovod is not on Aurora: say so before anything is loaded or launched
  horovod-pytorch) fail "Horovod for PyTorch is no longer in Aurora's frameworks module" \
    "(ALCF's PyTorch guide, 2026): on Aurora use DDP, EXAMPLE=ddp (xccl backend)" ;;
  horovod-*) fail "the Horovod TensorFlow examples have no Intel GPU path (--device xpu stops" \
    "in the Horovod TensorFlow lesson): on Aurora use DDP, EXAMPLE=ddp (xccl backend)" ;;
esac
SCRIPT=${SCRIPT:-$(example_script "$EXAMPLE")}  # yours: SCRIPT=/path/to/train.py
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # qsub passes no arguments: -v TRAIN_ARGS="..."
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: PyTorch (xpu, xccl), DeepSpeed and MPI from ALCF's frameworks module ------------
MODULE=${MODULE:-frameworks/2025.3.1}  # as in docs/aurora/data-science/frameworks/pytorch.md
step module load "$MODULE" \
  || fail "'module load $MODULE' failed (the module system's lines above):" \
  "see 'module avail ${MODULE%%/*}' and give another with MODULE=..." \
  "(a system update can leave a module unloadable until ALCF rebuilds it)"
refuse_laptop_venv aurora
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

# --- ranks: one per GPU tile ----------------------------------------------------------------------
NNODES=$(nodes_in "$PBS_NODEFILE")
RANKS_PER_NODE=${RANKS_PER_NODE:-12}     # 6 GPUs x 2 tiles, each tile its own device (FLAT)
NRANKS=$((NNODES * RANKS_PER_NODE))
# 4 cores per rank, ranks 0-5 on socket 0 and 6-11 on socket 1, and one more core per rank for its
# oneCCL worker thread, outside that list (frameworks/pytorch.md and oneCCL.md pair the two;
# oneCCL's own default cores 42-47 and 94-99 would sit inside a list of 8 cores per rank)
CPU_BIND=list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79
step export OMP_NUM_THREADS=4 ZE_FLAT_DEVICE_HIERARCHY=FLAT
if ((RANKS_PER_NODE == 12)); then  # (other layouts: oneCCL picks its cores itself)
  step export CCL_WORKER_AFFINITY=42,43,44,45,46,47,94,95,96,97,98,99
fi

# --- oneCCL under xccl, as ALCF's PyTorch guide sets it; ranks meet at the first node -------------
step export CCL_PROCESS_LAUNCHER=pmix CCL_ATL_TRANSPORT=mpi CCL_KVS_MODE=mpi \
  FI_MR_CACHE_MONITOR=userfaultfd
if ((NNODES > 1)); then step export CCL_KVS_CONNECTION_TIMEOUT=300; fi  # many nodes start slowly
# rank 0 runs on the node file's first host (a dry run outside a job: this host), reached over the
# Slingshot network: the node file names the management one (x...n0.hostmgmt2000.cm...), ALCF's
# PyTorch guide (frameworks/pytorch.md) and ezpz use <host>.hsn.cm.aurora.alcf.anl.gov
FIRST_HOST=$(head -n 1 "$PBS_NODEFILE" 2>/dev/null || hostname)
step export MASTER_ADDR="${FIRST_HOST%%.*}${MASTER_DOMAIN-.hsn.cm.aurora.alcf.anl.gov}"

# --- launch: all ranks at once (scale.sh: one run at 1, 2, 4, ... ranks each) ---------------------
RANKS=$(ranks_to_run "$NRANKS")  # all at once; scale.sh: 1 2 4 ...
for NRANKS in $RANKS; do
  PPN=$((NRANKS < RANKS_PER_NODE ? NRANKS : RANKS_PER_NODE))
  new_run aurora "$NRANKS" "$PPN"  # RUN_DIR; COURSE_FLAGS for the examples
  launch mpiexec -n "$NRANKS" --ppn "$PPN" --cpu-bind "$CPU_BIND" \
    python "$SCRIPT" "${COURSE_FLAGS[@]}" "$@"
done
