#!/usr/bin/env python
"""MNIST with DeepSpeed: ZeRO stages 0-3, CPU offload; [1]-[8]: the recipe (its README explains).

    python deepspeed/main.py                        one process
    deepspeed --num_gpus 2 deepspeed/main.py        two ranks (on CPUs --num_gpus counts processes)
    torchrun --nproc_per_node 2 deepspeed/main.py   (also: mpiexec -n 2 python deepspeed/main.py)
    ... --zero-stage 3 --offload                    the config file is deepspeed/ds_config.json
"""
import hashlib
import os
import sys
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): noise filtered, flags and the
    from course import plumbing  # config checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import deepspeed  # the library: this folder has no __init__.py, and the repo root comes last
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.checkpoint import constants as ckpt
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files
from utils.parse_args import deepspeed_config, deepspeed_flags, get_parser

# What each launcher sets: rank, local rank, world size, ranks on this node (DDP/main.py's table).
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


def Net(dropout):  # pytorch/examples' MNIST CNN (1.2M parameters), as one nn.Sequential
    return nn.Sequential(nn.Conv2d(1, 32, 3, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Dropout(dropout), nn.Flatten(), nn.Linear(9216, 128),
                         nn.ReLU(), nn.Dropout(2 * dropout), nn.Linear(128, 10), nn.LogSoftmax(1))


def train_epoch(engine, loaders, epoch, lr, steps, args, is_main):
    engine.train()
    sums = [0.0, 0, 0]  # loss, correct, seen
    progress = log.Progress(is_main, steps, epoch, args.log_interval)
    for step, micro_batches in enumerate(islice(zip(*loaders), steps)):  # one from each loader
        at, W = epoch - 1 + step / steps, args.lr_warmup_epochs  # --lr-warmup-epochs W: linear
        for group in engine.optimizer.param_groups:  # from the base LR to the scaled one
            group["lr"] = args.lr + (lr - args.lr) * at / W if W and at < W else lr
        for x, y in micro_batches:
            output = engine(x)
            loss = F.nll_loss(output, y)
            engine.backward(loss)  # [6] gradients averaged over ranks (ZeRO-2/3: each keeps its
            engine.step()  # partition); the update after the step's micro-batches, then zeroed
            sums = [sums[0] + loss.item() * len(y), sums[1] + (output.argmax(1) == y).sum().item(),
                    sums[2] + len(y)]
        progress.update(step + 1, loss.item())
    return sums


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    sums = [0.0, 0, 0]
    for x, y in loader:
        output = engine(x)
        sums = [sums[0] + F.nll_loss(output, y, reduction="sum").item(),
                sums[1] + (output.argmax(1) == y).sum().item(), sums[2] + len(y)]
    return sums


def main(args):
    # [1] Who am I, and where do the ranks meet? As in DDP/main.py (deepspeed sets torchrun's names)
    rank, local_rank, world_size, local_size, launcher = who_am_i()
    if launcher == "torchrun" and "TORCHELASTIC_RUN_ID" not in os.environ:
        launcher, local_size = "deepspeed", int(os.environ.get("LOCAL_SIZE", local_size))
    if world_size > 1 and "MASTER_ADDR" not in os.environ and local_size < world_size:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    # [2] Pin this rank to one device, as in DDP/main.py, in DeepSpeed's accelerator layer too
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    gpu = gpu.type if gpu and gpu.type in ("cuda", "xpu") and args.device != "cpu" else None
    device = f"{gpu}:{local_rank % torch.accelerator.device_count()}" if gpu else "cpu"
    if gpu:
        get_accelerator().set_device(torch.device(device).index)  # cuda:N, xpu:N
    else:  # else the engine moves the model to the GPU it sees; shm_comm: inference only, no build
        set_accelerator(CPU_Accelerator())
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count() else max(1, cores // local_size))
    torch.set_num_threads(threads)
    vendor = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # [1] join, via DeepSpeed's layer
    backend = vendor if args.backend == "auto" else args.backend  # (below: no MPI discovery)
    wait = timedelta(seconds=args.dist_timeout)
    keys = meeting_place(rank, world_size, wait)
    if keys is not None:  # one process, or a restarted attempt: DeepSpeed's layer takes this group
        dist.init_process_group(backend, store=keys, rank=rank, world_size=world_size, timeout=wait)
    deepspeed.init_distributed(backend, auto_mpi_discovery=False, verbose=False, timeout=wait)
    log.configure(rank, local_rank, args.log_all_ranks)
    log_dir = [args.log_dir or log.default_log_dir("deepspeed")]  # runs/deepspeed-<rank 0's time>
    dist.broadcast_object_list(log_dir, src=0)
    run = log.RunLog(log_dir[0], rank == 0)
    config = deepspeed_config(args)  # DeepSpeed's JSON file, with the flags written over it
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0, barrier=dist.barrier)
    log.info(f"deepspeed {deepspeed.__version__}: {world_size} rank(s) via {launcher}, device "
             f"{device}, backend {backend}, {threads} thread(s) per rank, ZeRO stage "
             f"{config['zero_optimization']['stage']}{' + CPU offload' * args.offload}\n"
             f"{mnist.describe()}")
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(device)
    # [5] The engine: broadcasts rank 0's weights, builds the config's optimizer (ZeRO: partitioned)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    # [4] Scale the LR with the global batch: ranks x the engine's micro-batches per step.
    A = engine.gradient_accumulation_steps()
    lr = args.lr * world_size * A if not args.no_lr_scaling else args.lr
    dtype = next(engine.parameters()).dtype  # the engine cast the weights (bf16?), not the inputs
    sets = [TensorDataset(torch.from_numpy(data.normalized(x)).unsqueeze(1).to(device, dtype),
                          torch.from_numpy(y).to(device))
            for x, y in ((mnist.x_train, mnist.y_train), (mnist.x_test, mnist.y_test))]
    # [3] Shard by *global* rank (DDP/main.py); test shards padded alike: ZeRO-3 gathers per forward
    log.grad_accum(A, world_size)  # A > 1: says so
    batch = engine.train_micro_batch_size_per_gpu()
    steps = data.batches_per_rank(len(sets[0]), world_size * A, batch, args.max_steps)
    loaders = [DataLoader(sets[0], batch_size=batch, drop_last=True, sampler=DistributedSampler(
        sets[0], num_replicas=world_size * A, rank=rank * A + k, seed=args.seed, drop_last=True))
        for k in range(A)]
    test_loader = DataLoader(sets[1], batch_size=args.test_batch_size, sampler=DistributedSampler(
        sets[1], num_replicas=world_size, rank=rank, shuffle=False))
    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir[0])
    first_epoch, latest = 1, checkpoint / ("latest_universal" if args.load_universal else "latest")
    if args.resume and latest.exists():  # [8] every rank loads its own ZeRO partition
        loaded, state = engine.load_checkpoint(checkpoint)
        first_epoch = state["epoch"] + 1
        log.info(f"resumed from {loaded}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    run.write_config(args, dict(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_size,
        launcher=launcher, device=device, backend=backend, num_threads=threads, scaled_lr=lr,
        log_dir=log_dir[0], master_addr=os.environ["MASTER_ADDR"], ds_config=config), "deepspeed")
    for epoch in range(first_epoch, args.epochs + 1):
        torch.manual_seed(args.seed + 1000 * epoch + rank)  # dropout: a resumed run draws the same
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(engine, loaders, epoch, lr, steps, args, rank == 0)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums = torch.tensor(train + evaluate(engine, test_loader), dtype=torch.float64).to(device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), engine.optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time.item())
        # [8] a collective: every rank writes its partition (stamped for ds_to_universal), then
        engine.save_checkpoint(checkpoint, tag=f"epoch{epoch}", save_latest=False, client_state={
            "epoch": epoch, ckpt.UNIVERSAL_CHECKPOINT_INFO: {
                ckpt.UNIVERSAL_CHECKPOINT_VERSION_KEY: ckpt.UNIVERSAL_CHECKPOINT_VERSION_VALUE}})
        if rank == 0:  # rank 0 points `latest` at them, after a barrier, through a temporary file
            log.atomic_write(checkpoint / "latest", lambda f: f.write(f"epoch{epoch}"))
    with deepspeed.zero.GatheredParameters(list(engine.parameters())):  # ZeRO-3: 1/N on a rank
        weights = torch.cat([p.detach().float().flatten().cpu() for p in engine.parameters()])
        if args.save_model and rank == 0:  # the whole model
            torch.save(engine.module.state_dict(), Path(log_dir[0]) / "model.pt")
    checksums = [None] * world_size
    dist.all_gather_object(checksums, hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16])
    run.summary({"param_checksums": checksums, "device": device})  # all equal, or ZeRO is broken
    dist.barrier()  # every rank past its last collective, then the groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = deepspeed_flags(get_parser(__doc__))
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. DeepSpeed's engine keeps gloo's
    # groups, and their threads, alive past destroy_process_group(), and the teardown can then abort
    # a finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
