#!/usr/bin/env python
"""Nodes with a network between them, on one machine: each "node" a network namespace with one interface
(eth0) and an address of its own, all joined through a switch (a bridge in a namespace of its own), each node's
link shaped to a known rate with `tc` (a token bucket, tbf, on what the node sends). Ranks started in a node's
namespace talk to the other nodes over that link, not over loopback.

    python tools/nodes.py up --nodes 2 --rate 1gbit     # course-cli-node0, -node1: eth0 at 10.77.0.1, 10.77.0.2
    python tools/nodes.py run 1 -- ip -brief addr        # a command in node 1
    python tools/nodes.py down                           # those nodes gone (--all: every set this tool made)

Needs CAP_NET_ADMIN: root (CI and these machines), or, for a program that makes its nodes and uses them in one
run (tools/bench_network.py), a user namespace of its own (`as_root_of_a_user_namespace`: no sudo on a Linux
laptop whose kernel allows one). `ip netns` rather than
`unshare`: named namespaces outlive the command that made them, so each node's launcher can be started in its
node by name (`ip netns exec course-cli-node1 torchrun ...`), and `down` finds every one of them by its prefix.
Each set of nodes has a tag in its names (the CLI's "cli", a test's process id), so two test runs on one machine
never share a node.
Traffic stays between the namespaces made here, to their own addresses (10.77.0.0/24); no route leads out.
A delay (`--delay`: tc's netem, below the rate's tbf) needs a kernel with netem (sch_netem); where it has none (this
course's test machines), asking for one is one line, and only the rate is shaped.
"""
import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

PREFIX = "course-"
SUBNET = "10.77.0"


NO_SUCH_QDISC = "Specified qdisc kind is unknown"  # tc's words where the kernel lacks the qdisc asked for


def sh(*cmd, check=True, no_such_qdisc=None):
    """Run one `ip`/`tc` command; its error is one line (`no_such_qdisc`: the line where the kernel lacks it)."""
    try:
        result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise SystemExit(f"error: nodes: `{cmd[0]}` not found: install iproute2 (apt install iproute2)") from None
    if check and result.returncode != 0:
        said = " ".join(result.stderr.split())
        raise SystemExit(no_such_qdisc if no_such_qdisc and NO_SUCH_QDISC in said else
                         f"error: nodes: {' '.join(map(str, cmd))}: {said}")
    return result.stdout


USERNS = "COURSE_NODES_USER_NAMESPACE"  # set in the program run again inside its user namespace


def as_root_of_a_user_namespace(argv):
    """Root goes on. Anyone else runs `argv` (this program) again, as root of a user namespace of its own
    (`unshare --user --map-root-user --net --mount`: root there, themselves everywhere else), with a /run of its
    own for `ip netns`; namespaces, veth pairs and tc work there, and the namespaces go when the program ends.
    Where the kernel allows no user namespace: one line that says sudo. Never returns unless root."""
    if os.geteuid() == 0:
        return
    sudo = "run it as root with the course's python (sudo -s, then source .venv/bin/activate)"
    if os.environ.get(USERNS):
        raise SystemExit(f"error: nodes: not root inside the user namespace: {sudo}")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"error: nodes: network namespaces need root, and this kernel gives no user namespace "
                         f"({probe.stderr.strip() or 'unshare failed'}): {sudo}")
    print("nodes: not root: in a user namespace of this run's own (unshare), where it may make network "
          "namespaces", flush=True)
    env = dict(os.environ, **{USERNS: "1"}, PATH=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    boot = 'mount -t tmpfs course-run /run && mkdir -p /run/netns && exec "$@"'  # (ip netns keeps its names there)
    os.execvpe("unshare", ["unshare", "--user", "--map-root-user", "--net", "--mount", "--", "sh", "-c", boot,
                           "sh", sys.executable, *argv], env)


def address(node):
    return f"{SUBNET}.{node + 1}"


def namespaces(tag=""):
    """The namespaces this tool made (by their prefix), with `tag` those of one set of nodes."""
    prefix = f"{PREFIX}{tag}-" if tag else PREFIX
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.startswith(prefix)]


def up(count, rate=None, tag="cli", burst="256kb", latency="50ms", own_hosts=False, delay=None):
    """Make `count` nodes joined by a switch; `rate` (e.g. "1gbit", "200mbit"): each node's sending rate;
    `delay` (e.g. "1ms"): what each node sends waits that long first (a round trip between two nodes: twice it);
    own_hosts: each node's host name resolves to its address (hosts()). Returns the nodes' namespace names,
    node 0 first. A step that fails removes what was made, and is one line."""
    down(tag)  # what an earlier set of this tag left (a killed run)
    try:
        return _make(count, rate, tag, burst, latency, own_hosts, delay)
    except SystemExit:
        down(tag)
        raise


def _make(count, rate, tag, burst, latency, own_hosts, delay):
    switch = f"{PREFIX}{tag}-switch"
    sh("ip", "netns", "add", switch)
    sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", switch, "link", "set", "br0", "up")
    for node in range(count):
        name = f"{PREFIX}{tag}-node{node}"
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        # a cable: eth0 in the node, port<N> on the switch
        sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{node}",
           "netns", switch)
        sh("ip", "-n", switch, "link", "set", f"port{node}", "master", "br0")
        sh("ip", "-n", switch, "link", "set", f"port{node}", "up")
        sh("ip", "-n", name, "addr", "add", f"{address(node)}/24", "dev", "eth0")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
        below = ["root"]
        if delay:  # netem first, the rate's token bucket under it (tc-netem(8)'s own example)
            sh(*in_node(name, ["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", delay]),
               no_such_qdisc=f"error: nodes: --delay {delay}: this kernel has no netem qdisc (the module sch_netem), "
               "so no delay can be added here; only --rate shapes the link")
            below = ["parent", "1:1", "handle", "10:"]
        if rate:
            sh(*in_node(name, ["tc", "qdisc", "add", "dev", "eth0", *below, "tbf", "rate", rate, "burst", burst,
                               "latency", latency]))
        if own_hosts:
            hosts(name, node)
    return [f"{PREFIX}{tag}-node{node}" for node in range(count)]


def down(tag=""):
    """Remove the namespaces of one set of nodes (`tag`), or every one this tool made; their interfaces go with
    them, and the programs still running in them lose their network."""
    for name in namespaces(tag):
        sh("ip", "netns", "del", name, check=False)
        shutil.rmtree(os.path.join(ETC, name), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(tempfile.gettempdir(), f"{name}.hostfile"))
    with contextlib.suppress(OSError):
        os.rmdir(ETC)  # (when no other node has one)


ETC = "/etc/netns"  # `ip netns exec NAME` mounts the files in /etc/netns/NAME over /etc's


def hosts(name, node):
    """The node's own /etc/hosts: the machine's host name resolves to the node's address, as a cluster node's
    name resolves to its address on the cluster's network (without it every namespace shares one host name,
    which /etc/hosts gives to 127.0.0.1 here). What takes its address from the host name then takes the node's:
    Horovod 0.28.1's gloo does for its main process set, whatever HOROVOD_GLOO_IFACE says (diagnose/network.md).
    Where /etc is not writable (a user namespace's), the nodes go without."""
    host = os.uname().nodename  # (the host name, as socket.gethostname() gives it)
    with open("/etc/hosts") as f:
        kept = [line for line in f.read().splitlines() if host not in line.split("#")[0].split()[1:]]
    with contextlib.suppress(OSError):
        os.makedirs(os.path.join(ETC, name), exist_ok=True)
        with open(os.path.join(ETC, name, "hosts"), "w") as f:
            f.write("\n".join([*kept, f"{address(node)} {host}"]) + "\n")


@contextlib.contextmanager
def nodes(count, rate=None, own_hosts=False, delay=None):
    """with nodes(2, "1gbit") as names: ... -- a set of nodes of this process's own, removed however the block
    ends."""
    tag = f"p{os.getpid()}"
    try:
        yield up(count, rate, tag, own_hosts=own_hosts, delay=delay)
    finally:
        down(tag)


def link_bytes(names):
    """The bytes the nodes have sent into the link so far: each node's eth0 (what crosses between nodes; a rank's
    traffic to a rank of its own node goes over the node's loopback), TCP's headers and acknowledgements included."""
    sent = 0
    for name in names:
        link = json.loads(sh("ip", "-n", name, "-s", "-j", "link", "show", "eth0"))
        sent += link[0]["stats64"]["tx"]["bytes"]
    return sent


def hostfile(names, slots):
    """A hostfile of the nodes' addresses, `slots` ranks each (DeepSpeed's launcher reads one), beside the
    other temporary files; `down` removes it with the nodes."""
    path = os.path.join(tempfile.gettempdir(), f"{names[0]}.hostfile")
    with open(path, "w") as f:
        f.write("".join(f"{address(node)} slots={slots}\n" for node in range(len(names))))
    return path


def in_node(name, cmd):
    """`cmd` as run in the node (namespace) `name`."""
    return ["ip", "netns", "exec", name, *map(str, cmd)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    make = sub.add_parser("up", help="make the nodes")
    make.add_argument("--nodes", type=int, default=2, choices=range(2, 9), metavar="N")
    make.add_argument("--rate", default=None, help="each node's sending rate, as tc writes it: 200mbit, 1gbit")
    make.add_argument("--delay", default=None, help="what each node sends waits this long first, as tc writes "
                      "it: 1ms (tc's netem: not in every kernel)")
    make.add_argument("--own-hosts", action="store_true", help="each node's /etc/hosts gives this machine's name "
                      "the node's address, as a cluster's does (Horovod over gloo across nodes needs it)")
    remove = sub.add_parser("down", help="remove them")
    remove.add_argument("--all", action="store_true", help="every set of nodes this tool made (a test's too)")
    run = sub.add_parser("run", help="run a command in a node")
    run.add_argument("node", type=int)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.what == "up":
        for node, name in enumerate(up(args.nodes, args.rate, own_hosts=args.own_hosts, delay=args.delay)):
            print(f"{name}: eth0 {address(node)}/24" + (f", sending at most {args.rate}" if args.rate else "")
                  + (f", each packet {args.delay} late" if args.delay else ""))
    elif args.what == "down":
        down("" if args.all else "cli")
    else:
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        sys.exit(subprocess.run(in_node(f"{PREFIX}cli-node{args.node}", cmd)).returncode)


if __name__ == "__main__":
    main()
