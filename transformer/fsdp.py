#!/usr/bin/env python
"""The chapter's GPT with FSDP2 (`fully_shard`): each rank holds 1/N of the weights, gradients and
AdamW's state, and gathers a block's weights only while it computes with them. [1]-[8]: the
course's recipe; transformer/README.md explains each line here.

    torchrun --nproc_per_node 2 transformer/fsdp.py                  each rank: half of everything
    torchrun --nproc_per_node 4 transformer/fsdp.py --replicate 2    HSDP: 2 copies x 2 shards
    torchrun --nproc_per_node 2 transformer/fsdp.py --bf16           bf16 compute, fp32 reductions
    python transformer/fsdp.py                                       one process: a group of one
    torchrun --nproc_per_node 4 transformer/fsdp.py --log-dir r          saves each epoch (DCP)
    torchrun --nproc_per_node 2 transformer/fsdp.py --log-dir r --resume --epochs 2    ...on 2
"""
import hashlib
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import flops_per_token, matmul_peak, peak_memory  # what it measures
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-fsdp2"
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


def apply_fsdp(model, mesh, bf16):
    """[5] FSDP2: shard each block, then the rest (the embeddings, the last norm): every parameter
    becomes a DTensor of which this rank keeps 1/shards (with --replicate, a 2-D mesh: each copy
    sharded over its ranks). --bf16: weights cast to bf16 for compute, gradients reduced in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def run_epoch(model, optimizer, tokens, starts, args, device, progress=None):
    """Train on (or, without a progress line, evaluate) the windows at `starts`, in batches."""
    model.train(progress is not None)
    sums = [0.0, 0, 0]  # loss x tokens, right guesses, tokens
    for step, batch in enumerate(starts):
        x, y = (t.to(device) for t in text.windows(tokens, batch, args.context))
        with torch.set_grad_enabled(progress is not None):
            logits = model(x)  # each block all-gathers its weights first, then frees them
            loss = gpt.loss_fn(logits, y)
        if progress is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # [6] gradients averaged: each block's reduce-scattered in backward
            optimizer.step()  # on this rank's slices only
            progress.update(step + 1, loss.item())
        sums = [sums[0] + loss.item() * y.numel(), sums[1] + (logits.argmax(-1) == y).sum().item(),
                sums[2] + y.numel()]
    return sums


def held_bytes(model, optimizer):
    """What this rank holds: its slices of the weights, their gradients and AdamW's two moments."""
    def size(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    moments = [s for p in params for k, s in optimizer.state[p].items() if k != "step"]
    return {"params": sum(map(size, params)), "grads": sum(size(p.grad) for p in params),
            "optimizer": sum(map(size, moments))}


def mark(tag, saving, folder, rank, kept):
    """(In a thread) Wait for a background save (it ends once rank 0 wrote .metadata, after every
    rank's slices); at once rank 0 points `latest` at it, removes the one before: one always whole."""
    saving.result()
    if rank == 0:
        log.atomic_write(folder / "latest", lambda f: f.write(tag))
        if kept:
            shutil.rmtree(folder / kept, ignore_errors=True)
    return tag


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
    # [1] Join the process group (one process: a group of one, the same program), then lay the
    #     ranks out: --replicate R copies of the model, each sharded over world_size / R ranks.
    backend = args.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, world_size, wait)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=wait, store=store)
    shards = world_size // args.replicate  # (text.Parser checked that it divides)
    mesh = init_device_mesh(device.split(":")[0], (args.replicate, shards),
                            mesh_dim_names=("replicate", "shard"))
    run, log_dir, train, test, about = chapter.open_run("transformer-fsdp", args, rank, local_rank)
    config = chapter.model_config(args)
    # [5] Build on the meta device (shapes, no memory), shard it, then allocate the slices and
    #     initialise them (model.py: the same model at any world size).
    with torch.device("meta"):
        model = gpt.GPT(config)
    apply_fsdp(model, mesh if args.replicate > 1 else mesh["shard"], args.bf16)
    model.to_empty(device=device)
    model.init_weights()
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher} = {args.replicate} cop(ies) x "
             f"{shards} shard(s), device {device}, backend {backend}, {threads} thread(s) per "
             f"rank, {'bf16' if args.bf16 else 'fp32'}\n{about}\nmodel: {config}")
    per_token = flops_per_token(model, train, args.context, device)  # before any step: counts
    # [4] Scale the LR with the global batch (world_size x one rank's), as the course does; for
    #     AdamW that rule is a choice, not a law (README.md, [4]).
    lr = args.lr * world_size if not args.no_lr_scaling else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    # [8] Checkpoints (torch.distributed.checkpoint, DCP): a folder per epoch, each rank writing
    #     its own slices, .metadata saying which file holds what. On a gloo group of their own:
    #     a save in the background never meets training's collectives (nor needs a GPU's).
    folder = log.checkpoint_folder(args.checkpoint_dir, log_dir)
    saver = dist.new_group(backend="gloo")
    first_epoch, shape, kept = 1, config.shape(), None  # kept: the last whole checkpoint
    if args.resume and (folder / "latest").is_file():
        kept = tag = (folder / "latest").read_text().strip()
        meta = {"epoch": 0, "shape": dict(shape)}  # read first: the model it holds
        dcp.load({"meta": meta}, checkpoint_id=folder / tag, process_group=saver)
        for k in (k for k in shape if meta["shape"][k] != shape[k]):  # one line, every rank
            raise SystemExit(f"error: --{k} {shape[k]}: {folder / tag} is of {k} {meta['shape'][k]}")
        # Resharding on load, as zero/fsdp_checkpoint.py teaches it: each rank reads the slices its
        # new shards cover. The LR stays this run's ([4]), not the saved one.
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder / tag, process_group=saver)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        optimizer.param_groups[0]["lr"] = lr  # (one group)
        first_epoch = meta["epoch"] + 1
        log.info(f"resumed from {folder / tag} on {world_size} rank(s): epoch {first_epoch}")
    run.keep_epochs_before(first_epoch)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], shards=shards, scaled_lr=lr),
                    FRAMEWORK)
    # an epoch: as many windows as the training text has tokens, or --max-steps (default 200)
    steps = min(args.max_steps, max(1, len(train) // (world_size * args.batch_size * args.context)))
    B, tests = args.batch_size, chapter.test_starts(test, args.context, world_size)  # as many a rank
    marker, marking = ThreadPoolExecutor(1), None  # marks each save when whole, in their order
    for epoch in range(first_epoch, args.epochs + 1):
        # [3] Shard by global rank, as in ddp.py: the same starts drawn for the global batch on
        #     every rank, each taking its own B (FSDP is data parallel: each rank, its sequences).
        starts = chapter.draw_starts(train, args, epoch, steps, world_size * B)
        start = time.perf_counter()
        sums = run_epoch(model, optimizer, train, starts[:, rank * B:(rank + 1) * B], args, device,
                         log.Progress(rank == 0, steps, epoch, args.log_interval))
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        held = held_bytes(model, optimizer)  # (after a step: the gradients and moments exist)
        sums += run_epoch(model, optimizer, test, tests[rank::world_size].split(
            args.test_batch_size), args, device)  # evaluation
        sums = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics summed over ranks
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), lr, time.perf_counter() - start, train_time.item())
        kept = marking.result() if marking else kept  # the previous save done before the next
        model_state, optim_state = get_state_dict(model, optimizer)  # this rank's slices
        saving = dcp.async_save(  # copies them, writes in a thread
            {"model": model_state, "optim": optim_state, "meta": {"epoch": epoch, "shape": shape}},
            checkpoint_id=folder / f"epoch{epoch}", process_group=saver)
        marking = marker.submit(mark, f"epoch{epoch}", saving, folder, rank, kept)
    if marking:
        marking.result()  # the last save whole and marked
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    peak = matmul_peak(device)
    mfu = tokens_per_s * per_token / peak
    log.info(f"{tokens_per_s:,.0f} tokens/s per rank x {per_token / 1e6:.1f} MFLOP/token: MFU "
             f"{mfu:.1%} of a measured {peak / 1e9:.0f} GFLOP/s matmul rate ({threads} thread(s))")
    everyone = [None] * world_size
    dist.all_gather_object(everyone, held)  # what each rank holds
    # [8] --save-model: the plain full state dict for one process (inference, ddp.py's
    #     model.pt): each DTensor gathered whole (a collective) to rank 0's CPU; rank 0 writes it.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    if args.save_model and rank == 0:
        log.atomic_write(Path(log_dir) / "model.pt", lambda f: torch.save(state, f), mode="wb")
    weights = torch.cat([t.detach().float().flatten() for t in state.values()]) if state else None
    run.summary({"weights_checksum": hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
                 if rank == 0 else None,
                 "device": device, "tokens_per_s_per_rank": tokens_per_s, "mfu": mfu,
                 "flops_per_token": per_token, "matmul_peak": peak, "held_bytes_per_rank": everyone,
                 "parameters": sum(p.numel() for p in model.parameters()), "shards": shards,
                 "replicate": args.replicate, "bf16": args.bf16,
                 "peak_memory_bytes": peak_memory(device)})
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "fsdp", who_am_i()[2])  # + --replicate, --bf16; checked
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. FSDP2's DTensors keep gloo's
    # groups, and their threads, alive past destroy_process_group(), and the teardown can then abort
    # a finished rank ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
