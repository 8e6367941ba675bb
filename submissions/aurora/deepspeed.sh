#!/bin/bash -l
#PBS -N deepspeed
#PBS -l select=1
#PBS -l place=scatter
#PBS -l walltime=0:30:00
#PBS -l filesystems=home:flare
#PBS -k doe
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# DeepSpeed (deepspeed/main.py)
# on Aurora (PBS Pro, 6 Intel GPU Max per node = 12 tiles, Cray PALS mpiexec, xpu + xccl); written from
# ALCF's Aurora guides as read on 2026-11-25, not yet run there.
# ranks = nodes in $PBS_NODEFILE x RANKS_PER_NODE (12, one per GPU tile), 8 cores each (--cpu-bind list),
# the oneCCL settings of ALCF's guide (AURORA_CCL=0 leaves them out).
# Output: runs/aurora/deepspeed/<job id>.n<ranks>/ (config.json, metrics.jsonl, summary.json, output.log).
#
#   qsub -A <project> submissions/aurora/deepspeed.sh
#   qsub -A <project> -l select=2 -v TRAIN_ARGS="--epochs 8" submissions/aurora/deepspeed.sh
#   bash submissions/aurora/deepspeed.sh --epochs 8      # inside an interactive job (qsub -I ...)
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, CPU_BIND, AURORA_CCL, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=aurora
EXAMPLE=deepspeed
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
