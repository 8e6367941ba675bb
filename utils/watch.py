"""Course plumbing around utils/log.py, from outside (plumbing.py installs it; a lesson's copy runs
without it): the run's TensorBoard event files (board.py), and what a one-line failure report needs
(failures.py): the training step this rank last finished, and the folder of the run's files; and a
non-finite loss stops the run before it writes a checkpoint."""
import math
import sys
import time

from utils.board import Board
from utils.errors import NonFiniteLoss

POSITION = {}  # epoch, step, total, at: the last training step this rank finished
RUN_DIR = []  # the folder of this process's RunLog
MOVED = []  # called at each step (utils/beacon.py: the rank's key in the store follows)


def install(log):
    """log.Progress and log.RunLog, as the lessons call them, also feed TensorBoard and the
    failure reports. Once per process."""
    if getattr(log.RunLog, "watched", False):
        return

    class Progress(log.Progress):
        def update(self, step, loss):
            POSITION.update(epoch=self.epoch, step=step, total=self.total, at=time.monotonic())
            for moved in MOVED:
                moved()
            if loss is not None and not math.isfinite(loss):  # stop before a checkpoint is written
                raise NonFiniteLoss(loss, self.epoch, step, self.total)
            printed = super().update(step, loss)
            if printed:  # a step loss every --log-interval steps: the same as the printed lines
                Board.step((self.epoch - 1) * self.total + step, loss)
            return printed

    class RunLog(log.RunLog):
        watched = True

        def __init__(self, log_dir, is_main):
            super().__init__(log_dir, is_main)
            RUN_DIR[:] = [log_dir]
            Board.open(log_dir, is_main)

        def epoch_end(self, epoch, sums, *args):  # (sums: over all ranks, the same on each)
            for loss, seen, which in ((sums[0], sums[2], "training"), (sums[3], sums[5], "test")):
                if not math.isfinite(loss):  # every rank stops here, before the epoch's checkpoint
                    raise NonFiniteLoss(loss / seen, epoch, which=which)
            super().epoch_end(epoch, sums, *args)
            if self.is_main:
                Board.epoch(self.history[-1])

        def summary(self, extra):
            Board.close()  # (before the summary table: it ends the run's output)
            peak = peak_accelerator_mb()  # (a GPU's: the course's GPU check reads it)
            more = {} if peak is None else {"peak_accelerator_mb": peak}
            return super().summary({**extra, **more})

    log.Progress, log.RunLog = Progress, RunLog


def peak_accelerator_mb():  # this process's peak GPU memory in MB (tensors, not the cache), or None
    torch = sys.modules.get("torch")  # (the TensorFlow lessons never import torch)
    for gpu in [getattr(torch, kind, None) for kind in ("cuda", "xpu")]:
        if gpu is not None and gpu.is_available() and gpu.is_initialized():
            return round(gpu.max_memory_allocated() / 2**20, 1)
    return None
