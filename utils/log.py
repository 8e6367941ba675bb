"""Rank-aware logging, the run's files (config.json, metrics.jsonl, summary.json) and atomic writes.

Every rank computes the same averaged metrics; only rank 0 prints and writes them, so a 512-rank job
produces one log, not 512.
"""
import json
import os
import sys
import tempfile
import time

from utils.errors import UserError, fail  # re-exported: the lessons' log.fail, log.UserError

_RANK = 0
_ALL_RANKS = False
_PREFIX = ""


def configure(rank, local_rank=0, log_all_ranks=False):
    """Who prints: rank 0, or with --log-all-ranks every rank, prefixed by its global and local rank."""
    global _RANK, _ALL_RANKS, _PREFIX
    _RANK, _ALL_RANKS = rank, log_all_ranks
    _PREFIX = f"[rank {rank}, local {local_rank}] " if log_all_ranks else ""


def info(message):
    """Print on rank 0 (or on every rank with --log-all-ranks, prefixed by its global and local rank)."""
    if _RANK == 0 or _ALL_RANKS:
        # One write per line (print() writes text and newline apart): lines from ranks sharing a pipe stay whole.
        prefix = _PREFIX if _ALL_RANKS else ""
        sys.stdout.write("".join(prefix + line for line in (message + "\n").splitlines(True)))
        sys.stdout.flush()


# What the frameworks raise on a rank whose peer died or stopped answering: torch.distributed's Dist*Error
# classes, Horovod's HorovodInternalError, and plain RuntimeErrors (or TensorFlow errors) from gloo/Horovod.
PEER_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "HorovodInternalError")
PEER_ERROR_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                    "timed out", "Horovod has been shut down", "gloo")


def is_peer_failure(exc):
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & set(PEER_ERROR_TYPES)) or any(text in str(exc) for text in PEER_ERROR_TEXTS)


def run_main(main):
    """Call main(); turn a UserError into one line on stderr and exit 2, and a lost peer (a rank that died or
    hung past the collective timeout) into one line and exit 1, on whichever rank meets it."""
    try:
        main()
    except UserError as exc:
        fail(str(exc))
    except Exception as exc:
        if not is_peer_failure(exc):
            raise  # a bug: keep the traceback
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        detail = next((line for line in lines if any(text in line for text in PEER_ERROR_TEXTS)), lines[0])[:240]
        fail(f"lost contact with another rank (it died, or hung past the collective timeout): {detail}", code=1)


def default_log_dir(script_name):
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{script_name}-{stamp}")


def atomic_write(path, write_fn, mode="w"):
    """Write via a temporary file in the same folder, fsync, then rename: a crash leaves the old file intact."""
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
    """config.json, metrics.jsonl (one line per epoch) and summary.json in --log-dir, written by rank 0."""

    def __init__(self, log_dir, is_main):
        self.dir = log_dir
        self.is_main = is_main
        self.metrics_path = os.path.join(log_dir, "metrics.jsonl")
        self.history = []
        if is_main:
            os.makedirs(log_dir, exist_ok=True)

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
            atomic_write(self.metrics_path, lambda f: f.writelines(json.dumps(m) + "\n" for m in self.history))

    def epoch(self, metrics):
        self.history.append(metrics)
        if self.is_main:
            # Rewritten whole and renamed, so a kill never leaves half a line behind.
            atomic_write(self.metrics_path, lambda f: f.writelines(json.dumps(m) + "\n" for m in self.history))
        info(format_epoch(metrics))

    def epoch_end(self, epoch, sums, lr, epoch_time_s, train_time_s, env, framework):
        """Record one epoch from the metric sums over all ranks (train loss/correct/seen, test loss/correct/seen)."""
        train_loss, train_correct, train_seen, test_loss, test_correct, test_seen = sums
        self.epoch(dict(epoch=epoch, train_loss=train_loss / train_seen, train_acc=train_correct / train_seen,
                        test_loss=test_loss / test_seen, test_acc=test_correct / test_seen, lr=lr,
                        epoch_time_s=epoch_time_s, train_time_s=train_time_s,
                        samples_per_s=train_seen / train_time_s,  # global: all ranks' samples / slowest rank's time
                        world_size=env.world_size, framework=framework, launcher=env.launcher))

    def summary(self, extra):
        """Last epoch's numbers + `extra` into summary.json, and the table on stdout."""
        last = self.history[-1] if self.history else {}
        summary = dict(last, **extra)
        if self.is_main:
            write_json(os.path.join(self.dir, "summary.json"), summary)
        info(format_summary(summary, self.dir))
        return summary


def format_epoch(m):
    return (f"epoch {m['epoch']:>2}  train_loss {m['train_loss']:.4f}  train_acc {m['train_acc']:.4f}  "
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
    """Rank 0's view of an epoch: a progress bar on a terminal, else a line every --log-interval steps."""

    def __init__(self, enabled, total, epoch, interval):
        self.enabled, self.total, self.epoch, self.interval = enabled, total, epoch, interval
        self.bar = enabled and sys.stdout.isatty()

    def update(self, step, loss):
        if not self.enabled:
            return
        if self.bar:
            done = int(30 * step / max(1, self.total))
            print(f"\repoch {self.epoch} [{'#' * done}{'.' * (30 - done)}] {step}/{self.total} loss {loss:.4f}",
                  end="", flush=True)
        elif step % self.interval == 0 or step == self.total:
            print(f"epoch {self.epoch} step {step}/{self.total} loss {loss:.4f}", flush=True)

    def close(self):
        if self.bar:
            print("\r" + " " * 80 + "\r", end="", flush=True)
