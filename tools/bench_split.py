"""The transformer chapter's split lessons in the bench (`python tools/bench.py --split`).

Each round, on one model for every row (transformer/model.py, 4 blocks, the rest the chapter's defaults: width
128, 4 heads, context 128) and one global batch of 16 sequences, every run at 2 ranks under torchrun, one thread
per rank:
- ddp.py (8 sequences a rank): the baseline each split is measured against;
- tp.py, cp.py (the same 16 sequences on both ranks), ep.py (8 a rank; its blocks' MLPs are a mixture of 4
  experts, top-2: more work per token than the dense MLP) and pp.py with each schedule (16 sequences in 4
  micro-batches).
Per row: tokens/s per rank (the global batch's tokens over the ranks; the median over the epochs after the
first) and that over DDP's in the same round, the bytes a rank handed to collectives and sends in one step
(the lesson's own measurement; DDP: its gradient all-reduce, the parameters' bytes), rank 0's peak memory, and
for the pipeline the measured idle share of a step per rank against the bubble's formula. Every ratio within a
round; the report: the median over rounds and the range. Results: a table on stdout and runs/bench/split.json.
"""
import json
import statistics

from tools.bench_report import steady_throughput
from tools.bench_runs import command, history, launch, wait
from tools.bench_transformer import span

MODEL = ["--layers", "4"]
RUNS = {"ddp": ("transformer-ddp", ["--batch-size", "8"]),
        "tp": ("transformer-tp", ["--batch-size", "16"]),
        "cp": ("transformer-cp", ["--batch-size", "16"]),
        "ep (MoE, 4 experts, top-2)": ("transformer-ep", ["--batch-size", "8"]),
        **{f"pp {schedule}": ("transformer-pp", ["--batch-size", "16", "--schedule", schedule])
           for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")}}


def flags(args, log_dir, extra=()):
    return [*MODEL, "--epochs", str(args.epochs), "--max-steps", str(args.steps), "--num-threads", "1",
            "--log-interval", "1000", "--log-dir", str(log_dir), *extra]


def wire_bytes(s):
    """What a rank handed to collectives and sent in a step: the lesson's measurement (DDP: its parameters)."""
    if "wire_per_step" not in s:
        return 4 * s["parameters"]
    return sum(v["bytes"] for v in s["wire_per_step"].values())


def measure_round(args, work, round_no):
    result = {}
    for name, (example, extra) in RUNS.items():
        print(f"  round {round_no}: {name} at 2 ranks ...", flush=True)
        log_dir = work / name.split(" (")[0].replace(" ", "-")
        wait(*launch(command(example, 2, "torchrun", flags(args, log_dir, extra)), args.timeout), name)
        s = json.loads((log_dir / "summary.json").read_text())
        row = {"tokens_per_s_per_rank": steady_throughput(history(log_dir)) / 2, "wire_bytes": wire_bytes(s),
               "peak_memory_bytes": s["peak_memory_bytes"]}
        if "idle_fraction" in s:
            row.update(idle=max(s["idle_fraction"]), idle_theory=s["idle_fraction_theory"])
        result[name] = row
    for row in result.values():
        row["vs_ddp"] = row["tokens_per_s_per_rank"] / result["ddp"]["tokens_per_s_per_rank"]
    return result


def combine(rounds):
    """Every number's median over the rounds, and its range."""
    return {name: {key: (statistics.median(r[name][key] for r in rounds),
                         [min(r[name][key] for r in rounds), max(r[name][key] for r in rounds)])
                   for key in rounds[0][name]} for name in rounds[0]}


def print_report(report):
    c = report["combined"]
    print(f"\nsplit lessons at 2 ranks, {report['repeat']} round(s) of {report['epochs']} epochs x {report['steps']} "
          f"steps (the first epoch warm-up), 4 blocks, 16 sequences a step, 1 thread per rank, {report['date']}; "
          "median (range) over rounds")
    print(f"{'lesson':<28} {'tokens/s per rank':>20} {'x DDP':>18} {'MiB sent a step':>16} {'peak MiB':>9} "
          f"{'idle (bubble)':>14}")
    for name, row in c.items():
        idle = f"{row['idle'][0]:.0%} ({row['idle_theory'][0]:.0%})" if "idle" in row else ""
        print(f"{name:<28} {span(row['tokens_per_s_per_rank'], ',.0f'):>20} {span(row['vs_ddp'], '.2f'):>18} "
              f"{row['wire_bytes'][0] / 2**20:>16.2f} {row['peak_memory_bytes'][0] / 2**20:>9,.0f} {idle:>14}")
