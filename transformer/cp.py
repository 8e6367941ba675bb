#!/usr/bin/env python
"""The chapter's GPT with context parallelism: each rank holds 1/N of every sequence's tokens,
and attention's keys and values go round the ranks in a ring (ring attention, written by hand).
[1]-[8]: the course's recipe; transformer/README.md explains each line here.

    torchrun --nproc_per_node 2 transformer/cp.py              each rank: half of each sequence
    torchrun --nproc_per_node 2 transformer/cp.py --context 256      longer sequences, same memory
    python transformer/cp.py                                   one process: the whole sequence
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
from torch.nn.parallel import DistributedDataParallel as DDP

from transformer import chapter, text  # what the six lessons do alike; the text and its flags
from transformer import model as gpt  # the chapter's model
from transformer.measure import WireBytes, flops_per_token, peak_memory  # what it measures
from utils import log  # the course's helper: rank 0's lines and run files

FRAMEWORK = "transformer-cp"
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


def ring_pass(group, *tensors):
    """Each tensor to the next rank of the ring, the previous rank's received (one batch of
    point-to-point sends and receives, so no rank waits on another's send to go first)."""
    n, r = group.size(), group.rank()
    to, of = (dist.get_global_rank(group, (r + d) % n) for d in (1, -1))
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [op for t, got in zip(tensors, received) for op in (
        dist.P2POp(dist.isend, t, to, group), dist.P2POp(dist.irecv, got, of, group))]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def scores(q, k, diagonal):
    """Q K^T / sqrt(head size) of a block; the diagonal block (this rank's own keys) is masked
    causally, and blocks of later tokens are never computed (they would be all masked)."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if diagonal:
        T = s.shape[-1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    return s


class RingAttention(torch.autograd.Function):
    """Causal attention over a sequence split into N contiguous parts, one per rank: the keys
    and values travel round the ring, each rank merging the blocks of its queries' past into
    one softmax as they arrive (the online softmax: running output and log-sum-exp). Backward
    sends them round again, with their gradients following until they are home."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        n, r = group.size(), group.rank()
        out = torch.zeros_like(q)  # the softmax-weighted values so far, and their log-sum-exp
        lse = torch.full((*q.shape[:-1], 1), -torch.inf, dtype=q.dtype, device=q.device)
        kv = (k, v)
        for step in range(n):
            source = (r - step) % n  # whose tokens these keys and values are
            if source <= r:  # (later ranks' tokens are the future: skipped)
                s = scores(q, kv[0], diagonal=source == r)
                new = torch.logaddexp(lse, s.logsumexp(-1, keepdim=True))
                out = out * (lse - new).exp() + (s - new).exp() @ kv[1]  # rescaled, merged
                lse = new
            if step < n - 1:
                kv = ring_pass(group, *kv)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        n, r = ctx.group.size(), ctx.group.rank()
        D = (dout * out).sum(-1, keepdim=True)  # softmax's backward, per query
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for step in range(n):
            source = (r - step) % n  # dk, dv: the gradients of these keys and values so far
            if source <= r:
                p = (scores(q, k, diagonal=source == r) - lse).exp()  # probabilities, recomputed
                ds = p * (dout @ v.transpose(-2, -1) - D)
                dq = dq + ds @ k * q.shape[-1] ** -0.5
                dk = dk + ds.transpose(-2, -1) @ q * q.shape[-1] ** -0.5
                dv = dv + p.transpose(-2, -1) @ dout
            # on, with the keys they belong to; after N passes each gradient is at its owner
            k, v, dk, dv = ring_pass(ctx.group, k, v, dk, dv) if step < n - 1 else (
                k, v, *ring_pass(ctx.group, dk, dv))
        return dq, dk, dv, None


def apply_cp(model, ring):
    """[5] Attention is the one layer whose tokens meet other ranks' tokens: in every block it
    becomes ring attention over the group `ring` (each rank holds T/N of every sequence)."""
    for block in model.blocks:
        block.attn.attend = lambda q, k, v, dropout: RingAttention.apply(q, k, v, ring)


def run_epoch(model, optimizer, tokens, starts, args, device, progress=None, wire=None):
    """Train on (or, without a progress line, evaluate) this rank's part of each sequence."""
    model.train(progress is not None)
    sums, part = [0.0, 0, 0], args.context // dist.get_world_size()
    first = dist.get_rank() * part  # this rank's tokens: [first, first + part) of each sequence
    for step, batch in enumerate(starts):
        x, y = (t[:, first:first + part].to(device)
                for t in text.windows(tokens, batch, args.context))
        with torch.set_grad_enabled(progress is not None), (
                wire if step == 1 and wire else nullcontext()):
            logits = model(x, first)  # positions first..: where these tokens are in the sequence
            loss = gpt.loss_fn(logits, y)  # the mean over this rank's tokens
            if progress is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # [6] DDP averages over the ranks: the mean over all tokens
                optimizer.step()
        if progress is not None:  # the mean over all the tokens (rank 0's are each sequence's first)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            progress.update(step + 1, mean.item() / dist.get_world_size())
        sums = [sums[0] + loss.item() * y.numel(), sums[1] + (logits.argmax(-1) == y).sum().item(),
                sums[2] + y.numel()]
    return sums


def wire_count(args, cp, batch):
    """The lesson's own count of what a rank sends in one training step (fp32): per block, the
    keys and values (each [batch, T/cp, C]) passed N-1 times forward and N-1 times backward,
    and their gradients N times; DDP's all-reduce of the gradients, once."""
    kv = batch * args.context // cp * args.width * 4
    L = args.layers
    return {"c10d.send": {"calls": L * (4 * (cp - 1) + 2 * cp),
                          "bytes": L * (4 * (cp - 1) + 2 * cp) * kv}}


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
    # [1] Join the process group; the ring's sends on a group of their own (the same ranks),
    #     apart from DDP's all-reduces in backward.
    backend = args.backend
    if backend == "auto":
        backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # gloo between CPUs
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, world_size, wait)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=wait, store=store)
    ring = dist.new_group()
    run, log_dir, train, test, about = chapter.open_run("transformer-cp", args, rank, local_rank)
    config = chapter.model_config(args)
    model = gpt.GPT(config).to(device)  # the same weights on every rank (model.py: seeded)
    per_token = flops_per_token(model, train, args.context, device)  # the whole model
    # [5] Every rank holds the whole model; its attention becomes ring attention. Then DDP, as in
    #     ddp.py.
    if world_size > 1:
        apply_cp(model, ring)
        model = DDP(model, device_ids=[device] if gpu else None)
    log.info(f"{FRAMEWORK}: {world_size} rank(s) via {launcher}, each {args.context // world_size}"
             f" of the {args.context} tokens of a sequence, device {device}, backend {backend}, "
             f"{threads} thread(s) per rank\n{about}\nmodel: {config}")
    # [4] No LR scaling: the ranks share the same sequences, the batch is one process's.
    lr = args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    run.write_config(args, dict(rank=rank, local_rank=local_rank, world_size=world_size,
                                local_world_size=local_size, launcher=launcher, device=device,
                                backend=backend, num_threads=threads, log_dir=log_dir,
                                master_addr=os.environ["MASTER_ADDR"], cp=world_size, scaled_lr=lr),
                    FRAMEWORK)
    steps = min(args.max_steps, max(1, len(train) // (args.batch_size * args.context)))
    tests = chapter.test_starts(test, args.context)
    wire = WireBytes()
    for epoch in range(1, args.epochs + 1):
        # [3] No sharding of sequences: every rank draws the same ones, and takes its tokens.
        starts = chapter.draw_starts(train, args, epoch, steps, args.batch_size)
        start = time.perf_counter()
        sums = run_epoch(model, optimizer, train, starts, args, device,
                         log.Progress(rank == 0, steps, epoch, args.log_interval), wire)
        train_time = torch.tensor([time.perf_counter() - start], device=device)
        sums += run_epoch(model, optimizer, test, tests.split(args.test_batch_size), args, device)
        sums = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # [7] metrics: each rank counted its tokens
        dist.all_reduce(train_time, op=dist.ReduceOp.MAX)  # the slowest rank's time
        run.epoch_end(epoch, sums.tolist(), lr, time.perf_counter() - start, train_time.item())
    tokens_per_s = run.history[-1]["samples_per_s"] / world_size if run.history else 0.0
    sent, counted = wire.per_step(), wire_count(args, world_size, args.batch_size)
    log.info(f"{tokens_per_s:,.0f} tokens/s per rank; a step sends "
             f"{sent.get('c10d.send', {}).get('bytes', 0) / 2**20:.2f} MiB of keys, values and "
             f"their gradients per rank (counted: {counted['c10d.send']['bytes'] / 2**20:.2f} "
             f"MiB); peak memory {peak_memory(device) / 2**20:,.0f} MiB (rank 0)")
    net = model.module if world_size > 1 else model
    if args.save_model and rank == 0:  # [8] one writer: every rank holds the same whole model
        log.atomic_write(Path(log_dir) / "model.pt", lambda f: torch.save(net.state_dict(), f),
                         mode="wb")
    run.summary({"device": device, "cp": world_size, "tokens_per_s_per_rank": tokens_per_s,
                 "flops_per_token": per_token, "wire_per_step": sent,
                 "wire_counted": counted if world_size > 1 else {},
                 "peak_memory_bytes": peak_memory(device)})
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = text.parser(__doc__, "cp", who_am_i()[2])  # checked: --context divides
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
