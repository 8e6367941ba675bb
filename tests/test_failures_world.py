"""A job whose world changes: a checkpoint written by 2 ranks continues at 1 and at 4 ranks (DDP,
Horovod).

The checkpoint holds the whole model and optimizer state once, so any world size loads it: the
resumed run starts from exactly the saved weights (checked through the first epoch's checksum being
carried over) and its metrics say the new world size."""

import shutil

import pytest

from failures_support import DDP, HVD_TORCH, checked, tiny  # noqa: F401  (tiny: a fixture)
from support import horovodrun, metrics, run, torchrun

FLAGS = ["--batch-size", "16", "--num-threads", "1", "--seed", "7", "--log-interval", "100"]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((DDP, torchrun), id="ddp-torchrun"),
        pytest.param((HVD_TORCH, horovodrun), id="hvd-torch-horovodrun"),
    ],
)
def written_at_2(request, tmp_path_factory, tiny):
    """One epoch at 2 ranks, with its checkpoint: shared by the resumes at 1 and 4 ranks."""
    script, launcher = request.param
    log_dir = tmp_path_factory.mktemp("world2")
    checked(
        run(
            launcher(2, script, *FLAGS, "--epochs", "1", "--data-dir", tiny, "--log-dir", log_dir),
            timeout=300,
        )
    )
    return script, launcher, log_dir


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_checkpoint_of_2_ranks_continues_at_another_world_size(
    tmp_path, tiny, written_at_2, ranks
):
    script, launcher, written = written_at_2
    log_dir = tmp_path / "log"
    shutil.copytree(written, log_dir)
    result = checked(
        run(
            launcher(
                ranks,
                script,
                *FLAGS,
                "--epochs",
                "2",
                "--resume",
                "--data-dir",
                tiny,
                "--log-dir",
                log_dir,
            ),
            timeout=300,
        )
    )
    assert "continuing at epoch 2" in result.stdout
    history = metrics(log_dir)
    assert [m["epoch"] for m in history] == [1, 2]
    assert [m["world_size"] for m in history] == [2, ranks]
    assert history[0] == metrics(written)[0]  # epoch 1 is the 2-rank run's, kept as it was
    # [4] the LR is scaled to the new world: base LR x ranks (no warmup)
    assert history[1]["lr"] == pytest.approx(history[0]["lr"] / 2 * ranks)
