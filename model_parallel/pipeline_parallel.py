#!/usr/bin/env python
"""MNIST with pipeline parallelism (torch.distributed.pipelining): an MLP cut into one stage per
rank.

    torchrun --nproc_per_node 2 model_parallel/pipeline_parallel.py
        2 stages, 1F1B, 4 micro-batches
    torchrun --nproc_per_node 2 model_parallel/pipeline_parallel.py --schedule gpipe
        GPipe's schedule instead (--micro-batches 8: smaller micro-batches, a smaller bubble)
    python model_parallel/pipeline_parallel.py --micro-batches 4
        one process: gradient accumulation

The numbered comments are the course's recipe: the same number marks the same step in every lesson
(README.md, "The recipe"); model_parallel/README.md explains each line here.
"""
import statistics
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
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from model_parallel import common  # the MLP, and the counters behind summary.json
from utils import checks, data, failures, log
from utils import dist as course
from utils.torch_utils import save_checkpoint, steps_per_epoch, to_tensors

FRAMEWORK = "pytorch-pipeline-parallel"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def train_step(part, schedule, stage, x, y, k):
    """One optimizer step's forward and backward; returns the output and the K micro-batch losses
    (last stage)."""
    if schedule is None:  # one process: the unsplit model, accumulating over the K micro-batches
        outputs, losses = [], []
        for xk, yk in zip(x.chunk(k), y.chunk(k)):
            outputs.append(part(xk))
            losses.append(F.cross_entropy(outputs[-1], yk))
            (losses[-1] / k).backward()
        return torch.cat(outputs), losses
    losses = []
    # The first stage feeds the inputs, the last the labels; the schedule splits both into K
    # micro-batches; the last stage computes the loss (scale_grads: each gradient counts 1/K)
    output = schedule.step(*([x] if stage.is_first else []), target=y if stage.is_last else None,
                           losses=losses)
    return output, losses


def train_epoch(part, schedule, stage, optimizer, loader, epoch, env, args, wire, timing):
    part.train()
    loss_sum, correct, seen = 0.0, 0, 0
    steps = steps_per_epoch([loader], args.max_steps)
    # Progress is shown by the stage that has the loss (the last, or the one process).
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
            loss_sum += sum(loss.item() for loss in losses) * len(y) / len(losses)
            correct += (output.argmax(1) == y).sum().item()
            seen += len(y)
        progress.update(step + 1, losses[-1].item() if losses else None)
    return [loss_sum, correct, seen]


@torch.no_grad()
def evaluate(part, loader, env, width):
    """Forward only, by hand, a whole test batch at a time: receive activations, compute, send them
    on."""
    part.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:
        if env.rank > 0:
            x = torch.empty(len(y), width, device=env.device)
            dist.recv(x, src=env.rank - 1)
        output = part(x)
        if env.rank < env.world_size - 1:
            dist.send(output, dst=env.rank + 1)
            continue
        loss_sum += F.cross_entropy(output, y, reduction="sum").item()
        correct += (output.argmax(1) == y).sum().item()
        seen += len(y)
    return [loss_sum, correct, seen]


def main():
    args = checks.parse(common.parser(__doc__, schedules=sorted(SCHEDULES)))  # + --micro-batches
    common.check_shared_flags(args)
    wall_start = time.perf_counter()

    # [1] Who am I? Checked before any process group exists: bad sizes fail at once on every rank.
    env = course.export_rendezvous(course.discover())
    stages, k = env.world_size, args.micro_batches
    common.check_pipeline(args, stages)  # layers split evenly, micro-batches that fit
    # [2] Pin the device to the local rank (GPU = local rank; on CPUs a share of the cores).
    device = course.pick_device(args.device, env.local_rank)
    if device != "cpu":  # one call for NVIDIA (cuda:N) and Intel (xpu:N): torch.cuda/xpu.set_device
        torch.accelerator.set_device_index(device)
    num_threads = course.threads_per_rank(args.num_threads, env.local_world_size)
    torch.set_num_threads(num_threads)
    backend = "none"
    if env.distributed:  # [1] Start the process group: stages send activations and gradients
        backend = course.pick_backend(args.backend, device)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=args.dist_timeout),
                                store=course.restart_store(env))
    env = replace(env, device=device, backend=backend, num_threads=num_threads)  # env, now complete
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    log_dir = args.log_dir or course.broadcast_object(log.default_log_dir("pipeline-parallel"))
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {stages} stage(s) via {env.launcher}, {args.schedule}, "
             f"{k} micro-batches of {args.batch_size // k}, device {env.device}, "
             f"backend {env.backend}, {env.num_threads} thread(s)/rank")

    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=course.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    # [3] No sharding: one pipeline trains on one stream of batches. Every rank draws the same
    #     shuffled batches; the first stage uses the digits, the last the labels.
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True,
                                                   seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    torch.manual_seed(args.seed)
    model = common.mlp(args.width).to(env.device)
    # [5] Split the model: this rank keeps its stage's layers (all built the same seeded model, so
    #     the stages fit together as rank 0's would). Nothing to broadcast: each lives on one rank.
    part = common.stage_layers(model, env.rank, stages)
    stage = schedule = None
    if env.distributed:
        stage = common.TimedStage(part, env.rank, stages, torch.device(env.device))
        schedule = SCHEDULES[args.schedule](stage, k, loss_fn=F.cross_entropy)
    # [4] The LR is not scaled: one batch of --batch-size per step, like one process (no warmup)
    optimizer = torch.optim.SGD(part.parameters(), lr=args.lr, momentum=args.momentum)
    run.write_config(args, env.as_dict(), FRAMEWORK, {"log_dir": log_dir, "scaled_lr": args.lr})

    wire, timing = common.WireBytes(), []
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank
        start = time.perf_counter()
        train = train_epoch(part, schedule, stage, optimizer, loader, epoch, env, args, wire,
                            timing)
        train_time = course.all_max(time.perf_counter() - start, env)
        sums = torch.tensor(train + evaluate(part, test_loader, env, args.width),
                            dtype=torch.float64, device=env.device)
        if env.distributed:  # [7] Metrics: only the last stage has them; it sends them to all
            dist.broadcast(sums, src=stages - 1)
        run.epoch_end(epoch, sums.tolist(), args.lr, time.perf_counter() - start, train_time)

    # --- summary: the whole model (stages gathered), what each stage holds, sent and waited for ---
    state = {}
    mine = {name: t.cpu() for name, t in part.state_dict().items()}
    for part_state in course.gather_object(mine):
        state.update(part_state)
    if args.save_model and env.is_main:  # [8] one writer: rank 0 saves the gathered full weights
        save_checkpoint(Path(log_dir) / "model.pt", state)
    step_s = statistics.median(t[0] for t in timing) if timing else float("nan")
    run.summary({
        "wall_time_s": time.perf_counter() - wall_start, "weights_checksum": common.checksum(state),
        **common.pipeline_report(part, stage, state, timing, stages, k, args.schedule,
                                 course.gather_object),
        "wire_bytes_per_step": course.gather_object(wire.per_step()),
        "step_time_s": course.all_max(step_s, env),
        "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
        "framework": FRAMEWORK})
    course.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
