#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for running submissions/slurm/*.sh as real jobs:
# munged, slurmctld and two slurmd daemons (nodes n1 and n2, both this host, 2 CPUs each).
#
#   bash tools/slurm_cluster.sh up       # install Slurm + munge if missing (root, apt-get), start, wait
#   bash tools/slurm_cluster.sh status   # which daemons run, sinfo; exit 0 only when all run
#   bash tools/slurm_cluster.sh down     # stop exactly the daemons `up` started (by their pid files)
#
# Everything it writes (slurm.conf, munge key and socket, state, spool, logs, pid files) stays in
# SLURM_CLUSTER_DIR (default /tmp/scaling-dl-slurm); nothing in /etc changes except one /etc/hosts line
# "127.0.0.1 n1 n2" when those names do not resolve. Clients find the cluster through SLURM_CONF:
#   export SLURM_CONF=/tmp/scaling-dl-slurm/slurm.conf; sinfo; sbatch ...
# Both subcommands are idempotent: `up` on a running cluster and `down` on a stopped one do nothing.
# Settings: SLURM_CLUSTER_DIR, SLURM_CLUSTER_PORT (slurmctld's port, default 6817; n1, n2 take the next two),
# SLURM_CLUSTER_TIMEOUT (seconds `up` waits for both nodes to be idle, default 90).
set -euo pipefail

DIR=${SLURM_CLUSTER_DIR:-/tmp/scaling-dl-slurm}
PORT=${SLURM_CLUSTER_PORT:-6817}
TIMEOUT=${SLURM_CLUSTER_TIMEOUT:-90}
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)
PROGRAMS=(munged slurmctld slurmd sinfo sbatch srun scontrol)
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"

die() { echo "error: $*" >&2; exit 1; }
say() { echo "[slurm-cluster] $*"; }

if ! [[ "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1024 || PORT > 65532)); then
  die "SLURM_CLUSTER_PORT must be a port number (1024-65532), got '$PORT'"
fi
[[ "$TIMEOUT" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CLUSTER_TIMEOUT must be a number of seconds, got '$TIMEOUT'"
# Some daemons live in /usr/sbin, which a user's PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$CONF"

# --- the daemons: name, program, pid file ------------------------------------------------------------------
daemons() {
  echo "munged munged $DIR/munge/munged.pid"
  echo "slurmctld slurmctld $DIR/run/slurmctld.pid"
  local node
  for node in "${NODES[@]}"; do echo "slurmd-$node slurmd $DIR/run/slurmd-$node.pid"; done
}

# The pid in PIDFILE when that process is alive and is PROGRAM (a pid file left behind by a crash, whose
# number the system has since given to another process, does not count).
running_pid() {
  local program=$1 pidfile=$2 pid
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$program" ]] || return 1
  # a zombie (exited, not yet reaped by its parent) is not running
  [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] || return 1
  echo "$pid"
}

# --- install ---------------------------------------------------------------------------------------------
install_packages() {
  local missing=() program
  for program in "${PROGRAMS[@]}"; do command -v "$program" >/dev/null || missing+=("$program"); done
  ((${#missing[@]} == 0)) && return 0
  ((EUID == 0)) || die "cannot bring up Slurm: ${missing[*]} not installed and installing needs root (sudo make slurm-up)"
  command -v apt-get >/dev/null ||
    die "cannot bring up Slurm: ${missing[*]} not installed and no apt-get here (install Slurm 22.05+ and munge yourself)"
  mkdir -p "$DIR"
  say "installing ${PACKAGES[*]} with apt-get (about a minute; log: $DIR/apt.log)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q "${PACKAGES[@]}" >"$DIR/apt.log" 2>&1; then
    { apt-get update -q && apt-get install -y -q "${PACKAGES[@]}"; } >>"$DIR/apt.log" 2>&1 ||
      die "cannot bring up Slurm: apt-get install ${PACKAGES[*]} failed (see $DIR/apt.log)"
  fi
  for program in "${PROGRAMS[@]}"; do
    command -v "$program" >/dev/null || die "cannot bring up Slurm: $program is still missing after apt-get install"
  done
}

# --- configuration -----------------------------------------------------------------------------------------
write_config() {
  local host node port=$PORT
  host=$(hostname -s)
  mkdir -p "$DIR"/{state,spool,log,run}
  {
    echo "# Written by tools/slurm_cluster.sh: two nodes on one host ($host), everything under $DIR."
    echo "ClusterName=scalingdl"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$MUNGE_SOCKET"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    # No cgroups here: processes are tracked through /proc, tasks are not bound to cores.
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    # Finished jobs with their final state, one line each (there is no accounting database for sacct).
    echo "JobCompType=jobcomp/filetxt"
    echo "JobCompLoc=$DIR/log/jobs.txt"
    echo "MpiDefault=none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=60"
    echo "MinJobAge=600"
    echo "KillWait=5"
    echo "InactiveLimit=0"
    for node in "${NODES[@]}"; do
      port=$((port + 1))
      echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=2 RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF.new"
  mv "$CONF.new" "$CONF"
}

# Node names must resolve (slurmd and srun look them up): both are this host.
ensure_hosts() {
  local node missing=()
  for node in "${NODES[@]}"; do getent hosts "$node" >/dev/null || missing+=("$node"); done
  ((${#missing[@]} == 0)) && return 0
  say "adding '127.0.0.1 ${missing[*]}' to /etc/hosts (the node names must resolve)"
  local sep=""  # a last line without its newline would otherwise swallow ours
  [[ -s /etc/hosts && -n "$(tail -c 1 /etc/hosts)" ]] && sep=$'\n'
  printf '%s127.0.0.1 %s\n' "$sep" "${missing[*]}" >>/etc/hosts || die "cannot bring up Slurm: cannot add '127.0.0.1 ${missing[*]}' to /etc/hosts"
}

# --- start -------------------------------------------------------------------------------------------------
start_munged() {
  local pid
  if pid=$(running_pid munged "$DIR/munge/munged.pid"); then return 0; fi
  # munged insists on its files belonging to the munge user, the key private, the socket's folder reachable.
  getent passwd munge >/dev/null || die "cannot bring up Slurm: no 'munge' user (is the munge package installed?)"
  install -d -m 0711 -o munge -g munge "$DIR/munge"
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    (umask 077; head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
  fi
  chown munge:munge "$DIR/munge/munge.key"
  chmod 0600 "$DIR/munge/munge.key"
  runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" ||
    die "munged did not start (see $DIR/munge/munged.log)"
  say "munged started"
}

# Start PROGRAM ARGS... unless its pid file names a live one; the daemon writes the pid file itself.
start_daemon() {
  local name=$1 pidfile=$2 log=$3 i
  shift 3
  if running_pid "$1" "$pidfile" >/dev/null; then return 0; fi
  rm -f "$pidfile"
  "$@" || die "$name did not start (see $log)"
  for ((i = 0; i < 50; i++)); do
    running_pid "$1" "$pidfile" >/dev/null && { say "$name started"; return 0; }
    sleep 0.2
  done
  die "$name did not start (no live pid in $pidfile; see $log)"
}

node_states() { sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

wait_until_idle() {
  local deadline=$((SECONDS + TIMEOUT)) states node state ready
  while ((SECONDS < deadline)); do
    states=$(node_states) || true
    ready=0
    for node in "${NODES[@]}"; do
      state=$(awk -v n="$node" '$1 == n {print $2}' <<<"$states")
      # idle, or busy with jobs from before (mix/alloc/completing); not down, drained or unknown
      [[ "$state" =~ ^(idle|mix|alloc|comp)$ ]] && ready=$((ready + 1))
    done
    if ((ready == ${#NODES[@]})); then
      say "up: nodes ${NODES[*]} $(awk '{printf "%s%s", sep, $2; sep=","}' <<<"$states")"
      return 0
    fi
    sleep 1
  done
  die "Slurm nodes not idle after ${TIMEOUT}s: $(tr '\n' ' ' <<<"${states:-no answer from slurmctld}")(logs in $DIR/log)"
}

cmd_up() {
  ((EUID == 0)) || die "cannot bring up Slurm: it needs root (slurmd starts every job's processes as their user): sudo make slurm-up"
  install_packages
  ensure_hosts
  local node
  if ! running_pid slurmctld "$DIR/run/slurmctld.pid" >/dev/null; then
    write_config
  fi
  start_munged
  start_daemon slurmctld "$DIR/run/slurmctld.pid" "$DIR/log/slurmctld.log" slurmctld -f "$CONF"
  for node in "${NODES[@]}"; do
    start_daemon "slurmd $node" "$DIR/run/slurmd-$node.pid" "$DIR/log/slurmd-$node.log" slurmd -f "$CONF" -N "$node"
  done
  wait_until_idle
  say "use it with: export SLURM_CONF=$CONF"
}

# --- stop --------------------------------------------------------------------------------------------------
cmd_down() {
  local name program pidfile pid i stopped=0 left
  # slurmd first, munged last (the others need it to say goodbye).
  while read -r name program pidfile; do
    pid=$(running_pid "$program" "$pidfile") || { rm -f "$pidfile"; continue; }
    kill -TERM "$pid" 2>/dev/null || die "cannot stop $name (pid $pid): not allowed (it runs as root: sudo make slurm-down)"
    for ((i = 0; i < 50; i++)); do
      running_pid "$program" "$pidfile" >/dev/null || break
      sleep 0.2
    done
    if running_pid "$program" "$pidfile" >/dev/null; then
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
    rm -f "$pidfile"
    say "$name stopped (pid $pid)"
    stopped=$((stopped + 1))
  done < <(daemons | tac)
  ((stopped > 0)) || say "nothing was running"
  left=$(daemons | while read -r name program pidfile; do
    if running_pid "$program" "$pidfile" >/dev/null; then echo "$name"; fi
  done)
  [[ -z "$left" ]] || die "still running: $(echo "$left" | tr '\n' ' ')"
}

# --- status ------------------------------------------------------------------------------------------------
cmd_status() {
  local name program pidfile pid down=0
  while read -r name program pidfile; do
    if pid=$(running_pid "$program" "$pidfile"); then
      printf '%-10s running (pid %s)\n' "$name" "$pid"
    else
      printf '%-10s stopped\n' "$name"
      down=$((down + 1))
    fi
  done < <(daemons)
  if ((down == 0)); then
    sinfo -N -o '%N %P %t %c' || true
    echo "SLURM_CONF=$CONF"
    return 0
  fi
  return 3
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: bash $0 up|down|status   (a 2-node Slurm cluster on this machine, in ${DIR})" >&2; exit 2 ;;
esac
