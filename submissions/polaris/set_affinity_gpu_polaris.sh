#!/bin/bash
# Polaris: one GPU per rank, as ALCF's set_affinity_gpu_polaris.sh does it. Cray MPICH binds no
# GPUs; `--cpu-bind depth` puts local rank 0 on the first cores (NUMA 0), nearest GPU 3, so the
# GPUs go in reverse order. Between mpiexec and the program:
#   mpiexec ... set_affinity_gpu_polaris.sh python train.py
num_gpus=4
local_rank=${PMI_LOCAL_RANK:-${PALS_LOCAL_RANKID:-${MPI_LOCALRANKID:-}}}
if [[ -z "$local_rank" ]]; then
  echo "error: set_affinity_gpu_polaris.sh: no local rank here (start it with mpiexec)" >&2
  exit 1
fi
gpu=$((num_gpus - 1 - local_rank % num_gpus))
export CUDA_VISIBLE_DEVICES=$gpu
if [[ "${AFFINITY_VERBOSE:-0}" == 1 ]]; then
  echo "RANK=${PMI_RANK:-?} LOCAL_RANK=$local_rank gpu=$gpu" >&2
fi
exec "$@"
