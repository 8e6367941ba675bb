"""What the two model-parallel lessons share: the MLP they split, their flags, and the counters
behind the numbers in their summary.json (bytes each rank sends per step; a pipeline stage's compute
time and memory).

The counters only watch: every step of the lessons is in tensor_parallel.py and
pipeline_parallel.py.
"""
import hashlib
import time
from collections import Counter, OrderedDict

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from utils.log import fail
from utils.parse_args import get_parser, positive_int

LAYERS = 4  # hidden layers fc1..fc4 (784 -> W, then W -> W), then the 10-way head


def mlp(width):
    """784 -> W -> W -> W -> W -> 10 with ReLUs: 3,962,890 parameters at W = 1024 (3.3 x the
    course's CNN)."""
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


def parser(doc):
    """The course's flags, plus --width; this MLP has no dropout."""
    p = get_parser(doc)
    p.set_defaults(dropout=0.0)
    p.add_argument("--width", type=positive_int, default=1024,
                   help="width of the MLP's four hidden layers")
    return p


def check_shared_flags(args):
    """Shared flags these lessons do not implement: one line and exit 2, rather than silently
    ignored."""
    if args.resume or args.checkpoint_dir:
        fail("--resume/--checkpoint-dir: the model-parallel lessons keep no checkpoints "
             "(--save-model writes the final weights)")
    if args.grad_accum != 1:
        fail("--grad-accum: not in the model-parallel lessons (pipeline_parallel.py's "
             "--micro-batches is gradient accumulation)")
    if args.dropout:
        fail("--dropout: the lessons' MLP has no dropout layers")


def full_tensor(t):
    """The whole tensor: a DTensor's slices gathered from its ranks (a collective), a plain tensor
    as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def checksum(state):
    """sha256 of a state dict's tensors, in name order: equal only for identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(state[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


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
    """A PipelineStage that also measures what the bubble is made of: seconds spent computing
    forward and backward of its micro-batches (everything else in a schedule step is waiting or
    communicating), and the most micro-batches whose activations it held at once (saved for their
    backward)."""

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
