"""Logging: rank 0 prints (a 512-rank job makes one log, not 512), and writes the run's files in
--log-dir atomically: config.json, metrics.jsonl (a line an epoch), summary.json."""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_RANK, _PREFIX = 0, None  # configure(): this rank; with --log-all-ranks, its line prefix

# Two extension points, empty in a lesson's copy. Only the course's plumbing registers here
# (course/README.md lists who). listen(): an object told of each run, step, epoch and summary by
# its methods of these names, where it has them: opened(run_log), step(progress, step, loss) and
# logged(progress, step, loss) before the step's line, epoch(run_log, epoch, sums), and after the
# files epoch_logged(run_log, metrics) before the epoch's line (a printed line is recorded first),
# summary(run_log) -> more for summary.json. seal_with(): a function sealer(path, write_fn, mode)
# that atomic_write asks first, True if it wrote the file itself (a checkpoint, its files' SHA-256).
_LISTENERS, _SEALERS = [], []


def listen(listener):
    _LISTENERS.append(listener)


def seal_with(sealer):
    _SEALERS.append(sealer)


def _tell(event, *values):  # what each listener's method `event` returns
    return [getattr(one, event)(*values) for one in _LISTENERS if hasattr(one, event)]


def configure(rank, local_rank=0, log_all_ranks=False):
    global _RANK, _PREFIX
    _RANK, _PREFIX = rank, f"[rank {rank}, local {local_rank}] " if log_all_ranks else None


def info(message):
    """Print on rank 0, or on every rank with --log-all-ranks: whole lines, one write each."""
    if _RANK == 0 or _PREFIX is not None:
        lines = (message + "\n").splitlines(True)
        sys.stdout.write("".join((_PREFIX or "") + line for line in lines))
        sys.stdout.flush()


def grad_accum(accum, world_size):
    if accum > 1:
        info(f"--grad-accum {accum}: each step averages {accum} micro-batches per rank: "
             f"an emulated world of {world_size * accum}")


class Progress:
    """Rank 0's view of an epoch: a line every --log-interval steps, and the last step's."""

    def __init__(self, enabled, total, epoch, interval):
        self.enabled, self.total, self.epoch, self.interval = enabled, total, epoch, interval

    def update(self, step, loss):  # True if it printed
        _tell("step", self, step, loss)
        if self.enabled and loss is not None and (step % self.interval == 0 or step == self.total):
            _tell("logged", self, step, loss)
            print(f"epoch {self.epoch} step {step}/{self.total} loss {loss:.4f}", flush=True)
            return True


def default_log_dir(script_name):
    return os.path.join("runs", f"{script_name}-{time.strftime('%Y%m%d-%H%M%S')}")


def checkpoint_folder(checkpoint_dir, log_dir):
    """The one rule for every lesson: --checkpoint-dir, else <log-dir>/checkpoints (or None)."""
    return Path(checkpoint_dir or Path(log_dir) / "checkpoints") if checkpoint_dir or log_dir \
        else None


def atomic_write(path, write_fn, mode="w"):
    """Write through a temporary file in the same folder, fsync, then rename: a crash leaves the
    old file whole. The new file gets the permissions open() would give it."""
    for sealer in _SEALERS:
        if sealer(path, write_fn, mode):
            return
    replace_file(path, write_fn, mode)


def replace_file(path, write_fn, mode="w"):  # atomic_write's own writing, asking no sealer
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode) as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # renamed: gone; a failed write: removed
            os.unlink(tmp)


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2, sort_keys=True, default=str))


class RunLog:
    """config.json, metrics.jsonl and summary.json in `log_dir`, written by rank 0."""

    def __init__(self, log_dir, is_main):
        self.dir, self.is_main, self.history, self.about = log_dir, is_main, [], {}
        self.start = time.perf_counter()
        self.metrics_path = os.path.join(log_dir, "metrics.jsonl")
        if is_main:
            os.makedirs(log_dir, exist_ok=True)
        _tell("opened", self)

    def write_config(self, args, env, framework, extra=None):  # env: a dict (world_size, ...)
        self.about = {"world_size": env["world_size"], "launcher": env["launcher"],
                      "framework": framework}
        if self.is_main:
            config = dict(vars(args), framework=framework, **env, **(extra or {}))
            write_json(os.path.join(self.dir, "config.json"), config)

    def keep_epochs_before(self, first_epoch):  # on resume: the history reads as one run
        if os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                self.history = [m for m in map(json.loads, filter(str.strip, f))
                                if m["epoch"] < first_epoch]
            self._write_metrics()

    def _write_metrics(self):
        if self.is_main:  # rewritten whole and renamed: a kill never leaves half a line
            lines = [json.dumps(m) + "\n" for m in self.history]
            atomic_write(self.metrics_path, lambda f: f.writelines(lines))

    def epoch_end(self, epoch, sums, lr, epoch_time_s, train_time_s):  # sums: over all ranks
        _tell("epoch", self, epoch, sums)
        train_loss, train_correct, train_seen, test_loss, test_correct, test_seen = sums
        m = dict(epoch=epoch, train_loss=train_loss / train_seen,
                 train_acc=train_correct / train_seen, test_loss=test_loss / test_seen,
                 test_acc=test_correct / test_seen, lr=lr, epoch_time_s=epoch_time_s,
                 train_time_s=train_time_s, samples_per_s=train_seen / train_time_s, **self.about)
        self.history.append(m)  # samples/s: all ranks' samples over the slowest rank's time
        self._write_metrics()
        _tell("epoch_logged", self, m)
        info(f"epoch {epoch:>2}  train_loss {m['train_loss']:.4f}  train_acc {m['train_acc']:.4f}  "
             f"test_loss {m['test_loss']:.4f}  test_acc {m['test_acc']:.4f}  lr {lr:.4g}  "
             f"{m['samples_per_s']:.0f} samples/s  {epoch_time_s:.1f}s")

    def summary(self, extra):  # the last epoch's numbers and `extra`: summary.json, and a table
        for more in _tell("summary", self):
            extra = {**extra, **more}
        s = {**(self.history[-1] if self.history else {}), **self.about,
             "wall_time_s": time.perf_counter() - self.start, **extra}
        if self.is_main:
            write_json(os.path.join(self.dir, "summary.json"), s)
        rows = [("framework", s.get("framework")), ("launcher", s.get("launcher")),
                ("ranks", s.get("world_size")), ("device", s.get("device")),
                ("epochs", s.get("epoch")), ("test accuracy", f"{s.get('test_acc', 0):.4f}"),
                ("samples/s (global)", f"{s.get('samples_per_s', 0):.0f}"),
                ("wall time", f"{s.get('wall_time_s', 0):.1f} s"), ("log dir", self.dir)]
        info("\n".join(["", "summary", "-" * 40] + [f"{k:<18}  {v}" for k, v in rows] + ["-" * 40]))
        return s

