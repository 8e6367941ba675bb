#!/usr/bin/env python
"""MNIST with DeepSpeed: ZeRO stages 0-3, optional CPU offload of the optimizer.

Runs as one process, or as N under the deepspeed launcher / torchrun / mpiexec:
    python deepspeed/main.py
    deepspeed --num_gpus 2 deepspeed/main.py       (on CPUs --num_gpus is the process count; without it: 1)
    torchrun --nproc_per_node 2 deepspeed/main.py
    mpiexec -n 2 python deepspeed/main.py
    ... --zero-stage 3 --offload                   (the config file is deepspeed/ds_config.json)
The numbered comments ([ds N]) are the lines that differ from DDP/main.py; deepspeed/README.md explains each.
"""
import argparse
import datetime
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import deepspeed  # [ds 0] the installed library: this folder has no __init__.py and the repo root goes last

# The repo root goes *after* site-packages, so our folders never shadow an installed library.
sys.path.append(str(Path(__file__).resolve().parents[1]))
from utils import data, dist, ds_checkpoint, ds_config, log  # noqa: E402
from utils.parse_args import get_parser, parse  # noqa: E402
from utils.schedule import lr_at, scaled_lr  # noqa: E402
from utils.torch_utils import (Net, index_batches, param_checksum, save_checkpoint,  # noqa: E402
                               seed_epoch, to_tensors)

FRAMEWORK = "deepspeed"
DEFAULT_CONFIG = Path(__file__).resolve().parent / "ds_config.json"


def add_deepspeed_args(parser):
    """[ds 1] DeepSpeed's own flags (--deepspeed, --deepspeed_config) and this course's shortcuts."""
    deepspeed.add_config_arguments(parser)
    g = parser.add_argument_group("ZeRO")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage of the config (0: plain data parallel)")
    g.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: optimizer states and step on the CPU (stage 1-3; DeepSpeedCPUAdam, a JIT-built op)")
    # The deepspeed launcher appends --local_rank=N to the script's arguments; the rank comes from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.set_defaults(lr=1e-3)  # Adam's usual rate for one rank (the common default is meant for SGD)
    return parser


def init_distributed(args):
    """[ds 2] rank/world from the launcher (our discovery: MASTER_ADDR stays on loopback on one host), then
    deepspeed.init_distributed starts torch.distributed and DeepSpeed's communication layer."""
    # torch deprecates a collective DeepSpeed still calls: one FutureWarning per rank and call site, not ours
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    dist.default_extensions_dir()  # JIT-built ops (cpu_adam for --offload) are cached outside the checkout
    env = dist.prepare(args)
    if env.device == "cpu":
        # The shared-memory all-reduce op (deepspeed_shm_comm) only serves tensor-parallel *inference*
        # (inference_all_reduce); training never calls it, so skip its JIT build (a minute or more).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not env.distributed:  # DeepSpeed wants a process group even for one process: a private one on loopback
        env.backend = "nccl" if env.device.startswith("cuda") else "gloo"
        env.master_port = dist.free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=dist.LOOPBACK, MASTER_PORT=str(env.master_port))
    try:
        deepspeed.init_distributed(env.backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=datetime.timedelta(seconds=args.dist_timeout))
    except Exception as exc:
        log.fail(f"could not start DeepSpeed's process group ({env.backend}) with master "
                 f"{env.master_addr}:{env.master_port}: {str(exc).splitlines()[0]}")
    return env


def train_epoch(model, optimizer, x, y, steps, epoch, lr_of_step, env, args):
    model.train()
    loss_sum, correct = 0.0, 0
    progress = log.Progress(env.is_main, len(steps), epoch, args.log_interval)
    for step, micro_batches in enumerate(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of_step(step)
        for idx in micro_batches:  # one micro-batch unless --grad-accum
            output = model(x[idx])
            loss = F.nll_loss(output, y[idx])
            model.backward(loss)  # [ds 5] engine.backward: scales by 1/accumulation, reduces (ZeRO: partitions) grads
            model.step()  # [ds 5] engine.step: optimizer step at the accumulation boundary, then zero_grad
            loss_sum += loss.item() * len(idx)
            correct += (output.argmax(1) == y[idx]).sum().item()
        progress.update(step + 1, loss.item())
    progress.close()
    return loss_sum, correct, len(steps) * args.grad_accum * args.batch_size


@torch.no_grad()
def evaluate(model, x, y, indices, batch_size, num_batches):
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, num_batches * batch_size, batch_size):  # [ds 6] same count of forwards on every rank
        idx = indices[start:start + batch_size]
        output = model(x[idx])
        loss_sum += F.nll_loss(output, y[idx], reduction="sum").item()
        correct += (output.argmax(1) == y[idx]).sum().item()
    return loss_sum, correct, len(indices)


def gathered(model):
    """[ds 8] ZeRO-3 keeps 1/N of every parameter on each rank: gather the full tensors for a moment."""
    if model.zero_optimization_stage() == 3:
        return deepspeed.zero.GatheredParameters(list(model.module.parameters()))
    return torch.no_grad()


def main():
    args = parse(add_deepspeed_args(get_parser(__doc__)))
    wall_start = time.perf_counter()

    # --- set up distributed ----------------------------------------------------------------------
    env = init_distributed(args)  # [ds 2] rank/world from the launcher; deepspeed.init_distributed
    log.configure(env.rank, args.log_all_ranks)
    log_dir = args.log_dir or log.default_log_dir("deepspeed")
    if env.distributed:  # every rank writes to rank 0's log dir (its default has a timestamp)
        log_dir = log_dir if args.log_dir else dist.broadcast_object(log_dir)
    run = log.RunLog(log_dir, env.is_main)
    config = ds_config.load(args, env.world_size, DEFAULT_CONFIG)  # [ds 3] JSON config + flags, checked
    log.info(f"{FRAMEWORK} {deepspeed.__version__}: {env.world_size} rank(s) via {env.launcher}, device "
             f"{env.device}, backend {env.backend}, {env.num_threads} thread(s) per rank, ZeRO stage "
             f"{config['zero_optimization'].get('stage', 0)}{' + CPU offload' if args.offload else ''}")

    # --- data: every rank loads the set, then trains on its own shard -----------------------------
    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=dist.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    test_idx = torch.from_numpy(data.test_shard(len(y_test), env.rank, env.world_size)).to(env.device)
    test_batches = math.ceil(math.ceil(len(y_test) / env.world_size) / args.test_batch_size)  # [ds 6] same on all ranks

    # --- model and optimizer ---------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Net(args.dropout).to(env.device)
    lr = scaled_lr(args.lr, env.world_size * args.grad_accum, not args.no_lr_scaling)  # linear LR scaling
    config.setdefault("optimizer", {"type": "Adam", "params": {}}).setdefault("params", {})["lr"] = lr
    # [ds 4] the engine: broadcasts rank 0's weights, builds the optimizer of the config (ZeRO-partitioned)
    model, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ds_checkpoint.use_safe_checkpoints(model)  # [ds 7] atomic writes, weights_only=True loads
    if model.bfloat16_enabled() or model.fp16_enabled():  # GPU configs: the engine casts the weights, not the inputs
        x_train, x_test = (t.to(torch.bfloat16 if model.bfloat16_enabled() else torch.half) for t in (x_train, x_test))
    checkpoint = Path(args.checkpoint_dir or Path(log_dir) / "checkpoints")
    first_epoch = 1
    if args.resume:  # [ds 7] every rank loads its own ZeRO partition of the optimizer state
        try:
            loaded, client_state = model.load_checkpoint(checkpoint)
        except Exception as exc:  # truncated file, or a checkpoint of another model / stage / world size
            log.fail(f"--resume: checkpoint in {checkpoint} does not load: {str(exc).strip().splitlines()[0]}")
        if loaded is None:
            log.fail(f"--resume: no DeepSpeed checkpoint in {checkpoint} (no 'latest' file)")
        first_epoch = client_state["epoch"] + 1
        log.info(f"resumed from {loaded}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": lr, "ds_config": config})

    # --- train / evaluate ------------------------------------------------------------------------
    for epoch in range(first_epoch, args.epochs + 1):
        seed_epoch(args.seed, epoch, env.rank)
        steps = data.epoch_batches(len(y_train), args.batch_size, env.rank, env.world_size,  # shard
                                   args.seed, epoch, args.max_steps, args.grad_accum)
        steps = index_batches(steps, env.device)

        def lr_of_step(step):
            return lr_at(epoch - 1 + step / len(steps), args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, x_train, y_train, steps, epoch, lr_of_step, env, args)
        train_time = dist.all_max(time.perf_counter() - start, env)
        test = evaluate(model, x_test, y_test, test_idx, args.test_batch_size, test_batches)
        run.epoch_end(epoch, dist.all_sum(train + test, env), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time, env, FRAMEWORK)
        # [ds 7] every rank writes its partition (collective); then `latest` names the new tag
        ds_checkpoint.save(model, checkpoint, f"epoch{epoch}", {"epoch": epoch}, env.is_main)

    # --- summary ---------------------------------------------------------------------------------
    with gathered(model):  # [ds 8]
        checksums = dist.gather_object(param_checksum(model.module))  # identical on every rank
        if args.save_model and env.is_main:
            save_checkpoint(Path(log_dir) / "model.pt",
                            {k: v.detach().float().cpu().clone() for k, v in model.module.state_dict().items()})
    run.summary({"wall_time_s": time.perf_counter() - wall_start, "param_checksums": checksums,
                 "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
                 "framework": FRAMEWORK})
    dist.shutdown()


if __name__ == "__main__":
    log.run_main(main)
