"""Ctrl-C (SIGINT) and a scheduler's walltime warning (SIGTERM): stop in seconds, on every rank, in
one line.

A scheduler sends SIGTERM some seconds before it kills a job at its walltime (Slurm: KillWait, 30 s
by default; PBS: kill_delay); a terminal sends SIGINT to every process of the job at once. Python
turns SIGINT into a KeyboardInterrupt and lets SIGTERM kill the process at once; here both become an
`Interrupted` exception raised in the main thread, which course.failures.run_main turns into one line
and the conventional exit code (128 + the signal's number: 130, 143). A checkpoint being written is
never half-renamed (its write is atomic), so the last good one survives."""

import signal
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received = {}


class Interrupted(KeyboardInterrupt):
    """The job was asked to stop (SIGINT or SIGTERM); `signum` says which."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _handler(signum, frame):
    if _received:  # a second Ctrl-C while the first unwinds: keep unwinding, not a second exception
        return
    _received.update(signum=signum, at=time.monotonic())
    if _ending:  # the run is already ending on an error: that error's line is the one to print
        return
    raise Interrupted(signum)


_ending = []


def ending():
    """From now on a signal is noted, not raised: the run is already ending (run_main of
    course/failures.py is writing its one line). A launcher that sees one rank die sends the others
    SIGTERM, which would otherwise land in the middle of that line's making and end the rank in a
    traceback. Returns the signal that stopped the run before this call, or None (both read with the
    signals blocked, so none slips in between)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        first = received()
        _ending.append(True)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    return first


def install():
    """Raise Interrupted in the main thread on SIGINT or SIGTERM (from the main thread only)."""
    for signum in SIGNALS:
        try:
            signal.signal(signum, _handler)
        except (ValueError, OSError):  # not the main thread, or not allowed here: keep the default
            pass


def received():
    """The number of the signal that stopped this run, or None."""
    return _received.get("signum")


def exit_code(signum):
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)
