#!/usr/bin/env python
"""Run short 2-rank examples many times and count how each run ended: a flake is a rate, not an anecdote.

    python tools/soak.py --runs 50                                  # DDP under torchrun
    python tools/soak.py --runs 50 --example deepspeed --launcher deepspeed
    python tools/soak.py --runs 50 --launcher mpiexec -- --epochs 1 --max-steps 3
    python tools/soak.py --runs 50 --launcher mpiexec --port-pressure -- --epochs 1 --max-steps 2 \
        --dist-timeout 10              # MASTER_PORT while other programs take kernel-picked ports
    python tools/soak.py --runs 50 --lifted --example all --launcher torchrun mpiexec
                                       # every lesson copied out as an attendee would (tools/lift.py)

--lifted runs a copy of the lesson (main.py with only its helpers, no course plumbing) from its own folder:
how the lesson ends by itself. --example and --launcher take several; a launcher a lesson is not run under
(torchrun for Horovod, horovodrun for PyTorch) is replaced by its own (horovodrun) or skipped.

Each run must exit 0 and print nothing on stderr that marks a crash (an abort in a library's threads after a
finished run, a traceback). The table lists every kind of ending with its count; the exit status is 1 when any
run ended badly. Not part of `make test`: 50 runs take several minutes on 2 cores.
"""
import argparse
import collections
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from course.ranks import free_port
from tools.launch import EXAMPLES, LAUNCHERS, ROOT, kernel_port, launch_command, port_pressure
from tools.lift import lift

# Lines that mark a crash even when the exit code is 0 (a rank's teardown can abort after its summary).
CRASH_MARKS = ("cannot listen on MASTER_PORT", "terminate called", "Traceback (most recent call last)",
               "Segmentation fault", "core dumped", "Aborted", "error:")


GPT_SMALL = ["--layers", "2", "--width", "64", "--heads", "2", "--context", "32", "--batch-size", "4"]
# The lessons a copy is made of (tools/lift.py), and each one's short run ({dir}: the run's own folder).
LESSONS = {**EXAMPLES, "zero-checkpoint": "zero/fsdp_checkpoint.py"}
SHORT = {"zero": ["--variant", "torch-fsdp2", "--hidden", "64", "--layers", "1", "--steps", "3", "--json",
                  "{dir}/run.json"],
         "zero-checkpoint": ["--checkpoint-dir", "{dir}/ckpt", "--hidden", "64", "--json", "{dir}/run.json"],
         **{name: [*GPT_SMALL, "--epochs", "1", "--max-steps", "2", "--num-threads", "1", "--log-dir", "{dir}/run"]
            for name in EXAMPLES if name.startswith("transformer-")}}
MNIST_SHORT = ["--epochs", "1", "--max-steps", "2", "--num-threads", "1", "--log-dir", "{dir}/run"]
HOROVOD = {"horovod-pytorch", "horovod-tensorflow", "horovod-keras"}


def launcher_for(example, launcher):
    """The launcher `example` runs under in place of `launcher`, or None (not its launcher)."""
    if example in HOROVOD:
        return {"torchrun": "horovodrun", "deepspeed": None}.get(launcher, launcher)
    return None if launcher.startswith("horovodrun") or (launcher == "deepspeed" and example != "deepspeed") \
        else launcher


def classify(result):
    """One short label for how a run ended."""
    text = result.stderr + result.stdout
    marks = [mark for mark in CRASH_MARKS if mark in text]
    if result.returncode == 0 and not marks:
        return "ok"
    return f"exit {result.returncode}" + (f", {marks[0]!r}" if marks else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--example", nargs="+", default=["ddp"], choices=["all", *sorted(LESSONS)])
    parser.add_argument("--launcher", nargs="+", default=["torchrun"], choices=[x for x in LAUNCHERS if x != "python"])
    parser.add_argument("--lifted", action="store_true", help="run a copy of the lesson without the course's plumbing")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=180, help="seconds before one run counts as hung")
    parser.add_argument("--keep", default=None, help="folder for the output of runs that ended badly")
    parser.add_argument("--port-pressure", action="store_true",
                        help="meanwhile keep ~7000 listeners on kernel-picked ports, churning")
    parser.add_argument("--kernel-port", action="store_true",
                        help="MASTER_PORT from binding port 0 (how it was picked before), as a control")
    parser.add_argument("args", nargs="*", help="the example's flags (after --; {dir}: the run's folder); default: "
                        "a short run of it (SHORT)")
    opts = parser.parse_args()
    examples = sorted(LESSONS) if "all" in opts.example else opts.example
    cells = [(e, launcher_for(e, x)) for e in examples for x in opts.launcher]
    cells = list(dict.fromkeys((e, x) for e, x in cells if x))
    keep = Path(opts.keep or tempfile.mkdtemp(prefix="soak-"))
    start = time.perf_counter()
    pressure = port_pressure() if opts.port_pressure else contextlib.nullcontext()
    table = {}
    with pressure:
        for example, launcher in cells:
            flags = opts.args or SHORT.get(example, MNIST_SHORT)
            table[example, launcher] = soak(opts, example, launcher, flags, keep)
    print(f"\n{'lifted copies' if opts.lifted else 'the course'}, {opts.nproc} ranks, {opts.runs} runs each "
          f"({time.perf_counter() - start:.0f} s){' under port pressure' if opts.port_pressure else ''}"
          f"{', MASTER_PORT from port 0' if opts.kernel_port else ''}:")
    for (example, launcher), counts in table.items():
        endings = ", ".join(f"{n} {label}" for label, n in counts.most_common())
        print(f"  {example:<20} {launcher:<11} {endings}")
    bad = any(set(counts) != {"ok"} for counts in table.values())
    if bad:
        print(f"the output of each bad run is in {keep}")
    return 1 if bad else 0


def soak(opts, example, launcher, flags, keep):
    counts = collections.Counter()
    for i in range(opts.runs):
        with tempfile.TemporaryDirectory() as run_dir:
            port = kernel_port() if opts.kernel_port else free_port()
            script, cwd = ROOT / LESSONS[example], None
            if opts.lifted:  # the copy in a folder of its own, far from the repository's utils/
                script = lift(script, Path(run_dir) / "copy")
                cwd = script.parent
            args = [str(a).replace("{dir}", run_dir) for a in flags]
            cmd = launch_command(script, opts.nproc, launcher, args, port=port)
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, cwd=cwd)
                label = classify(result)
            except subprocess.TimeoutExpired as exc:
                result = subprocess.CompletedProcess(cmd, -9, exc.stdout or "", exc.stderr or "")
                label = "hung"
        counts[label] += 1
        if label != "ok":
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{example}-{launcher}-{i:03d}.log").write_text(
                f"{label}\n{' '.join(cmd)}\n--- stdout\n{_text(result.stdout)}\n--- stderr\n{_text(result.stderr)}")
        print(f"{example} {launcher} run {i + 1:>3}/{opts.runs}: {label}", flush=True)
    return counts


def _text(out):
    return out.decode(errors="replace") if isinstance(out, bytes) else out


if __name__ == "__main__":
    sys.exit(main())
