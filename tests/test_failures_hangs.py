"""Hang forensics: bugs planted from outside the lessons (tests/hooks/faults.py, COURSE_PLANT), each
found within 60 s by the recipe diagnose/hangs.md gives for it: diagnose/stacks.py (py-spy of every
rank) names the rank that is elsewhere and the file:line where the others wait;
dist.monitored_barrier names the rank that never arrived; TORCH_DISTRIBUTED_DEBUG=DETAIL names the
mismatched collectives; torchrun's report names a rank that died; a data-order check shows a
forgotten set_epoch."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from support import BIN, DDP, DS, LAUNCHED, ROOT, kill_tree, launchers_in, run, torchrun, warm

DIAGNOSE_DEADLINE_S = 60
HOOKS = str(ROOT / "tests" / "hooks")


def line_of(path, text):
    """The number of the one line of `path` (from the repository root) that contains `text`."""
    hits = [i for i, line in enumerate((ROOT / path).read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1, (path, text, hits)
    return hits[0]


BACKWARD = f"{DDP}:{line_of(DDP, '(loss / len(micro_batches)).backward()')}"
BARRIER = f"tests/hooks/faults.py:{line_of('tests/hooks/faults.py', '        dist.barrier()')}"
ALL_REDUCE = "tests/hooks/faults.py:" + str(
    line_of("tests/hooks/faults.py", "dist.all_reduce(torch.zeros(rank + 2))"))


def planted(tmp_path, plant, *flags, script=DDP, env=None, until="COURSE_PLANT"):
    """Start a 2-rank torchrun job with the planted bug; return (process, output file, time it
    fired)."""
    out_path = tmp_path / "output.txt"
    full_env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
        PYTHONPATH=HOOKS,
        COURSE_PLANT=plant,
        **(env or {}),
    )
    cmd = [
        str(c)
        for c in torchrun(
            2, script, "--epochs", "5", "--num-threads", "1", "--log-dir", tmp_path / "log", *flags
        )
    ]
    LAUNCHED.extend(launchers_in(cmd))
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    while until not in out_path.read_text():
        assert proc.poll() is None or until == "COURSE_PLANT: rank 1 exits", out_path.read_text()[
            -3000:
        ]
        assert time.monotonic() < deadline, out_path.read_text()[-3000:]
        time.sleep(0.2)
    return proc, out_path, time.monotonic()


def end(proc):
    kill_tree(proc)  # torchrun and its workers: a stopped rank would otherwise stay for ever
    proc.wait()


def stacks(proc):
    """diagnose/stacks.py on the job, with nothing of the test's environment (no COURSE_*
    variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COURSE_") and k != "PYTHONPATH"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    out = subprocess.run(
        [sys.executable, ROOT / "diagnose" / "stacks.py", "--pid", str(proc.pid)],
        env=env,
        capture_output=True,
        text=True,
        timeout=DIAGNOSE_DEADLINE_S,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def shows(report, expect):
    """Whether the stacks report has every rank where `expect` says the planted bug leaves it."""
    lines = {rank: next((line for line in report.splitlines() if line.startswith(f"rank {rank} ")), "")
             for rank in (0, 1)}
    if "any" in expect and expect["any"] not in lines[0] + lines[1]:
        return False
    return all(words in lines[rank] for rank, words in expect.items() if rank != "any") and (
        "=> the ranks are not in the same call" in report)


def rank_line(report, rank):
    return next(line for line in report.splitlines() if line.startswith(f"rank {rank} "))


@pytest.mark.parametrize(
    "plant,expect",
    [
        # rank 0 alone in a barrier; rank 1 went on, to the next step's gradient all-reduce
        ("rank0-collective", {0: f"in barrier at {BARRIER}", 1: f"in backward at {BACKWARD}"}),
        # rank 1 stopped; rank 0 waits for it in the gradient all-reduce
        ("stop", {0: f"in backward at {BACKWARD}", 1: "STOPPED (SIGSTOP)"}),
        # gloo lets one rank through a mismatched all-reduce; the other waits in it
        ("mismatch", {"any": f"in all_reduce at {ALL_REDUCE}"}),
    ],
)
def test_stacks_of_every_rank_name_where_each_waits(tmp_path, plant, expect):
    proc, _, fired = planted(tmp_path, plant, "--dist-timeout", "100")
    try:
        while True:  # until the hang is established (each rank where the bug leaves it), within the deadline
            report = stacks(proc)
            took = time.monotonic() - fired
            if shows(report, expect) or took >= DIAGNOSE_DEADLINE_S:
                break
            time.sleep(0.5)
    finally:
        end(proc)
    print(f"\n[{plant}] diagnosed {took:.1f} s after the bug fired:\n{report}")
    assert took < DIAGNOSE_DEADLINE_S
    if "any" in expect:
        assert expect["any"] in rank_line(report, 0) + rank_line(report, 1), report
    for rank, words in expect.items():
        if rank != "any":
            assert words in rank_line(report, rank), report
    assert "=> the ranks are not in the same call" in report, report
    if plant == "stop":
        assert re.search(r"=> rank 1 is stopped: `kill -CONT \d+` resumes it", report), report


def test_monitored_barrier_names_the_rank_that_never_arrived(tmp_path):
    """Every rank passes a dist.monitored_barrier(timeout=5 s) after each step; rank 1 stops: rank
    0's one line names rank 1 (gloo's monitored barrier knows who did not arrive) 5 s later."""
    proc, out_path, fired = planted(
        tmp_path, "stop", "--dist-timeout", "100", env={"COURSE_MONITOR": "5"}
    )
    try:
        deadline = fired + DIAGNOSE_DEADLINE_S
        while "never arrived" not in out_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - fired
    finally:
        end(proc)
    line = next((x for x in out_path.read_text().splitlines() if "never arrived" in x), None)
    print(f"\n[monitored barrier] {took:.1f} s: {line}")
    assert line and line.startswith(
        "error: rank 0 waited 5 s in monitored_barrier at tests/hooks/faults.py:"
    )
    assert "for rank 1, which never arrived" in line and "in epoch 1 after step 3/" in line


def test_torch_distributed_debug_detail_names_the_mismatched_collectives(tmp_path):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's shape on every rank before it runs.
    (Shown on the DeepSpeed lesson: with DDP's constructor it crashes in this torch,
    diagnose/hangs.md.)"""
    proc, out_path, fired = planted(
        tmp_path,
        "mismatch",
        "--dist-timeout",
        "100",
        script=DS,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    try:
        proc.wait(timeout=DIAGNOSE_DEADLINE_S)
        took = time.monotonic() - fired
    finally:
        end(proc)
    output = out_path.read_text()
    found = re.findall(
        r"Detected mismatch between collectives on ranks\. Rank (\d) is running collective: "
        r"CollectiveFingerPrint\(SequenceNumber=\d+, OpType=ALLREDUCE, TensorShape=\[(\d)\]",
        output,
    )
    print(f"\n[DETAIL] the job ended {took:.1f} s after the bug fired: {found}")
    assert sorted(set(found)) == [("0", "2"), ("1", "3")], output[
        -3000:
    ]  # each rank names both shapes


def test_a_rank_that_dies_before_any_collective_is_torchruns_root_cause(tmp_path):
    proc, out_path, fired = planted(
        tmp_path, "die-early", "--dist-timeout", "100", until="COURSE_PLANT: rank 1 exits"
    )
    try:
        rc = proc.wait(timeout=DIAGNOSE_DEADLINE_S)
        took = time.monotonic() - fired
    finally:
        end(proc)
    output = out_path.read_text()
    root = output[output.index("Root Cause") :]
    print(f"\n[die-early] torchrun exit {rc} {took:.1f} s after rank 1 exited")
    assert rc != 0
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: 3", root), root


def data_order(tmp_path, tiny, plant):
    folder = tmp_path / ("planted" if plant else "as-written")
    env = {"COURSE_DATA_ORDER": str(folder), **({"COURSE_PLANT": plant} if plant else {})}
    result = run(
        warm(
            1,
            DDP,
            "--epochs",
            "3",
            "--max-steps",
            "1",
            "--num-threads",
            "1",
            "--data-dir",
            tiny,
            "--log-dir",
            folder / "log",
        ),
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["first"] for line in (folder / "rank0.jsonl").read_text().splitlines()]


def test_a_forgotten_set_epoch_repeats_the_data_order_every_epoch(tmp_path, tiny):
    """No hang, no error: the data-order check (each epoch's first samples of a rank) shows it."""
    as_written = data_order(tmp_path, tiny, None)
    forgotten = data_order(tmp_path, tiny, "no-set-epoch")
    print(f"\n[set_epoch] as written: {as_written}\n[set_epoch] forgotten:  {forgotten}")
    assert len(as_written) == len(forgotten) == 3
    assert len({tuple(x) for x in as_written}) == 3  # a new order each epoch
    assert len({tuple(x) for x in forgotten}) == 1  # the same order every epoch
