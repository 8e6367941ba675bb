#!/bin/bash
#SBATCH -J scale
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -t 01:00:00
#SBATCH -q debug
#SBATCH -A YOUR_PROJECT
#SBATCH -C gpu
#SBATCH -o %x-%j.out
# The scaling sweep on a Slurm cluster: train.sh at 1, 2, 4, ... ranks up to every GPU of the job
# (2 nodes: 8), one log folder each, then a table of throughput, speedup and efficiency.
#
#   sbatch -A <project> submissions/slurm/scale.sh --epochs 2

for REPO_DIR in "${REPO_DIR:-}" "$PWD" "$(dirname "$0")/../.."; do
  [[ -f "$REPO_DIR/submissions/plumbing.sh" ]] && break
done
[[ -f "$REPO_DIR/submissions/plumbing.sh" ]] ||
  { echo "error: repository not found: sbatch from inside it, or set REPO_DIR" >&2; exit 1; }
export SWEEP=1 REPO_DIR
exec bash "$REPO_DIR/submissions/slurm/train.sh" "$@"
