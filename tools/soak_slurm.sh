#!/usr/bin/env bash
# Submit submissions/slurm/train.sh many times to the Slurm cluster on this machine (make slurm-up) and count how
# each job ended: a flake of a job's start is a rate, not an anecdote. Not part of make test.
#
#   bash tools/soak_slurm.sh 50                     # DDP, 2 nodes x 1 rank, 2 steps each
#   NODES=1 PER_NODE=2 EXAMPLE=horovod-pytorch bash tools/soak_slurm.sh 20
#
# A job counts as bad when it does not end COMPLETED with exit 0:0, or when its output holds a traceback or an
# abort. The output of each bad job stays in the soak's folder. Exit 1 when any job ended badly.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=${1:-50}
NODES=${NODES:-2}
PER_NODE=${PER_NODE:-1}
EXAMPLE=${EXAMPLE:-ddp}
export SLURM_CONF=${SLURM_CONF:-/tmp/scaling-dl-slurm/slurm.conf}
[[ "$RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "error: the number of jobs must be a positive number, got '$RUNS'" >&2; exit 2; }
[[ -f "$SLURM_CONF" ]] || { echo "error: no Slurm cluster at $SLURM_CONF: run make slurm-up first" >&2; exit 2; }
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "error: no $PY: run make setup first" >&2; exit 2; }

# The jobs' frameworks: a venv outside the checkout that sees the course's packages, as a cluster's module would
# (the job scripts refuse the laptop .venv itself).
SOAK=$(mktemp -d /tmp/soak-slurm-XXXXXX)
"$("$PY" -c 'import sys; print(sys._base_executable)')" -m venv --without-pip "$SOAK/env"
"$SOAK/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$SOAK/purelib"
"$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$(cat "$SOAK/purelib")/course-packages.pth"
# shellcheck disable=SC2016  # $LD_LIBRARY_PATH is expanded by the job, when it sources this file
printf 'source %s/env/bin/activate\nexport LD_LIBRARY_PATH=%s/.venv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\n' \
  "$SOAK" "$ROOT" > "$SOAK/setup.sh"
# Horovod takes its ranks from MPI, which gets them from srun through PMI-2 (a site's MpiDefault).
MPI=()
[[ "$EXAMPLE" == horovod* ]] && MPI=(SLURM_MPI_TYPE=pmi2)

# The course's port picker (below the kernel's ephemeral range, where srun's own listening ports come from).
port() { "$PY" -c 'import sys; sys.path.append(sys.argv[1]); from course.dist import free_port; print(free_port())' "$ROOT"; }

declare -A COUNT=()
for ((i = 1; i <= RUNS; i++)); do
  OUT="$SOAK/job-$i.out"
  set +e
  (cd "$ROOT" && env -u VIRTUAL_ENV PATH=/usr/local/bin:/usr/bin:/bin ENV_SETUP="source $SOAK/setup.sh" \
    RUNS_DIR="$SOAK/runs" EXAMPLE="$EXAMPLE" TRAIN_ARGS="--epochs 1 --max-steps 2 --device cpu" \
    MASTER_PORT="$(port)" "${MPI[@]}" \
    sbatch --wait --quiet --gpus-per-node=0 --constraint= --time=10 -N "$NODES" --ntasks-per-node="$PER_NODE" \
    -o "$OUT" submissions/slurm/train.sh > /dev/null 2>> "$SOAK/sbatch.err")
  rc=$?
  set -e
  if ((rc == 0)) && ! grep -qE 'Traceback \(most recent|terminate called|Segmentation fault|Aborted' "$OUT"; then
    label=ok
  else
    label="exit $rc"
    grep -qE 'Traceback \(most recent' "$OUT" && label+=", traceback"
    grep -q 'terminate called' "$OUT" && label+=", abort"
    cp "$OUT" "$SOAK/bad-$i.out"
  fi
  COUNT[$label]=$((${COUNT[$label]:-0} + 1))
  echo "job $i/$RUNS: $label"
done
echo
echo "$EXAMPLE, $NODES node(s) x $PER_NODE rank(s), $RUNS jobs through sbatch:"
bad=0
for label in "${!COUNT[@]}"; do
  printf '  %4d  %s\n' "${COUNT[$label]}" "$label"
  [[ "$label" == ok ]] || bad=1
done
((bad == 0)) || echo "the output of each bad job is in $SOAK (bad-N.out)"
exit "$bad"
