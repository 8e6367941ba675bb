"""deepspeed/main.py under its three launchers (deepspeed, torchrun, mpiexec), on the shipped MNIST digits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import (
    DS,
    QUICK,
    ROOT,
    assert_event_epochs,
    check,
    deepspeed_launcher,
    error_lines,
    metrics,
    mpiexec,
    run,
    summary,
    torchrun,
    warm,
)

SCRIPT = DS
DDP_METRIC_KEYS = {"epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "epoch_time_s", "train_time_s",
                   "samples_per_s", "world_size", "framework", "launcher"}


LAUNCHES = {"deepspeed": (deepspeed_launcher, "2"), "torchrun": (torchrun, "3"), "mpiexec": (mpiexec, "1")}


@pytest.fixture(scope="module")
def quick_run(shared_run):
    """The 2-rank QUICK run under a launcher (its log dir and output), made once: the test that checks it,
    the resume test that compares against it and tests/test_lift_out.py read the same files."""
    return lambda name: shared_run(SCRIPT, name, [*QUICK, "--zero-stage", LAUNCHES[name][1]])


@pytest.mark.parametrize("name", LAUNCHES)
def test_two_ranks_train_and_stay_identical(quick_run, name):
    tmp_path, output = quick_run(name)
    history = metrics(tmp_path)
    assert [m["epoch"] for m in history] == [1, 2]
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert all(set(m) == DDP_METRIC_KEYS for m in history), history[0].keys()
    assert all(m["world_size"] == 2 and m["framework"] == "deepspeed" for m in history)
    assert history[0]["launcher"] == name
    assert_event_epochs(tmp_path)  # TensorBoard's event files: every epoch
    checksums = summary(tmp_path)["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    # Single host: the master stays on loopback under every launcher (DeepSpeed's MPI discovery would not).
    assert json.loads((tmp_path / "config.json").read_text())["master_addr"] == "127.0.0.1"
    # No JIT build on the way: torch's Adam instead of fused_adam, and no shm_comm op on CPUs.
    assert "Building extension" not in output
    assert "shm_comm" not in output


def test_resume_from_a_deepspeed_checkpoint_matches_an_uninterrupted_run(tmp_path, quick_run):
    """Epoch 1, then --resume to epoch 2 (ZeRO-3: each rank's files hold its slice of the parameters and
    of Adam's state), ends where the 2-epoch QUICK run under torchrun ended."""
    straight, _ = quick_run("torchrun")
    quick = [*QUICK, "--zero-stage", LAUNCHES["torchrun"][1]]
    check(run(warm(2, SCRIPT, *quick, "--epochs", "1", "--log-dir", tmp_path), timeout=240))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "epoch1"
    check(run(warm(2, SCRIPT, *quick, "--resume", "--log-dir", tmp_path), timeout=240))
    assert summary(tmp_path)["param_checksums"] == summary(straight)["param_checksums"]
    straight, split = metrics(straight), metrics(tmp_path)
    assert [m["epoch"] for m in split] == [1, 2]
    for a, b in zip(straight, split):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-12)
        assert a["test_acc"] == b["test_acc"]


def write_config(tmp_path, **changes):
    config = json.loads((ROOT / "deepspeed" / "ds_config.json").read_text())
    config.update(changes)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes,words,launch", [  # (one under mpiexec; the others' ranks start warm)
    ({"train_bach_size": 64}, "unknown key(s) train_bach_size", mpiexec),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "overlap_com: Extra inputs are not permitted", warm),
    ({"train_batch_size": 65}, "train_batch_size 65 is not divisible by the 2 ranks", warm),
    ({"gradient_clipping": 1.0}, "compute_grad_norm false, but gradient_clipping needs the norm", warm),
], ids=["unknown-key-mpiexec", "unknown-zero-key", "batch-not-divisible", "clipping-without-norm"])
def test_bad_config_fails_every_rank_with_one_line(tmp_path, changes, words, launch):
    config = write_config(tmp_path, **changes)
    result = run(launch(2, SCRIPT, "--deepspeed_config", config, "--log-dir", tmp_path / "log"), timeout=120)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all(words in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_bad_config_in_one_process_and_under_the_deepspeed_launcher(tmp_path):
    config = write_config(tmp_path, train_bach_size=64)
    result = run(warm(1, SCRIPT, "--deepspeed_config", config, "--log-dir", tmp_path / "one"), timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert [e for e in error_lines(result.stderr) if "train_bach_size" in e] == error_lines(result.stderr) != []
    # The deepspeed launcher stops the other rank as soon as one fails: at least one line, and a non-zero exit.
    result = run(deepspeed_launcher(2, SCRIPT, "--deepspeed_config", config, "--log-dir", tmp_path / "two"),
                 timeout=120)
    assert result.returncode != 0
    assert any("train_bach_size" in e for e in error_lines(result.stderr + result.stdout)), result.stderr[-3000:]


def ds_config_read(path, **flags):
    """The config deepspeed/main.py builds (utils/parse_args.deepspeed_config) from the file and the flags it
    gets from the command line, and the course's check of it at 2 ranks (course/ds_guard.py)."""
    import argparse
    import sys
    sys.path.append(str(ROOT))
    from course import ds_guard
    from utils.parse_args import deepspeed_config
    args = argparse.Namespace(deepspeed_config=path or str(ROOT / "deepspeed" / "ds_config.json"), batch_size=64,
                              grad_accum=1, zero_stage=None, offload=False, lr=1e-3, load_universal=False)
    vars(args).update(flags)
    return ds_guard, deepspeed_config(args), args.deepspeed_config


@pytest.mark.parametrize("flags,skipped", [
    ({}, True), ({"zero_stage": 1}, True), ({"zero_stage": 0}, False), ({"zero_stage": 3}, False),
    ({"zero_stage": 2, "offload": True}, False)], ids=["file", "stage1", "stage0", "stage3", "offload"])
def test_the_gradient_norm_is_skipped_only_where_deepspeed_allows_it(flags, skipped):
    """The shipped file skips the gradient norm (README, Performance); a flag that moves the config where
    DeepSpeed refuses the skip (stages 0 and 3, offload) brings the norm back instead of failing."""
    ds_guard, config, path = ds_config_read(None, **flags)
    assert (config["zero_optimization"].get("compute_grad_norm") is False) == skipped
    ds_guard.check(config, path, world_size=2)  # and DeepSpeed's own parser accepts the result (it exits otherwise)


@pytest.mark.parametrize("changes,flags,words", [
    ({"gradient_clipping": 1.0}, {"zero_stage": 2}, "gradient_clipping needs the norm"),
    ({"gradient_clipping": None}, {}, None),  # (null: DeepSpeed's parser has the last word)
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, {"zero_stage": 1},
     "ZeRO-1 with bf16 and fp32 gradient accumulation needs the norm"),
    ({"bf16": {"enabled": True}}, {"zero_stage": 1}, None),  # bf16 accumulation: DeepSpeed skips the norm fine
    ({"zero_optimization": {"stage": 2, "compute_grad_norm": False,
                            "offload_optimizer": {"device": "cpu"}}}, {}, "ZeRO-Offload needs the norm"),
], ids=["clipping-under-a-stage-flag", "clipping-null", "bf16-zero1-fp32-accumulation", "bf16-zero1",
        "offload-in-file"])
def test_a_file_that_needs_the_norm_it_skips_is_refused_in_one_line(tmp_path, capsys, changes, flags, words):
    ds_guard, config, path = ds_config_read(str(write_config(tmp_path, **changes)), **flags)
    if words is None:
        try:
            ds_guard.check(config, path, world_size=2)
        except SystemExit:
            assert "compute_grad_norm" not in capsys.readouterr().err
        return
    with pytest.raises(SystemExit):
        ds_guard.check(config, path, world_size=2)
    assert f"compute_grad_norm false, but {words}" in capsys.readouterr().err


def test_lessons_find_the_cpu_adam_op_that_make_setup_built_for_this_environment():
    """ZeRO-Offload's cpu_adam is JIT-built by `make setup`; a lesson finds it in the folder of its own
    Python environment (a build records the environment's paths: another venv's build would be redone)."""
    probe = ("import os, sys; sys.path.append(os.getcwd()); from course.dist import default_extensions_dir; "
             "default_extensions_dir(); print(os.environ['TORCH_EXTENSIONS_DIR'])")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}  # the lessons' default
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    folder = Path(out.strip().splitlines()[-1])
    assert list(folder.glob("cpu_adam/cpu_adam*.so")), f"no cpu_adam build in {folder}: run make setup"
    assert sys.prefix in (folder / "cpu_adam" / "build.ninja").read_text()
