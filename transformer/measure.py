"""What the split lessons of the chapter measure (they only watch: every step is in the lesson):
the bytes a rank hands to collectives and sends in a step, and a pipeline stage's compute time."""
import time
from collections import Counter

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

WIRE_OPS = ("all_reduce", "allreduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
            "broadcast_", "send", "alltoall_base_")


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

    def backward_weight_one_chunk(self, *args, **kwargs):  # (zero-bubble: the weights' part later)
        start = time.perf_counter()
        out = super().backward_weight_one_chunk(*args, **kwargs)
        self.compute_s += time.perf_counter() - start
        return out
