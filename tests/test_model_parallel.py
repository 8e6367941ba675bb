"""model_parallel/: tensor- and pipeline-parallel training under torchrun, each compared with one process doing
the same arithmetic on the unsplit model (the lessons' own --save-model files: the gathered full weights)."""
import pytest
import torch

from support import (
    PP,
    RANK_0_OF_2,
    TP,
    assert_each_rank_refused,
    assert_event_epochs,
    check,
    error_lines,
    metrics,
    python,
    run,
    run_rows,
    summary,
    torchrun,
)

# Small and short: 2 epochs x 3 steps, a 256-wide MLP, one thread per process.
SAME = ["--epochs", "2", "--max-steps", "3", "--width", "256", "--num-threads", "1", "--save-model"]


def weights(log_dir):
    return torch.load(log_dir / "model.pt", weights_only=True)


def assert_same_run(a, b, atol=1e-5):
    """Equal losses (every epoch, train and test) and equal final weights, within atol."""
    for ma, mb in zip(metrics(a), metrics(b), strict=True):
        for key in ("train_loss", "test_loss"):
            assert ma[key] == pytest.approx(mb[key], abs=atol), (key, ma, mb)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=atol, msg=name)


def test_tensor_parallel_equals_one_process(tmp_path):
    check(run(torchrun(2, TP, *SAME, "--log-dir", tmp_path / "tp"), timeout=240))
    check(run(python(TP, *SAME, "--log-dir", tmp_path / "one"), timeout=240))
    assert_same_run(tmp_path / "tp", tmp_path / "one")
    s = summary(tmp_path / "tp")
    assert metrics(tmp_path / "tp")[1]["train_loss"] < metrics(tmp_path / "tp")[0]["train_loss"]
    # Each rank holds half of every split layer, and really different halves.
    split = s["split_param_numel"]
    assert split["full"] == 784 * 256 + 3 * 256 * 256 + 2 * 256  # fc1-fc4 weights, fc1/fc3 biases
    assert split["per_rank"] == [split["full"] // 2] * 2
    assert all(b < s["param_bytes_full_model"] * 0.6 for b in s["param_bytes_per_rank"])
    assert s["param_checksums"][0] != s["param_checksums"][1]
    # Per step: fc2 and fc4 all-reduce [32, 256] outputs in forward, fc3 its input gradient in backward.
    assert s["wire_bytes_per_step"] == {"_c10d_functional.all_reduce": {"calls": 3, "bytes": 3 * 32 * 256 * 4}}


def test_two_by_two_equals_one_process_on_the_combined_batch(tmp_path):
    """--dp 2 on 4 ranks: two model copies, each split over 2 ranks, gradients averaged over the copies."""
    flags = [*SAME, "--no-lr-scaling"]
    check(run(torchrun(4, TP, *flags, "--dp", "2", "--batch-size", "16", "--log-dir", tmp_path / "2x2"),
              timeout=300))
    check(run(python(TP, *flags, "--batch-size", "32", "--log-dir", tmp_path / "one"), timeout=240))
    assert_same_run(tmp_path / "2x2", tmp_path / "one")
    s = summary(tmp_path / "2x2")
    assert (s["dp"], s["tp"]) == (2, 2)
    a, b, c, d = s["param_checksums"]  # ranks 0, 1 hold one half, 2, 3 the same halves of the other copy
    assert a == c and b == d and a != b
    wire = s["wire_bytes_per_step"]
    assert wire["_c10d_functional.all_reduce"]["bytes"] == 3 * 16 * 256 * 4  # DTensor: this copy's activations
    assert wire["c10d.allreduce_"]["bytes"] == s["param_bytes_per_rank"][0]  # dist.all_reduce: the gradients


def test_pipeline_equals_gradient_accumulation_for_both_schedules(tmp_path):
    flags = [*SAME, "--micro-batches", "4"]
    for schedule in ("gpipe", "1f1b"):
        check(run(torchrun(2, PP, *flags, "--schedule", schedule, "--log-dir", tmp_path / schedule), timeout=240))
    check(run(python(PP, *flags, "--log-dir", tmp_path / "one"), timeout=240))
    assert_same_run(tmp_path / "gpipe", tmp_path / "one")
    assert_same_run(tmp_path / "1f1b", tmp_path / "one")
    assert_same_run(tmp_path / "gpipe", tmp_path / "1f1b")
    gpipe, one_f_one_b = summary(tmp_path / "gpipe"), summary(tmp_path / "1f1b")
    # GPipe keeps all 4 micro-batches' activations on each stage; 1F1B at most (stages - stage index).
    assert gpipe["pipeline"]["peak_micro_batches_in_flight"] == [4, 4]
    assert one_f_one_b["pipeline"]["peak_micro_batches_in_flight"] == [2, 1]
    # Per step each stage sends [8, 256] per micro-batch: activations forward (stage 0), gradients back (1).
    assert gpipe["wire_bytes_per_step"] == [{"c10d.send": {"calls": 4, "bytes": 4 * 8 * 256 * 4}}] * 2
    assert sum(gpipe["param_bytes_per_rank"]) == gpipe["param_bytes_full_model"]
    # ...and 1e-5 is tight: twice the LR (what summed instead of averaged micro-batch gradients would do)
    # moves the weights far more.
    check(run(python(PP, *flags, "--lr", "0.1", "--log-dir", tmp_path / "double"), timeout=240))
    one, double = weights(tmp_path / "one"), weights(tmp_path / "double")
    assert max((one[n] - double[n]).abs().max().item() for n in one) > 1e-3


@pytest.mark.parametrize("nproc,script,flags,words", [
    (3, TP, [], "3 tensor-parallel ranks do not divide the layer width 1024"),
    (3, PP, [], "4 hidden layers do not split into 3 equal stages"),
], ids=["tp-width", "pp-stages"])
def test_bad_sizes_fail_every_rank_in_one_line(tmp_path, nproc, script, flags, words):
    result = run(torchrun(nproc, script, *flags, "--log-dir", tmp_path), timeout=120)
    assert result.returncode != 0
    assert_each_rank_refused(result, words, nproc, "torchrun")
    assert "exitcode  : 2 " in result.stderr  # torchrun's report of the first rank to stop: our exit code
    assert not [line for line in result.stderr.splitlines() if "model_parallel/" in line and "File" in line]
    assert not (tmp_path / "config.json").exists()  # stopped before anything started


BAD_SIZES_AT_2 = {  # more sizes that do not split over 2 ranks: rank 0's refusal, all in one interpreter
    TP: [(["--dp", "3"], "--dp 3 does not divide the 2 rank(s)")],
    PP: [(["--micro-batches", "5"], "--micro-batches 5 does not divide --batch-size 32"),
         (["--micro-batches", "1"], "--schedule 1f1b needs at least one micro-batch per stage")],
}


@pytest.mark.parametrize("script", BAD_SIZES_AT_2)
def test_more_bad_sizes_are_refused_at_2_ranks(tmp_path, script):
    table = BAD_SIZES_AT_2[script]
    outcomes = run_rows(script, [[*flags, "--log-dir", str(tmp_path / "log")] for flags, _ in table],
                        env=RANK_0_OF_2)
    for (flags, words), outcome in zip(table, outcomes):
        assert outcome["code"] == 2, (flags, outcome)
        errors = error_lines(outcome["stderr"])
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"])
    assert not (tmp_path / "log").exists()


BAD_INPUT = {  # one interpreter per lesson runs its rows (run_rows): each refusal comes before training
    TP: [(["--dp", "2"], "--dp 2 does not divide the 1 rank(s)"), (["--grad-accum", "2"], "--grad-accum")],
    PP: [(["--micro-batches", "3"], "--micro-batches 3 does not divide --batch-size 32"),
         (["--resume"], "keep no checkpoints"), (["--schedule", "interleaved"], "--schedule")],
}


@pytest.mark.parametrize("script", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path, script):
    table = BAD_INPUT[script]
    outcomes = run_rows(script, [[*flags, "--log-dir", str(tmp_path / "log")] for flags, _ in table])
    for (flags, words), outcome in zip(table, outcomes):
        assert outcome["code"] == 2, (flags, outcome)
        errors = error_lines(outcome["stderr"])
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"])
        assert "Traceback" not in outcome["stderr"], (flags, outcome["stderr"])


@pytest.mark.parametrize("script", [TP, PP])
def test_two_ranks_reach_85_percent_in_two_epochs(tmp_path, script):
    check(run(torchrun(2, script, "--log-dir", tmp_path), timeout=300))
    history = metrics(tmp_path)
    assert [m["epoch"] for m in history] == [1, 2] and history[-1]["world_size"] == 2
    assert history[-1]["test_acc"] >= 0.85, history
    assert_event_epochs(tmp_path)  # TensorBoard's event files: every epoch
