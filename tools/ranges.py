#!/usr/bin/env python
"""The course path's final numbers as ranges: each step's command over seeds and CPU kernel sets (the MNIST
steps' test accuracy; the transformer chapter's test loss, and the pipeline's idle shares).

    python tools/ranges.py                       # every step, seeds 42 and 1, three CPU kernel sets
    python tools/ranges.py --only gpt-ddp gpt-ddp-60 gpt-tp gpt-cp gpt-ep gpt-pp --kernels native avx2

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
    # transformer/: the chapter's commands (README.md, transformer/README.md, part2.md), and the short run they
    # suggest (--max-steps 60)
    "gpt-ddp": ("transformer-ddp", "python", 1, []),
    "gpt-ddp-60": ("transformer-ddp", "python", 1, ["--max-steps", "60"]),
    "gpt-tp": ("transformer-tp", "torchrun", 2, []),
    "gpt-cp": ("transformer-cp", "torchrun", 2, []),
    "gpt-ep": ("transformer-ep", "torchrun", 2, []),
    "gpt-pp": ("transformer-pp", "torchrun", 2, []),
    "gpt-pp-50": ("transformer-pp", "torchrun", 2, ["--max-steps", "50"]),  # part2.md's excerpt
}
# This CPU's kernels, AVX2's (what most laptops take; the same as native on an AVX2 CPU) and the plain ones.
KERNELS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "plain": {"ATEN_CPU_CAPABILITY": "default"}}


def final_numbers(example, launcher, ranks, flags, seed, env):
    """{what: value}: the test accuracy (MNIST) or test loss (the GPT), and a pipeline's idle shares."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = launch_command(example, ranks, launcher, [*flags, "--seed", str(seed), "--log-dir", log_dir])
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                env={**os.environ, **env})
        if result.returncode != 0:
            raise SystemExit(f"error: {' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-2000:]}")
        summary = json.loads((Path(log_dir) / "summary.json").read_text())
    if not example.startswith("transformer"):
        return {"test accuracy": summary["test_acc"]}
    numbers = {"test loss": summary["test_loss"]}
    for rank, share in enumerate(summary.get("idle_fraction") or []):
        numbers[f"idle share rank {rank}"] = share
    return numbers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(STEPS), default=sorted(STEPS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--json", default=None, help="also write the runs here")
    opts = parser.parse_args()
    import torch
    print(f"kernels: native = {torch.backends.cpu.get_cpu_capability()} on this CPU, plain = no vector "
          f"extensions; seeds {opts.seeds}", flush=True)
    kernels = {k: v for k, v in KERNELS.items() if k in opts.kernels}
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        kernels.pop("avx2", None)  # the native kernels already
    rows = {}
    for name in opts.only:
        example, launcher, ranks, flags = STEPS[name]
        runs = {f"{kernel} seed {seed}": final_numbers(example, launcher, ranks, flags, seed, env)
                for kernel, env in kernels.items() for seed in opts.seeds}
        rows[name] = runs
        for what in next(iter(runs.values())):
            values = {k: v[what] for k, v in runs.items()}
            low, high = min(values.values()), max(values.values())
            print(f"{name:<20} {what} {low:.4f}-{high:.4f} over {len(values)} runs: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
