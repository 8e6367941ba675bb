"""A loss that turns NaN or infinite stops the run in one line (the rank, the step, the checkpoint on disk) before
the epoch's checkpoint is written: a good checkpoint is never replaced by a worse one (course/watch.py).
--lr 1e30 makes every lesson's loss overflow within a few steps (Adam's too), through the real training code."""
import re
import shutil

import pytest

from support import (
    DDP,
    DS,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    PP,
    QUICK,
    TP,
    assert_log_dir_sound,
    error_lines,
    metrics,
    run,
    warm,
)

EXPLODES = ["--lr", "1e30"]
# Keras' loss grows without overflowing at 1e30 (weights of 1e30 still give finite logits in float32)
EXPLODES_BY_SCRIPT = {HVD_KERAS: ["--lr", "1e38"]}


def test_a_resumed_run_whose_loss_turns_nan_keeps_the_good_checkpoint_on_every_rank(shared_run, tmp_path):
    good, _ = shared_run(DDP, "torchrun", QUICK)  # 2 epochs, a checkpoint of epoch 2
    shutil.copytree(good, tmp_path / "run")
    before = {p.relative_to(tmp_path / "run"): p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()
              and "events" not in p.name and p.name != "config.json"}  # (the resumed run's flags: its own)
    result = run(warm(2, DDP, *QUICK, "--epochs", "3", *EXPLODES, "--resume", "--log-dir", tmp_path / "run"),
                 timeout=180)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all("Traceback" not in line for line in errors), result.stderr[-3000:]
    said = [line for line in errors if re.search(r"stopped: the (training|test) loss is (nan|inf)", line)]
    assert said, errors  # (a rank that got there first may leave the other one a lost peer to report)
    assert "epoch 3" in said[0] and "before the epoch's checkpoint; the checkpoint is left as it was" in said[0]
    assert f"{tmp_path / 'run' / 'checkpoints'} (epoch 2)" in said[0], said[0]
    assert_log_dir_sound(tmp_path / "run", before)  # checkpoint.pt, SHA256SUMS and metrics.jsonl as they were
    assert [m["epoch"] for m in metrics(tmp_path / "run")] == [1, 2]


@pytest.mark.parametrize("script", [HVD_TORCH, HVD_TF, HVD_KERAS, DS, TP, PP])
def test_every_lesson_stops_at_a_non_finite_loss_before_any_checkpoint(tmp_path, script):
    result = run(warm(1, script, "--epochs", "2", "--max-steps", "8", "--num-threads", "1",
                       *EXPLODES_BY_SCRIPT.get(script, EXPLODES), "--log-dir", tmp_path / "run"), timeout=180)
    errors = error_lines(result.stderr)
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert re.search(r"rank 0 stopped: the (training|test) loss is (nan|inf)", errors[0]), errors[0]
    assert "no checkpoint was written" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    # it trained before the loss turned: the folder stays, with the line it ended with
    (ended,) = (tmp_path / "run" / "ending.txt").read_text().splitlines()
    assert "rank 0, exit 1: error: " + errors[0][len("error: "):] in ended, ended
    print(f"\n[{script}] {errors[0]}")
