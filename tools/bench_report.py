"""The bench's arithmetic (unit-tested in tests/test_bench.py) and its report: the JSON file and the printout."""
import json
import os
import statistics
from pathlib import Path


def efficiency(samples_per_s_1, samples_per_s_2):
    """Weak-scaling efficiency at 2 ranks: the 2-rank throughput over twice the 1-rank throughput."""
    return samples_per_s_2 / (2 * samples_per_s_1)


def ceiling_efficiency(samples_per_s_1, independent_pair):
    """What 2 ranks could reach here: two independent runs at once, summed, over twice one alone."""
    return sum(independent_pair) / (2 * samples_per_s_1)


def steady_throughput(history):
    """Median samples/s over the epochs after the first (warm-up) one."""
    rates = [m["samples_per_s"] for m in history[1:]] or [history[-1]["samples_per_s"]]
    return statistics.median(rates)


def step_ratios(example_records, bare_records, first_epoch=2):
    """The overhead, epoch by epoch after the warm-up: the example's mean step time over the bare loop's in the
    same epoch (the two took turns step by step through it), minus 1. Records: phases.py's, one per step."""
    ratios = []
    epochs = sorted({r["epoch"] for r in example_records if r["epoch"] >= first_epoch})
    for epoch in epochs:
        mine = [r["step"] for r in example_records if r["epoch"] == epoch]
        bare = [r["step"] for r in bare_records if r["epoch"] == epoch]
        if not bare:
            raise SystemExit(f"bench: the bare loop timed no step in epoch {epoch}")
        ratios.append((sum(mine) / len(mine)) / (sum(bare) / len(bare)) - 1)
    if not ratios:
        raise SystemExit("bench: the example timed no step after the warm-up epoch")
    return ratios


def combine(rounds):
    """Median over rounds of every number (each ratio was computed within its round), and its range."""
    out = []
    for i, first in enumerate(rounds[0]["examples"]):
        per_round = [r["examples"][i] for r in rounds]
        row = {"example": first["example"]}
        for key in first:
            if key != "example" and all(key in r for r in per_round):
                values = [r[key] for r in per_round]
                row[key] = statistics.median(values)
                row[key + "_range"] = [min(values), max(values)]
        out.append(row)
    return out


def knob_settings():
    """The performance settings in effect for this benchmark (the examples' defaults, or the environment's)."""
    from course.dist import HOROVOD_CPU_KNOBS
    return {k: os.environ.get(k, v) for k, v in HOROVOD_CPU_KNOBS.items()}


def write_report(args, started, print_report, **results):
    """The run's settings and `results` as JSON to --out, then printed by `print_report`."""
    report = dict(date=started, cpu_count=os.cpu_count(), repeat=args.repeat, epochs=args.epochs,
                  steps=args.steps, batch_size=args.batch_size, example_args=args.example_args,
                  knobs=knob_settings(), **results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nwritten to {args.out}")


def pct(value, low, high):
    return f"{100 * value:+.1f}% ({100 * low:+.1f}..{100 * high:+.1f})"


def print_table(report):
    header = ("example", "1 rank/s", "2 ranks/s", "efficiency", "ceiling", "eff/ceiling", "overhead")
    lines = [header]
    for r in report["examples"]:
        lo, hi = r["efficiency_range"]
        lines.append((r["example"], f"{r['samples_per_s_1']:.0f}", f"{r['samples_per_s_2']:.0f}",
                      f"{r['efficiency']:.2f} ({lo:.2f}-{hi:.2f})", f"{r['ceiling_efficiency']:.2f}",
                      f"{r['relative_to_ceiling']:.2f}", pct(r["overhead"], *r["overhead_range"])))
    print(f"\nmedians over {report['repeat']} round(s), range over rounds in brackets"
          + (f"; the example ran with {' '.join(report['example_args'])}" if report.get("example_args") else ""))
    for line in lines:
        print("  ".join(f"{c:>{19 if i in (0, 3, 6) else 10}}" for i, c in enumerate(line)))
    print("(overhead: the example's own step at 1 rank against the bare loop's, tools/bare_loop.py, in pairs "
          "of processes taking turns step by step; TensorFlow: samples/s, runs one after the other)")
    knobs = [r for r in report["examples"] if "knob_speedup" in r]
    if knobs:
        print(f"\nthe examples' CPU knobs {report['knobs']} against the libraries' defaults, 2 ranks:")
        for r in knobs:
            lo, hi = r["knob_speedup_range"]
            print(f"  {r['example']:>19}: {r['samples_per_s_2']:.0f} vs {r['samples_per_s_2_library_defaults']:.0f} "
                  f"samples/s, x{r['knob_speedup']:.2f} ({lo:.2f}-{hi:.2f})")
    for r in report["examples"]:
        if "versus_speedup_2" in r:
            print_versus(report, r)
    launchers = [r for r in report["examples"] if "efficiency_mpiexec" in r]
    if launchers:
        print("\nthe Horovod examples at 2 ranks by launcher: horovodrun --gloo (gloo over loopback TCP) "
              "vs mpiexec (MPI, shared memory):")
        for r in launchers:
            lo, hi = r["efficiency_mpiexec_range"]
            print(f"  {r['example']:>19}: efficiency {r['efficiency']:.2f} vs {r['efficiency_mpiexec']:.2f} "
                  f"({lo:.2f}-{hi:.2f}); {r['samples_per_s_2']:.0f} vs {r['samples_per_s_2_mpiexec']:.0f} samples/s")
    print_cores(report)
    wire = report["allreduce"]
    print(f"\none all-reduce of the CNN's gradients ({next(iter(wire.values()))['bytes'] / 1e6:.1f} MB float32) "
          "between 2 ranks, median:")
    for name, timing in wire.items():
        print(f"  {name:>35}: {timing['ms']:.2f} ms")
    b = report["breakdown"]
    print(f"\n2-rank step on rank 0, phases run one after another (no overlap): {b['step_ms']:.1f} ms = " +
          ", ".join(f"{k} {v:.1f} ms ({100 * b['fraction'][k]:.0f}%)" for k, v in b["ms_per_step"].items()))


def print_versus(report, r):
    mine, other = " ".join(report["example_args"]) or "no flags", " ".join(report["versus_args"]) or "no flags"
    print(f"\n{r['example']} with {mine} against {other} (the second's numbers after 'vs'; ratios taken "
          "within each round):")
    for n, what in (("1", "1 rank"), ("2", "2 ranks")):
        lo, hi = r[f"versus_speedup_{n}_range"]
        print(f"  {what:>19}: {r[f'samples_per_s_{n}']:.0f} vs {r[f'samples_per_s_{n}_versus']:.0f} "
              f"samples/s, x{r[f'versus_speedup_{n}']:.2f} ({lo:.2f}-{hi:.2f})")
    (lo, hi), (vlo, vhi) = r["relative_to_ceiling_range"], r["relative_to_ceiling_versus_range"]
    print(f"  {'2 ranks / ceiling':>19}: {r['relative_to_ceiling']:.2f} ({lo:.2f}-{hi:.2f}) vs "
          f"{r['relative_to_ceiling_versus']:.2f} ({vlo:.2f}-{vhi:.2f})")
    print(f"  {'overhead':>19}: {pct(r['overhead'], *r['overhead_range'])} vs "
          f"{pct(r['overhead_versus'], *r['overhead_versus_range'])} (measured one after the other, after the rounds)")


def print_cores(report):
    cores = [r for r in report["examples"] if "cores_total_2" in r]
    if not cores:
        return
    print("\nwhere the cores go: CPU seconds per second of training per rank, by thread (main / TensorFlow's "
          "op pool / all others: Horovod, gloo, MPI, tf.data), 1 rank -> 2 ranks:")
    for r in cores:
        print(f"  {r['example']:>19}: " + ", ".join(
            f"{part} {r.get(f'cores_{part}_1', float('nan')):.2f} -> {r[f'cores_{part}_2']:.2f}"
            for part in ("main", "tf_pool", "other", "total")))
        if "cores_total_2_mpiexec" in r:
            print(f"  {'(mpiexec)':>19}: " + ", ".join(f"{part} {r[f'cores_{part}_2_mpiexec']:.2f} at 2 ranks"
                                                      for part in ("main", "tf_pool", "other", "total")))
