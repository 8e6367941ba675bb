"""The byte census of zero/main.py: which tensors one rank holds, sorted into the ZeRO paper's
kinds, and the paper's formula to hold them against.

Between the last backward and its optimizer step (gradients exist, and Adam's state exists since
the first step) `census()` walks every tensor reachable from the model and the optimizer, counts
each underlying storage once (a flat buffer and its views are one storage) and sorts it into

- params: the model's parameters, or the slice this rank keeps (DeepSpeed's `ds_tensor` at stage 3,
  the local shard of FSDP2's DTensors);
- grads:  the parameters' `.grad`, and the gradient buffers and buckets the optimizer keeps;
- optim:  Adam's exp_avg and exp_avg_sq in the optimizer that does the update;
- master: parameters the optimizer updates that are not the model's own (DeepSpeed's fp32 copy of
  its slice);
- other:  anything else reached (bookkeeping, staging buffers).

It also reads this process's resident memory (RSS) from /proc.
"""
import gc
import os
import resource

import torch

KINDS = ["params", "grads", "optim", "master", "other"]
NAMES = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
         "master": "fp32 master copy", "other": "other"}
MB = 1e6


def formula(stage, psi, n):
    """Bytes per rank for fp32 training with Adam (ZeRO paper, Rajbhandari et al. 2019, with K=8 and
    4-byte parameters/gradients): P_os at stage >= 1, P_os+g at >= 2, P_os+g+p at 3."""
    return {"params": 4 * psi / (n if stage >= 3 else 1),
            "grads": 4 * psi / (n if stage >= 2 else 1),
            "optim": 8 * psi / (n if stage >= 1 else 1)}


def local(t):
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def walk(obj, path, found, seen, depth=0):
    """Every tensor reachable from obj through attributes, dicts and lists: [(path, tensor)]."""
    if isinstance(obj, torch.Tensor):
        t = local(obj)
        found.append((path, t))
        for attr in ("grad", "ds_tensor"):  # .grad of leaves; ZeRO-3's partition of a parameter
            extra = getattr(obj, attr, None) if (attr != "grad" or obj.is_leaf) else None
            if isinstance(extra, torch.Tensor):
                found.append((f"{path}.{attr}", local(extra)))
        return
    if depth > 8 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            name = k if isinstance(k, (str, int)) else type(k).__name__
            walk(v, f"{path}[{name}]", found, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(list(obj)):
            walk(v, f"{path}[{i}]", found, seen, depth + 1)
    elif (type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "__main__")
          and hasattr(obj, "__dict__")):
        for k, v in list(vars(obj).items()):
            walk(v, f"{path}.{k}", found, seen, depth + 1)


def census(model, optimizer, adam):
    """Bytes this rank holds, by kind, and the largest tensors behind the sums. model: what the
    training loop calls (DeepSpeed's engine, DDP, the fully_shard model); optimizer: what it steps;
    adam: the torch Adam inside that owns the state. Each storage counts once (views of a flat
    buffer share one)."""
    gc.collect()

    def key(t):
        return t.untyped_storage().data_ptr() if t.numel() else None

    def nbytes(t):
        return t.untyped_storage().nbytes()

    params, state, opt_params = {}, {}, {}
    for p in model.parameters():
        for t in (local(p), getattr(p, "ds_tensor", None)):
            if t is not None and t.numel():
                params[key(t)] = nbytes(t)
    for s in adam.state.values():
        for t in s.values():
            # Adam's exp_avg and exp_avg_sq (not the step count)
            if hasattr(t, "numel") and local(t).numel() > 1:
                state[key(local(t))] = nbytes(local(t))
    # The optimizer's own fp32 copy of its partition: DeepSpeed's ZeRO keeps one even when the model
    # is fp32 (stage 3 detaches it from the optimizer's param groups between steps: look in both).
    masters = [p for g in adam.param_groups for p in g["params"]]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        masters += list(getattr(optimizer, name, None) or [])
    for p in masters:
        if isinstance(p, torch.Tensor) and local(p).numel():
            opt_params[key(local(p))] = nbytes(local(p))
    found = []
    walk({"model": model, "optimizer": optimizer}, "", found, set())
    out = dict.fromkeys(KINDS, 0)
    # (kind, where it was reached, MB): what the sums are made of (report.py --explain)
    out["largest"] = []
    counted = set()
    for path, t in found:
        k = key(t)
        if k is None or k in counted:
            continue
        counted.add(k)
        if k in params:
            kind = "params"
        elif k in state:
            kind = "optim"
        elif k in opt_params:
            kind = "master"  # the optimizer's own fp32 copy of (its partition of) the parameters
        elif "grad" in path.lower() or "ipg" in path.lower():
            kind = "grads"
        else:
            kind = "other"
        out[kind] += nbytes(t)
        out["largest"].append((kind, path.lstrip("."), round(nbytes(t) / MB, 2)))
    out["largest"] = sorted(out["largest"], key=lambda e: -e[2])[:12]
    return out


def rss_bytes():
    """This process's resident memory, after a garbage collection (what it holds, settled)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    """Restart the kernel's peak-RSS counter (VmHWM), so the peak covers training, not building the
    model (every rank first builds the full model; ZeRO-3 and FSDP partition it afterwards). False
    if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mb(x):
    return f"{x / MB:,.1f}"


def describe(result):
    """The lesson's printout of one run: every rank's bytes by kind, the formula in parentheses."""
    f = result["formula"]
    head = ["rank"] + [NAMES[k] for k in KINDS] + ["sum", "peak RSS"]
    rows = [head]
    for r in result["per_rank"]:
        cells = [mb(r[k]) + (f" ({mb(f[k])})" if k in f else "") for k in KINDS]
        total = f"{mb(sum(r[k] for k in KINDS))} ({mb(sum(f.values()))})"
        rows.append([str(r["rank"])] + cells + [total, mb(r["peak_rss"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return (f"MB held by each rank before the last optimizer step "
            f"(ZeRO formula for stage {result['stage']} in parentheses):\n" + "\n".join(lines))


def peak_accelerator_mb():
    """This process's peak GPU memory in MB (tensors, not the cache), or None without a GPU."""
    for gpu in (torch.cuda, torch.xpu):
        if gpu.is_available() and gpu.is_initialized():
            return round(gpu.max_memory_allocated() / 2**20, 1)
    return None
