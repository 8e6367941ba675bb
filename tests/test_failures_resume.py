"""Killed runs resume to the uninterrupted result; the same command twice gives the same result."""
import ast
import re
import signal

import pytest
import torch

from support import (
    DDP,
    DS,
    FSDP_CKPT,
    GPT_FSDP,
    GPT_SMALL,
    HVD_TF,
    HVD_TORCH,
    ROOT,
    SCRIPTS,
    TP,
    ZERO,
    assert_log_dir_sound,
    check,
    error_lines,
    launch_command,
    metrics,
    quick,
    remove_the_half_written_file,
    run,
    summary,
    warm,
    weights_digest,
    without_timing,
)

LONG = pytest.mark.long  # `make test-all`; not in `make test` (CI's time): the whole-run comparisons


@LONG
@pytest.mark.parametrize("script", SCRIPTS)
def test_same_command_twice_gives_identical_metrics(tmp_path, tiny, straight_run, script):
    """Pinned: --seed (weight init: torch.manual_seed / keras.utils.set_random_seed), the data order (numpy
    generator seeded by seed + epoch), dropout masks (reseeded per epoch and rank), the tf.data shuffle seed
    (Keras API), and --num-threads 1 (see above). Timing fields excluded."""
    first = straight_run(script)
    check(run(quick(script, tmp_path, "--data-dir", tiny), timeout=240))
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(first))
    assert summary(tmp_path)["param_checksums"] == summary(first)["param_checksums"]


@LONG
@pytest.mark.parametrize("script,fault", [
    # killed while writing epoch 2's checkpoint: half a temporary file, no rename
    (DDP, {"COURSE_DIE_IN_WRITE": "checkpoint.pt:2"}),
    (HVD_TORCH, {"COURSE_DIE_IN_WRITE": "checkpoint.pt:2"}),
    (DS, {"COURSE_DIE_IN_WRITE": "mp_rank_00_model_states.pt:2"}),
    # TensorFlow's CheckpointManager writes ckpt-2 itself: killed the moment its first file appears
    (HVD_TF, {"COURSE_DIE_ON_FILE": "{log_dir}/checkpoints/ckpt-2*"}),
    # killed (SIGKILL) in the middle of epoch 2, after epoch 1's checkpoint
    (HVD_TF, {"COURSE_FAIL_AT": "0:2:3:kill"}),
    (DS, {"COURSE_FAIL_AT": "0:2:3:kill"}),
], ids=["ddp-in-checkpoint-write", "hvd-torch-in-checkpoint-write", "deepspeed-in-checkpoint-write",
        "hvd-tf-in-checkpoint-write", "hvd-tf-mid-epoch", "deepspeed-mid-epoch"])
# (DDP killed mid-epoch under torchrun: test_torchrun_elastic_restart_resumes_from_the_checkpoint)
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, tiny, straight_run, script, fault):
    fault = {k: v.format(log_dir=tmp_path) for k, v in fault.items()}
    killed = run(quick(script, tmp_path, "--data-dir", tiny), timeout=240, env=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    in_save = "COURSE_FAIL_AT" not in fault  # killed in epoch 2's checkpoint save, after its metrics line
    assert [m["epoch"] for m in metrics(tmp_path)] == ([1, 2] if in_save else [1])
    checkpoints = tmp_path / "checkpoints"
    if script in (DDP, HVD_TORCH) and "COURSE_DIE_IN_WRITE" in fault:
        # the previous checkpoint is intact (epoch 1); the half-written one never got the real name
        assert torch.load(checkpoints / "checkpoint.pt", weights_only=True)["epoch"] == 1
        remove_the_half_written_file(checkpoints, ".tmp-checkpoint.pt*")
    if script == DS and "COURSE_DIE_IN_WRITE" in fault:
        assert (checkpoints / "latest").read_text() == "epoch1"  # still names the complete checkpoint
        remove_the_half_written_file(checkpoints / "epoch2", ".tmp-mp_rank_00_model_states.pt*")
    if "COURSE_DIE_ON_FILE" in fault:
        assert "COURSE_DIE_ON_FILE: killed" in killed.stdout
        assert 'model_checkpoint_path: "ckpt-1"' in (checkpoints / "checkpoint").read_text()
    resumed = check(run(quick(script, tmp_path, "--data-dir", tiny, "--resume"), timeout=240))
    assert "continuing at epoch 2" in resumed.stdout
    reference = straight_run(script)
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(reference))
    assert summary(tmp_path)["param_checksums"] == summary(reference)["param_checksums"]
    assert_log_dir_sound(tmp_path)



@pytest.mark.parametrize("script", [DDP, DS, GPT_FSDP, TP])
def test_torchrun_elastic_restart_resumes_from_the_checkpoint(tmp_path, tiny, script):
    """--max-restarts 1, rank 1 exits once (epoch 2 step 3; FSDP2: epoch 3 step 1): torchrun restarts both
    workers, which meet again on keys of their own attempt, pick up the last whole checkpoint by themselves
    (--resume auto; the tensor-parallel lesson keeps none and starts over; the transformer's FSDP2 lesson loads its
    sharded checkpoint) and end exactly where an uninterrupted run ends. (While this test was marked long, the DDP
    lesson's lift-out lost the per-attempt keys and no run saw it; DeepSpeed's never had them.)"""
    flags = ["--epochs", "3", "--batch-size", "32", "--num-threads", "1", "--seed", "7", "--data-dir", tiny]
    if script in (GPT_FSDP, TP):  # the transformer's text; --save-model: the whole model, to compare
        flags = [*GPT_SMALL, "--epochs", "3", "--max-steps", "4", "--batch-size", "4", "--seed", "7", "--save-model"]
    resume = ["--resume", "auto"] if script != TP else []
    check(run(warm(2, script, *flags, "--log-dir", tmp_path / "straight"), timeout=240))  # (the reference)
    elastic = launch_command(script, 2, "torchrun", [*flags, *resume, "--log-dir", tmp_path / "elastic"],
                             launcher_flags=["--max-restarts", "1"])
    # Where rank 1 stops, and the epochs the restarted workers may go on at. DDP and DeepSpeed save at the end of
    # each epoch before the next begins: stopped in epoch 2, they find epoch 1's. FSDP2 saves in the background
    # while the next epoch trains, one save at a time: stopped in epoch 3, epoch 1's is surely whole and marked,
    # epoch 2's if its save ended before the stop (a few steps of a busy machine may not be enough).
    fail_at, resumed_at = ("1:3:1", "[23]") if script == GPT_FSDP else ("1:2:3", "2")
    result = check(run(elastic, timeout=300, env={"COURSE_FAIL_AT": fail_at}))
    output = result.stdout + result.stderr
    epoch, step = fail_at.split(":")[1:]
    assert f"COURSE_FAIL_AT: rank 1 stops at epoch {epoch} step {step}" in output
    if resume:  # the restarted workers found a checkpoint
        assert re.search(rf"(continuing at |resumed from .*: )epoch {resumed_at}\b", result.stdout), result.stdout
    assert without_timing(metrics(tmp_path / "elastic")) == without_timing(metrics(tmp_path / "straight"))
    if script in (GPT_FSDP, TP):
        assert weights_digest(tmp_path / "elastic") == weights_digest(tmp_path / "straight")
    else:
        assert summary(tmp_path / "elastic")["param_checksums"] == summary(tmp_path / "straight")["param_checksums"]


TORCH_LESSONS = [DDP, DS, ZERO, FSDP_CKPT, *(f"transformer/{n}.py" for n in ("ddp", "fsdp", "tp", "cp", "ep", "pp"))]


@pytest.mark.parametrize("script", TORCH_LESSONS)
def test_every_torch_lesson_keeps_a_restarted_attempts_keys_apart(script):
    """The test above restarts four lessons under torchrun; every other torch.distributed lesson joins its group
    the same way (read from the file): a restarted attempt (TORCHELASTIC_RESTART_COUNT) meets in a PrefixStore of
    its own, given to init_process_group, not on the dead attempt's keys in torchrun's store (there a rank waits
    --dist-timeout for peers that are gone: what transformer/tp.py did before it had these lines)."""
    tree = ast.parse((ROOT / script).read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    names = {ast.unparse(node.func).split(".")[-1] for node in calls}
    joins = [node for node in calls if ast.unparse(node.func).endswith("init_process_group")]
    assert joins and all(any(k.arg == "store" for k in node.keywords) for node in joins), script
    assert "PrefixStore" in names and "rendezvous" in names, script
    assert "TORCHELASTIC_RESTART_COUNT" in ast.unparse(tree), script


def test_resume_auto_without_a_checkpoint_says_so_and_plain_resume_refuses_leaving_nothing(tmp_path, tiny):
    flags = ["--epochs", "1", "--max-steps", "1", "--data-dir", tiny, "--num-threads", "1"]
    auto = check(run(warm(1, DDP, *flags, "--resume", "auto", "--log-dir", tmp_path / "auto"), timeout=120))
    assert [m["epoch"] for m in metrics(tmp_path / "auto")] == [1]
    said = [line for line in auto.stdout.splitlines() if "no checkpoint in" in line]  # not silently
    assert said == [f"--resume auto: no checkpoint in {tmp_path / 'auto' / 'checkpoints'}: starting at epoch 1"]
    result = run(warm(1, DDP, *flags, "--resume", "--log-dir", tmp_path / "plain" / "run"), timeout=120)
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1
    assert "--resume: no checkpoint at" in result.stderr
    assert not (tmp_path / "plain").exists()  # the folder it had created is gone again


def test_parse_changes_no_value_and_the_helpers_decide_whether_to_resume(tmp_path, capsys):
    """parse() neither rewrites --resume nor exits; resuming() and finished_already() decide, and the lesson
    reads their answers. The three cases of --resume auto: nothing there, a checkpoint to continue, a run
    that is done."""
    from course.checks import finished_already, parse, resuming
    from utils.parse_args import get_parser
    log_dir = tmp_path / "run"
    args = parse(get_parser("test"), ["--resume", "auto", "--epochs", "2", "--log-dir", str(log_dir)])
    assert args.resume == "auto"
    assert not finished_already(args) and resuming(args) is False
    assert f"--resume auto: no checkpoint in {log_dir / 'checkpoints'}: starting at epoch 1" in capsys.readouterr().out
    (log_dir / "checkpoints").mkdir(parents=True)
    (log_dir / "checkpoints" / "checkpoint.pt").write_bytes(b"")
    (log_dir / "metrics.jsonl").write_text('{"epoch": 1}\n')
    assert not finished_already(args) and resuming(args) is True
    (log_dir / "metrics.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    assert finished_already(args) is True
    assert "has finished 2 of 2 epoch(s) already: nothing left to do" in capsys.readouterr().out
    assert args.resume == "auto"


def test_a_resume_remembers_the_saved_runs_flags_and_says_which(tmp_path, tiny):
    """What the interrupt line says (`--resume auto --log-dir DIR`) continues the run as it was started: --epochs 3
    (not the default 2), its --lr and --max-steps, from its config.json; a flag given anew wins and is named."""
    flags = ["--epochs", "3", "--max-steps", "3", "--lr", "0.02", "--num-threads", "1", "--data-dir", tiny]
    stopped = run(warm(1, DDP, *flags, "--log-dir", tmp_path), timeout=120, env={"COURSE_FAIL_AT": "0:2:1"})
    assert stopped.returncode == 3 and [m["epoch"] for m in metrics(tmp_path)] == [1], stopped.stderr[-3000:]
    resumed = check(run(warm(1, DDP, "--resume", "auto", "--log-dir", tmp_path, "--data-dir", tiny,
                             "--log-interval", "1"), timeout=120))
    said = [line for line in resumed.stdout.splitlines() if line.startswith("--resume: the saved run's flags")]
    assert said == [f"--resume: the saved run's flags ({tmp_path / 'config.json'}), kept: --epochs 3 --lr 0.02 "
                    "--max-steps 3; given anew: --log-interval 1 (was 10)"], resumed.stdout
    history = metrics(tmp_path)
    assert [m["epoch"] for m in history] == [1, 2, 3] and {m["lr"] for m in history} == {0.02}
    assert "epoch 3 step 3/3" in resumed.stdout  # --max-steps 3 kept, and --log-interval 1 taken


def test_a_resume_refuses_another_zero_stage_naming_both(tmp_path, shared_run):
    import shutil

    from support import QUICK
    written, _ = shared_run(DS, "torchrun", [*QUICK, "--zero-stage", "3"])  # tests/test_deepspeed.py's run
    shutil.copytree(written, tmp_path / "run")
    result = run(warm(1, DS, "--zero-stage", "2", "--resume", "--log-dir", tmp_path / "run"), timeout=120)
    assert result.returncode == 2 and error_lines(result.stderr) == [
        f"error: --zero-stage 2: the checkpoint in {tmp_path / 'run'} was written with --zero-stage 3, which a "
        "resume cannot change"], result.stderr[-3000:]
