"""transformer/: the chapter's GPT on bytes of real text (Python's standard library sources), under its
real launchers: N ranks train as one process on the combined batch, the loss falls, bad input is one line."""
import json
import math

import pytest
import torch

from support import GPT_DDP, GPT_QUICK, GPT_SMALL, LONG, check, metrics, mpiexec, python, run, summary

SCRIPT, SMALL = GPT_DDP, GPT_SMALL


def test_two_ranks_equal_one_process_on_the_combined_batch(shared_run, tmp_path):
    """DDP averages the gradients of each rank's own sequences: 2 ranks x 4 sequences end with the weights of
    one process that takes all 8; and one rank's 4 alone would not. (The 2-rank run is shared with
    tests/test_lift_out.py, whose copy of the lesson must end the same.)"""
    two_dir, _ = shared_run(SCRIPT, "torchrun", GPT_QUICK)
    same = GPT_QUICK[:-2]  # (all but --batch-size 4)
    check(run(python(SCRIPT, *same, "--batch-size", "8", "--log-dir", tmp_path / "one"), timeout=240))
    two = torch.load(two_dir / "model.pt", weights_only=True)
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=2e-5, msg=name)
    history = metrics(two_dir)
    assert [m["world_size"] for m in history] == [2, 2] and history[1]["test_loss"] < history[0]["test_loss"]
    for a, b in zip(history, metrics(tmp_path / "one")):  # the same losses, epoch by epoch
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-5), (a, b)
        assert math.isclose(a["test_loss"], b["test_loss"], rel_tol=1e-5), (a, b)
    checksums = summary(two_dir)["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums  # the ranks agree
    check(run(python(SCRIPT, *same, "--batch-size", "4", "--log-dir", tmp_path / "half"), timeout=240))
    half = torch.load(tmp_path / "half" / "model.pt", weights_only=True)
    assert max((half[n] - one[n]).abs().max().item() for n in one) > 1e-3  # (not vacuous)


def test_under_mpiexec_it_reports_tokens_per_second_and_mfu(tmp_path):
    """The baseline's numbers: tokens/s per rank, FLOPs per token counted by torch's FlopCounterMode
    (6 x parameters per token, give or take attention and the embeddings), MFU in (0, 1]."""
    out = check(run(mpiexec(2, SCRIPT, *SMALL, "--max-steps", "3", "--batch-size", "4",
                            "--log-dir", tmp_path), timeout=240)).stdout
    s = summary(tmp_path)
    assert s["launcher"] == "mpiexec" and s["world_size"] == 2
    # 6 per parameter and token, and attention's 12 x layers x width x context (2, 64, 32): counted, the CPU's
    # attention kernel included (transformer/model.py tells FlopCounterMode how), within 5%
    formula = 6 * s["parameters"] + 12 * 2 * 64 * 32
    assert abs(s["flops_per_token"] - formula) < 0.05 * formula, (s["flops_per_token"], formula)
    assert s["tokens_per_s_per_rank"] > 0 and 0 < s["mfu"] <= 1, s
    assert f"MFU {s['mfu']:.1%} of a measured" in out
    assert "Python's standard library sources" in out and "train /" in out


@pytest.mark.parametrize("flags, words", [
    (["--heads", "3"], "--heads 3 does not divide --width 128"),
    (["--momentum", "0.9"], "--momentum: the transformer trains with AdamW"),
    (["--context", "0"], "argument --context: must be a positive integer, got 0"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, words):
    result = run(python(SCRIPT, *flags), timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ddp.py: error: ") and words in line, line


def test_a_data_folder_without_the_text_is_one_line(tmp_path):
    result = run(python(SCRIPT, *SMALL, "--data-dir", tmp_path), timeout=120)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"no input.txt in {tmp_path}" in line and "--download" in line


@LONG
def test_one_process_learns_the_text_to_the_readme_threshold(tmp_path):
    """The README's run: the default model, 200 steps of 16 x 128 bytes, seeded: the test loss falls from
    ln 256 = 5.55 to under 2.45 nats per byte (2.313 on the README's machine)."""
    check(run(python(SCRIPT, "--log-dir", tmp_path), timeout=900))
    (m,) = metrics(tmp_path)
    assert m["test_loss"] < 2.45, m
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 200
