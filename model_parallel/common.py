"""What the two model-parallel lessons share: the MLP they split, their flags and checks, and a
DTensor's local slice or whole tensor. What they measure for summary.json is in counters.py.
"""
from collections import OrderedDict

import torch.nn as nn
from torch.distributed.tensor import DTensor

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


def full_tensor(t):
    """The whole tensor: a DTensor's slices gathered (a collective), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t):
    """This rank's part of a tensor: a DTensor's local slice, a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t
