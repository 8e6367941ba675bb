#!/usr/bin/env bash
# The scaling sweep on a workstation: train.sh at 1, 2, 4, ... up to NRANKS processes
# (default 2), one log folder each, then a table of throughput, speedup and efficiency.
# Speeds depend on the machine.
#
#   bash submissions/local/scale.sh --epochs 1
#   NRANKS=4 EXAMPLE=deepspeed bash submissions/local/scale.sh

SWEEP=1 exec bash "$(dirname "$0")/train.sh" "$@"
