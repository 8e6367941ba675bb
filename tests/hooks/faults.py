"""Test-only fault injection, from outside the examples: nothing in a lesson or in utils/ knows about it.

tests/test_failures.py runs an example with tests/hooks on PYTHONPATH and one of the variables below set;
Python then imports tests/hooks/sitecustomize.py at start-up (in every rank, under any launcher: they all
pass the environment on), which wraps two functions of utils/log.py before the example imports it:
`Progress.update` (called once per training step on every rank) and `atomic_write` (every file the course
writes). The failure then happens at a chosen moment, through the real code paths:

COURSE_FAIL_AT=<rank>:<epoch>:<step>[:kill]
    That rank stops when it reaches training step <step> (1-based) of epoch <epoch>: exit code 3, or SIGKILL of
    itself with ``:kill`` (no cleanup at all, like a node that died). It fires on a first attempt only: not in a
    worker that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0), so an elastic job recovers.
COURSE_DIE_IN_WRITE=<file name>:<n>
    The n-th atomic write (utils.log.atomic_write) of a file of that name in this process stops half-way:
    half of the bytes in the temporary file, then SIGKILL, before the rename. The previous file must survive.
COURSE_DIE_ON_FILE=<glob>
    For writers that are not ours (TensorFlow's CheckpointManager): a thread watches for a path matching the
    glob and SIGKILLs this process the moment one appears, i.e. while that checkpoint is being written.
"""
import glob
import os
import signal
import threading
import time

_writes = {}


def _die(kill):
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def at_step(rank, epoch, step):
    """Called (through the wrapper of utils.log.Progress.update) once per training step, on every rank."""
    spec = os.environ.get("COURSE_FAIL_AT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    parts = spec.split(":")
    if [int(p) for p in parts[:3]] == [rank, epoch, step]:
        print(f"COURSE_FAIL_AT: rank {rank} stops at epoch {epoch} step {step}", flush=True)
        _die(parts[3:] == ["kill"])


def in_write(path, f, tmp):
    """Called (through the wrapper of utils.log.atomic_write) after the data reached the temporary file `tmp`,
    before the fsync and the rename."""
    spec = os.environ.get("COURSE_DIE_IN_WRITE")
    if not spec:
        return
    name, n = spec.rsplit(":", 1)
    if os.path.basename(path) != name:
        return
    _writes[name] = _writes.get(name, 0) + 1
    if _writes[name] == int(n):
        f.truncate(os.path.getsize(tmp) // 2)
        f.flush()
        os.fsync(f.fileno())
        print(f"COURSE_DIE_IN_WRITE: killed while writing {path} (half of it is in {tmp})", flush=True)
        _die(kill=True)


def _watch(pattern):
    while not glob.glob(pattern):
        time.sleep(0.0005)
    print(f"COURSE_DIE_ON_FILE: killed as {glob.glob(pattern)[0]} appeared", flush=True)
    _die(kill=True)


def install():
    """Wrap utils/log.py's Progress.update and atomic_write (imported here first, so every later
    `from utils.log import atomic_write` gets the wrapper), and start the file watcher if asked."""
    from utils import log

    update = log.Progress.update

    def update_and_maybe_fail(self, step, loss):
        at_step(log._RANK, self.epoch, step)
        return update(self, step, loss)
    log.Progress.update = update_and_maybe_fail

    atomic_write = log.atomic_write

    def atomic_write_and_maybe_die(path, write_fn, mode="w"):
        def write_then_check(f):
            write_fn(f)
            f.flush()
            in_write(path, f, os.readlink(f"/proc/self/fd/{f.fileno()}"))  # the temporary file's name
        return atomic_write(path, write_then_check, mode)
    log.atomic_write = atomic_write_and_maybe_die

    if os.environ.get("COURSE_DIE_ON_FILE"):
        threading.Thread(target=_watch, args=(os.environ["COURSE_DIE_ON_FILE"],), daemon=True).start()
