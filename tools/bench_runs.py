"""The bench's training runs: every example run as a program (its flags and files: metrics.jsonl), started
through tools.launch.launch_command, at 1 and 2 ranks, beside the ceiling (two independent 1-rank runs at
once)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tools import bench_cpu
from tools.bench_report import ceiling_efficiency, efficiency, steady_throughput
from tools.launch import EXAMPLES, ROOT, launch_command

BIN = Path(sys.executable).parent  # the venv's bin: torchrun, mpiexec, horovodrun, deepspeed

HOROVODRUN_FLAGS = ("--gloo-timeout-seconds", "60")
# tools.launch.EXAMPLES name: (its 2-rank launcher, framework kind: whose independent pair is its ceiling)
BENCHED = {
    "ddp": ("torchrun", "torch"),
    "horovod-pytorch": ("horovodrun", "torch"),
    "horovod-tensorflow": ("horovodrun", "tf"),
    "deepspeed": ("deepspeed", "torch"),
}
PAIR_EXAMPLE = {"torch": "ddp", "tf": "horovod-tensorflow"}  # the ceiling's 1-rank runs
# Horovod's bytes travel with gloo under `horovodrun --gloo` (TCP over loopback) and with MPI under `mpiexec` (the
# MPI controller and operations; the venv's MPICH uses shared memory between ranks of one node). Each round also
# runs these examples at 2 ranks under mpiexec, so the report compares the two launchers on the same example.
MPIEXEC_RUNS = ("horovod-pytorch", "horovod-tensorflow")
# Knobs whose library default the examples change on CPU and the environment overrides: Horovod's cycle time
# (the Horovod lessons' CPU_KNOBS = course/dist.py's HOROVOD_CPU_KNOBS). Each round also runs the 2-rank example
# with Horovod's own value, and the report gives the speed-up of the course's choice. (tf.data's one private
# thread, ONE_THREAD, has
# no such switch: it is not measured against tf.data's defaults.)
LIBRARY_DEFAULTS = {"horovod-pytorch": {"HOROVOD_CYCLE_TIME": "1"}, "horovod-tensorflow": {"HOROVOD_CYCLE_TIME": "1"}}
BENCH_SETS = ("--epochs", "--max-steps", "--batch-size", "--num-threads", "--log-interval", "--log-dir")


def command(example, nproc, launcher, args, wrapper=None):
    """The launch command (tools.launch.launch_command) with the venv's launchers and horovodrun's gloo
    timeout."""
    flags = HOROVODRUN_FLAGS if launcher == "horovodrun" else ()
    return launch_command(example, nproc, launcher, args, wrapper=wrapper, bin_dir=BIN, launcher_flags=flags)


def env_for_bench():
    return dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def example_flags(args, log_dir, epochs=None):
    return ["--epochs", str(epochs or args.epochs), "--max-steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--num-threads", "1", "--log-interval", "1000", "--log-dir", str(log_dir)]


def launch(cmd, timeout, extra_env=None, **popen):
    """Start `cmd` in the repository root (output captured unless `popen` says otherwise): (process, timeout)."""
    popen = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), **popen)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=dict(env_for_bench(), **(extra_env or {})), **popen)
    return proc, timeout


def wait(proc, timeout, what):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit(f"bench: {what} did not finish in {timeout}s")
    if proc.returncode != 0:
        raise SystemExit(f"bench: {what} failed (exit {proc.returncode}):\n{(out or '')[-3000:]}")
    return out


def history(log_dir):
    with open(Path(log_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def described(tag):
    return f" ({tag.lstrip('-')})" if tag else ""


def measure_example(name, args, work, flags=None, tag=""):
    """(1-rank samples/s, 2-rank samples/s, framework kind, CPU by thread at 1 rank, CPU by thread at 2 ranks).
    `flags`: the example's own flags (default: those given to the bench; --versus gives others)."""
    flags = args.example_args if flags is None else flags
    one = work / f"{name}-1{tag}"
    proc = launch(command(name, 1, "python", [*example_flags(args, one), *flags]), args.timeout)
    cpu_1 = bench_cpu.watch_cpu(proc[0], EXAMPLES[name], one, args.epochs)
    wait(*proc, f"{name} 1 rank{described(tag)}")
    two, cpu_2 = measure_two_ranks(name, args, work, tag=tag, flags=flags)
    return steady_throughput(history(one)), two, BENCHED[name][1], cpu_1.result(), cpu_2


def measure_two_ranks(name, args, work, extra_env=None, tag="", launcher=None, flags=None):
    """(2-rank samples/s, CPU by thread kind per rank) under `launcher` (default: the example's own)."""
    flags = args.example_args if flags is None else flags
    two = work / f"{name}-2{tag}"
    proc = launch(command(name, 2, launcher or BENCHED[name][0], [*example_flags(args, two), *flags]),
                  args.timeout, extra_env)
    cpu = bench_cpu.watch_cpu(proc[0], EXAMPLES[name], two, args.epochs)
    wait(*proc, f"{name} 2 ranks{described(tag)}")
    return steady_throughput(history(two)), cpu.result()


def measure_ceiling(kind, args, work):
    """Two independent single-process runs of one framework at the same time: no communication at all."""
    procs = []
    for i in range(2):
        log_dir = work / f"independent-{kind}-{i}"
        procs.append((launch(command(PAIR_EXAMPLE[kind], 1, "python", example_flags(args, log_dir)), args.timeout),
                      log_dir))
    rates = []
    for (proc, timeout), log_dir in procs:
        wait(proc, timeout, f"independent {kind} run")
        rates.append(steady_throughput(history(log_dir)))
    return rates


def measure_round(names, args, work, round_no):
    """Everything once: per framework kind its independent pair, then each example at 1 and
    2 ranks. Ratios are taken inside the round."""
    kinds = sorted({BENCHED[n][1] for n in names})
    pairs = {}
    for kind in kinds:
        print(f"  round {round_no}: {kind} ceiling (two independent 1-rank runs at once) ...", flush=True)
        pairs[kind] = measure_ceiling(kind, args, work)
    rows = []
    for name in names:
        versus = None
        if args.versus_args is not None and round_no % 2 == 0:  # --versus: the two take turns going first
            versus = measure_versus(name, args, work, round_no)
        print(f"  round {round_no}: {name} at 1 rank, 2 ranks ...", flush=True)
        one, two, kind, cpu_1, cpu_2 = measure_example(name, args, work)
        if args.versus_args is not None and versus is None:
            versus = measure_versus(name, args, work, round_no)
        eff, ceiling = efficiency(one, two), ceiling_efficiency(one, pairs[kind])
        row = dict(example=name, samples_per_s_1=one, samples_per_s_2=two, efficiency=eff,
                   ceiling_efficiency=ceiling, relative_to_ceiling=eff / ceiling)
        row.update(bench_cpu.cores_fields(cpu_1, "1"), **bench_cpu.cores_fields(cpu_2, "2"))
        if versus is not None:  # the same example with other flags, in the same round: ratios within the round
            one_v, two_v = versus
            eff_v = efficiency(one_v, two_v)
            row.update(samples_per_s_1_versus=one_v, samples_per_s_2_versus=two_v, efficiency_versus=eff_v,
                       relative_to_ceiling_versus=eff_v / ceiling_efficiency(one_v, pairs[kind]),
                       versus_speedup_1=one / one_v, versus_speedup_2=two / two_v)
        if name in LIBRARY_DEFAULTS and not args.no_knobs:  # the course's knob against the library's default
            print(f"  round {round_no}: {name} at 2 ranks with the library's defaults {LIBRARY_DEFAULTS[name]} ...",
                  flush=True)
            lib, _ = measure_two_ranks(name, args, work, LIBRARY_DEFAULTS[name], "-library-defaults")
            row.update(samples_per_s_2_library_defaults=lib, knob_speedup=two / lib)
        if name in MPIEXEC_RUNS:
            print(f"  round {round_no}: {name} at 2 ranks under mpiexec (MPI moves the gradients) ...", flush=True)
            mpi, cpu_mpi = measure_two_ranks(name, args, work, tag="-mpiexec", launcher="mpiexec")
            row.update(samples_per_s_2_mpiexec=mpi, efficiency_mpiexec=efficiency(one, mpi),
                       relative_to_ceiling_mpiexec=efficiency(one, mpi) / ceiling)
            row.update(bench_cpu.cores_fields(cpu_mpi, "2_mpiexec"))
        rows.append(row)
    return dict(independent_pair_samples_per_s=pairs, examples=rows)


def measure_versus(name, args, work, round_no):
    """--versus: the example at 1 and 2 ranks with the other flags. (1-rank, 2-rank samples/s)"""
    print(f"  round {round_no}: {name} with {' '.join(args.versus_args) or 'no flags'} at 1 rank, 2 ranks ...",
          flush=True)
    one, two, *_ = measure_example(name, args, work, flags=args.versus_args, tag="-versus")
    return one, two
