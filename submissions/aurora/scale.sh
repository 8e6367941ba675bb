#!/bin/bash -l
#PBS -N scale
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=1:00:00
#PBS -l filesystems=home:flare
#PBS -k doe
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# The scaling sweep on Aurora: train.sh at 1, 2, 4, ... ranks up to every tile of the job
# (2 nodes: 24), one log folder each, then a table of throughput, speedup and efficiency.
# Written from ALCF's Aurora guides (docs/aurora/ in argonne-lcf/user-guides of 2026-08-19);
# not yet run there.
#
#   qsub -A <project> submissions/aurora/scale.sh
#   qsub -A <project> -q debug-scaling -l select=4 -v EXAMPLE=deepspeed submissions/aurora/scale.sh

for REPO_DIR in "${REPO_DIR:-}" "${PBS_O_WORKDIR:-}" "$(dirname "$0")/../.." "$PWD"; do
  [[ -f "$REPO_DIR/submissions/plumbing.sh" ]] && break
done
[[ -f "$REPO_DIR/submissions/plumbing.sh" ]] ||
  { echo "error: repository not found: qsub from inside it, or set REPO_DIR" >&2; exit 1; }
export SWEEP=1 REPO_DIR
# a login shell, as PBS starts a job script: `module` is defined there (a plain `bash` may lack it)
exec bash -l "$REPO_DIR/submissions/aurora/train.sh" "$@"
