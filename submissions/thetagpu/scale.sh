#!/bin/bash -l
#COBALT -n 1
#COBALT -t 1:00:00
#COBALT -q full-node
#COBALT -A YOUR_PROJECT
#COBALT -O scale.$jobid
#COBALT --attrs filesystems=home,theta-fs0
# scaling sweep: the same training at 1, 2, 4, ... ranks, one log dir each
# on ThetaGPU (Cobalt, 8 A100 per node, Open MPI mpirun).
# RETIRED: ThetaGPU stopped running jobs at 23:59 on 2023-12-31; its DGX A100 nodes run on as Sophia under
# PBS: submissions/sophia. Kept as the workshop's Cobalt/Open MPI reference (it warns when run).
# ranks = nodes in $COBALT_NODEFILE x RANKS_PER_NODE (8, one per GPU).
# EXAMPLE=ddp|horovod-pytorch|horovod-tensorflow|deepspeed picks the example (default ddp);
# runs go to runs/thetagpu/<example>-scale/<job id>/n<ranks>/, then a throughput table is printed.
#
#   qsub -A <project> submissions/thetagpu/scale.sh
#   qsub -A <project> -n 2 --env TRAIN_ARGS="--epochs 8" submissions/thetagpu/scale.sh
#   bash submissions/thetagpu/scale.sh --epochs 8      # inside an interactive job (qsub -I ...)
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=thetagpu
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
