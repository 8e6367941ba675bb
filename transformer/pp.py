#!/usr/bin/env python
"""The chapter's GPT as a pipeline (`torch.distributed.pipelining`): its blocks cut into stages,
each rank holding one or two stages, micro-batches flowing through on a schedule. [1]-[8]: the
course's recipe; transformer/README.md explains each line here.

    torchrun --nproc_per_node 2 transformer/pp.py                        2 stages, 1F1B
    torchrun --nproc_per_node 2 transformer/pp.py --schedule gpipe --micro-batches 8
    torchrun --nproc_per_node 2 transformer/pp.py --schedule interleaved-1f1b   2 stages a rank
    python transformer/pp.py                          one process: one stage, micro-batches
"""
import copy
import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import TimedStage, WireBytes, flops_per_token, peak_memory
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-pp"
# A schedule: its class, and the stages each rank holds (2: rank r holds stages r and r + N).
SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1),
             "interleaved-1f1b": (ScheduleInterleaved1F1B, 2),
             "zero-bubble": (ScheduleInterleavedZeroBubble, 2)}
# What each launcher sets: rank, local rank, world size, ranks on this node.
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


class Stage(nn.Module):
    """One stage of the GPT: its run of blocks; the first also the embeddings, the last the final
    norm and the head (names kept: the stages' state dicts add up to the whole model's)."""

    def __init__(self, model, index, stages):
        super().__init__()
        per, self.first, self.last = len(model.blocks) // stages, index == 0, index == stages - 1
        self.blocks = nn.ModuleDict({str(i): model.blocks[i]
                                     for i in range(index * per, (index + 1) * per)})
        if self.first:
            self.tokens, self.positions = model.tokens, model.positions
        if self.last:  # the head is tied to the embedding: a copy here, kept equal by [6]
            self.norm, self.head = model.norm, copy.deepcopy(model.head)

    def forward(self, x):
        if self.first:
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def apply_pp(model, rank, world_size, args, device):
    """[5] Cut the blocks into stages; keep this rank's (one; two for the interleaved schedules:
    r and r + N), each wrapped in a PipelineStage; then the schedule that orders their
    micro-batches' forwards and backwards (it splits each batch into --micro-batches). Returns
    (the number of stages, this rank's stage numbers, its Stages, their PipelineStages, the
    schedule)."""
    kind, per_rank = SCHEDULES[args.schedule]
    if world_size == 1:
        per_rank = 1  # one process: one stage, whole
    stages = world_size * per_rank  # (text.Parser checked that the blocks divide)
    mine = list(range(rank, stages, world_size))
    parts = [Stage(model, i, stages) for i in mine]
    held = [TimedStage(part, i, stages, torch.device(device)) for part, i in zip(parts, mine)]
    if kind.__name__.startswith("ScheduleInterleaved"):
        schedule = kind(held, args.micro_batches, loss_fn=gpt.loss_fn)
    else:
        schedule = kind(held[0], args.micro_batches, loss_fn=gpt.loss_fn)
    return stages, mine, parts, held, schedule


def run_epoch(parts, held, schedule, optimizer, tokens, starts, args, device, train, wire,
              timing):
    """Train (or evaluate) on the windows at `starts`; the sums on the last stage's rank."""
    sums, progress = [0.0, 0, 0], log.Progress(train and any(p.last for p in parts), len(starts),
                                               args.epoch, args.log_interval)
    for part in parts:
        part.train(train)
    for step, batch in enumerate(starts):
        x, y = (t.to(device) for t in text.windows(tokens, batch, args.context))
        first, last = parts[0].first or parts[-1].first, any(p.last for p in parts)
        inputs, losses = [x] if first else [], []  # (the first stage's rank feeds the bytes)
        start, computed = time.perf_counter(), sum(s.compute_s for s in held)
        if not train:  # forward only
            logits = schedule.eval(*inputs, target=y if last else None, losses=losses)
        else:
            optimizer.zero_grad(set_to_none=True)
            with wire if step == 1 else nullcontext():  # the step's sends, counted
                logits = schedule.step(*inputs, target=y if last else None, losses=losses)
                pipe_s = time.perf_counter() - start  # forward, backward, waits and sends
                tie_gradients(parts, args.tie_group)
            optimizer.step()
            if step > 0:  # (the first step also works out the shapes the stages exchange)
                computed = sum(s.compute_s for s in held) - computed
                timing.append((pipe_s, computed))
        if losses:  # the last stage: each micro-batch's mean loss
            loss = torch.stack(losses).mean()
            sums = [sums[0] + loss.item() * y.numel(),
                    sums[1] + (logits.argmax(-1) == y).sum().item(), sums[2] + y.numel()]
        progress.update(step + 1, loss.item() if losses else None)
    return sums


def tie_gradients(parts, group):
    """[6] The embedding and the head are one tied weight held twice (the first stage's
    `tokens`, the last's `head`): the two gradients summed, so both copies step alike."""
    tied = [p.tokens.weight for p in parts if p.first] + [p.head.weight for p in parts if p.last]
    if len(tied) == 2:  # both on this rank (one process)
        tied[0].grad = tied[1].grad = tied[0].grad + tied[1].grad
    elif tied:
        dist.all_reduce(tied[0].grad, group=group)  # the first and the last stage's ranks


def main(args):
    # [1] Who am I? The launcher's variables (LAUNCHERS), then where the ranks meet: torchrun sets
    #     MASTER_ADDR; else this node when all ranks are on it, or rank 0's host sent over MPI.
    rank, local_rank, world_size, local_size, launcher = who_am_i()
    if world_size > 1 and "MASTER_ADDR" not in os.environ and local_size < world_size:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    # [2] Pin this rank to one device (GPU number = local rank); on CPUs, its share of the cores.
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    gpu = gpu.type if gpu and gpu.type in ("cuda", "xpu") and args.device != "cpu" else None
    device = f"{gpu}:{local_rank % torch.accelerator.device_count()}" if gpu else "cpu"
    if gpu:
        torch.accelerator.set_device_index(device)  # NVIDIA (cuda:N) and Intel (xpu:N) alike
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.num_threads or (cores if cores < os.cpu_count() else max(1, cores // local_size))
    torch.set_num_threads(threads)
    # [1] Join the process group (one process: a group of one, the same program)
    backend = args.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, world_size, wait)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=wait, store=store)
    run, log_dir, train, test, about = chapter.open_run("transformer-pp", args, rank, local_rank)
    config = chapter.model_config(args)
    model = gpt.GPT(config).to(device)  # the same weights on every rank (model.py: seeded)
    per_token = flops_per_token(model, train, args.context, device)  # the whole model
    # [5] Cut the blocks into stages, keep this rank's, and the schedule that runs them.
    stages, mine, parts, held, schedule = apply_pp(model, rank, world_size, args, device)
    last = (stages - 1) % world_size  # the rank of the last stage (the first's: rank 0)
    args.tie_group = dist.new_group(sorted({0, last}))
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher}, {stages} stage(s) of "
             f"{args.layers // stages} block(s), stages {mine} on rank {rank}, {args.schedule}, "
             f"{args.micro_batches} micro-batches of {args.batch_size // args.micro_batches}, "
             f"device {device}, backend {backend}, {threads} thread(s) per rank\n{about}\n"
             f"model: {config}")
    # [4] No LR scaling: one batch of --batch-size per step, as one process takes it.
    lr = args.lr
    weights = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], stages=stages,
                                scaled_lr=lr), FRAMEWORK)
    steps = min(args.max_steps, max(1, len(train) // (args.batch_size * args.context)))
    tests = chapter.test_starts(test, args.context, args.batch_size)  # whole micro-batches
    wire, timing = WireBytes(), []
    for epoch in range(1, args.epochs + 1):
        # [3] No sharding: one pipeline takes one stream of batches. Every rank draws the same
        #     sequences; the first stage reads the bytes, the last the targets.
        args.epoch = epoch
        starts = chapter.draw_starts(train, args, epoch, steps, args.batch_size)
        start = time.perf_counter()
        sums = run_epoch(parts, held, schedule, optimizer, train, starts, args, device, True, wire,
                         timing)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums += run_epoch(parts, held, schedule, optimizer, test, tests.split(args.batch_size), args,
                          device, False, wire, timing)
        sums = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.broadcast(sums, src=last)  # [7] metrics: the last stage's, to all
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), lr, time.perf_counter() - start, train_time.item())
    # The bubble: the share of a step this rank's stages did not compute (waits, sends), against
    # (N-1)/(v m + N-1) of the schedule's picture (N ranks, m micro-batches, v stages a rank)
    pipe_s, computed = (sum(column) for column in zip(*timing)) if timing else (1.0, 1.0)
    v = stages // world_size
    idle, theory = [None] * world_size, (world_size - 1) / (v * args.micro_batches + world_size - 1)
    dist.all_gather_object(idle, 1 - computed / pipe_s)
    timeline = [None] * world_size  # each rank's forwards and backwards in the last step
    dist.all_gather_object(timeline, [event for stage in held for event in stage.events])
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    log.info(f"idle share of a step per rank: {', '.join(f'{i:.0%}' for i in idle)} (the "
             f"bubble, (N-1)/(v m+N-1): {theory:.0%}); {tokens_per_s:,.0f} tokens/s per rank; "
             f"peak memory {peak_memory(device) / 2**20:,.0f} MiB (rank 0)")
    # [8] --save-model: each rank's stages gathered: the whole model's state dict on rank 0
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {k: t.cpu() for part in parts
                                      for k, t in part.state_dict().items()})
    state = {k: t for each in everyone for k, t in each.items()}
    if args.save_model and rank == 0:
        log.atomic_write(Path(log_dir) / "model.pt", lambda f: torch.save(state, f), mode="wb")
    run.summary({"device": device, "stages": stages, "schedule": args.schedule,
                 "micro_batches": args.micro_batches, "idle_fraction": idle,
                 "idle_fraction_theory": theory, "timeline": timeline, "tokens_per_s_per_rank": tokens_per_s,
                 "flops_per_token": per_token, "wire_per_step": wire.per_step(),
                 "peak_memory_bytes": peak_memory(device)})
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "pp", who_am_i()[2], {k: v for k, (_, v) in SCHEDULES.items()})
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. The pipeline's stages keep gloo's
    # groups, and their threads, alive past destroy_process_group(), and the teardown can then abort
    # a finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
