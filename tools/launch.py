"""Starting examples: the one place the course's tools and tests get their launch commands.

The lessons never import this: they only *read* what a launcher set (course/dist.py, discover()). This module
writes the other side, the command that starts an example on N ranks of this host with one of those launchers.
"""
import collections
import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

from course.ranks import LOOPBACK, free_port

ROOT = Path(__file__).resolve().parents[1]


def _read_examples():  # {name: (script, data)}
    rows = (line.split("\t") for line in (ROOT / "tools" / "examples.tsv").read_text().splitlines()
            if line.strip() and not line.startswith("#"))
    return {name.strip(): (script.strip(), data.strip()) for name, script, data in rows}


_TABLE = _read_examples()
EXAMPLES = {name: script for name, (script, _) in _TABLE.items()}  # relative to the repository root
READS_MNIST = {name for name, (_, data) in _TABLE.items() if data == "mnist"}  # --data-dir: MNIST
LAUNCHERS = ("python", "torchrun", "mpiexec", "horovodrun", "horovodrun-mpi", "deepspeed")


def script_path(example):
    """An EXAMPLES name or a path (relative to the repository root, or absolute) -> absolute path."""
    return ROOT / EXAMPLES.get(str(example), example)


def launch_command(example, nproc=1, launcher="torchrun", args=(), *, port=None, wrapper=None, bin_dir=None,
                   python=None, launcher_flags=()):
    """The command (a list of strings) that runs `example` on `nproc` ranks of this host under `launcher`.

    example: an EXAMPLES name or a script path; args: the example's own flags; port: the rendezvous port
    (default: a free one); wrapper: a script that runs in front of the example in every rank (it gets the
    example's path as its first argument: tools/phases.py); bin_dir: where the launchers are (default:
    beside this Python, i.e. the venv's bin); launcher_flags: extra flags for the launcher itself.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    python = str(python or sys.executable)
    bin_dir = Path(bin_dir or Path(sys.executable).parent)
    port = str(port or free_port())
    program = [str(wrapper), str(script_path(example))] if wrapper else [str(script_path(example))]
    tail = [*map(str, args)]
    if launcher == "python":
        if nproc != 1:
            raise ValueError("launcher 'python' starts one process")
        return [python, *program, *tail]
    if launcher == "torchrun":
        return [str(bin_dir / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", LOOPBACK,
                "--master_port", port, *launcher_flags, *program, *tail]
    if launcher == "mpiexec":  # MPICH's Hydra: -env passes MASTER_PORT to every rank
        return [str(bin_dir / "mpiexec"), "-n", str(nproc), "-env", "MASTER_PORT", port, *launcher_flags,
                python, *program, *tail]
    if launcher in ("horovodrun", "horovodrun-mpi"):
        controller = "--gloo" if launcher == "horovodrun" else "--mpi"
        return [str(bin_dir / "horovodrun"), "-np", str(nproc), controller, *launcher_flags, python, *program,
                *tail]
    # deepspeed: on CPUs --num_gpus is the process count (without it, one process)
    return [str(bin_dir / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, *launcher_flags,
            *program, *tail]


def torchrun_worker_env(rank, nproc, port, nodes=1, master_addr=LOOPBACK):
    """The variables torchrun gives worker `rank` of `nproc` (on `nodes` nodes of nproc / nodes ranks each, node 0
    at `master_addr`: `torchrun --nnodes --node_rank --master_addr`; torch 2.14, printed from a worker), less its
    agent's own: TORCHELASTIC_USE_AGENT_STORE (the agent hosts the store; without an agent, rank 0 does, as under
    mpiexec) and TORCHELASTIC_ERROR_FILE (its per-attempt folder). For tests/warm.py, which starts a lesson's
    ranks without the launcher, as torchrun would have started them."""
    per_node = nproc // nodes
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **({"OMP_NUM_THREADS": "1"} if per_node > 1 else {})}


def horovodrun_worker_env(rank, nproc, port):
    """The variables `horovodrun --gloo` gives rank `rank` of `nproc` on this host (Horovod 0.28, printed from a
    rank), its rendezvous server (an HTTP key-value store, horovod.runner.http.http_server) at LOOPBACK:`port`.
    For tests/warm.py, which starts that server itself and the ranks without the launcher."""
    return {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo",
            "NCCL_SOCKET_IFNAME": "lo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": LOOPBACK,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(nproc), "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(nproc),
            "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}


def nodes_over_a_network(example, namespaces, nproc_per_node, args=(), *, launcher="torchrun", port=29400,
                         bin_dir=None, interface="eth0", python=None):
    """Commands that run `example` on the nodes tools/nodes.py made (network namespaces, node N's eth0 at
    nodes.address(N)), `nproc_per_node` ranks on each; gloo told which interface reaches the
    other nodes (GLOO_SOCKET_IFNAME=eth0; `interface` names another, as a mistaken job would). Each namespace
    has ports of its own: a fixed port is free.

    torchrun: one per node, in its namespace, each told its node's number and node 0's address (torchrun's
    static rendezvous, as PyTorch's multi-node example: the namespaces share the machine's hostname, which a
    c10d rendezvous would take for node 0's). mpiexec (MPICH's Hydra): one, in node 0, over a host list of
    the nodes' addresses; Hydra starts each node's proxy through tools/node_rsh.sh (in the node's namespace)
    where a cluster uses ssh, and `-iface eth0` (`interface`) makes it, and MPI, use the link; MASTER_ADDR is node 0's
    address. horovodrun (--gloo): one, in node 0, over a host list of the nodes' addresses; it reaches the other
    nodes through tools/node_ssh/ssh, first on its PATH, where a cluster uses ssh, and `--network-interface eth0`
    tells the ranks' gloo the link. deepspeed: one, in node 0, over a hostfile of the nodes' addresses, with its
    MPICH runner (`--launcher mpich`: Hydra's mpirun, given node_rsh.sh as above through --launcher_args); its
    check that node 0 answers ssh goes through tools/node_ssh/ssh."""
    from tools import nodes
    bin_dir = Path(bin_dir or Path(sys.executable).parent)
    program, tail = str(script_path(example)), [*map(str, args)]
    address = nodes.address(0)
    ssh = f"PATH={ROOT / 'tools' / 'node_ssh'}:{bin_dir}:{os.environ.get('PATH', '')}"  # (node_ssh/ssh first)
    # one launcher in node 0; tools/node_rsh.sh and tools/node_ssh/ssh find the other nodes by this prefix
    in_node0 = ["ip", "netns", "exec", namespaces[0], "env", f"COURSE_NODES={namespaces[0].removesuffix('0')}"]
    if launcher == "torchrun":
        return [["ip", "netns", "exec", name, "env", f"GLOO_SOCKET_IFNAME={interface}", str(bin_dir / "torchrun"),
                 "--nnodes", str(len(namespaces)), "--node_rank", str(node), "--nproc_per_node", str(nproc_per_node),
                 "--master_addr", address, "--master_port", str(port), program, *tail]
                for node, name in enumerate(namespaces)]
    if launcher == "mpiexec":
        hosts = ",".join(nodes.address(node) for node in range(len(namespaces)))
        return [[*in_node0, str(bin_dir / "mpiexec"), "-iface", interface, "-launcher", "ssh", "-launcher-exec",
                 str(ROOT / "tools" / "node_rsh.sh"), "-hosts", hosts, "-ppn", str(nproc_per_node),
                 "-n", str(len(namespaces) * nproc_per_node), "-genv", "MASTER_ADDR", address,
                 "-genv", "MASTER_PORT", str(port), "-genv", "GLOO_SOCKET_IFNAME", interface,
                 str(python or sys.executable), program, *tail]]
    if launcher == "horovodrun":
        hosts = ",".join(f"{nodes.address(node)}:{nproc_per_node}" for node in range(len(namespaces)))
        return [[*in_node0, ssh, str(bin_dir / "horovodrun"), "--gloo", "--network-interface", interface, "-np",
                 str(len(namespaces) * nproc_per_node), "-H", hosts, str(python or sys.executable), program, *tail]]
    if launcher == "deepspeed":  # its MPICH runner: Hydra's mpirun, told the link and how to reach node 1
        hostfile = nodes.hostfile(namespaces, nproc_per_node)
        return [[*in_node0, f"GLOO_SOCKET_IFNAME={interface}", ssh, str(bin_dir / "deepspeed"), "--hostfile", hostfile,
                 "--launcher", "mpich",
                 f"--launcher_args=-iface {interface} -launcher ssh -launcher-exec {ROOT / 'tools' / 'node_rsh.sh'}",
                 "--master_addr", address, "--master_port", str(port), program, *tail]]
    raise ValueError(f"nodes over a network are started by torchrun, mpiexec, horovodrun or deepspeed, not "
                     f"{launcher!r}")


# The ports a launch meets: tools/soak.py --port-pressure and its control.
@contextlib.contextmanager
def port_pressure(held=7000):
    """Meanwhile keep `held` listening sockets on ports the kernel picks (bind to port 0), dropping the
    oldest for a new one all the time: what srun does for its I/O and messages ("ephemeral ... selected
    by the kernel", slurm.conf's SrunPortRange), and gloo and TCPStore for theirs, many times over.
    A MASTER_PORT from that same pool can be taken before rank 0 listens on it."""
    stop = threading.Event()

    def churn():
        sockets = collections.deque()
        while not stop.is_set():
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            s.listen(1)
            sockets.append(s)
            if len(sockets) > held:
                sockets.popleft().close()
            time.sleep(0.0002)
        for s in sockets:
            s.close()
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def kernel_port():
    """A port the way free_port() picked it before (bind to port 0, release): the control."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]
