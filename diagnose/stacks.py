#!/usr/bin/env python
"""Where is every rank of a job on this node right now? One Python stack per rank, and who differs.

    python diagnose/stacks.py                  every rank of every job running on this node
    python diagnose/stacks.py --pid 4242       the ranks below one launcher (torchrun, mpiexec, ...)
    python diagnose/stacks.py --full           every frame, not only the course's and the last call

Run it from a second terminal (or `ssh` to the node, or `srun --overlap --jobid <id>`) while a job
hangs. It finds the Python processes that a launcher gave a rank (RANK, PMI_RANK, HOROVOD_RANK,
PALS_RANKID, OMPI_COMM_WORLD_RANK, SLURM_PROCID) and reads each one's stack with `py-spy dump
--nonblocking`, which reads the process' memory without pausing it, so it also works on a stopped
(SIGSTOP'd) rank. It needs permission to read other processes (the same user, and ptrace allowed:
kernel.yama.ptrace_scope 0 or 1).

The last lines say which rank is not where the others are: ranks stuck in one collective wait for
the rank that is elsewhere, stopped, or gone. diagnose/hangs.md shows it on each kind of hang."""

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_VARIABLES = (
    "RANK",
    "PMI_RANK",
    "HOROVOD_RANK",
    "PALS_RANKID",
    "OMPI_COMM_WORLD_RANK",
    "SLURM_PROCID",
)
SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in the kernel (disk/network)",
    "T": "STOPPED (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited (zombie)",
}
FRAME = re.compile(r"^\s+(?P<name>\S+) \((?P<file>.+):(?P<line>\d+)\)$")


def environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def parent(pid):
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def below(pid, ancestor):
    while pid > 1:
        if pid == ancestor:
            return True
        pid = parent(pid)
    return False


def find_ranks(launcher=None):
    """{(job, rank): (pid, world size)} of the Python processes that run a script with a rank."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        args = cmdline(pid)
        if (
            not args
            or "python" not in os.path.basename(args[0])
            or not any(a.endswith(".py") for a in args)
        ):
            continue
        if any(
            a.startswith("-m") or a.endswith(("torchrun", "deepspeed", "horovodrun"))
            for a in args[1:3]
        ):
            continue  # a launcher written in Python (torchrun, deepspeed's node helper): no rank
        env = environ(pid)
        rank_var = next((v for v in RANK_VARIABLES if v in env), None)
        if rank_var is None or (launcher and not below(pid, launcher)):
            continue
        script = next(a for a in args if a.endswith(".py"))
        job = (
            env.get("MASTER_PORT")
            or env.get("TORCHELASTIC_RUN_ID")
            or env.get("PMI_PORT")
            or env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
            or "?",
            script,
        )
        size = next((int(env[v]) for v in SIZE_VARIABLES if env.get(v, "").isdigit()), None)
        found.setdefault((job, int(env[rank_var])), (pid, size))
    return found


def dump(pid):
    """[(function, file, line)] innermost first, of the main thread, from py-spy (or an error
    string)."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        out = subprocess.run(
            [py_spy, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy failed: {exc}"
    if out.returncode != 0:
        return f"py-spy failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
    threads = out.stdout.split("\nThread ")
    main = next((t for t in threads if '"MainThread"' in t.splitlines()[0]), threads[-1])
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")  # a script started by a relative path shows that path
    except OSError:
        cwd = "/"
    return [
        (
            m["name"].rsplit(".", 1)[-1].replace("<locals>", ""),
            os.path.join(cwd, m["file"]),
            int(m["line"]),
        )
        for m in map(FRAME.match, main.splitlines())
        if m
    ]


def short(path):
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def is_course_code(path):
    """A file of this repository, not an installed library (a venv inside the checkout holds those
    too)."""
    relative = short(path)
    return relative != path and not any(part in ("site-packages", "dist-packages")
                                        for part in Path(relative).parts)


def where(frames):
    """(the call it is in, the course's innermost line): ('barrier', 'DDP/main.py:56')."""
    mine = next((i for i, f in enumerate(frames) if is_course_code(f[1])), None)
    if mine is None:
        return (frames[0][0] if frames else "?"), "?"
    library = [
        f[0] for f in frames[:mine] if not f[0].startswith("_") and f[0] not in ("wrapper", "wait")
    ]
    call = library[-1] if library else frames[mine][0]
    return call, f"{short(frames[mine][1])}:{frames[mine][2]}"


def report(found, full=False, out=sys.stdout):
    jobs = defaultdict(dict)
    for (job, rank), value in found.items():
        jobs[job][rank] = value
    if not jobs:
        print(
            "no rank of any job found on this node "
            "(RANK/PMI_RANK/HOROVOD_RANK/... in a Python process)",
            file=out,
        )
        return 1
    for (port, script), ranks in sorted(jobs.items()):
        size = max((s for _, s in ranks.values() if s), default=len(ranks))
        print(
            f"job {short(script)} (rendezvous {port}): {len(ranks)} of {size} rank(s) on this node",
            file=out,
        )
        places = defaultdict(list)
        notes = []
        for rank in sorted(ranks):
            pid, _ = ranks[rank]
            st = state(pid)
            frames = dump(pid)
            if isinstance(frames, str):
                print(f"rank {rank} (pid {pid}, {STATES.get(st, st)}): {frames}", file=out)
                continue
            call, line = where(frames)
            print(f"rank {rank} (pid {pid}, {STATES.get(st, st)}): in {call} at {line}", file=out)
            for name, file, lineno in (
                frames if full else [f for f in frames if is_course_code(f[1])]
            ):
                print(f"    {short(file)}:{lineno} {name}", file=out)
            places[line].append(rank)
            if st in "Tt":
                notes.append(
                    f"rank {rank} is stopped: `kill -CONT {pid}` resumes it, "
                    f"`kill -9 {pid}` ends the job"
                )
        missing = sorted(set(range(size)) - set(ranks))
        if missing and len(ranks) < size:
            notes.append(
                f"rank(s) {', '.join(map(str, missing))} not on this node: exited, "
                "or running elsewhere "
                "(run this there too)"
            )
        if len(places) > 1:
            groups = sorted(places.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            notes.append(
                "the ranks are not in the same call: "
                + "; ".join(f"rank(s) {', '.join(map(str, rs))} at {line}" for line, rs in groups)
            )
            if len(groups[0][1]) > len(groups[1][1]):
                odd = sorted(r for _, rs in groups[1:] for r in rs)
                notes.append(
                    f"most ranks wait at {groups[0][0]}; the one(s) elsewhere: rank(s) "
                    f"{', '.join(map(str, odd))}"
                )
        elif places:
            notes.append(
                f"every rank found is at {next(iter(places))}: if they stay there, "
                "they disagree on "
                "the collective itself (run with TORCH_DISTRIBUTED_DEBUG=DETAIL: diagnose/hangs.md)"
            )
        for note in notes:
            print(f"=> {note}", file=out)
    return 0


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pid", type=int, help="only the ranks below this process (the launcher)")
    p.add_argument("--full", action="store_true", help="every frame of each rank's main thread")
    args = p.parse_args()
    sys.exit(report(find_ranks(args.pid), args.full))


if __name__ == "__main__":
    main()
