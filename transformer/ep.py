#!/usr/bin/env python
"""The chapter's GPT with a mixture of experts in each block, and expert parallelism: each rank
holds 1/N of the experts, and every token is sent to the rank of its experts and back with
`all_to_all`. [1]-[8]: the course's recipe; transformer/README.md explains each line here.

    torchrun --nproc_per_node 2 transformer/ep.py                  4 experts: 2 on each rank
    torchrun --nproc_per_node 2 transformer/ep.py --top-k 1 --capacity-factor 1.0   Switch-like
    python transformer/ep.py                                       one process: every expert
"""
import os
import re
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
from torch.distributed._functional_collectives import all_to_all_single_autograd  # (torchtitan's)

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import WireBytes, flops_per_token, peak_memory  # what it measures
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-ep"
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


def expert_parallel(moe, group):
    """The MoE's `compute` with its experts spread over the ranks of `group`, E/N on each: the
    buffer of slots [B, E, capacity, C] goes expert by expert to the rank holding the expert (one
    all_to_all: equal parts, the shapes are fixed), the experts run on what every rank sent them,
    and a second all_to_all brings each slot's output back to the rank of its token."""
    n = group.size()

    def compute(buffer):
        B, E, capacity, C = buffer.shape
        send = buffer.transpose(0, 1).reshape(E * B * capacity, C)  # rank r's experts: part r
        got = all_to_all_single_autograd(send, None, None, group)  # equal parts; backward: back
        got = got.view(n, E // n, B, capacity, C)  # from each rank: its slots for my experts
        out = torch.stack([expert(got[:, i]) for i, expert in enumerate(moe.experts)], dim=1)
        back = all_to_all_single_autograd(out.reshape(-1, C), None, None, group)
        return back.view(E, B, capacity, C).transpose(0, 1)
    return compute


def apply_ep(model, mine, group):
    """[5] In every block, keep the experts numbered `mine` and let the MoE layer send each token
    to the rank that holds its expert (expert_parallel: two all-to-alls over `group`)."""
    for block in model.blocks:
        block.mlp.experts = nn.ModuleList(block.mlp.experts[i] for i in mine)
        block.mlp.compute = expert_parallel(block.mlp, group)


def run_epoch(model, optimizer, tokens, starts, args, device, progress=None, wire=None):
    """Train on (or, without a progress line, evaluate) the windows at `starts`, in batches."""
    model.train(progress is not None)
    sums, world_size = [0.0, 0, 0], dist.get_world_size()
    for step, batch in enumerate(starts):
        x, y = (t.to(device) for t in text.windows(tokens, batch, args.context))
        with torch.set_grad_enabled(progress is not None), (
                wire if step == 1 and wire else nullcontext()):
            logits = model(x)  # each MoE: two all_to_alls forward, two backward
            loss = gpt.loss_fn(logits, y)
            if progress is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # [6] Gradients averaged, two ways: the copies (attention, norms, router,
                #     embeddings) summed over the ranks; this rank's experts already have every
                #     rank's tokens' gradients (the all_to_all back). Both / N: the ranks' mean.
                for name, p in model.named_parameters():
                    if ".experts." not in name:
                        dist.all_reduce(p.grad)
                    p.grad /= world_size
                optimizer.step()
        if progress is not None:
            progress.update(step + 1, loss.item())
        sums = [sums[0] + loss.item() * y.numel(), sums[1] + (logits.argmax(-1) == y).sum().item(),
                sums[2] + y.numel()]
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
    # [1] Join the process group (one process: a group of one, the same program)
    backend = args.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, world_size, wait)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=wait, store=store)
    run, log_dir, train, test, about = chapter.open_run("transformer-ep", args, rank, local_rank)
    config = chapter.model_config(args, experts=args.experts, top_k=args.top_k,
                                  capacity_factor=args.capacity_factor)
    model = gpt.GPT(config).to(device)  # every expert, the same on every rank (seeded)
    per_token = flops_per_token(model, train, args.context, device)  # the whole model
    # [5] Keep this rank's experts (E/N of each block's) and exchange tokens for the rest; the
    #     other layers stay whole on every rank, as in DDP ([6] averages their gradients).
    share = args.experts // world_size  # (text.Parser checked that it divides)
    mine = range(rank * share, (rank + 1) * share)
    if world_size > 1:
        apply_ep(model, mine, dist.group.WORLD)
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher}, experts {mine.start}-"
             f"{mine.stop - 1} of {args.experts} on rank {rank}, top-{args.top_k}, capacity "
             f"{model.blocks[0].mlp.capacity} tokens of a sequence per expert, device {device}, "
             f"backend {backend}, {threads} thread(s) per rank\n{about}\nmodel: {config}")
    # [4] Scale the LR with the global batch (world size x one rank's), as in ddp.py.
    lr = args.lr * world_size if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], scaled_lr=lr), FRAMEWORK)
    steps = min(args.max_steps, max(1, len(train) // (world_size * args.batch_size * args.context)))
    B, tests = args.batch_size, chapter.test_starts(test, args.context, world_size)  # as many a rank
    wire = WireBytes()
    for epoch in range(1, args.epochs + 1):
        # [3] Shard by global rank, as in ddp.py: each rank its own B of the global batch (a
        #     capacity holds per sequence, so the experts see what one process would show them).
        starts = chapter.draw_starts(train, args, epoch, steps, world_size * B)
        start = time.perf_counter()
        sums = run_epoch(model, optimizer, train, starts[:, rank * B:(rank + 1) * B], args, device,
                         log.Progress(rank == 0, steps, epoch, args.log_interval), wire)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums += run_epoch(model, optimizer, test, tests[rank::world_size].split(
            args.test_batch_size), args, device)
        sums = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), lr, time.perf_counter() - start, train_time.item())
    # The load: tokens each expert was chosen for, and dropped (over capacity), over the ranks
    load = torch.stack([block.mlp.load for block in model.blocks]).to(device)  # [layers, 2, E]
    dist.all_reduce(load)
    routed, dropped = load.sum(0).tolist()
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    log.info(f"tokens per expert (all blocks, top-{args.top_k}): {routed}; dropped over capacity: "
             f"{dropped} ({sum(dropped) / max(1, sum(routed)):.1%})\n{tokens_per_s:,.0f} tokens/s "
             f"per rank; peak memory {peak_memory(device) / 2**20:,.0f} MiB (rank 0)")
    # [8] --save-model: every rank's experts gathered, under their numbers in the whole model
    experts = {re.sub(r"experts\.(\d+)\.", lambda m: f"experts.{mine[int(m[1])]}.", name):
               t.cpu() for name, t in model.state_dict().items() if ".experts." in name}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, experts)
    state = {k: v.cpu() for k, v in model.state_dict().items() if ".experts." not in k}
    for part in everyone:
        state.update(part)
    if args.save_model and rank == 0:
        log.atomic_write(Path(log_dir) / "model.pt", lambda f: torch.save(state, f), mode="wb")
    run.summary({"device": device, "tokens_per_s_per_rank": tokens_per_s,
                 "flops_per_token": per_token, "expert_tokens": routed, "expert_dropped": dropped,
                 "capacity": model.blocks[0].mlp.capacity, "wire_per_step": wire.per_step(),
                 "peak_memory_bytes": peak_memory(device)})
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "ep", who_am_i()[2])  # + --experts, --top-k; checked
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. The functional collectives keep
    # gloo's groups, and their threads, alive past destroy_process_group(), and the teardown can
    # then abort a finished rank ("terminate called without an active exception";
    # pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
