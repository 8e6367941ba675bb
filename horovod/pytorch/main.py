#!/usr/bin/env python
"""MNIST with Horovod and PyTorch; [1]-[8]: the recipe (horovod/pytorch/README.md explains).

    python horovod/pytorch/main.py                              one process
    horovodrun -np 2 --gloo python horovod/pytorch/main.py      two ranks
    mpiexec -n 2 python horovod/pytorch/main.py                 two ranks, Horovod over MPI
"""
import sys
import time
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the repo root *after* site-packages
import utils

utils.course_output()  # course plumbing: a missing framework is one line; noise filtered

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import checks, data, failures, log
from utils import dist as course  # which variables each launcher sets; Horovod's CPU knobs
from utils.errors import UserError, fail
from utils.framework_flags import horovod_flags
from utils.parse_args import clip_flag, get_parser
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

FRAMEWORK = "horovod-pytorch"


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
        for x, y in micro_batches:
            output = model(x)
            loss = F.nll_loss(output, y)
            # [6] gradients averaged: each one's all-reduce starts on Horovod's background thread as
            #     soon as backward has produced it (with --grad-accum, after the step's last
            #     backward pass).
            (loss / len(micro_batches)).backward()
            loss_sum += loss.item() * len(y)
            correct += (output.argmax(1) == y).sum().item()
            seen += len(y)
        if args.clip_grad_norm:  # clip the *averaged* gradient: wait for the all-reduces first
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()  # [6] waits for the averaged gradients: the same update everywhere
        progress.update(step + 1, loss.item())
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
    parser = horovod_flags(get_parser(__doc__, backend=False), backward_passes=True)
    args = checks.parse(clip_flag(parser))
    if checks.finished_already(args):  # --resume auto on a run that is done: touch nothing
        return
    wall_start = time.perf_counter()

    # Horovod reads its knobs at init: on CPU ranks a longer cycle time (utils/dist.py says why)
    knobs = course.horovod_knobs(on_cpu=args.device == "cpu" or not torch.cuda.is_available(),
                                 dist_timeout=args.dist_timeout)
    # [1] Start Horovod: rank, local rank and size come from horovodrun or the MPI launcher.
    hvd.init()
    # [2] Pin this rank to one device: GPU number = local rank. On CPUs: its share of the cores.
    device = course.pick_device(args.device, hvd.local_rank())
    if device.startswith("xpu"):  # no Intel GPU support in Horovod (nor on Aurora)
        fail(f"Horovod cannot train on {device}: on Intel GPUs (Aurora) use DDP/main.py (xccl)")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    num_threads = course.threads_per_rank(args.num_threads, hvd.local_size())
    torch.set_num_threads(num_threads)
    controller = "horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo")
    env = course.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(),
                         course.discover().launcher, device=device, backend=controller,
                         num_threads=num_threads)
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    if args.use_adasum and not hvd.mpi_enabled():
        raise UserError("--use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): "
                            "gloo has no Adasum")
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-pytorch"),
                                                   root_rank=0)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"{env.backend} controller, {env.num_threads} thread(s) per rank, "
             f"HOROVOD_CYCLE_TIME {knobs['HOROVOD_CYCLE_TIME']}")

    # --- data: every rank holds the whole (small) set in memory and trains on its own shard -------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=hvd.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    # [3] Shard by *global* rank (hvd.rank(), not hvd.local_rank(): that repeats on every node):
    #     each rank draws its own 1/size of every shuffled epoch; --grad-accum A: it plays A ranks.
    A = args.grad_accum
    log.grad_accum(A, hvd.size())  # A > 1: says so
    loaders = [DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                          sampler=DistributedSampler(train_set, num_replicas=hvd.size() * A,
                                                     rank=hvd.rank() * A + k, shuffle=True,
                                                     seed=args.seed, drop_last=True))
               for k in range(A)]
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False))

    # --- model and optimizer ----------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    # [4] Scale the LR with the global batch (Adasum adapts to the gradients instead: no scaling).
    lr = scaled_lr(args.lr, hvd.size() * A, not (args.no_lr_scaling or args.use_adasum))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    # [5] Wrap the optimizer: it all-reduces the gradients (fp16-compressed or Adasum, if asked).
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor, backward_passes_per_step=A)
    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir) / "checkpoint.pt"
    first_epoch = 1
    # [8] rank 0 reads the checkpoint; [5] hands it to every rank
    if checks.resuming(args) and env.is_main:
        state = load_checkpoint(checkpoint, env.device)
        first_epoch = restore(model, optimizer, state, checkpoint) + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0)
    run.keep_epochs_before(first_epoch)
    # [5] Start every rank from rank 0's weights and optimizer state (its random init, or the
    #     checkpoint).
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    run.write_config(args, env.as_dict(), FRAMEWORK,
                     {"log_dir": log_dir, "scaled_lr": lr, "horovod_knobs": knobs})

    # --- train / evaluate -------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)  # dropout masks: a resumed run draws the same ones
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank

        def lr_of(fraction):  # --lr-warmup-epochs: linear from the base LR to the scaled one
            return lr_at(epoch - 1 + fraction, args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, loaders, epoch, lr_of, env, args)
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        train_time = hvd.allreduce(seconds, op=hvd.Max, name="time").item()  # the slowest rank's
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64)
        sums = hvd.allreduce(sums, op=hvd.Sum, name="metrics")  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time)
        if env.is_main:  # [8] one writer; the file is replaced atomically
            save_checkpoint(checkpoint, {"model": model.state_dict(),
                                         "optimizer": optimizer.state_dict(), "epoch": epoch})

    # --- summary ----------------------------------------------------------------------------------
    checksums = hvd.allgather_object(param_checksum(model))  # all equal, or something broke
    if args.save_model and env.is_main:
        save_checkpoint(Path(log_dir) / "model.pt", model.state_dict())
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    hvd.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
