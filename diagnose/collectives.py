#!/usr/bin/env python
"""What a collective costs: all_reduce, reduce_scatter, all_gather and broadcast, 1 KB to 64 MB,
timed.

    torchrun --nproc_per_node 2 diagnose/collectives.py             (torch.distributed over gloo)
    mpiexec -n 2 python diagnose/collectives.py --library horovod   (Horovod; MPI when run so)
    torchrun --nproc_per_node 2 diagnose/collectives.py --out assets    (the figure into assets/)

Sizes are the whole buffer S as nccl-tests counts it (all_reduce and broadcast: the buffer;
reduce_scatter: its input; all_gather: its output). Per size: the median of --repeats rounds, each
round timing a loop of calls for every size in turn (the slowest rank's time). algbw = S / t; busbw
= algbw x (all_reduce 2(N-1)/N, reduce_scatter and all_gather (N-1)/N, broadcast 1): what one link
carries, comparable across N.

Then the ring model of the front README, t = 2(N-1)·alpha + 2(N-1)/N · S/beta, is fitted to the
all_reduce times (least squares on relative error), and checked against a measured all-reduce of
DDP's gradients (the course's CNN, 4.8 MB) and against the buckets DDP really forms for it. Rank 0
prints the table and writes collectives.json and collectives.png into --out (default
runs/collectives-<time>).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# The repo root, after site-packages: `import horovod` is the library.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from course import plumbing  # noqa: F401  (course plumbing: importing it filters the noise)

# isort: split

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def size(text):
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    value = int(float(text.rstrip("KMGB") or 0) * scale) if scale != 1 else int(text.rstrip("B"))
    if value < 4:
        raise argparse.ArgumentTypeError(f"{text}: a size is at least 4 bytes (one float)")
    return value


def human(n):
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


class Torch:
    name = "torch-gloo"

    def __init__(self):
        import torch
        import torch.distributed as dist

        from course import ranks

        self.torch, self.dist = torch, dist
        env = ranks.export_rendezvous(ranks.discover())
        torch.set_num_threads(1)
        if env.world_size < 2:
            raise SystemExit(
                "error: collectives: run it with 2 or more ranks, e.g. torchrun --nproc_per_node 2"
            )
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
        self.rank, self.n = env.rank, env.world_size
        self.name = f"torch-{dist.get_backend()}"

    def buffers(self, op, nbytes):
        floats = max(self.n, nbytes // 4) // self.n * self.n  # divisible by the ranks
        t = self.torch
        if op == "all_reduce" or op == "broadcast":
            return t.ones(floats), None
        if op == "reduce_scatter":
            return t.ones(floats), t.empty(floats // self.n)
        return t.ones(floats // self.n), t.empty(floats)  # all_gather

    def call(self, op, a, b):
        d = self.dist
        if op == "all_reduce":
            d.all_reduce(a)
        elif op == "broadcast":
            d.broadcast(a, src=0)
        elif op == "reduce_scatter":
            d.reduce_scatter_tensor(b, a)
        else:
            d.all_gather_into_tensor(b, a)

    def max_over_ranks(self, value):
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self):
        self.dist.barrier()

    def close(self):
        self.dist.destroy_process_group()


class Horovod:
    def __init__(self):
        import horovod.torch as hvd
        import torch

        hvd.init()
        torch.set_num_threads(1)
        self.hvd, self.torch = hvd, torch
        self.rank, self.n = hvd.rank(), hvd.size()
        if self.n < 2:
            raise SystemExit("error: collectives: run it with 2 or more ranks, e.g. mpiexec -n 2")
        self.name = "horovod-" + ("mpi" if hvd.mpi_enabled() and not hvd.gloo_enabled() else "gloo")

    buffers = Torch.buffers

    def call(self, op, a, b):
        hvd = self.hvd
        # One name per op and size, as a training step repeats its tensors' names: Horovod's
        # response cache then skips the negotiation, as it does from a lesson's second step on.
        name = f"{op}.{a.numel()}"
        if op == "all_reduce":
            hvd.allreduce_(a, op=hvd.Sum, name=name)
        elif op == "broadcast":
            hvd.broadcast_(a, root_rank=0, name=name)
        elif op == "reduce_scatter":
            hvd.reducescatter(a, op=hvd.Sum, name=name)
        else:
            hvd.allgather(a, name=name)

    def max_over_ranks(self, value):
        t = self.torch.tensor([value], dtype=self.torch.float64)
        return float(self.hvd.allreduce(t, op=self.hvd.Max, name="max").item())

    def barrier(self):
        self.hvd.barrier()

    def close(self):
        self.hvd.shutdown()


def sweep(lib, cases, repeats):
    """{(op, bytes): seconds per call}: the median over `repeats` rounds of the slowest rank's time
    for a loop of calls. Each round visits every case once, so a drift in a shared machine's speed
    hits all sizes alike instead of the ones measured during it."""
    times = {case: [] for case in cases}
    for _ in range(repeats):
        for op, nbytes in cases:
            a, b = lib.buffers(op, nbytes)
            lib.call(op, a, b)  # untimed: connections, buffers and pages set up
            iters = iterations(nbytes)
            lib.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                lib.call(op, a, b)
            times[op, nbytes].append(lib.max_over_ranks((time.perf_counter() - start) / iters))
    return {case: statistics.median(t) for case, t in times.items()}


def iterations(nbytes):
    """Calls per timed loop: about 64 MB moved, between 4 and 50 calls. Two ranks sharing a few
    cores with gloo's threads are descheduled now and then; a loop of tens of milliseconds averages
    that out, where 2 calls of a 4 MB message varied 3x from round to round."""
    return max(4, min(50, 2**26 // max(nbytes, 1)))


def fit_ring(points, n):
    """alpha (s) and beta (bytes/s) of t = 2(n-1)·alpha + 2(n-1)/n · S/beta from (S, t) pairs,
    least squares on the relative error (each point weighted 1/t), so 1 KB counts as much as
    64 MB."""
    ws = [(s, t, 1 / t) for s, t in points]
    sw = sum(w * w for _, _, w in ws)
    sx = sum(w * w * s for s, _, w in ws)
    sxx = sum(w * w * s * s for s, _, w in ws)
    sy = sum(w * w * t for _, t, w in ws)
    sxy = sum(w * w * s * t for s, t, w in ws)
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    intercept = (sy - slope * sx) / sw
    alpha = max(intercept, 0.0) / (2 * (n - 1))
    beta = 2 * (n - 1) / n / slope
    return alpha, beta


def ring_time(nbytes, n, alpha, beta):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def ddp_gradient_bytes():
    from course.torch_utils import Net

    return sum(p.numel() for p in Net().parameters()) * 4


def ddp_bucket_bytes(bucket_cap_mb=None):
    """The sizes of the buckets DDP all-reduces for the course's CNN, as it really forms them:
    counted by a hook over two small steps (the first step has one bucket; DDP then rebuilds them in
    the order the gradients became ready, the first up to 1 MB unless bucket_cap_mb is given). Needs
    the process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from course.torch_utils import Net

    model = DistributedDataParallel(Net(), bucket_cap_mb=bucket_cap_mb)
    sizes = []

    def counting(state, bucket):
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting)
    for _ in range(2):
        sizes.clear()
        model(torch.zeros(2, 1, 28, 28)).sum().backward()
    return list(sizes)


def figure(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    n = result["world_size"]
    for op in result["ops"]:
        rows = [r for r in result["rows"] if r["op"] == op]
        left.plot(
            [r["bytes"] for r in rows], [1e3 * r["time_s"] for r in rows], "o-", label=op, ms=3
        )
        right.plot(
            [r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-", label=op, ms=3
        )
    sizes = sorted({r["bytes"] for r in result["rows"]})
    fit = result["fit"]
    left.plot(
        sizes,
        [1e3 * ring_time(s, n, fit["alpha_s"], fit["beta_Bps"]) for s in sizes],
        "k--",
        lw=1,
        label=f"ring fit: α={1e6 * fit['alpha_s']:.0f} µs, β={fit['beta_Bps'] / 1e9:.2f} GB/s",
    )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size S (bytes)")
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    left.set_ylabel("time per call (ms)")
    right.set_ylabel("bus bandwidth (GB/s)")
    left.legend(fontsize=8)
    fig.suptitle(
        f"{result['library']}, {n} ranks on {result['machine']} ({result['date']})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--library",
        choices=("torch", "horovod"),
        default="torch",
        help="torch.distributed over gloo, or Horovod (gloo or MPI, as launched)",
    )
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--min-size", type=size, default=size("1K"))
    p.add_argument("--max-size", type=size, default=size("64M"))
    p.add_argument(
        "--factor", type=int, default=4, help="each size this many times the last (default 4)"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed loops per size; the median is reported"
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for collectives.json and .png (default runs/collectives-<time>)",
    )
    p.add_argument("--machine", default="2-core CPU", help="named in the figure's title")
    args = p.parse_args()
    if args.min_size > args.max_size or args.factor < 2 or args.repeats < 1:
        p.error(
            "--min-size must not exceed --max-size; --factor is at least 2; --repeats at least 1"
        )
    lib = Torch() if args.library == "torch" else Horovod()
    n, main_rank = lib.n, lib.rank == 0
    say = print if main_rank else (lambda *a, **k: None)
    if n > (os.cpu_count() or 1):
        say(
            f"note: {n} ranks on {os.cpu_count()} cores: oversubscribed, "
            "ranks take turns on the cores"
        )

    sizes, s = [], args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= args.factor
    say(
        f"{lib.name}, {n} ranks; S = the whole buffer (nccl-tests' size); "
        f"median of {args.repeats} rounds"
    )
    say(f"{'op':<15}{'size':>9}{'time':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    grads = ddp_gradient_bytes()
    buckets = ddp_bucket_bytes() if isinstance(lib, Torch) else [grads]  # Horovod: one fused buffer
    probes = [("all_reduce", grads)] + [
        ("all_reduce", b) for b in buckets if b != grads
    ]  # not in the fit
    probes = probes if "all_reduce" in args.ops else []
    cases = [(op, nbytes) for op in args.ops for nbytes in sizes]
    measured = sweep(lib, cases + [c for c in probes if c not in cases], args.repeats)
    rows = []
    for op, nbytes in cases:
        t = measured[op, nbytes]
        algbw = nbytes / t / 1e9
        row = dict(
            op=op, bytes=nbytes, time_s=t, algbw_GBps=algbw, busbw_GBps=algbw * BUS_FACTOR[op](n)
        )
        rows.append(row)
        say(f"{op:<15}{human(nbytes):>9}{1e3 * t:>9.3f}ms{algbw:>12.3f}{row['busbw_GBps']:>12.3f}")

    result = dict(
        library=lib.name,
        world_size=n,
        ops=args.ops,
        rows=rows,
        machine=args.machine,
        date=time.strftime("%Y-%m-%d"),
    )
    reduce_rows = [(r["bytes"], r["time_s"]) for r in rows if r["op"] == "all_reduce"]
    if len(reduce_rows) >= 2:
        alpha, beta = fit_ring(reduce_rows, n)
        predicted_one = ring_time(grads, n, alpha, beta)
        predicted_ddp = sum(ring_time(b, n, alpha, beta) for b in buckets)
        measured_one = measured["all_reduce", grads]
        measured_ddp = sum(measured["all_reduce", b] for b in buckets)
        result["fit"] = dict(
            alpha_s=alpha,
            beta_Bps=beta,
            ddp_gradient_bytes=grads,
            ddp_buckets=buckets,
            predicted_s=predicted_one,
            measured_s=measured_one,
            predicted_ddp_buckets_s=predicted_ddp,
            measured_ddp_buckets_s=measured_ddp,
        )
        say(
            f"\nring fit to all_reduce: alpha = {1e6 * alpha:.1f} us per message hop, "
            f"beta = {beta / 1e9:.2f} GB/s"
        )
        say(
            f"DDP's gradients ({grads / 1e6:.2f} MB, the CNN) in one all_reduce: "
            f"predicted {1e3 * predicted_one:.2f} ms, "
            f"measured {1e3 * measured_one:.2f} ms ({predicted_one / measured_one:.2f}x)"
        )
        say(
            f"  in DDP's buckets ({' + '.join(f'{b / 1e6:.2f}' for b in buckets)} MB): "
            f"predicted {1e3 * predicted_ddp:.2f} ms, "
            f"measured {1e3 * measured_ddp:.2f} ms ({predicted_ddp / measured_ddp:.2f}x)"
        )
    if main_rank:
        out = Path(args.out or f"runs/collectives-{time.strftime('%Y%m%d-%H%M%S')}")
        out.mkdir(parents=True, exist_ok=True)
        stem = (
            "collectives" if lib.name == "torch-gloo" and n == 2 else f"collectives-{lib.name}-{n}"
        )
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        if "fit" in result:
            figure(result, out / f"{stem}.png")
        say(f"wrote {out / stem}.json" + (" and .png" if "fit" in result else ""))
    lib.close()


if __name__ == "__main__":
    from course import failures

    failures.run_main(main)
    # The run is over: leave without the interpreter's teardown. The groups it measured keep gloo's
    # groups, and their threads, alive past destroy_process_group(), and the teardown can then abort
    # a finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
