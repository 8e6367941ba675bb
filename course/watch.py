"""Course plumbing that listens to utils/log.py (plumbing.py registers it; a lesson's copy runs
without it): the run's TensorBoard event files (board.py), and what a one-line failure report needs
(failures.py): the training step this rank last finished, and the folder of the run's files; and a
non-finite loss stops the run before it writes a checkpoint."""
import math
import sys
import time

from course.board import Board
from course.errors import NonFiniteLoss

POSITION = {}  # epoch, step, total, at: the last training step this rank finished
RUN_DIR = []  # the folder of this process's RunLog
MOVED = []  # called at each step (course/beacon.py: the rank's key in the store follows)


class Watch:
    """Hears the lessons' log.Progress and log.RunLog (plumbing.py registers it with log.listen):
    TensorBoard's event files, the failure reports' position, and a non-finite loss stopped."""

    def step(self, progress, step, loss):
        POSITION.update(epoch=progress.epoch, step=step, total=progress.total, at=time.monotonic())
        for moved in MOVED:
            moved()
        if loss is not None and not math.isfinite(loss):  # stop before a checkpoint is written
            raise NonFiniteLoss(loss, progress.epoch, step, progress.total)

    def logged(self, progress, step, loss):  # every --log-interval steps, as the printed lines
        Board.step((progress.epoch - 1) * progress.total + step, loss)

    def opened(self, run_log):
        RUN_DIR[:] = [run_log.dir]
        Board.open(run_log.dir, run_log.is_main)

    def epoch(self, run_log, epoch, sums):  # (sums: over all ranks, the same on each)
        for loss, seen, which in ((sums[0], sums[2], "training"), (sums[3], sums[5], "test")):
            if not math.isfinite(loss):  # every rank stops here, before the epoch's checkpoint
                raise NonFiniteLoss(loss / seen, epoch, which=which)

    def epoch_logged(self, run_log, metrics):
        if run_log.is_main:
            Board.epoch(metrics)

    def summary(self, run_log):
        Board.close()  # (before the summary table: it ends the run's output)
        peak = peak_accelerator_mb()  # (a GPU's: the course's GPU check reads it)
        return {} if peak is None else {"peak_accelerator_mb": peak}


def peak_accelerator_mb():  # this process's peak GPU memory in MB (tensors, not the cache), or None
    torch = sys.modules.get("torch")  # (the TensorFlow lessons never import torch)
    for gpu in [getattr(torch, kind, None) for kind in ("cuda", "xpu")]:
        if gpu is not None and gpu.is_available() and gpu.is_initialized():
            return round(gpu.max_memory_allocated() / 2**20, 1)
    return None
