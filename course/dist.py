"""Who am I? Rank discovery for every launcher the course uses, and the torch.distributed setup.

``discover()`` reads the environment that the launcher left for this process:

========================  ========================================================================
launcher                  variables
========================  ========================================================================
torchrun / deepspeed      RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
horovodrun (gloo)         HOROVOD_RANK, HOROVOD_LOCAL_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_SIZE
PALS (Polaris mpiexec)    PALS_RANKID, PALS_LOCAL_RANKID, PMI_SIZE, PALS_LOCAL_SIZE/PMI_LOCAL_SIZE
MPICH Hydra (laptop)      PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
Open MPI (Sophia mpirun)  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
Slurm (srun)              SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
(none of these)           mpi4py if an MPI launcher is suspected, else a single process
========================  ========================================================================

The other way round (the command that starts an example under each launcher) is the tools' side:
tools/launch.py.
"""
import os
import socket
import subprocess
import sys
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


def _slurm_local_size():
    # SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; SLURM_TASKS_PER_NODE looks like
    # "4(x2),3".
    if os.environ.get("SLURM_NTASKS_PER_NODE"):
        return int(os.environ["SLURM_NTASKS_PER_NODE"])
    first = os.environ.get("SLURM_TASKS_PER_NODE", "1").split(",")[0]
    return int(first.split("(")[0])


def discover():
    """Rank, local rank, world size, local world size and launcher name of this process."""
    env = os.environ
    if "HOROVOD_RANK" in env and "RANK" not in env:
        return DistEnv(_int("HOROVOD_RANK"), _int("HOROVOD_LOCAL_RANK", 0), _int("HOROVOD_SIZE"),
                       _int("HOROVOD_LOCAL_SIZE", 1), "horovodrun")
    if "RANK" in env and "WORLD_SIZE" in env:
        # torchrun sets TORCHELASTIC_RUN_ID; DeepSpeed's launcher sets RANK/LOCAL_RANK/WORLD_SIZE
        # without it.
        torchrun = "TORCHELASTIC_RUN_ID" in env
        launcher = "torchrun" if torchrun else env.get("COURSE_LAUNCHER", "deepspeed")
        world = _int("WORLD_SIZE")
        return DistEnv(_int("RANK"), _int("LOCAL_RANK", 0), world,
                       _int("LOCAL_WORLD_SIZE", _int("LOCAL_SIZE", world)), launcher)
    if "PALS_RANKID" in env:
        size = _int("PMI_SIZE") or _int("PALS_SIZE")
        return DistEnv(_int("PALS_RANKID"), _int("PALS_LOCAL_RANKID", 0), size,
                       _int("PALS_LOCAL_SIZE", _int("PMI_LOCAL_SIZE", size)), "mpiexec (PALS)")
    if "OMPI_COMM_WORLD_RANK" in env:
        return DistEnv(_int("OMPI_COMM_WORLD_RANK"), _int("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                       _int("OMPI_COMM_WORLD_SIZE"), _int("OMPI_COMM_WORLD_LOCAL_SIZE", 1),
                       "mpirun (Open MPI)")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "MPI_LOCALRANKID" not in env:
        # srun (with or without --mpi=pmi2, which adds PMI_RANK/PMI_SIZE but no local rank): Slurm's
        # numbers.
        return DistEnv(_int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), _int("SLURM_NTASKS"),
                       _slurm_local_size(), "srun")
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        size = _int("PMI_SIZE")
        return DistEnv(_int("PMI_RANK"), _int("MPI_LOCALRANKID", _int("PMI_LOCAL_RANK", 0)), size,
                       _int("MPI_LOCALNRANKS", _int("PMI_LOCAL_SIZE", size)), "mpiexec")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(_int("SLURM_PROCID"), _int("SLURM_LOCALID", 0), _int("SLURM_NTASKS"),
                       _slurm_local_size(), "srun")
    return DistEnv()


def _mpi_bcast(value):
    """rank 0's value on every rank, over MPI (only used when the launcher was MPI and ranks span
    nodes)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.bcast(value, root=0)


def device_problem(device):
    """What is wrong with --device `device` here, as one line (cuda or xpu where torch sees none),
    or None: the one check of the flag, by course/checks.py's parse() (each lesson's step [2] then
    picks the device itself)."""
    import torch
    module = getattr(torch, device, None)
    if device in ("cuda", "xpu") and not (module is not None and module.is_available()):
        return (f"--device {device}: this torch ({torch.__version__}) sees no {device} device "
                f"(torch.{device}.is_available() is False); use --device cpu or auto")
    return None


def cores():
    """(the cores this process may use, whether the launcher bound it to them)."""
    has_affinity = hasattr(os, "sched_getaffinity")
    allowed = len(os.sched_getaffinity(0)) if has_affinity else os.cpu_count()
    return allowed, allowed < (os.cpu_count() or allowed)


def warn_shared_cores(local_world_size):
    """More ranks on this node than cores, unbound: said once, by local rank 0."""
    allowed, bound = cores()
    if not bound and local_world_size > allowed and discover().local_rank == 0:
        sys.stderr.write(f"warning: {local_world_size} ranks on the {allowed} core(s) of this "
                         "node: ranks share cores, so steps are slower than with one rank per "
                         "core\n")


def threads_per_rank(requested, local_world_size):
    """CPU threads for this rank: --num-threads, else the cores we may use shared by the ranks on
    this node."""
    warn_shared_cores(local_world_size)
    allowed, bound = cores()
    if requested:
        return requested
    return max(1, allowed if bound else allowed // max(1, local_world_size))


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


# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (Horovod's default: 1) to agree with
# the other ranks on which tensors are ready: a small collective each time, 1,000 a second per rank.
# On GPU nodes it has a core to itself; on CPU ranks it takes that time from the compute thread of a
# core it shares. `make bench` measures this choice against Horovod's default in every run (README,
# Performance).
HOROVOD_CPU_KNOBS = {"HOROVOD_CYCLE_TIME": "5"}


def horovod_knobs(on_cpu, dist_timeout=None):
    """Before hvd.init(): the course's Horovod settings for CPU ranks, unless the environment sets
    them.

    `dist_timeout` (--dist-timeout) becomes HOROVOD_GLOO_TIMEOUT_SECONDS, the timeout of every gloo
    operation Horovod runs (its default: 30 s), so the flag bounds a hung peer in the Horovod
    examples as it does in the torch.distributed ones. `horovodrun --gloo-timeout-seconds N` sets
    the variable itself and wins."""
    if on_cpu:
        for name, value in HOROVOD_CPU_KNOBS.items():
            os.environ.setdefault(name, value)
    if dist_timeout:
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(dist_timeout))
    return {name: os.environ.get(name, "Horovod's default") for name in HOROVOD_CPU_KNOBS}


# The vendor collective libraries and the one device kind each connects.
GPU_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


def backend_problem(backend, device):
    """What is wrong with --backend `backend` for `device`, as one line, or None: the one check of
    the flag, by course/checks.py's parse() before any process group, with --device (`auto` until
    a rank picks one; each lesson's step [1] then picks the backend itself)."""
    if backend == "auto":
        return None
    import torch
    import torch.distributed as dist
    if not getattr(dist, f"is_{backend}_available", lambda: True)():
        return (f"--backend {backend}: this torch build has no {backend} backend "
                f"(torch {torch.__version__}); use --backend auto")
    kind, wants = device.split(":")[0], GPU_BACKENDS.get(backend)
    seen = getattr(getattr(torch, wants or "cpu", None), "is_available", bool)
    if wants and kind == "auto" and not seen():
        return (f"--backend {backend} connects {wants} devices and torch sees none here; "
                "use --backend auto")
    if wants and kind not in ("auto", wants):
        return f"--backend {backend} connects {wants} devices, not {device}; use --backend auto"
    if backend == "gloo" and kind == "xpu":
        return "--backend gloo cannot move xpu tensors; use --backend xccl (or auto)"
    return None


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


def default_extensions_dir():
    """DeepSpeed's JIT-built ops go to a cache outside the checkout (where `make setup` puts
    them), one folder per Python environment: a build records its environment's paths, and a run
    from another environment (a second clone's venv) would rebuild it over the first one's."""
    import hashlib
    home_cache = os.path.join(os.path.expanduser("~"), ".cache", "scaling-dl")
    cache = os.environ.get("SCALING_DL_CACHE", home_cache)
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(cache, "torch_extensions", env_id))
