#!/usr/bin/env python
"""MNIST with PyTorch DistributedDataParallel (DDP).

Runs as one process, or as N under torchrun / mpiexec / srun / aprun:
    python DDP/main.py
    torchrun --nproc_per_node 2 DDP/main.py
    mpiexec -n 2 python DDP/main.py
The numbered comments ([ddp N]) are the lines that make it distributed; DDP/README.md explains each.
"""
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# The repo root goes *after* site-packages, so our folders never shadow an installed library.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from utils import data, dist, log  # noqa: E402
from utils.parse_args import clip_flag, get_parser, parse  # noqa: E402
from utils.schedule import lr_at, scaled_lr  # noqa: E402
from utils.torch_utils import (Net, index_batches, load_checkpoint, param_checksum, restore,  # noqa: E402
                               save_checkpoint, seed_epoch, to_tensors)

FRAMEWORK = "pytorch-ddp"


def train_epoch(model, optimizer, x, y, steps, epoch, lr_of_step, env, args):
    model.train()
    loss_sum, correct = 0.0, 0
    progress = log.Progress(env.is_main, len(steps), epoch, args.log_interval)
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of_step(step)
        optimizer.zero_grad()
        for k, idx in enumerate(micro_batches):  # one micro-batch unless --grad-accum
            last = k == len(micro_batches) - 1
            # [ddp 4] DDP all-reduces (averages) gradients in buckets while backward runs; with gradient
            # accumulation, no_sync() skips that until the last micro-batch of the step.
            with nullcontext() if last or not env.distributed else model.no_sync():
                output = model(x[idx])
                loss = F.nll_loss(output, y[idx])
                (loss / len(micro_batches)).backward()
            loss_sum += loss.item() * len(idx)
            correct += (output.argmax(1) == y[idx]).sum().item()
        if args.clip_grad_norm:  # the gradients are averaged by now: every rank clips the same vector
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        progress.update(step + 1, loss.item())
    progress.close()
    return loss_sum, correct, len(steps) * args.grad_accum * args.batch_size


@torch.no_grad()
def evaluate(model, x, y, indices, batch_size):
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(indices), batch_size):
        idx = indices[start:start + batch_size]
        output = model(x[idx])
        loss_sum += F.nll_loss(output, y[idx], reduction="sum").item()
        correct += (output.argmax(1) == y[idx]).sum().item()
    return loss_sum, correct, len(indices)


def main():
    args = parse(clip_flag(get_parser(__doc__)))
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    env = dist.init_torch(args)  # [ddp 1] rank/world from the launcher; init_process_group
    log.configure(env.rank, args.log_all_ranks)
    log_dir = args.log_dir or log.default_log_dir("ddp")
    if env.distributed:  # every rank writes to rank 0's log dir (its default has a timestamp)
        log_dir = log_dir if args.log_dir else dist.broadcast_object(log_dir)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"backend {env.backend}, {env.num_threads} thread(s) per rank")

    # --- data: every rank loads the set, then trains on its own shard -----------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=dist.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    test_idx = torch.from_numpy(data.test_shard(len(y_test), env.rank, env.world_size)).to(env.device)

    # --- model and optimizer ---------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    lr = scaled_lr(args.lr, env.world_size * args.grad_accum, not args.no_lr_scaling)  # [ddp 2] linear LR scaling
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    checkpoint = Path(args.checkpoint_dir or Path(log_dir) / "checkpoints") / "checkpoint.pt"
    first_epoch = 1
    if args.resume:  # every rank reads the same file, so all start from identical weights
        first_epoch = restore(model, optimizer, load_checkpoint(checkpoint, env.device), checkpoint) + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    if env.distributed:
        # [ddp 3] wrap the model: broadcasts rank 0's weights, then hooks gradient all-reduce into backward
        model = DDP(model, device_ids=[env.local_rank] if env.device.startswith("cuda") else None)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)
        steps = data.epoch_batches(len(y_train), args.batch_size, env.rank, env.world_size,  # [ddp 0] shard
                                   args.seed, epoch, args.max_steps, args.grad_accum)
        steps = index_batches(steps, env.device)

        def lr_of_step(step):
            return lr_at(epoch - 1 + step / len(steps), args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, x_train, y_train, steps, epoch, lr_of_step, env, args)
        train_time = dist.all_max(time.perf_counter() - start, env)
        test = evaluate(model, x_test, y_test, test_idx, args.test_batch_size)
        # [ddp 5] sum the metrics over ranks, so every number printed is global
        run.epoch_end(epoch, dist.all_sum(train + test, env), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time, env, FRAMEWORK)
        if env.is_main:  # one writer; the file is replaced atomically
            save_checkpoint(checkpoint, {"model": getattr(model, "module", model).state_dict(),
                                         "optimizer": optimizer.state_dict(), "epoch": epoch})

    # --- summary ---------------------------------------------------------------------------------
    checksums = dist.gather_object(param_checksum(model))  # identical on every rank, or DDP is broken
    if args.save_model and env.is_main:
        save_checkpoint(Path(log_dir) / "model.pt", getattr(model, "module", model).state_dict())
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    dist.shutdown()


if __name__ == "__main__":
    log.run_main(main)
