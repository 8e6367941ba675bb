"""Course plumbing: what a lesson does not teach, around it. A lesson brings it in with one visible
import (commented as plumbing) and runs the same without it, as a copy in another project does:

- importing it makes a missing or too old framework one line, filters the libraries' noise
  (quiet.py; COURSE_VERBOSE=1 shows it) and gives the process its own temporary folder (scratch.py);
- run_main(main, parser) checks every flag (course/checks.py: paths, device, backend, --resume), then
  calls main(args) and ends every way it can go wrong in one line (course/failures.py).
"""
import importlib.abc
import importlib.metadata
import re
import sys

from course import quiet, scratch, seal, watch, wrap
from utils import log

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
            from course.errors import fail
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
    """main(args) with the flags checked, every ending one line (course/failures.py), and nothing
    done for --resume auto on a run that has finished."""
    from course import checks, failures, runfiles

    def checked_main():
        args = checks.parse(parser)
        checks.take_log_dir(args)  # one run per folder: a second one on it is refused
        runfiles.tell_what_is_there(args)  # a folder whose run ended badly: what this run does
        checks.remember_flags(args, parser)  # --resume: the saved run's flags, unless given anew
        _before_main(args)
        if not checks.finished_already(args):
            checks.resume_check(args)
            main(args)
    failures.run_main(checked_main)


def _before_main(args):
    """Cores shared by more ranks than they have; the framework calls the plumbing watches
    wrapped (course/wrap.py); with DeepSpeed: its JIT ops cached outside the checkout, and
    deepspeed/main.py's flags and config checked (course/ds_guard.py)."""
    from course.dist import warn_shared_cores
    from course.ranks import discover
    warn_shared_cores(discover())
    deepspeed_config = None
    if "deepspeed" in sys.modules:
        from course import ds_guard
        from course.dist import default_extensions_dir
        default_extensions_dir()
        deepspeed_config = ds_guard.check_flags(args)
    wrap.attach(args, deepspeed_config)


install()
scratch.private_tmp()  # (after install(): the line numbers above are quoted in diagnose/hangs.md)
log.listen(watch.Watch())  # TensorBoard's event files and the failure reports hear each step
log.seal_with(seal.seal)  # every checkpoint with the SHA-256 of its files, checked on --resume
