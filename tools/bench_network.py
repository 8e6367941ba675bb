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
- for each --sharded-rates, the chapter's GPT split and sharded across the link: transformer/fsdp.py at 2 nodes x
  2 ranks as FSDP2 (one shard group of 4, across the link) and as HSDP (--replicate 2: a shard group per node),
  transformer/tp.py's 2 ranks inside one node and one on each node. The bytes that cross the link per step
  (both nodes' eth0, two runs differenced), beside the formula for the sharded layouts, and tokens/s.

    python tools/bench_network.py                 # unshaped, 1gbit, 500mbit, 200mbit; sharded at 1gbit, 200mbit
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


def run_on_nodes(names, script, args, timeout, per_node=1):
    """One torchrun per node, in its namespace, `per_node` ranks each; all must end with exit 0."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in launch.nodes_over_a_network(script, names, per_node, args)]
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


def across_the_link(names, script, flags, steps, tmp, timeout, per_node):
    """`script` on these nodes, `per_node` ranks each, twice (into `tmp`, the layout's own folder), the runs
    differing only in their steps per epoch: (the bytes that cross the link per step, the two runs' sent into it
    differenced so that start-up, evaluation and checkpoints cancel; tokens/s, the longer run's last epoch)."""
    sent = []
    for n in steps:
        log_dir = tmp / f"steps{n}"
        before = nodes.link_bytes(names)
        run_on_nodes(names, script, [*flags, "--max-steps", str(n), "--log-dir", log_dir], timeout, per_node)
        sent.append(nodes.link_bytes(names) - before)
    history = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    # (a layout that sends nothing across: the two runs' few stray packets, such as IPv6's, differ by a few bytes
    # either way; never below none)
    return dict(bytes_per_step=max(0.0, (sent[1] - sent[0]) / (len(history) * (steps[1] - steps[0]))),
                tokens_per_s=history[-1]["samples_per_s"])


def split_and_sharded(rate, tmp, timeout):
    """One link: transformer/fsdp.py at 2 nodes x 2 ranks, FSDP2 (one shard group of 4, across the link) against
    HSDP (--replicate 2: a shard group per node, the copies across the link); transformer/tp.py's 2 ranks inside
    one node against one on each node."""
    with nodes.nodes(2, rate) as names:
        rows = {layout: across_the_link(names, script, [*GPT_FLAGS, *extra], SHARDED_STEPS, tmp / f"layout{i}",
                                        timeout, per_node)
                for i, (layout, script, extra, per_node, names) in enumerate((
                    ("FSDP2 4 shards", "transformer/fsdp.py", [], 2, names),
                    ("HSDP 2 x 2", "transformer/fsdp.py", ["--replicate", "2"], 2, names),
                    ("TP 2 in a node", "transformer/tp.py", [], 2, names[:1]),
                    ("TP 2 across", "transformer/tp.py", [], 1, names)))}
    return dict(rate=rate, rate_Bps=bytes_per_s(rate), layouts=rows)


# The GPT that transformer/fsdp.py shards across the link: 3.2 M parameters (12.8 MB in fp32), a step small beside it
GPT_FLAGS = ["--layers", "4", "--width", "256", "--heads", "4", "--context", "64", "--batch-size", "8",
             "--epochs", "1", "--num-threads", "1", "--no-lr-scaling"]
SHARDED_STEPS = (2, 6)  # the two runs' steps per epoch, differenced


def gpt_parameters(flags):
    """(every parameter, the blocks' ones) of the chapter's GPT with these flags, counted on the meta device."""
    import torch

    from transformer.model import GPT, Config
    value = {flags[i].lstrip("-"): int(flags[i + 1]) for i in range(0, len(flags) - 1) if flags[i + 1].isdigit()}
    with torch.device("meta"):
        model = GPT(Config(**{k: value[k] for k in ("layers", "width", "heads", "context")}))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.blocks.parameters())


def sharded_formula(parameters, block_parameters):
    """Bytes across the link per step, fp32, each collective a ring (ranks 0-1 on node 0, 2-3 on node 1). FSDP2
    over 4 ranks crosses the link at 2 of the ring's 4 hops, each carrying 3/4 of what is all-gathered: the
    forward's every parameter, the backward's the blocks' again (the root keeps its own unsharded), so 1.5 x
    both; the gradients' reduce-scatter, which gloo moves as an all-reduce (2 x 3/4 at each hop: measured with
    a lone reduce_scatter_tensor, tools/PERFORMANCE.md), 3 x the parameters. HSDP gathers and reduce-scatters
    inside each node, and only all-reduces each rank's half of the gradients with its copy on the other node: 2
    pairs x 2 directions x a half = 2 x the parameters."""
    p, blocks = 4 * parameters, 4 * block_parameters
    return {"FSDP2 4 shards": 1.5 * (p + blocks) + 3 * p, "HSDP 2 x 2": 2 * p}


def ring_time(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "500mbit", "200mbit"], type=str,
                        help="each link's sending rate, as tc writes it")
    parser.add_argument("--quick", action="store_true", help="3 epochs x 10 steps per DDP run (else 4 x 30)")
    parser.add_argument("--overlap-variants", nargs="*", default=["ddp", "ddp-cap1", "ddp-fp16", "ddp-powersgd"],
                        help="diagnose/overlap.py's variants to time on each link (none: skip it)")
    parser.add_argument("--sharded-rates", nargs="*", default=["1gbit", "200mbit"],
                        help="links over which to run transformer/fsdp.py at 2 nodes x 2 ranks, FSDP2 against HSDP "
                        "(none: skip it)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "network.json"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = parser.parse_args()
    for rate in [*args.rates, *args.sharded_rates]:
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
        shards = []
        for i, rate in enumerate(args.sharded_rates):
            print(f"  FSDP2 and HSDP at 2 nodes x 2 ranks, tensor parallel inside and across, link {rate} ...",
                  flush=True)
            (tmp / f"sharded{i}").mkdir()
            shards.append(split_and_sharded(rate, tmp / f"sharded{i}", args.timeout))
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
    if shards:
        formula = sharded_formula(*gpt_parameters(GPT_FLAGS))
        print(f"\nthe chapter's GPT ({' '.join(GPT_FLAGS)}) across the link: the bytes that cross it per step "
              "(measured: both nodes' eth0; the formula: fp32, ring collectives, gloo's reduce-scatter an all-reduce), "
              "and tokens/s")
        print(f"{'link':>10}{'layout':>16}{'MB/step':>9}{'formula':>9}{'tokens/s':>10}")
        for link in shards:
            for layout, row in link["layouts"].items():
                row["formula_bytes_per_step"] = formula.get(layout)
                expected = f"{formula[layout] / 1e6:.1f}" if layout in formula else "-"
                print(f"{link['rate']:>10}{layout:>16}{row['bytes_per_step'] / 1e6:>9.1f}{expected:>9}"
                      f"{row['tokens_per_s']:>10.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(started=started, machine=os.uname().nodename, cores=os.cpu_count(),
                                              single_samples_per_s=single, links=links, ddp_flags=ddp_flags,
                                              sharded=shards, gpt_flags=GPT_FLAGS),
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
