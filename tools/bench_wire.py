#!/usr/bin/env python
"""The bench's two measurements of communication apart from the examples, each run as its own 2-rank program
(through tools.launch.launch_command):

    torchrun --nproc_per_node 2 tools/bench_wire.py breakdown --steps 80 --batch-size 64
    mpiexec -n 2 python tools/bench_wire.py allreduce mpi4py --reps 50     (torch-gloo | horovod | mpi4py)

breakdown: rank 0's DDP-style step, phase by phase, one after another (no overlap): the next batch from a
DataLoader + DistributedSampler over the preloaded tensors (the examples' data path), forward+backward, one
all-reduce of the flattened gradients, the optimizer's step. allreduce: one all-reduce of a float32 tensor the
size of the CNN's gradients, timed alone (median), by each way the examples move them. Each prints one JSON line.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root, after site-packages
from tools import bench_runs

ALLREDUCE_WAYS = {  # name: (launcher, what it measures)
    "torch.distributed gloo (torchrun)": ("torchrun", "torch-gloo"),
    "Horovod, gloo (horovodrun --gloo)": ("horovodrun", "horovod"),
    "Horovod, MPI (mpiexec)": ("mpiexec", "horovod"),
    "MPI alone (mpiexec, mpi4py)": ("mpiexec", "mpi4py"),
}


def last_json(text, marker="{"):
    """The last JSON object printed (horovodrun puts `[rank]<stdout>:` in front of each line)."""
    line = [line for line in text.splitlines() if marker in line][-1]
    return json.loads("{" + line.split("{", 1)[1])


def measure_breakdown(args):
    out = bench_runs.wait(*bench_runs.launch(bench_runs.command(
        __file__, 2, "torchrun", ["breakdown", "--steps", args.steps * 2, "--batch-size", args.batch_size]),
        args.timeout), "breakdown")
    return last_json(out, '{"ms_per_step"')


def measure_allreduce(args):
    """{way: {"ms": .., "bytes": ..}} for each way in ALLREDUCE_WAYS."""
    out = {}
    for name, (launcher, kind) in ALLREDUCE_WAYS.items():
        cmd = bench_runs.command(__file__, 2, launcher, ["allreduce", kind, "--reps", args.allreduce_reps])
        out[name] = last_json(bench_runs.wait(*bench_runs.launch(cmd, args.timeout), f"all-reduce via {name}"),
                              '{"ms"')
    return out


def breakdown(steps, batch_size):
    """Rank 0's step, phase by phase (no overlap): next batch, forward+backward, all-reduce, step."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from course.torch_utils import Net
    from tools.bare_loop import train_arrays
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    x, y = train_arrays()
    dataset = TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y))
    sampler = DistributedSampler(dataset, tdist.get_world_size(), tdist.get_rank(), shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, drop_last=True, sampler=sampler)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    totals = dict(data=0.0, forward_backward=0.0, communication=0.0, optimizer=0.0)
    done, epoch = 0, 0
    while done < steps + 5:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(min(len(loader), steps + 5 - done)):
            t0 = time.perf_counter()
            xb, yb = next(batches)
            t1 = time.perf_counter()
            optimizer.zero_grad()
            F.nll_loss(model(xb), yb).backward()
            t2 = time.perf_counter()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()])
            tdist.all_reduce(flat)
            flat /= tdist.get_world_size()
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            t3 = time.perf_counter()
            optimizer.step()
            t4 = time.perf_counter()
            if done >= 5:  # the first 5 are warm-up
                for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    totals[key] += dt
            done += 1
        epoch += 1
    if tdist.get_rank() == 0:
        ms = {k: 1000 * v / steps for k, v in totals.items()}
        step_ms = sum(ms.values())
        print(json.dumps({"ms_per_step": ms, "fraction": {k: v / step_ms for k, v in ms.items()},
                          "step_ms": step_ms}), flush=True)
    shutdown_gloo()


def allreduce_timing(kind, reps):
    """Median ms of one all-reduce of a float32 tensor the size of the CNN's gradients, on rank 0, ranks lined
    up by a barrier before each. Horovod runs with the examples' knobs (its cycle time is part of the cost)."""
    import numpy as np
    import torch

    from course.torch_utils import Net
    torch.set_num_threads(1)
    numel = sum(p.numel() for p in Net().parameters())
    if kind == "torch-gloo":
        import torch.distributed as tdist
        tdist.init_process_group("gloo")
        t = torch.ones(numel)
        rank, barrier, allreduce, done = tdist.get_rank(), tdist.barrier, lambda: tdist.all_reduce(t), shutdown_gloo
    elif kind == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        a, b = np.ones(numel, np.float32), np.empty(numel, np.float32)
        rank, barrier, allreduce, done = comm.Get_rank(), comm.Barrier, lambda: comm.Allreduce(a, b), lambda: None
    else:
        import horovod.torch as hvd

        from course.dist import horovod_knobs
        horovod_knobs(on_cpu=True)
        hvd.init()
        t = torch.ones(numel)
        rank, barrier, allreduce, done = hvd.rank(), hvd.barrier, lambda: hvd.allreduce_(t, name="grads"), hvd.shutdown
    times = []
    for _ in range(reps + 5):  # the first 5 are warm-up (connections, buffers)
        barrier()
        t0 = time.perf_counter()
        allreduce()
        times.append(time.perf_counter() - t0)
    done()
    if rank == 0:
        print(json.dumps({"ms": 1000 * statistics.median(times[5:]), "bytes": 4 * numel}), flush=True)


def shutdown_gloo():
    import torch.distributed as tdist
    tdist.barrier()  # leave together: no rank unregisters the groups while a peer is still in a collective
    tdist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("breakdown")
    b.add_argument("--steps", type=int, default=80)
    b.add_argument("--batch-size", type=int, default=64)
    a = sub.add_parser("allreduce")
    a.add_argument("kind", choices=["torch-gloo", "horovod", "mpi4py"])
    a.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if args.what == "breakdown":
        breakdown(args.steps, args.batch_size)
    else:
        allreduce_timing(args.kind, args.reps)


if __name__ == "__main__":
    main()
