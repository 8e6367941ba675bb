#!/usr/bin/env python
"""Every variant of zero/main.py, one torchrun launch each (so each has its own peak memory), and
the bytes each rank holds next to the ZeRO paper's formula, as markdown tables.

    python zero/report.py --ranks 2                      # every variant on 2 ranks (minutes)
    python zero/report.py --ranks 2 4 --json zero.json   # ... on 2 and 4 ranks; also as JSON
    python zero/report.py --variants ds2 ds3 --explain   # + the largest tensors behind the sums

Each launch runs `zero/main.py --variant V` with the model flags given here, one thread per rank
and glibc's mmap threshold fixed at 1 MB: every freed large tensor then goes back to the OS at once,
so RSS follows the tensors (glibc's default threshold adapts upwards and keeps freed buffers in the
heap, inflating RSS).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from course.checks import check_paths
from course.errors import fail
from course.failures import run_main
from tools.launch import launch_command
from zero.census import KINDS, NAMES, mb
from zero.flags import model_flags, problems
from zero.main import VARIANTS

MODEL_FLAGS = ("hidden", "layers", "steps", "batch_size", "lr", "seed", "dist_timeout")


def launch(variant, n, args, out):
    """One torchrun launch of zero/main.py; its result (rank 0's JSON) with the launch's wall
    time."""
    flags = ["--variant", variant, "--json", out]
    for name in MODEL_FLAGS:
        flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    cmd = launch_command("zero", n, "torchrun", flags)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MALLOC_MMAP_THRESHOLD_="1048576",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    start = time.perf_counter()
    # Its own process group: a timeout ends torchrun and the ranks.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        fail(f"{variant} on {n} ranks did not finish in {args.timeout} s (--timeout)", code=1)
    if proc.returncode != 0:
        sys.stderr.write(stdout[-3000:] + stderr[-3000:])
        fail(f"{variant} on {n} ranks failed (exit {proc.returncode}); its output is above", code=1)
    result = json.loads(Path(out).read_text())
    result["launch_s"] = time.perf_counter() - start
    return result


def cell(values, formula=None):
    """Mean over ranks, [min-max] when the ranks differ, (the formula) when there is one."""
    mean = sum(values) / len(values)
    low, high = mb(min(values)), mb(max(values))
    text = mb(mean) if low == high else f"{mb(mean)} [{low}-{high}]"
    return text if formula is None else f"{text} ({mb(formula)})"


def table(results, n):
    rows = [r for r in results if r["ranks"] == n]
    psi = rows[0]["psi"]
    lines = [f"N = {n} ranks, Ψ = {psi:,} parameters (fp32: 4Ψ = {mb(4 * psi)} MB). "
             "MB per rank: the mean over ranks [min-max when they differ], the ZeRO formula in "
             "parentheses; sum and RSS: the largest rank.", "",
             "| variant | " + " | ".join(NAMES[k] for k in KINDS) + " | sum | peak RSS in training "
             "| peak RSS - RSS before the model |",
             "|---" * (len(KINDS) + 4) + "|"]
    for r in rows:
        per_rank, formula = r["per_rank"], r["formula"]
        cells = [cell([pr[k] for pr in per_rank], formula.get(k)) for k in KINDS]
        largest = max(sum(pr[k] for k in KINDS) for pr in per_rank)
        cells.append(f"{mb(largest)} ({mb(sum(formula.values()))})")
        cells.append(mb(max(pr["peak_rss"] for pr in per_rank)))
        cells.append(mb(max(pr["peak_rss"] - pr["base_rss"] for pr in per_rank)))
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_table(results, n):
    rows = [r for r in results if r["ranks"] == n]
    ref = next((r for r in rows if r["variant"] == "ds0"), rows[0])
    lines = [f"| variant (N = {n}) | losses of steps 1..{len(ref['losses'])} "
             f"| max abs diff to {ref['variant']} |", "|---|---|---|"]
    for r in rows:
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        losses = " ".join(f"{v:.6f}" for v in r["losses"])
        lines.append(f"| {r['variant']} | {losses} | {diff:.1e} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes to measure")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    model_flags(p.add_argument_group("what is trained (zero/main.py's flags)"))
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--json", help="also write all results to this file")
    p.add_argument("--explain", action="store_true",
                   help="list the largest tensors of rank 0 behind each sum")
    args = p.parse_args()
    if min(args.ranks) < 1 or args.timeout < 1:
        p.error("--ranks and --timeout must be at least 1")
    for problem in problems(args, max(args.ranks)):
        p.error(problem)
    check_paths(p, args)  # --json: a file we can write, checked before anything starts

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            for v in args.variants:
                r = launch(v, n, args, Path(tmp) / f"{v}-{n}.json")
                losses = " ".join(f"{x:.6f}" for x in r["losses"])
                print(f"{v:<12} N={n}: {r['launch_s']:.0f} s, losses {losses}", flush=True)
                if args.explain:
                    for kind, where, size in r["per_rank"][0]["largest"]:
                        print(f"    rank 0 {kind:<7} {size:>9.2f} MB  {where}")
                results.append(r)
    for n in args.ranks:
        print("\n" + table(results, n) + "\n\n" + loss_table(results, n))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_main(main)
