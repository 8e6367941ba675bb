#!/bin/bash -l
#COBALT -n 1
#COBALT -t 0:30:00
#COBALT -q full-node
#COBALT -A YOUR_PROJECT
#COBALT --attrs filesystems=home,theta-fs0
# RETIRED: ThetaGPU (Cobalt, 8 A100 per DGX node, Open MPI mpirun) stopped running jobs at 23:59 on
# 2023-12-31. Its DGX A100 nodes run on as Sophia, under PBS: submissions/sophia/train.sh. Kept as a
# reference for the workshop's original launch line; it runs nowhere today.
#
# 8 ranks per node, one per GPU; Open MPI passes on only the variables named with -x.

module load conda
conda activate
NNODES=$(wc -l < "$COBALT_NODEFILE")
RANKS_PER_NODE=8
NRANKS=$((NNODES * RANKS_PER_NODE))
mpirun -np "$NRANKS" -npernode "$RANKS_PER_NODE" --hostfile "$COBALT_NODEFILE" \
  -x PATH -x LD_LIBRARY_PATH python DDP/main.py --device cuda "$@"
