#!/usr/bin/env python
"""MNIST with tensor parallelism (PyTorch DTensor): each layer of a wide MLP split over the ranks.

    torchrun --nproc_per_node 2 model_parallel/tensor_parallel.py         each: half of each layer
    torchrun --nproc_per_node 4 model_parallel/tensor_parallel.py --dp 2  2 data x 2 tensor-parallel
    python model_parallel/tensor_parallel.py                              one process: the whole MLP

[1]-[8]: the course's recipe (README.md); model_parallel/README.md explains each line here.
"""
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (utils/plumbing.py): the libraries' noise filtered,
    from utils import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from model_parallel import common, counters  # the MLP and its flags; what summary.json reports
from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files

FRAMEWORK = "pytorch-tensor-parallel"
# Column-parallel: each rank computes a slice of the outputs. Row-parallel: each rank multiplies its
# slice of the inputs, and one all-reduce sums the partial outputs. The head stays whole.
PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
        "fc3": ColwiseParallel(), "fc4": RowwiseParallel()}
# What each launcher sets: rank, local rank, world size, ranks on this node.
LAUNCHERS = {"torchrun": ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
             "mpiexec (PALS)": ("PALS_RANKID", "PALS_LOCAL_RANKID", "PMI_SIZE", "PALS_LOCAL_SIZE"),
             "mpirun (Open MPI)": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                   "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
             "mpiexec": ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"),
             "srun": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE")}


def who_am_i():
    e = os.environ
    if "SLURM_STEP_ID" in e and "MPI_LOCALRANKID" not in e:  # srun (its PMI_RANK has no local rank)
        e = {k: v for k, v in e.items() if not k.startswith("PMI_")}
    for name, (rank, local, size, local_size) in LAUNCHERS.items():
        if rank in e and size in e:
            local_sizes = e.get(local_size) or e.get("SLURM_TASKS_PER_NODE", e[size])
            return (int(e[rank]), int(e.get(local, 0)), int(e[size]),
                    int(local_sizes.split("(")[0].split(",")[0]), name)
    return 0, 0, 1, 1, "python"


def train_epoch(model, optimizer, loader, mesh, epoch, lr_of, steps, args, wire, step_times):
    model.train()
    sums = [0.0, 0, 0]  # loss, correct, seen
    progress = log.Progress(not mesh or dist.get_rank() == 0, steps, epoch, args.log_interval)
    for step, (x, y) in enumerate(islice(loader, steps)):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_of(epoch - 1 + step / steps)
        optimizer.zero_grad()
        with wire if step == 1 else nullcontext():  # counts what this rank sends during one step
            output = model(x)  # [B, 10] on every rank: fc2 and fc4 all-reduced their outputs
            loss = F.cross_entropy(output, y)
            loss.backward()  # ...and fc3's input gradient is all-reduced on the way back
            if args.dp > 1:
                # [6] Gradients averaged over the dp ranks only: one all_reduce per parameter over
                #     the "dp" group (a tensor-parallel rank holds its slice's only gradient:
                #     nothing to average over "tp").
                for p in model.parameters():
                    dist.all_reduce(common.local(p.grad), group=mesh.get_group("dp"))
                    common.local(p.grad).div_(args.dp)
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        sums = [sums[0] + loss.item() * len(y), sums[1] + (output.argmax(1) == y).sum().item(),
                sums[2] + len(y)]
        progress.update(step + 1, loss.item())
    return sums


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    sums = [0.0, 0, 0]
    for x, y in loader:
        output = model(x)
        sums = [sums[0] + F.cross_entropy(output, y, reduction="sum").item(),
                sums[1] + (output.argmax(1) == y).sum().item(), sums[2] + len(y)]
    return sums


def main(args):
    # [1] Who am I? The launcher's variables (LAUNCHERS), then where the ranks meet: torchrun sets
    #     MASTER_ADDR; else this node when all ranks are on it, or rank 0's host sent over MPI.
    rank, local_rank, world_size, local_size, launcher = who_am_i()
    tp = world_size // args.dp  # (common.Parser checked that it divides, and the width)
    if world_size > 1 and "MASTER_ADDR" not in os.environ and local_size < world_size:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    # [2] Pin this rank to one device (GPU number = local rank); on CPUs, its share of the cores.
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    gpu = gpu.type if gpu and gpu.type in ("cuda", "xpu") and args.device != "cpu" else None
    device = f"{gpu}:{local_rank % torch.accelerator.device_count()}" if gpu else "cpu"
    if gpu:
        torch.accelerator.set_device_index(device)  # NVIDIA (cuda:N) and Intel (xpu:N) alike
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count() else max(1, cores // local_size))
    torch.set_num_threads(threads)
    vendor = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    backend = (vendor if args.backend == "auto" else args.backend) if world_size > 1 else "none"
    mesh, wait = None, timedelta(seconds=args.dist_timeout)
    if world_size > 1:
        # [1] Join the group (torchrun --max-restarts: each attempt's keys apart), then lay the
        #     ranks out as dp x tp: ranks 0..tp-1 hold one copy of the model, split; the next tp...
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        keys = None if attempt == "0" else dist.PrefixStore(attempt, next(dist.rendezvous(
            "env://", rank, world_size, timeout=wait))[0])
        dist.init_process_group(backend, store=keys, rank=rank, world_size=world_size, timeout=wait)
        mesh = init_device_mesh(device.split(":")[0], (args.dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp") if mesh else 0
    log.configure(rank, local_rank, args.log_all_ranks)
    log_dir = [args.log_dir or log.default_log_dir("tensor-parallel")]  # rank 0's time
    if world_size > 1 and not args.log_dir:
        dist.broadcast_object_list(log_dir, src=0)
    run = log.RunLog(log_dir[0], rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0,
                            barrier=dist.barrier if world_size > 1 else lambda: None)
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher} = {args.dp} dp x {tp} tp, device "
             f"{device}, backend {backend}, {threads} thread(s) per rank\n{mnist.describe()}")
    train_set, test_set = [TensorDataset(torch.from_numpy(data.normalized(x)).unsqueeze(1).to(
        device), torch.from_numpy(y).to(device)) for x, y in ((mnist.x_train, mnist.y_train),
                                                               (mnist.x_test, mnist.y_test))]
    # [3] Shard by the *dp* rank only: the tp ranks of one copy all see the same whole batch (each
    #     computes its slice of every layer for all of it); with --dp 1 every rank sees every batch.
    steps = data.batches_per_rank(len(train_set), args.dp, args.batch_size, args.max_steps)
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(train_set, num_replicas=args.dp, rank=dp_rank,
                                                   shuffle=True, seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=DistributedSampler(
        test_set, num_replicas=args.dp, rank=dp_rank, shuffle=False))
    torch.manual_seed(args.seed)
    model = common.mlp(args.width).to(device)
    if world_size > 1:
        # [5] Start from rank 0's weights (one broadcast per tensor), then split: parallelize_module
        #     turns each planned layer's weight into a DTensor; this rank keeps its 1/tp slice.
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
        if tp > 1:
            parallelize_module(model, mesh["tp"], PLAN)
    # [4] Scale the LR with the *different* batches per step: dp (a copy's tp ranks share one).
    lr = args.lr * args.dp if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    def lr_of(progress):  # --lr-warmup-epochs W: linear from the base LR to the scaled one
        W = args.lr_warmup_epochs
        return args.lr + (lr - args.lr) * progress / W if W and progress < W else lr
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size, tp=tp,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir[0],
                                master_addr=os.environ["MASTER_ADDR"], scaled_lr=lr), FRAMEWORK)

    wire, times = counters.WireBytes(), []
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(model, optimizer, loader, mesh, epoch, lr_of, steps, args, wire, times)
        train_time = counters.slowest(time.perf_counter() - start, device)
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64).to(device)
        if args.dp > 1:  # [7] metrics summed over the dp ranks only (a copy's tp ranks: the same)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time)
    # The summary: the full weights (each DTensor's slices gathered), what each rank holds and sent
    state = {name: common.full_tensor(t) for name, t in model.state_dict().items()}
    if args.save_model and rank == 0:  # [8] one writer: rank 0 saves the gathered full weights
        log.atomic_write(Path(log_dir[0]) / "model.pt", lambda f: torch.save(
            {name: t.cpu() for name, t in state.items()}, f), mode="wb")
    held = counters.tensor_parallel_report(model, state)  # what each rank holds
    run.summary({
        "weights_checksum": counters.checksum(state), "wire_bytes_per_step": wire.per_step(),
        **held,
        "step_time_s": counters.slowest(times, device), "dp": args.dp, "tp": tp,
        "width": args.width, "batch_size": args.batch_size, "device": device,
        "world_size": world_size, "launcher": launcher, "framework": FRAMEWORK})
    dist.destroy_process_group() if world_size > 1 else None


if __name__ == "__main__":
    parser = common.parser(__doc__, ranks=who_am_i()[2], dp=True)  # + --width, --dp; checked
    plumbing.run_main(main, parser) if plumbing else main(parser.parse_args())
