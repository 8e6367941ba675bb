"""Course plumbing around a run's folder (the files themselves: utils/log.py): whether a
checkpoint is there, how many epochs are done, and the folders a run created, removed again when it
fails before its first result.
"""
import json
import os

from course import watch

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


ENDING = "ending.txt"  # a run that trained, then ended badly: the line each rank ended with
LOCK = ".lock"  # a run's folder: byte r locked by rank r while it runs; the holder written in
_HELD = []  # the open lock file: the lock lasts as long as the process, and dies with it


def take_log_dir(log_dir, rank, command):
    """Rank `rank` of this run takes `log_dir`: a POSIX record lock on byte `rank` of
    <log_dir>/.lock, released by the kernel when the process ends, however it ends (no stale pid
    file). Every rank of a second run on the folder meets the lock of its counterpart and is refused
    in one line that names the holder; once the first run has ended, a rerun (a resume) takes the
    folder again. Nothing if the file system has no locks (the run goes on, unguarded)."""
    import fcntl
    import socket
    import time

    from course.errors import UserError
    created = outermost_missing(log_dir)  # what this rank's makedirs creates (None: nothing)
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank, os.SEEK_SET)
    except OSError as exc:
        if exc.errno not in (11, 13):  # EAGAIN, EACCES: held. ENOLCK and the like: no locks here
            os.close(fd)
            return
        holder = holder_of(log_dir) or "another process"
        os.close(fd)
        raise UserError(f"{log_dir} is in use by another run ({holder}): wait for it to end (then "
                        "--resume continues it), or choose another --log-dir") from None
    if rank == 0:  # the folder is this run's: removed again if it fails before a result. What this
        # rank created, or the folder itself if it holds nothing but locks (this run's other ranks
        # made it just now); never a folder above it that was there before, even an empty one
        fresh = all(name == LOCK for name in files_under(log_dir))
        remember_created(created or (os.path.abspath(log_dir) if fresh else None))
        # who holds it, for the refusal's line (past bytes 0..ranks: the locks are apart)
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {when}: {command}"
                  .encode()[:4000].ljust(4096), 0)  # (the locks are on bytes, not on the content)
    _HELD.append(fd)


def holder_of(log_dir):
    """Who holds `log_dir` as its rank 0 (the line take_log_dir wrote), or None if nobody does."""
    import fcntl
    try:
        fd = os.open(os.path.join(log_dir or "", LOCK), os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError:
            return " ".join(f.read().split()) or "another process"
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0, os.SEEK_SET)
    return None


def files_under(folder):
    return [name for _, _, names in os.walk(folder) for name in names]


def outermost_missing(path):
    """The outermost folder of `path` that does not exist yet (what os.makedirs would create), or
    None."""
    folder, top = os.path.abspath(path), None
    while not os.path.lexists(folder):
        top, folder = folder, os.path.dirname(folder)
    return top


def remember_created(folder):
    """If the run fails before any result is in `folder` (nothing but config.json and TensorBoard's
    events), run_main removes it again, so a failed start leaves no debris."""
    if folder and folder not in _CREATED:
        _CREATED.append(folder)


def note_new_folder(path):
    """Remember the outermost folder of `path` that does not exist yet (remember_created)."""
    if path:
        remember_created(outermost_missing(path))


def note_default_log_dir():
    """No --log-dir: the lesson names a new folder under runs/ (utils/log.py's default_log_dir)."""
    _DEFAULT_DIR[:] = [True]
    note_new_folder(os.path.join("runs", "_"))


def _holds_results(folder):
    """A result: anything but the run's config, a half-written temporary file, or TensorBoard's
    events (step losses are written before the first epoch ends)."""
    skipped = (".tmp-", "events.out.tfevents.")
    return any(name not in ("config.json", LOCK) and not name.startswith(skipped)
               for name in files_under(folder))


def remove_debris():
    """Remove the folders this run created and left without a result (rank 0 made them; rank 0
    removes), if it never took a training step: a run that trained, then failed or was stopped,
    keeps its folder as evidence (config.json, its event files, ending.txt)."""
    import shutil

    from course.ranks import discover
    if discover().rank != 0 or watch.POSITION:  # a run that took a training step keeps its folder
        return
    chosen = [chosen_log_dir()] if _DEFAULT_DIR and chosen_log_dir() else []
    for folder in _CREATED + chosen:
        if os.path.isdir(folder) and not _holds_results(folder):
            shutil.rmtree(folder, ignore_errors=True)


def chosen_log_dir():
    """The folder of this run's files, once the lesson has opened it (None before)."""
    return watch.RUN_DIR[0] if watch.RUN_DIR else None


def write_ending(line, code, rank):
    """Each rank's one line, appended to the folder of a run that ended badly (when, which rank, the
    exit code), if the folder is still there (remove_debris keeps a run that trained)."""
    import time
    folder = chosen_log_dir()
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, ENDING), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, exit {code}: {line}\n")


def tell_what_is_there(args):
    """A new run in the folder of one that ended badly: rank 0 says how it ended and what this run
    does with it; the ending then goes (the folder is this run's)."""
    from course.ranks import discover
    log_dir = getattr(args, "log_dir", None)
    path = os.path.join(log_dir or "", ENDING)
    if discover().rank != 0 or not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.read().splitlines() or ["(empty)"]
    print(f"{log_dir} holds a run that ended badly ({ENDING}: {lines[0]}); this run continues it with "
          "--resume, else starts at epoch 1 and replaces its files", flush=True)
    os.remove(path)
