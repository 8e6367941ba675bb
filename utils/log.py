"""Rank-aware logging, the run's files (config.json, metrics.jsonl, summary.json) and atomic writes.

Every rank computes the same averaged metrics; only rank 0 prints and writes them, so a 512-rank job
produces one log, not 512.
"""
import atexit
import json
import os
import socket
import sys
import tempfile
import time

from utils.errors import UserError, fail  # re-exported: the lessons' log.fail, log.UserError

_RANK = None  # configure() sets it; None: a failure before it
_ALL_RANKS = False
_PREFIX = ""


def configure(rank, local_rank=0, log_all_ranks=False):
    """Who prints: rank 0, or with --log-all-ranks every rank, prefixed by its global and local
    rank."""
    global _RANK, _ALL_RANKS, _PREFIX
    _RANK, _ALL_RANKS = rank, log_all_ranks
    _PREFIX = f"[rank {rank}, local {local_rank}] " if log_all_ranks else ""


def _rank():
    """This rank's number: the one configure() was given. A failure before configure() (a bad
    device, a signal during start-up) reads it from the launcher's variables instead."""
    if _RANK is not None:
        return _RANK
    from utils.dist import discover  # imported here: utils.dist imports nothing from this module
    return discover().rank


def info(message):
    """Print on rank 0 (or on every rank with --log-all-ranks, prefixed by its global and local
    rank)."""
    if _rank() == 0 or _ALL_RANKS:
        # One write per line (print() writes text and newline apart): lines from ranks sharing a
        # pipe stay whole.
        prefix = _PREFIX if _ALL_RANKS else ""
        lines = (message + "\n").splitlines(True)
        sys.stdout.write("".join(prefix + line for line in lines))
        sys.stdout.flush()


# What the frameworks raise on a rank whose peer died or stopped answering: torch.distributed's
# Dist*Error classes, Horovod's HorovodInternalError, and plain RuntimeErrors (or TensorFlow errors)
# from gloo/Horovod.
PEER_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
                    "HorovodInternalError")
PEER_ERROR_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "Timed out waiting", "timed out", "Horovod has been shut down", "gloo")
TIMEOUT_TEXTS = ("Timed out", "timed out", "Timeout", "timeout")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANGS_PAGE = "diagnose/hangs.md"


def is_peer_failure(exc):
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & set(PEER_ERROR_TYPES)) or any(text in str(exc) for text in PEER_ERROR_TEXTS)


# --- what the one line of a failed or stopped run needs to know ----------------------------------
_POSITION = {}  # epoch, step, total: the last training step this rank finished (Progress.update)
_RUN = {}  # args (utils.parse_args.parse), log_dir (default_log_dir)
# outermost folders this run created: removed again if it fails before writing a result
_CREATED = []


def at_step(epoch, step, total):
    _POSITION.update(epoch=epoch, step=step, total=total, at=time.monotonic())


def note_args(args):
    _RUN["args"] = args


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


def _where():
    if not _POSITION:
        return "before any training step it reported"
    p = _POSITION
    return f"in epoch {p['epoch']} after step {p['step']}/{p['total']}"


def _last_checkpoint():
    """(the newest complete checkpoint as 'DIR (epoch N)' or None, the log dir)."""
    from utils.parse_args import checkpoint_folder, epochs_done, has_checkpoint
    args = _RUN.get("args")
    log_dir = getattr(args, "log_dir", None) or _RUN.get("log_dir")
    folder = checkpoint_folder(getattr(args, "checkpoint_dir", None), log_dir)
    if not folder or not has_checkpoint(folder):
        return None, log_dir
    done = epochs_done(log_dir)
    return f"{folder}" + (f" (epoch {done})" if done else ""), log_dir


def _stopped_line(signum):
    import signal

    checkpoint, log_dir = _last_checkpoint()
    rerun = "rerun with --resume auto" + (f" --log-dir {log_dir}" if log_dir else "")
    kept = (f"last good checkpoint: {checkpoint}; {rerun} to continue from it" if checkpoint else
            "no checkpoint written yet: a rerun starts at epoch 1")
    return f"rank {_rank()} stopped by {signal.Signals(signum).name} {_where()}: {kept}"


def _frames(exc):
    import traceback
    return traceback.extract_tb(exc.__traceback__)


def _waited_where(exc):
    """('all_reduce', 'DDP/main.py:152') for the collective that failed and the course's line that
    called it."""
    frames = _frames(exc)
    # (a virtual environment may live inside the checkout)
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(ROOT + os.sep)
            and "site-packages" not in f.filename]
    if not ours:
        return None, None
    mine = frames[ours[-1]]
    below = frames[ours[-1] + 1:]
    dist_calls = [f.name for f in below if "distributed" in f.filename or "horovod" in f.filename]
    what = next((name for name in dist_calls if not name.startswith("_") and name != "wrapper"),
                below[0].name if below else mine.line.split("(")[0].strip())
    return what, f"{os.path.relpath(mine.filename, ROOT)}:{mine.lineno}"


def _peer_line(exc):
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
        port = os.environ.get("MASTER_PORT", "?")
        return (f"rank {_rank()} cannot listen on MASTER_PORT {port}: address already in use "
                "(another run or connection on this node holds it); "
                "set MASTER_PORT to a free port")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    peer_line = next((line for line in lines if any(text in line for text in PEER_ERROR_TEXTS)),
                     lines[0])
    detail = next((line for line in lines if "monitoredBarrier" in line), peer_line)[:240]
    what, where = _waited_where(exc)
    call = f"in {what} at {where} " if where else ""
    rank = _rank()
    timeout = getattr(_RUN.get("args"), "dist_timeout", None)
    # Horovod reports a gloo timeout only as "Horovod has been shut down": the time since the last
    # step says it
    since = time.monotonic() - _POSITION["at"] if "at" in _POSITION else 0
    if any(text in str(exc) for text in TIMEOUT_TEXTS) or (timeout and since >= 0.9 * timeout):
        import re
        ms = re.search(r"(\d+)\s*ms", str(exc))
        waited = (f"{int(ms.group(1)) / 1000:g} s" if ms else f"{since:.0f} s" if since else
                  f"{timeout} s (--dist-timeout)" if timeout else "")
        # gloo names the rank
        absent = re.search(r"Rank (\d+) failed to pass monitoredBarrier", str(exc))
        who = (f"rank {absent.group(1)}, which never arrived" if absent else
               "a rank that never joined it")
        return (f"rank {rank} waited {waited} {call}{_where()} for {who} "
                f"(hung, stopped or elsewhere); "
                f"next: while it hangs, `python diagnose/stacks.py` shows where every rank is "
                f"({HANGS_PAGE}) [{detail}]")
    return (f"rank {rank} lost contact with another rank {call}{_where()} (it died, or hung past "
            f"the collective timeout): {detail}")


def run_main(main):
    """Call main(), and end every way it can go wrong in one line on stderr instead of a traceback:

    - a UserError (bad input): one line, exit 2;
    - SIGINT or SIGTERM (Ctrl-C, a scheduler's walltime): where it stopped, the last good
      checkpoint and how to continue; exit 130 or 143 (utils/interrupts.py);
    - a lost peer (a rank that died, or hung past the collective timeout): which rank waited, in
      which collective at which line, in which epoch and step, and what to do next; exit 1.

    A finished main() leaves through _leave_finished(): exit 0 without the interpreter's
    finalization (why: its docstring).

    A run that fails before its first result removes the folders it created. Under torchrun the
    line also goes into the worker's error file, so torchrun's report names it as the cause. A bug
    keeps its traceback.
    """
    from utils import interrupts
    interrupts.install()
    try:
        main()
        _leave_finished()
    except SystemExit as exc:
        if exc.code not in (0, None):
            remove_debris()
        raise
    except BaseException as exc:
        # A signal from here on (the launcher's SIGTERM after a peer died) is noted, not raised.
        signum = interrupts.ending()
        if signum is None and isinstance(exc, KeyboardInterrupt):
            signum = 2
        # stopped on purpose; a peer error after it is the same stop seen later
        if signum is not None:
            _quit(_stopped_line(signum), interrupts.exit_code(signum), prefix="stopped")
        remove_debris()
        if isinstance(exc, UserError):
            fail(str(exc))
        if not is_peer_failure(exc):
            import traceback

            from utils.errors import record_for_torchrun
            # torchrun's report shows it (as @record would)
            record_for_torchrun(traceback.format_exc())
            raise  # a bug: keep the traceback
        _quit(_peer_line(exc), 1)


def _leave_finished():
    """Exit 0 after the exit handlers (Horovod's shutdown, mpi4py's MPI_Finalize, the TensorBoard
    file's close), without the interpreter's finalization. destroy_process_group() only unregisters
    the process group: the wrapped model (DDP's reducer, DeepSpeed's engine, FSDP2's mesh) still
    holds it, and with it gloo's threads. Finalization would tear those down in no fixed order,
    which can abort a rank after its summary ("terminate called without an active exception")."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _quit(line, code, prefix="error"):
    """One line, then out at once: a rank whose peers are gone must not wait in the libraries' exit
    hooks."""
    from utils.errors import say
    remove_debris()
    sys.stdout.flush()
    say(line, prefix)
    os._exit(code)


def default_log_dir(script_name):
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join("runs", f"{script_name}-{stamp}")
    note_new_folder(path)
    _RUN.setdefault("log_dir", path)
    return path


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
        if self.is_main:
            write_json(os.path.join(self.dir, "summary.json"), summary)
        Board.close()
        info(format_summary(summary, self.dir))
        return summary


def format_epoch(m):
    return (f"epoch {m['epoch']:>2}  "
            f"train_loss {m['train_loss']:.4f}  train_acc {m['train_acc']:.4f}  "
            f"test_loss {m['test_loss']:.4f}  test_acc {m['test_acc']:.4f}  lr {m['lr']:.4g}  "
            f"{m['samples_per_s']:.0f} samples/s  {m['epoch_time_s']:.1f}s")


def format_summary(s, log_dir):
    rows = [("framework", s.get("framework")), ("launcher", s.get("launcher")),
            ("ranks", s.get("world_size")), ("device", s.get("device")),
            ("epochs", s.get("epoch")), ("test accuracy", f"{s.get('test_acc', float('nan')):.4f}"),
            ("samples/s (global)", f"{s.get('samples_per_s', float('nan')):.0f}"),
            ("wall time", f"{s.get('wall_time_s', float('nan')):.1f} s"), ("log dir", log_dir)]
    width = max(len(k) for k, _ in rows)
    lines = ["", "summary", "-" * 40] + [f"{k:<{width}}  {v}" for k, v in rows] + ["-" * 40]
    return "\n".join(lines)


class Progress:
    """Rank 0's view of an epoch: a progress bar on a terminal, else a line every --log-interval
    steps."""

    def __init__(self, enabled, total, epoch, interval):
        self.enabled, self.total, self.epoch, self.interval = enabled, total, epoch, interval
        self.bar = enabled and sys.stdout.isatty()

    def update(self, step, loss):
        at_step(self.epoch, step, self.total)
        if not self.enabled:
            return
        if (step % self.interval == 0 or step == self.total) and loss is not None:
            Board.step((self.epoch - 1) * self.total + step, loss)
        if self.bar:
            done = int(30 * step / max(1, self.total))
            print(f"\repoch {self.epoch} [{'#' * done}{'.' * (30 - done)}] "
                  f"{step}/{self.total} loss {loss:.4f}", end="", flush=True)
        elif step % self.interval == 0 or step == self.total:
            print(f"epoch {self.epoch} step {step}/{self.total} loss {loss:.4f}", flush=True)

    def close(self):
        if self.bar:
            print("\r" + " " * 80 + "\r", end="", flush=True)


def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data):
    """The checksum TFRecord files carry (CRC-32C, rotated and offset as TensorFlow's record writer
    does)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class Board:
    """TensorBoard event files in the run's log dir. Per epoch: epoch/* (losses, accuracies, lr,
    samples/s, seconds), x = the epoch; per logged step (--log-interval): step/train_loss, x = steps
    since the start of the run. Written by the rank that writes the run's files, and for the step
    losses by the rank that prints them (the last pipeline stage). `tensorboard --logdir runs` shows
    every run side by side. COURSE_TENSORBOARD=0 turns it off.

    The records are written here (TFRecord framing around tensorboard's Event protobuf), not with
    tensorboard's or torch's SummaryWriter: their event writer imports TensorFlow when it is
    installed, which would load TensorFlow into every PyTorch lesson (tens of seconds on a busy
    machine)."""

    _dir = None
    _file = None
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
    def _write(cls, event):
        data = event.SerializeToString()
        header = len(data).to_bytes(8, "little")
        cls._file.write(header + _masked_crc32c(header).to_bytes(4, "little") + data
                        + _masked_crc32c(data).to_bytes(4, "little"))

    @classmethod
    def _scalars(cls, step, values):
        if cls._dir is None:
            return
        if cls._file is None:
            try:
                from tensorboard.compat.proto import event_pb2, summary_pb2
            except ImportError:
                info("tensorboard is not installed: no event files (pip install tensorboard, or "
                     "COURSE_TENSORBOARD=0 to silence this)")
                cls._dir = None
                return
            cls._proto = (event_pb2, summary_pb2)
            os.makedirs(cls._dir, exist_ok=True)
            name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
            cls._file = open(os.path.join(cls._dir, name), "ab")
            cls._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
            atexit.register(cls.close)  # a run that stops early still leaves its last steps on disk
        event_pb2, summary_pb2 = cls._proto
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        cls._write(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    @classmethod
    def epoch(cls, metrics):
        values = {f"epoch/{k}": metrics[k] for k in cls.EPOCH_KEYS if k in metrics}
        cls._scalars(metrics["epoch"], values)
        if cls._file is not None:
            cls._file.flush()  # an epoch is visible in TensorBoard as soon as it is printed

    @classmethod
    def step(cls, global_step, loss):
        cls._scalars(global_step, {"step/train_loss": loss})

    @classmethod
    def close(cls):
        if cls._file is not None:
            cls._file.close()
        cls._file = None
