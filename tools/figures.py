#!/usr/bin/env python
"""make figures: the scaling study, the learning-rate lesson and the diagrams, drawn into runs/figures/.

The course notes' figures in assets/ (tracked by git) change only when asked: `--out assets` (`make figures
OUT=assets`).

    python tools/figures.py                       # all three on this machine (~10 min on 2 CPU cores)
    python tools/figures.py --out assets          # the same, replacing the notes' figures in assets/
    python tools/figures.py scaling --ranks 1 2   # weak + strong scaling and the batch-size sweep
    python tools/figures.py lr                    # large-batch LR lesson: 8, 32, 128, 256 emulated workers
    python tools/figures.py diagrams              # data vs model parallelism, gradient averaging, the
                                                  # tensor-parallel block, ring attention
    python tools/figures.py pipeline              # transformer/pp.py's schedules, measured at 2 ranks
    python tools/figures.py scaling --from-logs runs/polaris/ddp-scale/<job id>   # an ALCF sweep's logs

Every run is a real DDP/main.py under torchrun, one thread per rank, logging into runs/figures/<study>/<run>/
(metrics.jsonl, as every example writes); `--replot` draws again from those logs without training.
Each plot function (figures_plots.py) returns the data it drew ({"panel|label": (x, y)}, read back from the
axes), which is what tests/test_figures.py checks; figures_diagrams.py draws the diagrams; figures_runs.py
starts the runs (through tools/launch.py's launch_command) and reads their logs.

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
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from tools.figures_diagrams import diagram_allreduce, diagram_parallelism, diagram_ring, diagram_tensor_parallel
from tools.figures_plots import (
    plot_accuracy,
    plot_batch_efficiency,
    plot_efficiency,
    plot_epoch_time,
    plot_lr_lesson,
    plot_pipeline,
    plot_speedup,
)
from tools.figures_runs import (
    ROOT,
    batch_efficiency,
    find_sweeps,
    launch,
    lr_runs,
    machine_from_path,
    machine_name,
    read_config,
    read_metrics,
    scaling_runs,
    scaling_table,
    sweep_kind,
)


# --- the scaling study ---------------------------------------------------------------------------------------
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


# --- the learning-rate lesson ------------------------------------------------------------------------------
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


# --- the pipeline schedules (transformer/pp.py) -----------------------------------------------------------------
PIPELINE = ["--layers", "4", "--batch-size", "16", "--micro-batches", "4", "--epochs", "1", "--max-steps", "6",
            "--num-threads", "1", "--log-interval", "1000"]


def pipeline_figure(args, out, machine):
    """pp.py at 2 ranks with each schedule; the last training step of each drawn as time lines."""
    runs = {}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"):
        run_dir = Path(args.runs_dir) / "pipeline" / schedule
        if not args.replot and not (args.reuse and (run_dir / "summary.json").exists()):
            launch(2, run_dir, [*PIPELINE, "--schedule", schedule], example="transformer-pp")
        if not (run_dir / "summary.json").exists():
            sys.exit(f"error: --replot: no {run_dir / 'summary.json'} (run without --replot first)")
        runs[schedule] = json.loads((run_dir / "summary.json").read_text())
    path = out / "pipeline_schedules.png"
    title = (f"transformer/pp.py at 2 ranks, 4 blocks, a batch of 16 sequences in 4 micro-batches, the last of "
             f"6 steps; {machine}")
    return {path: plot_pipeline(runs, path, title)}


# --- command line ----------------------------------------------------------------------------------------------
def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", nargs="?", choices=["all", "scaling", "lr", "diagrams", "pipeline"], default="all")
    p.add_argument("--out", default=str(ROOT / "runs" / "figures"),
                   help="where the PNGs go (`--out assets` replaces the course notes' figures)")
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
        diagram_tensor_parallel(out / "diagram_tensor_parallel.png")
        diagram_ring(out / "diagram_ring_attention.png")
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
    if args.what in ("all", "pipeline") and not args.from_logs:
        drawn.update(pipeline_figure(args, out, machine))
    print(f"[figures] done in {time.perf_counter() - start:.0f}s" + ("" if args.from_logs else f" on {machine}"))
    return drawn


if __name__ == "__main__":
    main()
