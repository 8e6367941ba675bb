#!/usr/bin/env python
"""ZeRO on MNIST: a wide MLP trained a few Adam steps by plain data parallelism, by DeepSpeed's ZeRO
stages 1-3 (with or without CPU offload) and by PyTorch's ZeroRedundancyOptimizer and FSDP2
fully_shard, and what each rank then holds, counted in bytes (zero/census.py).

    torchrun --nproc_per_node 2 zero/main.py --variant ds3     # one variant on 2 ranks
    python zero/main.py --variant torch-fsdp2                  # one process (a group of one)
    python zero/report.py --ranks 2 4                          # every variant, one after another

[1]-[8]: the course's recipe (README.md); zero/README.md explains each line, and why [4] is missing.
"""
import os
import sys
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import deepspeed  # the installed library: the repo root is last on sys.path
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and files
from zero import census, flags  # what each rank holds, in bytes; the flags, shared with report.py

VARIANTS = {  # name: (label, ZeRO stage, optimizer state and step on the CPU)
    "ds0": ("DeepSpeed stage 0 (plain data parallel)", 0, False),
    "ds1": ("DeepSpeed ZeRO-1", 1, False),
    "ds2": ("DeepSpeed ZeRO-2", 2, False),
    "ds3": ("DeepSpeed ZeRO-3", 3, False),
    "ds2-offload": ("DeepSpeed ZeRO-2 + CPU offload", 2, True),
    "ds3-offload": ("DeepSpeed ZeRO-3 + CPU offload", 3, True),
    "torch-zero1": ("PyTorch DDP + ZeroRedundancyOptimizer", 1, False),
    "torch-fsdp2": ("PyTorch FSDP2 fully_shard", 3, False),
}
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


def mlp(hidden, layers):
    dims = [784] + [hidden] * (layers + 1)
    blocks = []
    for a, b in zip(dims[:-1], dims[1:]):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10), nn.LogSoftmax(dim=1))


def main(args):
    label, stage, offload = VARIANTS[args.variant]
    deepspeed_run = args.variant.startswith("ds")
    # [1] Who am I, and where do the ranks meet? As in DDP/main.py.
    rank, local_rank, n, local_size, launcher = who_am_i()
    if n > 1 and "MASTER_ADDR" not in os.environ and local_size < n:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(n))
    log.configure(rank)
    # [2] Pin this rank to one device, as in DDP/main.py (and DeepSpeed's accelerator layer)
    gpu = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    gpu = gpu.type if gpu and gpu.type in ("cuda", "xpu") and args.device != "cpu" else None
    device = f"{gpu}:{local_rank % torch.accelerator.device_count()}" if gpu else "cpu"
    if gpu:
        torch.accelerator.set_device_index(device)  # DeepSpeed's engine and fully_shard follow it
    elif deepspeed_run:  # on a GPU node too: DeepSpeed's engine would move the model to the GPU
        set_accelerator(CPU_Accelerator())
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference only: no build
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores if cores < os.cpu_count() else max(1, cores // local_size))
    backend = {"cuda": "nccl", "xpu": "xccl"}.get(gpu, "gloo")  # [1] the group: gloo, nccl or xccl
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, n, wait)
    if deepspeed_run and store is None:  # ... through DeepSpeed's comm layer (no MPI discovery)
        deepspeed.init_distributed(backend, auto_mpi_discovery=False, verbose=False, timeout=wait)
    else:  # (one process, or a restart: DeepSpeed's layer takes this group as it is)
        dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=wait)
    mnist = data.load_shipped()  # [3] shard by *global* rank: the same seeded shuffle, 1/n each
    train_set = TensorDataset(torch.from_numpy(data.normalized(mnist.x_train).reshape(-1, 784)),
                              torch.from_numpy(mnist.y_train))
    sampler = DistributedSampler(train_set, num_replicas=n, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, drop_last=True, sampler=sampler)
    batches = [(x.to(device), y.to(device)) for x, y in islice(loader, args.steps)]  # moved once
    base_rss = census.rss_bytes()
    torch.manual_seed(args.seed)  # the same initial weights on every rank ...
    model = mlp(args.hidden, args.layers).to(device)
    psi = sum(p.numel() for p in model.parameters())
    log.info(f"{args.variant}: {label} on {n} rank(s) via {launcher}; MLP 784-{args.hidden}x"
             f"{args.layers + 1}-10, {psi:,} parameters; {args.steps} Adam steps of "
             f"{args.batch_size} digits per rank")
    # [5] wrap the model and the optimizer; each starts from rank 0's weights.
    if deepspeed_run:  # stage 0: nothing partitioned; 1: Adam's state; 2: + gradients; 3: + params
        zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False,
                # buckets of 2M elements (8 MB); DeepSpeed's 500M default would be 2 GB here
                "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}
        if stage == 3:  # gather 2M elements ahead; partition every parameter, even the small biases
            zero.update(stage3_prefetch_bucket_size=2_000_000, stage3_param_persistence_threshold=0)
        if offload:  # ZeRO-Offload: Adam's state, fp32 copy and step on the CPU (DeepSpeedCPUAdam)
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        adam_params = {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                       "adam_w_mode": False,  # torch.optim.Adam inside (no FusedAdam build) unless
                       "torch_adam": not offload}  # offload: then DeepSpeedCPUAdam
        config = {"train_micro_batch_size_per_gpu": args.batch_size, "steps_per_print": 10**6,
                  "optimizer": {"type": "Adam", "params": adam_params}, "zero_optimization": zero,
                  "gradient_clipping": 0.0}  # DeepSpeed 0.19.8 clips to 1.0 unless told; torch not
        # [5] ... the engine broadcasts rank 0's weights, builds the (stage >= 1: partitioned) Adam
        model, optimizer, _, _ = deepspeed.initialize(model=model, config=config,
                                                      model_parameters=model.parameters())
        adam = getattr(model, "basic_optimizer", None) or optimizer  # the Adam that holds the state
    elif args.variant == "torch-zero1":
        model = DDP(model, gradient_as_bucket_view=True)  # [5] ... DDP broadcasts rank 0's weights
        # ZeRO-1: each rank's Adam owns whole parameters, about 1/N of them, with their state only
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=args.lr)
        adam = optimizer.optim
    else:  # torch-fsdp2
        # [5] ... fully_shard does not broadcast: send rank 0's weights first
        for param in model.parameters():
            dist.broadcast(param.detach(), src=0)
        # ZeRO-3: every Linear a unit of its own, gathered whole only for its forward and backward
        mesh = init_device_mesh(device.split(":")[0], (n,))  # the ranks' devices (cpu: even on
        for layer in model:  # a GPU node; fully_shard's default mesh is the node's accelerator)
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # parameters now DTensors: each rank holds 1/N of each
        optimizer = adam = torch.optim.Adam(model.parameters(), lr=args.lr)  # state: its shards
    setup_rss, peak_reset = census.rss_bytes(), census.reset_peak_rss()  # the peak from here on
    losses, start = [], time.perf_counter()
    for step, (x, y) in enumerate(batches, 1):
        loss = F.nll_loss(model(x), y)  # ZeRO-3/fully_shard: each layer all-gathered, used, freed
        if deepspeed_run:  # [6] the engine averages the gradients: stage 0 all-reduces them;
            model.backward(loss)  # stages 1-3 reduce them in buckets, each rank keeping its slice
        else:  # [6] averaged in backward: DDP all-reduces its buckets (torch-zero1), fully_shard
            loss.backward()  # reduce-scatters each layer's gradient into this rank's shard
        if step == len(batches):  # gradients held now, Adam's state since step 1: count bytes
            held = census.census(model, optimizer, adam)
        if deepspeed_run:  # stage 0: every rank updates every weight; 1-2: each its slice, then an
            model.step()  # all-gather refills every full copy; 3: each updates and keeps its slice
        else:
            optimizer.step()  # ZeroRedundancyOptimizer: each rank its share, then broadcasts it
            optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # [7] the loss summed over ranks: every rank knows the global mean
        losses.append(total.item() / n)
        log.info(f"step {step}  loss {losses[-1]:.6f}")
    elapsed = time.perf_counter() - start
    held.update(rank=rank, peak_rss=census.peak_rss_bytes(), base_rss=base_rss, setup_rss=setup_rss,
                peak_is_training_only=peak_reset, peak_gpu_mb=census.peak_accelerator_mb())
    per_rank = [None] * n
    dist.all_gather_object(per_rank, held)  # every rank's census, for rank 0's table
    result = dict(variant=args.variant, label=label, stage=stage, offload=offload, ranks=n, psi=psi,
                  hidden=args.hidden, layers=args.layers, batch_size=args.batch_size, device=device,
                  backend=backend, steps=args.steps, losses=losses, train_time_s=elapsed,
                  per_rank=per_rank, formula=census.formula(stage, psi, n))
    log.info(census.describe(result))
    if rank == 0 and args.json:  # [8] one writer: rank 0 writes the file (atomically)
        log.write_json(args.json, result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = flags.parser(__doc__, ranks=who_am_i()[2], variants=VARIANTS)  # checked for n ranks
    if plumbing:
        plumbing.run_main(main, parser)
    else:
        main(parser.parse_args())
    # The run is over: leave without the interpreter's teardown. DDP's reducer, DeepSpeed's engine
    # and FSDP2's DTensors keep gloo's groups, and their threads, alive past
    # destroy_process_group(), and the teardown can then abort a finished rank ("terminate called
    # without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()  # first: mpiexec may drop what a rank writes after MPI_Finalize
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: MPI_Finalize, as mpi4py would at exit
    if mpi and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(0)
