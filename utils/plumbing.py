"""Course plumbing: what a lesson does not teach, around it. A lesson brings it in with one visible
import (commented as plumbing) and runs the same without it, as a copy in another project does:

- importing it makes a missing or too old framework one line, filters the libraries' noise
  (quiet.py; COURSE_VERBOSE=1 shows it) and gives the process its own temporary folder (scratch.py);
- run_main(main, parser) checks every flag (utils/checks.py: paths, device, backend, --resume), then
  calls main(args) and ends every way it can go wrong in one line (utils/failures.py).
"""
import contextlib
import functools
import importlib.abc
import importlib.metadata
import re
import sys

from utils import beacon, log, quiet, scratch, seal, watch

FRAMEWORKS = ("torch", "tensorflow", "keras", "tf_keras", "horovod", "deepspeed", "mpi4py", "numpy",
              "mlxtend")


def _missing_framework_hook(kind, value, tb, default=sys.excepthook):
    missing = isinstance(value, ImportError)
    name = (getattr(value, "name", None) or "").split(".")[0] if missing else ""
    if missing and "Extension horovod.torch has not been built" in str(value):
        # Horovod is there, but built without PyTorch (as in Aurora's frameworks module)
        sys.stderr.write("error: this Horovod was built without PyTorch support "
                         "(`import horovod.torch` fails): use PyTorch DDP instead (DDP/main.py, "
                         "the same recipe), or rebuild Horovod with HOROVOD_WITH_PYTORCH=1\n")
        sys.stderr.flush()
        return
    if name not in FRAMEWORKS:
        return default(kind, value, tb)
    sys.stderr.write(f"error: {value} ({sys.executable}): activate the course's environment "
                     "(source .venv/bin/activate; `make setup` builds it), or on an ALCF machine "
                     "load the frameworks module (submissions/README.md)\n")
    sys.stderr.flush()


# The oldest version each framework's lessons run on, and why: checked when a lesson first imports
# it (an ALCF module can be older: Polaris' conda/2024-04-29 has torch 2.3).
MINIMUM = {"torch": ((2, 7), "torch.accelerator.set_device_index, the lessons' step [2]")}


class _OldFramework(importlib.abc.MetaPathFinder):
    """At a framework's first import, its installed version (read from its metadata, before any of
    it runs) against MINIMUM: too old is one line and exit 2, not an AttributeError mid-run."""

    def find_spec(self, name, path=None, target=None):
        if name not in MINIMUM:
            return None
        sys.meta_path.remove(self)  # once
        need, why = MINIMUM[name]
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None  # not installed: the import fails, and _missing_framework_hook says so
        if tuple(int(n) for n in re.findall(r"\d+", found)[:2]) < need:
            from utils.errors import fail
            fail(f"this lesson needs {name} >= {'.'.join(map(str, need))} ({why}); found {found} "
                 f"({sys.executable}): load a newer module, or use the course's environment")
        return None


def install():
    """Before the frameworks are imported: a missing one is one line, one too old too; the
    libraries' noise is filtered."""
    sys.excepthook = _missing_framework_hook
    if "torch" not in sys.modules and not any(isinstance(f, _OldFramework) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldFramework())
    quiet.install()


def run_main(main, parser):
    """main(args) with the flags checked, every ending one line (utils/failures.py), and nothing
    done for --resume auto on a run that has finished."""
    from utils import checks, failures

    def checked_main():
        args = checks.parse(parser)
        checks.take_log_dir(args)  # one run per folder: a second one on it is refused
        checks.remember_flags(args, parser)  # --resume: the saved run's flags, unless given anew
        _before_main(args)
        if not checks.finished_already(args):
            checks.resume_check(args)
            main(args)
    failures.run_main(checked_main)


def _before_main(args):
    """Cores shared by more ranks than they have; with DeepSpeed: --dist-timeout for the groups it
    makes itself, its JIT ops cached outside the checkout, and deepspeed/main.py's config checked
    and deepspeed.initialize wrapped (utils/ds_guard.py)."""
    from utils.dist import discover, warn_shared_cores
    warn_shared_cores(discover().local_world_size)
    if dist := sys.modules.get("torch.distributed"):
        c10d = sys.modules["torch.distributed.distributed_c10d"]  # (device meshes call it there)
        _watch_joining(dist, "init_process_group", lambda: (dist.get_rank(), dist.get_world_size()),
                       quiet.C10D_CONNECT_NOISE, also=[c10d])
    for name in ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras"):
        if hvd := sys.modules.get(name):
            _watch_joining(hvd, "init", lambda hvd=hvd: (hvd.rank(), hvd.size()))
    if "deepspeed" in sys.modules:
        from utils import ds_guard
        ds_guard.install(args)


def _watch_joining(module, name, rank_and_size, noise=None, also=()):
    """module.<name> (torch.distributed.init_process_group, hvd.init), wherever it is called from
    (a lesson, DeepSpeed, a device mesh): the stderr lines matching `noise` dropped while it runs,
    unless COURSE_VERBOSE (c10d's C++ frame dumps while a rank finds no rank 0: utils/failures.py
    says so in one line), and once joined the rank's position kept in the store (utils/beacon.py).
    `also`: other modules that hold the same function under the same name."""
    join = getattr(module, name)
    if getattr(join, "watched", False):
        return

    @functools.wraps(join)
    def watched(*args, **kwargs):
        quiet_now = noise and not quiet.verbose()
        with quiet.filtered_stderr(noise) if quiet_now else contextlib.nullcontext():
            result = join(*args, **kwargs)
        beacon.start(*rank_and_size())
        return result
    watched.watched = True
    for owner in (module, *also):
        setattr(owner, name, watched)


install()
scratch.private_tmp()  # (after install(): the line numbers above are quoted in diagnose/hangs.md)
watch.install(log)  # TensorBoard's event files and the failure reports, around log's classes
seal.install(log)  # every checkpoint with the SHA-256 of its files, checked on --resume
