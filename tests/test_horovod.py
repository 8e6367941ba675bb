"""Horovod examples (PyTorch, TensorFlow custom loop, Keras API) under horovodrun and mpiexec."""
import json

import pytest
import torch

from support import (
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    QUICK,
    assert_each_rank_refused,
    assert_event_epochs,
    check,
    horovodrun,
    metrics,
    mpiexec,
    run,
    summary,
    warm,
)


def assert_trained_and_identical(log_dir, ranks=2):
    history = metrics(log_dir)
    assert [m["epoch"] for m in history] == [1, 2]
    assert history[1]["train_loss"] < history[0]["train_loss"]
    assert all(m["world_size"] == ranks for m in history)
    checksums = summary(log_dir)["param_checksums"]
    assert len(checksums) == ranks and len(set(checksums)) == 1, checksums
    return history


LAUNCHES = [  # the first of each script is also the resume test's uninterrupted run; under mpiexec: the
    # lift-out test's copies of the lessons (tests/test_lift_out.py), which end as these runs, digit for digit
    pytest.param(HVD_TORCH, lambda *a: horovodrun(2, *a), "horovodrun", id="torch-horovodrun-gloo"),
    pytest.param(HVD_TORCH, lambda *a: horovodrun(2, *a, controller="--mpi"), "mpiexec", id="torch-horovodrun-mpi"),
    pytest.param(HVD_TF, lambda *a: horovodrun(2, *a), "horovodrun", id="tf-horovodrun-gloo"),
    pytest.param(HVD_KERAS, lambda *a: horovodrun(2, *a), "horovodrun", id="keras-horovodrun-gloo"),
]


# Keras 3's dropout layers draw from their own seed generators, which no checkpoint records: the TensorFlow
# runs that a resumed run is compared with go without dropout. PyTorch reseeds per epoch and keeps it.
FLAGS = {HVD_TORCH: QUICK, HVD_TF: [*QUICK, "--dropout", "0"], HVD_KERAS: QUICK}


def launch_named(name):
    """(script, launch, launcher) of the LAUNCHES row with this id."""
    return next(p.values for p in LAUNCHES if p.id == name)


# How tools/launch.py names each LAUNCHES row's launcher.
LAUNCH_NAMES = {"torch-horovodrun-gloo": "horovodrun", "torch-horovodrun-mpi": "horovodrun-mpi",
                "tf-horovodrun-gloo": "horovodrun",
                "keras-horovodrun-gloo": "horovodrun"}


@pytest.fixture(scope="module")
def quick_run(shared_run):
    """A 2-rank run of FLAGS per (script, launcher), made once: the test that checks it, the resume test that
    compares against it and tests/test_lift_out.py read the same files."""
    return lambda name: shared_run(launch_named(name)[0], LAUNCH_NAMES[name], FLAGS[launch_named(name)[0]])[0]


@pytest.mark.parametrize("script,launch,launcher", LAUNCHES)
def test_two_ranks_train_and_stay_identical(request, quick_run, script, launch, launcher):
    log_dir = quick_run(request.node.callspec.id)
    history = assert_trained_and_identical(log_dir)
    assert history[0]["launcher"] == launcher
    assert_event_epochs(log_dir)  # TensorBoard's event files: every epoch (Keras' fit included)
    # the course's CPU knob (course/dist.HOROVOD_CPU_KNOBS) reached Horovod before hvd.init()
    assert json.loads((log_dir / "config.json").read_text())["horovod_knobs"] == {"HOROVOD_CYCLE_TIME": "5"}


def test_fp16_allreduce_trains_and_keeps_ranks_identical(tmp_path):
    # (and a knob set in the environment wins over the course's default)
    check(run(warm(2, HVD_TORCH, *QUICK, "--fp16-allreduce", "--log-dir", tmp_path, launcher="horovodrun"),
              timeout=300, env={"HOROVOD_CYCLE_TIME": "2"}))
    assert_trained_and_identical(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["horovod_knobs"] == {"HOROVOD_CYCLE_TIME": "2"}


def test_torch_two_ranks_equal_one_process_on_the_combined_batch(tmp_path):
    same = ["--epochs", "1", "--max-steps", "6", "--no-lr-scaling", "--dropout", "0", "--lr", "0.05",
            "--save-model"]
    check(run(warm(2, HVD_TORCH, *same, "--batch-size", "32", "--log-dir", tmp_path / "two", launcher="horovodrun"),
              timeout=300))
    check(run(warm(1, HVD_TORCH, *same, "--batch-size", "64", "--log-dir", tmp_path / "one"), timeout=300))
    two = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=name)


def test_tf_reaches_90_percent_on_real_digits(tmp_path):
    check(run(warm(2, HVD_TF, "--epochs", "2", "--log-dir", tmp_path, launcher="horovodrun"), timeout=400))
    assert metrics(tmp_path)[-1]["test_acc"] >= 0.90


@pytest.mark.parametrize("name", ["torch-horovodrun-gloo", "tf-horovodrun-gloo"], ids=["torch-gloo", "tf-gloo"])
def test_resume_matches_an_uninterrupted_run(tmp_path, quick_run, name):
    """Epoch 1, then --resume to epoch 2 (ranks started warm as horovodrun --gloo's), ends where the 2-epoch run
    of the same flags under horovodrun ended."""
    script, _, _ = launch_named(name)
    straight = quick_run(name)
    for more in (["--epochs", "1"], ["--resume"]):
        check(run(warm(2, script, *FLAGS[script], *more, "--log-dir", tmp_path, launcher="horovodrun"), timeout=300))
    assert summary(tmp_path)["param_checksums"] == summary(straight)["param_checksums"]
    assert [m["epoch"] for m in metrics(tmp_path)] == [1, 2]
    assert metrics(tmp_path)[1]["train_loss"] == pytest.approx(metrics(straight)[1]["train_loss"], abs=1e-9)


def test_adasum_trains_under_mpi_and_is_refused_clearly_under_gloo(tmp_path):
    check(run(mpiexec(2, HVD_TORCH, *QUICK, "--use-adasum", "--log-dir", tmp_path / "mpi"), timeout=300))
    assert_trained_and_identical(tmp_path / "mpi")
    result = run(warm(2, HVD_TORCH, *QUICK, "--use-adasum", "--log-dir", tmp_path / "gloo", launcher="horovodrun"),
                 timeout=180)
    assert_each_rank_refused(result, "Adasum", 2, "warm")


@pytest.mark.parametrize("script", [HVD_TORCH, HVD_TF, HVD_KERAS])
def test_each_lesson_sets_the_cycle_time_the_bench_reports(script):
    """Each Horovod lesson writes its CPU knobs itself (CPU_KNOBS); the bench reads course/dist.py's copy."""
    import ast

    from course.dist import HOROVOD_CPU_KNOBS
    from support import ROOT
    tree = ast.parse((ROOT / script).read_text())
    knobs = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "CPU_KNOBS" for t in node.targets))
    assert knobs == HOROVOD_CPU_KNOBS
