#!/bin/bash -l
#PBS -N train
#PBS -l select=1:system=polaris
#PBS -l place=scatter
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:eagle
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# One training run on every GPU of the job, on Polaris (4 A100 per node, Cray MPICH mpiexec).
# Written from ALCF's Polaris guide (docs/polaris/ in argonne-lcf/user-guides of 2026-08-19);
# not yet run there.
#
#   qsub -A <project> submissions/polaris/train.sh                        # DDP on 1 node: 4 ranks
#   qsub -A <project> -l select=2:system=polaris -v EXAMPLE=deepspeed submissions/polaris/train.sh
#   qsub -A <project> -v TRAIN_ARGS="--epochs 4" submissions/polaris/train.sh
#   DRY_RUN=1 bash submissions/polaris/train.sh     # print the commands (outside a job: for 1 node)
#   qsub -A <project> -v SCRIPT=$PWD/train.py train.sh # your own script: this file alone will do
# Options, and your own script: submissions/README.md (Polaris, Your own training script).

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
case "$EXAMPLE" in  # Horovod is not in Polaris' conda module: say so before anything is loaded
  horovod-*) fail "Horovod has not been in Polaris' conda module since conda/2025-09-25" \
    "(polaris/system-updates.md); conda/2024-04-29 has it, with torch 2.3, older than the" \
    "lessons need (2.7): on Polaris use EXAMPLE=ddp or EXAMPLE=deepspeed" ;;
esac
SCRIPT=${SCRIPT:-$(example_script "$EXAMPLE")}  # yours: SCRIPT=/path/to/train.py
read -r -a TRAIN_ARGS <<< "${TRAIN_ARGS:-}"  # qsub passes no arguments: -v TRAIN_ARGS="..."
set -- "${TRAIN_ARGS[@]}" "$@"

# --- environment: PyTorch, TensorFlow, DeepSpeed and MPI from ALCF's conda module -----------------
# conda/2025-09-25: the default since 2025-10-24 (docs/polaris/system-updates.md)
MODULE=${MODULE:-conda/2025-09-25}
step module use /soft/modulefiles
step module load "$MODULE" \
  || fail "'module load $MODULE' failed (the module system's lines above):" \
  "see 'module avail ${MODULE%%/*}' and give another with MODULE=..." \
  "(a system update can leave a module unloadable until ALCF rebuilds it)"
step conda activate
refuse_laptop_venv polaris
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
NNODES=$(nodes_in "$PBS_NODEFILE")
RANKS_PER_NODE=${RANKS_PER_NODE:-4}      # 4 A100 per node
NRANKS=$((NNODES * RANKS_PER_NODE))
DEPTH=$((32 / RANKS_PER_NODE))           # the node's 32 cores shared by its ranks: 8 each
step export OMP_NUM_THREADS="$DEPTH"
# rank 0 runs on the node file's first host (a dry run outside a job: this host), reached over the
# Slingshot network: <host>.hsn.cm.polaris.alcf.anl.gov, as ALCF's Polaris DDP examples
# (argonne-lcf/ai-science-training-series, 01-AI-at-Scale, 2025)
FIRST_HOST=$(head -n 1 "$PBS_NODEFILE" 2>/dev/null || hostname)
step export MASTER_ADDR="${FIRST_HOST%%.*}${MASTER_DOMAIN-.hsn.cm.polaris.alcf.anl.gov}"

# --- NCCL between nodes: ALCF's recommended settings, opt-in (qsub -v POLARIS_NCCL_TUNING=1) ------
OFI_NCCL=${POLARIS_OFI_NCCL_DIR:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}
if [[ "${POLARIS_NCCL_TUNING:-0}" == 1 ]]; then
  [[ -d "$OFI_NCCL" || "${DRY_RUN:-0}" == 1 ]] ||
    fail "no aws-ofi-nccl plugin in $OFI_NCCL (set POLARIS_OFI_NCCL_DIR to its lib folder)"
  step export NCCL_NET_GDR_LEVEL=PHB NCCL_CROSS_NIC=1 NCCL_COLLNET_ENABLE=1 \
    NCCL_NET="AWS Libfabric" \
    LD_LIBRARY_PATH="$OFI_NCCL:/soft/libraries/hwloc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    FI_CXI_DISABLE_HOST_REGISTER=1 FI_MR_CACHE_MONITOR=userfaultfd FI_CXI_DEFAULT_CQ_SIZE=131072
fi

# --- launch: all ranks at once (scale.sh: one run at 1, 2, 4, ... ranks each) ---------------------
# each rank's GPU: ALCF's set_affinity_gpu_polaris.sh, the repository's (this file alone: the one in
# the folder you run qsub from, as ALCF's guide has it)
AFFINITY_DIR=${REPO_DIR:+$REPO_DIR/submissions/polaris}
AFFINITY_DIR=${AFFINITY_DIR:-${PBS_O_WORKDIR:-$PWD}}
RANKS=$(ranks_to_run "$NRANKS")  # all at once; scale.sh: 1 2 4 ...
for NRANKS in $RANKS; do
  PPN=$((NRANKS < RANKS_PER_NODE ? NRANKS : RANKS_PER_NODE))
  new_run polaris "$NRANKS" "$PPN"  # RUN_DIR; COURSE_FLAGS for the examples
  launch mpiexec -n "$NRANKS" --ppn "$PPN" --depth "$DEPTH" --cpu-bind depth \
    "$AFFINITY_DIR"/set_affinity_gpu_polaris.sh \
    python "$SCRIPT" "${COURSE_FLAGS[@]}" "$@"
done
