"""The run's folder: config.json, metrics.jsonl (one line per epoch) and summary.json, written
atomically by rank 0; where its checkpoints live (one rule for every lesson); and the folders a run
created, removed again when it fails before its first result.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from utils.board import Board
from utils.log import _rank, format_epoch, format_summary, info

# outermost folders this run created: removed again if it fails before writing a result
_CREATED = []
_LOG_DIR = []  # the run's log dir when the lesson chose it (default_log_dir): for a failure's line

# The file each framework writes last when it saves a checkpoint: torch examples,
# tf.train.CheckpointManager, DeepSpeed.
CHECKPOINT_MARKERS = ("checkpoint.pt", "checkpoint", "latest")


def checkpoint_folder(checkpoint_dir, log_dir):
    """Where a run keeps its checkpoints, the one rule every lesson follows: --checkpoint-dir, else
    <log-dir>/checkpoints (a Path; None if neither is set)."""
    if checkpoint_dir or log_dir:
        return Path(checkpoint_dir or Path(log_dir) / "checkpoints")
    return None


def has_checkpoint(folder):
    return any(os.path.isfile(os.path.join(folder, name)) for name in CHECKPOINT_MARKERS)


def epochs_done(log_dir):
    """The last epoch in <log_dir>/metrics.jsonl (0 if there is none)."""
    try:
        with open(os.path.join(log_dir or "", "metrics.jsonl")) as f:
            return max((json.loads(line)["epoch"] for line in f if line.strip()), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def note_new_folder(path):
    """Remember the outermost folder of `path` that does not exist yet: if the run fails before
    any result is in it (nothing but config.json and TensorBoard's events), run_main removes it
    again, so a failed start leaves no debris."""
    if not path:
        return
    folder, top = os.path.abspath(path), None
    while not os.path.lexists(folder):
        top, folder = folder, os.path.dirname(folder)
    if top and top not in _CREATED:
        _CREATED.append(top)


def _holds_results(folder):
    """A result: anything but the run's config, a half-written temporary file, or TensorBoard's
    events (step losses are written before the first epoch ends)."""
    skipped = (".tmp-", "events.out.tfevents.")
    return any(name != "config.json" and not name.startswith(skipped)
               for _, _, files in os.walk(folder) for name in files)


def remove_debris():
    """Remove the folders this run created and left without a result (rank 0 made them; rank 0
    removes)."""
    import shutil

    if _rank() != 0:
        return
    for folder in _CREATED:
        if os.path.isdir(folder) and not _holds_results(folder):
            shutil.rmtree(folder, ignore_errors=True)


def default_log_dir(script_name):
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join("runs", f"{script_name}-{stamp}")
    note_new_folder(path)
    _LOG_DIR[:] = _LOG_DIR or [path]
    return path


def chosen_log_dir():
    """The log dir default_log_dir() chose for this run (None if it chose none)."""
    return _LOG_DIR[0] if _LOG_DIR else None


def atomic_write(path, write_fn, mode="w"):
    """Write via a temporary file in the same folder, fsync, then rename: a crash leaves the old
    file intact."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
    try:
        with os.fdopen(fd, mode) as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2, sort_keys=True, default=str))


class RunLog:
    """config.json, metrics.jsonl (one line per epoch) and summary.json in --log-dir, written by
    rank 0, and TensorBoard's event files beside them (see Board; COURSE_TENSORBOARD=0 turns them
    off)."""

    def __init__(self, log_dir, is_main):
        self.dir = log_dir
        self.is_main = is_main
        self.metrics_path = os.path.join(log_dir, "metrics.jsonl")
        self.history = []
        if is_main:
            os.makedirs(log_dir, exist_ok=True)
        Board.open(log_dir, is_main)

    def write_config(self, args, env, framework, extra=None):
        if self.is_main:
            config = dict(vars(args), framework=framework, **env, **(extra or {}))
            write_json(os.path.join(self.dir, "config.json"), config)

    def keep_epochs_before(self, first_epoch):
        """On resume: keep the lines of the epochs already done, so the history reads as one run."""
        if not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path) as f:
            self.history = [json.loads(line) for line in f if line.strip()]
        self.history = [m for m in self.history if m["epoch"] < first_epoch]
        if self.is_main:
            atomic_write(self.metrics_path,
                         lambda f: f.writelines(json.dumps(m) + "\n" for m in self.history))

    def epoch(self, metrics):
        self.history.append(metrics)
        if self.is_main:
            # Rewritten whole and renamed, so a kill never leaves half a line behind.
            atomic_write(self.metrics_path,
                         lambda f: f.writelines(json.dumps(m) + "\n" for m in self.history))
            Board.epoch(metrics)
        info(format_epoch(metrics))

    def epoch_end(self, epoch, sums, lr, epoch_time_s, train_time_s, env, framework):
        """Record one epoch from the metric sums over all ranks (train loss/correct/seen, test
        loss/correct/seen)."""
        train_loss, train_correct, train_seen, test_loss, test_correct, test_seen = sums
        self.epoch(dict(epoch=epoch, train_loss=train_loss / train_seen,
                        train_acc=train_correct / train_seen,
                        test_loss=test_loss / test_seen, test_acc=test_correct / test_seen, lr=lr,
                        epoch_time_s=epoch_time_s, train_time_s=train_time_s,
                        # global: all ranks' samples / slowest rank's time
                        samples_per_s=train_seen / train_time_s,
                        world_size=env.world_size, framework=framework, launcher=env.launcher))

    def summary(self, extra):
        """Last epoch's numbers + `extra` into summary.json, and the table on stdout."""
        last = self.history[-1] if self.history else {}
        summary = dict(last, **extra)
        if (peak := peak_accelerator_mb()) is not None:  # rank 0's, on a GPU
            summary["peak_accelerator_mb"] = peak
        if self.is_main:
            write_json(os.path.join(self.dir, "summary.json"), summary)
        Board.close()
        info(format_summary(summary, self.dir))
        return summary


def peak_accelerator_mb():
    """This process's peak GPU memory in MB (torch's allocator: tensors, not its cache), or None
    where it used no GPU. The TensorFlow lessons never import torch: None there too."""
    torch = sys.modules.get("torch")
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available() and module.is_initialized():
            return round(module.max_memory_allocated() / 2**20, 1)
    return None
