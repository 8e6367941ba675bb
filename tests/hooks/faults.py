"""Test-only fault injection, from outside the examples: nothing in a lesson or in utils/ knows about it.

The failure tests (tests/test_failures_*.py) run an example with tests/hooks on PYTHONPATH and one of the
variables below set; Python then imports tests/hooks/sitecustomize.py at start-up (in every rank, under any
launcher: they all pass the environment on), which wraps two functions of utils/log.py before the
example imports it: `Progress.update` (called once per training step on every rank) and `replace_file`
(what `atomic_write` writes every file of the course with). The failure then happens at a chosen moment,
through the real code paths:

COURSE_FAIL_AT=<rank>:<epoch>:<step>[:kill]
    That rank stops when it reaches training step <step> (1-based) of epoch <epoch>: exit code 3, or SIGKILL of
    itself with ``:kill`` (no cleanup at all, like a node that died). It fires on a first attempt only: not in a
    worker that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0), so an elastic job recovers.
COURSE_DIE_IN_WRITE=<file name>:<n>
    The n-th atomic write (utils.log.replace_file) of a file of that name in this process stops half-way:
    half of the bytes in the temporary file, then SIGKILL, before the rename. The previous file must survive.
COURSE_DIE_ON_FILE=<glob>
    For writers that are not ours (TensorFlow's CheckpointManager): a thread watches for a path matching the
    glob and SIGKILLs this process the moment one appears, i.e. while that checkpoint is being written.

Planted bugs of distributed code (torch.distributed lessons; diagnose/hangs.md shows each one):

COURSE_PLANT=<bug>[:<rank>:<epoch>:<step>]   (default rank 1, epoch 1, step 3; first attempt only)
    rank0-collective  rank 0 alone calls a collective (dist.barrier: "evaluate on rank 0" done wrong); the
                      given rank is ignored
    mismatch          every rank calls dist.all_reduce, with a tensor of (rank + 2) elements: shapes differ
    stop              that rank stops itself (SIGSTOP): alive, silent, like a hung node
    die-early         that rank exits (code 3) right after joining the process group, before any collective
                      (the given epoch and step are ignored)
    stop-early        that rank stops itself (SIGSTOP) right after joining the process group (epoch and step
                      ignored)
    no-set-epoch      DistributedSampler.set_epoch does nothing: no hang, but every epoch repeats the first
                      epoch's order (the data-order check below shows it)
COURSE_MONITOR=<seconds>
    Every rank calls dist.monitored_barrier(timeout=<seconds>) after each training step: the recipe that
    names the rank that did not arrive (gloo only).
COURSE_DATA_ORDER=<folder>
    Every rank writes the first 8 sample indices its shuffling DistributedSampler gives each epoch to
    <folder>/rank<r>.jsonl: the data-order check.
"""
import glob
import json
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
    """Called (through the wrapper of utils.log.replace_file) after the data reached the temporary file `tmp`,
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


def _plant():
    """(bug, rank, epoch, step) from COURSE_PLANT, or None."""
    spec = os.environ.get("COURSE_PLANT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    bug, *numbers = spec.split(":")
    rank, epoch, step = [int(n) for n in numbers] + [1, 1, 3][len(numbers):]
    return bug, rank, epoch, step


def planted_at_step(rank, epoch, step):
    """The planted bugs that fire at a training step (called before that step's own update)."""
    plant = _plant()
    if plant and plant[2:] == (epoch, step):
        _fire(plant, rank, epoch, step)
    if os.environ.get("COURSE_MONITOR"):
        import datetime

        import torch.distributed as dist
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=float(os.environ["COURSE_MONITOR"])))


def _fire(plant, rank, epoch, step):
    bug, who = plant[0], plant[1]
    import torch
    import torch.distributed as dist
    if bug == "rank0-collective" and rank == 0:
        print(f"COURSE_PLANT: rank 0 alone calls dist.barrier() at epoch {epoch} step {step}", flush=True)
        dist.barrier()
    elif bug == "mismatch":
        print(f"COURSE_PLANT: rank {rank} all-reduces {rank + 2} numbers at epoch {epoch} step {step}", flush=True)
        dist.all_reduce(torch.zeros(rank + 2))
    elif bug == "stop" and rank == who:
        print(f"COURSE_PLANT: rank {rank} stops itself (SIGSTOP) at epoch {epoch} step {step}", flush=True)
        time.sleep(0.5)  # as a rank that hangs in its next call would: not within microseconds of its step
        os.kill(os.getpid(), signal.SIGSTOP)


def _install_plants(log):
    plant = _plant()
    if plant and plant[0] in ("die-early", "stop-early"):
        configure = log.configure

        def configure_and_maybe_die(rank, *args, **kwargs):  # lessons call it right after joining the group
            if rank == plant[1] and plant[0] == "stop-early":
                print(f"COURSE_PLANT: rank {rank} stops itself (SIGSTOP) after joining the group", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif rank == plant[1]:
                print(f"COURSE_PLANT: rank {rank} exits before its first collective", flush=True)
                os._exit(3)
            return configure(rank, *args, **kwargs)
        log.configure = configure_and_maybe_die
    if (plant and plant[0] == "no-set-epoch") or os.environ.get("COURSE_DATA_ORDER"):
        from torch.utils.data.distributed import DistributedSampler
        if plant and plant[0] == "no-set-epoch":
            DistributedSampler.set_epoch = lambda self, epoch: None
        if os.environ.get("COURSE_DATA_ORDER"):
            iterate = DistributedSampler.__iter__

            def iterate_and_record(self):
                indices = list(iterate(self))
                if not self.shuffle:  # the test set's sampler: the same order by design
                    return iter(indices)
                folder = os.environ["COURSE_DATA_ORDER"]
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"rank{self.rank}.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch_seen": self.epoch, "first": indices[:8]}) + "\n")
                return iter(indices)
            DistributedSampler.__iter__ = iterate_and_record


def _watch(pattern):
    while not glob.glob(pattern):
        time.sleep(0.0005)
    print(f"COURSE_DIE_ON_FILE: killed as {glob.glob(pattern)[0]} appeared", flush=True)
    _die(kill=True)


def install():
    """Wrap utils/log.py's Progress.update and replace_file, which atomic_write writes with (imported
    here first, so every later `from utils.log import replace_file` gets the wrapper: the course's
    sealed writes too), and start the file watcher if asked."""
    from utils import log

    update = log.Progress.update

    def update_and_maybe_fail(self, step, loss):
        at_step(log._RANK, self.epoch, step)
        update(self, step, loss)
        planted_at_step(log._RANK, self.epoch, step)
    log.Progress.update = update_and_maybe_fail

    replace_file = log.replace_file  # (what atomic_write, and the course's sealed writes, write with)

    def replace_file_and_maybe_die(path, write_fn, mode="w"):
        def write_then_check(f):
            write_fn(f)
            f.flush()
            in_write(path, f, os.readlink(f"/proc/self/fd/{f.fileno()}"))  # the temporary file's name
        return replace_file(path, write_then_check, mode)
    log.replace_file = replace_file_and_maybe_die
    _install_plants(log)

    if os.environ.get("COURSE_DIE_ON_FILE"):
        threading.Thread(target=_watch, args=(os.environ["COURSE_DIE_ON_FILE"],), daemon=True).start()


def stop_before_join():
    """COURSE_PLANT=stop-before-join:<rank>: that rank stops itself (SIGSTOP) as it starts, before it imports
    anything (epoch and step ignored): the others wait for it in init_process_group (diagnose/hangs.md)."""
    plant = _plant()
    if plant and plant[0] == "stop-before-join" and int(os.environ.get("RANK", "-1")) == plant[1]:
        print(f"COURSE_PLANT: rank {plant[1]} stops itself (SIGSTOP) before it joins the group", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def refuse_at_step():
    """COURSE_PLANT=refuse:<rank>:<epoch>:<step>: that rank finds bad input at that training step, after it
    joined its peers (a UserError, as the course's own checks raise): the peers then lose it."""
    plant = _plant()
    if not plant or plant[0] != "refuse":
        return
    from course.errors import UserError
    from utils import log
    update = log.Progress.update

    def update_or_refuse(self, step, loss):
        if (log._RANK, self.epoch, step) == plant[1:]:
            raise UserError(f"COURSE_PLANT: rank {log._RANK} refuses at epoch {self.epoch} step {step}")
        update(self, step, loss)
    log.Progress.update = update_or_refuse
