#!/usr/bin/env python
"""Run one short 2-rank example many times and count how each run ended: a flake is a rate, not an anecdote.

    python tools/soak.py --runs 50                                  # DDP under torchrun
    python tools/soak.py --runs 50 --example deepspeed --launcher deepspeed
    python tools/soak.py --runs 50 --launcher mpiexec -- --epochs 1 --max-steps 3
    python tools/soak.py --runs 50 --launcher mpiexec --port-pressure -- --epochs 1 --max-steps 2 \
        --dist-timeout 10              # MASTER_PORT while other programs take kernel-picked ports

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
from tools.launch import EXAMPLES, LAUNCHERS, kernel_port, launch_command, port_pressure
from utils.dist import free_port

# Lines that mark a crash even when the exit code is 0 (a rank's teardown can abort after its summary).
CRASH_MARKS = ("cannot listen on MASTER_PORT", "terminate called", "Traceback (most recent call last)",
               "Segmentation fault", "core dumped", "Aborted", "error:")


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
    parser.add_argument("--example", default="ddp", choices=sorted(EXAMPLES))
    parser.add_argument("--launcher", default="torchrun", choices=[x for x in LAUNCHERS if x != "python"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=180, help="seconds before one run counts as hung")
    parser.add_argument("--keep", default=None, help="folder for the output of runs that ended badly")
    parser.add_argument("--port-pressure", action="store_true",
                        help="meanwhile keep ~7000 listeners on kernel-picked ports, churning")
    parser.add_argument("--kernel-port", action="store_true",
                        help="MASTER_PORT from binding port 0 (how it was picked before), as a control")
    parser.add_argument("args", nargs="*", help="the example's flags (after --); default: 1 epoch of 2 steps")
    opts = parser.parse_args()
    flags = opts.args or ["--epochs", "1", "--max-steps", "2"]
    keep = Path(opts.keep or tempfile.mkdtemp(prefix="soak-"))
    start = time.perf_counter()
    pressure = port_pressure() if opts.port_pressure else contextlib.nullcontext()
    with pressure:
        counts = soak(opts, flags, keep)
    print(f"\n{opts.example} x {opts.nproc} ranks under {opts.launcher}, {opts.runs} runs "
          f"({time.perf_counter() - start:.0f} s){' under port pressure' if opts.port_pressure else ''}"
          f"{', MASTER_PORT from port 0' if opts.kernel_port else ''}:")
    for label, n in counts.most_common():
        print(f"  {n:>4}  {label}")
    if set(counts) != {"ok"}:
        print(f"the output of each bad run is in {keep}")
    return 0 if set(counts) == {"ok"} else 1


def soak(opts, flags, keep):
    counts = collections.Counter()
    for i in range(opts.runs):
        with tempfile.TemporaryDirectory() as log_dir:
            port = kernel_port() if opts.kernel_port else free_port()
            cmd = launch_command(opts.example, opts.nproc, opts.launcher, [*flags, "--log-dir", log_dir],
                                 port=port)
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
                label = classify(result)
            except subprocess.TimeoutExpired as exc:
                result = subprocess.CompletedProcess(cmd, -9, exc.stdout or "", exc.stderr or "")
                label = "hung"
        counts[label] += 1
        if label != "ok":
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"run-{i:03d}.log").write_text(f"{label}\n{' '.join(cmd)}\n--- stdout\n{result.stdout}\n"
                                                  f"--- stderr\n{result.stderr}")
        print(f"run {i + 1:>3}/{opts.runs}: {label}", flush=True)
    return counts


if __name__ == "__main__":
    sys.exit(main())
