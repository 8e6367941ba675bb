"""What a new attendee meets first: a missing framework, more ranks than cores, an emulated world."""
import os
import sys

import pytest

from support import DDP, DS, HVD_KERAS, HVD_TF, HVD_TORCH, check, run, warm

LESSONS = [DDP, HVD_TORCH, HVD_TF, HVD_KERAS, DS]


@pytest.mark.parametrize("script", LESSONS)
def test_a_missing_framework_is_one_line_that_says_how_to_get_it(script):
    # python -S: no site-packages, as with a Python outside the course's environment
    result = run([sys.executable, "-S", script], timeout=60)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: No module named"), result.stderr
    assert "make setup" in lines[0] and ".venv" in lines[0]


def test_more_ranks_than_cores_is_one_warning(tmp_path):
    cores = len(os.sched_getaffinity(0))
    result = check(run(warm(cores + 1, DDP, "--epochs", "1", "--max-steps", "2",
                                "--log-dir", tmp_path), timeout=300))
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {cores + 1} ranks on the {cores} core(s) of this node: ranks share cores, "
                        "so steps are slower than with one rank per core"], result.stderr[-2000:]


@pytest.mark.parametrize("script", [DDP, HVD_TORCH])
def test_gradient_accumulation_says_which_world_it_emulates(tmp_path, script):
    result = check(run(warm(2, script, "--grad-accum", "2", "--epochs", "1", "--max-steps", "2",
                            "--log-dir", tmp_path) if script == DDP else
                       warm(1, script, "--grad-accum", "3", "--epochs", "1", "--max-steps", "2",
                            "--log-dir", tmp_path), timeout=300))
    expected = "an emulated world of 4" if script == DDP else "an emulated world of 3"
    assert result.stdout.count(expected) == 1, result.stdout[-2000:]
