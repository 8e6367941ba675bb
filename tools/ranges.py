#!/usr/bin/env python
"""The course path's final accuracies as ranges: each step's command over seeds and CPU kernel sets.

    python tools/ranges.py                       # every step, seeds 42 and 1, three CPU kernel sets
    python tools/ranges.py --only ddp tp --seeds 42 1 2

One machine's digits are not another's: the last digits of a loss or an accuracy follow the CPU's
floating-point kernels and the seed. PyTorch picks its kernels by the CPU's instruction set (AVX-512, AVX2, ...);
ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 CPU take AVX2's kernels, as most laptops do, and
ATEN_CPU_CAPABILITY=default the plain ones a CPU without vector extensions would. The kernel sets and a few
seeds give the range an attendee can expect on their own machine. The notes quote these ranges, and the
tests' thresholds as the criterion. TensorFlow ignores the variable (its kernels come from oneDNN), so its
range comes from the seeds alone.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from tools.launch import launch_command

# name: (example, launcher, ranks, flags) -- the course path's commands (README.md), with their defaults
STEPS = {
    "ddp": ("ddp", "torchrun", 2, []),
    "horovod-pytorch": ("horovod-pytorch", "horovodrun", 2, []),
    "horovod-tensorflow": ("horovod-tensorflow", "mpiexec", 2, []),
    "deepspeed": ("deepspeed", "deepspeed", 2, []),
    # DDP/large-batches.md: 128 emulated workers (2 ranks x 64 accumulation steps), warmup + clipping
    "rescue": ("ddp", "torchrun", 2, ["--epochs", "15", "--batch-size", "8", "--lr", "0.01", "--grad-accum", "64",
                                      "--lr-warmup-epochs", "5", "--clip-grad-norm", "1.0"]),
}
# This CPU's kernels, AVX2's (what most laptops take; the same as native on an AVX2 CPU) and the plain ones.
KERNELS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "plain": {"ATEN_CPU_CAPABILITY": "default"}}


def final_accuracy(example, launcher, ranks, flags, seed, env):
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = launch_command(example, ranks, launcher, [*flags, "--seed", str(seed), "--log-dir", log_dir])
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                env={**os.environ, **env})
        if result.returncode != 0:
            raise SystemExit(f"error: {' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-2000:]}")
        return json.loads((Path(log_dir) / "summary.json").read_text())["test_acc"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(STEPS), default=sorted(STEPS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1])
    parser.add_argument("--json", default=None, help="also write the runs here")
    opts = parser.parse_args()
    import torch
    print(f"kernels: native = {torch.backends.cpu.get_cpu_capability()} on this CPU, plain = no vector "
          f"extensions; seeds {opts.seeds}", flush=True)
    kernels = dict(KERNELS)
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        del kernels["avx2"]  # the native kernels already
    rows = {}
    for name in opts.only:
        example, launcher, ranks, flags = STEPS[name]
        runs = {f"{kernel} seed {seed}": final_accuracy(example, launcher, ranks, flags, seed, env)
                for kernel, env in kernels.items() for seed in opts.seeds}
        rows[name] = runs
        values = sorted(runs.values())
        print(f"{name:<20} test accuracy {values[0]:.4f}-{values[-1]:.4f} over {len(values)} runs: "
              + ", ".join(f"{k} {v:.4f}" for k, v in runs.items()), flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
