#!/usr/bin/env python
"""Run a PyTorch example unchanged, timing the phases of each training step on each rank.

    PHASES_OUT=PREFIX python tools/phases.py DDP/main.py --epochs 3 ...            (one rank)
    PHASES_OUT=PREFIX torchrun --nproc_per_node 2 tools/phases.py DDP/main.py ...  (any launcher, rank count)

Before the example runs, the calls that make up a step are wrapped with timers (the example's code is not
touched): the model's forward, `backward` (DeepSpeed: `engine.backward`), Horovod's `synchronize` (waiting for
the all-reduces that backward started), and the optimizer's `step` (DeepSpeed: `engine.step`). Each phase
counts its own time only: Horovod's `step` calls `synchronize`, which counts as waiting, not as the optimizer.
A step ends when the outermost optimizer step returns (DeepSpeed's engine.step runs once per micro-batch: with
--grad-accum a "step" here is a micro-batch); *other* is what is left of the step (indexing the batch, the loss,
reading it with .item(), zero_grad, setting the learning rate). Where the communication happens:
DDP all-reduces during backward and waits for the last bucket at its end, so its communication lands in
*backward*; Horovod's all-reduces run on its background thread, and what is not done when backward ends
lands in *wait*; DeepSpeed reduces the gradients in engine.backward and, at ZeRO stage 1 and 2, gathers the
updated weights in engine.step.

Each rank writes {"rank", "records": [{"epoch", "step", phase: seconds, ...}, ...]} to $PHASES_OUT-rank{R}.json
when the example ends. `python tools/bench.py --phases` runs the examples so at 1 and 2 ranks and compares.
With $PHASES_TURNS set (by the bench's overhead measurement, tools/bench_overhead.py), the process takes
turns with another one step by step: see `Turns`. Nothing inside the example is touched, only library classes
and the course's shared modules (utils.log.Progress, course.torch_utils.Net; nn.Sequential for DDP's CNN).
"""
import atexit
import functools
import json
import os
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "backward", "wait", "optimizer")
PYTORCH_EXAMPLES = {"ddp": "ddp", "horovod-pytorch": "horovod", "deepspeed": "deepspeed",  # launch.EXAMPLES names
                    **{f"transformer-{kind}": "transformer" for kind in ("ddp", "fsdp", "tp", "cp", "ep", "pp")}}


class Turns:
    """Taking turns with another process, so that a drift in this machine's speed hits both alike: after every
    `every` steps, one byte on the write pipe says "my part is done", then the process waits for one byte on the
    read pipe (the go-ahead) before its next step. Set up by $PHASES_TURNS="READ_FD,WRITE_FD,EVERY" (pipes the
    parent passed down); the wait is no step's time. If the parent goes away, the process runs on freely."""

    def __init__(self, read_fd, write_fd, every):
        self.read_fd, self.write_fd, self.every = read_fd, write_fd, every
        for fd in (read_fd, write_fd):
            os.set_inheritable(fd, False)  # not into processes the example may start

    @classmethod
    def from_env(cls):
        spec = os.environ.get("PHASES_TURNS")
        return cls(*map(int, spec.split(","))) if spec else None

    def after_step(self, steps_done):
        if self.write_fd is None or steps_done % self.every:
            return
        try:
            os.write(self.write_fd, b".")
            if os.read(self.read_fd, 1):
                return
        except OSError:
            pass
        self.write_fd = None


class StepTimer:
    """Self time of each phase per step; a step ends when the outermost optimizer call returns."""

    def __init__(self, clock=time.perf_counter, turns=None):
        self.clock = clock
        self.turns = turns
        self.records = []
        self.epoch = 0
        self.current = defaultdict(float)
        self.nested = []  # for each timed call in progress: the time of the timed calls inside it
        self.step_start = clock()

    def start_epoch(self, epoch):
        """A new epoch: its first step starts now (evaluation and logging in between are no step's)."""
        self.epoch = epoch
        self.current.clear()
        self.step_start = self.clock()

    def wrap(self, phase, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = self.clock()
            self.nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                self.current[phase] += elapsed - self.nested.pop()
                if self.nested:
                    self.nested[-1] += elapsed
                elif phase == "optimizer":
                    self.end_step()
        return timed

    def end_step(self):
        now = self.clock()
        record = {"epoch": self.epoch, "step": now - self.step_start, **{p: self.current[p] for p in PHASES}}
        record["other"] = record["step"] - sum(record[p] for p in PHASES)
        self.records.append(record)
        self.current.clear()
        if self.turns:
            self.turns.after_step(len(self.records))
            now = self.clock()  # the next step starts when this process has its turn again
        self.step_start = now


def patch(timer, framework):
    """Wrap the calls of a step in `framework`'s example (classes are patched before the example builds
    anything, so every instance, and Horovod's optimizer class made from them, gets the timers)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from course.torch_utils import Net
    from utils import log

    original_init = log.Progress.__init__

    def progress_init(self, enabled, total, epoch, *args, **kwargs):  # opened at the start of every epoch
        timer.start_epoch(epoch)
        original_init(self, enabled, total, epoch, *args, **kwargs)
    log.Progress.__init__ = progress_init

    for cls, name, phase in [(Net, "forward", "forward"), (DistributedDataParallel, "forward", "forward"),
                             (torch.Tensor, "backward", "backward"), (torch.optim.SGD, "step", "optimizer"),
                             (torch.optim.Adam, "step", "optimizer")]:
        setattr(cls, name, timer.wrap(phase, getattr(cls, name)))
    if framework == "horovod":  # Horovod builds the optimizer's class from one of these (Adasum: the second)
        from horovod.torch.optimizer import _DistributedAdasumOptimizer, _DistributedOptimizer
        _DistributedOptimizer.step = timer.wrap("optimizer", _DistributedOptimizer.step)
        _DistributedOptimizer.synchronize = timer.wrap("wait", _DistributedOptimizer.synchronize)
        _DistributedAdasumOptimizer.step = timer.wrap("optimizer", _DistributedAdasumOptimizer.step)
    if framework in ("ddp", "horovod"):  # their models are nn.Sequential (DDP's CNN)
        torch.nn.Sequential.forward = timer.wrap("forward", torch.nn.Sequential.forward)
    if framework == "transformer":  # the chapter's GPT (pp.py: its stages run inside the schedule's step)
        from transformer.model import GPT
        GPT.forward = timer.wrap("forward", GPT.forward)
    if framework == "transformer":  # pp.py: a pipeline step is its schedule's
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
        # forward and backward of every micro-batch, the sends between stages and the waits for them
        PipelineScheduleSingle.step = timer.wrap("backward", PipelineScheduleSingle.step)
        PipelineScheduleMulti.step = timer.wrap("backward", PipelineScheduleMulti.step)
    if framework == "deepspeed":
        from deepspeed.runtime.engine import DeepSpeedEngine
        for name, phase in [("forward", "forward"), ("backward", "backward"), ("step", "optimizer")]:
            setattr(DeepSpeedEngine, name, timer.wrap(phase, getattr(DeepSpeedEngine, name)))


def framework_of(script):
    from tools.launch import script_path
    path = Path(script).resolve()
    for name, framework in PYTORCH_EXAMPLES.items():
        if script_path(name).resolve() == path:
            return framework
    sys.exit(f"error: phases: {script} is not a PyTorch example (DDP/, horovod/pytorch/, deepspeed/ main.py, "
             "transformer/)")


def script_and_argv(args):
    """(the example, its sys.argv): the first argument that is not a flag; the deepspeed launcher puts its
    --local_rank=N before it, and the example takes that flag too."""
    i = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if i is None:
        return None, None
    return args[i], [args[i]] + args[:i] + args[i + 1:]


def main():
    script, argv = script_and_argv(sys.argv[1:])
    out = os.environ.get("PHASES_OUT")
    if script is None or not out:
        sys.exit("usage: PHASES_OUT=PREFIX python tools/phases.py EXAMPLE/main.py [its flags]")
    # The example sees what `python EXAMPLE/main.py` would give it: its own folder first on the path instead of
    # tools/ (whose modules would stand as top-level names), the repo root last (after site-packages).
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(script).resolve().parent))
    sys.path.append(str(ROOT))
    framework = framework_of(script)
    timer = StepTimer(turns=Turns.from_env())
    patch(timer, framework)
    sys.argv = argv

    def finish(exit_code):
        from course.ranks import discover  # the course's one reading of the ranks, every launcher's
        rank = discover().rank
        Path(f"{out}-rank{rank}.json").write_text(
            json.dumps({"rank": rank, "framework": framework, "records": timer.records}))
        if exit_code in (None, 0) and not timer.records:
            print(f"error: phases: {script} ran, but none of its optimizer steps was timed", file=sys.stderr,
                  flush=True)
            os._exit(1)

    run_lesson(script, finish)


def run_lesson(script, finish):
    """Run the lesson `script` (sys.argv already its own) in this process, then finish(exit_code) once. finish is
    also an exit handler: a lesson that finishes runs the exit handlers (course/failures.run_main), then leaves
    through its own last lines (os._exit), never returning here. The lesson's own non-zero exit is passed on."""
    done = []

    def once(code=0):
        if not done:
            done.append(code)
            finish(code)

    atexit.register(once)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # the lesson's own exit (its one-line errors)
        once(exc.code)
        sys.exit(exc.code)
    once()

if __name__ == "__main__":
    main()
