"""What the two model-parallel lessons measure for summary.json: bytes sent per step, what each rank
holds, a pipeline stage's compute time and activations in flight, the slowest rank's times.

The counters only watch: the lessons' steps are all in tensor_parallel.py and pipeline_parallel.py.
"""
import hashlib
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from model_parallel.common import local


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


def checksum(state):
    """sha256 of a state dict's tensors, in name order: equal only for identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(state[name].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


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
