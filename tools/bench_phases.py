"""`bench.py --phases`: the PyTorch examples' own steps at 1 and 2 ranks, phase by phase. Each example runs
unchanged under tools/phases.py (the wrapper in front of it in every rank, through launch_command), which
times the calls a step is made of from outside.

The breakdown (bench_wire.py) runs its phases one after another; in the examples communication overlaps backward
(and takes CPU from it), so where a 2-rank step loses its time shows only in their own loops, timed as they run.
"""
import json
import statistics
from pathlib import Path

from tools import bench_runs

PHASES = Path(__file__).resolve().parent / "phases.py"
PHASE_NAMES = ("step", "forward", "backward", "wait", "optimizer", "other")


def phase_means(records, first_epoch=2):
    """{phase: mean ms per step} over the steps of the epochs after the warm-up (the means add up to the step)."""
    steady = [r for r in records if r["epoch"] >= first_epoch]
    if not steady:
        raise SystemExit("bench: no steps after the warm-up epoch were timed")
    return {k: 1000 * sum(r[k] for r in steady) / len(steady) for k in PHASE_NAMES}


def measure_phases(name, args, work):
    """{"1": phase means on rank 0 at 1 rank, "2": the same at 2 ranks[, "2_mpiexec": under mpiexec (Horovod)]},
    each with "wait_by_rank": every rank's mean wait (rank 0's includes waiting for a slower rank 1, and so on)"""
    means = {}
    runs = [("1", 1, "python"), ("2", 2, bench_runs.BENCHED[name][0])]
    if name in bench_runs.MPIEXEC_RUNS:
        runs.append(("2_mpiexec", 2, "mpiexec"))
    for ranks, nproc, launcher in runs:
        out = work / f"{name}-phases-{ranks}"
        cmd = bench_runs.command(name, nproc, launcher, [*bench_runs.example_flags(args, out), *args.example_args],
                                 wrapper=PHASES)
        bench_runs.wait(*bench_runs.launch(cmd, args.timeout, {"PHASES_OUT": str(out)}),
                        f"{name} phases, {ranks} rank(s)")
        by_rank = [phase_means(json.loads(Path(f"{out}-rank{r}.json").read_text())["records"]) for r in range(nproc)]
        means[ranks] = dict(by_rank[0], wait_by_rank=[m["wait"] for m in by_rank])
    return means


def run_phases(args, names, tmp):
    rounds = []
    for r in range(args.repeat):
        work = Path(tmp) / f"phases-{r + 1}"
        work.mkdir()
        print(f"  round {r + 1}: " + ", ".join(names) + " at 1 and 2 ranks, phase by phase ...", flush=True)
        rounds.append({name: measure_phases(name, args, work) for name in names})
    medians = {name: {ranks: {k: statistics.median(rnd[name][ranks][k] for rnd in rounds) for k in PHASE_NAMES}
                      for ranks in rounds[0][name]} for name in names}
    for name in names:
        for ranks, m in medians[name].items():
            m["wait_by_rank"] = [statistics.median(rnd[name][ranks]["wait_by_rank"][r] for rnd in rounds)
                                 for r in range(int(ranks[0]))]
    return medians, step_costs(rounds), rounds


def step_costs(rounds):
    """Per example and 2-rank run: what the 2-rank step costs more than the 1-rank step (ms), and the efficiency
    from step times (1-rank step / 2-rank step), each taken within a round: medians over rounds and ranges."""
    costs = {}
    for name, by_ranks in rounds[0].items():
        for ranks in by_ranks:
            if ranks == "1":
                continue
            extra = [rnd[name][ranks]["step"] - rnd[name]["1"]["step"] for rnd in rounds]
            ratio = [rnd[name]["1"]["step"] / rnd[name][ranks]["step"] for rnd in rounds]
            costs.setdefault(name, {})[ranks] = dict(
                extra_ms=statistics.median(extra), extra_ms_range=[min(extra), max(extra)],
                step_efficiency=statistics.median(ratio), step_efficiency_range=[min(ratio), max(ratio)])
    return costs


def print_phases(report):
    print(f"\nrank 0's step by phase, ms (mean over the steps of a run, median over {report['repeat']} round(s)):"
          " 1 rank -> 2 ranks (difference)")
    for name, by_ranks in report["phases"].items():
        one = by_ranks["1"]
        for ranks, label in (("2", name), ("2_mpiexec", "(mpiexec)")):
            if ranks in by_ranks:
                two = by_ranks[ranks]
                print(f"  {label:>16}: " + ", ".join(f"{k} {one[k]:.1f} -> {two[k]:.1f} ({two[k] - one[k]:+.1f})"
                                                     for k in PHASE_NAMES))
                c = report["step_costs"][name][ranks]
                (lo, hi), (elo, ehi) = c["extra_ms_range"], c["step_efficiency_range"]
                if any(two["wait_by_rank"]):
                    print(f"  {'':>16}  wait by rank: " + " / ".join(f"{w:.1f}" for w in two["wait_by_rank"]) + " ms")
                print(f"  {'':>16}  within rounds: the 2-rank step {c['extra_ms']:+.1f} ms ({lo:+.1f}..{hi:+.1f}), "
                      f"1-rank step / 2-rank step {c['step_efficiency']:.2f} ({elo:.2f}-{ehi:.2f}; the efficiency)")


