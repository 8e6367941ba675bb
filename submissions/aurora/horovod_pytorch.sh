#!/bin/bash -l
#PBS -N horovod_pytorch
#PBS -l select=1
#PBS -l place=scatter
#PBS -l walltime=0:05:00
#PBS -l filesystems=home:flare
#PBS -k doe
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# Horovod + PyTorch (horovod/pytorch/main.py)
# on Aurora (PBS Pro, 6 Intel GPU Max per node = 12 tiles, Cray PALS mpiexec, xpu + xccl); written from
# ALCF's Aurora guides as read on 2026-11-25, not yet run there.
# NOT ON AURORA: Horovod for PyTorch left Aurora's frameworks module in 2026 (ALCF's PyTorch guide).
# This script stops at once with that reason in one `error:` line; on Aurora use DDP:
# submissions/aurora/ddp.sh (or EXAMPLE=ddp submissions/aurora/scale.sh).
# Kept so that every machine has every script (see submissions/README.md).

MACHINE=aurora
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
