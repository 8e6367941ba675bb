#!/usr/bin/env bash
# Horovod + TensorFlow (horovod/tensorflow/main.py)
# on a workstation or laptop, with the repo's own .venv (make setup): its mpiexec, torchrun, deepspeed.
# ranks = NRANKS (2); LAUNCHER=mpiexec (default), torchrun, deepspeed or horovodrun.
# Output: runs/local/horovod-tensorflow/<job id>.n<ranks>/ (config.json, metrics.jsonl, summary.json, output.log).
#
#   bash submissions/local/horovod_tensorflow.sh --epochs 1
#   NRANKS=4 LAUNCHER=horovodrun bash submissions/local/horovod_tensorflow.sh
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=local
EXAMPLE=horovod-tensorflow
# Schedulers may run a copy of this script from a spool directory: look for the repository next to the
# script, then where the job was submitted from (cd into the repo before qsub/sbatch), or set REPO_DIR.
for d in "${REPO_DIR:-}" "$(dirname "${BASH_SOURCE[0]}")" "${PBS_O_WORKDIR:-}" "${SLURM_SUBMIT_DIR:-}" "$PWD"; do
  d=$(cd "${d:-/nonexistent}" 2>/dev/null && pwd -P) || continue
  while [[ "$d" != / && ! -f "$d/submissions/common.sh" ]]; do d=$(dirname "$d"); done
  if [[ -f "$d/submissions/common.sh" ]]; then REPO_DIR=$d; break; fi
done
[[ -f "${REPO_DIR:-}/submissions/common.sh" ]] || { echo "error: repository not found; set REPO_DIR" >&2; exit 1; }
# shellcheck source=submissions/common.sh
source "$REPO_DIR/submissions/common.sh"
sdl_main "$@"
