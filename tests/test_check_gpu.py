"""tools/check_gpu.py (make check-gpu) on a machine without a GPU: it says so, runs the CPU path of
the lessons it checks, reads their own files for its table, reports a failing lesson by its one
line and exits non-zero, and refuses a GPU that is not there."""
import json
import sys

import torch

from support import ROOT, check, error_lines, run

TOOL = ROOT / "tools" / "check_gpu.py"


def test_the_cpu_path_runs_and_its_table_is_read_from_the_runs(tmp_path):
    out = tmp_path / "check"
    result = check(run([sys.executable, TOOL, "--device", "cpu", "--steps", "6", "--out", out,
                        "--only", "ddp", "zero-fsdp2", "deepspeed-zero3", "profile"], timeout=400))
    assert "checking the CPU path" in result.stdout
    report = json.loads((out / "check-gpu.json").read_text())
    rows = {r["lesson"]: r for r in report["rows"]}
    assert set(rows) == {"ddp", "zero-fsdp2", "deepspeed-zero3", "profile-ddp"}
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert row["device"] == "cpu" and row["ranks"] == 1, row
        assert row["steps_per_s"] > 0 and row["peak_gpu_mb"] is None, row
        assert name in result.stdout
    assert rows["zero-fsdp2"]["backend"] == "gloo" and rows["deepspeed-zero3"]["backend"] == "gloo"
    # The steps/s come from the lesson's own files: 6 steps over its recorded training time.
    ddp_summary = json.loads((out / "ddp-1" / "summary.json").read_text())
    assert abs(rows["ddp"]["steps_per_s"] - round(6 / ddp_summary["train_time_s"], 2)) < 0.011
    # The profile row is a real trace: CPU events only on a CPU
    trace = json.loads((out / "profile-ddp-1" / "rank0.trace.json").read_text())
    assert len(trace["traceEvents"]) > 100 and rows["profile-ddp"]["gpu_events"] == 0


def test_a_failing_lesson_is_its_one_line_and_a_non_zero_exit(tmp_path):
    result = run([sys.executable, TOOL, "--device", "cpu", "--steps", "5", "--out", tmp_path,
                  "--only", "ddp", "--data-dir", tmp_path / "no-such-folder"], timeout=200)
    assert result.returncode == 1, result.stdout + result.stderr
    row = json.loads((tmp_path / "check-gpu.json").read_text())["rows"][0]
    assert row["status"] == "failed" and row["line"].startswith("main.py: error: --data-dir"), row
    assert "no-such-folder" in row["line"]
    assert error_lines(result.stderr) == ["error: check-gpu: failed: ddp"]


def test_a_gpu_that_is_not_there_is_refused():
    absent = "cuda" if not torch.cuda.is_available() else "xpu"
    result = run([sys.executable, TOOL, "--device", absent], timeout=60)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [line for line in result.stderr.splitlines() if line.strip()]
    assert f"--device {absent}" in result.stderr
