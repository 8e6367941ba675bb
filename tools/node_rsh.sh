#!/bin/sh
# MPICH's mpiexec (Hydra) across the nodes tools/nodes.py makes: given as its ssh (`-launcher ssh -launcher-exec
# tools/node_rsh.sh`), Hydra calls `node_rsh.sh -x HOST "COMMAND"` for each host, and the command (Hydra's proxy,
# which starts that node's ranks) runs in the node whose eth0 has HOST (10.77.0.N: node N-1) instead of over ssh.
# COURSE_NODES: the nodes' names without their number (course-cli-node). tools/launch.py nodes_over_a_network.
[ "$1" = "-x" ] && shift
host=$1
shift
exec ip netns exec "${COURSE_NODES:-course-cli-node}$((${host##*.} - 1))" sh -c "$*"
