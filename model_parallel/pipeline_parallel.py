#!/usr/bin/env python
"""MNIST with pipeline parallelism (torch.distributed.pipelining): an MLP cut into a stage per rank.

    torchrun --nproc_per_node 2 model_parallel/pipeline_parallel.py  2 stages, 1F1B, 4 micro-batches
    torchrun --nproc_per_node 2 model_parallel/pipeline_parallel.py --schedule gpipe  GPipe instead
    python model_parallel/pipeline_parallel.py     one process: accumulating the 4 micro-batches

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
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from model_parallel import common, counters  # the MLP and its flags; what summary.json reports
from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files

FRAMEWORK = "pytorch-pipeline-parallel"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

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


def train_step(part, schedule, stage, x, y, k):
    """One step's forward and backward: the output and the K micro-batch losses (last stage)."""
    if schedule is None:  # one process: the unsplit model, accumulating the K micro-batches
        outputs = [part(xk) for xk in x.chunk(k)]
        losses = [F.cross_entropy(out, yk) for out, yk in zip(outputs, y.chunk(k))]
        (sum(losses) / k).backward()
        return torch.cat(outputs), losses
    losses = []  # The first stage feeds the inputs, the last the labels and computes the K losses
    output = schedule.step(*([x] if stage.is_first else []), target=y if stage.is_last else None,
                           losses=losses)  # (the schedule splits both; scale_grads: each 1/K)
    return output, losses


def train_epoch(part, schedule, stage, optimizer, loader, epoch, steps, args, wire, timing):
    part.train()
    sums = [0.0, 0, 0]  # loss, correct, seen: on the stage that has the loss (the last)
    progress = log.Progress(not stage or stage.is_last, steps, epoch, args.log_interval)
    for step, (x, y) in enumerate(islice(loader, steps)):
        start, computed = time.perf_counter(), getattr(stage, "compute_s", 0.0)
        optimizer.zero_grad()
        with wire if step == 1 else nullcontext():  # counts what this rank sends during one step
            # [6] No gradient averaging: each parameter lives on one stage only. The K micro-
            #     batches' gradients accumulate in place, each scaled by 1/K: the batch's mean.
            output, losses = train_step(part, schedule, stage, x, y, args.micro_batches)
        pipe_s = time.perf_counter() - start  # the schedule's forward + backward, waits and sends
        optimizer.step()
        if (epoch, step) != (1, 0):  # the first step also works out the shapes the stages exchange
            compute_s = getattr(stage, "compute_s", 0.0) - computed
            timing.append((time.perf_counter() - start, pipe_s, compute_s))
        if losses:  # the last stage (or the one process)
            sums = [sums[0] + sum(loss.item() for loss in losses) * len(y) / len(losses),
                    sums[1] + (output.argmax(1) == y).sum().item(), sums[2] + len(y)]
        progress.update(step + 1, losses[-1].item() if losses else None)
    return sums


@torch.no_grad()
def evaluate(part, loader, device, width):
    """Forward only, by hand, a test batch at a time: receive activations, compute, send on."""
    part.eval()
    rank, last = (dist.get_rank(), dist.get_world_size() - 1) if dist.is_initialized() else (0, 0)
    sums = [0.0, 0, 0]
    for x, y in loader:
        if rank > 0:
            x = torch.empty(len(y), width, device=device)
            dist.recv(x, src=rank - 1)
        output = part(x)
        if rank < last:
            dist.send(output, dst=rank + 1)
            continue
        sums = [sums[0] + F.cross_entropy(output, y, reduction="sum").item(),
                sums[1] + (output.argmax(1) == y).sum().item(), sums[2] + len(y)]
    return sums


def main(args):
    # [1] Who am I? The launcher's variables (LAUNCHERS), then where the ranks meet: torchrun sets
    #     MASTER_ADDR; else this node when all ranks are on it, or rank 0's host sent over MPI.
    rank, local_rank, world_size, local_size, launcher = who_am_i()
    stages, k = world_size, args.micro_batches  # (common.Parser checked that they fit)
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
    if world_size > 1:  # [1] Join the group (torchrun --max-restarts: each attempt's keys apart)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        wait = timedelta(seconds=args.dist_timeout)
        keys = None if attempt == "0" else dist.PrefixStore(attempt, next(dist.rendezvous(
            "env://", rank, world_size, timeout=wait))[0])
        dist.init_process_group(backend, store=keys, rank=rank, world_size=world_size, timeout=wait)
    log.configure(rank, local_rank, args.log_all_ranks)
    log_dir = [args.log_dir or log.default_log_dir("pipeline-parallel")]  # rank 0's time
    if world_size > 1 and not args.log_dir:
        dist.broadcast_object_list(log_dir, src=0)
    run = log.RunLog(log_dir[0], rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0,
                            barrier=dist.barrier if world_size > 1 else lambda: None)
    log.info(f"{FRAMEWORK}: {stages} stage(s) via {launcher}, {args.schedule}, {k} micro-batches, "
             f"device {device}, backend {backend}, {threads} thread(s)/rank\n{mnist.describe()}")
    train_set, test_set = [TensorDataset(torch.from_numpy(data.normalized(x)).unsqueeze(1).to(
        device), torch.from_numpy(y).to(device)) for x, y in ((mnist.x_train, mnist.y_train),
                                                               (mnist.x_test, mnist.y_test))]
    # [3] No sharding: one pipeline trains on one stream of batches. Every rank draws the same
    #     shuffled batches; the first stage uses the digits, the last the labels.
    steps = data.batches_per_rank(len(train_set), 1, args.batch_size, args.max_steps)
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True,
                                                   seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)
    torch.manual_seed(args.seed)
    model = common.mlp(args.width).to(device)
    # [5] Split the model: this rank keeps its stage's layers (all built the same seeded model, so
    #     the stages fit together as rank 0's would). Nothing to broadcast: each lives on one rank.
    part = common.stage_layers(model, rank, stages)
    stage = counters.TimedStage(part, rank, stages, torch.device(device)) if stages > 1 else None
    schedule = SCHEDULES[args.schedule](stage, k, loss_fn=F.cross_entropy) if stage else None
    # [4] The LR is not scaled: one batch of --batch-size per step, like one process (no warmup)
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr, momentum=args.momentum)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir[0],
                                master_addr=os.environ["MASTER_ADDR"]), FRAMEWORK)
    wire, timing = counters.WireBytes(), []
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(part, schedule, stage, optimizer, loader, epoch, steps, args, wire,
                            timing)
        train_time = counters.slowest(time.perf_counter() - start, device)
        sums = torch.tensor(train + evaluate(part, test_loader, device, args.width),
                            dtype=torch.float64).to(device)
        if world_size > 1:  # [7] Metrics: only the last stage has them; it sends them to all
            dist.broadcast(sums, src=stages - 1)
        run.epoch_end(epoch, sums.tolist(), args.lr, time.perf_counter() - start, train_time)

    # The summary: the whole model (stages gathered), what each stage holds, sent and waited for
    mine = {name: t.cpu() for name, t in part.state_dict().items()}
    state = {name: t for each in counters.gather(mine) for name, t in each.items()}
    if args.save_model and rank == 0:  # [8] one writer: rank 0 saves the gathered full weights
        log.atomic_write(Path(log_dir[0]) / "model.pt", lambda f: torch.save(state, f), mode="wb")
    run.summary({"weights_checksum": counters.checksum(state), **counters.pipeline_report(
        part, stage, state, timing, wire, k, args.schedule), "device": device,
        "world_size": world_size, "launcher": launcher, "framework": FRAMEWORK})
    dist.destroy_process_group() if world_size > 1 else None


if __name__ == "__main__":
    parser = common.parser(__doc__, ranks=who_am_i()[2], schedules=sorted(SCHEDULES))  # checked
    plumbing.run_main(main, parser) if plumbing else main(parser.parse_args())
