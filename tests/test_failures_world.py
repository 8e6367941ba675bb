"""A job whose world changes: a checkpoint written by 2 ranks continues at 1 and at 4 ranks (DDP,
Horovod PyTorch; Horovod TensorFlow at 1; DeepSpeed ZeRO-2 and -3 through a universal checkpoint; FSDP2
through torch.distributed.checkpoint).

DDP's and Horovod's checkpoint holds the whole model and optimizer state once, so any world size
loads it: the resumed run starts from exactly the saved weights (checked through the first epoch's
checksum being carried over) and its metrics say the new world size. ZeRO's checkpoint holds one
slice per rank: another world size needs DeepSpeed's conversion to a universal checkpoint first."""

import json
import re
import shutil
import sys

import pytest

from support import (
    DDP,
    DS,
    HVD_TF,
    HVD_TORCH,
    LONG,
    assert_each_rank_refused,
    assert_log_dir_sound,
    check,
    error_lines,
    metrics,
    run,
    summary,
    torchrun,
    warm,
    without_timing,
)

FLAGS = ["--batch-size", "16", "--num-threads", "1", "--seed", "7", "--log-interval", "100"]


def as_horovodrun(nproc, script, *args):
    """Horovod's ranks started warm, as `horovodrun --gloo` starts them (tests/warm.py)."""
    return warm(nproc, script, *args, launcher="horovodrun")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((DDP, warm), id="ddp"),  # (ranks started warm: tests/README.md)
        pytest.param((HVD_TORCH, as_horovodrun), id="hvd-torch"),
    ],
)
def written_at_2(request, tmp_path_factory, tiny):
    """One epoch at 2 ranks, with its checkpoint: shared by the resumes at 1 and 4 ranks."""
    script, launcher = request.param
    log_dir = tmp_path_factory.mktemp("world2")
    check(
        run(
            launcher(2, script, *FLAGS, "--epochs", "1", "--data-dir", tiny, "--log-dir", log_dir),
            timeout=300,
        )
    )
    return script, launcher, log_dir


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_checkpoint_of_2_ranks_continues_at_another_world_size(tmp_path, tiny, written_at_2, ranks):
    script, launcher, written = written_at_2
    assert_continues(script, launcher, written, ranks, tmp_path / "log", tiny)


def test_a_tensorflow_checkpoint_of_2_ranks_continues_at_1_rank(tmp_path, tiny):
    """Horovod TensorFlow's tf.train.Checkpoint holds the whole model and optimizer once, as well."""
    written = tmp_path / "written"
    check(run(as_horovodrun(2, HVD_TF, *FLAGS, "--epochs", "1", "--data-dir", tiny, "--log-dir", written),
              timeout=300))
    assert_continues(HVD_TF, as_horovodrun, written, 1, tmp_path / "log", tiny)


def assert_continues(script, launcher, written, ranks, log_dir, tiny):
    shutil.copytree(written, log_dir)
    flags = [*FLAGS, "--epochs", "2", "--resume", "--data-dir", tiny, "--log-dir", log_dir]
    result = check(run(launcher(ranks, script, *flags), timeout=300))
    assert "continuing at epoch 2" in result.stdout
    history = metrics(log_dir)
    assert [m["epoch"] for m in history] == [1, 2]
    assert [m["world_size"] for m in history] == [2, ranks]
    assert history[0] == metrics(written)[0]  # epoch 1 is the 2-rank run's, kept as it was
    # [4] the LR is scaled to the new world: base LR x ranks (no warmup)
    assert history[1]["lr"] == pytest.approx(history[0]["lr"] / 2 * ranks)


# ZeRO-3 (the parameters sliced too) in `make test`; ZeRO-2's slices of the Adam state in `make test-all`
@pytest.fixture(scope="module", params=[pytest.param(2, marks=LONG), 3], ids=["zero2", "zero3"])
def zero_at_2(request, tmp_path_factory, tiny):
    """One epoch of the DeepSpeed lesson on 2 ranks at ZeRO stage 2 (the lesson's default; stage 1
    is the same code in DeepSpeed) or 3: each rank's checkpoint files hold its own slice of the Adam
    state (stage 3: of the parameters too)."""
    log_dir = tmp_path_factory.mktemp(f"zero{request.param}")
    check(run(warm(2, DS, *FLAGS, "--zero-stage", request.param, "--epochs", "1", "--data-dir",
                   tiny, "--log-dir", log_dir), timeout=300))
    return request.param, log_dir


def test_a_zero_checkpoint_continues_at_another_world_size_after_the_conversion_its_error_names(
        tmp_path, tiny, zero_at_2):
    """At 1 rank the ZeRO checkpoint of 2 ranks is refused in one line that says how to convert it;
    the conversion it names, run as printed, gives a universal checkpoint that continues at 1 rank,
    and at ZeRO-3 also at 4 ranks, and at 2 exactly as the original checkpoint does."""
    stage, written = zero_at_2

    def resume(ranks, log_dir, *extra):
        flags = [*FLAGS, "--zero-stage", stage, "--epochs", "2", "--resume", "--data-dir", tiny,
                 "--log-dir", log_dir, *extra]
        return run(warm(ranks, DS, *flags), timeout=300)

    refused_dir = tmp_path / "refused"
    shutil.copytree(written, refused_dir)
    before = {p.relative_to(refused_dir): p.read_bytes() for p in refused_dir.rglob("*") if p.is_file()}
    refused = resume(1, refused_dir)
    errors = error_lines(refused.stderr)
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert_log_dir_sound(refused_dir, before)
    said = re.search(r"python -m (deepspeed\.checkpoint\.ds_to_universal) --input_folder (\S+) "
                     r"--output_folder (\S+), then add --checkpoint-dir (\S+) --load-universal", errors[0])
    assert said, errors[0]
    module, source, target, universal = said.groups()
    check(run([sys.executable, "-m", module, "--input_folder", source, "--output_folder", target],
                timeout=300))

    if stage == 3:
        original = tmp_path / "original"  # the same world, from the checkpoint as written
        shutil.copytree(written, original)
        check(resume(2, original))
    for ranks in (1, 2, 4) if stage == 3 else (1,):
        log_dir = tmp_path / f"at{ranks}"
        shutil.copytree(written, log_dir, ignore=shutil.ignore_patterns("checkpoints"))
        shutil.copytree(universal, log_dir / "universal")  # each run saves its epoch 2 beside it
        result = check(resume(ranks, log_dir, "--checkpoint-dir", log_dir / "universal",
                                "--load-universal"))
        assert "continuing at epoch 2" in result.stdout
        history = metrics(log_dir)
        assert [m["world_size"] for m in history] == [2, ranks]
        assert history[0] == metrics(written)[0]
        assert history[1]["lr"] == pytest.approx(history[0]["lr"] / 2 * ranks)  # [4] the new world
        assert history[1]["train_loss"] < history[0]["train_loss"]  # it went on from epoch 1's weights
        if ranks == 2:  # the conversion loses nothing: the same run as from the original files
            assert without_timing(metrics(log_dir)) == without_timing(metrics(original))
            assert summary(log_dir)["param_checksums"] == summary(original)["param_checksums"]


FSDP = "zero/fsdp_checkpoint.py"


def test_an_fsdp2_checkpoint_of_2_ranks_loads_whole_at_1_and_4_ranks(tmp_path):
    """torch.distributed.checkpoint: each rank of 2 writes its shards; 1 and 4 ranks read the slices
    their own shards cover. The whole model and Adam state, gathered, hash the same after the load
    as when saved, and training goes on from the saved step."""
    def fsdp(ranks, folder, *extra):
        flags = ["--hidden", "128", "--steps", "2", "--checkpoint-dir", folder, "--json",
                 folder / "result.json", *extra]
        return check(run(warm(ranks, FSDP, *flags), timeout=300))

    fsdp(2, tmp_path / "at2")
    saved = json.loads((tmp_path / "at2" / "result.json").read_text())
    assert saved["world_size"] == 2 and saved["step"] == 2
    for ranks in (1, 4):
        folder = tmp_path / f"at{ranks}"
        shutil.copytree(tmp_path / "at2", folder)
        result = fsdp(ranks, folder, "--resume")
        loaded = json.loads((folder / "result.json").read_text())
        assert loaded["written_by"] == 2 and loaded["world_size"] == ranks
        assert loaded["loaded_checksum"] == saved["saved_checksum"]
        assert loaded["step"] == 4 and "step 3  loss" in result.stdout
        assert (folder / "latest").read_text() == "step4"
    # the shards carry their SHA-256 (course/seal.py): one damaged in place is refused before anything loads
    shutil.copytree(tmp_path / "at2", tmp_path / "damaged")
    shard = max((tmp_path / "damaged").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 4096] = bytes(4096)
    shard.write_bytes(bytes(raw))
    refused = run(warm(1, FSDP, "--hidden", "128", "--steps", "2", "--checkpoint-dir", tmp_path / "damaged",
                       "--resume"), timeout=120)
    assert refused.returncode == 2 and error_lines(refused.stderr) == [
        f"error: checkpoint file {shard} is damaged: its bytes are not the ones written (SHA-256 in "
        f"{shard.parent / 'SHA256SUMS'}): resume from an intact copy, or start again without --resume"], refused.stderr


def test_fsdp2_resume_without_a_checkpoint_is_one_line_on_every_rank(tmp_path):
    result = run(torchrun(2, FSDP, "--checkpoint-dir", tmp_path / "none", "--resume"), timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert_each_rank_refused(result, "--resume: no checkpoint in", 2, "torchrun")
    assert 'fsdp_checkpoint.py", line' not in output  # torchrun's own report is torchrun's
    assert not (tmp_path / "none").exists()
