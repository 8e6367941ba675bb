#!/usr/bin/env python
"""ZeRO, measured: what each rank keeps at DeepSpeed stages 0-3 (+ CPU offload) and with PyTorch's own
ZeroRedundancyOptimizer (ZeRO-1) and FSDP2 fully_shard (ZeRO-3), next to the ZeRO paper's formula.

    python zero/main.py --ranks 2 4                  # print the tables (about 6 minutes on 2 cores)
    python zero/main.py --ranks 2 4 --write-readme   # ... and rewrite the table in zero/README.md + assets/zero_memory.png

Every variant trains the same wide MLP (default about 28M parameters) on the same real MNIST digits for a few
Adam steps under `torchrun --nproc_per_node N` (one launch per variant, so each has its own peak memory).
Between the last backward and its optimizer step each rank adds up the bytes of the tensors it holds,
reached from the model and the optimizer, sorted into parameters, gradients, optimizer state (Adam's two
moments), DeepSpeed's fp32 master copy and other buffers; and it reads its peak resident memory (RSS).
"""
import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our deepspeed/ folder must never shadow the library

VARIANTS = {  # name: (label, ZeRO stage the formula follows, offload)
    "ds0": ("DeepSpeed stage 0 (plain data parallel)", 0, False),
    "ds1": ("DeepSpeed ZeRO-1", 1, False),
    "ds2": ("DeepSpeed ZeRO-2", 2, False),
    "ds3": ("DeepSpeed ZeRO-3", 3, False),
    "ds2-offload": ("DeepSpeed ZeRO-2 + CPU offload", 2, True),
    "ds3-offload": ("DeepSpeed ZeRO-3 + CPU offload", 3, True),
    "torch-zero1": ("PyTorch DDP + ZeroRedundancyOptimizer", 1, False),
    "torch-fsdp2": ("PyTorch FSDP2 fully_shard", 3, False),
}
KINDS = ["params", "grads", "optim", "master", "other"]
MB = 1e6
README = ROOT / "zero" / "README.md"
CHART = ROOT / "assets" / "zero_memory.png"
BEGIN, END = "<!-- zero-table:begin -->", "<!-- zero-table:end -->"


def formula(stage, psi, n):
    """Bytes per rank for fp32 training with Adam (ZeRO paper, Rajbhandari et al. 2019, with K=8 and
    4-byte parameters/gradients): P_os at stage >= 1, P_os+g at >= 2, P_os+g+p at 3."""
    return {"params": 4 * psi / (n if stage >= 3 else 1),
            "grads": 4 * psi / (n if stage >= 2 else 1),
            "optim": 8 * psi / (n if stage >= 1 else 1)}


# ======================================= worker (one rank) ========================================
def mlp(hidden, layers):
    import torch.nn as nn
    dims = [784] + [hidden] * (layers + 1)
    blocks = []
    for a, b in zip(dims[:-1], dims[1:]):
        blocks += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10), nn.LogSoftmax(dim=1))


def local(t):
    """The part of a tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def walk(obj, path, found, seen, depth=0):
    """Every tensor reachable from obj through attributes, dicts and lists: [(path, tensor)]."""
    import torch
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
            walk(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", found, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(list(obj)):
            walk(v, f"{path}[{i}]", found, seen, depth + 1)
    elif type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "__main__") and hasattr(obj, "__dict__"):
        for k, v in list(vars(obj).items()):
            walk(v, f"{path}.{k}", found, seen, depth + 1)


def census(model, optimizer, basic_optimizer):
    """Bytes this rank holds, by kind. Each storage counts once (views of a flat buffer share one)."""
    import torch

    def key(t):
        return t.untyped_storage().data_ptr() if t.numel() else None

    def nbytes(t):
        return t.untyped_storage().nbytes()

    params, state, opt_params = {}, {}, {}
    for p in model.parameters():
        for t in (local(p), getattr(p, "ds_tensor", None)):
            if t is not None and t.numel():
                params[key(t)] = nbytes(t)
    for s in basic_optimizer.state.values():
        for t in s.values():
            if hasattr(t, "numel") and local(t).numel() > 1:  # Adam's exp_avg, exp_avg_sq (not the step count)
                state[key(local(t))] = nbytes(local(t))
    # The optimizer's own fp32 copy of its partition: DeepSpeed's ZeRO keeps one even when the model is fp32
    # (stage 3 detaches it from the optimizer's param groups between steps, so name both places).
    masters = [p for g in basic_optimizer.param_groups for p in g["params"]]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        masters += list(getattr(optimizer, name, None) or [])
    for p in masters:
        if isinstance(p, torch.Tensor) and local(p).numel():
            opt_params[key(local(p))] = nbytes(local(p))
    found = []
    walk({"model": model, "optimizer": optimizer}, "", found, set())
    out = dict.fromkeys(KINDS, 0)
    out["largest"] = []  # (kind, where it was reached, MB): what the sums are made of (--explain prints them)
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
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    """Restart the kernel's peak-RSS counter (VmHWM), so the peak covers training, not building the model
    (every rank first builds the full model; ZeRO-3 and FSDP partition it afterwards). False if not allowed."""
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


def ds_config(stage, offload, batch, lr):
    opt_params = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": False}
    if not offload:
        opt_params["torch_adam"] = True  # torch.optim.Adam: no JIT build of FusedAdam on CPU
    zero = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False,
            "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=2_000_000, stage3_param_persistence_threshold=0)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}  # DeepSpeedCPUAdam (cpu_adam op)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": opt_params}, "zero_optimization": zero,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 clips to norm 1.0 unless told: PyTorch's runs don't clip
            "steps_per_print": 1_000_000}


def worker(args):
    import datetime

    import numpy as np
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from utils import data, dist

    label, stage, offload = VARIANTS[args.variant]
    ns = argparse.Namespace(device="cpu", num_threads=None, backend="gloo", dist_timeout=300)
    dist.default_extensions_dir()
    env = dist.prepare(ns)
    if args.variant.startswith("ds"):
        import deepspeed
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # inference-only op: skip its JIT build
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False,
                                   timeout=datetime.timedelta(seconds=300))
    else:
        tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, n = tdist.get_rank(), tdist.get_world_size()

    mnist = data.load_shipped()
    x = torch.from_numpy(data.normalized(mnist.x_train).reshape(-1, 784))
    y = torch.from_numpy(mnist.y_train)
    order = np.random.default_rng(args.seed).permutation(len(y))[rank::n]
    batches = [torch.from_numpy(order[i * args.batch_size:(i + 1) * args.batch_size]) for i in range(args.steps)]
    gc.collect()
    base_rss = rss_bytes()

    torch.manual_seed(args.seed)
    model = mlp(args.hidden, args.layers)
    psi = sum(p.numel() for p in model.parameters())
    if args.variant.startswith("ds"):
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=ds_config(stage, offload, args.batch_size, args.lr))
        basic = engine.basic_optimizer if hasattr(engine, "basic_optimizer") else optimizer
        forward, backward, step = engine, engine.backward, engine.step
        roots = (engine, optimizer)
    elif args.variant == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        engine = DDP(model, gradient_as_bucket_view=True)  # p.grad are views of DDP's buckets: counted once
        optimizer = ZeroRedundancyOptimizer(engine.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
        basic = optimizer.optim  # the Adam that owns this rank's share of the parameters

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        forward, backward, roots = engine, torch.Tensor.backward, (engine, optimizer)
    else:  # torch-fsdp2
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = basic = torch.optim.Adam(model.parameters(), lr=args.lr)

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        engine, forward, backward, roots = model, model, torch.Tensor.backward, (model, optimizer)

    gc.collect()
    setup_rss, peak_reset = rss_bytes(), reset_peak_rss()
    losses, measured = [], None
    start = time.perf_counter()
    for i, idx in enumerate(batches):
        loss = F.nll_loss(forward(x[idx]), y[idx])
        backward(loss)
        if i == len(batches) - 1:  # gradients are held now, and Adam's state exists since the first step
            gc.collect()
            measured = census(engine, roots[1], basic)
        step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(mean.item() / n)
    elapsed = time.perf_counter() - start
    mine = dict(measured, rank=rank, peak_rss=peak_rss_bytes(), base_rss=base_rss, setup_rss=setup_rss,
                peak_is_training_only=peak_reset)
    everyone = [None] * n
    tdist.all_gather_object(everyone, mine)
    if rank == 0:
        result = dict(variant=args.variant, label=label, stage=stage, offload=offload, ranks=n, psi=psi,
                      hidden=args.hidden, layers=args.layers, batch_size=args.batch_size, steps=args.steps,
                      losses=losses, train_time_s=elapsed, per_rank=everyone, formula=formula(stage, psi, n))
        Path(args.out).write_text(json.dumps(result, indent=1))
    tdist.barrier()
    tdist.destroy_process_group()


# ===================================== driver (launches runs) ======================================
def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(variant, n, args, out):
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc_per_node", str(n), "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", "--variant", variant, "--out", str(out),
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--lr", str(args.lr)]
    # A fixed mmap threshold: glibc then returns every freed large tensor to the OS at once, so RSS follows the
    # tensors (its default threshold adapts upwards and keeps freed buffers in the heap, inflating RSS).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MALLOC_MMAP_THRESHOLD_="1048576",
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: {variant} on {n} ranks did not finish in {args.timeout}s")
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        sys.exit(f"error: {variant} on {n} ranks failed (exit {proc.returncode}); its output is above")
    result = json.loads(Path(out).read_text())
    result["launch_s"] = time.perf_counter() - t
    return result


def mb(x):
    return f"{x / MB:,.1f}"


def table(results, n):
    rows = [r for r in results if r["ranks"] == n]
    psi = rows[0]["psi"]
    lines = [f"N = {n} ranks, Ψ = {psi:,} parameters (fp32: 4Ψ = {mb(4 * psi)} MB). Per rank, MB; "
             "measured is the mean over ranks [min-max when they differ], formula in parentheses; sum and RSS: the largest rank.", "",
             "| variant | parameters | gradients | optimizer state | fp32 master copy | other | sum "
             "| RSS after setup | peak RSS in training | peak RSS in training - RSS before the model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for kind in KINDS:
            vals = [pr[kind] for pr in r["per_rank"]]
            mean = sum(vals) / len(vals)
            text = mb(mean) if mb(min(vals)) == mb(max(vals)) else f"{mb(mean)} [{mb(min(vals))}-{mb(max(vals))}]"
            if kind in r["formula"]:
                text += f" ({mb(r['formula'][kind])})"
            cells.append(text)
        cells.append(f"{mb(max(sum(pr[k] for k in KINDS) for pr in r['per_rank']))} "
                     f"({mb(sum(r['formula'].values()))})")
        cells.append(mb(max(pr["setup_rss"] for pr in r["per_rank"])))
        cells.append(mb(max(pr["peak_rss"] for pr in r["per_rank"])))
        cells.append(mb(max(pr["peak_rss"] - pr["base_rss"] for pr in r["per_rank"])))
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_table(results, n):
    rows = [r for r in results if r["ranks"] == n]
    ref = next((r for r in rows if r["variant"] == "ds0"), rows[0])
    lines = [f"| variant (N = {n}) | losses of steps 1..{len(ref['losses'])} | max abs diff to {ref['variant']} |",
             "|---|---|---|"]
    for r in rows:
        diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        lines.append(f"| {r['variant']} | {' '.join(f'{v:.6f}' for v in r['losses'])} | {diff:.1e} |")
    return "\n".join(lines)


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = sorted({r["ranks"] for r in results})
    fig, axes = plt.subplots(1, len(ns), figsize=(6.5 * len(ns), 5), squeeze=False, sharey=True)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868", "master": "#c44e52", "other": "#8c8c8c"}
    names = {"params": "parameters", "grads": "gradients", "optim": "optimizer state (Adam)",
             "master": "fp32 master copy", "other": "other buffers"}
    for ax, n in zip(axes[0], ns):
        rows = [r for r in results if r["ranks"] == n]
        xs = range(len(rows))
        bottom = [0.0] * len(rows)
        for kind in KINDS:
            vals = [max(pr[kind] for pr in r["per_rank"]) / MB for r in rows]
            ax.bar(xs, vals, bottom=bottom, color=colors[kind], label=names[kind] if n == ns[0] else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [sum(r["formula"].values()) / MB for r in rows], marker="_", s=600, color="black",
                   zorder=3, label="ZeRO formula (params + grads + optimizer)" if n == ns[0] else None)
        ax.set_xticks(list(xs), [r["variant"] for r in rows], rotation=35, ha="right")
        ax.set_title(f"{n} ranks, Ψ = {rows[0]['psi'] / 1e6:.1f}M parameters (largest rank)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("MB held per rank")
    fig.legend(loc="upper center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_readme(results, args):
    import deepspeed  # noqa: F401  (version only)
    import torch
    block = [BEGIN, "",
             f"Produced by `python zero/main.py --ranks {' '.join(map(str, args.ranks))} --write-readme` "
             f"(torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, {os.cpu_count()} CPU cores, gloo; "
             f"MLP 784-{args.hidden}x{args.layers + 1}-10, batch {args.batch_size} per rank, {args.steps} Adam steps).", ""]
    for n in sorted({r["ranks"] for r in results}):
        block += [table(results, n), "", loss_table(results, n), ""]
    block += [f"![bytes per rank]({os.path.relpath(CHART, README.parent)})", "", END]
    text = README.read_text() if README.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + "\n".join(block) + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + "\n".join(block) + "\n"
    README.write_text(text)
    chart(results, CHART)
    print(f"wrote the tables into {README} and the chart {CHART}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes to measure")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--hidden", type=int, default=2560, help="width of the MLP's hidden layers")
    p.add_argument("--layers", type=int, default=4, help="hidden-to-hidden layers (each hidden^2 parameters)")
    p.add_argument("--steps", type=int, default=3, help="Adam steps per run (>= 2: the state exists after the first)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--json", default=None, help="also write all results to this file")
    p.add_argument("--explain", action="store_true", help="list the largest tensors of rank 0 behind each sum")
    p.add_argument("--write-readme", action="store_true", help="rewrite the table in zero/README.md and the chart")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps must be >= 2 (Adam's state exists only after the first step)")
    if min(args.ranks) < 1 or args.hidden < 16 or args.layers < 0:
        p.error("--ranks >= 1, --hidden >= 16, --layers >= 0")
    if args.worker:
        worker(args)
        # Done, result written. Leave without the interpreter's finalization: FSDP2's device mesh keeps a reference
        # to the process group, so gloo's threads can outlive destroy_process_group and be torn down with the
        # interpreter, which aborted one rank once in CI ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            for v in args.variants:
                r = launch(v, n, args, Path(tmp) / f"{v}-{n}.json")
                print(f"{v:<12} N={n}: {r['launch_s']:.0f} s, losses {' '.join(f'{x:.5f}' for x in r['losses'])}",
                      flush=True)
                if args.explain:
                    for kind, where, size in r["per_rank"][0]["largest"]:
                        print(f"    rank 0 {kind:<7} {size:>9.2f} MB  {where}")
                results.append(r)
    for n in args.ranks:
        print("\n" + table(results, n) + "\n\n" + loss_table(results, n))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_readme:
        write_readme(results, args)


if __name__ == "__main__":
    main()
