#!/bin/bash -l
#COBALT -n 2
#COBALT -t 0:30:00
#COBALT -q debug-cache-quad
#COBALT -A YOUR_PROJECT
#COBALT --attrs mcdram=cache:numa=quad:filesystems=home,theta-fs0
# RETIRED: Theta (Cobalt, KNL CPUs, aprun) stopped running jobs at 23:59 on 2023-12-31. Kept as a
# reference for the workshop's original launch line; it runs nowhere today. Its successors are
# Aurora and Polaris: submissions/aurora/train.sh, submissions/polaris/train.sh.
#
# 4 ranks per KNL node, 32 hardware threads each (64 cores x 2 threads, aprun -d 32 -j 2).

module load conda/2021-09-22
NNODES=$COBALT_JOBSIZE
RANKS_PER_NODE=4
NRANKS=$((NNODES * RANKS_PER_NODE))
aprun -n "$NRANKS" -N "$RANKS_PER_NODE" -d 32 -j 2 -cc depth \
  -e OMP_NUM_THREADS=32 -e KMP_BLOCKTIME=0 python DDP/main.py --device cpu "$@"
