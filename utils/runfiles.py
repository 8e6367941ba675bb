"""Course plumbing around a run's folder (the files themselves: utils/log.py): whether a
checkpoint is there, how many epochs are done, and the folders a run created, removed again when it
fails before its first result.
"""
import json
import os

from utils import watch

# outermost folders this run created: removed again if it fails before writing a result
_CREATED = []
_DEFAULT_DIR = []  # [True] when the lesson names the run's folder itself (no --log-dir)

# The file each framework writes last when it saves a checkpoint: torch examples,
# tf.train.CheckpointManager, DeepSpeed.
CHECKPOINT_MARKERS = ("checkpoint.pt", "checkpoint", "latest", "latest_universal")


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


def note_default_log_dir():
    """No --log-dir: the lesson names a new folder under runs/ (utils/log.py's default_log_dir)."""
    _DEFAULT_DIR[:] = [True]
    note_new_folder(os.path.join("runs", "_"))


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

    from utils.dist import discover
    if discover().rank != 0:
        return
    chosen = [chosen_log_dir()] if _DEFAULT_DIR and chosen_log_dir() else []
    for folder in _CREATED + chosen:
        if os.path.isdir(folder) and not _holds_results(folder):
            shutil.rmtree(folder, ignore_errors=True)


def chosen_log_dir():
    """The folder of this run's files, once the lesson has opened it (None before)."""
    return watch.RUN_DIR[0] if watch.RUN_DIR else None
