#!/usr/bin/env python
"""MNIST with PyTorch DistributedDataParallel (DDP).

    python DDP/main.py                          one process
    torchrun --nproc_per_node 2 DDP/main.py     two ranks
    mpiexec -n 2 python DDP/main.py             two ranks under MPI (also: srun, in a Slurm job)

The numbered comments [1]-[8] are the course's recipe: the same number marks the same step in every
lesson (README.md, "The recipe"); DDP/README.md explains each line.
"""
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
import utils

utils.course_output()  # course plumbing: a missing framework is one line; noise filtered

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, failures, log, runfiles
from utils import dist as course  # which variables each launcher sets; metrics functions
from utils.parse_args import clip_flag, finished_already, get_parser, parse, resuming
from utils.schedule import lr_at, scaled_lr
from utils.torch_utils import (
    Net,
    load_checkpoint,
    param_checksum,
    restore,
    save_checkpoint,
    seed_epoch,
    steps_per_epoch,
    to_tensors,
)

FRAMEWORK = "pytorch-ddp"


def train_epoch(model, optimizer, loaders, epoch, lr_of, env, args):
    model.train()
    loss_sum, correct, seen = 0.0, 0, 0
    steps = steps_per_epoch(loaders, args.max_steps)
    progress = log.Progress(env.is_main, steps, epoch, args.log_interval)
    # One micro-batch per step, or --grad-accum of them: one from each loader.
    for step, micro_batches in enumerate(islice(zip(*loaders), steps)):
        for group in optimizer.param_groups:
            group["lr"] = lr_of(step / steps)
        optimizer.zero_grad()
        for k, (x, y) in enumerate(micro_batches):
            # [6] gradients averaged: DDP all-reduces them in buckets *during* backward. With
            #     --grad-accum, no_sync() skips that until the step's last micro-batch.
            last = k == len(micro_batches) - 1
            with nullcontext() if last or not env.distributed else model.no_sync():
                output = model(x)
                loss = F.nll_loss(output, y)
                (loss / len(micro_batches)).backward()
            loss_sum += loss.item() * len(y)
            correct += (output.argmax(1) == y).sum().item()
            seen += len(y)
        if args.clip_grad_norm:  # averaged by now: every rank clips the same vector
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        progress.update(step + 1, loss.item())
    progress.close()
    return [loss_sum, correct, seen]


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:
        output = model(x)
        loss_sum += F.nll_loss(output, y, reduction="sum").item()
        correct += (output.argmax(1) == y).sum().item()
        seen += len(y)
    return [loss_sum, correct, seen]


def main():
    args = parse(clip_flag(get_parser(__doc__)))
    if finished_already(args):  # --resume auto on a run that is done: touch nothing
        return
    wall_start = time.perf_counter()

    # [1] Who am I? The launcher's variables give this process's rank, its local rank on this node
    #     and the world size (torchrun: RANK...; mpiexec: PMI_RANK...; srun: SLURM_PROCID...: the
    #     table in utils/dist.py).
    env = course.export_rendezvous(course.discover())  # + MASTER_ADDR/PORT, where the ranks meet
    # [2] Pin this rank to one device before anything touches it: GPU (or Aurora tile) number =
    #     local rank. On CPUs: its share of the cores, so that N ranks on a node do not fight.
    device = course.pick_device(args.device, env.local_rank)
    if device != "cpu":  # one call for NVIDIA (cuda:N) and Intel (xpu:N): torch.cuda/xpu.set_device
        torch.accelerator.set_device_index(device)
    num_threads = course.threads_per_rank(args.num_threads, env.local_world_size)
    torch.set_num_threads(num_threads)
    # [1] Start the process group: returns when all world_size ranks have joined at
    #     MASTER_ADDR:MASTER_PORT.
    backend = "none"
    if env.distributed:
        backend = course.pick_backend(args.backend, device)  # Intel xccl, NVIDIA nccl, CPU gloo
        # A dead peer ends the job after --dist-timeout instead of hanging it. The store is None
        # (the default), except in a worker that torchrun restarted.
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=args.dist_timeout),
                                store=course.restart_store(env))
    env = replace(env, device=device, backend=backend, num_threads=num_threads)  # env, now complete
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    # --log-dir, or a folder named by rank 0's clock (the same name on every rank)
    log_dir = args.log_dir or course.broadcast_object(runfiles.default_log_dir("ddp"))
    run = runfiles.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"backend {env.backend}, {env.num_threads} thread(s) per rank")

    # --- data: every rank holds the whole (small) set in memory and trains on its own shard ------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=course.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    # [3] Shard by *global* rank: each rank draws its own 1/world_size of every shuffled epoch (the
    #     same permutation everywhere, seeded). --grad-accum A: a rank plays A ranks of a world A
    #     times larger.
    A = args.grad_accum
    log.grad_accum(A, env.world_size)  # A > 1: says so
    loaders = [DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                          sampler=DistributedSampler(train_set, num_replicas=env.world_size * A,
                                                     rank=env.rank * A + k, shuffle=True,
                                                     seed=args.seed, drop_last=True))
               for k in range(A)]
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=DistributedSampler(
        test_set, num_replicas=env.world_size, rank=env.rank, shuffle=False))

    # --- model and optimizer ----------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    # [4] Scale the LR with the global batch: world_size (x grad-accum) times one rank's batch.
    lr = scaled_lr(args.lr, env.world_size * A, not args.no_lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    checkpoint = runfiles.checkpoint_folder(args.checkpoint_dir, log_dir) / "checkpoint.pt"
    first_epoch = 1
    if resuming(args):  # [8] every rank reads the same file: all start from identical weights
        state = load_checkpoint(checkpoint, env.device)
        first_epoch = restore(model, optimizer, state, checkpoint) + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    if env.distributed:
        # [5] Wrap the model: DDP broadcasts rank 0's weights to every rank, then hooks [6] into
        #     backward.
        model = DDP(model, device_ids=None if env.device == "cpu" else [env.device])
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)  # dropout masks: a resumed run draws the same ones
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank

        def lr_of(fraction):  # --lr-warmup-epochs: linear from the base LR to the scaled one
            return lr_at(epoch - 1 + fraction, args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, loaders, epoch, lr_of, env, args)
        train_time = course.all_max(time.perf_counter() - start, env)  # the slowest rank's time
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64,
                            device=env.device)
        if env.distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time, env, FRAMEWORK)
        if env.is_main:  # [8] one writer; the file is replaced atomically
            save_checkpoint(checkpoint, {"model": getattr(model, "module", model).state_dict(),
                                         "optimizer": optimizer.state_dict(), "epoch": epoch})

    # --- summary ---------------------------------------------------------------------------------
    # The weights' checksum from every rank: all equal, or DDP is broken.
    checksums = course.gather_object(param_checksum(model))
    if args.save_model and env.is_main:
        save_checkpoint(Path(log_dir) / "model.pt", getattr(model, "module", model).state_dict())
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    course.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
