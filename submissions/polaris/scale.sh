#!/bin/bash -l
#PBS -N scale
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=1:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# scaling sweep: the same training at 1, 2, 4, ... ranks, one log dir each
# on Polaris (PBS Pro, 4 A100 per node, Cray MPICH/PALS mpiexec + GPU-affinity wrapper); written from
# ALCF's Polaris guide as read on 2026-11-25, not yet run there.
# ranks = nodes in $PBS_NODEFILE x RANKS_PER_NODE (4, one per GPU).
# EXAMPLE=ddp|horovod-pytorch|horovod-tensorflow|deepspeed picks the example (default ddp);
# runs go to runs/polaris/<example>-scale/<job id>/n<ranks>/, then a throughput table is printed.
#
#   qsub -A <project> submissions/polaris/scale.sh
#   qsub -A <project> -l select=2:system=polaris -v TRAIN_ARGS="--epochs 8" submissions/polaris/scale.sh
#   bash submissions/polaris/scale.sh --epochs 8      # inside an interactive job (qsub -I ...)
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, CPU_BIND,
# POLARIS_NCCL_TUNING=1, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=polaris
EXAMPLE=${EXAMPLE:-ddp}
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
sdl_sweep "$@"
