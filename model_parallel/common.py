"""What the two model-parallel lessons share: the MLP they split, their flags and checks, and the
counters behind their summary.json (bytes sent per step; a pipeline stage's compute time, memory).

The counters only watch: the lessons' steps are all in tensor_parallel.py and pipeline_parallel.py.
"""
import hashlib
import statistics
import time
from collections import Counter, OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from utils import parse_args
from utils.parse_args import get_parser, positive_int

LAYERS = 4  # hidden layers fc1..fc4 (784 -> W, then W -> W), then the 10-way head


def mlp(width):
    """784 -> W -> W -> W -> W -> 10, ReLUs: 3,962,890 parameters at W = 1024 (3.3 x the CNN)."""
    dims = [784] + [width] * LAYERS
    layers = [("flat", nn.Flatten())]
    for i in range(LAYERS):
        fc = nn.Linear(dims[i], dims[i + 1])
        # He init: with torch's default the signal shrinks layer by layer and 4 layers learn slowly
        # (0.87 after 2 epochs, not 0.92).
        nn.init.kaiming_normal_(fc.weight, nonlinearity="relu")
        nn.init.zeros_(fc.bias)
        layers += [(f"fc{i + 1}", fc), (f"relu{i + 1}", nn.ReLU())]
    return nn.Sequential(OrderedDict(layers + [("head", nn.Linear(width, 10))]))


def stage_layers(model, stage, stages):
    """This stage's slice of the MLP, names kept: the first also flattens, the last has the head."""
    per = LAYERS // stages
    names = [f"{kind}{i + 1}" for i in range(stage * per, (stage + 1) * per)
             for kind in ("fc", "relu")]
    names = (["flat"] if stage == 0 else []) + names + (["head"] if stage == stages - 1 else [])
    return nn.Sequential(OrderedDict((name, getattr(model, name)) for name in names))


class Parser(parse_args.Parser):
    """The course's flags, and what these lessons refuse when parsing them, on every rank before any
    process group: flags they do not implement, sizes that do not split over the `ranks`."""

    def __init__(self, ranks, **kwargs):
        super().__init__(**kwargs)
        self.ranks = ranks

    def parse_known_args(self, args=None, namespace=None):
        args, rest = super().parse_known_args(args, namespace)
        for problem in problems(args, self.ranks):
            self.error(problem)  # one line, exit 2
        return args, rest


def parser(doc, ranks, dp=False, schedules=None):
    """The course's flags and --width (no dropout); dp: + --dp (tensor_parallel.py); schedules:
    + --schedule, --micro-batches (pipeline_parallel.py)."""
    p = get_parser(doc, cls=lambda **kwargs: Parser(ranks, **kwargs))
    p.set_defaults(dropout=0.0)
    p.add_argument("--width", type=positive_int, default=1024,
                   help="width of the MLP's four hidden layers")
    if dp:
        p.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas: the "
                       "ranks form a dp x tp mesh, tp = world size / dp")
    if schedules:
        p.add_argument("--micro-batches", type=positive_int, default=4,
                       help="micro-batches per batch (K)")
        p.add_argument("--schedule", choices=schedules, default="1f1b", help="pipeline schedule")
    return p


def problems(args, ranks):
    """What these lessons cannot do with these flags on `ranks` ranks."""
    if args.resume or args.checkpoint_dir:
        yield ("--resume/--checkpoint-dir: the model-parallel lessons keep no checkpoints "
               "(--save-model writes the final weights)")
    if args.grad_accum != 1:
        yield ("--grad-accum: not in the model-parallel lessons (pipeline_parallel.py's "
               "--micro-batches is gradient accumulation)")
    if args.dropout:
        yield "--dropout: the lessons' MLP has no dropout layers"
    if hasattr(args, "dp") and ranks % args.dp:  # tensor_parallel.py: tp = ranks / dp
        yield f"--dp {args.dp} does not divide the {ranks} rank(s) into dp x tp"
    elif hasattr(args, "dp") and args.width % (ranks // args.dp):
        yield (f"{ranks // args.dp} tensor-parallel ranks do not divide the layer width "
               f"{args.width} (--width): each rank must hold an equal slice")
    if hasattr(args, "schedule"):  # pipeline_parallel.py: one stage per rank
        k = args.micro_batches
        if LAYERS % ranks:
            yield (f"the MLP's {LAYERS} hidden layers do not split into {ranks} equal stages "
                   f"(one per rank): run 1, 2 or 4 ranks")
        if args.batch_size % k:
            yield (f"--micro-batches {k} does not divide --batch-size {args.batch_size} "
                   f"into equal micro-batches")
        if args.schedule == "1f1b" and k < ranks:
            yield (f"--schedule 1f1b needs at least one micro-batch per stage: "
                   f"--micro-batches {k} < {ranks} stages")


def gather(obj):
    """Every rank's `obj`, in rank order (one process: [obj])."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def slowest(seconds, device):
    """The largest over the ranks of a time (of a list of times: their median)."""
    seconds = statistics.median(seconds) if isinstance(seconds, list) else seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def full_tensor(t):
    """The whole tensor: a DTensor's slices gathered (a collective), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def checksum(state):
    """sha256 of a state dict's tensors, in name order: equal only for identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(state[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def local(t):
    """This rank's part of a tensor: a DTensor's local slice, a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def tensor_parallel_report(model, state):
    """What each rank holds: its slices' checksum (equal over dp), parameter bytes, the split
    weights' elements per rank and in full (lists: every rank's value)."""
    split = [p for p in model.parameters()
             if isinstance(p, DTensor) and isinstance(p.placements[-1], Shard)]
    slices = {name: local(t) for name, t in model.state_dict().items()}
    return {"param_checksums": gather(checksum(slices)),
            "param_bytes_per_rank": gather(sum(local(p).nbytes for p in model.parameters())),
            "param_bytes_full_model": sum(t.nbytes for t in state.values()),
            "split_param_numel": {"full": sum(p.numel() for p in split),
                                  "per_rank": gather(sum(local(p).numel() for p in split))}}


def pipeline_report(part, stage, state, timing, wire, k, schedule):
    """What each stage holds and sends; its measured idle fraction against the bubble,
    (S-1) / (K+S-1); the slowest stage's median step time."""
    stages, nan = dist.get_world_size() if dist.is_initialized() else 1, float("nan")
    _, pipe_s, compute_s = (sum(column) for column in zip(*timing)) if timing else (0.0, nan, 0.0)
    return {"param_bytes_per_rank": gather(sum(p.nbytes for p in part.parameters())),
            "param_bytes_full_model": sum(t.nbytes for t in state.values()),
            "pipeline": {"stages": stages, "micro_batches": k, "schedule": schedule,
                         "idle_fraction": gather(1 - compute_s / pipe_s if stage else 0.0),
                         "idle_fraction_theory": (stages - 1) / (k + stages - 1),
                         "peak_micro_batches_in_flight": gather(
                             getattr(stage, "peak_in_flight", 0))},
            "wire_bytes_per_step": gather(wire.per_step()),
            "step_time_s": max(gather(statistics.median(t[0] for t in timing) if timing else nan))}


WIRE_OPS = ("all_reduce", "allreduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
            "broadcast_", "send")


class WireBytes(TorchDispatchMode):
    """Counts, while entered, the bytes this rank hands to collectives and sends: DTensor's
    functional collectives (torch.ops._c10d_functional.*), torch.distributed's all_reduce and the
    pipeline's send (torch.ops.c10d.*) all pass through the dispatcher, where this mode sees them,
    in forward and in backward. Payload bytes per call (a ring all-reduce of S bytes moves
    2(N-1)/N x S per rank); receives not counted."""

    def __init__(self):
        super().__init__()
        self.bytes, self.calls, self.steps = Counter(), Counter(), 0

    def __enter__(self):
        self.steps += 1
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns the op into plain ops and collectives: see those
        name = func._overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d") and name in WIRE_OPS:
            # The payload: the first tensor argument.
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)][:1]
            key = f"{func.namespace}.{name}"  # _c10d_functional.all_reduce, c10d.send, ...
            self.calls[key] += 1
            self.bytes[key] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))

    def per_step(self):
        steps = max(1, self.steps)
        return {name: {"calls": self.calls[name] // steps, "bytes": self.bytes[name] // steps}
                for name in sorted(self.bytes)}


class TimedStage(PipelineStage):
    """A PipelineStage that also measures what the bubble is made of: seconds computing forward and
    backward of its micro-batches (the rest of a schedule step is waiting or communicating), and
    the most micro-batches whose activations (saved for backward) it held at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute_s, self.in_flight, self.peak_in_flight = 0.0, 0, 0

    def forward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().forward_one_chunk(*args, **kwargs)
        self.compute_s += time.perf_counter() - start
        if self.has_backward:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return out

    def backward_one_chunk(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().backward_one_chunk(*args, **kwargs)
        self.compute_s += time.perf_counter() - start
        self.in_flight -= 1
        return out
