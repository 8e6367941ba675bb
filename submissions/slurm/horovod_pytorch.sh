#!/bin/bash
#SBATCH -J horovod_pytorch
#SBATCH -N 1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -t 00:30:00
#SBATCH -q debug
#SBATCH -A YOUR_PROJECT
#SBATCH -C gpu
#SBATCH -o %x-%j.out
# Horovod + PyTorch (horovod/pytorch/main.py)
# on a Slurm cluster with 4 GPUs per node (Perlmutter-style: -C gpu -q debug; on Frontier drop -C/-q, use -p batch).
# ranks = $SLURM_JOB_NUM_NODES x RANKS_PER_NODE (--ntasks-per-node, 4), launched with srun.
# Output: runs/slurm/horovod-pytorch/<job id>.n<ranks>/ (config.json, metrics.jsonl, summary.json, output.log).
#
#   sbatch -A <project> submissions/slurm/horovod_pytorch.sh --epochs 8
#   sbatch -A <project> -N 2 submissions/slurm/horovod_pytorch.sh
#   bash submissions/slurm/horovod_pytorch.sh --epochs 8      # inside an interactive job (salloc ...)
# Environment variables that change the run (TRAIN_ARGS, RANKS_PER_NODE, ENV_SETUP, DRY_RUN=1, ...):
# see submissions/README.md and the top of submissions/common.sh.

MACHINE=slurm
EXAMPLE=horovod-pytorch
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
