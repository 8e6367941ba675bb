#!/bin/bash -l
#PBS -N scale
#PBS -l select=2
#PBS -l walltime=1:00:00
#PBS -l filesystems=home:eagle
#PBS -q by-node
#PBS -A YOUR_PROJECT
#PBS -j oe
# No place=: by-node gives whole nodes, and by-gpu puts every chunk (a GPU) on one node
# (docs/sophia/queueing-and-running-jobs/running-jobs.md), which scatter would contradict.
# The scaling sweep on Sophia: train.sh at 1, 2, 4, ... ranks up to every GPU of the job
# (2 nodes: 16), one log folder each, then a table of throughput, speedup and efficiency.
# Written from ALCF's Sophia guide (docs/sophia/ in argonne-lcf/user-guides of 2026-08-19);
# not yet run there.
#
#   qsub -A <project> submissions/sophia/scale.sh
#   qsub -A <project> -v EXAMPLE=horovod-pytorch submissions/sophia/scale.sh

for REPO_DIR in "${REPO_DIR:-}" "${PBS_O_WORKDIR:-}" "$(dirname "$0")/../.." "$PWD"; do
  [[ -f "$REPO_DIR/submissions/plumbing.sh" ]] && break
done
[[ -f "$REPO_DIR/submissions/plumbing.sh" ]] ||
  { echo "error: repository not found: qsub from inside it, or set REPO_DIR" >&2; exit 1; }
export SWEEP=1 REPO_DIR
# a login shell, as PBS starts a job script: `module` is defined there (a plain `bash` may lack it)
exec bash -l "$REPO_DIR/submissions/sophia/train.sh" "$@"
