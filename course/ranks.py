"""Who am I? Rank discovery for every launcher the course uses, outside the lessons (the plumbing,
diagnose/, the tools), and where the ranks meet.

``discover()`` reads the environment that the launcher left for this process, with the lessons' own
table (LAUNCHERS, below): torchrun and DeepSpeed's launcher, horovodrun, mpiexec under PALS (Polaris,
Aurora), MPICH's Hydra, Open MPI's mpirun (Sophia), srun; none of them: a single process.

The other way round (the command that starts an example under each launcher) is the tools' side:
tools/launch.py.
"""
import os
import socket
import subprocess
from dataclasses import asdict, dataclass, replace

from course.errors import fail

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class DistEnv:
    """Who this process is, built once: discover() fills the launcher's part; a lesson adds its
    device, backend and threads with dataclasses.replace once it has picked them."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "python"
    device: str = "cpu"
    backend: str = "none"
    num_threads: int = 1
    master_addr: str = LOOPBACK
    master_port: int = 29500

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    def as_dict(self):
        return asdict(self)


def _int(name, default=None):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


# What each launcher sets: rank, local rank, world size, ranks on this node. The lessons' table (LAUNCHERS in
# each lesson's step [1], read the same way by who_am_i) with horovodrun's row added: one reading of the
# ranks, inside the lessons and out (tests/test_dist.py keeps the rows equal).
LAUNCHERS = {"torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
             "horovodrun": ("HOROVOD_RANK", "HOROVOD_LOCAL_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"),
             "mpiexec (PALS)": ("PALS_RANKID", "PALS_LOCAL_RANKID", "PMI_SIZE", "PALS_LOCAL_SIZE"),
             "mpirun (Open MPI)": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                   "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
             "mpiexec": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
             "srun": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")}


def discover():
    """Rank, local rank, world size, local world size and launcher name of this process: the
    lessons' who_am_i, on the table above. torchrun's variables without TORCHELASTIC_RUN_ID are
    DeepSpeed's launcher's (or COURSE_LAUNCHER's, where the tests start ranks themselves)."""
    e = os.environ
    if "SLURM_STEP_ID" in e and "MPI_LOCALRANKID" not in e:  # srun (its PMI_RANK has no local rank)
        e = {k: v for k, v in e.items() if not k.startswith("PMI_")}
    for name, (rank, local, size, local_size) in LAUNCHERS.items():
        if rank in e and size in e:
            local_sizes = e.get(local_size) or e.get("SLURM_TASKS_PER_NODE", e[size])
            if name == "torchrun" and "TORCHELASTIC_RUN_ID" not in e:
                name = e.get("COURSE_LAUNCHER", "deepspeed")
            return DistEnv(int(e[rank]), int(e.get(local, 0)), int(e[size]),
                           int(local_sizes.split("(")[0].split(",")[0]), name)
    return DistEnv()


def _mpi_bcast(value):
    """rank 0's value on every rank, over MPI (only used when the launcher was MPI and ranks span
    nodes)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.bcast(value, root=0)


def _slurm_first_host():
    """The first host of this Slurm step (where srun puts rank 0), or None without Slurm's
    scontrol."""
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError, TypeError):
        return None
    hosts = out.stdout.split() if out.returncode == 0 else []
    return hosts[0] if hosts else None


def master_address(env):
    """MASTER_ADDR/PORT: the environment's if set; loopback when every rank is on this host; else
    rank 0's host."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        if env.local_world_size >= env.world_size:
            addr = LOOPBACK
        elif env.launcher == "srun" and (first := _slurm_first_host()):
            addr = first  # rank 0 runs on the step's first node (no MPI needed)
        elif env.launcher.startswith(("mpiexec", "mpirun", "srun")):
            addr = _mpi_bcast(socket.gethostname())
        else:
            fail("ranks span several hosts: set MASTER_ADDR to rank 0's host name")
    return addr, _int("MASTER_PORT", default_port())


def default_port():
    """29500, moved by the scheduler's job number (PBS_JOBID 4242.host: 29742), which every rank of
    a job sees alike: two jobs sharing a node (Sophia's by-gpu queue, a shared Slurm partition)
    then rarely meet on one port, where rank 0 of the second could not listen."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or ""
    digits = job[:len(job) - len(job.lstrip("0123456789"))]
    return 29500 + int(digits) % 1000 if digits else 29500


def free_port():
    """A TCP port on loopback that nobody uses right now (a private rendezvous), from below the
    kernel's ephemeral range. An ephemeral port (what binding port 0 gives) is what every program
    that listens on "any free port" gets too (srun for its I/O, gloo, a TCPStore), so it can be
    taken again by the time rank 0 listens on it: rank 0 then fails with EADDRINUSE and the other
    ranks wait for it (seen once in a Slurm job; tools/soak.py --port-pressure shows it)."""
    import random
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default; macOS's range starts at 49152
    pick = random.SystemRandom()  # not the lessons' seeded generator: two runs must not pick alike
    for _ in range(200):
        port = pick.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all tried were taken: the kernel's choice
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def export_rendezvous(env):
    """Where the ranks meet, for init_process_group's default env:// method:
    MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (torchrun sets them itself; mpiexec, srun
    and horovodrun do not). Returns `env` with that address."""
    addr, port = master_address(env) if env.distributed else (LOOPBACK, 29500)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(env.rank),
                      WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size))
    return replace(env, master_addr=addr, master_port=port)
