"""Quiet by default: the library lines that teach nothing are dropped before the frameworks load.

Importing `course/plumbing.py` (each lesson does, before its frameworks, in an optional `try`)
calls `install()`.
It drops only the lines listed here, each from one library and for one reason; every other warning
and log line is shown as before.

    COURSE_VERBOSE=1 python DDP/main.py ...     every filter off: all that the libraries print
                                                (also through torchrun, mpiexec, horovodrun,
                                                deepspeed and the job scripts, which pass the
                                                environment to the ranks)

What goes, and why it teaches nothing on the course's machines:
  - TensorFlow's C++ INFO lines (TF_CPP_MIN_LOG_LEVEL=1 unless already set; its WARNINGs stay):
    the CPU-feature banner ("This TensorFlow binary is optimized to use available CPU
    instructions ...") of every rank;
  - the two lines TensorFlow logs while `import tensorflow` runs, before that level applies, so
    that the variable cannot reach them: absl's "All log messages before absl::InitializeLog() ..."
    and "oneDNN custom operations are on" (the only other way to stop them,
    TF_ENABLE_ONEDNN_OPTS=0, changes the arithmetic);
  - torch's FutureWarning that `torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor`
    are deprecated: DeepSpeed's ZeRO calls them, once per rank and step (hundreds of lines a run;
    not ours to fix);
  - DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable
    to detect it." on a machine without GPUs, once per rank: each lesson's first line already says
    `device cpu`;
  - while a rank joins its process group (course/plumbing.py wraps init_process_group): c10d's
    lines from C++ for each failed try to reach the store, with the C++ frames of the exception
    (about 20 lines a try) when no rank 0 listens: the rank's one line says so, with the address;
  - torch's "No CUDA runtime is found, using CUDA_HOME=..." of every rank, when DeepSpeed loads its
    compiled CPU Adam (`--offload`) on a machine with a CUDA toolkit and no GPU.
  - DTensor's "While redistributing from (_StridedShard(...), Shard(...)) to (Replicate(), ...),
    2 sequential all_gather operations will be performed. This is suboptimal ...", once per rank
    when transformer/tp.py --dp gathers its 2-D sharded weights at its end (transformer/part2.md).

Not a filter, so also under COURSE_VERBOSE: stdout and stderr are made line-buffered, each line one
write. PYTHONUNBUFFERED=1 (which the Makefile and many job scripts set) makes print() write its text
and its newline apart, and `horovodrun --mpi` / `mpiexec -l` then cut lines in two: "[0] epoch 1
step 10[0] \\n".
"""
import contextlib
import importlib.abc
import logging
import os
import subprocess
import sys
import warnings

VERBOSE_VARIABLE = "COURSE_VERBOSE"

# Lines TensorFlow writes to file descriptor 2 from C++ while `import tensorflow` runs.
TF_IMPORT_NOISE = (r"^WARNING: All log messages before absl::InitializeLog\(\) is called are "
                   r"written to STDERR"
                   r"|\] oneDNN custom operations are on\.")
# What c10d writes from C++ while a rank connects to the store and cannot: each retry and the last
# try as a line with the C++ frames of the exception (~20 lines), when failures.py says the same
# in one line ("found no rank 0 at ADDR:PORT").
C10D_CONNECT_NOISE = (r"^frame #\d+: |^Exception raised from |^<omitting python frames>|^\s*$"
                      r"|\[c10d\] The client socket has timed out after"
                      r"|\[c10d\] TCP client failed to connect/validate"
                      r"|\[c10d\] waitForInput: (poll for )?socket .*(returned 0, likely a timeout|timed out)")
# Python warnings: (regular expression matched at the start of the message, category).
WARNINGS = [(r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
             FutureWarning),
            # NCCL/xccl barrier in a group started without device_id (DeepSpeed's init_distributed
            # takes none): it uses the current device, which step [2] has set (seen on an H100)
            (r"barrier\(\): using the device under current context", UserWarning)]
# Log records: logger name -> the beginnings of the messages dropped from it.
LOG_RECORDS = {
    "DeepSpeed": ("Setting accelerator to CPU.",),
    "torch.utils.cpp_extension": ("No CUDA runtime is found, using CUDA_HOME=",),
    "torch.distributed.tensor._redistribute": ("While redistributing from (_StridedShard(",),
}


def verbose():
    """True when COURSE_VERBOSE is set to anything but '', '0', 'false' or 'no'."""
    return os.environ.get(VERBOSE_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def install():
    line_buffered()
    if verbose():
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # everything, even where a script set 2
        return
    if not os.environ.get("TF_CPP_MIN_LOG_LEVEL"):  # unset or empty
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "1"  # INFO off, WARNING and ERROR on
    for message, category in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, beginnings in LOG_RECORDS.items():
        # The libraries create these loggers later with logging.getLogger(name): the same object,
        # filter kept.
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(beginnings))
    installed = any(isinstance(f, QuietTensorFlowImport) for f in sys.meta_path)
    if "tensorflow" not in sys.modules and not installed:
        sys.meta_path.insert(0, QuietTensorFlowImport())


def line_buffered():
    for stream in (sys.stdout, sys.stderr):
        # Only the process's own streams (not a test runner's capture), and only text streams
        # that can be reconfigured.
        own = stream is not None and stream in (sys.__stdout__, sys.__stderr__)
        if own and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(line_buffering=True, write_through=False)


class DropMessages(logging.Filter):
    def __init__(self, beginnings):
        super().__init__()
        self.beginnings = tuple(beginnings)

    def filter(self, record):
        return not record.getMessage().startswith(self.beginnings)


class QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Runs the first `import tensorflow` (from a lesson, keras, tf_keras or horovod.tensorflow
    alike) with file descriptor 2 passing through `filtered_stderr`, then steps aside. (torch asks
    for TensorFlow's spec without importing it: a spec alone changes nothing.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        for finder in sys.meta_path:  # TensorFlow's own spec, from the finders after this one
            if isinstance(finder, QuietTensorFlowImport):  # this one (or a second copy of it)
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if hasattr(spec.loader, "exec_module"):
            spec.loader = FilteredLoader(spec.loader, self)
        return spec


class FilteredLoader(importlib.abc.Loader):
    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)  # TensorFlow starts once: later imports left alone
        # Anyone who asks later sees the real loader.
        module.__loader__ = module.__spec__.loader = self.loader
        with filtered_stderr(TF_IMPORT_NOISE):
            self.loader.exec_module(module)


# The filter process: copies its stdin to its stdout line by line, minus the lines matching argv[1].
_FILTER = """
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; this ends with its input
noise = re.compile(sys.argv[1].encode())
try:
    for line in sys.stdin.buffer:
        if not noise.search(line):
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()
except OSError:
    pass
"""


@contextlib.contextmanager
def filtered_stderr(pattern):
    """While the block runs, whatever is written to file descriptor 2 (by C++ code too, which
    sys.stderr does not see) goes through a small filter process that drops the lines matching
    `pattern`. A separate process, not a thread or a file: should this process die inside the block
    (say TensorFlow aborting on a CPU it was not built for), what it wrote up to then still comes
    out. Where anything fails, the block runs unfiltered."""
    saved = proc = None
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _FILTER, pattern],
                                stdin=subprocess.PIPE, stdout=saved)
        os.dup2(proc.stdin.fileno(), 2)
    except (OSError, ValueError, AttributeError):
        if proc is not None:
            proc.stdin.close()
        if saved is not None:
            os.close(saved)
        saved = proc = None
    try:
        yield
    finally:
        if proc is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            proc.stdin.close()
            # Its lines come out before ours; a child process that kept the pipe open only delays
            # its exit. (after that it is left to finish on its own: killing it would break the
            # child's stderr)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)



def refused_quietly():
    """A rank that refused bad input leaves through the interpreter's teardown: a TensorFlow checkpoint
    that did not restore then warns of its unrestored values, after the one line."""
    if "tensorflow" in sys.modules:
        import logging
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
