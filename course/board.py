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
import time


def _event_file():
    """tensorboardX's EventsWriter (one event file, written where it is called: its SummaryWriter
    hands events to a thread and a queue, and its flush() does not wait for them, so a printed line
    could be missing from the file) and the Event and Summary protobufs. tensorboardX imports torch
    when it can (for its graph tools, which the course does not use): in a TensorFlow lesson it must
    not, since TensorFlow and torch's triton crash a process that holds both (tests/conftest.py)."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
    finally:
        if hidden:
            del sys.modules["torch"]
    return EventsWriter, Event, Summary


class Board:
    """The run's event writer: open() names the folder, the first value creates the file, and each
    value is on disk when its call returns (before utils/log.py prints the line that shows it)."""

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
                writer, event, summary = _event_file()
            except ImportError:
                sys.stdout.write("tensorboardX is not installed: no event files (pip install "
                                 "tensorboardX, or COURSE_TENSORBOARD=0 to silence this)\n")
                sys.stdout.flush()
                cls._dir = None
                return
            os.makedirs(cls._dir, exist_ok=True)
            # The pid in the name: two writers of one run (rank 0's epochs, the last pipeline
            # stage's steps) never share a file.
            cls._writer = (writer(os.path.join(cls._dir, "events"), f".{os.getpid()}"), event,
                           summary)
        writer, event, summary = cls._writer
        for tag, value in values.items():
            writer.write_event(event(wall_time=time.time(), step=int(step), summary=summary(
                value=[summary.Value(tag=tag, simple_value=float(value))])))
        writer.flush()

    @classmethod
    def epoch(cls, metrics):
        values = {f"epoch/{k}": metrics[k] for k in cls.EPOCH_KEYS if k in metrics}
        cls._scalars(metrics["epoch"], values)

    @classmethod
    def step(cls, global_step, loss):
        cls._scalars(global_step, {"step/train_loss": loss})

    @classmethod
    def close(cls):
        if cls._writer is not None:
            cls._writer[0].close()
        cls._writer = None
