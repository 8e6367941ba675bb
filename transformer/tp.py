#!/usr/bin/env python
"""The chapter's GPT with tensor and sequence parallelism (DTensor's `parallelize_module`, in
Megatron's layout): each rank computes its share of every block's heads and MLP columns, and
holds its share of the tokens between them. [1]-[8]: the course's recipe; transformer/README.md
explains each line here.

    torchrun --nproc_per_node 2 transformer/tp.py              each rank: half of every block
    torchrun --nproc_per_node 4 transformer/tp.py --dp 2       2-D: FSDP2 over 2 x tensor over 2
    python transformer/tp.py                                   one process: the whole model
"""
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import WireBytes, flops_per_token, peak_memory  # what it measures
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-tp"
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


def apply_tp(model, tp_mesh):
    """[5] Split every block over the tp ranks in Megatron's layout; each rank keeps its slices
    of the weights, as DTensors. Column-parallel: each rank computes some of the outputs (of q, k,
    v: whole heads). Row-parallel: each rank multiplies the inputs it holds, and the partial sums
    are added over the ranks. Sequence parallel: between them (the norms, the residual stream)
    each rank holds T/tp of the tokens: an all-gather of the sequence before attention and the
    MLP, a reduce-scatter (sum, then each its tokens) after."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block_plan = {"norm1": SequenceParallel(), "attn": gather,
                  "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                  "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                  "norm2": SequenceParallel(), "mlp": gather,
                  "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(1))}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    # The embeddings, the last norm and the (tied) head stay whole on every rank: the first block
    # takes its T/tp of the tokens (no send), the last norm gathers them all again.
    edges = {"blocks.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                            desired_input_layouts=(Shard(1),), use_local_output=True),
             "norm": PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),), use_local_output=True)}
    parallelize_module(model, tp_mesh, edges)


def apply_fsdp(model, dp_mesh):
    """[5] --dp > 1: shard what each rank holds over the dp ranks with FSDP2 (2-D parallel; fsdp.py
    teaches FSDP2 alone): each block, then the rest."""
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def run_epoch(model, optimizer, tokens, starts, args, device, progress=None, wire=None):
    """Train on (or, without a progress line, evaluate) the windows at `starts`, in batches."""
    model.train(progress is not None)
    sums = [0.0, 0, 0]  # loss x tokens, right guesses, tokens
    for step, batch in enumerate(starts):
        x, y = (t.to(device) for t in text.windows(tokens, batch, args.context))
        with torch.set_grad_enabled(progress is not None), (wire if step == 1 and wire else nullcontext()):
            logits = model(x)  # the whole [B, T, vocab] on every rank of a copy (the head's)
            loss = gpt.loss_fn(logits, y)
            if progress is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # [6] the same collectives, backwards; --dp: FSDP2's too
                for p in model.parameters():  # [6] the norms' weights and biases: each rank
                    g = p.grad  # has its tokens' part (Partial): summed over the tp ranks, once
                    if isinstance(g, DTensor) and any(q.is_partial() for q in g.placements):
                        p.grad = g.redistribute(placements=[Replicate() if q.is_partial() else q
                                                            for q in g.placements])
                optimizer.step()  # each rank: its slices, and its copy of the whole tensors
        if progress is not None:
            progress.update(step + 1, loss.item())
        sums = [sums[0] + loss.item() * y.numel(), sums[1] + (logits.argmax(-1) == y).sum().item(),
                sums[2] + y.numel()]
    return sums


def wire_count(args, tp, batch):
    """The lesson's own count of what a rank hands to collectives in one training step (bytes of
    fp32 activations [batch, T, C]): per block, forward and backward, two all-gathers of its
    T/tp tokens and two reduce-scatters of the whole sequence; the edges, one all-gather each
    way; the gradients of the norms' weights and biases (C each), summed over the tp ranks."""
    full = batch * args.context * args.width * 4
    L = args.layers
    return {"_c10d_functional.all_gather_into_tensor": {"calls": 4 * L + 2,
                                                        "bytes": (4 * L + 2) * full // tp},
            "_c10d_functional.reduce_scatter_tensor": {"calls": 4 * L, "bytes": 4 * L * full},
            "_c10d_functional.all_reduce": {"calls": 4 * L, "bytes": 4 * L * args.width * 4}}


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
    # [1] Join the process group (one process: a group of one), then lay the ranks out as dp x tp:
    #     ranks 0..tp-1 hold one copy of the model between them, the next tp ranks the next copy.
    backend = args.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, world_size, wait)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=wait, store=store)
    dp, tp = args.dp, world_size // args.dp  # (text.Parser checked that it divides, and heads)
    mesh = init_device_mesh(device.split(":")[0], (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    run, log_dir, train, test, about = chapter.open_run("transformer-tp", args, rank, local_rank)
    config = chapter.model_config(args)
    model = gpt.GPT(config).to(device)  # the same weights on every rank (model.py: seeded)
    per_token = flops_per_token(model, train, args.context, device)  # (the whole model's)
    # [5] Split each block over the tp ranks, then shard what each holds over the dp ranks.
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if dp > 1:
        apply_fsdp(model, mesh["dp"])
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher} = {dp} dp x {tp} tp, device "
             f"{device}, backend {backend}, {threads} thread(s) per rank\n{about}\nmodel: {config}")
    # [4] Scale the LR with the *different* sequences per step: dp (a copy's tp ranks share them).
    lr = args.lr * dp if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], dp=dp, tp=tp, scaled_lr=lr),
                    FRAMEWORK)
    steps = min(args.max_steps, max(1, len(train) // (dp * args.batch_size * args.context)))
    B, tests = args.batch_size, chapter.test_starts(test, args.context, dp)  # as many a copy
    wire = WireBytes()
    for epoch in range(1, args.epochs + 1):
        # [3] Shard by the *dp* rank only: the tp ranks of a copy all take the same sequences
        #     (each computes its heads and columns for all of them).
        starts = chapter.draw_starts(train, args, epoch, steps, dp * B)
        start = time.perf_counter()
        sums = run_epoch(model, optimizer, train, starts[:, dp_rank * B:(dp_rank + 1) * B], args,
                         device, log.Progress(rank == 0, steps, epoch, args.log_interval), wire)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums += run_epoch(model, optimizer, test, tests[dp_rank::dp].split(args.test_batch_size),
                          args, device)  # evaluation
        sums = torch.tensor(sums, dtype=torch.float64, device=device)
        # [7] Metrics summed over the dp ranks only (a copy's tp ranks computed the same numbers)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), lr, time.perf_counter() - start, train_time.item())
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    sent, counted = wire.per_step(), wire_count(args, tp, B) if tp > 1 else {}
    tp_sent = {k: v for k, v in sent.items() if k in counted}  # (--dp: + FSDP2's, not counted)
    log.info(f"{tokens_per_s:,.0f} tokens/s per rank; a step hands collectives "
             f"{sum(v['bytes'] for v in tp_sent.values()) / 2**20:.2f} MiB of activations per "
             f"rank (counted: {sum(v['bytes'] for v in counted.values()) / 2**20:.2f} MiB); "
             f"peak memory {peak_memory(device) / 2**20:,.0f} MiB (rank 0)")
    held = [None] * world_size  # what each rank holds of the parameters
    dist.all_gather_object(held, sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                                     for p in model.parameters()))
    # [8] --save-model: the plain full state dict (ddp.py's model.pt), gathered to rank 0's CPU
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if args.save_model and rank == 0:
        log.atomic_write(Path(log_dir) / "model.pt", lambda f: torch.save(state, f), mode="wb")
    run.summary({"device": device, "dp": dp, "tp": tp, "tokens_per_s_per_rank": tokens_per_s,
                 "flops_per_token": per_token, "param_bytes_per_rank": held,
                 "wire_per_step": sent, "wire_counted": counted,
                 "peak_memory_bytes": peak_memory(device)})
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "tp", who_am_i()[2])  # + --dp; checked
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. DTensor's collectives keep gloo's
    # groups, and their threads, alive past destroy_process_group(), and the teardown can then abort
    # a finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
