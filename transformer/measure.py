"""What the chapter's lessons measure (they only watch: every step is in the lesson): the model's
FLOPs per token, the measured matmul peak and the peak memory (MFU and memory against time), the
bytes a rank hands to collectives and sends in a step, and a pipeline stage's compute time."""
import sys
import time
from collections import Counter

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from transformer.model import MoE, loss_fn
from transformer.text import windows

WIRE_OPS = ("all_reduce", "allreduce_", "all_gather_into_tensor", "reduce_scatter_tensor",
            "broadcast_", "send", "all_to_all_single")


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
    when: `events`, the last training step's (kind F, B or W (zero bubble: the weights' part of
    backward), micro-batch, stage, start, end) in time.perf_counter() seconds (one clock for the
    processes of one machine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compute_s, self.events = 0.0, []

    def timed(self, kind, chunk, work, *args, **kwargs):
        start = time.perf_counter()
        out = work(chunk, *args, **kwargs)
        end = time.perf_counter()
        self.compute_s += end - start
        if self.has_backward:  # (training; evaluation runs forward only)
            self.events = [] if (kind, chunk) == ("F", 0) else self.events  # a new step
            self.events.append((kind, chunk, self.stage_index, start, end))
        return out

    def forward_one_chunk(self, chunk, *args, **kwargs):
        return self.timed("F", chunk, super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, chunk, *args, **kwargs):
        return self.timed("B", chunk, super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, chunk, *args, **kwargs):
        return self.timed("W", chunk, super().backward_weight_one_chunk, *args, **kwargs)


def _attention(q, k, v, *args, out_shape=None, **kwargs):  # shapes [B, heads, T, head size]
    return 4 * q[0] * q[1] * q[2] * k[2] * q[3]  # Q K^T and (softmax) V: 2 FLOPs per multiply-add


def _attention_backward(grad, q, k, v, *args, out_shape=None, **kwargs):
    return 2 * _attention(q, k, v)  # the gradients of Q, K, V and the scores: 4 products


# FlopCounterMode knows the GPU attention kernels, not the CPU one: counted as torch counts those
CPU_ATTENTION = {}
for _kernel, _formula in (("_scaled_dot_product_flash_attention_for_cpu", _attention),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward)):
    if hasattr(torch.ops.aten, _kernel):
        CPU_ATTENTION[getattr(torch.ops.aten, _kernel)] = _formula


def flops_per_token(model, tokens, context, device):
    """FLOPs of one forward and backward per token, counted by torch's FlopCounterMode on the
    text's first window (matmuls and attention, whole: the causal mask's skipped half is counted,
    as torch does). Before any step: the count leaves no gradient and no routing behind."""
    from torch.utils.flop_counter import FlopCounterMode
    x, y = (t.to(device) for t in windows(tokens, torch.tensor([0]), context))
    recompute, model.config.recompute = model.config.recompute, False  # the model's, not redone
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    model.config.recompute = recompute
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.load.zero_()  # (the counted sequence's routing is no training's)
    return counter.get_total_flops() / y.numel()


def peak_memory(device):
    """The most memory this process held, in bytes: on a GPU the allocator's peak; on CPUs the
    peak resident set (all of it: torch's libraries, Python, the text, the activations)."""
    if device != "cpu":
        return torch.get_device_module(device).max_memory_allocated(device)
    import resource  # (Linux counts KiB, macOS bytes)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                  else 1024)


def matmul_peak(device, n=1024, seconds=0.5):
    """The measured FP32 matmul rate (FLOP/s) of this rank's device and threads: the best of
    repeated n x n products for about `seconds` (the ceiling MFU is taken against)."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best, end = 0.0, time.perf_counter() + seconds
    on_gpu = device != "cpu"
    while time.perf_counter() < end:
        if on_gpu:
            torch.accelerator.synchronize()
        t = time.perf_counter()
        a @ b
        if on_gpu:
            torch.accelerator.synchronize()  # the product is done, not only queued
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best
