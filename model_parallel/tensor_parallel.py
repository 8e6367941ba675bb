#!/usr/bin/env python
"""MNIST with tensor parallelism (PyTorch DTensor): each layer of a wide MLP split over the ranks.

    torchrun --nproc_per_node 2 model_parallel/tensor_parallel.py
        each rank holds half of every layer
    torchrun --nproc_per_node 4 model_parallel/tensor_parallel.py --dp 2
        2 data-parallel x 2 tensor-parallel
    python model_parallel/tensor_parallel.py
        one process: the unsplit model

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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from model_parallel import common  # the MLP, and the counters behind summary.json
from utils import checks, data, failures, log
from utils import dist as course
from utils.parse_args import positive_int
from utils.schedule import lr_at, scaled_lr
from utils.torch_utils import save_checkpoint, steps_per_epoch, to_tensors

FRAMEWORK = "pytorch-tensor-parallel"
# Column-parallel: each rank computes a slice of the layer's outputs. Row-parallel: each rank
# multiplies its slice of the inputs, and one all-reduce sums the partial outputs. The head
# (width -> 10) stays whole.
PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
        "fc3": ColwiseParallel(), "fc4": RowwiseParallel()}


def train_epoch(model, optimizer, loader, mesh, epoch, lr_of, env, args, wire, step_times):
    model.train()
    loss_sum, correct, seen = 0.0, 0, 0
    steps = steps_per_epoch([loader], args.max_steps)
    progress = log.Progress(env.is_main, steps, epoch, args.log_interval)
    for step, (x, y) in enumerate(islice(loader, steps)):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_of(step / steps)
        optimizer.zero_grad()
        with wire if step == 1 else nullcontext():  # counts what this rank sends during one step
            output = model(x)  # [B, 10] on every rank: fc2 and fc4 all-reduced their outputs
            loss = F.cross_entropy(output, y)
            loss.backward()  # ...and fc3's input gradient is all-reduced on the way back
            if args.dp > 1:
                # [6] Gradients averaged over the dp ranks only: one all_reduce per parameter over
                #     the "dp" group (a tensor-parallel rank holds its slice's only gradient:
                #     nothing to average over "tp").
                for p in model.parameters():
                    dist.all_reduce(common.local(p.grad), group=mesh.get_group("dp"))
                    common.local(p.grad).div_(args.dp)
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        loss_sum += loss.item() * len(y)
        correct += (output.argmax(1) == y).sum().item()
        seen += len(y)
        progress.update(step + 1, loss.item())
    return [loss_sum, correct, seen]


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    for x, y in loader:
        output = model(x)
        loss_sum += F.cross_entropy(output, y, reduction="sum").item()
        correct += (output.argmax(1) == y).sum().item()
        seen += len(y)
    return [loss_sum, correct, seen]


def main():
    p = common.parser(__doc__)
    p.add_argument("--dp", type=positive_int, default=1,
                   help="data-parallel replicas: the ranks form a dp x tp mesh, "
                        "tp = world size / dp")
    args = checks.parse(p)
    common.check_shared_flags(args)
    wall_start = time.perf_counter()

    # [1] Who am I? Checked before any process group exists: bad sizes fail at once on every rank.
    env = course.export_rendezvous(course.discover())
    tp = common.tensor_parallel_size(args, env.world_size)  # world size / --dp, and it must fit
    # [2] Pin the device to the local rank (GPU = local rank; on CPUs a share of the cores).
    device = course.pick_device(args.device, env.local_rank)
    if device != "cpu":  # one call for NVIDIA (cuda:N) and Intel (xpu:N): torch.cuda/xpu.set_device
        torch.accelerator.set_device_index(device)
    num_threads = course.threads_per_rank(args.num_threads, env.local_world_size)
    torch.set_num_threads(num_threads)
    mesh, backend = None, "none"
    if env.distributed:
        # [1] Start the process group, then lay the ranks out as a dp x tp grid: ranks 0..tp-1 are
        #     one tensor-parallel group (one copy of the model), the next tp ranks the next copy.
        backend = course.pick_backend(args.backend, device)
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=args.dist_timeout),
                                store=course.restart_store(env))
        mesh = init_device_mesh(device.split(":")[0], (args.dp, tp), mesh_dim_names=("dp", "tp"))
    env = replace(env, device=device, backend=backend, num_threads=num_threads)  # env, now complete
    dp_rank = mesh.get_local_rank("dp") if mesh else 0
    log.configure(env.rank, env.local_rank, args.log_all_ranks)
    log_dir = args.log_dir or course.broadcast_object(log.default_log_dir("tensor-parallel"))
    run = log.RunLog(log_dir, env.is_main)
    log.info(f"{FRAMEWORK}: {env.world_size} rank(s) via {env.launcher} = {args.dp} dp x {tp} tp, "
             f"device {env.device}, backend {env.backend}, {env.num_threads} thread(s) per rank")

    mnist = data.load_mnist(args.data_dir, args.download, env.is_main, barrier=course.barrier)
    log.info(mnist.describe())
    x_train, y_train, x_test, y_test = to_tensors(mnist, env.device)
    train_set, test_set = TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)
    # [3] Shard the data by the *dp* rank only: the tp ranks of one model copy all see the same
    #     whole batch (each computes its slice of every layer for all of it); with --dp 1 every
    #     rank sees every batch.
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True,
                        sampler=DistributedSampler(train_set, num_replicas=args.dp, rank=dp_rank,
                                                   shuffle=True, seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=DistributedSampler(
        test_set, num_replicas=args.dp, rank=dp_rank, shuffle=False))

    torch.manual_seed(args.seed)
    model = common.mlp(args.width).to(env.device)
    if env.distributed:
        # [5] Start from rank 0's weights (one broadcast per tensor), then split: parallelize_module
        #     turns each planned layer's weight into a DTensor of which this rank keeps its slice
        #     (1/tp of the layer).
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
        if tp > 1:
            parallelize_module(model, mesh["tp"], PLAN)
    # [4] Scale the LR with the number of *different* batches per step: dp (the tp ranks of a
    #     copy share one batch).
    lr = scaled_lr(args.lr, args.dp, not args.no_lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    run.write_config(args, env.as_dict(), FRAMEWORK,
                     {"log_dir": log_dir, "scaled_lr": lr, "tp": tp})

    wire, step_times = common.WireBytes(), []
    for epoch in range(1, args.epochs + 1):
        loader.sampler.set_epoch(epoch)  # [3] a new shuffle each epoch, the same on every rank

        def lr_of(fraction):
            return lr_at(epoch - 1 + fraction, args.lr, lr, args.lr_warmup_epochs)

        start = time.perf_counter()
        train = train_epoch(model, optimizer, loader, mesh, epoch, lr_of, env, args, wire,
                            step_times)
        train_time = course.all_max(time.perf_counter() - start, env)
        sums = torch.tensor(train + evaluate(model, test_loader), dtype=torch.float64,
                            device=env.device)
        if args.dp > 1:
            # [7] Metrics summed over the dp ranks only (the tp ranks of a copy counted the same
            #     samples).
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time)

    # --- summary: the whole model (slices gathered), what each rank holds, what it sent -----------
    # The full weights: each DTensor's slices gathered (a collective over tp).
    state = {name: common.full_tensor(t) for name, t in model.state_dict().items()}
    if args.save_model and env.is_main:  # [8] one writer: rank 0 saves the gathered full weights
        save_checkpoint(Path(log_dir) / "model.pt", {name: t.cpu() for name, t in state.items()})
    run.summary({
        "wall_time_s": time.perf_counter() - wall_start, "weights_checksum": common.checksum(state),
        **common.tensor_parallel_report(model, state, course.gather_object),
        "wire_bytes_per_step": wire.per_step(),
        "step_time_s": course.all_max(statistics.median(step_times), env),
        "dp": args.dp, "tp": tp, "width": args.width, "batch_size": args.batch_size,
        "device": env.device, "world_size": env.world_size, "launcher": env.launcher,
        "framework": FRAMEWORK})
    course.shutdown()


if __name__ == "__main__":
    failures.run_main(main)  # course plumbing: each way it can end is one line (utils/failures.py)
