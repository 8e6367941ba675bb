#!/usr/bin/env python
"""make bench: every framework measured side by side on this machine, with one thread per rank.

For each example: training throughput at 1 and 2 ranks (same model, same batch per rank), the weak-scaling
efficiency = throughput(2) / (2 x throughput(1)), the *ceiling* (two independent 1-rank runs of the same
framework at once, no communication: what 2 ranks can reach on this box) and each example's efficiency
relative to it. Then a per-step time breakdown on rank 0 of a 2-rank run (data, forward+backward, gradient
all-reduce, optimizer), measured phase by phase. Last, each example's *overhead*: its own train_epoch (imported
from its main.py, at one rank, with its framework's optimizer wrapper or engine) against a bare loop over the
same preloaded tensors, in one process: each of `--pairs` timed pairs covers an epoch's steps, run in parts of
`--part-steps` steps, the example and the bare loop taking turns part by part (the speed drifts over seconds).

Epoch 1 of every run is warm-up (graph tracing, allocator, connections) and excluded; a run's throughput is
the median over its remaining epochs. The whole set is repeated `--repeat` times, interleaved (round 1 runs
everything once, then round 2 ...), because this machine's speed drifts by +-10% over minutes: every ratio
is computed within a round, from runs minutes apart, and the report gives the median over rounds and the
range. Results: a table on stdout and runs/bench/latest.json.
The Horovod examples also run at 2 ranks under mpiexec (MPI moves their gradients instead of gloo), and one
all-reduce of the gradients' size is timed alone by each way the examples move them (`allreduce` in the JSON).
    python utils/bench.py            # full: 3 rounds of 4 epochs x 40 steps per run (about 20 minutes)
    python utils/bench.py --quick    # short: 1 round of 3 epochs x 8 steps, 2 overhead pairs (in the tests)
    python utils/bench.py --only deepspeed --zero-stage 0
                                     # one example, every run of it with flags of its own (not those the
                                     # bench sets: --epochs --max-steps --batch-size --num-threads ...; the
                                     # overhead runs both loops on the bench's data and learning rate)
    python utils/bench.py --only deepspeed --zero-stage 2 --versus='--zero-stage 0'
                                     # A/B: every round also runs the example with the other flags (the two
                                     # take turns going first); speed-ups and overheads of the two side by side
    python utils/bench.py --overhead deepspeed [--zero-stage 0 | --deepspeed_config FILE ...]
                                     # one example's overhead alone; flags after it go to the example
    python utils/bench.py --phases [--only ddp ...]
                                     # where a PyTorch example's step goes: its own training loop, run
                                     # unchanged under utils/phases.py at 1 and 2 ranks, timed phase by phase
                                     # (forward, backward, waiting for the all-reduce, optimizer); only this,
                                     # written to runs/bench/phases.json
"""
import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PY = sys.executable
sys.path.append(str(ROOT))

EXAMPLES = {  # name: (script, 2-rank launcher prefix, framework kind: which independent pair is its ceiling)
    "ddp": ("DDP/main.py", lambda port: [BIN / "torchrun", "--nproc_per_node", "2", "--master_addr",
                                         "127.0.0.1", "--master_port", str(port)], "torch"),
    "horovod-pytorch": ("horovod/pytorch/main.py", lambda port: [BIN / "horovodrun", "-np", "2", "--gloo",
                                                                  "--gloo-timeout-seconds", "60", PY], "torch"),
    "horovod-tensorflow": ("horovod/tensorflow/main.py", lambda port: [BIN / "horovodrun", "-np", "2", "--gloo",
                                                                        "--gloo-timeout-seconds", "60", PY], "tf"),
    "deepspeed": ("deepspeed/main.py", lambda port: [BIN / "deepspeed", "--num_gpus", "2", "--master_port",
                                                     str(port)], "torch"),
}


# Horovod's bytes travel with gloo under `horovodrun --gloo` (TCP over loopback) and with MPI under `mpiexec` (the
# MPI controller and operations; the venv's MPICH uses shared memory between ranks of one node). Each round also
# runs these examples at 2 ranks under mpiexec, so the report compares the two launchers on the same example.
MPIEXEC_LAUNCHES = {"horovod-pytorch": lambda port: [BIN / "mpiexec", "-n", "2", PY],
                    "horovod-tensorflow": lambda port: [BIN / "mpiexec", "-n", "2", PY]}


# --- arithmetic (unit-tested in tests/test_bench.py) -------------------------------------------------------
def efficiency(samples_per_s_1, samples_per_s_2):
    """Weak-scaling efficiency at 2 ranks: the 2-rank throughput over twice the 1-rank throughput."""
    return samples_per_s_2 / (2 * samples_per_s_1)


def ceiling_efficiency(samples_per_s_1, independent_pair):
    """What 2 ranks could reach here: two independent runs at once, summed, over twice one alone."""
    return sum(independent_pair) / (2 * samples_per_s_1)


def steady_throughput(history):
    """Median samples/s over the epochs after the first (warm-up) one."""
    rates = [m["samples_per_s"] for m in history[1:]] or [history[-1]["samples_per_s"]]
    return statistics.median(rates)


# --- runs ------------------------------------------------------------------------------------------------
def env_for_bench():
    return dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


BENCH_SETS = ("--epochs", "--max-steps", "--batch-size", "--num-threads", "--log-interval", "--log-dir")


def example_flags(args, log_dir):
    return ["--epochs", str(args.epochs), "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--num-threads", "1", "--log-interval", "1000", "--log-dir", str(log_dir)]


def launch(cmd, timeout, extra_env=None):
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=dict(env_for_bench(), **(extra_env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, timeout


def wait(proc, timeout, what):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"bench: {what} did not finish in {timeout}s")
    if proc.returncode != 0:
        raise SystemExit(f"bench: {what} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return out


def history(log_dir):
    with open(Path(log_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def measure_example(name, args, work, port, flags=None, tag=""):
    """(1-rank samples/s, 2-rank samples/s, framework kind, CPU by thread at 1 rank, CPU by thread at 2 ranks).
    `flags`: the example's own flags (default: those given to the bench; --versus gives others)."""
    script, _, kind = EXAMPLES[name]
    flags = args.example_args if flags is None else flags
    one = work / f"{name}-1{tag}"
    proc = launch([PY, ROOT / script, *example_flags(args, one), *flags], args.timeout)
    cpu_1 = watch_cpu(proc[0], script, one, args.epochs)
    wait(*proc, f"{name} 1 rank{described(tag)}")
    two, cpu_2 = measure_two_ranks(name, args, work, port, tag=tag, flags=flags)
    return steady_throughput(history(one)), two, kind, cpu_1.result(), cpu_2


def described(tag):
    return f" ({tag.lstrip('-')})" if tag else ""


def measure_two_ranks(name, args, work, port, extra_env=None, tag="", prefix=None, flags=None):
    """(2-rank samples/s, CPU by thread kind per rank)"""
    script, two_rank_prefix, _ = EXAMPLES[name]
    flags = args.example_args if flags is None else flags
    two = work / f"{name}-2{tag}"
    proc = launch([*(prefix or two_rank_prefix)(port), ROOT / script, *example_flags(args, two), *flags],
                  args.timeout, extra_env)
    cpu = watch_cpu(proc[0], script, two, args.epochs)
    wait(*proc, f"{name} 2 ranks{described(tag)}")
    return steady_throughput(history(two)), cpu.result()


# --- where the cores go: CPU time of each rank's threads, from /proc (Linux) ---------------------------------
# On 2 cores, 2 ranks leave no core to spare: any thread besides a rank's compute takes its time from a compute
# thread. Each run's ranks are sampled when epoch 1 (warm-up) has been logged and again when the last epoch
# has: CPU seconds per second of wall time (cores) of the main thread, TensorFlow's op pool ("tf_*" threads:
# TF runs kernels there, not on the main thread) and every other thread (Horovod's background thread, gloo's
# and MPI's threads, tf.data's), averaged over the ranks.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_kind(pid, tid, comm):
    if tid == pid:
        return "main"
    return "tf_pool" if comm.startswith("tf_") else "other"


def cpu_by_kind(before, after, seconds, ticks_per_s=CLOCK_TICKS):
    """Cores used per thread kind, averaged over ranks. before/after: {pid: {tid: (comm, ticks)}} sampled
    `seconds` apart; threads that started in between count from zero, ranks gone by `after` are left out."""
    ranks = [pid for pid in before if pid in after]
    if not ranks or seconds <= 0:
        return None
    cores = {"main": 0.0, "tf_pool": 0.0, "other": 0.0}
    for pid in ranks:
        for tid, (comm, ticks) in after[pid].items():
            used = ticks - before[pid].get(tid, (comm, 0))[1]
            cores[thread_kind(pid, tid, comm)] += used / ticks_per_s / seconds / len(ranks)
    cores["total"] = sum(cores.values())
    return cores


def rank_pids(script, log_dir):
    """The example's processes (python <script> ... <log_dir>), not the launchers around them."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a and a != b"-u"]
        if len(argv) > 1 and argv[1].endswith(script) and str(log_dir) in argv:
            pids.append(int(entry.name))
    return sorted(pids)


def thread_ticks(pids):
    out = {}
    for pid in pids:
        threads = {}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            threads[int(task.name)] = (comm, int(fields[11]) + int(fields[12]))  # utime + stime
        out[pid] = threads
    return out


class watch_cpu:
    """Samples the ranks' threads after the warm-up epoch and after the last one, in a thread of the bench."""

    def __init__(self, proc, script, log_dir, epochs):
        import threading
        self.cores = None
        self.thread = threading.Thread(target=self._run, args=(proc, script, log_dir, epochs), daemon=True)
        if Path("/proc/self/task").is_dir():
            self.thread.start()

    def _run(self, proc, script, log_dir, epochs):
        metrics, logged, before = Path(log_dir) / "metrics.jsonl", 0, None
        while proc.poll() is None:
            time.sleep(0.05)
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            if lines == logged:
                continue
            logged = lines
            if before is None and lines >= 1:
                before, t0 = thread_ticks(rank_pids(script, log_dir)), time.perf_counter()
                before = before or None  # no rank found yet: try again at the next epoch
            elif before is not None and lines >= epochs:
                self.cores = cpu_by_kind(before, thread_ticks(list(before)), time.perf_counter() - t0)
                return

    def result(self):
        if self.thread.ident:  # started (Linux): it ends with the run
            self.thread.join()
        return self.cores


def cores_fields(cpu, tag):
    """Flat keys (cores_main_2, ...), so that combine() takes their medians over rounds."""
    return {f"cores_{part}_{tag}": v for part, v in (cpu or {}).items()}


PAIR_SCRIPT = {"torch": "DDP/main.py", "tf": "horovod/tensorflow/main.py"}  # the ceiling's 1-rank runs


def measure_ceiling(kind, args, work):
    """Two independent single-process runs of one framework at the same time: no communication at all."""
    procs = []
    for i in range(2):
        log_dir = work / f"independent-{kind}-{i}"
        procs.append((launch([PY, ROOT / PAIR_SCRIPT[kind], *example_flags(args, log_dir)], args.timeout),
                      log_dir))
    rates = []
    for (proc, timeout), log_dir in procs:
        wait(proc, timeout, f"independent {kind} run")
        rates.append(steady_throughput(history(log_dir)))
    return rates


def measure_breakdown(args, port):
    out = wait(*launch([BIN / "torchrun", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", str(port), __file__, "--breakdown", "--steps", str(args.steps * 2),
                        "--batch-size", str(args.batch_size)], args.timeout), "breakdown")
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


# --- the breakdown, run in its own processes ----------------------------------------------------------------
def breakdown(steps, batch_size):
    """Rank 0's step, phase by phase (no overlap): index the batch, forward+backward, all-reduce, step."""
    import torch
    import torch.distributed as tdist
    import torch.nn.functional as F
    from utils.data import load_mnist
    from utils.torch_utils import Net, to_tensors
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    x, y, _, _ = to_tensors(load_mnist(), "cpu")
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    idx = torch.randint(0, len(y), (steps + 5, batch_size))
    totals = dict(data=0.0, forward_backward=0.0, communication=0.0, optimizer=0.0)
    for i in range(steps + 5):
        t0 = time.perf_counter()
        xb, yb = x[idx[i]], y[idx[i]]
        t1 = time.perf_counter()
        optimizer.zero_grad()
        F.nll_loss(model(xb), yb).backward()
        t2 = time.perf_counter()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        tdist.all_reduce(flat)
        flat /= tdist.get_world_size()
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        t3 = time.perf_counter()
        optimizer.step()
        t4 = time.perf_counter()
        if i >= 5:
            for key, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[key] += dt
    if tdist.get_rank() == 0:
        ms = {k: 1000 * v / steps for k, v in totals.items()}
        step_ms = sum(ms.values())
        print(json.dumps({"ms_per_step": ms, "fraction": {k: v / step_ms for k, v in ms.items()},
                          "step_ms": step_ms}), flush=True)
    shutdown_gloo()


# --- --phases: the examples' own steps at 1 and 2 ranks, phase by phase (utils/phases.py) ---------------------
# The breakdown above runs its phases one after another; in the examples communication overlaps backward (and
# takes CPU from it), so where a 2-rank step loses its time shows only in their own loops, timed as they run.
PHASE_NAMES = ("step", "forward", "backward", "wait", "optimizer", "other")


def phase_means(records, first_epoch=2):
    """{phase: mean ms per step} over the steps of the epochs after the warm-up (the means add up to the step)."""
    steady = [r for r in records if r["epoch"] >= first_epoch]
    if not steady:
        raise SystemExit("bench: no steps after the warm-up epoch were timed")
    return {k: 1000 * sum(r[k] for r in steady) / len(steady) for k in PHASE_NAMES}


def measure_phases(name, args, work, port):
    """{"1": phase means on rank 0 at 1 rank, "2": the same at 2 ranks[, "2_mpiexec": under mpiexec (Horovod)]},
    each with "wait_by_rank": every rank's mean wait (rank 0's includes waiting for a slower rank 1, and so on)"""
    script, two_rank_prefix, _ = EXAMPLES[name]
    means = {}
    runs = [("1", [PY]), ("2", two_rank_prefix(port))]
    if name in MPIEXEC_LAUNCHES:
        runs.append(("2_mpiexec", MPIEXEC_LAUNCHES[name](port)))
    for ranks, prefix in runs:
        out = work / f"{name}-phases-{ranks}"
        wait(*launch([*prefix, ROOT / "utils" / "phases.py", ROOT / script, *example_flags(args, out),
                      *args.example_args], args.timeout, {"PHASES_OUT": str(out)}), f"{name} phases, {ranks} rank(s)")
        by_rank = [phase_means(json.loads(Path(f"{out}-rank{r}.json").read_text())["records"])
                   for r in range(int(ranks[0]))]
        means[ranks] = dict(by_rank[0], wait_by_rank=[m["wait"] for m in by_rank])
    return means


def run_phases(args, names, tmp):
    rounds = []
    for r in range(args.repeat):
        work = Path(tmp) / f"phases-{r + 1}"
        work.mkdir()
        print(f"  round {r + 1}: " + ", ".join(names) + " at 1 and 2 ranks, phase by phase ...", flush=True)
        rounds.append({name: measure_phases(name, args, work, 29690 + i) for i, name in enumerate(names)})
    medians = {name: {ranks: {k: statistics.median(rnd[name][ranks][k] for rnd in rounds) for k in PHASE_NAMES}
                      for ranks in rounds[0][name]} for name in names}
    for name in names:
        for ranks, m in medians[name].items():
            m["wait_by_rank"] = [statistics.median(rnd[name][ranks]["wait_by_rank"][r] for rnd in rounds)
                                 for r in range(int(ranks[0]))]
    return medians, step_costs(rounds), rounds


def step_costs(rounds):
    """Per example and 2-rank run: what the 2-rank step costs more than the 1-rank step (ms), and the efficiency
    from step times (1-rank step / 2-rank step), each taken within a round: medians over rounds and ranges."""
    costs = {}
    for name, by_ranks in rounds[0].items():
        for ranks in by_ranks:
            if ranks == "1":
                continue
            extra = [rnd[name][ranks]["step"] - rnd[name]["1"]["step"] for rnd in rounds]
            ratio = [rnd[name]["1"]["step"] / rnd[name][ranks]["step"] for rnd in rounds]
            costs.setdefault(name, {})[ranks] = dict(
                extra_ms=statistics.median(extra), extra_ms_range=[min(extra), max(extra)],
                step_efficiency=statistics.median(ratio), step_efficiency_range=[min(ratio), max(ratio)])
    return costs


def print_phases(report):
    print(f"\nrank 0's step by phase, ms (mean over the steps of a run, median over {report['repeat']} round(s)):"
          " 1 rank -> 2 ranks (difference)")
    for name, by_ranks in report["phases"].items():
        one = by_ranks["1"]
        for ranks, label in (("2", name), ("2_mpiexec", "(mpiexec)")):
            if ranks in by_ranks:
                two = by_ranks[ranks]
                print(f"  {label:>16}: " + ", ".join(f"{k} {one[k]:.1f} -> {two[k]:.1f} ({two[k] - one[k]:+.1f})"
                                                     for k in PHASE_NAMES))
                c = report["step_costs"][name][ranks]
                (lo, hi), (elo, ehi) = c["extra_ms_range"], c["step_efficiency_range"]
                if any(two["wait_by_rank"]):
                    print(f"  {'':>16}  wait by rank: " + " / ".join(f"{w:.1f}" for w in two["wait_by_rank"]) + " ms")
                print(f"  {'':>16}  within rounds: the 2-rank step {c['extra_ms']:+.1f} ms ({lo:+.1f}..{hi:+.1f}), "
                      f"1-rank step / 2-rank step {c['step_efficiency']:.2f} ({elo:.2f}-{ehi:.2f}; the efficiency)")


# --- one all-reduce of the model's gradients, by each way the examples move them ---------------------------
ALLREDUCE_WAYS = {  # name: (launcher prefix, what it measures)
    "torch.distributed gloo (torchrun)": (lambda port: [BIN / "torchrun", "--nproc_per_node", "2", "--master_addr",
                                                        "127.0.0.1", "--master_port", str(port)], "torch-gloo"),
    "Horovod, gloo (horovodrun --gloo)": (lambda port: [BIN / "horovodrun", "-np", "2", "--gloo",
                                                        "--gloo-timeout-seconds", "60", PY], "horovod"),
    "Horovod, MPI (mpiexec)": (lambda port: [BIN / "mpiexec", "-n", "2", PY], "horovod"),
    "MPI alone (mpiexec, mpi4py)": (lambda port: [BIN / "mpiexec", "-n", "2", PY], "mpi4py"),
}


def allreduce_timing(kind, reps):
    """Median ms of one all-reduce of a float32 tensor the size of the CNN's gradients, on rank 0, ranks lined
    up by a barrier before each. Horovod runs with the examples' knobs (its cycle time is part of the cost)."""
    import numpy as np
    import torch
    from utils.torch_utils import Net
    torch.set_num_threads(1)
    numel = sum(p.numel() for p in Net().parameters())
    if kind == "torch-gloo":
        import torch.distributed as tdist
        tdist.init_process_group("gloo")
        t = torch.ones(numel)
        rank, barrier, allreduce, done = tdist.get_rank(), tdist.barrier, lambda: tdist.all_reduce(t), shutdown_gloo
    elif kind == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        a, b = np.ones(numel, np.float32), np.empty(numel, np.float32)
        rank, barrier, allreduce, done = comm.Get_rank(), comm.Barrier, lambda: comm.Allreduce(a, b), lambda: None
    else:
        import horovod.torch as hvd
        from utils.dist import horovod_knobs
        horovod_knobs(on_cpu=True)
        hvd.init()
        t = torch.ones(numel)
        rank, barrier, allreduce, done = hvd.rank(), hvd.barrier, lambda: hvd.allreduce_(t, name="grads"), hvd.shutdown
    times = []
    for _ in range(reps + 5):  # the first 5 are warm-up (connections, buffers)
        barrier()
        t0 = time.perf_counter()
        allreduce()
        times.append(time.perf_counter() - t0)
    done()
    if rank == 0:
        print(json.dumps({"ms": 1000 * statistics.median(times[5:]), "bytes": 4 * numel}), flush=True)


def shutdown_gloo():
    import torch.distributed as tdist
    tdist.barrier()  # leave together (see utils/dist.shutdown): avoids a gloo abort at exit
    tdist.destroy_process_group()


def measure_allreduce(args, port):
    """{way: {"ms": .., "bytes": ..}} for each way in ALLREDUCE_WAYS (horovodrun prefixes lines with [rank])."""
    out = {}
    for i, (name, (prefix, kind)) in enumerate(ALLREDUCE_WAYS.items()):
        text = wait(*launch([*prefix(port + i), __file__, "--allreduce", kind, "--repeat", str(args.allreduce_reps)],
                            args.timeout), f"all-reduce via {name}")
        out[name] = json.loads("{" + [line for line in text.splitlines() if '{"ms"' in line][-1].split("{", 1)[1])
    return out


# --- the examples' own overhead, measured inside one process ---------------------------------------------
def load_example(script):
    """Import an example's main.py as a module (its main() does not run): its train_epoch is the one measured."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("example_" + script.replace("/", "_")[:-3], ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alternate(example_run, bare_run, parts, pairs, clock=time.perf_counter):
    """Time the example and the bare loop over the same steps, `pairs` times after one warm-up pass. Within a
    pair both run every part (a few steps) in turn, the example first on even parts and second on odd ones,
    so that this machine's speed drifts (10% within seconds) hit both alike. Returns per pair: example time /
    bare time - 1. A run may return its own duration (to leave set-up out of it); otherwise it is timed whole."""
    def timed(run, part):
        t0 = clock()
        own = run(part)
        t1 = clock()
        return own if own is not None else t1 - t0

    for part in parts:
        example_run(part), bare_run(part)
    ratios = []
    for _ in range(pairs):
        example = bare = 0.0
        for i, part in enumerate(parts):
            if i % 2 == 0:
                example += timed(example_run, part)
                bare += timed(bare_run, part)
            else:
                bare += timed(bare_run, part)
                example += timed(example_run, part)
        ratios.append(example / bare - 1)
    return ratios


def split(steps, part_steps):
    return [steps[i:i + part_steps] for i in range(0, len(steps), part_steps)]


def overhead_torch(name, steps, batch_size, pairs, part_steps, example_flags=()):
    import copy

    import torch
    import torch.nn.functional as F
    from utils import data
    from utils.dist import DistEnv
    from utils.torch_utils import Net, index_batches, to_tensors
    module = load_example(EXAMPLES[name][0])
    flags = ["--batch-size", str(batch_size), "--num-threads", "1", "--log-interval", str(10 ** 9), *example_flags]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y, _, _ = to_tensors(data.load_mnist(), "cpu")
    model = Net()
    bare_model = copy.deepcopy(model)  # its own copy: hooks the example installs must not see the bare steps
    if name == "ddp":  # one process: DDP/main.py trains the plain model (no DDP wrapper at one rank)
        args = module.parse(module.clip_flag(module.get_parser("")), flags)
        env = DistEnv()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        bare_optimizer = torch.optim.SGD(bare_model.parameters(), lr=0.01, momentum=0.5)
    elif name == "horovod-pytorch":  # Horovod at one rank: the wrapped optimizer and its background thread
        args = module.parse(module.clip_flag(module.horovod_flags(module.get_parser(""))), flags)
        from utils.dist import horovod_knobs
        horovod_knobs(on_cpu=True)
        module.hvd.init()
        env = DistEnv()
        optimizer = module.hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                                                    named_parameters=model.named_parameters())
        bare_optimizer = torch.optim.SGD(bare_model.parameters(), lr=0.01, momentum=0.5)
    else:  # deepspeed: the engine of deepspeed/ds_config.json (ZeRO stage 2, Adam) at one rank
        args = module.parse(module.add_deepspeed_args(module.get_parser("")), flags)
        env = module.init_distributed(args)
        config = module.ds_config.load(args, 1, module.DEFAULT_CONFIG)
        if args.grad_accum != 1 or args.batch_size != batch_size:  # the bare loop steps on every batch of this size
            sys.exit(f"error: the overhead compares one optimizer step per batch of {batch_size}: this config has "
                     f"micro-batch {args.batch_size} x {args.grad_accum} accumulation steps")
        config["optimizer"]["params"]["lr"] = 1e-3
        model, optimizer, _, _ = module.deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                              config=config)
        adam = {k: v for k, v in config["optimizer"]["params"].items() if k in ("betas", "eps", "weight_decay")}
        bare_optimizer = torch.optim.Adam(bare_model.parameters(), lr=1e-3, **adam)
    batches = index_batches(data.epoch_batches(len(y), batch_size, 0, 1, 0, 1, steps), "cpu")

    def example_run(part):
        module.train_epoch(model, optimizer, x, y, part, 1, lambda step: optimizer.param_groups[0]["lr"], env, args)

    def bare_run(part):
        bare_model.train()
        for (idx,) in part:
            bare_optimizer.zero_grad()
            F.nll_loss(bare_model(x[idx]), y[idx]).backward()
            bare_optimizer.step()

    return alternate(example_run, bare_run, split(batches, part_steps), pairs)


def overhead_tf(steps, batch_size, pairs, part_steps, example_flags=()):
    module = load_example(EXAMPLES["horovod-tensorflow"][0])
    tf, keras, hvd = module.tf, module.keras, module.hvd
    from utils import data
    from utils.dist import DistEnv, horovod_knobs
    from utils.tf_utils import build_model, configure_tf, images, shard_dataset
    args = module.parse(module.horovod_flags(module.get_parser("")),
                        ["--batch-size", str(batch_size), "--num-threads", "1", "--log-interval", str(10 ** 9),
                         *example_flags])
    horovod_knobs(on_cpu=True)
    hvd.init()
    configure_tf("cpu", 0, 1)
    mnist = data.load_mnist()
    x, y = images(mnist.x_train), mnist.y_train
    keras.utils.set_random_seed(0)
    models = [build_model(keras, args.dropout) for _ in range(2)]
    optimizers = [keras.optimizers.SGD(0.01, momentum=0.5) for _ in range(2)]
    train_step = module.make_train_step(models[0], optimizers[0], args)
    steps = data.epoch_batches(len(y), batch_size, 0, 1, 0, 1, steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    bare_model, bare_optimizer = models[1], optimizers[1]

    @tf.function
    def bare_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, bare_model(xb, training=True))
        bare_optimizer.apply_gradients(zip(tape.gradient(loss, bare_model.trainable_variables),
                                           bare_model.trainable_variables))

    parts = split(steps, part_steps)
    epoch = {}

    def example_run(part):
        # As in horovod/tensorflow/main.py, one tf.data pipeline per epoch, built (and its iterator started)
        # before the clock; the parts take their batches from it in turn, so starting the pipeline's threads
        # is not counted once per part.
        if part is parts[0]:
            epoch["batches"] = iter(shard_dataset(x, y, steps, batch_size))
        t0 = time.perf_counter()
        module.train_epoch(train_step, optimizers[0], itertools.islice(epoch["batches"], len(part)), len(part), 1,
                           lambda step: 0.01, DistEnv(), args)
        return time.perf_counter() - t0

    def bare_run(part):
        for (idx,) in part:
            bare_step(tf.constant(x[idx]), tf.constant(y[idx]))

    return alternate(example_run, bare_run, parts, pairs)


def measure_overhead(name, args, flags=None):
    flags = args.example_args if flags is None else flags
    out = wait(*launch([PY, __file__, "--overhead", name, "--steps", str(args.steps), "--batch-size",
                        str(args.batch_size), "--pairs", str(args.pairs), "--part-steps", str(args.part_steps),
                        *flags], args.timeout), f"{name} overhead")
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["ratios"]


# --- report ----------------------------------------------------------------------------------------------
def measure_round(names, args, work, round_no):
    """Everything once: per framework kind its independent pair, then each example at 1 and
    2 ranks. Ratios are taken inside the round."""
    kinds = sorted({EXAMPLES[n][2] for n in names})
    pairs = {}
    for kind in kinds:
        print(f"  round {round_no}: {kind} ceiling (two independent 1-rank runs at once) ...", flush=True)
        pairs[kind] = measure_ceiling(kind, args, work)
    rows = []
    for i, name in enumerate(names):
        versus = None
        if args.versus_args is not None and round_no % 2 == 0:  # --versus: the two take turns going first
            versus = measure_versus(name, args, work, round_no, 29680 + i)
        print(f"  round {round_no}: {name} at 1 rank, 2 ranks ...", flush=True)
        one, two, kind, cpu_1, cpu_2 = measure_example(name, args, work, 29600 + i)
        if args.versus_args is not None and versus is None:
            versus = measure_versus(name, args, work, round_no, 29680 + i)
        eff, ceiling = efficiency(one, two), ceiling_efficiency(one, pairs[kind])
        row = dict(example=name, samples_per_s_1=one, samples_per_s_2=two, efficiency=eff,
                   ceiling_efficiency=ceiling, relative_to_ceiling=eff / ceiling)
        row.update(cores_fields(cpu_1, "1"), **cores_fields(cpu_2, "2"))
        if versus is not None:  # the same example with other flags, in the same round: ratios within the round
            one_v, two_v = versus
            eff_v = efficiency(one_v, two_v)
            row.update(samples_per_s_1_versus=one_v, samples_per_s_2_versus=two_v, efficiency_versus=eff_v,
                       relative_to_ceiling_versus=eff_v / ceiling_efficiency(one_v, pairs[kind]),
                       versus_speedup_1=one / one_v, versus_speedup_2=two / two_v)
        if name in LIBRARY_DEFAULTS and not args.no_knobs:  # the course's knob against the library's default
            print(f"  round {round_no}: {name} at 2 ranks with the library's defaults {LIBRARY_DEFAULTS[name]} ...",
                  flush=True)
            lib, _ = measure_two_ranks(name, args, work, 29620 + i, LIBRARY_DEFAULTS[name], "-library-defaults")
            row.update(samples_per_s_2_library_defaults=lib, knob_speedup=two / lib)
        if name in MPIEXEC_LAUNCHES:
            print(f"  round {round_no}: {name} at 2 ranks under mpiexec (MPI moves the gradients) ...", flush=True)
            mpi, cpu_mpi = measure_two_ranks(name, args, work, 29640 + i, tag="-mpiexec",
                                             prefix=MPIEXEC_LAUNCHES[name])
            row.update(samples_per_s_2_mpiexec=mpi, efficiency_mpiexec=efficiency(one, mpi),
                       relative_to_ceiling_mpiexec=efficiency(one, mpi) / ceiling)
            row.update(cores_fields(cpu_mpi, "2_mpiexec"))
        rows.append(row)
    return dict(independent_pair_samples_per_s=pairs, examples=rows)


def measure_versus(name, args, work, round_no, port):
    """--versus: the example at 1 and 2 ranks with the other flags. (1-rank, 2-rank samples/s)"""
    print(f"  round {round_no}: {name} with {' '.join(args.versus_args) or 'no flags'} at 1 rank, 2 ranks ...",
          flush=True)
    one, two, *_ = measure_example(name, args, work, port, flags=args.versus_args, tag="-versus")
    return one, two


# Knobs whose library default the examples change (on CPU): Horovod's cycle time (utils/dist.py,
# HOROVOD_CPU_KNOBS) and tf.data's thread pool (utils/tf_utils.py, TFDATA_THREADS). Each round also runs the
# 2-rank example with the libraries' own values, and the report gives the speed-up of the course's choice.
LIBRARY_DEFAULTS = {"horovod-pytorch": {"HOROVOD_CYCLE_TIME": "1"},
                    "horovod-tensorflow": {"HOROVOD_CYCLE_TIME": "1", "SCALING_DL_TFDATA_THREADS": "0"}}


def knob_settings():
    """The performance settings in effect for this benchmark (the examples' defaults, or the environment's)."""
    from utils.dist import HOROVOD_CPU_KNOBS
    defaults = dict(HOROVOD_CPU_KNOBS, SCALING_DL_TFDATA_THREADS="1")  # utils/tf_utils.TFDATA_THREADS
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def combine(rounds):
    """Median over rounds of every number (each ratio was computed within its round), and its range."""
    out = []
    for i, first in enumerate(rounds[0]["examples"]):
        per_round = [r["examples"][i] for r in rounds]
        row = {"example": first["example"]}
        for key in first:
            if key != "example" and all(key in r for r in per_round):
                values = [r[key] for r in per_round]
                row[key] = statistics.median(values)
                row[key + "_range"] = [min(values), max(values)]
        out.append(row)
    return out


def parse_args(argv=None):
    # allow_abbrev=False: an example's flag such as `--s 3` must not be taken for the bench's --steps
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--quick", action="store_true",
                        help="1 round (unless --repeat) of 3 epochs x 8 steps per run (a smoke test)")
    parser.add_argument("--repeat", type=int, help="rounds; medians over them are reported (default 3, --quick 1)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run; the first is warm-up")
    parser.add_argument("--steps", type=int, default=40, help="training steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64, help="batch per rank")
    parser.add_argument("--no-knobs", action="store_true", help="skip the runs with the libraries' defaults")
    parser.add_argument("--versus", metavar="FLAGS",
                        help="with one --only example: every round also runs it with these flags instead of the "
                             "example flags given to the bench, the two taking turns going first (so 4 rounds "
                             "unless --repeat), and the report gives their ratios round by round. Use the = form: "
                             "--versus='--zero-stage 0' (--versus='' for no flags)")
    parser.add_argument("--only", nargs="*", choices=list(EXAMPLES), help="measure only these examples")
    parser.add_argument("--out", help="the JSON report (default runs/bench/latest.json, with --phases "
                                      "runs/bench/phases.json)")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--pairs", type=int, default=6, help="timed example/bare epoch pairs for the overhead")
    parser.add_argument("--part-steps", type=int, default=1,
                        help="the overhead's example and bare loop take turns every this many steps")
    parser.add_argument("--phases", action="store_true",
                        help="only time the PyTorch examples' own steps phase by phase at 1 and 2 ranks "
                             "(utils/phases.py), written to runs/bench/phases.json unless --out")
    parser.add_argument("--overhead", choices=list(EXAMPLES), help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--allreduce", choices=["torch-gloo", "horovod", "mpi4py"], help=argparse.SUPPRESS)
    # Flags the bench does not know go to the example, in every run of it (`--only deepspeed --zero-stage 0`): one
    # example at a time, and never the flags the bench sets itself, so that every run stays comparable.
    args, args.example_args = parser.parse_known_args(argv)
    args.only = list(dict.fromkeys(args.only)) if args.only else args.only
    if args.example_args and not args.overhead and len(args.only or ()) != 1:
        parser.error(f"unrecognized arguments: {' '.join(args.example_args)} (flags for an example need exactly "
                     "one --only NAME)")
    args.versus_args = shlex.split(args.versus) if args.versus is not None else None
    if args.versus_args is not None and len(args.only or ()) != 1:
        parser.error("--versus compares two sets of flags of one example: it needs exactly one --only NAME")
    taken = [f for f in args.example_args + (args.versus_args or []) if f.startswith("--")
             and len(f.split("=")[0]) > 2
             and any(name.startswith(f.split("=")[0]) for name in BENCH_SETS)]  # the examples take abbreviations
    if taken:
        parser.error(f"{' '.join(taken)}: the bench sets this flag itself in every run (see --help)")
    if args.phases and (args.versus_args is not None or "horovod-tensorflow" in (args.only or ())):
        parser.error("--phases times the PyTorch examples (TensorFlow runs its step as one graph), without --versus")
    args.out = args.out or str(ROOT / "runs" / "bench" / ("phases.json" if args.phases else "latest.json"))
    if args.repeat is None:  # --versus: an even count, so that each set of flags goes first as often
        args.repeat = 1 if args.quick else 4 if args.versus_args is not None else 3
    if args.repeat < 1 or args.epochs < 2 or args.steps < 1 or args.pairs < 1 or args.part_steps < 1:
        parser.error("--repeat, --steps, --pairs and --part-steps must be at least 1, --epochs at least 2 "
                     "(the first is warm-up)")
    return args


def main():
    args = parse_args()
    if args.allreduce:  # (--repeat: how many all-reduces are timed)
        allreduce_timing(args.allreduce, args.repeat)
        return
    if args.overhead:
        ratios = (overhead_tf(args.steps, args.batch_size, args.pairs, args.part_steps, args.example_args)
                  if args.overhead == "horovod-tensorflow"
                  else overhead_torch(args.overhead, args.steps, args.batch_size, args.pairs, args.part_steps,
                                      args.example_args))
        print(json.dumps({"ratios": ratios}), flush=True)
        os._exit(0)  # Horovod's and DeepSpeed's process-exit hooks have nothing to add here
    if args.breakdown:
        breakdown(args.steps, args.batch_size)
        return
    if args.quick:
        args.epochs, args.steps, args.pairs = 3, 8, 2
    args.allreduce_reps = 10 if args.quick else 50

    names = args.only or list(EXAMPLES)
    started = time.strftime("%Y-%m-%d %H:%M")
    if args.phases:
        names = [n for n in names if EXAMPLES[n][2] == "torch"]
        print(f"bench --phases: {', '.join(names)}, {args.repeat} round(s) of {args.epochs} epochs x {args.steps} "
              f"steps, batch {args.batch_size} per rank, 1 thread per rank", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            phases, costs, rounds = run_phases(args, names, tmp)
        write_report(args, started, print_phases, phases=phases, step_costs=costs, rounds=rounds)
        return
    print(f"bench: {len(names)} example(s), {args.repeat} round(s) of {args.epochs} epochs x {args.steps} steps, "
          f"batch {args.batch_size} per rank, 1 thread per rank, on {os.cpu_count()} cores"
          + (f"; {names[0]} with {' '.join(args.example_args) or 'no flags'}"
             if args.example_args or args.versus_args is not None else "")
          + (f", against {' '.join(args.versus_args) or 'no flags'}" if args.versus_args is not None else ""),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        rounds = []
        for r in range(args.repeat):  # each round in its own folder: a run must not find the last one's metrics
            (Path(tmp) / f"round-{r + 1}").mkdir()
            rounds.append(measure_round(names, args, Path(tmp) / f"round-{r + 1}", r + 1))
        print("  breakdown of a 2-rank step ...", flush=True)
        parts = measure_breakdown(args, 29650)
        print("  one all-reduce of the gradients: gloo, Horovod (gloo, MPI), MPI ...", flush=True)
        wire = measure_allreduce(args, 29660)
    examples = combine(rounds)
    for row in examples:
        print(f"  {row['example']}: its training loop against a bare loop, alternating in one process ...", flush=True)
        ratios = measure_overhead(row["example"], args)
        row.update(overhead=statistics.median(ratios), overhead_range=[min(ratios), max(ratios)],
                   overhead_pairs=ratios)
        if args.versus_args is not None:
            ratios = measure_overhead(row["example"], args, args.versus_args)
            row.update(overhead_versus=statistics.median(ratios), overhead_versus_range=[min(ratios), max(ratios)],
                       overhead_versus_pairs=ratios)

    write_report(args, started, print_table, versus_args=args.versus_args, breakdown=parts, allreduce=wire,
                 examples=examples, rounds=rounds)


def write_report(args, started, print_report, **results):
    """The run's settings and `results` as JSON to --out, then printed by `print_report`."""
    report = dict(date=started, cpu_count=os.cpu_count(), repeat=args.repeat, epochs=args.epochs,
                  steps=args.steps, batch_size=args.batch_size, example_args=args.example_args,
                  knobs=knob_settings(), **results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nwritten to {args.out}")


def print_table(report):
    header = ("example", "1 rank/s", "2 ranks/s", "efficiency", "ceiling", "eff/ceiling", "overhead")
    lines = [header]
    for r in report["examples"]:
        lo, hi = r["efficiency_range"]
        olo, ohi = r["overhead_range"]
        lines.append((r["example"], f"{r['samples_per_s_1']:.0f}", f"{r['samples_per_s_2']:.0f}",
                      f"{r['efficiency']:.2f} ({lo:.2f}-{hi:.2f})", f"{r['ceiling_efficiency']:.2f}",
                      f"{r['relative_to_ceiling']:.2f}",
                      f"{100 * r['overhead']:+.1f}% ({100 * olo:+.1f}..{100 * ohi:+.1f})"))
    print(f"\nmedians over {report['repeat']} round(s), range over rounds in brackets"
          + (f"; the example ran with {' '.join(report['example_args'])}" if report.get("example_args") else ""))
    for line in lines:
        print("  ".join(f"{c:>{19 if i in (0, 3, 6) else 10}}" for i, c in enumerate(line)))
    knobs = [r for r in report["examples"] if "knob_speedup" in r]
    if knobs:
        print(f"\nthe examples' CPU knobs {report['knobs']} against the libraries' defaults, 2 ranks:")
        for r in knobs:
            lo, hi = r["knob_speedup_range"]
            print(f"  {r['example']:>19}: {r['samples_per_s_2']:.0f} vs {r['samples_per_s_2_library_defaults']:.0f} "
                  f"samples/s, x{r['knob_speedup']:.2f} ({lo:.2f}-{hi:.2f})")
    for r in report["examples"]:
        if "versus_speedup_2" in r:
            mine, other = " ".join(report["example_args"]) or "no flags", " ".join(report["versus_args"]) or "no flags"
            print(f"\n{r['example']} with {mine} against {other} (the second's numbers after 'vs'; ratios taken "
                  "within each round):")
            for n, what in (("1", "1 rank"), ("2", "2 ranks")):
                lo, hi = r[f"versus_speedup_{n}_range"]
                print(f"  {what:>19}: {r[f'samples_per_s_{n}']:.0f} vs {r[f'samples_per_s_{n}_versus']:.0f} "
                      f"samples/s, x{r[f'versus_speedup_{n}']:.2f} ({lo:.2f}-{hi:.2f})")
            (lo, hi), (vlo, vhi) = r["relative_to_ceiling_range"], r["relative_to_ceiling_versus_range"]
            print(f"  {'2 ranks / ceiling':>19}: {r['relative_to_ceiling']:.2f} ({lo:.2f}-{hi:.2f}) vs "
                  f"{r['relative_to_ceiling_versus']:.2f} ({vlo:.2f}-{vhi:.2f})")
            (lo, hi), (vlo, vhi) = r["overhead_range"], r["overhead_versus_range"]
            print(f"  {'overhead':>19}: {100 * r['overhead']:+.1f}% ({100 * lo:+.1f}..{100 * hi:+.1f}) vs "
                  f"{100 * r['overhead_versus']:+.1f}% ({100 * vlo:+.1f}..{100 * vhi:+.1f}) (measured one after "
                  "the other, after the rounds)")
    launchers = [r for r in report["examples"] if "efficiency_mpiexec" in r]
    if launchers:
        print("\nthe Horovod examples at 2 ranks by launcher: horovodrun --gloo (gloo over loopback TCP) "
              "vs mpiexec (MPI, shared memory):")
        for r in launchers:
            lo, hi = r["efficiency_mpiexec_range"]
            print(f"  {r['example']:>19}: efficiency {r['efficiency']:.2f} vs {r['efficiency_mpiexec']:.2f} "
                  f"({lo:.2f}-{hi:.2f}); {r['samples_per_s_2']:.0f} vs {r['samples_per_s_2_mpiexec']:.0f} samples/s")
    cores = [r for r in report["examples"] if "cores_total_2" in r]
    if cores:
        print("\nwhere the cores go: CPU seconds per second of training per rank, by thread (main / TensorFlow's "
              "op pool / all others: Horovod, gloo, MPI, tf.data), 1 rank -> 2 ranks:")
        for r in cores:
            print(f"  {r['example']:>19}: " + ", ".join(
                f"{part} {r.get(f'cores_{part}_1', float('nan')):.2f} -> {r[f'cores_{part}_2']:.2f}"
                for part in ("main", "tf_pool", "other", "total")))
            if "cores_total_2_mpiexec" in r:
                print(f"  {'(mpiexec)':>19}: " + ", ".join(f"{part} {r[f'cores_{part}_2_mpiexec']:.2f} at 2 ranks"
                                                          for part in ("main", "tf_pool", "other", "total")))
    wire = report["allreduce"]
    print(f"\none all-reduce of the CNN's gradients ({next(iter(wire.values()))['bytes'] / 1e6:.1f} MB float32) "
          "between 2 ranks, median:")
    for name, timing in wire.items():
        print(f"  {name:>35}: {timing['ms']:.2f} ms")
    b = report["breakdown"]
    print(f"\n2-rank step on rank 0, phases run one after another (no overlap): {b['step_ms']:.1f} ms = " +
          ", ".join(f"{k} {v:.1f} ms ({100 * b['fraction'][k]:.0f}%)" for k, v in b["ms_per_step"].items()))


if __name__ == "__main__":
    main()
