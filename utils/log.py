"""Rank-aware printing: every rank computes the same averaged metrics; only rank 0 prints them,
so a 512-rank job produces one log, not 512. Progress lines within an epoch, and where this rank is
(the last step it finished), which a failure's one line names (utils/failures.py).
"""
import sys
import time

from utils.board import Board
from utils.errors import UserError, fail  # noqa: F401  (the lessons call log.fail)

_RANK = None  # configure() sets it; None: a failure before it
_ALL_RANKS = False
_PREFIX = ""
_POSITION = {}  # epoch, step, total, at: the last training step this rank finished


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


def grad_accum(accum, world_size):
    """With --grad-accum A > 1, say so once: each step averages A micro-batches per rank, as a world
    A times larger would."""
    if accum > 1:
        info(f"--grad-accum {accum}: each step averages {accum} micro-batches per rank: "
             f"an emulated world of {world_size * accum}")


def at_step(epoch, step, total):
    _POSITION.update(epoch=epoch, step=step, total=total, at=time.monotonic())


def position():
    """{epoch, step, total, at (time.monotonic())} of the last step this rank finished ({} if
    none)."""
    return dict(_POSITION)


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
