#!/usr/bin/env python
"""One DDP training step, many ways to communicate: what each costs in exposed communication.

    torchrun --nproc_per_node 2 diagnose/overlap.py     (gloo; the mpi4py hook is skipped)
    mpiexec -n 2 python diagnose/overlap.py             (also a DDP hook that all-reduces over MPI)

The course's CNN, SGD, the same batch per rank (--batch-size, default 32 as in the lessons), one
thread per rank. Variants, timed in turns (--rounds rounds of --steps steps each), each rank's
median step:
  none          no communication: every rank steps on its own. Both ranks run at once, so this is
                the two-process ceiling: two independent processes doing the same per-rank work.
  per-param     after backward, one all_reduce per parameter tensor (8 for this CNN)
  flat          after backward, the gradients copied into one flat buffer, one all_reduce, and back
  ddp           DDP as the lessons use it: buckets (1 MB, then 25 MB) all-reduced during backward
  ddp-cap<MB>   DDP with bucket_cap_mb=MB (every bucket that size; 5 or more: one bucket here)
  ddp-fp16, ddp-bf16, ddp-powersgd
                DDP communication hooks that work on gloo: 16-bit gradients, and PowerSGD's
                rank-1 approximation (after 2 uncompressed steps; in one bucket, see bucket_cap)
  ddp-mpi       a DDP hook that all-reduces each bucket with mpi4py (shared memory); mpiexec only
exposed communication = a variant's step - none's step; efficiency = none's step / the variant's
step. --accuracy-epochs E trains the DDP variants E epochs each from the same start and reports test
accuracy.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages

from course import plumbing  # noqa: F401  (course plumbing: importing it filters the noise)

# isort: split

import collectives  # diagnose/collectives.py, beside this file: its DDP bucket probe
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from course import failures, ranks
from course.errors import fail
from course.torch_utils import Net, to_tensors
from utils import data, log

DEFAULT = [
    "none",
    "per-param",
    "flat",
    "ddp",
    "ddp-cap1",
    "ddp-cap25",
    "ddp-fp16",
    "ddp-bf16",
    "ddp-powersgd",
    "ddp-mpi",
]


def mpi_comm(world_size):
    """MPI's world, when mpiexec started this process with the same ranks as torch.distributed."""
    if not any(os.environ.get(v) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() == world_size else None


def mpi_hook(comm):
    """A DDP communication hook: the bucket's flat gradient buffer all-reduced in place by MPI (on
    one node, through shared memory), averaged, handed back as an already completed future."""
    from mpi4py import MPI

    def hook(state, bucket):
        buf = bucket.buffer()
        comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        buf.div_(comm.Get_size())
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def build(variant, n, lr, comm):
    """(model, optimizer, after_backward) for one variant; every variant from the same weights."""
    torch.manual_seed(0)
    net = Net()
    after = None
    if variant in ("none", "per-param", "flat"):
        model = net
        params = [p for p in net.parameters()]
        if variant == "per-param":

            def after():
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad.div_(n)
        elif variant == "flat":

            def after():
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat)
                flat.div_(n)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
    else:
        model = DDP(net, bucket_cap_mb=bucket_cap(variant))
        if variant == "ddp-fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif variant == "ddp-bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif variant == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif variant == "ddp-mpi":
            model.register_comm_hook(None, mpi_hook(comm))
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5), after


def train_step(model, optimizer, after, x, y):
    optimizer.zero_grad(set_to_none=True)
    F.nll_loss(model(x), y).backward()
    if after:
        after()
    optimizer.step()


def batches(x, y, rank, n, batch, seed):
    """This rank's batches of one shuffled epoch (the same permutation on every rank, seeded)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    per_rank = len(y) // n
    mine = order[rank * per_rank : (rank + 1) * per_rank]
    return [
        (x[mine[i : i + batch]], y[mine[i : i + batch]])
        for i in range(0, per_rank - batch + 1, batch)
    ]


def test_accuracy(model, x, y, rank, n):
    model.eval()
    with torch.no_grad():
        shard = slice(rank, None, n)
        correct = (model(x[shard]).argmax(1) == y[shard]).sum().float()
    total = torch.stack([correct, torch.tensor(float(len(y[shard])))])
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def bucket_cap(variant):
    """bucket_cap_mb: ddp-cap<MB>'s, PowerSGD's one bucket, else DDP's default (None)."""
    if variant.startswith("ddp-cap"):
        return float(variant[len("ddp-cap") :])
    # PowerSGD all-reduces twice per bucket, the second from a callback thread: with two buckets on
    # gloo the ranks can order bucket 1's second all-reduce and bucket 2's first differently, and
    # gloo aborts ("Received data size doesn't match expected size"). One bucket leaves a single
    # order.
    return 25 if variant == "ddp-powersgd" else None


def n_buckets(variant):
    return len(collectives.ddp_bucket_bytes(bucket_cap(variant)))


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--variants", nargs="+", default=DEFAULT, help=f"default: {' '.join(DEFAULT)}")
    p.add_argument(
        "--batch-size", type=int, default=32, help="per rank (default 32, as the lessons)"
    )
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    p.add_argument(
        "--rounds", type=int, default=6, help="rounds; the variants take turns within each"
    )
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--accuracy-epochs", type=int, default=2, help="train the DDP variants this long (0: skip)"
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="cap the accuracy runs' steps per epoch"
    )
    p.add_argument("--json", help="rank 0 writes the results here")
    args = p.parse_args()
    bad = [v for v in args.variants if v not in DEFAULT and not v.startswith("ddp-cap")]
    if (
        bad
        or min(args.batch_size, args.steps, args.rounds, args.num_threads, args.max_steps or 1) < 1
        or args.accuracy_epochs < 0
    ):
        p.error(
            f"unknown variant(s) {' '.join(bad)}"
            if bad
            else "--batch-size, --steps, --rounds and --num-threads are at least 1; "
            "--accuracy-epochs at least 0"
        )
    for v in args.variants:
        if v.startswith("ddp-cap"):
            try:
                assert float(v[7:]) > 0
            except (ValueError, AssertionError):
                p.error(f"{v}: ddp-cap takes a positive size in MB, e.g. ddp-cap5")

    env = ranks.export_rendezvous(ranks.discover())
    torch.set_num_threads(args.num_threads)
    if env.world_size < 2:
        fail(
            "overlap: run it with 2 ranks, e.g. torchrun --nproc_per_node 2 diagnose/overlap.py"
        )
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
    log.configure(env.rank)
    rank, n = env.rank, env.world_size
    comm = mpi_comm(n)
    variants = [v for v in args.variants if v != "ddp-mpi" or comm is not None]
    if "ddp-mpi" in args.variants and comm is None:
        log.info("ddp-mpi skipped: it needs mpi4py and the ranks started by mpiexec")
    mnist = data.load_mnist(is_main=env.is_main, barrier=dist.barrier)
    x_train, y_train, x_test, y_test = to_tensors(mnist, torch.device("cpu"))
    lr = 0.01 * n
    log.info(
        f"{n} ranks, batch {args.batch_size} per rank, {args.num_threads} thread(s) per rank; "
        f"{args.rounds} rounds x {args.steps} steps per variant"
    )

    built = {v: build(v, n, lr, comm) for v in variants}
    times = {v: [[] for _ in range(args.rounds)] for v in variants}
    work = batches(x_train, y_train, rank, n, args.batch_size, seed=0)
    for r in range(args.rounds):
        order = (
            variants[r % len(variants) :] + variants[: r % len(variants)]
        )  # each variant goes first once
        for v in order:
            model, optimizer, after = built[v]
            dist.barrier()
            for s in range(
                args.steps + (2 if r == 0 else 0)
            ):  # round 0: 2 warm-up steps (PowerSGD's too)
                x, y = work[(r * args.steps + s) % len(work)]
                start = time.perf_counter()
                train_step(model, optimizer, after, x, y)
                if r or s >= 2:
                    times[v][r].append(time.perf_counter() - start)
    # Per round, each variant's median step, the slowest rank's (the ranks move together; for `none`
    # the slower process sets what two would finish together). A shared machine drifts: a variant is
    # compared with `none` of the same round, and the median over the rounds is reported.
    mine = {v: [statistics.median(t) for t in rounds] for v, rounds in times.items()}
    every = [None] * n
    dist.all_gather_object(every, mine)
    per_round = {v: [max(m[v][r] for m in every) for r in range(args.rounds)] for v in variants}

    rows = []
    for v in variants:
        row = dict(
            variant=v,
            step_s=statistics.median(per_round[v]),
            buckets=n_buckets(v) if v.startswith("ddp") else None,
        )
        if "none" in per_round:
            base = per_round["none"]
            row.update(
                exposed_s=statistics.median(s - b for s, b in zip(per_round[v], base)),
                efficiency=statistics.median(b / s for s, b in zip(per_round[v], base)),
            )
        rows.append(row)

    if args.accuracy_epochs:
        for row in rows:
            v = row["variant"]
            if not (v == "ddp" or v in ("ddp-fp16", "ddp-bf16", "ddp-powersgd", "ddp-mpi")):
                continue
            model, optimizer, after = build(v, n, lr, comm)
            for epoch in range(args.accuracy_epochs):
                torch.manual_seed(1000 * epoch + rank)  # dropout masks
                for x, y in batches(x_train, y_train, rank, n, args.batch_size, seed=epoch)[
                    : args.max_steps
                ]:
                    train_step(model, optimizer, after, x, y)
            row["test_acc"] = test_accuracy(model, x_test, y_test, rank, n)
            sums = [None] * n  # [6] held: every rank ends with the same weights
            dist.all_gather_object(
                sums, [float(p.detach().double().sum()) for p in model.parameters()]
            )
            row["same_weights"] = all(s == sums[0] for s in sums)

    head = f"{'variant':<14}{'buckets':>8}{'step ms':>9}{'exposed ms':>12}{'of ceiling':>12}"
    if args.accuracy_epochs:
        head += f"{f'acc {args.accuracy_epochs} ep':>11}"
    lines = [head, "-" * len(head)]
    for row in rows:
        line = (
            f"{row['variant']:<14}{row['buckets'] or '':>8}{1e3 * row['step_s']:>9.1f}"
            f"{1e3 * row.get('exposed_s', float('nan')):>12.1f}"
            f"{row.get('efficiency', float('nan')):>12.2f}"
        )
        if "test_acc" in row:
            line += f"{row['test_acc']:>11.4f}"
        lines.append(line)
    lines.append(
        "(medians over the rounds of: the slowest rank's median step; "
        "exposed = step - none's step in the "
        "same round; of ceiling = none's step / step, same round)"
    )
    log.info("\n".join(lines))
    if env.is_main and args.json:
        log.write_json(
            args.json,
            dict(
                world_size=n,
                batch_size=args.batch_size,
                num_threads=args.num_threads,
                launcher=env.launcher,
                rows=rows,
            ),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    failures.run_main(main)
    # The run is over: leave without the interpreter's teardown. DDP's reducer keeps gloo's groups,
    # and their threads, alive past destroy_process_group(), and the teardown can then abort a
    # finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
