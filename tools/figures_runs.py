"""make figures' runs: each a real example started through tools.launch.launch_command (torchrun), logging into
its own folder; their metrics read back, and the scaling arithmetic on them (tests/test_figures.py)."""
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.append(str(ROOT))  # after site-packages: our horovod/ and deepspeed/ folders never shadow the libraries
from tools.launch import EXAMPLES, launch_command  # the one module that knows launchers

EXAMPLE = "ddp"  # every run of the scaling study and the learning-rate lesson


# --- running the examples ----------------------------------------------------------------------------------
def machine_name():
    """'2-core x86_64 CPU, no GPU' (or the GPUs): what every caption and figure title names."""
    cpu = f"{os.cpu_count()}-core {platform.machine()} CPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")
        gpus = [g.strip() for g in out if g.strip()]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return f"{cpu}, {len(gpus)} x {gpus[0]}" if gpus else f"{cpu}, no GPU"


def launch(nproc, run_dir, flags, timeout=600, example=None):
    """One run of `example` (default: DDP) under torchrun into `run_dir` (output in run_dir/output.log); returns
    its metrics."""
    example = example or EXAMPLE
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in ("metrics.jsonl", "summary.json"):  # a previous run's files must not pass for this one's
        (run_dir / old).unlink(missing_ok=True)
    cmd = launch_command(example, nproc, "torchrun", [*flags, "--log-dir", run_dir], bin_dir=BIN)
    print(f"[figures] torchrun --nproc_per_node {nproc} ... {EXAMPLES[example]} {' '.join(map(str, flags))}",
          flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    start = time.perf_counter()
    with open(run_dir / "output.log", "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"error: timed out after {timeout}s; see {run_dir / 'output.log'}")
    if proc.returncode != 0:
        tail = (run_dir / "output.log").read_text().splitlines()[-15:]
        if not (run_dir / "summary.json").exists():
            sys.exit(f"error: exit {proc.returncode}: {' '.join(cmd)}\n" + "\n".join(tail))
        # Training finished and was recorded; a crash while the processes tear down does not change it.
        print(f"[figures]   warning: exit {proc.returncode} after summary.json was written; see "
              f"{run_dir / 'output.log'}", flush=True)
    m = read_metrics(run_dir)
    print(f"[figures]   {time.perf_counter() - start:.0f}s, test_acc {m[-1]['test_acc']:.3f}, "
          f"{throughput(m):.0f} samples/s", flush=True)
    return m


def get_run(nproc, run_dir, flags, replot, reuse=False):
    if reuse and (Path(run_dir) / "summary.json").exists():
        print(f"[figures] reusing {run_dir}", flush=True)
        return read_metrics(run_dir)
    if replot:
        if not (Path(run_dir) / "metrics.jsonl").exists():
            sys.exit(f"error: --replot: no {Path(run_dir) / 'metrics.jsonl'} (run without --replot first)")
        return read_metrics(run_dir)
    return launch(nproc, run_dir, flags)


def read_metrics(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_config(run_dir):
    path = Path(run_dir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


# --- arithmetic --------------------------------------------------------------------------------------------
def steady(history, key):
    """Median of `key` over the epochs after the first (warm-up), or the only epoch."""
    values = [m[key] for m in history[1:]] or [m[key] for m in history]
    return statistics.median(values)


def throughput(history):
    return steady(history, "samples_per_s")


def scaling_table(runs):
    """{ranks: metrics history} -> ranks, samples/s, speedup, efficiency, epoch time (sorted by ranks).

    Speedup is relative to the smallest rank count n0 (scaled so that it reads n0 there): n0 x sps(n) / sps(n0).
    """
    ranks = sorted(runs)
    sps = [throughput(runs[n]) for n in ranks]
    speedup = [ranks[0] * s / sps[0] for s in sps]
    return {"ranks": ranks, "samples_per_s": sps, "speedup": speedup,
            "efficiency": [s / n for s, n in zip(speedup, ranks)],
            "epoch_time_s": [steady(runs[n], "train_time_s") for n in ranks]}


def batch_efficiency(one_rank, two_ranks):
    """{batch per rank: history} at 1 and 2 ranks -> (batch sizes, efficiency = sps(2) / (2 sps(1)))."""
    sizes = sorted(set(one_rank) & set(two_ranks))
    return sizes, [throughput(two_ranks[b]) / (2 * throughput(one_rank[b])) for b in sizes]


# --- sweeps from ALCF machines (submissions/*/scale.sh) --------------------------------------------------------
def find_sweeps(folder):
    """Every folder under `folder` (itself included) holding n<ranks>/metrics.jsonl: {folder: {ranks: dir}}."""
    sweeps = {}
    for metrics in sorted(Path(folder).glob("**/n*/metrics.jsonl")):
        run = metrics.parent
        if run.name[1:].isdigit():
            sweeps.setdefault(run.parent, {})[int(run.name[1:])] = run
    return sweeps


def sweep_kind(runs):
    """'weak' when the batch per rank is fixed, 'strong' when ranks x batch is, else 'sweep'."""
    per_rank = {read_config(d).get("batch_size") for d in runs.values()}
    global_ = {read_config(d).get("batch_size", 0) * n * read_config(d).get("grad_accum", 1) for n, d in runs.items()}
    if len(runs) > 1 and len(global_) == 1 and None not in per_rank:
        return f"strong ({global_.pop()} global)"
    if len(per_rank) == 1 and None not in per_rank:
        return f"weak ({per_rank.pop()}/rank)"
    return "sweep"


def machine_from_path(sweep):
    """runs/<machine>/<example>-scale/<job id> -> <machine>."""
    parts = Path(sweep).resolve().parts
    return parts[parts.index("runs") + 1] if "runs" in parts[:-1] else Path(sweep).name


# --- the runs of each study (figures.py draws them) ---------------------------------------------------------
def scaling_runs(args):
    """Run (or re-read) every configuration once: {(ranks, batch per rank): history}."""
    base = Path(args.runs_dir) / "scaling"
    common = ["--epochs", args.epochs, "--num-threads", args.threads, "--log-interval", 1000]
    if args.max_steps:
        common += ["--max-steps", args.max_steps]
    configs = []
    for n in args.ranks:
        configs.append((n, args.batch_size))  # weak
        if args.global_batch % n:
            sys.exit(f"error: --global-batch {args.global_batch} is not divisible by {n} ranks")
        configs.append((n, args.global_batch // n))  # strong
    for b in args.batch_sizes:
        configs += [(1, b), (2, b)]
    runs = {}
    for n, b in configs:
        if (n, b) not in runs:
            # The LR follows the global batch (linear scaling rule): per rank --lr is proportional to the batch
            # per rank, and the script multiplies it by the ranks. Weak scaling grows it, strong keeps it fixed.
            lr = args.scaling_lr * b / args.batch_size
            runs[n, b] = get_run(n, base / f"n{n}-b{b}", common + ["--batch-size", b, "--lr", f"{lr:g}"],
                                 args.replot, args.reuse)
    return runs


def lr_variants(workers, args):
    variants = {"no warmup": [], f"warmup {args.warmup} epochs": ["--lr-warmup-epochs", args.warmup]}
    if workers >= args.rescue_from:
        variants[f"warmup + clip {args.clip:g}"] = ["--lr-warmup-epochs", args.warmup, "--clip-grad-norm", args.clip]
    return variants


def lr_runs(args):
    base = Path(args.runs_dir) / "lr"
    runs = {}
    for w in args.workers:
        if w % args.real_ranks:
            sys.exit(f"error: {w} workers cannot be emulated by {args.real_ranks} ranks x whole accumulation steps")
        common = ["--epochs", args.epochs, "--batch-size", args.batch_size, "--lr", args.lr, "--momentum", 0.5,
                  "--grad-accum", w // args.real_ranks, "--num-threads", args.threads, "--log-interval", 1000]
        if args.max_steps:
            common += ["--max-steps", args.max_steps]
        runs[w] = {}
        for variant, flags in lr_variants(w, args).items():
            slug = variant.replace(" ", "-").replace("+", "").replace("--", "-")
            runs[w][variant] = get_run(args.real_ranks, base / f"w{w}-{slug}", common + flags, args.replot,
                                       args.reuse)
    return runs
