#!/bin/bash -l
#COBALT -n 1
#COBALT -t 0:30:00
#COBALT -q debug-cache-quad
#COBALT -A YOUR_PROJECT
#COBALT -O ddp.$jobid
#COBALT --attrs mcdram=cache:numa=quad:filesystems=home,theta-fs0
# PyTorch DDP (DDP/main.py)
# on Theta (Cobalt, KNL CPUs, aprun).
# RETIRED: Theta stopped running jobs at 23:59 on 2023-12-31. Kept as the workshop's Cobalt/aprun reference
# (it warns when run); today run on Aurora or Polaris: submissions/aurora, submissions/polaris.
# ranks = $COBALT_JOBSIZE nodes x RANKS_PER_NODE (4), each with 128/4 = 32 hardware threads (aprun -d 32 -j 2).
# Output: runs/theta/ddp/<job id>.n<ranks>/ (config.json, metrics.jsonl, summary.json, output.log).
#
#   qsub -A <project> submissions/theta/ddp.sh
#   qsub -A <project> -n 4 --env TRAIN_ARGS="--epochs 8" submissions/theta/ddp.sh
#   bash submissions/theta/ddp.sh --epochs 8      # inside an interactive job (qsub -I ...)
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=theta
EXAMPLE=ddp
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
