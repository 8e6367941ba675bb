#!/usr/bin/env python
"""make demo: every example on 2 CPU ranks over real MNIST digits, through its real launchers, then a table.

Each run writes its own log dir under runs/demo/; the table is also saved as runs/demo/results.json.
    python tools/demo.py                 # all examples, default flags (2 epochs)
    python tools/demo.py --epochs 1 --only ddp
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.append(str(ROOT))  # after site-packages: our horovod/ and deepspeed/ folders never shadow the libraries
from tools.launch import launch_command  # the one module that knows launchers

# (name, framework, launcher as shown, example (tools.launch.EXAMPLES), launcher (tools.launch.LAUNCHERS)),
# 2 ranks each
RUNS = [
    ("ddp-torchrun", "PyTorch DDP", "torchrun", "ddp", "torchrun"),
    ("ddp-mpiexec", "PyTorch DDP", "mpiexec", "ddp", "mpiexec"),
    ("hvd-torch-horovodrun", "Horovod PyTorch", "horovodrun --gloo", "horovod-pytorch", "horovodrun"),
    ("hvd-torch-mpiexec", "Horovod PyTorch", "mpiexec", "horovod-pytorch", "mpiexec"),
    ("hvd-tf-horovodrun", "Horovod TensorFlow", "horovodrun --gloo", "horovod-tensorflow", "horovodrun"),
    ("hvd-tf-mpiexec", "Horovod TensorFlow", "mpiexec", "horovod-tensorflow", "mpiexec"),
    ("hvd-keras-horovodrun", "Horovod Keras API", "horovodrun --gloo", "horovod-keras", "horovodrun"),
    ("deepspeed-launcher", "DeepSpeed", "deepspeed", "deepspeed", "deepspeed"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="run only these (name prefixes: ddp, hvd-torch, hvd-tf, ...)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "demo"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run before it is killed")
    args = parser.parse_args()

    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1")
    results, failed = [], []
    selected = [r for r in RUNS if not args.only or any(r[0].startswith(p) for p in args.only)]
    for i, (name, framework, launcher, example, how) in enumerate(selected, 1):
        log_dir = Path(args.out) / name
        cmd = launch_command(example, 2, how, ["--epochs", args.epochs, "--log-dir", log_dir], bin_dir=BIN)
        print(f"[{i}/{len(selected)}] {framework} under {launcher} ... ", end="", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired as exc:
            proc, ok = exc, False
        wall = time.perf_counter() - start
        if not ok:
            failed.append(name)
            print(f"FAILED after {wall:.0f}s\n    {' '.join(cmd)}")
            tail = (proc.stderr or "") if isinstance(proc.stderr, str) else ""
            print("    " + "\n    ".join(tail.strip().splitlines()[-8:]))
            continue
        summary = json.loads((log_dir / "summary.json").read_text())
        results.append(dict(name=name, framework=framework, launcher=launcher, ranks=summary["world_size"],
                            test_acc=summary["test_acc"], samples_per_s=summary["samples_per_s"],
                            wall_time_s=wall, log_dir=str(log_dir)))
        print(f"test accuracy {summary['test_acc']:.3f} in {wall:.0f}s")

    print_table(results)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    if failed:
        print(f"\n{len(failed)} example(s) failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def print_table(results):
    header = ("framework", "launcher", "ranks", "test acc", "samples/s", "wall time")
    rows = [(r["framework"], r["launcher"], str(r["ranks"]), f"{r['test_acc']:.3f}",
             f"{r['samples_per_s']:.0f}", f"{r['wall_time_s']:.0f} s") for r in results]
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(title="make demo: 2 CPU ranks, real MNIST digits (samples/s = global training throughput)")
        for column in header:
            table.add_column(column, justify="left" if column in ("framework", "launcher") else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=120).print(table)
    except ImportError:
        for row in [header] + rows:
            print("  ".join(f"{c:>18}" for c in row))


if __name__ == "__main__":
    main()
