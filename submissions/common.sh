# shellcheck shell=bash
# Shared logic of every job script in submissions/: sourced, not copied.
#
# A job script holds its scheduler's directives, sets MACHINE and EXAMPLE, finds the repository,
# sources this file and calls `sdl_main "$@"` (one run on the whole allocation) or `sdl_sweep "$@"`
# (1, 2, 4, ... ranks, each run in its own log dir). Everything below can be changed without editing a
# script, through environment variables (qsub -v / sbatch --export / export in an interactive job):
#
#   TRAIN_ARGS       extra flags for main.py, e.g. "--epochs 4 --batch-size 128" (or pass them as arguments)
#   RANKS_PER_NODE   ranks on each node (aurora 12, one per GPU tile; sophia 8, or the GPUs a by-gpu job lists
#                    in CUDA_VISIBLE_DEVICES; polaris 4; thetagpu 8; theta 4; slurm 4); NRANKS on `local` (2)
#   THREADS_PER_RANK CPU threads per rank (default: the node's cores shared by its ranks; aurora: 8, the cores
#                    of each rank's entry in the binding list)
#   DEVICE           --device for main.py (aurora: xpu; sophia/polaris/thetagpu: cuda; theta: cpu;
#                    slurm/local: auto); the backend stays `auto` (xccl on xpu, nccl on cuda, gloo on cpu)
#   CPU_BIND         aurora/polaris: mpiexec's --cpu-bind (aurora: list of 8 cores per rank from ALCF's
#                    running-jobs page; polaris: depth, 8 cores per rank; e.g. list:0,1:8,9:16,17:24,25)
#   AURORA_CCL=0     aurora: leave out the oneCCL/libfabric settings of ALCF's PyTorch guide (README, Aurora)
#   POLARIS_NCCL_TUNING=1  polaris: add the NCCL/libfabric settings of ALCF's guide (README, Polaris), with
#                    the aws-ofi-nccl plugin from POLARIS_OFI_NCCL_DIR and the hwloc it needs (POLARIS_HWLOC_DIR)
#   ENV_SETUP        shell code that sets up Python + frameworks + MPI instead of the machine's default
#                    (ENV_SETUP=: when the current shell is already set up)
#   PYTHON           the Python that runs main.py (default: `python` after ENV_SETUP; the .venv's on `local`)
#   RUNS_DIR         where log dirs go (default <repo>/runs)
#   SWEEP_RANKS      rank counts for sdl_sweep (default: 1 2 4 ... up to the allocation)
#   EXAMPLE          which example a scale.sh sweep runs: ddp (default), horovod-pytorch,
#                    horovod-tensorflow, deepspeed
#   LAUNCHER         `local` only: mpiexec (default), torchrun, deepspeed, horovodrun
#   DRY_RUN=1        print the plan and the launch commands, run nothing
#
# Theta and ThetaGPU were retired on 2023-12-31: their scripts still work as references and warn when run.
# Polaris GPU affinity is also here: `bash common.sh gpu-affinity CMD...` (what polaris/*.sh put between
# mpiexec and python) sets CUDA_VISIBLE_DEVICES from the rank's local rank, then runs CMD.

SDL_COMMON="${BASH_SOURCE[0]}"
SDL_EXAMPLES=(ddp horovod-pytorch horovod-tensorflow deepspeed)

sdl_die() { echo "error: $*" >&2; exit 1; }
sdl_say() { echo "[submissions] $*"; }
sdl_warn() { echo "[submissions] warning: $*" >&2; }

sdl_machine_name() {
  case "$1" in
    aurora) echo Aurora ;; sophia) echo Sophia ;; polaris) echo Polaris ;; theta) echo Theta ;;
    thetagpu) echo ThetaGPU ;; slurm) echo Slurm ;; *) echo "$1" ;;
  esac
}

# The launch line as something to paste into a shell: words with spaces or quotes are single-quoted.
sdl_show() {
  local w out=() q="'"
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$w"); else out+=("$q${w//$q/$q\\$q$q}$q"); fi
  done
  echo "${out[*]}"
}

# --- the examples --------------------------------------------------------------------------------------
sdl_example_script() {
  case "$1" in
    ddp) echo DDP/main.py ;;
    horovod-pytorch) echo horovod/pytorch/main.py ;;
    horovod-tensorflow) echo horovod/tensorflow/main.py ;;
    deepspeed) echo deepspeed/main.py ;;
    *) return 1 ;;
  esac
}

sdl_example_framework() { if [[ "$1" == horovod-tensorflow ]]; then echo tensorflow; else echo pytorch; fi; }

# --- rank arithmetic -------------------------------------------------------------------------------------
sdl_is_count() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

# Nodes in a nodefile: one host per non-empty line (PBS_NODEFILE on Aurora, Polaris and Sophia, COBALT_NODEFILE
# on ThetaGPU).
sdl_count_nodes() {
  [[ -r "$1" ]] || sdl_die "nodefile '$1' is missing or unreadable (is this running inside a job?)"
  grep -c '[^[:space:]]' "$1" || true
}

# Nodes of this job, from the scheduler's environment.
sdl_job_nodes() {
  case "$MACHINE" in
    theta) echo "${COBALT_JOBSIZE:?COBALT_JOBSIZE is not set: run this inside a Cobalt job on Theta}" ;;
    thetagpu) sdl_count_nodes "${COBALT_NODEFILE:?COBALT_NODEFILE is not set: run this inside a Cobalt job on ThetaGPU}" ;;
    aurora | sophia | polaris)
      [[ -n "${PBS_NODEFILE:-}" ]] || sdl_die "PBS_NODEFILE is not set: run this inside a PBS job on $(sdl_machine_name "$MACHINE")"
      sdl_count_nodes "$PBS_NODEFILE" ;;
    slurm) echo "${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?SLURM_JOB_NUM_NODES is not set: run this inside a Slurm job}}" ;;
    local) echo 1 ;;
    *) sdl_die "unknown MACHINE '$MACHINE'" ;;
  esac
}

# 1 2 4 ... up to MAX, and MAX itself when it is not a power of two.
sdl_sweep_list() {
  local max=$1 n=1 out=()
  while ((n < max)); do out+=("$n"); n=$((n * 2)); done
  out+=("$max")
  echo "${out[*]}"
}

# How n ranks are laid out: SDL_PPN ranks on each of SDL_NODES nodes (filling nodes first).
sdl_layout() {
  local n=$1
  SDL_PPN=$((n < RANKS_PER_NODE ? n : RANKS_PER_NODE))
  SDL_NODES=$(((n + SDL_PPN - 1) / SDL_PPN))
}

# --- machine defaults ------------------------------------------------------------------------------------
# Aurora's CPU binding, from ALCF's running-jobs page: 8 cores per rank, ranks 0-5 on socket 0 (cores 1-48),
# ranks 6-11 on socket 1 (cores 53-100); cores 0 and 52, the first of each socket, stay with the system.
# With fewer ranks per node each keeps its entry (the first ones). Why this list: submissions/README.md, Aurora.
SDL_AURORA_CPU_LIST=(1-8 9-16 17-24 25-32 33-40 41-48 53-60 61-68 69-76 77-84 85-92 93-100)

# The aws-ofi-nccl plugin that POLARIS_NCCL_TUNING=1 puts on LD_LIBRARY_PATH (ALCF's Polaris guide; it moves
# with Polaris' software: `ls /soft/libraries/aws-ofi-nccl` there, and set POLARIS_OFI_NCCL_DIR).
sdl_polaris_ofi_dir() { echo "${POLARIS_OFI_NCCL_DIR:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}"; }

# A 0/1 setting: NAME is 0 or 1 (DEFAULT when unset or empty), else one error line.
sdl_is_switch() {
  local value=${!1:-$2}
  [[ "$value" == 0 || "$value" == 1 ]] || sdl_die "$1 must be 0 or 1, got '$value'"
}

sdl_machine_defaults() {
  local framework
  framework=$(sdl_example_framework "$EXAMPLE")
  case "$MACHINE" in
    aurora)  # 2 x 52-core Xeon Max, 6 GPU Max = 12 tiles (ZE_FLAT_DEVICE_HIERARCHY=FLAT): one rank per tile
      : "${RANKS_PER_NODE:=12}" "${DEVICE:=xpu}"
      SDL_CPUS_PER_NODE=96  # the 12 entries x 8 cores of the binding list (cores 0 and 52 left to the system)
      SDL_DEFAULT_SETUP='module load frameworks' ;;
    sophia)  # DGX A100 (ThetaGPU's nodes): 8 GPUs, 2 x 64 cores; a by-gpu job gets some of the GPUs
      local gpus=8
      if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .); fi
      : "${RANKS_PER_NODE:=$gpus}" "${DEVICE:=cuda}"
      SDL_CPUS_PER_NODE=$((16 * gpus))  # 16 cores per GPU: a by-gpu job shares its node
      SDL_DEFAULT_SETUP='module use /soft/modulefiles; module load conda; conda activate base' ;;
    theta)  # KNL: 64 cores x 4 hardware threads; aprun -j 2 uses 2 of them, so 128 CPUs to share
      : "${RANKS_PER_NODE:=4}" "${DEVICE:=cpu}"
      SDL_CPUS_PER_NODE=128
      SDL_DEFAULT_SETUP="module load ${THETA_MODULES:-conda/2021-09-22}" ;;
    thetagpu)  # DGX A100: 8 GPUs, 2 x 64 cores
      : "${RANKS_PER_NODE:=8}" "${DEVICE:=cuda}"
      SDL_CPUS_PER_NODE=128
      SDL_DEFAULT_SETUP='module load conda; conda activate' ;;
    polaris)  # 4 A100, one 32-core Milan; --depth counts these 32 cores
      : "${RANKS_PER_NODE:=4}" "${DEVICE:=cuda}"
      SDL_CPUS_PER_NODE=32
      SDL_DEFAULT_SETUP='module use /soft/modulefiles; module load conda; conda activate' ;;
    slurm)
      : "${RANKS_PER_NODE:=${SLURM_NTASKS_PER_NODE:-4}}" "${DEVICE:=auto}"
      SDL_CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
      SDL_DEFAULT_SETUP="module load $framework" ;;
    local)
      : "${NRANKS:=2}" "${DEVICE:=auto}"
      : "${RANKS_PER_NODE:=$NRANKS}"
      SDL_CPUS_PER_NODE=$(nproc)
      SDL_DEFAULT_SETUP="" ;;
    *) sdl_die "unknown MACHINE '$MACHINE' (aurora, sophia, polaris, theta, thetagpu, slurm, local)" ;;
  esac
  sdl_is_count "$RANKS_PER_NODE" || sdl_die "RANKS_PER_NODE must be a positive integer, got '$RANKS_PER_NODE'"
  SDL_DEPTH=$((SDL_CPUS_PER_NODE / RANKS_PER_NODE))
  ((SDL_DEPTH >= 1)) || SDL_DEPTH=1
  case "$MACHINE" in
    aurora)
      ((RANKS_PER_NODE <= ${#SDL_AURORA_CPU_LIST[@]})) ||
        sdl_die "RANKS_PER_NODE on Aurora is at most ${#SDL_AURORA_CPU_LIST[@]} (one rank per GPU tile), got $RANKS_PER_NODE"
      SDL_DEPTH=8  # each rank keeps its 8 cores of the list, however many ranks share the node
      sdl_is_switch AURORA_CCL 1 ;;
    polaris)
      sdl_is_switch POLARIS_NCCL_TUNING 0
      if [[ "${POLARIS_NCCL_TUNING:-0}" == 1 && "${DRY_RUN:-0}" != 1 && ! -d "$(sdl_polaris_ofi_dir)" ]]; then
        sdl_die "POLARIS_NCCL_TUNING=1: no aws-ofi-nccl plugin in $(sdl_polaris_ofi_dir) (set POLARIS_OFI_NCCL_DIR to its lib directory, or leave the tuning off)"
      fi ;;
  esac
  : "${THREADS_PER_RANK:=$SDL_DEPTH}"
  sdl_is_count "$THREADS_PER_RANK" || sdl_die "THREADS_PER_RANK must be a positive integer, got '$THREADS_PER_RANK'"
}

# --- environment -----------------------------------------------------------------------------------------
# On ALCF machines the frameworks and the MPI (Aurora's and Polaris' MPICH, Sophia's Open MPI) come from the modules; the laptop .venv (PyPI
# torch builds + the PyPI mpich wheel) would shadow them and break multi-node MPI. Refuse it loudly.
sdl_refuse_laptop_venv() {
  local what path
  for what in "$PYTHON" mpiexec mpirun; do
    path=$(command -v "$what" 2>/dev/null) || continue
    case "$path" in
      "$REPO_DIR"/.venv/*) sdl_die "'$what' is $path: the repo's laptop .venv must not be used on $MACHINE. Open a new shell (no 'source .venv/bin/activate', no .venv/bin on PATH) and let ENV_SETUP load the modules." ;;
    esac
  done
  if [[ "${VIRTUAL_ENV:-}" == "$REPO_DIR/.venv" ]]; then
    sdl_die "VIRTUAL_ENV is the repo's laptop .venv: run 'deactivate' first; on $MACHINE use the modules"
  fi
}

sdl_setup_env() {
  local setup=${ENV_SETUP:-$SDL_DEFAULT_SETUP}
  if [[ "$MACHINE" == local ]]; then
    if [[ -z "${SCALING_DL_FORCE_VENV:-}" ]] && { [[ -d /soft/modulefiles ]] || [[ -d /lus/eagle ]] || [[ -d /lus/flare ]] || [[ -d /lus/theta-fs0 ]]; }; then
      sdl_die "this looks like an ALCF machine: use submissions/aurora, polaris or sophia, not submissions/local"
    fi
    local venv=${VENV:-$REPO_DIR/.venv}
    [[ -x "$venv/bin/python" ]] && export PATH="$venv/bin:$PATH"
    : "${PYTHON:=$(command -v python || command -v python3)}"
  fi
  if [[ -n "$setup" ]]; then
    sdl_say "environment: $setup"
    if [[ "${DRY_RUN:-0}" != 1 ]]; then
      # A batch shell that is not a login shell may lack `module` (ThetaGPU's Lmod needs its init script).
      if [[ -z "$(type -t module)" && -f /etc/profile.d/z00_lmod.sh ]]; then
        # shellcheck source=/dev/null
        source /etc/profile.d/z00_lmod.sh
      fi
      # Module and conda scripts are not written for `set -u`.
      set +u
      eval "$setup" || sdl_die "ENV_SETUP failed: $setup"
      set -u
    fi
  fi
  : "${PYTHON:=python}"
  [[ "$MACHINE" == local ]] || sdl_refuse_laptop_venv
}

# --- log dirs --------------------------------------------------------------------------------------------
sdl_job_id() {
  local id=${COBALT_JOBID:-${PBS_JOBID:-${SLURM_JOB_ID:-}}}
  if [[ -n "$id" ]]; then echo "${id%%.*}"; else date +%Y%m%d-%H%M%S; fi
}

# A fresh directory name: BASE, else BASE.2, BASE.3, ... (several runs in one interactive job).
sdl_fresh_dir() {
  local dir=$1 i=2
  while [[ -e "$dir" ]]; do dir="$1.$i"; i=$((i + 1)); done
  echo "$dir"
}

# --- launching -------------------------------------------------------------------------------------------
sdl_first_host() { grep -m 1 '[^[:space:]]' "$1" | tr -d '[:space:]'; }

# NAME=DEFAULT -> NAME=<the environment's NAME if set, else DEFAULT>: an exported value wins.
sdl_env_default() {
  local name=${1%%=*}
  echo "$name=${!name:-${1#*=}}"
}

# Aurora's --cpu-bind for PPN ranks per node: the first PPN entries of the list.
sdl_aurora_cpu_bind() {
  local IFS=:
  echo "list:${SDL_AURORA_CPU_LIST[*]:0:$1}"
}

# Fills SDL_CMD with the machine's launcher for n ranks (SDL_PPN per node on SDL_NODES nodes).
sdl_launcher() {
  local n=$1 name value
  sdl_layout "$n"
  case "$MACHINE" in
    theta)
      SDL_CMD=(aprun -n "$n" -N "$SDL_PPN" -d "$SDL_DEPTH" -j 2 -cc depth
               -e "OMP_NUM_THREADS=$THREADS_PER_RANK" -e KMP_BLOCKTIME=0) ;;
    thetagpu | sophia)
      if [[ "$MACHINE" == sophia ]]; then
        # rank 0 runs on the first host of the hostfile: the ranks meet there
        export MASTER_ADDR=${MASTER_ADDR:-$(sdl_first_host "$PBS_NODEFILE")}
        SDL_CMD=(mpirun -n "$n" -N "$SDL_PPN" --hostfile "$PBS_NODEFILE")
      else
        SDL_CMD=(mpirun -np "$n" -npernode "$SDL_PPN" --hostfile "$COBALT_NODEFILE")
      fi
      export OMP_NUM_THREADS=$THREADS_PER_RANK
      # Open MPI does not forward the environment by itself: name what the ranks need.
      for name in PATH LD_LIBRARY_PATH PYTHONPATH OMP_NUM_THREADS MASTER_ADDR MASTER_PORT CONDA_PREFIX \
                  COURSE_VERBOSE TF_CPP_MIN_LOG_LEVEL; do
        value=${!name:-}
        [[ -n "$value" ]] && SDL_CMD+=(-x "$name")
      done ;;
    aurora)
      # Cray PALS mpiexec passes the environment on; --env adds what the ranks need besides (in the plan).
      SDL_CMD=(mpiexec -n "$n" --ppn "$SDL_PPN" --cpu-bind "${CPU_BIND:-$(sdl_aurora_cpu_bind "$SDL_PPN")}"
               --env "OMP_NUM_THREADS=$THREADS_PER_RANK"
               --env "ZE_FLAT_DEVICE_HIERARCHY=${ZE_FLAT_DEVICE_HIERARCHY:-FLAT}"
               --env "MASTER_ADDR=${MASTER_ADDR:-$(sdl_first_host "$PBS_NODEFILE")}")
      if [[ "${AURORA_CCL:-1}" == 1 ]]; then  # oneCCL under xccl, as ALCF's PyTorch guide sets it
        for name in CCL_PROCESS_LAUNCHER=pmix CCL_ATL_TRANSPORT=mpi CCL_KVS_MODE=mpi FI_MR_CACHE_MONITOR=userfaultfd; do
          SDL_CMD+=(--env "$(sdl_env_default "$name")")
        done
        ((SDL_NODES == 1)) || SDL_CMD+=(--env "$(sdl_env_default CCL_KVS_CONNECTION_TIMEOUT=300)")
      fi ;;
    polaris)
      if [[ "${CPU_BIND:-depth}" == depth ]]; then
        SDL_CMD=(mpiexec -n "$n" --ppn "$SDL_PPN" --depth "$SDL_DEPTH" --cpu-bind depth)
      else
        SDL_CMD=(mpiexec -n "$n" --ppn "$SDL_PPN" --cpu-bind "$CPU_BIND")
      fi
      SDL_CMD+=(--env "OMP_NUM_THREADS=$THREADS_PER_RANK")
      if [[ "${POLARIS_NCCL_TUNING:-0}" == 1 ]]; then  # ALCF's Polaris guide: NCCL over libfabric
        SDL_CMD+=(--env NCCL_NET_GDR_LEVEL=PHB --env NCCL_CROSS_NIC=1 --env NCCL_COLLNET_ENABLE=1
                  --env "NCCL_NET=AWS Libfabric"
                  --env "LD_LIBRARY_PATH=$(sdl_polaris_ofi_dir):${POLARIS_HWLOC_DIR:-/soft/libraries/hwloc/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                  --env FI_CXI_DISABLE_HOST_REGISTER=1 --env FI_MR_CACHE_MONITOR=userfaultfd
                  --env FI_CXI_DEFAULT_CQ_SIZE=131072)
      fi
      SDL_CMD+=(bash "$SDL_COMMON" gpu-affinity) ;;
    slurm)
      # --kill-on-bad-exit: a rank that fails ends the step at once (Slurm's default lets the others wait on it)
      SDL_CMD=(srun -N "$SDL_NODES" -n "$n" --ntasks-per-node "$SDL_PPN" --cpus-per-task "$SDL_DEPTH"
               --cpu-bind=cores --kill-on-bad-exit=1)
      # Rank 0 runs on the allocation's first node: every rank meets there (without a PMI, srun's ranks are
      # separate 1-rank MPI worlds and could not agree on an address among themselves).
      if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
        export MASTER_ADDR
      fi
      export OMP_NUM_THREADS=$THREADS_PER_RANK ;;
    local)
      case "${LAUNCHER:-mpiexec}:$EXAMPLE" in
        torchrun:horovod-* | deepspeed:horovod-* | deepspeed:ddp | horovodrun:ddp | horovodrun:deepspeed)
          sdl_die "LAUNCHER=$LAUNCHER cannot start $EXAMPLE (mpiexec starts every example)" ;;
      esac
      case "${LAUNCHER:-mpiexec}" in
        mpiexec) SDL_CMD=(mpiexec -n "$n") ;;
        torchrun) SDL_CMD=(torchrun --standalone --nproc_per_node "$n") ;;
        deepspeed) SDL_CMD=(deepspeed --num_gpus "$n") ;;
        horovodrun) SDL_CMD=(horovodrun -np "$n") ;;
        *) sdl_die "LAUNCHER must be mpiexec, torchrun, deepspeed or horovodrun, got '$LAUNCHER'" ;;
      esac ;;
  esac
  # torchrun and deepspeed start the script themselves (they run it with their own Python).
  if [[ "$MACHINE" != local || "${LAUNCHER:-mpiexec}" =~ ^(mpiexec|horovodrun)$ ]]; then
    SDL_CMD+=("$PYTHON")
  fi
}

# One run of EXAMPLE on n ranks into log dir DIR, with extra main.py flags after them.
sdl_run() {
  local n=$1 dir=$2 script status
  shift 2
  script=$(sdl_example_script "$EXAMPLE")
  sdl_launcher "$n"
  # The same threads per rank at every rank count, so that a sweep compares like with like.
  SDL_CMD+=("$REPO_DIR/$script" --device "$DEVICE" --num-threads "$THREADS_PER_RANK" --log-dir "$dir" "$@")
  sdl_say "$EXAMPLE on $MACHINE: $n rank(s) = $SDL_NODES node(s) x $SDL_PPN, log dir $dir"
  sdl_say "run: $(sdl_show "${SDL_CMD[@]}")"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then return 0; fi
  mkdir -p "$dir"
  set +e
  "${SDL_CMD[@]}" 2>&1 | tee "$dir/output.log"
  status=${PIPESTATUS[0]}
  set -e
  ((status == 0)) || echo "error: $EXAMPLE on $n rank(s) exited with $status (output in $dir/output.log)" >&2
  return "$status"
}

# Last epoch of each log dir: ranks, throughput, accuracy; speedup and efficiency only against a 1-rank run
# among them (a single run has no baseline: no speedup is made up against itself).
sdl_report() {
  [[ "${DRY_RUN:-0}" == 1 ]] && return 0
  "$PYTHON" - "$@" <<'EOF' || true
import json, os, sys
rows = []
for d in sys.argv[1:]:
    try:
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows.append((d, [json.loads(line) for line in f if line.strip()][-1]))
    except (OSError, IndexError, ValueError):
        rows.append((d, None))
base = next((m["samples_per_s"] for _, m in rows if m and m["world_size"] == 1), None)
cols, none = ("", "") if base is None else (f" {'speedup':>8} {'efficiency':>10}", f" {'-':>8} {'-':>10}")
print(f"{'ranks':>5} {'samples/s':>10}{cols} {'test_acc':>8}  log dir")
for d, m in rows:
    if m is None:
        print(f"{'?':>5} {'-':>10}{none} {'-':>8}  {d} (no metrics: see output.log)")
        continue
    vs = "" if base is None else f" {m['samples_per_s'] / base:>8.2f} {m['samples_per_s'] / base / m['world_size']:>10.0%}"
    print(f"{m['world_size']:>5} {m['samples_per_s']:>10.0f}{vs} {m['test_acc']:>8.4f}  {d}")
if base is None:
    print("(speedup and efficiency need a 1-rank run to compare with: the scale.sh sweep makes one)")
EOF
}

# What a machine cannot run, as one error line with the way that works there; and the retired machines.
sdl_check_supported() {
  case "$MACHINE:$EXAMPLE" in
    aurora:horovod-pytorch)
      sdl_die "Horovod for PyTorch is no longer in Aurora's frameworks module (ALCF's PyTorch guide, 2026): on Aurora use DDP, submissions/aurora/ddp.sh (xccl backend)" ;;
    aurora:horovod-tensorflow)
      sdl_die "the Horovod TensorFlow example has no Intel GPU path (--device xpu stops in utils/tf_utils.py): on Aurora use DDP, submissions/aurora/ddp.sh (xccl backend)" ;;
  esac
  case "$MACHINE" in
    theta) sdl_warn "Theta was retired on 2023-12-31 (no jobs after 23:59): this script is kept as the Cobalt/aprun reference; run on Aurora or Polaris (submissions/aurora, submissions/polaris)" ;;
    thetagpu) sdl_warn "ThetaGPU was retired on 2023-12-31 (no jobs after 23:59): its DGX A100 nodes run on as Sophia under PBS (submissions/sophia); this script is kept as the Cobalt/Open MPI reference" ;;
  esac
}

# Common start of sdl_main and sdl_sweep: check the example, set defaults, set up the environment.
sdl_prepare() {
  set -euo pipefail
  [[ -n "${MACHINE:-}" ]] || sdl_die "MACHINE is not set (the job script sets it)"
  EXAMPLE=${EXAMPLE:-ddp}
  local script
  script=$(sdl_example_script "$EXAMPLE") ||
    sdl_die "EXAMPLE must be one of: ${SDL_EXAMPLES[*]}; got '$EXAMPLE'"
  sdl_check_supported
  if [[ ! -f "$REPO_DIR/$script" ]]; then
    [[ "${DRY_RUN:-0}" == 1 ]] || sdl_die "$REPO_DIR/$script does not exist"
    echo "warning: $REPO_DIR/$script does not exist (yet)" >&2
  fi
  sdl_machine_defaults
  SDL_JOB_NODES=$(sdl_job_nodes)
  sdl_is_count "$SDL_JOB_NODES" || sdl_die "this job has '$SDL_JOB_NODES' nodes"
  if [[ "$MACHINE" == local ]]; then SDL_NRANKS=$NRANKS; else SDL_NRANKS=$((SDL_JOB_NODES * RANKS_PER_NODE)); fi
  sdl_is_count "$SDL_NRANKS" || sdl_die "NRANKS must be a positive integer, got '$SDL_NRANKS'"
  read -r -a SDL_TRAIN_ARGS <<< "${TRAIN_ARGS:-}"
  sdl_setup_env
  : "${RUNS_DIR:=$REPO_DIR/runs}"
  sdl_say "job $(sdl_job_id): $SDL_JOB_NODES node(s) x $RANKS_PER_NODE rank(s) per node = $SDL_NRANKS rank(s)," \
          "$THREADS_PER_RANK thread(s) per rank, device $DEVICE"
}

# One run on the whole allocation. Arguments: extra flags for main.py.
sdl_main() {
  sdl_prepare
  local dir
  dir=$(sdl_fresh_dir "$RUNS_DIR/$MACHINE/$EXAMPLE/$(sdl_job_id).n$SDL_NRANKS")
  sdl_run "$SDL_NRANKS" "$dir" "${SDL_TRAIN_ARGS[@]}" "$@"
  sdl_report "$dir"
}

# The scaling sweep: the same training at 1, 2, 4, ... ranks, each into <sweep dir>/n<ranks>.
sdl_sweep() {
  sdl_prepare
  local ranks n dir base failed=0 dirs=()
  read -r -a ranks <<< "${SWEEP_RANKS:-$(sdl_sweep_list "$SDL_NRANKS")}"
  for n in "${ranks[@]}"; do
    if ! sdl_is_count "$n" || ((n > SDL_NRANKS)); then
      sdl_die "SWEEP_RANKS: '$n' is not between 1 and the $SDL_NRANKS ranks of this job"
    fi
  done
  base=$(sdl_fresh_dir "$RUNS_DIR/$MACHINE/$EXAMPLE-scale/$(sdl_job_id)")
  sdl_say "scaling sweep over ${ranks[*]} rank(s) into $base"
  for n in "${ranks[@]}"; do
    dir="$base/n$n"
    dirs+=("$dir")
    sdl_run "$n" "$dir" "${SDL_TRAIN_ARGS[@]}" "$@" || failed=$((failed + 1))
  done
  sdl_report "${dirs[@]}"
  ((failed == 0)) || sdl_die "$failed of ${#ranks[@]} runs failed"
}

# --- Polaris GPU affinity --------------------------------------------------------------------------------
# Cray MPICH does not bind ranks to GPUs. --cpu-bind depth gives local rank 0 the first cores (NUMA 0),
# and on Polaris the GPU nearest NUMA 0 is GPU 3: so local rank r gets GPU (3 - r % 4), counting backwards
# through CUDA_VISIBLE_DEVICES when the job was already given a subset (or MIG instances).
sdl_gpu_affinity() {
  local local_rank=${PMI_LOCAL_RANK:-${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-}}}}}
  [[ -n "$local_rank" ]] || sdl_die "gpu-affinity: no local rank in the environment (run it under mpiexec)"
  [[ $# -gt 0 ]] || sdl_die "usage: common.sh gpu-affinity COMMAND [ARGS...]"
  local gpus=() n
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
  else
    for ((n = 0; n < ${GPUS_PER_NODE:-4}; n++)); do gpus+=("$n"); done
  fi
  n=${#gpus[@]}
  export CUDA_VISIBLE_DEVICES=${gpus[n - 1 - local_rank % n]}
  if [[ "${AFFINITY_VERBOSE:-0}" == 1 ]]; then
    echo "gpu-affinity: rank ${PMI_RANK:-?} local rank $local_rank -> CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >&2
  fi
  exec "$@"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  case "${1:-}" in
    gpu-affinity) shift; sdl_gpu_affinity "$@" ;;
    *) echo "usage: bash $0 gpu-affinity COMMAND [ARGS...]   (job scripts source this file)" >&2; exit 2 ;;
  esac
fi
