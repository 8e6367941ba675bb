"""diagnose/profile_ranks.py: one valid Chrome trace per rank of an unchanged lesson, a per-rank
split of the step into compute, communication and waiting, and a straggler injected from outside
that shows up as the *other* rank waiting."""

import json
import re
import sys

import pytest

from support import DDP, GPT_SMALL, ROOT, TP, check, error_lines, run, warm
from tools.launch import launch_command

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
    profiling = check(run(cmd, timeout=300))
    # torch.profiler's C++ lines (kineto's USDT start/stop; gpuGetDeviceCount on a machine without a GPU): not shown
    assert not re.search(r"^(USDT|ERROR):.*\.cpp:\d+\]", profiling.stdout + profiling.stderr, re.M), profiling.stderr
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


@pytest.mark.serial  # a ratio of times: measured alone on the machine
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
    triton, which crashes a process that holds TensorFlow too (see conftest.py)."""
    conv1 = 2 * 26 * 26 * 32 * 1 * 3 * 3
    conv2 = 2 * 24 * 24 * 64 * 32 * 3 * 3
    fc1, fc2 = 2 * 9216 * 128, 2 * 128 * 10
    expected = conv1 + conv2 + fc1 + fc2 + (conv1 + 2 * conv2 + 2 * fc1 + 2 * fc2)
    code = ("import sys; sys.path += sys.argv[1:]; import trace_summary; "
            "print(trace_summary.flops_per_sample(4))")
    result = check(run([sys.executable, "-c", code, ROOT / "diagnose", ROOT], timeout=120))
    assert float(result.stdout.split()[-1]) == pytest.approx(expected, rel=1e-6)


def test_a_bad_flag_is_one_error_line(tmp_path):
    cmd = [sys.executable, PROFILE, "--slow-ms", "5", DDP]
    result = run(cmd, timeout=60)
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1, result.stderr


def test_each_collective_of_a_step_is_measured_by_its_last_rank_and_predicted_by_the_ring_fit():
    """Hand-made traces of 2 ranks and 2 training steps: an all_reduce of 1,000 floats per step (rank
    0 arrives first and waits), an all_gather of 10 floats per rank once, a send per step."""
    def x(name, ts, dur, tid=1, **args):
        return dict(ph="X", name=name, ts=ts, dur=dur, tid=tid, cat="cpu_op", args=args)

    def trace(spans, sends):
        events = []
        for step, start in enumerate((0, 1000)):
            events += [x(f"ProfilerStep#{step}", start, 1000), x("phase:backward", start, 500),
                       x("gloo:all_reduce", start + 100, spans[step], tid=2, **{
                           "Input Dims": [[1000]], "Input type": ["float"]}),
                       x("gloo:send", start + 600, sends, tid=2, **{"Input Dims": [[8]], "Input type": ["float"]})]
        events.append(x("gloo:all_gather", 200, 50, tid=2, **{"Input Dims": [[10]], "Input type": ["float"]}))
        return {"traceEvents": events}

    per_rank = {0: trace_summary.collective_calls(trace([400, 300], 70), 2),
                1: trace_summary.collective_calls(trace([100, 200], 90), 2)}
    fit = dict(alpha_s=1e-4, beta_Bps=1e7, source="test")
    rows = {(r["op"], r["bytes"]): r for r in trace_summary.collectives_table(per_rank, 2, fit)}
    assert set(rows) == {("all_reduce", 4000), ("all_gather", 80), ("send", 32)}  # S = both ranks' parts
    reduce = rows[("all_reduce", 4000)]
    assert reduce["calls_per_step"] == 1.0 and rows[("all_gather", 80)]["calls_per_step"] == 0.5
    assert reduce["measured_s"] == pytest.approx(150e-6)  # min(400, 100) and min(300, 200): median 150
    assert reduce["rank_median_s"] == pytest.approx({0: 350e-6, 1: 150e-6})
    assert reduce["predicted_s"] == pytest.approx(2 * 1e-4 + 4000 / 1e7)  # 2(N-1) alpha + 2(N-1)/N S/beta
    assert "measured_s" not in rows[("send", 32)]  # one rank's call: its span holds its wait


def test_the_tensor_parallel_lessons_collectives_are_the_ones_it_counts_itself(tmp_path):
    """Profiled from outside, transformer/tp.py's step holds the collectives its own counter writes into
    summary.json: per block and step the all-gathers of the sequence's halves (S: both ranks' parts), the
    reduce-scatters of the row-parallel outputs (gloo runs each as an all-reduce of the whole tensor, as ZeRO-3's
    row below shows), and the all-reduces of the norms' gradients."""
    check(run(warm(2, PROFILE, "--out", tmp_path / "trace", ROOT / TP, *GPT_SMALL, *SHORT, "--batch-size", "4",
                   "--log-dir", tmp_path / "run"), timeout=300))
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"fit": {"alpha_s": 1e-3, "beta_Bps": 1e9}}))
    result = check(run([sys.executable, PROFILE, "summary", tmp_path / "trace", "--no-mfu", "--fit", fit,
                        "--json", tmp_path / "summary.json"], timeout=120))
    assert "collectives per training step against the ring fit" in result.stdout
    rows = {(r["op"], r["bytes"]): r for r in json.loads((tmp_path / "summary.json").read_text())["collectives"]}
    counted = json.loads((tmp_path / "run" / "summary.json").read_text())["wire_counted"]
    each = {name.split(".")[-1]: (c["calls"], c["bytes"] // c["calls"]) for name, c in counted.items()}
    gather_calls, gather_bytes = each["all_gather_into_tensor"]  # one rank's part
    scatter_calls, scatter_bytes = each["reduce_scatter_tensor"]
    reduce_calls, reduce_bytes = each["all_reduce"]
    assert set(rows) == {("all_gather", 2 * gather_bytes), ("all_reduce", scatter_bytes),
                         ("all_reduce", reduce_bytes)}, sorted(rows)
    # 2 blocks: 4 all-gathers a block and 2 at the edges; 4 reduce-scatters a block
    assert rows[("all_gather", 2 * gather_bytes)]["calls_per_step"] == gather_calls == 4 * 2 + 2
    assert rows[("all_reduce", scatter_bytes)]["calls_per_step"] == scatter_calls == 4 * 2
    assert rows[("all_reduce", reduce_bytes)]["calls_per_step"] == reduce_calls
    assert rows[("all_gather", 2 * gather_bytes)]["predicted_s"] == pytest.approx(1e-3 + gather_bytes / 1e9)
    assert all(0 < r["measured_s"] < 10 for r in rows.values())  # real durations, from both ranks' traces
