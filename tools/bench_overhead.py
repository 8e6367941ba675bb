"""The examples' *overhead*: how much slower an example's own training step is, at one rank, than a bare loop's
(tools/bare_loop.py: the same model, optimizer and data in a plain loop, no framework). Both run as
programs; nothing of the example is imported.

--pairs times, each time in two fresh processes (a process's own speed differs from the next one's: its memory
lands elsewhere), the example and the bare loop run a warm-up epoch and one measured epoch of --steps steps:
PyTorch: the example runs unchanged under phases.py, which times its steps from outside, and the bare loop under
the same timers; the two take turns every --part-steps steps (one goes first in even parts, the other in odd
ones; who starts alternates pair by pair), each waiting on a pipe while the other runs, their compute threads
on one core, so that this machine's drifts in speed (10% within seconds) hit both alike. The pair's ratio: the
example's mean step over the bare loop's in the measured epoch, minus 1.
TensorFlow runs its step as one graph, which phases.py does not take apart: there each pair is two whole
1-rank runs one after the other (who goes first alternates), and the ratio compares the measured epoch's
samples/s: bare / example - 1.
"""
import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path

from tools import bench_runs
from tools.bench_phases import PHASES
from tools.bench_report import steady_throughput, step_ratios

BARE = Path(__file__).resolve().parent / "bare_loop.py"


def flag_value(flags, name):
    """The value of `name` in an example's flags (`--name value` or `--name=value`), or None."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def overhead_commands(name, args, flags, work):
    """{"example": (command, where its timings go), "bare": (command, where its timings go)} at one rank each:
    PyTorch's timings are phases.py's files ($PHASES_OUT), TensorFlow's the runs' metrics.jsonl."""
    tf, epochs = bench_runs.BENCHED[name][1] == "tf", 2  # a warm-up epoch and a measured one
    example_out, bare_out = Path(work) / f"{name}-overhead", Path(work) / f"{name}-overhead-bare"
    example = bench_runs.command(name, 1, "python", [*bench_runs.example_flags(args, example_out, epochs), *flags],
                                 wrapper=None if tf else PHASES)
    bare = ["--epochs", epochs, "--max-steps", args.steps, "--batch-size", args.batch_size, "--num-threads", 1]
    if flag_value(flags, "--data-dir"):  # the same digits as the example
        bare += ["--data-dir", flag_value(flags, "--data-dir")]
    if tf:
        bare += ["--framework", "tf", "--log-dir", bare_out]
    elif name == "deepspeed":  # its config's optimizer: Adam (deepspeed/ds_config.json, or the one it is given)
        bare += ["--optimizer", "adam", "--lr", "1e-3"]
        if flag_value(flags, "--deepspeed_config"):
            bare += ["--adam-config", flag_value(flags, "--deepspeed_config")]
    return {"example": (example, example_out), "bare": (bench_runs.command(BARE, 1, "python", bare), bare_out)}


def records(out):
    return json.loads(Path(f"{out}-rank0.json").read_text())["records"]


def take_turns(commands, every, timeout, work):
    """Run the programs of `commands` ({side: (command, $PHASES_OUT)}) side by side, one at a time: each runs
    until it has done `every` steps (phases.Turns), then waits for the coordinator's go-ahead while the others
    take their turn, the order reversed every part. Returns when all have exited (SystemExit if one fails)."""
    deadline, procs = time.monotonic() + timeout, {}
    try:
        for side, (cmd, out) in commands.items():
            go_read, go_write = os.pipe()
            done_read, done_write = os.pipe()
            log = open(Path(work) / f"{Path(out).name}.log", "w")
            env = {"PHASES_OUT": str(out), "PHASES_TURNS": f"{go_read},{done_write},{every}"}
            proc, _ = bench_runs.launch(cmd, timeout, env, stdout=log, pass_fds=(go_read, done_write))
            os.close(go_read), os.close(done_write)
            procs[side] = dict(proc=proc, go=go_write, done=done_read, log=log)
        ready = {side: part_done(p, deadline, side) for side, p in procs.items()}  # each has run its first part
        share_one_core(p["proc"].pid for p in procs.values())
        part = 0
        while any(ready.values()):
            for side in (list(procs) if part % 2 == 0 else list(procs)[::-1]):
                if ready[side]:
                    try:
                        os.write(procs[side]["go"], b".")
                        ready[side] = part_done(procs[side], deadline, side)
                    except BrokenPipeError:  # it has gone: its exit status says how
                        ready[side] = False
            part += 1
        for side, p in procs.items():
            try:
                p["proc"].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"bench: overhead, {side}: did not finish in {timeout}s")
            if p["proc"].returncode != 0:
                tail = Path(p["log"].name).read_text()[-3000:]
                raise SystemExit(f"bench: overhead, {side} failed (exit {p['proc'].returncode}):\n{tail}")
    finally:
        for p in procs.values():
            if p["proc"].poll() is None:
                p["proc"].kill()
                p["proc"].wait()
            os.close(p["go"]), os.close(p["done"])
            p["log"].close()


def share_one_core(pids):
    """Put the processes' main threads (which compute, at one thread) on the same core: taking turns evens out
    drifts in time, this evens out what else runs on each core. Only the main threads: on Linux a pid names
    that one thread, and the threads the processes have started by now (Horovod's, gloo's) stay free."""
    if hasattr(os, "sched_setaffinity"):
        core = max(os.sched_getaffinity(0))
        for pid in pids:
            try:
                os.sched_setaffinity(pid, {core})
            except OSError:  # it has exited already
                pass


def part_done(p, deadline, side):
    """Wait until the process says its part is done (True) or has exited (False: its pipe closed)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"bench: overhead, {side}: no step done in time")
        readable, _, _ = select.select([p["done"]], [], [], min(left, 1.0))
        if readable:
            return bool(os.read(p["done"], 1))


def measure_overhead(name, args, flags=None):
    """The overhead ratios (--pairs of them) of example `name` run with `flags` (default: the bench's)."""
    flags = args.example_args if flags is None else flags
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for i in range(args.pairs):
            work = Path(tmp) / f"pair-{i + 1}"
            work.mkdir()
            commands = overhead_commands(name, args, flags, work)
            order = ("example", "bare") if i % 2 == 0 else ("bare", "example")
            if bench_runs.BENCHED[name][1] == "tf":
                rates = {}
                for side in order:
                    cmd, log_dir = commands[side]
                    bench_runs.wait(*bench_runs.launch(cmd, args.timeout), f"{name} overhead, {side}")
                    rates[side] = steady_throughput(bench_runs.history(log_dir))
                ratios.append(rates["bare"] / rates["example"] - 1)
            else:
                take_turns({side: commands[side] for side in order}, args.part_steps, args.timeout, work)
                ratios += step_ratios(records(commands["example"][1]), records(commands["bare"][1]))
    return ratios
