"""Read the per-rank traces of diagnose/profile_ranks.py: where each rank's step goes.

    python diagnose/profile_ranks.py summary DIR [--json FILE] [--no-mfu]

Per step (ProfilerStep#N on the rank's main thread), the step's time is split into:
  compute  the main thread runs operators (and a --slow-rank's injected delay: slow work);
  comm     the main thread is inside a collective call (c10d::*, gloo, nccl, Horovod), or waits for
           one (DTensor's functional collectives: _c10d_functional::wait_tensor);
  wait     the main thread is inside backward, Horovod's synchronize or the optimizer step but runs
           nothing:
           it waits for the other ranks' gradients (DDP's last bucket, Horovod's all-reduces);
  other    the rest: Python between operators, indexing the batch, the loss's .item().
`overlap` is how much of the step a background thread spent in a collective (gloo's threads):
communication hidden behind compute, or compute slowed by it on a machine with no core to spare.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

COMM_MARKS = ("c10d::", "c10d_functional::", "gloo", "nccl", "xccl", "horovod", "mpi")
WAIT_PHASES = ("phase:backward", "phase:wait", "phase:optimizer")


def union(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def clip(intervals, a, b):
    return [(max(x, a), min(y, b)) for x, y in intervals if y > a and x < b]


def covered_within(intervals, windows):
    """Length of union(intervals) that lies inside union(windows)."""
    total = 0.0
    for a, b in merge(windows):
        total += union(clip(intervals, a, b))
    return total


def merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def is_comm(name):
    low = name.lower()
    return any(mark in low for mark in COMM_MARKS)


def training_steps(events):
    """(the main thread's id, [(start, end)] of every recorded training step, in order). A step is a
    ProfilerStep#N span that holds a backward: evaluation and logging between epochs, or the run's
    end, are not training steps."""
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        return None, []
    main = steps[0]["tid"]
    backward = [float(e["ts"]) for e in events
                if e["tid"] == main and e["name"] == "phase:backward"]
    windows = sorted((float(s["ts"]), float(s["ts"]) + float(s["dur"])) for s in steps)
    return main, [(a, b) for a, b in windows if any(a <= t < b for t in backward)]


def split_steps(trace):
    """One dict per recorded step: step, compute, comm, wait, other, overlap (seconds)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    main, windows = training_steps(events)
    if not windows:
        return []
    span = lambda e: (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # noqa: E731
    ops = [span(e) for e in events if e["tid"] == main and e.get("cat") == "cpu_op"]
    slow = [span(e) for e in events if e["tid"] == main and e["name"] == "straggler"]
    comm = [
        span(e)
        for e in events
        if e["tid"] == main and e.get("cat") == "cpu_op" and is_comm(e["name"])
    ]
    waits = [span(e) for e in events if e["tid"] == main and e["name"] in WAIT_PHASES]
    background = [span(e) for e in events if e["tid"] != main and is_comm(e["name"])]
    rows = []
    for a, b in windows:
        step_comm = clip(comm, a, b)
        busy = clip(ops + slow, a, b)
        t_comm = union(step_comm)
        t_busy = union(busy)
        t_wait = union(clip(waits, a, b)) - covered_within(busy, clip(waits, a, b))
        row = dict(
            step=(b - a),
            compute=t_busy - t_comm,
            comm=t_comm,
            wait=t_wait,
            overlap=union(clip(background, a, b)),
        )
        row["other"] = row["step"] - row["compute"] - row["comm"] - row["wait"]
        rows.append({k: v / 1e6 for k, v in row.items()})  # the trace's microseconds to seconds
    return rows


def load(folder):
    """{rank: (meta, rows)} for every rank<R>.trace.json in folder."""
    out = {}
    for path in sorted(Path(folder).glob("rank*.trace.json")):
        rank = int(path.name[4:].split(".")[0])
        meta_path = path.with_name(f"rank{rank}.meta.json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        out[rank] = (meta, split_steps(json.loads(path.read_text())))
    return out


def rank_table(ranks):
    """Per rank: steps, min/median/max step time, median compute/comm/wait/other, and the median
    over the steps of the share of the step spent waiting (a median: one step stalled by the
    machine does not decide it)."""
    table = []
    for rank, (meta, rows) in sorted(ranks.items()):
        if not rows:
            continue
        step = [r["step"] for r in rows]
        table.append(
            dict(
                rank=rank,
                steps=len(rows),
                step_min=min(step),
                step_median=statistics.median(step),
                step_max=max(step),
                **{
                    k: statistics.median(r[k] for r in rows)
                    for k in ("compute", "comm", "wait", "other", "overlap")
                },
                wait_fraction=statistics.median(r["wait"] / r["step"] for r in rows),
                slow_ms=meta.get("slow_ms") if meta.get("slow_rank") == rank else 0,
            )
        )
    return table


def format_table(table):
    head = (
        f"{'rank':>4} {'steps':>5} {'step ms min/med/max':>21} {'compute':>8} {'comm':>6} "
        f"{'wait':>6} "
        f"{'other':>6} {'overlap':>8} {'wait %':>7}"
    )
    lines = [head, "-" * len(head)]
    for t in table:
        ms = lambda x: f"{1000 * x:.1f}"  # noqa: E731
        mark = f"  <- slowed {t['slow_ms']:g} ms/step" if t["slow_ms"] else ""
        lines.append(
            f"{t['rank']:>4} {t['steps']:>5} {ms(t['step_min']):>6}/{ms(t['step_median']):>6}/"
            f"{ms(t['step_max']):>7} {ms(t['compute']):>8} {ms(t['comm']):>6} {ms(t['wait']):>6} "
            f"{ms(t['other']):>6} {ms(t['overlap']):>8} {100 * t['wait_fraction']:>6.1f}%{mark}"
        )
    lines.append(
        "(medians over the recorded steps, in ms; wait % = the median step's share of waiting)"
    )
    return "\n".join(lines)


def flops_per_sample(batch):
    """Forward + backward FLOPs of one sample of the course's CNN (course.torch_utils.Net), counted
    by torch.utils.flop_counter at the batch the lesson ran."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.append(str(Path(__file__).resolve().parents[1]))
    from course.torch_utils import Net

    model = Net()
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.nll_loss(model(x), y).backward()
    return counter.get_total_flops() / batch


def matmul_peak(threads, n=1024, seconds=1.0):
    """This machine's measured FP32 matmul rate (FLOP/s) with `threads` threads: the best of
    repeated n x n products for about `seconds`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    torch.set_num_threads(before)
    return best


def mfu(ranks, table):
    """Model FLOP utilisation: FLOPs per sample x global samples/s, over the measured matmul peak of
    the cores the ranks use (one rank's threads, times the ranks)."""
    meta = next(iter(ranks.values()))[0]
    if not meta.get("batch") or meta.get("framework") not in ("ddp", "horovod", "deepspeed"):
        return None
    world = meta.get("world_size", len(ranks))
    threads = meta.get("threads", 1)
    step = max(
        t["step_median"] for t in table
    )  # the ranks move together: the slowest sets the pace
    samples_per_s = world * meta["batch"] / step
    per_sample = flops_per_sample(meta["batch"])
    peak = matmul_peak(threads) * world
    return dict(
        flops_per_sample=per_sample,
        samples_per_s=samples_per_s,
        achieved=per_sample * samples_per_s,
        peak=peak,
        mfu=per_sample * samples_per_s / peak,
        world_size=world,
        threads_per_rank=threads,
    )


def format_mfu(m):
    return (
        f"MFU: {m['flops_per_sample'] / 1e6:.1f} MFLOP/sample x {m['samples_per_s']:.0f} "
        f"samples/s = {m['achieved'] / 1e9:.2f} GFLOP/s against a measured matmul peak of "
        f"{m['peak'] / 1e9:.1f} GFLOP/s "
        f"({m['world_size']} rank(s) x {m['threads_per_rank']} thread(s)): {100 * m['mfu']:.1f}%"
    )


ELEMENT_BYTES = {"float": 4, "double": 8, "long int": 8, "int": 4, "unsigned char": 1, "bool": 1,
                 "c10::BFloat16": 2, "c10::Half": 2}


def whole_bytes(op, event, n):
    """S, the whole buffer as collectives.py (and nccl-tests) counts it, from the sizes the profiler
    recorded (record_shapes): gloo's all_gather event holds one rank's part, the others the
    buffer."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [[]], args.get("Input type") or ["float"]
    count = 1
    for d in dims[0]:
        count *= d
    part = count * ELEMENT_BYTES.get(types[0], 4)
    return part * n if op == "all_gather" else part


def model_time(op, nbytes, n, alpha, beta):
    """The front README's ring model with the alpha and beta collectives.py fitted to all_reduce,
    applied to one call: all_reduce 2(N-1) hops, all_gather and reduce_scatter N-1, a send, a
    receive or a broadcast one."""
    if op == "all_reduce":
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * alpha + (n - 1) / n * nbytes / beta
    return alpha + nbytes / beta


def collective_calls(trace, n):
    """{(op, S): [duration of gloo's span of each call, in order]} for the collectives of the
    training steps, and the number of training steps. gloo's span runs on its own thread and holds
    the wire and the waiting for the peers."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    _, windows = training_steps(events)
    if not windows:
        return {}, 0
    groups = {}
    for e in sorted(events, key=lambda e: float(e["ts"])):
        if not e["name"].startswith("gloo:") or "Input Dims" not in e.get("args", {}):
            continue
        if any(a <= float(e["ts"]) < b for a, b in windows):
            op = e["name"][5:]
            groups.setdefault((op, whole_bytes(op, e, n)), []).append(float(e["dur"]) / 1e6)
    return groups, len(windows)


def collectives_table(per_rank, n, fit):
    """One row per (op, S) that the step does (in at least every other step). A collective ends at
    the same moment on every rank, so the rank that arrived last spent only the transfer in it: the
    measured cost of call k is its shortest span over the ranks, and the row gives the median over
    the calls. A send or a receive is one rank's: its span is given per rank, waits included."""
    keys = sorted({k for groups, _ in per_rank.values() for k in groups},
                  key=lambda k: (k[0], -k[1]))
    rows = []
    for op, size in keys:
        spans = {rank: groups.get((op, size), []) for rank, (groups, _) in per_rank.items()}
        steps = max(count for _, count in per_rank.values())
        calls = max(len(d) for d in spans.values())
        if calls < 0.5 * steps:
            continue
        row = dict(op=op, bytes=size, calls_per_step=calls / steps,
                   rank_median_s={r: statistics.median(d) for r, d in spans.items() if d},
                   predicted_s=model_time(op, size, n, fit["alpha_s"], fit["beta_Bps"]))
        if op not in ("send", "recv") and len({len(d) for d in spans.values()}) == 1:
            row["measured_s"] = statistics.median(min(d[k] for d in spans.values())
                                                  for k in range(calls))
        rows.append(row)
    return rows


def human_bytes(n):
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_collectives(rows, fit):
    ms = lambda x: f"{1e3 * x:.2f}"  # noqa: E731
    head = (f"{'op':<14} {'S':>10} {'calls/step':>10} {'each rank ms':>16} {'measured ms':>12} "
            f"{'predicted ms':>13} {'ratio':>6}")
    title = (f"collectives per training step against the ring fit "
             f"(alpha = {1e3 * fit['alpha_s']:.2f} ms, beta = {fit['beta_Bps'] / 1e9:.2f} GB/s; "
             f"{fit['source']}):")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        ranks = "/".join(ms(v) for _, v in sorted(r["rank_median_s"].items()))
        measured = r.get("measured_s")
        ratio = f"{measured / r['predicted_s']:.2f}" if measured else "-"
        lines.append(f"{r['op']:<14} {human_bytes(r['bytes']):>10} {r['calls_per_step']:>10.1f} "
                     f"{ranks:>16} {ms(measured) if measured else '-':>12} "
                     f"{ms(r['predicted_s']):>13} {ratio:>6}")
    lines.append("(each rank: the median span of the call on that rank, waiting for the others "
                 "included; measured: the median over the calls of the shortest span, the last "
                 "rank to arrive)")
    return "\n".join(lines)


def read_fit(path):
    try:
        fit = json.loads(Path(path).read_text())["fit"]
        return dict(alpha_s=float(fit["alpha_s"]), beta_Bps=float(fit["beta_Bps"]),
                    source=str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"error: --fit {path}: not a diagnose/collectives.py result with a fit "
                         f"({exc})")


def main(argv):
    p = argparse.ArgumentParser(prog="diagnose/profile_ranks.py summary")
    p.add_argument("folder", help="the --out folder of a profiled run")
    p.add_argument("--json", help="also write the table (and MFU) here")
    p.add_argument("--no-mfu", action="store_true", help="skip the FLOP count and the matmul peak")
    p.add_argument("--fit", help="a diagnose/collectives.py --out result (e.g. "
                                 "assets/collectives.json): each collective of the step against "
                                 "the ring model's prediction")
    args = p.parse_args(argv)
    fit = read_fit(args.fit) if args.fit else None
    ranks = load(args.folder)
    table = rank_table(ranks)
    if not table:
        print(f"error: no rank*.trace.json with recorded steps in {args.folder}", file=sys.stderr)
        return 2
    print(format_table(table))
    result = dict(ranks=table)
    if not args.no_mfu:
        m = mfu(ranks, table)
        if m:
            print(format_mfu(m))
            result["mfu"] = m
    if fit:
        per_rank, n = {}, len(ranks)
        for path in sorted(Path(args.folder).glob("rank*.trace.json")):
            rank = int(path.name[4:].split(".")[0])
            n = ranks[rank][0].get("world_size", n)
            per_rank[rank] = collective_calls(json.loads(path.read_text()), n)
        rows = collectives_table(per_rank, n, fit)
        print(format_collectives(rows, fit))
        result["collectives"], result["fit"] = rows, fit
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
