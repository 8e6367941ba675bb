# shellcheck shell=bash
# What the job scripts share and nobody needs to read to submit one: the dry run, the examples'
# table, a log folder per run, the laptop-.venv check, the end-of-job report. Sourced by
# submissions/*/train.sh (a train.sh copied alone has a short stand-in of its own); machine facts
# (ranks per node, binding, launch line) stay there.
#
#   step CMD...        print CMD, then run it in this shell (module, export); DRY_RUN=1: print only
#   launch CMD...      check the files CMD names up to $SCRIPT exist, print CMD, run it, copy its
#                      output to $RUN_DIR/output.log; DRY_RUN=1: check and print only
#   example_script X   the script of example X in tools/examples.tsv (the one table)
#   nodes_in FILE      hosts in a node file (one a line); a dry run without one: 1
#   ranks_to_run N     N; with SWEEP=1 (scale.sh) 1 2 4 ... N, or SWEEP_RANKS
#   new_run M N PPN    RUN_DIR=runs/M/<example>/<job id>.nN (a sweep: <example>-scale/<job id>/nN)
#                      and COURSE_FLAGS (--num-threads, --log-dir; --data-dir DATA_DIR where set,
#                      checked) when SCRIPT is a course example
#   refuse_laptop_venv stop if python or mpiexec would come from the course's laptop .venv

set -eo pipefail
REPO_DIR=$(cd "$REPO_DIR" && pwd -P)
EXAMPLES_TSV=$REPO_DIR/tools/examples.tsv
RUN_DIRS=()
if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "dry run: nothing is executed"; fi

fail() { echo "error: $*" >&2; exit 1; }
# A command as it would be typed: words with spaces or quotes single-quoted.
quote() {
  local w out=() q="'"
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$w")
    else out+=("$q${w//$q/$q\\$q$q}$q"); fi
  done
  echo "${out[*]}"
}

show() { if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "$1"; else echo "+ $1"; fi; }
step() {
  if [[ "$1" == eval ]]; then show "$2"; else show "$(quote "$@")"; fi
  # export changes only this shell: the dry run does it too, so that its plan shows the threads
  if [[ "${DRY_RUN:-0}" != 1 || "$1" == export ]]; then "$@"; fi
}

# A signal to this script (qdel, walltime, scancel: TERM; Ctrl-C: INT) goes at once to the launcher
# alone (run in the background, its own process group: Ctrl-C reaches it once); tee ignores it.
stop() { kill -s "$1" "$(jobs -pr)" 2>/dev/null || true; wait; exit $((128 + $(kill -l "$1"))); }
trap 'stop INT' INT; trap 'stop TERM' TERM
# shellcheck disable=SC2153  # SCRIPT comes from the job script
launch() {
  local w
  for w in "$@"; do  # the files it names up to the script (not the script's arguments) must exist
    if [[ ("$w" == */* && "$w" != -*) || "$w" == "$SCRIPT" ]] && [[ ! -e "$w" ]]; then
      fail "no such file: $w (named on the launch line)"
    fi
    if [[ "$w" == "$SCRIPT" ]]; then break; fi
  done
  show "$(quote "$@")"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then return 0; fi
  LAUNCHED=$RUN_WHAT
  set -m; "$@" < /dev/null 2>&1 | (trap '' INT TERM; exec tee "$RUN_DIR/output.log") & set +m
  wait $!
}

example_script() {
  local script names
  script=$(awk -F '\t' -v name="$1" '$1 == name { print $2 }' "$EXAMPLES_TSV")
  names=$(awk -F '\t' '!/^#/ && NF == 3 { printf "%s ", $1 }' "$EXAMPLES_TSV")
  [[ -n "$script" ]] || fail "EXAMPLE must be one of: ${names}(got '$1')"
  echo "$REPO_DIR/$script"
}
reads_mnist() {  # the table's third column: the examples whose --data-dir is an MNIST folder
  awk -F '\t' '$3 == "mnist" { print $2 }' "$EXAMPLES_TSV" | grep -qxF "${1#"$REPO_DIR"/}"
}
is_example() {
  [[ "$1" == "$REPO_DIR"/* && -f "$EXAMPLES_TSV" ]] &&
    cut -f 2 "$EXAMPLES_TSV" | grep -qxF "${1#"$REPO_DIR"/}"
}
nodes_in() {  # hosts, not lines: a node file can name one host once per chunk (Sophia's by-gpu)
  [[ -n "$1" || "${DRY_RUN:-0}" != 1 ]] ||
    { echo "dry run: no node file, assuming 1 node (this host)" >&2; echo 1; return; }
  [[ -n "$1" && -r "$1" ]] || fail "node file '$1' missing: run this inside a job (or qsub -I)"
  grep '[^[:space:]]' "$1" | sort -u | grep -c .
}
# MNIST where the examples read it (DATA_DIR): the compute nodes have no internet to fetch it
has_mnist() {
  [[ -f "$1/mnist.npz" ]] || compgen -G "$1/train-images-idx3-ubyte*" > /dev/null ||
    compgen -G "$1/MNIST/raw/train-images-idx3-ubyte*" > /dev/null
}
check_data() {  # (with --download the ranks fetch it: DOWNLOADS=1)
  has_mnist "$DATA_DIR" || [[ "${DOWNLOADS:-0}" == 1 ]] && return 0
  local why="no MNIST in DATA_DIR=$DATA_DIR: once, on a login node (it has internet):"
  why+=" python3 $REPO_DIR/tools/get_data.py $DATA_DIR (or qsub -v DATA_DIR=<your MNIST folder>;"
  why+=" or TRAIN_ARGS=--download: the job fetches it, through the proxy)"
  if [[ "${DRY_RUN:-0}" == 1 ]]; then echo "dry run: $why" >&2; else fail "$why"; fi
}
ranks_to_run() {
  local n=1 points=()
  [[ "$1" =~ ^[1-9][0-9]*$ ]] || fail "ranks must be a positive integer, got '$1'"
  if [[ "${SWEEP:-0}" != 1 ]]; then echo "$1"; return; fi
  if [[ -n "${SWEEP_RANKS:-}" ]]; then
    read -r -a points <<< "$SWEEP_RANKS"
    for n in "${points[@]}"; do
      { [[ "$n" =~ ^[1-9][0-9]*$ ]] && ((n <= $1)); } ||
        fail "SWEEP_RANKS: '$n' is not between 1 and the $1 ranks of this job"
    done
  else
    while ((n < $1)); do points+=("$n"); n=$((n * 2)); done
    points+=("$1")
  fi
  echo "${points[*]}"
}
job_id() { local id=${PBS_JOBID:-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}; echo "${id%%.*}"; }
# shellcheck disable=SC2034,SC2153  # SCRIPT comes from the job script, COURSE_FLAGS goes back
new_run() {
  local machine=$1 n=$2 ppn=$3 name base i=2
  if is_example "$SCRIPT"; then name=${EXAMPLE:-ddp}; else name=$(basename "${SCRIPT%.*}"); fi
  base="${RUNS_DIR:-$REPO_DIR/runs}/$machine/$name"
  if [[ "${SWEEP:-0}" == 1 ]]; then
    RUN_DIR="${SWEEP_DIR:=$base-scale/$(job_id)}/n$n"
  else
    RUN_DIR="$base/$(job_id).n$n"
    while [[ -e "$RUN_DIR" ]]; do RUN_DIR="$base/$(job_id).n$n.$i"; i=$((i + 1)); done
  fi
  RUN_DIRS+=("$RUN_DIR")
  COURSE_FLAGS=()
  if is_example "$SCRIPT"; then
    COURSE_FLAGS=(--num-threads "$OMP_NUM_THREADS" --log-dir "$RUN_DIR")
    if [[ -n "${DATA_DIR:-}" ]] && reads_mnist "$SCRIPT"; then  # (the transformer's: text)
      check_data; COURSE_FLAGS+=(--data-dir "$DATA_DIR")
    fi
  fi
  RUN_WHAT="$name on $n rank(s)"
  echo "# $RUN_WHAT = $(((n + ppn - 1) / ppn)) node(s) x $ppn," \
       "${OMP_NUM_THREADS:-?} thread(s) per rank, log dir $RUN_DIR"
  if [[ "${DRY_RUN:-0}" != 1 ]]; then mkdir -p "$RUN_DIR"; fi
}

refuse_laptop_venv() {
  [[ "${DRY_RUN:-0}" != 1 ]] || return 0
  local what path
  for what in python mpiexec mpirun; do
    path=$(command -v "$what" 2>/dev/null) || continue
    [[ "$path" != "$REPO_DIR/.venv/"* ]] ||
      fail "'$what' is $path: the course's laptop .venv must not be used on $1 (its pip" \
           "MPICH would shadow the machine's MPI); open a shell without .venv/bin/activate"
  done
  [[ "${VIRTUAL_ENV:-}" != "$REPO_DIR/.venv" ]] ||
    fail "VIRTUAL_ENV is the course's laptop .venv: run 'deactivate'; on $1 use the modules"
}

# The end of the job: what failed, or the last epoch of each run (speedup and efficiency only
# against a 1-rank run among them). A failure before any launch has said why already.
report() {
  local status=$1
  if [[ "${DRY_RUN:-0}" != 1 && ${#RUN_DIRS[@]} -gt 0 ]] && is_example "$SCRIPT"; then
    python "$REPO_DIR/tools/job_report.py" "${RUN_DIRS[@]}" || true
  fi
  ((status == 0)) || [[ -z "${LAUNCHED:-}" ]] ||  # the job's last line says what failed
    echo "error: $LAUNCHED exited with $status (output in $RUN_DIR/output.log)" >&2
  return "$status"
}
trap 'report $?' EXIT
