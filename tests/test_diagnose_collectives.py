"""diagnose/collectives.py: nccl-tests' bandwidths, the ring model fitted to gloo's all-reduce, and
its prediction of DDP's gradient all-reduce checked against a measured one in the same run."""

import json
import sys

import pytest

from support import ROOT, check, error_lines, mpiexec, run, torchrun

sys.path.append(str(ROOT / "diagnose"))
import collectives

TOOL = "diagnose/collectives.py"


@pytest.mark.serial  # a ratio of times: measured alone on the machine
def test_two_ranks_measure_fit_and_predict_ddps_all_reduce_within_30_percent(tmp_path):
    check(
        run(
            torchrun(
                2,
                TOOL,
                "--ops",
                "all_reduce",
                "all_gather",
                "--min-size",
                "16K",
                "--max-size",
                "16M",
                "--repeats",
                "5",
                "--out",
                tmp_path,
            ),
            timeout=300,
        )
    )
    result = json.loads((tmp_path / "collectives.json").read_text())
    assert (tmp_path / "collectives.png").stat().st_size > 10_000
    assert result["world_size"] == 2
    for row in result["rows"]:  # nccl-tests: algbw = S/t; busbw = algbw x 2(n-1)/n or (n-1)/n
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        factor = 1.0 if row["op"] == "all_reduce" else 0.5
        assert row["busbw_GBps"] == pytest.approx(factor * row["algbw_GBps"])
    sizes = [r["bytes"] for r in result["rows"] if r["op"] == "all_reduce"]
    assert sizes == [16 * 2**10 * 4**k for k in range(6)]
    fit = result["fit"]
    assert fit["ddp_gradient_bytes"] == 1_199_882 * 4  # the CNN's parameters, float32
    assert fit["alpha_s"] > 0 and fit["beta_Bps"] > 0
    # DDP rebuilds its buckets in the order the gradients become ready: fc2 and fc1 fill the first
    # (1 MB cap, closed once passed), the convolutions the second
    assert fit["ddp_buckets"] == [
        (10 + 1280 + 128 + 9216 * 128) * 4,
        (64 + 64 * 32 * 9 + 32 + 32 * 9) * 4,
    ]
    assert fit["predicted_s"] == pytest.approx(fit["measured_s"], rel=0.30), fit


def test_horovod_over_mpi_measures_the_same_quantities_and_repeats_its_names(tmp_path):
    result = check(
        run(
            mpiexec(
                2,
                TOOL,
                "--library",
                "horovod",
                "--ops",
                "all_reduce",
                "broadcast",
                "--min-size",
                "64K",
                "--max-size",
                "4M",
                "--repeats",
                "2",
                "--out",
                tmp_path,
            ),
            timeout=300,
        )
    )
    # one name per op and size, as in training: Horovod's response cache is hit, never overflows
    assert "evicted from cache" not in result.stderr, result.stderr[-2000:]
    data = json.loads((tmp_path / "collectives-horovod-mpi-2.json").read_text())
    assert data["library"] == "horovod-mpi" and data["world_size"] == 2
    assert {(r["op"], r["bytes"]) for r in data["rows"]} == {
        (op, 64 * 2**10 * 4**k) for op in ("all_reduce", "broadcast") for k in range(4)
    }
    assert all(r["time_s"] > 0 for r in data["rows"])
    assert data["fit"]["ddp_buckets"] == [1_199_882 * 4]  # Horovod fuses into one buffer


def test_the_ring_fit_recovers_a_known_alpha_and_beta():
    alpha, beta, n = 50e-6, 2e9, 4
    points = [
        (s, collectives.ring_time(s, n, alpha, beta)) for s in (2**10 * 4**k for k in range(9))
    ]
    assert collectives.fit_ring(points, n) == pytest.approx((alpha, beta), rel=1e-6)


def test_a_bad_size_is_one_error_line_on_every_rank():
    result = run(torchrun(2, TOOL, "--min-size", "2"), timeout=120)
    # torchrun stops the other rank as soon as one fails: it may end before printing its own line
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and 1 <= len(errors) <= 2, result.stderr
    assert all("--min-size" in e for e in errors), errors
