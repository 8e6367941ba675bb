#!/usr/bin/env python
"""make bench: what the network between two nodes does to DDP, measured against the link's known rate.

Two "nodes" on this machine (tools/nodes.py: network namespaces joined by a link that tc holds to a rate), one
rank each, gloo over the link. For an unshaped link and each --rates:
- diagnose/collectives.py's ring fit to all_reduce: beta against the shaped rate, alpha (the stack's own cost per
  message hop) from the unshaped link, where the rate does not hide it;
- DDP/main.py's training throughput at 2 nodes x 1 rank, and its weak-scaling efficiency against one rank alone
  (throughput(2) / (2 x throughput(1)), the same batch per rank);
- diagnose/overlap.py's ways to communicate one DDP step at 2 nodes (--overlap-variants), each one's
  efficiency against the two-process ceiling (no communication): where compression starts to pay;
- beside DDP's throughput, the alpha-beta model's two bounds: the all-reduce of DDP's gradient buckets takes
  t = 2(N-1)·alpha + 2(N-1)/N · S/rate per bucket; with no overlap a step at 2 nodes takes one rank's step
  plus t (efficiency step(1) / (step(1) + t)); hidden entirely behind the step (DDP starts each bucket's
  all-reduce during backward), it takes the longer of the two (step(1) / max(step(1), t)).

    python tools/bench_network.py                 # unshaped, 1gbit, 500mbit, 200mbit (about 8 minutes)
    python tools/bench_network.py --rates 100mbit 10gbit --quick

Results: a table on stdout and runs/bench/network.json. A run's throughput is the median over its epochs after
the first (warm-up). Needs network namespaces: as root, or as anyone where the kernel gives a user namespace (it
runs itself again in one: tools/nodes.py as_root_of_a_user_namespace). Nothing is sent anywhere but between the
namespaces made.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from tools import launch, nodes
from tools.bench_report import steady_throughput

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def bytes_per_s(rate):
    """'500mbit' -> 62.5e6 (tc's units: 1000-based bits per second)."""
    for unit, scale in UNITS.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise argparse.ArgumentTypeError(f"{rate}: a rate as tc writes it (200mbit, 1gbit)")


def run_on_nodes(names, script, args, timeout):
    """One torchrun per node, in its namespace; both must end with exit 0."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in launch.nodes_over_a_network(script, names, 1, args)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"error: bench_network: {script} across the nodes ran past {timeout} s")
    if any(p.returncode for p in procs):
        raise SystemExit(f"error: bench_network: {script} across the nodes failed:\n{outs[0][-2000:]}")
    return outs


def throughput(log_dir):
    """Median samples/s over the epochs after the first (bench_report's rule)."""
    return steady_throughput([json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()])


def measure(rate, ddp_flags, sizes, variants, tmp, timeout):
    """One link: the ring fit, DDP's throughput at 2 nodes x 1 rank, and overlap.py's variants."""
    with nodes.nodes(2, rate) as names:
        run_on_nodes(names, "diagnose/collectives.py", ["--ops", "all_reduce", *sizes, "--repeats", "3",
                                                        "--out", tmp / "fit"], timeout)
        run_on_nodes(names, "DDP/main.py", [*ddp_flags, "--log-dir", tmp / "ddp"], timeout)
        if variants:
            run_on_nodes(names, "diagnose/overlap.py", ["--variants", "none", *variants, "--rounds", "3",
                                                        "--json", tmp / "overlap.json"], timeout)
    fit = json.loads((tmp / "fit" / "collectives.json").read_text())["fit"]
    rows = json.loads((tmp / "overlap.json").read_text())["rows"] if variants else []
    return dict(rate=rate, rate_Bps=bytes_per_s(rate) if rate else None, alpha_s=fit["alpha_s"],
                beta_Bps=fit["beta_Bps"], buckets=fit["ddp_buckets"], samples_per_s=throughput(tmp / "ddp"),
                overlap={row["variant"]: row["efficiency"] for row in rows if row["variant"] != "none"})


def ring_time(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "500mbit", "200mbit"], type=str,
                        help="each link's sending rate, as tc writes it")
    parser.add_argument("--quick", action="store_true", help="3 epochs x 10 steps per DDP run (else 4 x 30)")
    parser.add_argument("--overlap-variants", nargs="*", default=["ddp", "ddp-cap1", "ddp-fp16", "ddp-powersgd"],
                        help="diagnose/overlap.py's variants to time on each link (none: skip it)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "network.json"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = parser.parse_args()
    for rate in args.rates:
        try:
            bytes_per_s(rate)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    nodes.as_root_of_a_user_namespace(sys.argv)  # (root goes on; anyone else, again in a user namespace)
    epochs, steps = (3, 10) if args.quick else (4, 30)
    ddp_flags = ["--epochs", str(epochs), "--max-steps", str(steps), "--batch-size", "64", "--num-threads", "1"]
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"bench network: 2 nodes x 1 rank, links unshaped and at {', '.join(args.rates)}; DDP {epochs} epochs x "
          f"{steps} steps, batch 64 per rank, 1 thread per rank", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-network-") as tmp:
        tmp = Path(tmp)
        one = subprocess.run(launch.launch_command("DDP/main.py", 1, "python", [*ddp_flags, "--log-dir",
                                                                                 tmp / "one"]),
                             cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        if one.returncode:
            raise SystemExit(f"error: bench_network: DDP at one rank failed:\n{one.stderr[-2000:]}")
        single = throughput(tmp / "one")
        links = []
        for i, rate in enumerate([None, *args.rates]):
            print(f"  link {rate or 'unshaped'} ...", flush=True)
            (tmp / str(i)).mkdir()
            sizes = ["--min-size", "1K", "--max-size", "4M"] if rate is None else ["--min-size", "1M", "--max-size",
                                                                                     "4M"]
            links.append(measure(rate, ddp_flags, sizes, args.overlap_variants, tmp / str(i), args.timeout))
    alpha = links[0]["alpha_s"]  # the stack's own cost, from the unshaped link
    step_one = 64 / single
    for link in links:
        link["efficiency"] = link["samples_per_s"] / (2 * single)
        beta = link["rate_Bps"] or link["beta_Bps"]  # unshaped: the fitted beta is the link
        comm = sum(ring_time(b, 2, alpha, beta) for b in link["buckets"])
        link.update(comm_s=comm, predicted_efficiency=step_one / (step_one + comm),
                    predicted_hidden=step_one / max(step_one, comm))
    print(f"\none rank alone: {single:.0f} samples/s ({1e3 * step_one:.1f} ms a step of 64)")
    print(f"{'link':>10}{'beta fit MB/s':>15}{'rate MB/s':>11}{'all-reduce ms':>15}{'DDP samples/s':>15}"
          f"{'efficiency':>12}{'predicted: no overlap':>23}{'hidden':>8}")
    for link in links:
        rate = f"{link['rate_Bps'] / 1e6:.1f}" if link["rate_Bps"] else "-"
        print(f"{link['rate'] or 'unshaped':>10}{link['beta_Bps'] / 1e6:>15.1f}{rate:>11}{1e3 * link['comm_s']:>15.1f}"
              f"{link['samples_per_s']:>15.0f}{link['efficiency']:>12.2f}{link['predicted_efficiency']:>23.2f}"
              f"{link['predicted_hidden']:>8.2f}")
    print(f"alpha (unshaped link) {1e6 * alpha:.0f} us per message hop; DDP's buckets "
          + " + ".join(f"{b / 1e6:.2f}" for b in links[0]["buckets"]) + " MB")
    if args.overlap_variants:
        print("\ndiagnose/overlap.py at 2 nodes, batch 32 per rank: each variant's efficiency (the ceiling's step / "
              "its step)")
        print(f"{'link':>10}" + "".join(f"{v:>14}" for v in args.overlap_variants))
        for link in links:
            print(f"{link['rate'] or 'unshaped':>10}" + "".join(f"{link['overlap'].get(v, float('nan')):>14.2f}"
                                                                for v in args.overlap_variants))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(started=started, machine=os.uname().nodename, cores=os.cpu_count(),
                                              single_samples_per_s=single, links=links, ddp_flags=ddp_flags),
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
