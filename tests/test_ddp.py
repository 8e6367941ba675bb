"""DDP/main.py on the shipped MNIST digits: its 2-rank run under torchrun (and its copy under mpiexec, in
tests/test_lift_out.py), every rank's refusal under torchrun; the rest with ranks started warm (tests/README.md)."""
import pytest
import torch

from support import (
    DDP,
    QUICK,
    assert_each_rank_refused,
    check,
    error_lines,
    metrics,
    run,
    run_rows,
    summary,
    torchrun,
    warm,
)

SCRIPT = DDP


@pytest.fixture(scope="module")
def quick_run(shared_run):
    """The 2-rank QUICK run under a launcher, made once: the test that checks it, the resume test that compares
    against it and tests/test_lift_out.py read the same files."""
    return lambda launcher: shared_run(SCRIPT, launcher.__name__, QUICK)[0]


def test_two_ranks_train_and_stay_identical(quick_run):
    """(Under mpiexec: tests/test_lift_out.py's copy of the lesson, which ends as this run, digit for digit.)"""
    log_dir = quick_run(torchrun)
    history = metrics(log_dir)
    assert [m["epoch"] for m in history] == [1, 2]
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert all(m["world_size"] == 2 for m in history)
    assert history[0]["launcher"] == "torchrun"
    checksums = summary(log_dir)["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums


def test_two_ranks_equal_one_process_on_the_combined_batch(tmp_path):
    """Gradients are averaged, not summed or dropped: 2 x batch 32 == 1 x batch 64 (same data order)."""
    same = ["--epochs", "1", "--max-steps", "6", "--no-lr-scaling", "--dropout", "0", "--lr", "0.05",
            "--save-model"]
    check(run(warm(2, SCRIPT, *same, "--batch-size", "32", "--log-dir", tmp_path / "two"), timeout=240))
    check(run(warm(1, SCRIPT, *same, "--batch-size", "64", "--log-dir", tmp_path / "one"), timeout=240))
    two = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    moved = 0.0
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)
        moved = max(moved, (one[name] - two[name]).abs().max().item())
    # ...and the comparison is not vacuous: summed gradients (2x lr) would differ by far more.
    check(run(warm(1, SCRIPT, *same, "--batch-size", "64", "--lr", "0.1", "--log-dir", tmp_path / "double"),
              timeout=240))
    double = torch.load(tmp_path / "double" / "model.pt", weights_only=True)
    assert max((double[n] - one[n]).abs().max().item() for n in one) > 1e-3


def test_reaches_90_percent_on_real_digits(tmp_path):
    check(run(warm(2, SCRIPT, "--epochs", "2", "--log-dir", tmp_path), timeout=300))
    assert metrics(tmp_path)[-1]["test_acc"] >= 0.90


def test_resume_matches_an_uninterrupted_run(tmp_path, quick_run):
    """Epoch 1, then --resume to epoch 2, ends where the 2-epoch QUICK run ended."""
    straight = quick_run(torchrun)
    check(run(warm(2, SCRIPT, *QUICK, "--epochs", "1", "--log-dir", tmp_path), timeout=240))
    check(run(warm(2, SCRIPT, *QUICK, "--resume", "--log-dir", tmp_path), timeout=240))
    assert summary(tmp_path)["param_checksums"] == summary(straight)["param_checksums"]
    straight, split = metrics(straight), metrics(tmp_path)
    assert [m["epoch"] for m in split] == [1, 2]
    for a, b in zip(straight, split):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-12)
        assert a["test_acc"] == b["test_acc"]


BAD_INPUT = [
    (["--batch-size", "0"], "--batch-size"),
    (["--lr", "-1"], "--lr"),
    (["--data-dir", "/no/such/dir"], "/no/such/dir"),
    (["--epochs", "two"], "--epochs"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--epoch", "1"], "--epoch 1"),  # an abbreviation of --epochs is refused, not taken for it
]


def test_bad_input_is_one_line_and_non_zero(tmp_path):
    """Each row is one command line, all run in one interpreter (run_rows): each is refused before training."""
    outcomes = run_rows(SCRIPT, [[*flags, "--log-dir", str(tmp_path / "log")] for flags, _ in BAD_INPUT])
    for (flags, words), outcome in zip(BAD_INPUT, outcomes):
        assert outcome["code"] not in (0, None, "finished"), (flags, outcome)
        errors = error_lines(outcome["stderr"])
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"])
        # one line, not the usage block
        assert "Traceback" not in outcome["stderr"] and "usage:" not in outcome["stderr"], (flags, outcome)


def test_bad_input_fails_every_rank_under_torchrun(tmp_path):
    result = run(torchrun(2, SCRIPT, "--batch-size", "0", "--log-dir", tmp_path), timeout=120)
    assert result.returncode != 0
    assert_each_rank_refused(result, "--batch-size", 2, "torchrun")  # one line from each rank it let run


def test_missing_mnist_in_data_dir_is_reported(tmp_path):
    result = run(warm(1, SCRIPT, "--data-dir", tmp_path, "--log-dir", tmp_path / "log"), timeout=120)
    assert result.returncode != 0
    assert error_lines(result.stderr) == [f"error: no MNIST in {tmp_path} (MNIST/raw/"
                                          "train-images-idx3-ubyte[.gz] etc., or mnist.npz): add --download, "
                                          "or leave out --data-dir (the shipped digits)"]


def test_resume_auto_on_a_finished_run_leaves_it_alone(tmp_path):
    quick = ["--epochs", "1", "--max-steps", "3", "--log-dir", tmp_path]
    check(run(warm(2, SCRIPT, *quick), timeout=240))
    before = {name: (tmp_path / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "config.json")}
    again = check(run(warm(2, SCRIPT, *quick, "--resume", "auto"), timeout=240))
    assert again.stdout.count("nothing left to do") == 1, again.stdout  # said once (rank 0), exit 0
    assert "epoch  1" not in again.stdout  # no training
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_the_warmup_ramps_the_lr_from_one_ranks_to_the_scaled_one(tmp_path):
    """--lr-warmup-epochs 2 with --grad-accum 2 (scaled LR = 2 x --lr): the LR of each epoch's last step
    (4 steps an epoch) is on the line from --lr to 2 x --lr, then stays there."""
    flags = ["--epochs", "3", "--max-steps", "4", "--grad-accum", "2", "--lr-warmup-epochs", "2", "--lr", "0.04",
             "--num-threads", "1", "--log-dir", tmp_path]
    check(run(warm(1, SCRIPT, *flags), timeout=240))
    lrs = [m["lr"] for m in metrics(tmp_path)]
    assert lrs == pytest.approx([0.04 * (1 + 0.75 / 2), 0.04 * (1 + 1.75 / 2), 0.08], rel=1e-12), lrs
    assert lrs[2] == 0.04 * 2  # past the warmup: the scaled LR itself
