#!/usr/bin/env python
"""make bench: every framework measured side by side on this machine, with one thread per rank.

For each example: training throughput at 1 and 2 ranks (same model, same batch per rank), the weak-scaling
efficiency = throughput(2) / (2 x throughput(1)), the *ceiling* (two independent 1-rank runs of the same
framework at once, no communication: what 2 ranks can reach on this box) and each example's efficiency
relative to it. Then a per-step time breakdown on rank 0 of a 2-rank run (data, forward+backward, gradient
all-reduce, optimizer), measured phase by phase. Last, each example's *overhead*: its own training step at one
rank (run unchanged under tools/phases.py) against a bare loop of the same model, optimizer and data
(tools/bare_loop.py), `--pairs` pairs of processes, the two of a pair taking turns every `--part-steps`
steps (the speed drifts over seconds), one ratio per pair; TensorFlow: samples/s of two runs one after the
other per pair (bench_overhead.py).
Every example runs as a program, started through tools.launch.launch_command; no tool imports a lesson.

Epoch 1 of every run is warm-up (graph tracing, allocator, connections) and excluded; a run's throughput is
the median over its remaining epochs. The whole set is repeated `--repeat` times, interleaved (round 1 runs
everything once, then round 2 ...), because this machine's speed drifts by +-10% over minutes: every ratio
is computed within a round, from runs minutes apart, and the report gives the median over rounds and the
range. Results: a table on stdout and runs/bench/latest.json.
The Horovod examples also run at 2 ranks under mpiexec (MPI moves their gradients instead of gloo), and one
all-reduce of the gradients' size is timed alone by each way the examples move them (`allreduce` in the JSON).
    python tools/bench.py          # full: 3 rounds of 4 epochs x 40 steps per run (about 20 minutes)
    python tools/bench.py --quick  # short: 1 round of 3 epochs x 8 steps, 2 overhead pairs (in the tests)
    python tools/bench.py --transformer [--quick]
                                     # the transformer chapter: its lessons at 2 ranks against the ceiling,
                                     # ddp.py's memory-against-time flags (bench_transformer.py; 3 x 20 steps)
    python tools/bench.py --split [--quick]
                                     # the chapter's split lessons (tp, cp, ep, pp and its schedules) at 2 ranks
                                     # against ddp.py at 2 (bench_split.py; 3 x 20 steps)
    python tools/bench.py --only deepspeed --zero-stage 0
                                     # one example, every run of it with flags of its own (not those the
                                     # bench sets: --epochs --max-steps --batch-size --num-threads ...)
    python tools/bench.py --only deepspeed --zero-stage 2 --versus='--zero-stage 0'
                                     # A/B: every round also runs the example with the other flags (the two
                                     # take turns going first); speed-ups and overheads of the two side by side
    python tools/bench.py --overhead deepspeed [--zero-stage 0 | --deepspeed_config FILE ...]
                                     # one example's overhead alone; flags after it go to the example
    python tools/bench.py --phases [--only ddp ...]
                                     # where a PyTorch example's step goes: its own training loop, run
                                     # unchanged under tools/phases.py at 1 and 2 ranks, timed phase by
                                     # phase (forward, backward, waiting for the all-reduce, optimizer); only
                                     # this, written to runs/bench/phases.json
The modules beside this one: bench_runs.py (the runs), bench_cpu.py (CPU by thread), bench_overhead.py,
bench_phases.py, bench_wire.py (breakdown, all-reduce), bench_report.py (arithmetic, report).
"""
import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from tools import bench_overhead, bench_phases, bench_runs, bench_split, bench_transformer, bench_wire
from tools.bench_report import combine, print_table, write_report
from tools.bench_runs import BENCH_SETS, BENCHED, ROOT


def parse_args(argv=None):
    # allow_abbrev=False: an example's flag such as `--s 3` must not be taken for the bench's --steps
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--quick", action="store_true",
                        help="1 round (unless --repeat) of 3 epochs x 8 steps per run (a smoke test)")
    parser.add_argument("--repeat", type=int, help="rounds; medians over them are reported (default 3, --quick 1)")
    parser.add_argument("--epochs", type=int, help="epochs per run; the first is warm-up (default 4; --transformer 3)")
    parser.add_argument("--steps", type=int, help="training steps per epoch (default 40; --transformer 20)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch per rank")
    parser.add_argument("--no-knobs", action="store_true", help="skip the runs with the libraries' defaults")
    parser.add_argument("--versus", metavar="FLAGS",
                        help="with one --only example: every round also runs it with these flags instead of the "
                             "example flags given to the bench, the two taking turns going first (so 4 rounds "
                             "unless --repeat), and the report gives their ratios round by round. Use the = form: "
                             "--versus='--zero-stage 0' (--versus='' for no flags)")
    parser.add_argument("--only", nargs="*", choices=list(BENCHED), help="measure only these examples")
    parser.add_argument("--out", help="the JSON report (default runs/bench/latest.json, with --phases "
                                      "runs/bench/phases.json)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run (per overhead measurement)")
    parser.add_argument("--pairs", type=int, default=6,
                        help="overhead ratios: pairs of processes, the example's and the bare loop's, each a "
                             "warm-up epoch and a measured one")
    parser.add_argument("--part-steps", type=int, default=1,
                        help="the overhead's example and bare loop take turns every this many steps")
    parser.add_argument("--phases", action="store_true",
                        help="only time the PyTorch examples' own steps phase by phase at 1 and 2 ranks "
                             "(tools/phases.py), written to runs/bench/phases.json unless --out")
    parser.add_argument("--transformer", action="store_true",
                        help="only the transformer chapter (tools/bench_transformer.py): its lessons at 2 ranks "
                             "against the ceiling, and ddp.py's memory-against-time flags, written to "
                             "runs/bench/transformer.json unless --out")
    parser.add_argument("--split", action="store_true",
                        help="only the transformer chapter's split lessons (tools/bench_split.py) at 2 ranks "
                             "against ddp.py at 2, written to runs/bench/split.json unless --out")
    parser.add_argument("--overhead", choices=list(BENCHED), help=argparse.SUPPRESS)
    # Flags the bench does not know go to the example, in every run of it (`--only deepspeed --zero-stage 0`): one
    # example at a time, and never the flags the bench sets itself, so that every run stays comparable.
    args, args.example_args = parser.parse_known_args(argv)
    args.only = list(dict.fromkeys(args.only)) if args.only else args.only
    if args.example_args and not args.overhead and len(args.only or ()) != 1:
        parser.error(f"unrecognized arguments: {' '.join(args.example_args)} (flags for an example need exactly "
                     "one --only NAME)")
    args.versus_args = shlex.split(args.versus) if args.versus is not None else None
    if args.versus_args is not None and len(args.only or ()) != 1:
        parser.error("--versus compares two sets of flags of one example: it needs exactly one --only NAME")
    taken = [f for f in args.example_args + (args.versus_args or []) if f.startswith("--")
             and len(f.split("=")[0]) > 2
             and any(name.startswith(f.split("=")[0]) for name in BENCH_SETS)]  # the examples take abbreviations
    if taken:
        parser.error(f"{' '.join(taken)}: the bench sets this flag itself in every run (see --help)")
    if args.phases and (args.versus_args is not None or "horovod-tensorflow" in (args.only or ())):
        parser.error("--phases times the PyTorch examples (TensorFlow runs its step as one graph), without --versus")
    for chapter in ("transformer", "split"):
        if getattr(args, chapter) and (args.only or args.phases or args.versus_args is not None
                                       or args.example_args or args.transformer and args.split):
            parser.error(f"--{chapter} measures the chapter's own runs: without --only, --phases, --versus, "
                         "flags for an example or the other chapter flag")
    args.epochs = args.epochs or (3 if args.transformer or args.split else 4)
    args.steps = args.steps or (20 if args.transformer or args.split else 40)
    args.out = args.out or str(ROOT / "runs" / "bench" / ("phases.json" if args.phases else "transformer.json"
                                                          if args.transformer else "split.json" if args.split
                                                          else "latest.json"))
    if args.repeat is None:  # --versus: an even count, so that each set of flags goes first as often
        args.repeat = 1 if args.quick else 4 if args.versus_args is not None else 3
    if args.repeat < 1 or args.epochs < 2 or args.steps < 1 or args.pairs < 1 or args.part_steps < 1:
        parser.error("--repeat, --steps, --pairs and --part-steps must be at least 1, --epochs at least 2 "
                     "(the first is warm-up)")
    if args.quick:
        args.epochs, args.steps, args.pairs = 3, 8, 2
    args.allreduce_reps = 10 if args.quick else 50
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.overhead:
        ratios = bench_overhead.measure_overhead(args.overhead, args)
        print(f"{args.overhead}: overhead {100 * statistics.median(ratios):+.1f}% (median of {len(ratios)}: "
              + ", ".join(f"{100 * r:+.1f}%" for r in ratios) + ")")
        print(json.dumps({"ratios": ratios}), flush=True)
        return
    names = args.only or list(BENCHED)
    started = time.strftime("%Y-%m-%d %H:%M")
    if args.split:
        print(f"bench --split: {args.repeat} round(s) of {args.epochs} epochs x {args.steps} steps, each split "
              "lesson and ddp.py at 2 ranks, 1 thread per rank", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            rounds = []
            for r in range(args.repeat):
                (Path(tmp) / f"round-{r + 1}").mkdir()
                rounds.append(bench_split.measure_round(args, Path(tmp) / f"round-{r + 1}", r + 1))
        write_report(args, started, bench_split.print_report, rounds=rounds, combined=bench_split.combine(rounds))
        return
    if args.transformer:
        print(f"bench --transformer: {args.repeat} round(s) of {args.epochs} epochs x {args.steps} steps, the "
              "chapter's default model, 1 thread per rank", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            rounds = []
            for r in range(args.repeat):
                (Path(tmp) / f"round-{r + 1}").mkdir()
                rounds.append(bench_transformer.measure_round(args, Path(tmp) / f"round-{r + 1}", r + 1))
        write_report(args, started, bench_transformer.print_report, rounds=rounds,
                     combined=bench_transformer.combine(rounds))
        return
    if args.phases:
        names = [n for n in names if BENCHED[n][1] == "torch"]
        print(f"bench --phases: {', '.join(names)}, {args.repeat} round(s) of {args.epochs} epochs x {args.steps} "
              f"steps, batch {args.batch_size} per rank, 1 thread per rank", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            phases, costs, rounds = bench_phases.run_phases(args, names, tmp)
        write_report(args, started, bench_phases.print_phases, phases=phases, step_costs=costs, rounds=rounds)
        return
    print(f"bench: {len(names)} example(s), {args.repeat} round(s) of {args.epochs} epochs x {args.steps} steps, "
          f"batch {args.batch_size} per rank, 1 thread per rank, on {os.cpu_count()} cores"
          + (f"; {names[0]} with {' '.join(args.example_args) or 'no flags'}"
             if args.example_args or args.versus_args is not None else "")
          + (f", against {' '.join(args.versus_args) or 'no flags'}" if args.versus_args is not None else ""),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        rounds = []
        for r in range(args.repeat):  # each round in its own folder: a run must not find the last one's metrics
            (Path(tmp) / f"round-{r + 1}").mkdir()
            rounds.append(bench_runs.measure_round(names, args, Path(tmp) / f"round-{r + 1}", r + 1))
        print("  breakdown of a 2-rank step ...", flush=True)
        parts = bench_wire.measure_breakdown(args)
        print("  one all-reduce of the gradients: gloo, Horovod (gloo, MPI), MPI ...", flush=True)
        wire = bench_wire.measure_allreduce(args)
    examples = combine(rounds)
    for row in examples:
        print(f"  {row['example']}: its own step against a bare loop's, at 1 rank, taking turns ...", flush=True)
        ratios = bench_overhead.measure_overhead(row["example"], args)
        row.update(overhead=statistics.median(ratios), overhead_range=[min(ratios), max(ratios)],
                   overhead_pairs=ratios)
        if args.versus_args is not None:
            ratios = bench_overhead.measure_overhead(row["example"], args, args.versus_args)
            row.update(overhead_versus=statistics.median(ratios), overhead_versus_range=[min(ratios), max(ratios)],
                       overhead_versus_pairs=ratios)
    write_report(args, started, print_table, versus_args=args.versus_args, breakdown=parts, allreduce=wire,
                 examples=examples, rounds=rounds)


if __name__ == "__main__":
    main()
