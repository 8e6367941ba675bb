"""Shared helpers for the course's examples: arguments, rank discovery, data, logging, checkpoints.

The training loops themselves live in each example's main.py, so each reads top to bottom as a
lesson.

Importing the package does nothing by itself. Each lesson calls ``utils.course_output()`` before it
imports its frameworks: a missing framework is then one line that says how to get it, instead of a
traceback (the commonest first failure is running a lesson outside the environment that has torch,
TensorFlow, Horovod and DeepSpeed), and the libraries' lines that teach nothing are filtered
(utils/quiet.py says which; COURSE_VERBOSE=1 shows them).
"""
import sys

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


def course_output():
    """Before the frameworks are imported: a missing one is one line; the libraries' noise is
    filtered."""
    sys.excepthook = _missing_framework_hook
    quiet.install()
