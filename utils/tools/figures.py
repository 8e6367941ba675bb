#!/usr/bin/env python
"""make figures: the scaling study, the learning-rate lesson and the diagrams, drawn into assets/.

    python utils/figures.py                       # all three on this machine (~10 min on 2 CPU cores)
    python utils/figures.py scaling --ranks 1 2   # weak + strong scaling and the batch-size sweep
    python utils/figures.py lr                    # large-batch LR lesson: 8, 32, 128, 256 emulated workers
    python utils/figures.py diagrams              # data vs model parallelism, gradient averaging
    python utils/figures.py scaling --from-logs runs/polaris/ddp-scale/<job id>   # an ALCF sweep's logs

Every run is a real DDP/main.py under torchrun, one thread per rank, logging into runs/figures/<study>/<run>/
(metrics.jsonl, as every example writes); `--replot` draws again from those logs without training.
Each plot function returns the data it drew ({"panel|label": (x, y)}, read back from the axes), which is
what tests/test_figures.py checks.

Scaling study (DDP, the shipped 4,000 training digits, `--epochs` epochs per run, throughput = median
samples/s over the epochs after the first; the global LR follows the global batch, see --scaling-lr):
  weak   -- fixed batch per rank (`--batch-size`): the global batch grows with the ranks;
  strong -- fixed global batch (`--global-batch`): each rank gets global / ranks;
  speedup(n) = throughput(n) / throughput(1), efficiency = speedup / n; time per epoch = training time of
  one pass over the set (the slowest rank's); and at 2 ranks, efficiency against the batch size per rank.

Learning-rate lesson: SGD (momentum 0.5), base LR 0.01 per worker scaled linearly, 8 samples per worker;
a world of W workers is emulated by 2 real ranks x W/2 gradient-accumulation steps (`--grad-accum`), which
tests/test_figures.py proves equal to a real larger world. Variants: no warmup, linear warmup, and warmup +
gradient-norm clipping (`--clip-grad-norm`) from `--rescue-from` workers up.
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = "DDP/main.py"
DPI = 100


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, run_dir, flags, timeout=600):
    """One DDP run under torchrun into `run_dir` (output in run_dir/output.log); returns its metrics."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in ("metrics.jsonl", "summary.json"):  # a previous run's files must not pass for this one's
        (run_dir / old).unlink(missing_ok=True)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / SCRIPT), *map(str, flags), "--log-dir", str(run_dir)]
    print(f"[figures] {' '.join(cmd[:3])} ... {SCRIPT} {' '.join(map(str, flags))}", flush=True)
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


# --- plots: each returns {"panel|label": (x, y)} read back from the axes -------------------------------------
def plotted(fig):
    return {f"{ax.get_title()}|{line.get_label()}": (list(map(float, line.get_xdata())),
                                                     list(map(float, line.get_ydata())))
            for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}


def save(fig, path, title):
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    data = plotted(fig)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
    return data


def plot_speedup(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    top = max(max(t["ranks"]) for t in tables.values())
    lo = min(min(t["ranks"]) for t in tables.values())
    ax.plot([lo, top], [lo, top], "k--", label="ideal")
    for label, t in tables.items():
        ax.plot(t["ranks"], t["speedup"], "o-", label=label)
    ax.set(xlabel="ranks", ylabel="speedup (throughput vs 1 rank)", title="speedup")
    ax.set_xticks(sorted({n for t in tables.values() for n in t["ranks"]}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_efficiency(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ranks = sorted({n for t in tables.values() for n in t["ranks"]})
    ax.plot([ranks[0], ranks[-1]], [1, 1], "k--", label="ideal")
    for label, t in tables.items():
        ax.plot(t["ranks"], t["efficiency"], "o-", label=label)
    ax.set(xlabel="ranks", ylabel="efficiency (speedup / ranks)", title="efficiency", ylim=(0, 1.15))
    ax.set_xticks(ranks)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_epoch_time(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for label, t in tables.items():
        line, = ax.plot(t["ranks"], t["epoch_time_s"], "o-", label=label)
        ideal = [t["epoch_time_s"][0] * t["ranks"][0] / n for n in t["ranks"]]
        ax.plot(t["ranks"], ideal, ":", color=line.get_color(), label=f"ideal: {label.split(' ')[0]}")
    ax.set(xlabel="ranks", ylabel="training time per epoch (s)", title="time per epoch", ylim=(0, None))
    ax.set_xticks(sorted({n for t in tables.values() for n in t["ranks"]}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_accuracy(curves, path, title):
    """curves: {panel: {ranks: history}} -> test accuracy against epoch, one line per rank count."""
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False, sharey=True)
    for ax, (panel, runs) in zip(axes[0], curves.items()):
        for n in sorted(runs):
            ax.plot([m["epoch"] for m in runs[n]], [m["test_acc"] for m in runs[n]], "o-", label=f"{n} rank(s)")
        ax.set(xlabel="epoch", title=panel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    return save(fig, path, title)


def plot_batch_efficiency(sizes, eff, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot([sizes[0], sizes[-1]], [1, 1], "k--", label="ideal")
    ax.plot(sizes, eff, "o-", label="2 ranks")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set(xlabel="batch size per rank", ylabel="efficiency at 2 ranks", title="efficiency vs batch per rank",
           ylim=(0, 1.15))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_lr_lesson(runs, path, title):
    """runs: {workers: {variant: history}} -> one panel per worker count, accuracy vs epoch per variant."""
    workers = sorted(runs)
    fig, axes = plt.subplots(1, len(workers), figsize=(3.2 * len(workers), 3.3), squeeze=False, sharey=True)
    styles = {}
    for ax, w in zip(axes[0], workers):
        lr = runs[w][next(iter(runs[w]))][-1]["lr"]
        for variant, history in runs[w].items():
            fmt = styles.setdefault(variant, ["o-", "s-", "^-", "v-"][len(styles) % 4])
            ax.plot([m["epoch"] for m in history], [m["test_acc"] for m in history], fmt, ms=3, label=variant)
        ax.set(xlabel="epoch", title=f"{w} workers (lr {lr:.3g})", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    data = plotted(fig)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
    return data


# --- the scaling study ---------------------------------------------------------------------------------------
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


def scaling_figures(runs, args, out, prefix, machine):
    """The five scaling figures from {(ranks, batch per rank): history}; returns {figure path: plotted data}."""
    weak = {n: runs[n, args.batch_size] for n in args.ranks}
    strong = {n: runs[n, args.global_batch // n] for n in args.ranks}
    tables = {f"weak ({args.batch_size}/rank)": scaling_table(weak),
              f"strong ({args.global_batch} global)": scaling_table(strong)}
    where = f"DDP, {machine}"
    drawn = {}
    for name, fn in [("speedup", plot_speedup), ("efficiency", plot_efficiency), ("epoch_time", plot_epoch_time)]:
        path = out / f"{prefix}_{name}.png"
        drawn[path] = fn(tables, path, where)
    path = out / f"{prefix}_accuracy.png"
    drawn[path] = plot_accuracy({f"weak: {args.batch_size} per rank": weak,
                                 f"strong: {args.global_batch} global": strong}, path, where)
    if args.batch_sizes:
        sizes, eff = batch_efficiency({b: runs[1, b] for b in args.batch_sizes},
                                      {b: runs[2, b] for b in args.batch_sizes})
        path = out / f"{prefix}_batch_efficiency.png"
        drawn[path] = plot_batch_efficiency(sizes, eff, path, where)
    for label, t in tables.items():
        print(f"[figures] {label}: " + ", ".join(
            f"{n} rank(s) {s:.0f} samples/s speedup {sp:.2f} eff {e:.2f} epoch {et:.2f}s"
            for n, s, sp, e, et in zip(t["ranks"], t["samples_per_s"], t["speedup"], t["efficiency"],
                                       t["epoch_time_s"])))
    if args.batch_sizes:
        print("[figures] efficiency at 2 ranks by batch per rank: "
              + ", ".join(f"{b}: {e:.2f}" for b, e in zip(sizes, eff)))
    return drawn


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


def from_logs(args):
    sweeps = {}
    for folder in args.from_logs:
        found = find_sweeps(folder)
        if not found:
            sys.exit(f"error: no <sweep>/n<ranks>/metrics.jsonl under {folder}")
        sweeps.update(found)
    tables, curves = {}, {}
    for folder, dirs in sweeps.items():
        runs = {n: read_metrics(d) for n, d in dirs.items()}
        config = read_config(next(iter(dirs.values())))
        label = f"{folder.parent.name.replace('-scale', '')} {sweep_kind(dirs)}"
        if label in tables:
            label = f"{label} [{folder.name}]"
        tables[label], curves[label] = scaling_table(runs), runs
    name = args.name or machine_from_path(next(iter(sweeps)))
    where = f"{name}: {config.get('device', '?')}, logs in {', '.join(map(str, args.from_logs))}"
    out, drawn = Path(args.out), {}
    for fig_name, fn in [("speedup", plot_speedup), ("efficiency", plot_efficiency), ("epoch_time", plot_epoch_time)]:
        path = out / f"{name}_scaling_{fig_name}.png"
        drawn[path] = fn(tables, path, where)
    path = out / f"{name}_scaling_accuracy.png"
    drawn[path] = plot_accuracy(curves, path, where)
    return drawn


def machine_from_path(sweep):
    """runs/<machine>/<example>-scale/<job id> -> <machine>."""
    parts = Path(sweep).resolve().parts
    return parts[parts.index("runs") + 1] if "runs" in parts[:-1] else Path(sweep).name


# --- the learning-rate lesson ------------------------------------------------------------------------------
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


def lr_figure(runs, args, out, machine):
    path = out / "lr_lesson.png"
    title = (f"DDP, {args.real_ranks} real ranks x --grad-accum = emulated workers, {args.batch_size} samples per "
             f"worker, lr {args.lr:g} x workers, SGD momentum 0.5\n{machine}")
    drawn = {path: plot_lr_lesson(runs, path, title)}
    print("[figures] final test accuracy:")
    for w in sorted(runs):
        print(f"[figures]   {w:>4} workers: " + ", ".join(
            f"{v} {h[-1]['test_acc']:.3f} (best {max(m['test_acc'] for m in h):.3f})" for v, h in runs[w].items()))
    return drawn


# --- diagrams (drawn by code) ------------------------------------------------------------------------------
def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, text="", color="black", style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, lw=1.2,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.15, text, ha="center", fontsize=7, color=color)


def diagram_parallelism(path):
    """Data parallelism (full model per worker, a slice of the batch each) vs model parallelism (layers split)."""
    layer_colors = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5"]
    data_colors = ["#fdd0a2", "#fdae6b", "#fd8d3c", "#e6550d"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.9))
    for ax in axes:
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 7.5)
        ax.axis("off")
    ax = axes[0]
    ax.set_title("data parallelism: every worker holds the whole model", fontsize=9)
    for r in range(4):
        x = 0.3 + r * 2.45
        _box(ax, x, 5.6, 1.9, 0.7, f"batch slice {r}", data_colors[r])
        for li in range(4):
            _box(ax, x + 0.2, 1.5 + li * 0.8, 1.5, 0.6, f"layer {li + 1}", layer_colors[li], fontsize=7)
        ax.text(x + 0.95, 0.95, f"GPU {r}", ha="center", fontsize=8, weight="bold")
        _arrow(ax, (x + 0.95, 5.6), (x + 0.95, 4.75))
    ax.plot([0.4, 9.6], [0.55, 0.55], color="#31a354", lw=2)
    ax.text(5, 0.1, "all-reduce: average the gradients, every copy takes the same step", ha="center",
            fontsize=8, color="#31a354")
    ax = axes[1]
    ax.set_title("model parallelism: each worker holds some layers", fontsize=9)
    _box(ax, 0.2, 5.6, 2.2, 0.7, "whole batch", "#fdae6b")
    for r in range(4):
        x = 0.3 + r * 2.45
        _box(ax, x + 0.2, 3.0, 1.5, 0.8, f"layer {r + 1}", layer_colors[r])
        ax.text(x + 0.95, 0.95, f"GPU {r}", ha="center", fontsize=8, weight="bold")
        if r < 3:
            _arrow(ax, (x + 1.75, 3.4), (x + 2.6, 3.4), color="#756bb1")
    _arrow(ax, (1.25, 5.6), (1.25, 3.85))
    ax.text(5.2, 4.3, "activations forward, their gradients backward", ha="center", fontsize=8, color="#756bb1")
    ax.text(5, 0.1, "(pipeline: layers split; tensor parallel: each layer split)", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)


def diagram_allreduce(path):
    """Each rank's gradient g_r -> ring all-reduce (reduce-scatter, all-gather) -> the average on every rank."""
    grads = [[0.8, 0.2, 0.5, 0.3], [0.4, 0.6, 0.1, 0.7], [0.6, 0.4, 0.9, 0.1], [0.2, 0.8, 0.5, 0.5]]
    mean = [sum(g[i] for g in grads) / 4 for i in range(4)]
    colors = ["#e6550d", "#31a354", "#3182bd", "#756bb1"]
    fig, ax = plt.subplots(figsize=(9, 3.9))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.7, 6.6)
    ax.axis("off")

    def bars(x0, y0, values, color, label):
        for i, v in enumerate(values):
            ax.add_patch(plt.Rectangle((x0 + i * 0.3, y0), 0.24, v * 1.1, fc=color, ec="black", lw=0.5))
        ax.text(x0 + 0.55, y0 - 0.35, label, ha="center", fontsize=8)

    for r in range(4):
        x = 0.6 + r * 2.9
        bars(x, 4.6, grads[r], colors[r], f"rank {r}: g{r}")
        bars(x, 0.6, mean, "#bdbdbd", f"rank {r}: (g0+g1+g2+g3)/4")
        _arrow(ax, (x + 0.55, 4.15), (x + 0.55, 3.35))
        _arrow(ax, (x + 0.55, 2.55), (x + 0.55, 1.85))
    _box(ax, 0.4, 2.6, 11.2, 0.7, "ring all-reduce: N-1 reduce-scatter steps, then N-1 all-gather steps; "
         "each rank sends 2(N-1)/N x S bytes", "#f0f0f0")
    ax.text(6, 6.35, "after backward: a different gradient on every rank (each saw different data)",
            ha="center", fontsize=9)
    ax.text(6, -0.6, "after the all-reduce: the same average everywhere, so every copy of the model stays identical",
            ha="center", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)


# --- command line ----------------------------------------------------------------------------------------------
def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", nargs="?", choices=["all", "scaling", "lr", "diagrams"], default="all")
    p.add_argument("--out", default=str(ROOT / "assets"), help="where the PNGs go")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "figures"), help="where the runs' log dirs go")
    p.add_argument("--replot", action="store_true", help="draw from the logs in --runs-dir, train nothing")
    p.add_argument("--reuse", action="store_true",
                   help="keep the finished runs in --runs-dir (summary.json written); train only the missing ones")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (the same at every rank count)")
    p.add_argument("--max-steps", type=int, default=None, help="cap steps per epoch (quick runs, tests)")
    g = p.add_argument_group("scaling study")
    g.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts")
    g.add_argument("--epochs", type=int, default=3, help="epochs per scaling run")
    g.add_argument("--batch-size", type=int, default=64, help="weak scaling: batch per rank")
    g.add_argument("--global-batch", type=int, default=64, help="strong scaling: global batch")
    g.add_argument("--scaling-lr", type=float, default=0.05,
                   help="per-rank LR at --batch-size; other batches get it in proportion (so a strong-scaling "
                        "sweep keeps one global LR)")
    g.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 32, 128, 512],
                   help="batch sizes per rank for the efficiency sweep at 2 ranks (none: skip it)")
    g.add_argument("--from-logs", nargs="+", default=None, metavar="DIR",
                   help="plot the sweeps under DIR (<sweep>/n<ranks>/metrics.jsonl from submissions/*/scale.sh) "
                        "instead of running; figures are named <machine>_scaling_*.png")
    g.add_argument("--name", default=None, help="with --from-logs: the machine name in file names and titles")
    g = p.add_argument_group("learning-rate lesson")
    g.add_argument("--workers", type=int, nargs="+", default=[8, 32, 128, 256], help="emulated worker counts")
    g.add_argument("--real-ranks", type=int, default=2, help="real ranks; workers / real ranks = --grad-accum")
    g.add_argument("--lr-epochs", dest="lr_epochs", type=int, default=15, help="epochs per lesson run")
    g.add_argument("--lr", type=float, default=0.01, help="base LR per worker")
    g.add_argument("--lr-batch-size", dest="lr_batch_size", type=int, default=8, help="samples per worker")
    g.add_argument("--warmup", type=int, default=5, help="warmup epochs")
    g.add_argument("--clip", type=float, default=1.0, help="--clip-grad-norm of the rescue")
    g.add_argument("--rescue-from", type=int, default=128, help="add the warmup + clipping variant from here up")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    drawn = {}
    start = time.perf_counter()
    if args.what in ("all", "diagrams") and not args.from_logs:
        diagram_parallelism(out / "diagram_parallelism.png")
        diagram_allreduce(out / "diagram_allreduce.png")
    if args.what in ("all", "scaling"):
        if args.from_logs:
            drawn.update(from_logs(args))
        else:
            if 2 not in args.ranks and args.batch_sizes:
                args.batch_sizes = []  # the batch-size sweep is at 2 ranks
            drawn.update(scaling_figures(scaling_runs(args), args, out, "scaling", machine))
    if args.what in ("all", "lr") and not args.from_logs:
        lesson = argparse.Namespace(**vars(args))
        lesson.epochs, lesson.batch_size = args.lr_epochs, args.lr_batch_size
        drawn.update(lr_figure(lr_runs(lesson), lesson, out, machine))
    print(f"[figures] done in {time.perf_counter() - start:.0f}s" + ("" if args.from_logs else f" on {machine}"))
    return drawn


if __name__ == "__main__":
    main()
