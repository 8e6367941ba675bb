"""diagnose/profile_ranks.py: one valid Chrome trace per rank of an unchanged lesson, a per-rank
split of the step into compute, communication and waiting, and a straggler injected from outside
that shows up as the *other* rank waiting."""

import json
import sys

import pytest

from support import ROOT, check, error_lines, run
from utils.tools.launch import launch_command

sys.path.append(str(ROOT / "diagnose"))
import trace_summary

PROFILE = ROOT / "diagnose" / "profile_ranks.py"
SHORT = ["--epochs", "1", "--max-steps", "14", "--log-interval", "100"]


def profiled(tmp_path, name, *flags):
    """torchrun, 2 ranks, DDP/main.py profiled; the tool's flags go before the lesson's path."""
    cmd = launch_command(
        "ddp", 2, "torchrun", [*SHORT, "--log-dir", tmp_path / f"{name}-run"], wrapper=PROFILE
    )
    at = cmd.index(str(PROFILE)) + 1
    cmd[at:at] = ["--out", str(tmp_path / name), *map(str, flags)]
    check(run(cmd, timeout=300))
    result = run(
        [
            sys.executable,
            PROFILE,
            "summary",
            tmp_path / name,
            "--no-mfu",
            "--json",
            tmp_path / f"{name}.json",
        ],
        timeout=120,
    )
    check(result)
    return {
        row["rank"]: row for row in json.loads((tmp_path / f"{name}.json").read_text())["ranks"]
    }, result


def test_a_straggler_shows_up_as_the_other_rank_waiting(tmp_path):
    even, out = profiled(tmp_path, "even")
    slow, _ = profiled(tmp_path, "slow", "--slow-rank", "1", "--slow-ms", "150")
    for rank in (
        0,
        1,
    ):  # a trace per rank, in the Chrome format Perfetto opens, with the recorded steps
        trace = json.loads((tmp_path / "slow" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names) and "phase:backward" in names
    assert "wait %" in out.stdout and "rank" in out.stdout
    assert even[0]["steps"] >= 8 and slow[0]["steps"] >= 8
    # Rank 1 sleeps 150 ms a step: rank 0 waits for its gradients in backward, rank 1 hardly waits
    # at all.
    assert slow[0]["wait_fraction"] > even[0]["wait_fraction"] + 0.15
    assert slow[0]["wait_fraction"] > 2 * slow[1]["wait_fraction"]
    assert slow[0]["wait"] > 0.1  # most of the 150 ms
    # The ranks move together: both steps take about as long.
    assert slow[0]["step_median"] == pytest.approx(slow[1]["step_median"], rel=0.25)


def test_the_split_of_a_step_adds_up_on_a_known_trace():
    """A hand-made trace: a 100 us step with 30 us of operators, 10 us in an all-reduce call, and 40
    us idle inside backward (waiting), 20 us of Python outside any phase; a gloo thread busy for 50
    us."""
    def x(name, ts, dur, tid=1, cat="cpu_op"):
        return dict(ph="X", name=name, ts=ts, dur=dur, tid=tid, cat=cat)

    events = [
        x("ProfilerStep#3", 0, 100, cat="user_annotation"),
        x("phase:forward", 0, 20, cat="user_annotation"),
        x("aten::conv2d", 0, 20),
        x("phase:backward", 40, 60, cat="user_annotation"),
        x("aten::convolution_backward", 40, 10),
        x("c10d::allreduce_", 50, 10),
        x("gloo:all_reduce", 50, 50, tid=2, cat="user_annotation"),
        x("ProfilerStep#4", 100, 50, cat="user_annotation"),
    ]  # evaluation: no backward, dropped
    (row,) = trace_summary.split_steps({"traceEvents": events})
    assert row == pytest.approx(
        dict(step=100e-6, compute=30e-6, comm=10e-6, wait=40e-6, other=20e-6, overlap=50e-6)
    )


def test_mfu_counts_the_cnns_flops():
    """The CNN's forward + backward, counted by torch.utils.flop_counter: its two convolutions and
    two linear layers, forward once and backward twice (input and weight gradients; the first conv's
    input needs none). Counted in a process of its own, as the tool does: the flop counter imports
    triton, whose native library crashed the whole test session (segfault) when loaded into it."""
    conv1 = 2 * 26 * 26 * 32 * 1 * 3 * 3
    conv2 = 2 * 24 * 24 * 64 * 32 * 3 * 3
    fc1, fc2 = 2 * 9216 * 128, 2 * 128 * 10
    expected = conv1 + conv2 + fc1 + fc2 + (conv1 + 2 * conv2 + 2 * fc1 + 2 * fc2)
    code = ("import sys; sys.path += sys.argv[1:]; import trace_summary; "
            "print(trace_summary.flops_per_sample(4))")
    result = check(run([sys.executable, "-c", code, ROOT / "diagnose", ROOT], timeout=120))
    assert float(result.stdout.split()[-1]) == pytest.approx(expected, rel=1e-6)


def test_a_bad_flag_is_one_error_line(tmp_path):
    cmd = [sys.executable, PROFILE, "--slow-ms", "5", "DDP/main.py"]
    result = run(cmd, timeout=60)
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1, result.stderr
