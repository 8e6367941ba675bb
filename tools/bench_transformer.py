"""The transformer chapter in the bench (`python tools/bench.py --transformer`, also the end of `make bench`).

Each round, on the chapter's default model (transformer/model.py) with one thread per rank:
- the *ceiling*: two independent 1-process runs of ddp.py at once (the same per-rank work, no communication);
- ddp.py and fsdp.py at 2 ranks under torchrun: tokens/s per rank, and that over the ceiling's tokens/s per
  process (the target: at least 0.85), MFU and rank 0's peak memory; where FSDP2's time goes: fsdp.py at 2 ranks
  with --replicate 2 (two whole copies: FSDP2's machinery and a gradient all-reduce, no gathers), and fsdp.py
  alone at 1 process over ddp.py alone (the machinery, no communication);
- ddp.py at 1 process, plain and with each of --activation-checkpointing, --bf16, --compile: tokens/s and
  the step time after the warm-up, the first step (--compile: compiling), the peak memory (summary.json) and
  MFU, and each knob's step time and peak memory over the plain run's of the same round.
Epoch 1 is warm-up (and --compile's compiling): tokens/s is the median over the later epochs. Every ratio
is computed within a round; the report gives the median over rounds and the range. Results: a table on
stdout and runs/bench/transformer.json.
"""
import json
import statistics

from tools.bench_report import steady_throughput
from tools.bench_runs import command, history, launch, wait

LESSONS = {"transformer-ddp": [], "transformer-fsdp": [], "transformer-fsdp --replicate 2": ["--replicate", "2"]}
KNOBS = {"plain": [], "activation checkpointing": ["--activation-checkpointing"], "bf16 autocast": ["--bf16"],
         "compile": ["--compile"]}


def flags(args, log_dir, extra=()):
    return ["--epochs", str(args.epochs), "--max-steps", str(args.steps), "--num-threads", "1",
            "--log-interval", "1000", "--log-dir", str(log_dir), *extra]


def summary(log_dir):
    return json.loads((log_dir / "summary.json").read_text())


def measure_round(args, work, round_no):
    """One round: {"ceiling": tokens/s per process, "lessons": {...}, "knobs": {...}}."""
    print(f"  round {round_no}: the ceiling (two independent 1-process runs of ddp.py at once) ...", flush=True)
    procs = [launch(command("transformer-ddp", 1, "python", flags(args, work / f"alone-{i}")), args.timeout)
             for i in range(2)]
    for i, proc in enumerate(procs):
        wait(*proc, f"transformer-ddp alone ({i + 1} of 2)")
    ceiling = statistics.mean(steady_throughput(history(work / f"alone-{i}")) for i in range(2))
    result = {"ceiling": ceiling, "lessons": {}, "knobs": {}}
    for name, extra in LESSONS.items():
        print(f"  round {round_no}: {name} at 2 ranks ...", flush=True)
        log_dir, example = work / f"{name.replace(' ', '')}-2", name.split()[0]
        wait(*launch(command(example, 2, "torchrun", flags(args, log_dir, extra)), args.timeout), f"{name} 2 ranks")
        per_rank = steady_throughput(history(log_dir)) / 2
        s = summary(log_dir)
        result["lessons"][name] = {"tokens_per_s_per_rank": per_rank, "of_ceiling": per_rank / ceiling,
                                   "mfu": per_rank * s["flops_per_token"] / s["matmul_peak"],
                                   "peak_memory_bytes": s["peak_memory_bytes"]}
    print(f"  round {round_no}: transformer-fsdp at 1 process ...", flush=True)
    wait(*launch(command("transformer-fsdp", 1, "python", flags(args, work / "fsdp-1")), args.timeout), "fsdp 1")
    fsdp_alone = steady_throughput(history(work / "fsdp-1"))
    for knob, extra in KNOBS.items():
        print(f"  round {round_no}: transformer-ddp at 1 process, {knob} ...", flush=True)
        log_dir = work / f"knob-{knob.replace(' ', '-')}"
        wait(*launch(command("transformer-ddp", 1, "python", flags(args, log_dir, extra)), args.timeout * 2),
             f"transformer-ddp {knob}")
        s, tokens = summary(log_dir), steady_throughput(history(log_dir))
        config = json.loads((log_dir / "config.json").read_text())
        result["knobs"][knob] = {"tokens_per_s": tokens, "first_step_s": s["first_step_s"],
                                 "step_s": config["batch_size"] * config["context"] / tokens,  # after warm-up
                                 "peak_memory_bytes": s["peak_memory_bytes"],
                                 "mfu": tokens * s["flops_per_token"] / s["matmul_peak"]}
    plain = result["knobs"]["plain"]
    result["fsdp_alone_vs_ddp_alone"] = fsdp_alone / plain["tokens_per_s"]  # both alone, 1 process, 1 thread
    for row in result["knobs"].values():
        row["step_vs_plain"] = row["step_s"] / plain["step_s"]
        row["memory_vs_plain"] = row["peak_memory_bytes"] / plain["peak_memory_bytes"]
    return result


def combine(rounds):
    """Every number's median over the rounds, and its range."""
    def merge(rows):
        return {key: (statistics.median(r[key] for r in rows), [min(r[key] for r in rows), max(r[key] for r in rows)])
                for key in rows[0]}
    return {"ceiling": merge([{"v": r["ceiling"]} for r in rounds])["v"],
            "fsdp_alone_vs_ddp_alone": merge([{"v": r["fsdp_alone_vs_ddp_alone"]} for r in rounds])["v"],
            "lessons": {name: merge([r["lessons"][name] for r in rounds]) for name in rounds[0]["lessons"]},
            "knobs": {knob: merge([r["knobs"][knob] for r in rounds]) for knob in rounds[0]["knobs"]}}


def span(pair, fmt):
    value, (low, high) = pair
    return format(value, fmt) + (f" ({format(low, fmt)}-{format(high, fmt)})" if high != low else "")


def print_report(report):
    c = report["combined"]
    print(f"\ntransformer chapter, {report['repeat']} round(s) of {report['epochs']} epochs x {report['steps']} "
          f"steps (the first epoch warm-up), 1 thread per rank, {report['date']}; median (range) over rounds")
    print(f"ceiling: {span(c['ceiling'], ',.0f')} tokens/s per process (two ddp.py at once)")
    print(f"{'lesson at 2 ranks':<31} {'tokens/s per rank':>22} {'of the ceiling':>20} {'MFU':>20} {'peak MiB':>9}")
    for name, row in c["lessons"].items():
        print(f"{name:<31} {span(row['tokens_per_s_per_rank'], ',.0f'):>22} {span(row['of_ceiling'], '.2f'):>20} "
              f"{span(row['mfu'], '.1%'):>20} {row['peak_memory_bytes'][0] / 2**20:>9,.0f}")
    print(f"fsdp.py alone over ddp.py alone (1 process each, no communication): "
          f"{span(c['fsdp_alone_vs_ddp_alone'], '.2f')}")
    print(f"\n{'ddp.py, 1 process':<26} {'tokens/s':>8} {'first step s':>12} {'step ms':>8} {'x plain':>7} "
          f"{'peak MiB':>9} {'x plain':>7} {'MFU':>6}")
    for knob, row in c["knobs"].items():
        print(f"{knob:<26} {row['tokens_per_s'][0]:>8,.0f} {row['first_step_s'][0]:>12.2f} "
              f"{row['step_s'][0] * 1e3:>8.0f} {row['step_vs_plain'][0]:>7.2f} "
              f"{row['peak_memory_bytes'][0] / 2**20:>9,.0f} {row['memory_vs_plain'][0]:>7.2f} {row['mfu'][0]:>6.1%}")
