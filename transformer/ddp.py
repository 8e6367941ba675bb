#!/usr/bin/env python
"""A GPT-style transformer (transformer/model.py) with PyTorch DDP, on bytes of real text: the
chapter's baseline. [1]-[8]: the course's recipe; transformer/README.md explains each line here.

    python transformer/ddp.py                          one process: the loss falls from ln 256
    torchrun --nproc_per_node 2 transformer/ddp.py     two ranks, each its own sequences
    mpiexec -n 2 python transformer/ddp.py             two ranks under MPI (also: srun)
    python transformer/ddp.py --activation-checkpointing | --bf16 | --compile   memory vs time
"""
import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import flops_per_token, matmul_peak, peak_memory  # what it measures
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-ddp"
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


def train_epoch(model, optimizer, train, epoch, steps, rank, world_size, args, device):
    model.train()
    sums, context, B = [0.0, 0, 0], args.context, args.batch_size  # loss, right guesses, tokens
    progress = log.Progress(rank == 0, steps, epoch, args.log_interval)
    # [3] Shard by global rank: every rank draws the same starts for the whole global batch (one
    #     seed per epoch) and takes its own B of them: N ranks see what one process sees at N x B.
    starts = chapter.draw_starts(train, args, epoch, steps, world_size * B)
    start, first_step = time.perf_counter(), 0.0
    for step in range(steps):
        x, y = (t.to(device) for t in text.windows(train, starts[step, rank * B:(rank + 1) * B],
                                                   context))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], torch.bfloat16, enabled=args.bf16):  # --bf16
            logits = model(x)  # (--compile: the first step compiles)
            loss = gpt.loss_fn(logits, y)
        loss.backward()  # [6] gradients averaged: DDP all-reduces them in buckets during backward
        optimizer.step()
        sums = [sums[0] + loss.item() * y.numel(), sums[1] + (logits.argmax(-1) == y).sum().item(),
                sums[2] + y.numel()]
        progress.update(step + 1, loss.item())
        if step == 0:
            first_step = time.perf_counter() - start  # (--compile: compiling)
    return sums, first_step


@torch.no_grad()
def evaluate(model, test, rank, world_size, args, device):
    """The same fixed windows of the test split every epoch, dealt out over the ranks."""
    model.eval()
    sums, context = [0.0, 0, 0], args.context
    starts = chapter.test_starts(test, context)[rank::world_size]
    for batch in starts.split(args.test_batch_size):
        x, y = (t.to(device) for t in text.windows(test, batch, context))
        with torch.autocast(device.split(":")[0], torch.bfloat16, enabled=args.bf16):
            logits = model(x)
        sums = [sums[0] + gpt.loss_fn(logits, y, reduction="sum").item(),
                sums[1] + (logits.argmax(-1) == y).sum().item(), sums[2] + y.numel()]
    return sums


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
    # [1] Join the process group: back when all ranks met; a dead peer fails it after --dist-timeout
    vendor = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    backend = (vendor if args.backend == "auto" else args.backend) if world_size > 1 else "none"
    wait = timedelta(seconds=args.dist_timeout)
    if world_size > 1:  # (one process: no group, as pytorch/examples' MNIST)
        store = meeting_place(rank, world_size, wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)
    run, log_dir, train, test, about = chapter.open_run("transformer-ddp", args, rank, local_rank)
    config = chapter.model_config(args, recompute=args.activation_checkpointing)
    torch.manual_seed(args.seed)
    model = gpt.GPT(config).to(device)
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher}, device {device}, backend "
             f"{backend}, {threads} thread(s) per rank\n{about}\nmodel: "
             f"{sum(p.numel() for p in model.parameters()):,} parameters, {config}")
    per_token = flops_per_token(model, train, args.context, device)  # before any step: counts
    # [4] Scale the LR with the global batch (world_size x one rank's), as the course does; for
    #     AdamW that rule is a choice, not a law (README.md, [4]).
    lr = args.lr * world_size if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    checkpoint = log.checkpoint_folder(args.checkpoint_dir, log_dir) / "checkpoint.pt"
    first_epoch = 1
    if args.resume and checkpoint.exists():  # [8] every rank reads the same file: the same weights
        state = torch.load(checkpoint, map_location=device, weights_only=True)  # no code runs
        for k in (k for k, v in config.shape().items() if state["shape"][k] != v):  # one line
            raise SystemExit(f"error: --{k} {getattr(config, k)}: {checkpoint} is of {k} "
                             f"{state['shape'][k]}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        log.info(f"resumed from {checkpoint}: continuing at epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    net = model  # the model itself: its state dict, and evaluation (no gradients, no compiling)
    if world_size > 1:  # [5] Wrap: DDP sends rank 0's weights to every rank, hooks [6] in backward
        model = DDP(model, device_ids=[device] if gpu else None)
    if args.compile:  # after DDP: its optimizer cuts the graph at the buckets, keeping [6]'s overlap
        model = torch.compile(model)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], scaled_lr=lr), FRAMEWORK)
    # an epoch: as many windows as the training text has tokens, or --max-steps (default 200)
    steps = min(args.max_steps, max(1, len(train) // (world_size * args.batch_size * args.context)))
    timing = (0.0, 0.0)  # the first epoch's first step, then its mean step
    for epoch in range(first_epoch, args.epochs + 1):
        start = time.perf_counter()
        sums, first = train_epoch(model, optimizer, train, epoch, steps, rank, world_size, args,
                                  device)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        if epoch == first_epoch:
            timing = (first, (train_time.item() - first) / max(1, steps - 1))
        sums = torch.tensor(sums + evaluate(net, test, rank, world_size, args, device),
                            dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
            dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), optimizer.param_groups[0]["lr"],
                      time.perf_counter() - start, train_time.item())
        if rank == 0:  # [8] one writer, through a temporary file: a kill keeps the old checkpoint
            state = {"model": net.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch, "shape": config.shape()}
            log.atomic_write(checkpoint, lambda f: torch.save(state, f), mode="wb")
    # Tokens/s per rank and MFU: the FLOPs a token costs x tokens/s, over this device's matmul rate
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    peak = matmul_peak(device)
    mfu, held = tokens_per_s * per_token / peak, peak_memory(device)
    log.info(f"{tokens_per_s:,.0f} tokens/s per rank x {per_token / 1e6:.1f} MFLOP/token = "
             f"{tokens_per_s * per_token / 1e9:.2f} GFLOP/s per rank: MFU {mfu:.1%} of a measured "
             f"{peak / 1e9:.0f} GFLOP/s matmul rate ({threads} thread(s))\nfirst step "
             f"{timing[0]:.2f} s, then {timing[1] * 1e3:.0f} ms a step; peak memory "
             f"{held / 2**20:,.0f} MiB (rank 0)")
    weights = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    checksums = [hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]] * world_size
    if world_size > 1:
        dist.all_gather_object(checksums, checksums[0])  # all equal, or DDP is broken
    if args.save_model and rank == 0:
        torch.save(net.state_dict(), Path(log_dir) / "model.pt")
    run.summary({"param_checksums": checksums, "device": device, "tokens_per_s_per_rank":
                 tokens_per_s, "flops_per_token": per_token, "matmul_peak": peak,
                 "mfu": mfu, "parameters": weights.numel(), "first_step_s": timing[0],
                 "step_s": timing[1], "peak_memory_bytes": held})
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "ddp", who_am_i()[2])  # checked for n ranks
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. DDP's reducer keeps gloo's groups,
    # and their threads, alive past destroy_process_group(), and the teardown can then abort a
    # finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
