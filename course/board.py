"""TensorBoard event files for a run, written with tensorboardX (course plumbing: the lessons teach
nothing here, and run the same with COURSE_TENSORBOARD=0).

Per epoch: epoch/* (losses, accuracies, lr, samples/s, seconds), x = the epoch; per logged step
(--log-interval): step/train_loss, x = steps since the start of the run. Written by the rank that
writes the run's files, and for the step losses by the rank that prints them (the last pipeline
stage). `tensorboard --logdir runs` shows every run side by side.

tensorboardX, not torch's SummaryWriter: torch's writer imports TensorFlow where it is installed
(3.8 s measured here), which every PyTorch lesson would then pay for.
"""
import os
import sys


def _summary_writer():
    """tensorboardX's SummaryWriter class. tensorboardX imports torch when it can (for its graph
    tools, which the course does not use): in a TensorFlow lesson it must not, since TensorFlow and
    torch's triton crash a process that holds both (tests/conftest.py)."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class Board:
    """The run's event writer: open() names the folder, the first value creates the file."""

    _dir = None
    _writer = None
    EPOCH_KEYS = ("train_loss", "train_acc", "test_loss", "test_acc", "lr", "samples_per_s",
                  "epoch_time_s")

    @staticmethod
    def enabled():
        value = os.environ.get("COURSE_TENSORBOARD", "1").strip().lower()
        return value not in ("0", "off", "false", "no")

    @classmethod
    def open(cls, log_dir, is_main):
        cls.close()
        cls._dir = log_dir if cls.enabled() else None

    @classmethod
    def _scalars(cls, step, values):
        if cls._dir is None:
            return
        if cls._writer is None:
            try:
                writer = _summary_writer()
            except ImportError:
                sys.stdout.write("tensorboardX is not installed: no event files (pip install "
                                 "tensorboardX, or COURSE_TENSORBOARD=0 to silence this)\n")
                sys.stdout.flush()
                cls._dir = None
                return
            # The pid in the name: two writers of one run (rank 0's epochs, the last pipeline
            # stage's steps) never share a file.
            cls._writer = writer(cls._dir, filename_suffix=f".{os.getpid()}", flush_secs=10)
            import atexit
            atexit.register(cls.close)  # a run that stops early still leaves its last steps on disk
        for tag, value in values.items():
            cls._writer.add_scalar(tag, float(value), int(step))

    @classmethod
    def epoch(cls, metrics):
        values = {f"epoch/{k}": metrics[k] for k in cls.EPOCH_KEYS if k in metrics}
        cls._scalars(metrics["epoch"], values)
        if cls._writer is not None:
            cls._writer.flush()  # an epoch is visible in TensorBoard as soon as it is printed

    @classmethod
    def step(cls, global_step, loss):
        cls._scalars(global_step, {"step/train_loss": loss})

    @classmethod
    def close(cls):
        if cls._writer is not None:
            cls._writer.close()
        cls._writer = None
