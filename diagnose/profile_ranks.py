#!/usr/bin/env python
"""Profile an unchanged PyTorch lesson from outside: one torch.profiler Chrome trace per rank.

    torchrun --nproc_per_node 2 diagnose/profile_ranks.py [--out DIR] \\
        [--slow-rank R --slow-ms MS] DDP/main.py --epochs 1 --max-steps 30
    python diagnose/profile_ranks.py summary DIR    (per rank: step time, compute, comm, waiting)

Everything before the lesson's path is this tool's; everything after it is the lesson's own flags.
The lesson is not touched: before it runs, the calls that make up a step (the model's forward,
backward, the optimizer's step; Horovod's synchronize; DeepSpeed's engine calls) are wrapped in
torch.profiler record_function spans named phase:<name>, the same calls tools/phases.py times,
and the end of each optimizer step advances the profiler by one step (ProfilerStep#N in the trace).

--slow-rank R --slow-ms MS makes one rank a straggler: it sleeps MS ms at the end of each step,
inside a span named `straggler`, as if its own work were slower. The lesson does not know; the other
ranks show it as time waiting for the all-reduce of their gradients.

DIR/rank<R>.trace.json opens in https://ui.perfetto.dev or chrome://tracing; DIR/rank<R>.meta.json
holds what the summary needs (ranks, batch, threads).
"""

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# torch.profiler's C++ side (kineto) writes "USDT: ... profiler_start" and "profiler_stop" lines,
# and on a machine without an NVIDIA GPU "ERROR: ... gpuGetDeviceCount failed with code 35" (no
# CUDA device: harmless, the trace is the CPU's). Level 6 is none of its lines; COURSE_VERBOSE=1,
# or a KINETO_LOG_LEVEL of your own, shows them.
if os.environ.get("COURSE_VERBOSE", "").strip().lower() in ("", "0", "false", "no"):
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# After site-packages: `import horovod` and `import deepspeed` stay the libraries.
sys.path.append(str(ROOT))


class Spans:
    """What tools/phases.py's patch() asks of a timer: wrap(phase, fn) and start_epoch(epoch). Each
    wrapped call becomes a record_function span; the outermost optimizer call ends a step."""

    def __init__(self, prof, rank, slow_rank, slow_ms):
        self.prof, self.depth, self.steps = prof, 0, 0
        self.delay = slow_ms / 1000 if rank == slow_rank else 0.0
        self.batch = None

    def start_epoch(self, epoch):
        # evaluation and logging since the last step: a "step" with no backward, dropped
        self.prof.step()

    def wrap(self, phase, fn):
        import torch

        @functools.wraps(fn)
        def spanned(*args, **kwargs):
            if phase == "forward" and self.batch is None:
                x = next((a for a in args if isinstance(a, torch.Tensor)), None)
                self.batch = int(x.shape[0]) if x is not None and x.dim() else None
            self.depth += 1
            try:
                with torch.profiler.record_function(f"phase:{phase}"):
                    return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if phase == "optimizer" and self.depth == 0:
                    self.end_step()

        return spanned

    def end_step(self):
        import torch

        if self.delay:
            with torch.profiler.record_function("straggler"):
                time.sleep(self.delay)
        self.steps += 1
        self.prof.step()


def split_argv(argv):
    """(this tool's flags, the lesson's argv): the lesson is the first argument ending in .py; a
    launcher's --local_rank=N before it (the deepspeed launcher's) belongs to the lesson."""
    i = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")), None)
    if i is None:
        return argv, None
    ours = [a for a in argv[:i] if not a.startswith("--local_rank")]
    theirs = [a for a in argv[:i] if a.startswith("--local_rank")]
    return ours, [argv[i]] + theirs + argv[i + 1 :]


def profile(argv):
    ours, lesson_argv = split_argv(argv)
    p = argparse.ArgumentParser(prog="diagnose/profile_ranks.py", usage=__doc__.split("\n\n")[1])
    p.add_argument(
        "--out", default=None, help="folder for the traces (default runs/profile-<time>)"
    )
    p.add_argument("--slow-rank", type=int, default=None, help="the rank made a straggler")
    p.add_argument("--slow-ms", type=float, default=0.0, help="its extra milliseconds per step")
    p.add_argument("--skip", type=int, default=3, help="first steps not recorded (warm-up)")
    args = p.parse_args(ours)
    if lesson_argv is None:
        p.error("name the lesson to profile, e.g. DDP/main.py")
    if args.slow_ms < 0 or (args.slow_ms and args.slow_rank is None):
        p.error("--slow-ms needs a non-negative value and --slow-rank")

    from tools import phases  # the same calls, the same patching, as the phase timer

    framework = phases.framework_of(lesson_argv[0])
    from course.ranks import discover  # the course's one reading of the ranks, every launcher's
    me = discover()
    rank, world_size = me.rank, me.world_size
    out = Path(args.out or f"runs/profile-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from torch.profiler import ProfilerActivity, schedule

    trace = out / f"rank{rank}.trace.json"
    activities = [ProfilerActivity.CPU]  # + the GPU's kernels and copies, where there is one
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        activities.append(ProfilerActivity.XPU)
    prof = torch.profiler.profile(
        activities=activities,
        record_shapes=True,  # the sizes of the collectives: what the ring model predicts from
        schedule=schedule(skip_first=args.skip, wait=0, warmup=1, active=10**6),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    )
    spans = Spans(prof, rank, args.slow_rank, args.slow_ms)
    phases.patch(spans, framework)

    # The lesson sees what `python LESSON.py` gives it: its own folder first on the path, the repo
    # root last.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    sys.path.insert(0, str(Path(lesson_argv[0]).resolve().parent))
    sys.argv = lesson_argv

    def finish(code):
        """Stop the profiler (it writes the trace of the steps recorded so far), write the meta
        file, and check that enough steps ran."""
        prof.stop()
        meta = dict(
            rank=rank,
            world_size=world_size,
            framework=framework,
            lesson=lesson_argv,
            batch=spans.batch,
            steps=spans.steps,
            skip=args.skip,
            threads=torch.get_num_threads(),
            slow_rank=args.slow_rank,
            slow_ms=args.slow_ms,
        )
        (out / f"rank{rank}.meta.json").write_text(json.dumps(meta, indent=1))
        if code not in (None, 0):
            return
        if spans.steps <= args.skip + 1:
            print(f"error: profile: only {spans.steps} steps ran; more than --skip {args.skip} + 1 "
                  "are needed for a trace", file=sys.stderr, flush=True)
            os._exit(1)
        if rank == 0:
            print(f"profile: traces in {out}/rank*.trace.json; read them with: "
                  f"python diagnose/profile_ranks.py summary {out}", flush=True)

    prof.start()
    phases.run_lesson(lesson_argv[0], finish)


def main():
    if sys.argv[1:2] == ["summary"]:
        import trace_summary

        sys.exit(trace_summary.main(sys.argv[2:]))
    profile(sys.argv[1:])


if __name__ == "__main__":
    main()
