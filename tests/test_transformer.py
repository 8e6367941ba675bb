"""transformer/: the chapter's GPT on bytes of real text (Python's standard library sources), its ranks
started warm (tests/README.md; under mpiexec: its tokens/s report, and tests/test_lift_out.py's copies): N ranks
train as one process on the combined batch, the loss falls, bad input is one line on every rank."""
import json
import math
import shutil

import pytest
import torch

from support import (
    GPT_DDP,
    GPT_QUICK,
    GPT_SMALL,
    LONG,
    ROOT,
    assert_each_rank_refused,
    check,
    metrics,
    mpiexec,
    python,
    run,
    summary,
    torchrun,
    warm,
)

SCRIPT, SMALL = GPT_DDP, GPT_SMALL


def test_two_ranks_equal_one_process_on_the_combined_batch(shared_run, tmp_path):
    """DDP averages the gradients of each rank's own sequences: 2 ranks x 4 sequences end with the weights of
    one process that takes all 8; and one rank's 4 alone would not. (The 2-rank run is shared with
    tests/test_lift_out.py, whose copy of the lesson must end the same.)"""
    two_dir, _ = shared_run(SCRIPT, "torchrun", GPT_QUICK)
    same = GPT_QUICK[:-2]  # (all but --batch-size 4)
    check(run(warm(1, SCRIPT, *same, "--batch-size", "8", "--log-dir", tmp_path / "one"), timeout=240))
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
    check(run(warm(1, SCRIPT, *same, "--batch-size", "4", "--log-dir", tmp_path / "half"), timeout=240))
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
    result = run(warm(1, SCRIPT, *flags), timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("ddp.py: error: ") and words in line, line


def test_a_checkpoint_of_another_model_shape_is_one_line_naming_the_flag(shared_run, tmp_path):
    """ddp.py --resume from the shared 2-rank run's checkpoint (context 32) with --context 64: every rank says
    which flag does not fit the checkpoint, before any step (fsdp.py's: the DCP test below)."""
    saved = shared_run(SCRIPT, "torchrun", GPT_QUICK)[0] / "checkpoints"
    result = run(warm(2, SCRIPT, *SMALL, "--context", "64", "--epochs", "3", "--resume", "--checkpoint-dir", saved,
                         "--log-dir", tmp_path / "run"), timeout=120)
    assert_each_rank_refused(result, f"--context 64: {saved / 'checkpoint.pt'} is of context 32", 2, "warm")


def test_a_data_folder_without_the_text_is_one_line(tmp_path):
    result = run(warm(1, SCRIPT, *SMALL, "--data-dir", tmp_path), timeout=120)
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"no input.txt in {tmp_path}" in line and "--download" in line



@pytest.mark.parametrize("lesson", ["ddp", "fsdp", "tp", "cp", "ep", "pp"])
def test_a_text_shorter_than_its_windows_is_one_line_naming_the_length(lesson, tmp_path):
    """A 10-byte input.txt: the lesson says how long the text must be for its --context and ranks, when the flags
    are read (one process told it is rank 0 of 2: the parse path every rank takes), not torch's `random_ expects
    'from' to be less than 'to'` from the first draw of a window."""
    (tmp_path / "input.txt").write_bytes(b"0123456789")
    result = run(warm(1, f"transformer/{lesson}.py", *SMALL, "--data-dir", tmp_path), timeout=120,
                 env={"RANK": "0", "WORLD_SIZE": "2"})
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "input.txt has 10 bytes: --context 32 on 2 rank(s) needs at least 651 " in line, line


def test_a_short_text_is_refused_on_every_rank_and_a_long_enough_one_trains(tmp_path):
    """The same under mpiexec, every rank; then the shortest text the line names trains (one epoch)."""
    (tmp_path / "input.txt").write_bytes(b"x" * 650)
    result = run(warm(2, SCRIPT, *SMALL, "--data-dir", tmp_path, "--log-dir", tmp_path / "run"), timeout=120)
    assert_each_rank_refused(result, "input.txt has 650 bytes: --context 32 on 2 rank(s) needs at least 651", 2,
                             "mpiexec")
    (tmp_path / "input.txt").write_bytes(bytes(range(256)) * 2 + b"y" * 139)  # 651 bytes
    check(run(warm(2, SCRIPT, *SMALL, "--data-dir", tmp_path, "--epochs", "1", "--max-steps", "2",
                      "--log-dir", tmp_path / "run"), timeout=180))
    (m,) = metrics(tmp_path / "run")
    assert m["test_loss"] > 0

@LONG
def test_one_process_learns_the_text_to_the_readme_threshold(tmp_path):
    """The README's run: the default model, 200 steps of 16 x 128 bytes, seeded: the test loss falls from
    ln 256 = 5.55 to under 2.7 nats per byte (2.491-2.532 over two CPUs and their kernel sets:
    transformer/README.md)."""
    check(run(warm(1, SCRIPT, "--log-dir", tmp_path), timeout=900))
    (m,) = metrics(tmp_path)
    assert m["test_loss"] < 2.7, m
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 200


FSDP = "transformer/fsdp.py"


SHARDED = [*GPT_SMALL, "--epochs", "2", "--max-steps", "3", "--no-lr-scaling", "--save-model"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted 1-process run of 2 epochs on the global batch (8 sequences) that the sharded runs
    below end as."""
    log_dir = tmp_path_factory.mktemp("gpt") / "one"
    check(run(warm(1, SCRIPT, *SHARDED, "--batch-size", "8", "--log-dir", log_dir), timeout=240))
    return log_dir


def assert_same_training(log_dir, one_dir, name):
    """Every epoch's losses and the final weights (--save-model's full state dict) as the one process's."""
    one = torch.load(one_dir / "model.pt", weights_only=True)
    sharded = torch.load(log_dir / "model.pt", weights_only=True)
    assert sharded.keys() == one.keys(), name
    for key in one:
        torch.testing.assert_close(sharded[key], one[key], rtol=0, atol=2e-5, msg=f"{name}: {key}")
    for a, b in zip(metrics(log_dir), metrics(one_dir), strict=True):
        for kind in ("train_loss", "test_loss"):
            assert math.isclose(a[kind], b[kind], rel_tol=1e-5), (name, kind, a, b)


def test_fsdp2_and_hsdp_train_as_one_process_and_hold_a_share_of_the_bytes(one_process, tmp_path):
    """FSDP2 (2 ranks, each half of every tensor) and HSDP (4 ranks = 2 copies x 2 shards; 4 processes on 2
    cores, oversubscribed) end with the weights of one process that takes the whole global batch; each rank
    holds 1/shards of the parameters, gradients and AdamW's two moments (fp32: 4, 4 and 8 bytes each)."""
    flags = SHARDED
    runs = {"fsdp": (2, ["--batch-size", "4"], 2), "hsdp": (4, ["--batch-size", "2", "--replicate", "2"], 2)}
    for name, (ranks, extra, shards) in runs.items():
        check(run(warm(ranks, FSDP, *flags, *extra, "--log-dir", tmp_path / name), timeout=300))
        assert_same_training(tmp_path / name, one_process, name)
        s = summary(tmp_path / name)
        assert (s["world_size"], s["shards"]) == (ranks, shards)
        n = s["parameters"]
        for held in s["held_bytes_per_rank"]:  # FSDP2 pads each tensor's slices to equal rows: within 10%
            for kind, per_parameter in (("params", 4), ("grads", 4), ("optimizer", 8)):
                formula = per_parameter * n / shards
                assert abs(held[kind] - formula) <= 0.1 * formula, (name, kind, held, formula)


def test_bf16_computes_in_bf16_and_stays_near_fp32(tmp_path):
    """--bf16: the weights are cast to bf16 for forward and backward (the losses move), the gradients reduced
    and the weights kept in fp32 (they stay near the fp32 run's)."""
    flags = [*GPT_SMALL, "--epochs", "1", "--max-steps", "4", "--batch-size", "4"]
    check(run(warm(2, FSDP, *flags, "--log-dir", tmp_path / "fp32"), timeout=240))
    check(run(warm(2, FSDP, *flags, "--bf16", "--log-dir", tmp_path / "bf16"), timeout=240))
    (fp32,), (bf16,) = metrics(tmp_path / "fp32"), metrics(tmp_path / "bf16")
    assert fp32["train_loss"] != bf16["train_loss"] and abs(fp32["train_loss"] - bf16["train_loss"]) < 0.05
    assert summary(tmp_path / "bf16")["held_bytes_per_rank"] == summary(tmp_path / "fp32")["held_bytes_per_rank"]


def test_a_checkpoint_of_4_ranks_continues_on_2_and_on_1_as_if_never_stopped(one_process, tmp_path):
    """DCP: 4 ranks (oversubscribed on 2 cores) save epoch 1 in the background, each rank its own slices. Its
    copies continue at 2 ranks and at 1 (the same global batch: 8 sequences), each rank reading the slices its
    new shards cover, AdamW's moments included: epoch 2 ends as the uninterrupted run's, losses and weights.
    A checkpoint of another model shape is one line naming the flag, on every rank, before any step."""
    # the LR as the page gives it ([4] multiplies --lr by the ranks): the one process's 3e-3 at every size
    scaled = [flag for flag in SHARDED if flag != "--no-lr-scaling"]
    four = tmp_path / "four"
    check(run(warm(4, FSDP, *scaled[:-1], "--epochs", "1", "--batch-size", "2", "--lr", "0.00075", "--log-dir",
                   four), timeout=300))
    saved = four / "checkpoints"
    assert (saved / "latest").read_text() == "epoch1"
    assert len(list((saved / "epoch1").glob("*.distcp"))) == 4 and (saved / "epoch1" / ".metadata").is_file()
    for ranks, launch in ((2, lambda *a: warm(2, FSDP, *a)), (1, lambda *a: warm(1, FSDP, *a))):
        log_dir = tmp_path / f"at{ranks}"
        shutil.copytree(four, log_dir)
        result = check(run(launch(*scaled, "--batch-size", str(8 // ranks), "--lr", f"{0.003 / ranks:g}",
                                  "--resume", "--log-dir", log_dir), timeout=300))
        assert f"resumed from {log_dir / 'checkpoints' / 'epoch1'} on {ranks} rank(s): epoch 2" in result.stdout
        assert [m["world_size"] for m in metrics(log_dir)] == [4, ranks]
        assert_same_training(log_dir, one_process, f"resumed at {ranks}")
        # the new checkpoint replaces the one it continued
        assert (log_dir / "checkpoints" / "latest").read_text() == "epoch2"
        assert sorted(p.name for p in (log_dir / "checkpoints").iterdir() if p.is_dir()) == ["epoch2"]
        assert len(list((log_dir / "checkpoints" / "epoch2").glob("*.distcp"))) == ranks
    wider = [*GPT_SMALL, "--width", "32", "--epochs", "2", "--resume", "--checkpoint-dir", saved]
    result = run(warm(2, FSDP, *wider, "--log-dir", tmp_path / "wider"), timeout=120)
    assert_each_rank_refused(result, f"--width 32: {saved / 'epoch1'} is of width 64", 2, "warm")
    assert not (tmp_path / "wider").exists()


def test_the_pages_resume_at_another_world_size_keeps_the_global_batch_and_the_lr():
    """transformer/README.md's commands: every part of the run takes the same global batch (--batch-size x ranks)
    and the same LR (--lr x ranks, [4]), the two things the test above holds equal."""
    import re
    page = (ROOT / "transformer" / "README.md").read_text()
    commands = re.findall(r"^\$ torchrun --nproc_per_node (\d+) transformer/fsdp.py (.*?)(?:\s+#.*)?$", page, re.M)
    parts = [(int(n), flags.split()) for n, flags in commands if "--log-dir runs/gpt" in flags]
    assert len(parts) >= 2 and any("--resume" in flags for _, flags in parts), commands

    def flag(flags, name, default):
        return float(flags[flags.index(name) + 1]) if name in flags else default
    batches = {n * flag(flags, "--batch-size", 16) for n, flags in parts}
    lrs = {round(n * flag(flags, "--lr", 3e-3), 12) for n, flags in parts if "--no-lr-scaling" not in flags}
    assert len(batches) == 1 and len(lrs) == 1, (batches, lrs)


@pytest.mark.parametrize("flags, words", [
    (["--replicate", "3"], "--replicate 3 does not divide the 2 rank(s) into copies"),
])
def test_fsdp_refuses_what_it_cannot_do_in_one_line_on_every_rank(flags, words):
    assert_each_rank_refused(run(warm(2, FSDP, *GPT_SMALL, *flags), timeout=120), words, 2, "warm")


# --- memory against time: the same training, another cost ---------------------------------------------------
def test_activation_checkpointing_recomputes_the_same_training(one_process, tmp_path):
    """--activation-checkpointing keeps each block's input only and computes the block again in backward: the
    same arithmetic, so one process ends with the weights of the run without it, bit for bit; under FSDP2 (2
    ranks, a block's weights gathered again for the recompute), as that run to fp32's reduction order."""
    result = check(run(warm(1, SCRIPT, *SHARDED, "--batch-size", "8", "--activation-checkpointing", "--log-dir",
                              tmp_path / "one"), timeout=240))
    assert "recompute=True" in result.stdout
    one, recomputed = (torch.load(d / "model.pt", weights_only=True) for d in (one_process, tmp_path / "one"))
    assert all(torch.equal(recomputed[key], one[key]) for key in one)
    check(run(warm(2, FSDP, *SHARDED, "--batch-size", "4", "--activation-checkpointing", "--log-dir",
                       tmp_path / "fsdp"), timeout=240))
    assert_same_training(tmp_path / "fsdp", one_process, "fsdp2 + activation checkpointing")


def test_bf16_autocast_stays_within_the_readmes_tolerance_of_fp32(one_process, tmp_path):
    """ddp.py --bf16 (torch.autocast): the matmuls run in bf16, so the losses move, each epoch's within 0.05
    nats of fp32's (transformer/README.md); the weights stay fp32."""
    check(run(warm(1, SCRIPT, *SHARDED, "--batch-size", "8", "--bf16", "--log-dir", tmp_path), timeout=240))
    for a, b in zip(metrics(tmp_path), metrics(one_process), strict=True):
        assert a["train_loss"] != b["train_loss"] and abs(a["train_loss"] - b["train_loss"]) < 0.05, (a, b)
        assert abs(a["test_loss"] - b["test_loss"]) < 0.05, (a, b)
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(t.dtype == torch.float32 for t in weights.values())


@LONG  # compiling takes about 40 s of one core, even for this small model
def test_a_compiled_model_trains_as_the_eager_one(one_process, tmp_path):
    """ddp.py --compile, at 1 process and under DDP at 2 ranks (TorchDynamo cuts the graph at DDP's buckets):
    the training is the eager 1-process run's to fp32 rounding (fused kernels add in another order). What
    compiling costs and gains is measured, not asserted (transformer/README.md)."""
    check(run(python(SCRIPT, *SHARDED, "--batch-size", "8", "--compile", "--log-dir", tmp_path / "one"),
              timeout=600))
    check(run(torchrun(2, SCRIPT, *SHARDED, "--batch-size", "4", "--compile", "--log-dir", tmp_path / "two"),
              timeout=900))
    for name in ("one", "two"):
        for a, b in zip(metrics(tmp_path / name), metrics(one_process), strict=True):
            assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=1e-4), (name, a, b)
