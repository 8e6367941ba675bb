"""Course plumbing: what a lesson does not teach, around it. A lesson brings it in with one visible
import (commented as plumbing) and runs the same without it, as a copy in another project does:

- importing it makes a missing or too old framework one line, and filters the libraries' noise
  (utils/quiet.py says which; COURSE_VERBOSE=1 shows them); the process gets its own temporary
  folder, removed at every ending (private_tmp);
- run_main(main, parser) checks every flag (utils/checks.py: paths, device, backend, --resume), then
  calls main(args) and ends every way it can go wrong in one line (utils/failures.py).
"""
import atexit
import importlib.abc
import importlib.metadata
import os
import re
import shutil
import socket
import sys
import tempfile

from utils import quiet

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


TMP_PREFIX = f"scaling-dl-tmp-{socket.gethostname()}-"


def private_tmp():
    """This process's own temporary folder (tempfile.tempdir), removed at every ending.
    TensorFlow's autograph writes a source file per traced function to the temporary folder and
    removes it only in an atexit hook, which an ending through os._exit skips (a stop, a lost peer:
    utils/failures.py): one stopped 2-rank run of horovod/tensorflow/main.py left 38 files in /tmp.
    A folder whose process was killed (SIGKILL runs no hook) is removed at the next start."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len(TMP_PREFIX):]
        if name.startswith(TMP_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    tempfile.tempdir = os.path.join(base, f"{TMP_PREFIX}{os.getpid()}")
    os.makedirs(tempfile.tempdir, exist_ok=True)
    atexit.register(remove_private_tmp)


def remove_private_tmp():
    if os.path.basename(tempfile.tempdir or "").startswith(TMP_PREFIX):
        shutil.rmtree(tempfile.tempdir, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # (another user's)
    return True


def install():
    """Before the frameworks are imported: a missing one is one line, one too old too; the
    libraries' noise is filtered; a temporary folder of this process's own."""
    sys.excepthook = _missing_framework_hook
    if not os.path.basename(tempfile.tempdir or "").startswith(TMP_PREFIX):
        private_tmp()
    if "torch" not in sys.modules and not any(isinstance(f, _OldFramework) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldFramework())
    quiet.install()


def run_main(main, parser):
    """main(args) with the flags checked, every ending one line (utils/failures.py), and nothing
    done for --resume auto on a run that has finished."""
    from utils import checks, failures
    from utils.dist import discover, warn_shared_cores

    def checked_main():
        args = checks.parse(parser)
        warn_shared_cores(discover().local_world_size)
        if not checks.finished_already(args):
            checks.resume_check(args)
            main(args)
    failures.run_main(checked_main)


install()
