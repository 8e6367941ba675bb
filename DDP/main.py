#!/usr/bin/env python
"""MNIST with PyTorch DistributedDataParallel (DDP); [1]-[8]: the recipe (DDP/README.md explains).

    python DDP/main.py                          one process
    torchrun --nproc_per_node 2 DDP/main.py     two ranks
    mpiexec -n 2 python DDP/main.py             two ranks under MPI (also: srun, in a Slurm job)
"""
import hashlib
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files
from utils.parse_args import clip_flag, get_parser

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


def Net(dropout):  # pytorch/examples' MNIST CNN (1.2M parameters), as one nn.Sequential
    return nn.Sequential(nn.Conv2d(1, 32, 3, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Dropout(dropout), nn.Flatten(), nn.Linear(9216, 128),
                         nn.ReLU(), nn.Dropout(2 * dropout), nn.Linear(128, 10), nn.LogSoftmax(1))


def train_epoch(model, optimizer, loaders, epoch, lr_of, steps, args, is_main):
    model.train()
    sums = [0.0, 0, 0]  # loss, correct, seen
    progress = log.Progress(is_main, steps, epoch, args.log_interval)
    for step, micro_batches in enumerate(islice(zip(*loaders), steps)):  # one from each loader
        for group in optimizer.param_groups:
            group["lr"] = lr_of(epoch - 1 + step / steps)
        optimizer.zero_grad()
        for k, (x, y) in enumerate(micro_batches):
            # [6] gradients averaged: DDP all-reduces them in buckets *during* backward. With
            #     --grad-accum, no_sync() skips that until the step's last micro-batch.
            last = k == len(micro_batches) - 1
            with nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
                output = model(x)
                loss = F.nll_loss(output, y)
                (loss / len(micro_batches)).backward()
            sums = [sums[0] + loss.item() * len(y), sums[1] + (output.argmax(1) == y).sum().item(),
                    sums[2] + len(y)]
        if args.clip_grad_norm:  # averaged by now: every rank clips the same vector
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        progress.update(step + 1, loss.item())  # (the last step clears a progress bar)
    return sums


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    sums = [0.0, 0, 0]
    for x, y in loader:
        output = model(x)
        sums = [sums[0] + F.nll_loss(output, y, reduction="sum").item(),
                sums[1] + (output.argmax(1) == y).sum().item(), sums[2] + len(y)]
    return sums


def main(args):
    # [1] Who am I? The launcher's variables (LAUNCHERS), then where the ranks meet: torchrun sets
    #     MASTER_ADDR; else this node when all ranks are on it, or rank 0's host sent over MPI.
    rank, local_rank, world_size, local_size, launcher = who_am_i()
    if world_size > 1 and "MASTER_ADDR" not in os.environ and local_size < world_size:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    # [2] Pin this rank to one device before anything touches it: GPU (or Aurora tile) number =
    #     local rank. On CPUs: its share of the cores (all, if the launcher bound it to its own).
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    gpu = gpu.type if gpu and gpu.type in ("cuda", "xpu") and args.device != "cpu" else None
    device = f"{gpu}:{local_rank % torch.accelerator.device_count()}" if gpu else "cpu"
    if gpu:
        torch.accelerator.set_device_index(device)  # NVIDIA (cuda:N) and Intel (xpu:N) alike
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count() else max(1, cores // local_size))
    torch.set_num_threads(threads)
    # [1] Join the process group: back when all ranks met; a dead peer fails it after --dist-timeout
    vendor = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    backend = (vendor if args.backend == "auto" else args.backend) if world_size > 1 else "none"
    wait = timedelta(seconds=args.dist_timeout)
    if world_size > 1:  # (one process: no group, as pytorch/examples' MNIST)
        keys = meeting_place(rank, world_size, wait)
        dist.init_process_group(backend, store=keys, rank=rank, world_size=world_size, timeout=wait)
    log.configure(rank, local_rank, args.log_all_ranks)
    log_dir = [args.log_dir or log.default_log_dir("ddp")]  # runs/ddp-<time>: rank 0's time
    if world_size > 1 and not args.log_dir:
        dist.broadcast_object_list(log_dir, src=0)
    run = log.RunLog(log_dir[0], rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0,
                            barrier=dist.barrier if world_size > 1 else lambda: None)
    log.info(f"pytorch-ddp: {world_size} rank(s) via {launcher}, device {device}, backend "
             f"{backend}, {threads} thread(s) per rank\n{mnist.describe()}")
    sets = [TensorDataset(torch.from_numpy(data.normalized(x)).unsqueeze(1).to(device),
                          torch.from_numpy(y).to(device))
            for x, y in ((mnist.x_train, mnist.y_train), (mnist.x_test, mnist.y_test))]
    # [3] Shard by *global* rank: each rank draws its own 1/world_size of every shuffled epoch (the
    #     same permutation everywhere, seeded). --grad-accum A: a rank plays A ranks.
    A = args.grad_accum
    log.grad_accum(A, world_size)  # A > 1: says so
    steps = data.batches_per_rank(len(sets[0]), world_size * A, args.batch_size, args.max_steps)
    loaders = [DataLoader(sets[0], batch_size=args.batch_size, drop_last=True, sampler=(
        DistributedSampler(sets[0], num_replicas=world_size * A, rank=rank * A + k, seed=args.seed,
                           drop_last=True))) for k in range(A)]
    test_loader = DataLoader(sets[1], batch_size=args.test_batch_size, sampler=DistributedSampler(
        sets[1], num_replicas=world_size, rank=rank, shuffle=False))
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(device)
    # [4] Scale the LR with the global batch: world_size (x grad-accum) times one rank's batch.
    lr = args.lr * world_size * A if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir[0]) / "checkpoint.pt"
    first_epoch = 1
    if args.resume and checkpoint.exists():  # [8] every rank reads the same file: the same weights
        state = torch.load(checkpoint, map_location=device, weights_only=True)  # no code runs
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)

    def lr_of(progress):  # --lr-warmup-epochs W: linear from the base LR to the scaled one
        W = args.lr_warmup_epochs
        return args.lr + (lr - args.lr) * progress / W if W and progress < W else lr
    if world_size > 1:  # [5] Wrap: DDP sends rank 0's weights to every rank, hooks [6] in backward
        model = DDP(model, device_ids=[device] if gpu else None)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir[0],
                                master_addr=os.environ["MASTER_ADDR"], scaled_lr=lr), "pytorch-ddp")
    for epoch in range(first_epoch, args.epochs + 1):
        torch.manual_seed(args.seed + 1000 * epoch + rank)  # dropout: a resumed run draws the same
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(model, optimizer, loaders, epoch, lr_of, steps, args, rank == 0)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64).to(device)
        if world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
            dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time.item())
        if rank == 0:  # [8] one writer, through a temporary file: a kill keeps the old checkpoint
            state = {"model": getattr(model, "module", model).state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch}
            log.atomic_write(checkpoint, lambda f: torch.save(state, f), mode="wb")
    weights = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    checksums = [hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]] * world_size
    if world_size > 1:
        dist.all_gather_object(checksums, checksums[0])  # all equal, or DDP is broken
    if args.save_model and rank == 0:
        torch.save(getattr(model, "module", model).state_dict(), Path(log_dir[0]) / "model.pt")
    run.summary({"param_checksums": checksums, "device": device})
    if world_size > 1:
        dist.destroy_process_group()


def meeting_place(rank, world_size, wait):
    """The store the ranks meet in (no step of the recipe). One process: a store of its own, a
    group of one. torchrun --max-restarts starts a failed job again on the same store: a restarted
    attempt keeps its keys apart, or it meets the dead attempt's and waits out --dist-timeout.
    Otherwise None: init_process_group meets at MASTER_ADDR:MASTER_PORT itself."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if world_size == 1:
        return dist.HashStore()
    if attempt == "0":
        return None
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=wait))
    return dist.PrefixStore(attempt, store)


if __name__ == "__main__":
    parser = clip_flag(get_parser(__doc__))
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. DDP's reducer keeps gloo's groups,
    # and their threads, alive past destroy_process_group(), and the teardown can then abort a
    # finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
