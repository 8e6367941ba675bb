#!/usr/bin/env python
"""FSDP2's checkpoint (torch.distributed.checkpoint, DCP), written by some number of ranks and
continued by another: the next job may get another number of nodes.

    torchrun --nproc_per_node 2 zero/fsdp_checkpoint.py --checkpoint-dir runs/fsdp    # saves
    python zero/fsdp_checkpoint.py --checkpoint-dir runs/fsdp --resume                 # 1 rank
    torchrun --nproc_per_node 4 zero/fsdp_checkpoint.py --checkpoint-dir runs/fsdp --resume

Every rank writes only its own shards (a file per rank, and a .metadata file that says which slice
of which tensor each file holds); on load every rank reads just the slices its new shards cover.
[1]-[8]: the course's recipe (README.md); zero/README.md explains this script.
"""
import argparse
import hashlib
import os
import sys
from datetime import timedelta
from itertools import islice
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repo root *after* site-packages
try:  # course plumbing, no step of the recipe (course/plumbing.py): the libraries' noise filtered,
    from course import plumbing  # flags checked, every ending one line. A copy runs without it.
except ImportError:
    plumbing = None

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from utils import data, log  # the course's helpers: MNIST, and rank 0's lines and files
from utils.parse_args import non_negative_int, positive_float, positive_int
from zero.flags import Checked  # a parser that also refuses --resume with nothing to resume

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



def flags():
    def problems(args):
        if args.resume and not (Path(args.checkpoint_dir) / "latest").is_file():
            yield f"--resume: no checkpoint in {args.checkpoint_dir} (no 'latest' file)"
    p = Checked(problems, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="where the checkpoints go")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--steps", type=positive_int, default=3, help="Adam steps in this run")
    p.add_argument("--hidden", type=positive_int, default=512, help="width of the hidden layers")
    p.add_argument("--batch-size", type=positive_int, default=32, help="digits per rank and step")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--dist-timeout", type=positive_int, default=300, help="seconds to wait")
    p.add_argument("--json", help="rank 0 writes the checksums and losses here")
    return p


def mlp(hidden):
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10), nn.LogSoftmax(dim=1))


def checksum(model, optimizer):
    """A hash of the whole model and Adam state, gathered from every rank's shards (a collective;
    rank 0 gets the full tensors, the others an empty dict): equal across world sizes."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=full),
             "optim": get_optimizer_state_dict(model, optimizer, options=full).get("state", {})}
    h = hashlib.sha256()

    def visit(name, value):
        if isinstance(value, dict):
            for key in sorted(value):
                visit(f"{name}.{key}", value[key])
        elif isinstance(value, torch.Tensor):
            h.update(name.encode() + value.detach().float().contiguous().numpy().tobytes())

    visit("", state)
    return h.hexdigest()[:16]


def main(args):
    folder = Path(args.checkpoint_dir)
    # [1] Who am I, and where do the ranks meet? As in DDP/main.py.
    rank, local_rank, n, local_size, launcher = who_am_i()
    if n > 1 and "MASTER_ADDR" not in os.environ and local_size < n:
        from mpi4py import MPI
        os.environ["MASTER_ADDR"] = MPI.COMM_WORLD.bcast(os.uname().nodename, root=0)
    job = (os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or "0").split(".")[0]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(job) % 1000))  # two jobs, two ports
    log.configure(rank)
    # [2] Pin this rank: on GPUs cuda:LOCAL_RANK; here the CPU, each rank its share of the cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores if cores < os.cpu_count() else max(1, cores // local_size))
    # [1] Join the process group (gloo between CPUs; torchrun --max-restarts: this attempt's keys
    #     apart, as in DDP/main.py).
    wait = timedelta(seconds=args.dist_timeout)
    store = meeting_place(rank, n, wait)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=wait)
    log.info(f"FSDP2 + torch.distributed.checkpoint on {n} rank(s) via {launcher}; MLP 784-"
             f"{args.hidden}x2-10; {args.steps} Adam steps of {args.batch_size} digits per rank")
    # [5] Wrap: every Linear a unit of its own, each rank holding 1/n of every parameter, and Adam
    #     keeping state for this rank's shards only. fully_shard does not broadcast: rank 0's
    #     weights first.
    torch.manual_seed(args.seed)
    model = mlp(args.hidden)
    for param in model.parameters():
        dist.broadcast(param.detach(), src=0)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    start, result = 0, {"world_size": n}
    if args.resume:
        tag = (folder / "latest").read_text().strip()
        # [8] Load: this rank's (empty) shards say which slices it needs; DCP reads just those
        #     from whichever files hold them, whatever the world size that wrote them.
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "meta": {"step": 0, "world_size": 0}}
        dcp.load(state, checkpoint_id=folder / tag)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        start = state["meta"]["step"]
        result.update(loaded_checksum=checksum(model, optimizer),
                      written_by=state["meta"]["world_size"])
        log.info(f"loaded {folder / tag}: step {start}, written by {result['written_by']} rank(s), "
                 f"read by {n}; weights + Adam state checksum {result['loaded_checksum']}")

    # [3] Shard the digits by global rank (each run a new shuffle: seeded by the step it starts at).
    mnist = data.load_shipped()
    train_set = TensorDataset(torch.from_numpy(data.normalized(mnist.x_train).reshape(-1, 784)),
                              torch.from_numpy(mnist.y_train))
    sampler = DistributedSampler(train_set, num_replicas=n, rank=rank, seed=args.seed)
    sampler.set_epoch(start)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    losses = []
    for step, (x, y) in enumerate(islice(loader, args.steps), start + 1):
        loss = F.nll_loss(model(x), y)
        loss.backward()  # [6] each layer's gradient reduce-scattered into this rank's shard
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)  # [7] the loss summed over ranks
        losses.append(total.item() / n)
        log.info(f"step {step}  loss {losses[-1]:.6f}")

    # [8] Save: every rank writes its own shards (a collective); rank 0 writes .metadata last. Into
    #     a new folder, and only then `latest` names it: a kill mid-save leaves the previous whole.
    tag = f"step{start + args.steps}"
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state,
              "meta": {"step": start + args.steps, "world_size": n}}, checkpoint_id=folder / tag)
    result.update(saved_checksum=checksum(model, optimizer), losses=losses,
                  step=start + args.steps)
    if rank == 0:
        log.atomic_write(folder / "latest", lambda f: f.write(tag))
        if args.json:
            log.write_json(args.json, result)
    log.info(f"saved {folder / tag} from {n} rank(s); weights + Adam state checksum "
             f"{result['saved_checksum']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = flags()
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
