#!/usr/bin/env python
"""MNIST with Horovod and PyTorch; [1]-[8]: the recipe (horovod/pytorch/README.md explains).

    python horovod/pytorch/main.py                              one process
    horovodrun -np 2 --gloo python horovod/pytorch/main.py      two ranks
    mpiexec -n 2 python horovod/pytorch/main.py                 two ranks, Horovod over MPI
"""
import hashlib
import os
import sys
import time
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and run files
from utils.parse_args import clip_flag, get_parser, positive_float, positive_int

# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms to agree on the next all-reduce
# (default 1): on CPU ranks that share cores, 5 ms leaves them more time to compute.
CPU_KNOBS = {"HOROVOD_CYCLE_TIME": "5"}


def horovod_flags(parser):
    g = parser.add_argument_group("horovod").add_argument
    g("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
    g("--use-adasum", action="store_true", help="combine gradients with Adasum, not the average")
    g("--gradient-predivide-factor", type=positive_float, default=1.0, help="divide gradients by "
      "this before the sum and by size/factor after (numerics of big worlds)")
    g("--backward-passes-per-step", dest="grad_accum", type=positive_int,
      help="Horovod's name for --grad-accum: local backward passes before each all-reduce")
    return parser


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
        for x, y in micro_batches:
            output = model(x)
            loss = F.nll_loss(output, y)
            # [6] gradients averaged: each one's all-reduce starts on Horovod's background thread as
            #     soon as backward has produced it (--grad-accum: after the step's last backward).
            (loss / len(micro_batches)).backward()
            sums = [sums[0] + loss.item() * len(y), sums[1] + (output.argmax(1) == y).sum().item(),
                    sums[2] + len(y)]
        if args.clip_grad_norm:  # clip the *averaged* gradient: wait for the all-reduces first
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()  # [6] waits for the averaged gradients: the same update everywhere
        progress.update(step + 1, loss.item())
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
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    cuda = gpu is not None and gpu.type == "cuda" and args.device != "cpu"
    if gpu is not None and gpu.type == "xpu" and args.device != "cpu":  # not in Horovod, nor Aurora
        sys.exit("error: Horovod cannot train on Intel GPUs: on Aurora use DDP/main.py (xccl)")
    for name, value in ({} if cuda else CPU_KNOBS).items():  # read by hvd.init(): set them first
        os.environ.setdefault(name, value)
    # --dist-timeout bounds every gloo operation of Horovod's, as it bounds DDP's collectives
    os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(args.dist_timeout))
    # [1] Start Horovod: rank, local rank and size come from horovodrun or the MPI launcher.
    hvd.init()
    e, rank, size = os.environ, hvd.rank(), hvd.size()  # the launcher's name, for the logs:
    launcher = ("horovodrun" if "HOROVOD_RANK" in e else "python" if size == 1 else "srun" if
                "SLURM_STEP_ID" in e and "MPI_LOCALRANKID" not in e else "mpiexec")
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    if args.use_adasum and not hvd.mpi_enabled():
        sys.exit("error: --use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): "
                 "gloo has no Adasum")
    # [2] Pin this rank to one GPU: number = local rank. On CPUs: its share of the cores.
    device = f"cuda:{hvd.local_rank() % torch.cuda.device_count()}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count()
                                   else max(1, cores // hvd.local_size()))
    torch.set_num_threads(threads)
    log.configure(rank, hvd.local_rank(), args.log_all_ranks)
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-pytorch"))
    run = log.RunLog(log_dir, rank == 0)
    mnist = data.load_mnist(args.data_dir, args.download, rank == 0, barrier=hvd.barrier)
    knobs = {name: os.environ.get(name, "Horovod's default") for name in CPU_KNOBS}
    log.info(f"horovod-pytorch: {size} rank(s) via {launcher}, device {device}, {controller} "
             f"controller, {threads} thread(s) per rank, HOROVOD_CYCLE_TIME "
             f"{knobs['HOROVOD_CYCLE_TIME']}\n{mnist.describe()}")
    sets = [TensorDataset(torch.from_numpy(data.normalized(x)).unsqueeze(1).to(device),
                          torch.from_numpy(y).to(device))
            for x, y in ((mnist.x_train, mnist.y_train), (mnist.x_test, mnist.y_test))]
    # [3] Shard by *global* rank (hvd.rank(), not hvd.local_rank(): that repeats on every node):
    #     each rank draws its own 1/size of every shuffled epoch; --grad-accum A: it plays A ranks.
    A = args.grad_accum
    log.grad_accum(A, size)  # A > 1: says so
    steps = data.batches_per_rank(len(sets[0]), size * A, args.batch_size, args.max_steps)
    loaders = [DataLoader(sets[0], batch_size=args.batch_size, drop_last=True, sampler=(
        DistributedSampler(sets[0], num_replicas=size * A, rank=rank * A + k, seed=args.seed,
                           drop_last=True))) for k in range(A)]
    test_loader = DataLoader(sets[1], batch_size=args.test_batch_size, sampler=DistributedSampler(
        sets[1], num_replicas=size, rank=rank, shuffle=False))
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(device)
    # [4] Scale the LR with the global batch (Adasum adapts to the gradients instead: no scaling).
    lr = args.lr if args.no_lr_scaling or args.use_adasum else args.lr * size * A
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    # [5] Wrap the optimizer: it all-reduces the gradients (fp16-compressed or Adasum, if asked).
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor, backward_passes_per_step=A)
    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir) / "checkpoint.pt"
    first_epoch = 1
    if args.resume and checkpoint.exists() and rank == 0:  # [8] rank 0 reads; [5] sends it on
        state = torch.load(checkpoint, map_location=device, weights_only=True)  # no code runs
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0)
    run.keep_epochs_before(first_epoch)
    # [5] Start every rank from rank 0's weights and optimizer state (its init, or the checkpoint)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def lr_of(progress):  # --lr-warmup-epochs W: linear from the base LR to the scaled one
        W = args.lr_warmup_epochs
        return args.lr + (lr - args.lr) * progress / W if W and progress < W else lr
    run.write_config(args, dict(rank=rank, local_rank=hvd.local_rank(), world_size=size,
                                local_world_size=hvd.local_size(), launcher=launcher,
                                device=device, backend=controller, num_threads=threads,
                                log_dir=log_dir, scaled_lr=lr, horovod_knobs=knobs),
                     "horovod-pytorch")
    for epoch in range(first_epoch, args.epochs + 1):
        torch.manual_seed(args.seed + 1000 * epoch + rank)  # dropout: a resumed run draws the same
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(model, optimizer, loaders, epoch, lr_of, steps, args, rank == 0)
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        train_time = hvd.allreduce(seconds, op=hvd.Max, name="time").item()  # the slowest rank's
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64)
        sums = hvd.allreduce(sums, op=hvd.Sum, name="metrics")  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time)
        if rank == 0:  # [8] one writer, through a temporary file: a kill keeps the old checkpoint
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch}
            log.atomic_write(checkpoint, lambda f: torch.save(state, f), mode="wb")
    weights = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    checksum = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
    checksums = hvd.allgather_object(checksum)  # all equal, or something broke
    if args.save_model and rank == 0:
        torch.save(model.state_dict(), Path(log_dir) / "model.pt")
    run.summary({"param_checksums": checksums, "device": device})
    hvd.shutdown()  # Horovod's background thread joined: the interpreter's teardown finds it gone


if __name__ == "__main__":
    parser = clip_flag(horovod_flags(get_parser(__doc__, backend=False)))
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
