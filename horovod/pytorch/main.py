#!/usr/bin/env python
"""MNIST with Horovod and PyTorch.

Runs as one process, or as N under horovodrun (gloo or MPI controller) or a plain MPI launcher:
    python horovod/pytorch/main.py
    horovodrun -np 2 --gloo python horovod/pytorch/main.py
    mpiexec -n 2 python horovod/pytorch/main.py
The numbered comments ([hvd N]) are Horovod's recipe; horovod/README.md explains each step.
"""
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F

# The repo root goes *after* site-packages, so our horovod/ folder never shadows the installed library.
sys.path.append(str(Path(__file__).resolve().parents[2]))
from utils import data, dist, log  # noqa: E402
from utils.parse_args import clip_flag, get_parser, parse, positive_float, positive_int  # noqa: E402
from utils.schedule import lr_at, scaled_lr  # noqa: E402
from utils.torch_utils import (Net, index_batches, load_checkpoint, param_checksum, restore,  # noqa: E402
                               save_checkpoint, seed_epoch, to_tensors)

FRAMEWORK = "horovod-pytorch"


def horovod_flags(parser):
    g = parser.add_argument_group("horovod")
    g.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16 for the all-reduce")
    g.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum instead of averaging")
    g.add_argument("--gradient-predivide-factor", type=positive_float, default=1.0,
                   help="divide gradients by this before the sum and by size/factor after (numerics of big worlds)")
    g.add_argument("--backward-passes-per-step", dest="grad_accum", type=positive_int,
                   help="Horovod's name for --grad-accum: local backward passes before each all-reduce")
    return parser


def all_sum(values, env):
    """[hvd 7] Sum a few numbers over all ranks (metrics), so every rank reports the global value."""
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name="metrics").tolist()


def all_max(value, env):
    return hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name="max").item()


def train_epoch(model, optimizer, x, y, steps, epoch, lr_of_step, env, args):
    model.train()
    loss_sum, correct = 0.0, 0
    progress = log.Progress(env.is_main, len(steps), epoch, args.log_interval)
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of_step(step)
        optimizer.zero_grad()
        for k, idx in enumerate(micro_batches):  # one micro-batch unless --grad-accum
            output = model(x[idx])
            loss = F.nll_loss(output, y[idx])
            # [hvd 5] each gradient's all-reduce starts in the background as soon as backward produces it
            # (after the last of --backward-passes-per-step passes, when accumulating)
            (loss / len(micro_batches)).backward()
            loss_sum += loss.item() * len(idx)
            correct += (output.argmax(1) == y[idx]).sum().item()
        if args.clip_grad_norm:  # clip the *averaged* gradient: wait for the all-reduce first
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()  # [hvd 6] waits for the averaged gradients, then updates identical weights everywhere
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
    args = parse(clip_flag(horovod_flags(get_parser(__doc__))))
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    # Horovod reads its knobs at init: on CPU a longer cycle time (utils/dist.py; README, Performance)
    knobs = dist.horovod_knobs(on_cpu=args.device == "cpu" or not torch.cuda.is_available(),
                               dist_timeout=args.dist_timeout)
    hvd.init()  # [hvd 1] start Horovod: rank, size and local rank come from horovodrun or MPI
    env = dist.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), dist.discover().launcher,
                       backend="horovod-" + ("mpi" if hvd.mpi_enabled() else "gloo"))
    env = dist.configure_device(env, args)  # [hvd 2] pin one GPU per process: cuda:<local rank>
    log.configure(env.rank, args.log_all_ranks)
    if args.use_adasum and not hvd.mpi_enabled():
        raise log.UserError("--use-adasum needs the MPI controller (mpiexec, horovodrun --mpi): gloo has no Adasum")
    log_dir = args.log_dir or hvd.broadcast_object(log.default_log_dir("horovod-pytorch"), root_rank=0)
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher}, device {env.device}, "
             f"{env.backend} controller, {env.num_threads} thread(s) per rank, "
             f"HOROVOD_CYCLE_TIME {knobs['HOROVOD_CYCLE_TIME']}")

    # --- data: every rank loads the set, then trains on its own shard -----------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=hvd.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    test_idx = torch.from_numpy(data.test_shard(len(y_test), env.rank, env.world_size)).to(env.device)

    # --- model and optimizer ---------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    # [hvd 3] scale the LR by the number of workers (Adasum adapts to the gradients instead: no scaling)
    lr = scaled_lr(args.lr, env.world_size * args.grad_accum, not (args.no_lr_scaling or args.use_adasum))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    # [hvd 4] wrap the optimizer: it all-reduces gradients (optionally fp16-compressed, or with Adasum)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor, backward_passes_per_step=args.grad_accum)
    checkpoint = Path(args.checkpoint_dir or Path(log_dir) / "checkpoints") / "checkpoint.pt"
    first_epoch = 1
    if args.resume and env.is_main:  # rank 0 reads the checkpoint; the broadcast below hands it to everyone
        first_epoch = restore(model, optimizer, load_checkpoint(checkpoint, env.device), checkpoint) + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0)
    run.keep_epochs_before(first_epoch)
    # [hvd 4b] start every rank from rank 0's weights and optimizer state (random init or checkpoint)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr,
                                                 "horovod_knobs": knobs})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)
        # [hvd 0] shard by the *global* rank (the original workshop script used the local rank: wrong on >1 node)
        steps = data.epoch_batches(len(y_train), args.batch_size, env.rank, env.world_size,
                                   args.seed, epoch, args.max_steps, args.grad_accum)
        steps = index_batches(steps, env.device)

        def lr_of_step(step):
            return lr_at(epoch - 1 + step / len(steps), args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, x_train, y_train, steps, epoch, lr_of_step, env, args)
        train_time = all_max(time.perf_counter() - start, env)
        test = evaluate(model, x_test, y_test, test_idx, args.test_batch_size)
        run.epoch_end(epoch, all_sum(train + test, env), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time, env, FRAMEWORK)
        if env.is_main:  # one writer; the file is replaced atomically
            save_checkpoint(checkpoint, {"model": model.state_dict(),
                                         "optimizer": optimizer.state_dict(), "epoch": epoch})

    # --- summary ---------------------------------------------------------------------------------
    checksums = hvd.allgather_object(param_checksum(model))  # identical on every rank, or something is broken
    if args.save_model and env.is_main:
        save_checkpoint(Path(log_dir) / "model.pt", model.state_dict())
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    hvd.shutdown()


if __name__ == "__main__":
    log.run_main(main)
