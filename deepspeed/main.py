#!/usr/bin/env python
"""MNIST with DeepSpeed: ZeRO stages 0-3, CPU offload; [1]-[8]: the recipe (its README explains).

    python deepspeed/main.py                        one process
    deepspeed --num_gpus 2 deepspeed/main.py        two ranks (on CPUs --num_gpus counts processes)
    torchrun --nproc_per_node 2 deepspeed/main.py   (also: mpiexec -n 2 python deepspeed/main.py)
    ... --zero-stage 3 --offload                    the config file is deepspeed/ds_config.json
"""
import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
import utils

utils.course_output()  # course plumbing: a missing framework is one line; noise filtered

import deepspeed  # the library: this folder has no __init__.py, and the repo root comes last
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import checks, data, ds_checkpoint, ds_config, failures, log
from utils import dist as course  # which variables each launcher sets; metrics functions
from utils.errors import fail
from utils.framework_flags import deepspeed_flags
from utils.parse_args import get_parser
from utils.schedule import lr_at, scaled_lr
from utils.torch_utils import (
    Net,
    param_checksum,
    save_checkpoint,
    seed_epoch,
    steps_per_epoch,
    to_tensors,
)

FRAMEWORK = "deepspeed"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "ds_config.json"


def train_epoch(engine, loaders, epoch, lr_of, env, args):
    engine.train()
    loss_sum, correct, seen = 0.0, 0, 0
    steps = steps_per_epoch(loaders, args.max_steps)
    progress = log.Progress(env.is_main, steps, epoch, args.log_interval)
    # One micro-batch per step, or --grad-accum of them: one from each loader.
    for step, micro_batches in enumerate(islice(zip(*loaders), steps)):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_of(step / steps)
        for x, y in micro_batches:
            output = engine(x)
            loss = F.nll_loss(output, y)
            # [6] gradients averaged: engine.backward reduces them over ranks (ZeRO-2/3: each keeps
            #     its partition); engine.step updates after the step's micro-batches, then zeroes.
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item() * len(y)
            correct += (output.argmax(1) == y).sum().item()
            seen += len(y)
        progress.update(step + 1, loss.item())
    return [loss_sum, correct, seen]


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:
        output = engine(x)
        loss_sum += F.nll_loss(output, y, reduction="sum").item()
        correct += (output.argmax(1) == y).sum().item()
        seen += len(y)
    return [loss_sum, correct, seen]


def main():
    args = checks.parse(deepspeed_flags(get_parser(__doc__)))
    if checks.finished_already(args):  # --resume auto on a run that is done: touch nothing
        return
    course.default_extensions_dir()  # JIT-built ops (cpu_adam): cached outside the checkout
    wall_start = time.perf_counter()
    # [1] Who am I? The launcher's variables give rank, local rank and world size (utils/dist.py).
    env = course.export_rendezvous(course.discover())  # + MASTER_ADDR/PORT (loopback on one host)
    if not env.distributed:  # DeepSpeed wants a process group even for one process: a private one
        os.environ["MASTER_PORT"] = str(course.free_port())
    # [2] Pin this rank to one device: accelerator number = local rank (CPUs: a share of the cores)
    device = course.pick_device(args.device, env.local_rank)
    if device != "cpu":
        get_accelerator().set_device(torch.device(device).index)  # DeepSpeed's layer: cuda, xpu
    else:  # on a GPU node too: DeepSpeed's engine would move the model to the GPU it sees
        set_accelerator(CPU_Accelerator())
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference only: no build
    num_threads = course.threads_per_rank(args.num_threads, env.local_world_size)
    torch.set_num_threads(num_threads)
    backend = course.pick_backend(args.backend, device)  # [1] the group: gloo, or nccl/xccl (GPUs)
    course.group_timeout(timedelta(seconds=args.dist_timeout))  # also the groups DeepSpeed makes
    deepspeed.init_distributed(backend, auto_mpi_discovery=False, verbose=False,  # ... and over it
                               timeout=timedelta(seconds=args.dist_timeout))  # DeepSpeed's comm
    env = replace(env, device=device, backend=backend, num_threads=num_threads)  # env, now complete
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    log_dir = args.log_dir or course.broadcast_object(log.default_log_dir("deepspeed"))
    run = log.RunLog(log_dir, env.is_main)
    ds = ds_config.load(args, env.world_size, DEFAULT_CONFIG)  # the JSON file + the flags, checked
    log.info(f"{FRAMEWORK} {deepspeed.__version__}: {env.world_size} rank(s) via {env.launcher}, "
             f"device {env.device}, backend {env.backend}, {env.num_threads} thread(s) per rank, "
             f"ZeRO stage {ds.stage}{' + CPU offload' if args.offload else ''}")

    # --- model, optimizer and engine -------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    # [4] Scale the LR with the global batch; the optimizer itself is the config's (Adam).
    lr = scaled_lr(args.lr, env.world_size * ds.grad_accum, not args.no_lr_scaling)
    opt_config = ds.config.setdefault("optimizer", {"type": "Adam", "params": {}})
    opt_config.setdefault("params", {})["lr"] = lr
    # [5] The engine: broadcasts rank 0's weights, builds the config's optimizer (ZeRO: partitioned)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds.config)
    ds_checkpoint.use_safe_checkpoints(engine)  # [8] atomic writes, weights_only=True loads

    # --- data: every rank holds the whole (small) set in memory and trains on its own shard ------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=course.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    if engine.bfloat16_enabled() or engine.fp16_enabled():  # the engine casts weights, not inputs
        dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half
        x_train, x_test = x_train.to(dtype), x_test.to(dtype)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    # [3] Shard by *global* rank; --grad-accum A (the config's): a rank plays A ranks. Test shards
    #     are padded to one length: at ZeRO-3 every forward gathers weights, with every rank.
    A = ds.grad_accum
    log.grad_accum(A, env.world_size)  # A > 1: says so
    loaders = [DataLoader(train_set, batch_size=ds.batch_size, drop_last=True,
                          sampler=DistributedSampler(train_set, num_replicas=env.world_size * A,
                                                     rank=env.rank * A + k, shuffle=True,
                                                     seed=args.seed, drop_last=True))
               for k in range(A)]
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=DistributedSampler(
        test_set, num_replicas=env.world_size, rank=env.rank, shuffle=False))

    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir)
    first_epoch = 1
    if checks.resuming(args):  # [8] every rank loads its own ZeRO partition of the optimizer state
        try:
            loaded, client_state = engine.load_checkpoint(checkpoint)
        except Exception as exc:  # truncated, or of another model / stage / world size
            fail(ds_checkpoint.not_loaded(checkpoint, exc))  # says how to change world size
        if loaded is None:
            fail(f"--resume: no DeepSpeed checkpoint in {checkpoint} (no 'latest' file)")
        first_epoch = client_state["epoch"] + 1
        log.info(f"resumed from {loaded}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    run.write_config(args, env.as_dict(), FRAMEWORK,  # what it trained with: the config's batches
                     {"log_dir": log_dir, "scaled_lr": lr, "ds_config": ds.config, "grad_accum": A,
                      "batch_size": ds.batch_size, "deepspeed_config": ds.path})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)  # dropout masks: a resumed run draws the same ones
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank

        def lr_of(fraction):  # --lr-warmup-epochs: linear from the base LR to the scaled one
            return lr_at(epoch - 1 + fraction, args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(engine, loaders, epoch, lr_of, env, args)
        train_time = course.all_max(time.perf_counter() - start, env)  # the slowest rank's time
        sums = torch.tensor(train + evaluate(engine, test_loader), dtype=torch.float64,
                            device=env.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
        run.epoch_end(epoch, sums.tolist(), engine.optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time)
        # [8] a collective: every rank writes its partition, then rank 0 points `latest` at the tag
        ds_checkpoint.save(engine, checkpoint, f"epoch{epoch}", {"epoch": epoch}, env.is_main)

    # --- summary: ZeRO-3 keeps 1/N of every parameter on each rank: gathered for a moment -------
    gathered = deepspeed.zero.GatheredParameters(list(engine.module.parameters())) \
        if engine.zero_optimization_stage() == 3 else torch.no_grad()
    with gathered:
        checksums = course.gather_object(param_checksum(engine.module))  # identical on every rank
        if args.save_model and env.is_main:  # the whole model, in fp32
            save_checkpoint(Path(log_dir) / "model.pt", ds_checkpoint.fp32_weights(engine))
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    course.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
