"""TensorBoard by default: every training lesson's run leaves event files in its --log-dir holding
each epoch's scalars and the logged steps' losses, read back here with the tensorboard package's own
reader (beside TensorFlow, and without it: support.event_scalars); and COURSE_TENSORBOARD=0 leaves none."""

import os
import signal
import subprocess
import sys

import pytest

from support import DDP, GPT_SPLIT, HVD_TF, PP, QUICK, ROOT, check, event_scalars, kill_tree, metrics, run, warm

EPOCH_TAGS = {
    "epoch/train_loss",
    "epoch/train_acc",
    "epoch/test_loss",
    "epoch/test_acc",
    "epoch/lr",
    "epoch/samples_per_s",
}
# The writer is RunLog's, shared by every lesson: these three cover its kinds (a PyTorch rank 0, a TensorFlow
# rank 0, and the transformer's pipeline, whose step losses come from the last stage). Each is the 2-rank run its
# lesson's tests and the lift-out test read too (conftest.py's shared_run); the other lessons' own tests check
# their event files on their runs (support.assert_event_epochs).
LESSONS = [(DDP, "torchrun", QUICK), (HVD_TF, "horovodrun", [*QUICK, "--dropout", "0"]), (PP, "torchrun", GPT_SPLIT)]


@pytest.mark.parametrize("script,launcher,flags", LESSONS, ids=["ddp", "horovod-tensorflow", "transformer-pp"])
def test_every_epoch_is_in_the_event_files(shared_run, script, launcher, flags):
    log_dir, _ = shared_run(script, launcher, flags)
    files, found = event_scalars(log_dir, tensorflow=True)  # TensorBoard's reader as it runs beside TensorFlow
    assert files, f"{script}: no event file in {log_dir}"
    assert event_scalars(log_dir) == (files, found)  # and without it (support.event_scalars: the other tests')
    assert EPOCH_TAGS <= set(found), sorted(found)
    for m in metrics(log_dir):  # the same numbers as metrics.jsonl, epoch by epoch
        for key in ("train_loss", "test_acc", "lr", "samples_per_s"):
            assert found[f"epoch/{key}"][m["epoch"]] == pytest.approx(m[key], rel=1e-5), (key, m)
    assert sorted(found["epoch/train_loss"]) == [1, 2]
    # --log-interval 4 of 8 steps, over 2 epochs: global steps 4, 8, 12, 16
    assert sorted(found["step/train_loss"]) == [4, 8, 12, 16]


def test_course_tensorboard_0_writes_no_event_files(tmp_path):
    check(
        run(
            warm(1, DDP, "--epochs", "1", "--max-steps", "2", "--log-dir", tmp_path),
            env={"COURSE_TENSORBOARD": "0"},
            timeout=240,
        )
    )
    assert metrics(tmp_path) and not list(tmp_path.glob("events.out.tfevents.*"))


def test_writing_events_does_not_load_tensorflow(tmp_path):
    """The writer frames tensorboard's Event protobuf itself: tensorboard's own event writer imports
    TensorFlow where it is installed, which every PyTorch lesson would then pay for."""
    code = (
        "import sys; sys.path.append(sys.argv[1]); from course.board import Board; "
        "Board.open(sys.argv[2], True); "
        "Board.step(1, 0.5); Board.close(); print('tensorflow' in sys.modules)"
    )
    result = check(run([sys.executable, "-c", code, ROOT, tmp_path], timeout=120))
    assert result.stdout.strip() == "False"
    files, found = event_scalars(tmp_path)  # and TensorBoard reads the record back, checksums and all
    assert found == {"step/train_loss": {1: 0.5}}


def test_a_printed_line_is_already_in_an_event_file(tmp_path):
    """What a reader sees printed is recorded: the first logged step's line appears only once its event
    file exists, and the epoch's line once its scalars are in it, so a run stopped right after a line (Ctrl-C
    on seeing it) keeps what it said (tests/test_failures_interrupts.py stops a run at the first step line)."""
    cmd = [sys.executable, DDP, "--epochs", "1", "--max-steps", "4", "--log-interval", "2", "--num-threads", "1",
           "--log-dir", tmp_path]
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    at_step = at_epoch = None
    try:
        for line in proc.stdout:  # (the run's 4 steps take seconds; the suite's timeout bounds a hang)
            if line.startswith("epoch 1 step 2/") and at_step is None:
                at_step = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
            elif line.startswith("epoch  1  train_loss"):
                os.killpg(proc.pid, signal.SIGSTOP)  # held at the line while the files are read
                at_epoch = event_scalars(tmp_path)[1]
                os.killpg(proc.pid, signal.SIGCONT)
                break
        rest = proc.stdout.read()
        assert proc.wait(timeout=240) == 0, rest[-3000:]
    finally:
        kill_tree(proc)
    assert at_step, "no event file yet when the first step line was printed"
    assert at_epoch is not None and 1 in at_epoch.get("epoch/train_loss", {}), at_epoch
