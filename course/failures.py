"""Course plumbing: every way a run can go wrong ends in one line on stderr, not a traceback
(run_main). A lesson copied without it still runs, with Python's own tracebacks.

The line names the rank, where it was (the epoch and step it last finished: course/watch.py), and for
a stop or a lost peer what to do next: the last good checkpoint, or how to find a hung rank
(diagnose/hangs.md). An unreadable checkpoint, or one that does not fit the model, is one too.
"""
import atexit
import os
import sys
import time

from course import beacon, network, quiet, scratch, watch
from course.errors import NonFiniteLoss, UserError, checkpoint_problem, fail, say
from course.ranks import discover
from course.runfiles import chosen_log_dir, epochs_done, has_checkpoint, holder_of, remove_debris, write_ending
from utils import log
from utils.data import DataError

_ARGS = []  # the run's parsed flags (checks.parse notes them): --log-dir, --dist-timeout


def note_args(args):
    _ARGS[:] = [args]


# What the frameworks raise on a rank whose peer died or stopped answering: torch.distributed's Dist*Error
# classes, Horovod's HorovodInternalError, RuntimeErrors (or TF's) from gloo/Horovod; gloo's pair a timeout closed,
# under the next wait ("... pair closure"); Horovod PyTorch's pending operations that MPI's abort emptied.
PEER_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "HorovodInternalError")
PEER_ERROR_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                    "timed out", "Horovod has been shut down", "gloo", "Application timeout caused pair closure",
                    "was not created or has been cleared")
TIMEOUT_TEXTS = ("Timed out", "timed out", "Timeout", "timeout")
ROOT, HANGS_PAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "diagnose/hangs.md"


def _rank():
    """This rank's number, from the launcher's variables (what the lesson was given too)."""
    return discover().rank


def is_peer_failure(exc):
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & set(PEER_ERROR_TYPES)) or any(text in str(exc) for text in PEER_ERROR_TEXTS)


def _where():
    p = watch.POSITION
    if not p:
        return "before any training step it reported"
    return f"in epoch {p['epoch']} after step {p['step']}/{p['total']}"


def _last_checkpoint():
    """(the newest complete checkpoint as 'DIR (epoch N)' or None, the log dir)."""
    args = _ARGS[0] if _ARGS else None
    log_dir = getattr(args, "log_dir", None) or chosen_log_dir()
    folder = log.checkpoint_folder(getattr(args, "checkpoint_dir", None), log_dir)
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


def _waited_where(exc):
    """('all_reduce', 'DDP/main.py:152'): the collective that failed, the line that called it. A timeout
    the launcher's signal cut short: the signal's frames (down to the lesson's line), then its own."""
    import traceback
    frames = traceback.extract_tb(getattr(exc, "course_outer_traceback", None)) + \
        traceback.extract_tb(exc.__traceback__)
    plumbing = os.path.join(ROOT, "course") + os.sep
    ours = [i for i, f in enumerate(frames) if os.path.abspath(f.filename).startswith(ROOT + os.sep)
            and not os.path.abspath(f.filename).startswith(plumbing)  # (its wraps: not the lesson's)
            and "site-packages" not in f.filename and f.filename[:1] != "<"]  # (a venv; TF's code)
    if not ours:
        return None, None
    mine = frames[ours[-1]]
    below = [f for f in frames[ours[-1] + 1:] if not os.path.abspath(f.filename).startswith(plumbing)]
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
    if no_rank_0 := _no_rank_0(exc):
        return no_rank_0
    if unreachable := network.unreachable_line(exc, _rank()):  # an address peers cannot reach
        return unreachable
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    peer_line = next((line for line in lines if any(text in line for text in PEER_ERROR_TEXTS)),
                     lines[0])
    detail = next((line for line in lines if "monitoredBarrier" in line), peer_line)[:240]
    what, where = _waited_where(exc)
    call = f"in {what} at {where} " if where else ""
    rank = _rank()
    hung = (f"(hung, stopped or elsewhere); next: while it hangs, `python diagnose/stacks.py` "
            f"shows where every rank is ({HANGS_PAGE}) [{detail}]")
    timeout = getattr(_ARGS[0] if _ARGS else None, "dist_timeout", None)
    # Horovod says a gloo timeout only as "Horovod has been shut down": the time since the step does
    at = watch.POSITION.get("at")
    since = time.monotonic() - at if at else 0
    if any(text in str(exc) for text in TIMEOUT_TEXTS) or (timeout and since >= 0.9 * timeout):
        import re
        ms = re.search(r"(\d+)\s*ms", str(exc))
        waited = (f"{int(ms.group(1)) / 1000:g} s" if ms else f"{since:.0f} s" if since else
                  f"{timeout} s (--dist-timeout)" if timeout else "")
        absent = re.search(r"Rank (\d+) failed to pass monitoredBarrier", str(exc))  # gloo names it
        named = None if absent else beacon.absent(rank)  # the ranks' keys in the store
        who = (f"rank {absent.group(1)}, which never arrived" if absent else named or
               beacon.never_joined(str(exc), rank))
        return f"rank {rank} waited {waited} {call}{_where()} for {who} {hung}"
    if named := beacon.absent(rank):  # a rank that gave up waiting for a silent one has left
        return (f"rank {rank} lost contact with another rank {call}{_where()}: the ranks gave up "
                f"waiting for {named} {hung}")
    return (f"rank {rank} lost contact with another rank {call}{_where()} (it died, or hung past "
            f"the collective timeout): {detail}")


def run_main(main):
    """Call main(), and end every way it can go wrong in one line on stderr instead of a traceback:

    - a UserError (bad input): one line, exit 2;
    - SIGINT or SIGTERM (Ctrl-C, a scheduler's walltime): where it stopped, the last good
      checkpoint and how to continue; exit 130 or 143 (course/interrupts.py);
    - a lost peer (a rank that died, or hung past the collective timeout): which rank waited, in
      which collective at which line, in which epoch and step, and what to do next; exit 1.

    A finished main() runs the exit handlers (_leave_finished) and returns: the lesson's own last
    lines end the process, as they do in a copy without the plumbing.

    A run that fails before its first result removes the folders it created. Under torchrun the
    line also goes into the worker's error file, so torchrun's report names it as the cause. A bug
    keeps its traceback.
    """
    from course import interrupts
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
        try:
            signum = interrupts.ending()
        except interrupts.Interrupted:  # it came as this failure began: the launcher's reaction
            interrupts.ending()  # (a second one is ignored: the handler keeps the first only)
            signum = None
        # The launcher's SIGTERM, raised while this rank's own collective timeout unwound: the timeout
        # came first, and is the line to print (a lost connection may be the signal's doing), with the
        # signal's traceback above its own (the timeout's begins below the lesson's line)
        late = exc.__context__ if isinstance(exc, interrupts.Interrupted) else None
        if late is not None and is_peer_failure(late) and any(t in str(late) for t in TIMEOUT_TEXTS):
            late.course_outer_traceback = exc.__traceback__
            exc, signum = late, None
        if signum is None and isinstance(exc, KeyboardInterrupt):
            signum = 2
        # stopped on purpose; a peer error after it is the same stop seen later
        if signum is not None:
            _quit(_stopped_line(signum), interrupts.exit_code(signum), prefix="stopped")
        remove_debris()
        if isinstance(exc, NonFiniteLoss):
            _quit(_non_finite_line(exc), 1)
        problem = str(exc) if isinstance(exc, (UserError, DataError)) else checkpoint_problem(exc)
        if problem:  # bad input: the peers that lose this rank then say that it refused
            beacon.refuse(_rank(), problem)
            quiet.refused_quietly()
            fail(problem)
        if not is_peer_failure(exc):
            import traceback

            from course.errors import record_for_torchrun
            # torchrun's report shows it (as @record would)
            record_for_torchrun(traceback.format_exc())
            raise  # a bug: keep the traceback
        if refused := beacon.refusal(_rank()):  # a peer refused bad input: so does this rank
            _quit(f"rank {_rank()} stopped: {refused}", 2)
        _quit(_peer_line(exc), 1)


def _non_finite_line(exc):
    """A NaN or infinite loss: where, and that the checkpoint on disk is still the last good one."""
    where = (f"at step {exc.step}/{exc.total} of epoch {exc.epoch}" if exc.step is not None else
             f"in epoch {exc.epoch} (its mean over all ranks)")
    checkpoint, _ = _last_checkpoint()
    kept = (f"the checkpoint is left as it was: {checkpoint}" if checkpoint else
            "no checkpoint was written")
    clip = " or --clip-grad-norm" if hasattr(_ARGS[0] if _ARGS else None, "clip_grad_norm") else ""
    return (f"rank {_rank()} stopped: the {exc.which} loss is {exc.loss} {where}, before the "
            f"epoch's checkpoint; {kept}. A lower --lr{clip} may help; a run that resumed from a "
            "checkpoint damaged in place would end here too")


def _no_rank_0(exc):
    """The line for a rank that found nobody where the ranks meet (rank 0 listens there): a rank
    started alone, rank 0 dead before it opened the store, or a wrong MASTER_ADDR/MASTER_PORT."""
    import re
    found = re.search(r"trying to connect to \((\S+), (\d+)\)", str(exc))
    if not found or _rank() == 0:
        return None
    held = holder_of(getattr(_ARGS[0], "log_dir", None) if _ARGS else None)
    if held:  # this run's rank 0 was refused the folder (a larger run has ranks the first lacks)
        return (f"rank {_rank()} found no rank 0: {_ARGS[0].log_dir} is in use by another run "
                f"({held}): wait for it to end, or choose another --log-dir")
    return (f"rank {_rank()} found no rank 0 at {found.group(1)}:{found.group(2)} (MASTER_ADDR:"
            "MASTER_PORT; rank 0 listens there): rank 0 never started, died before, or listens "
            "elsewhere; start every rank with one launcher, or check the address")


def _leave_finished():
    """A finished main(): the exit handlers now (Horovod's shutdown, the TensorBoard file's close,
    this process's temporary folder, a measuring tool's; mpi4py's MPI_Finalize is no atexit
    handler: the lesson's ending calls it), then back to the lesson, whose own last lines leave
    without the interpreter's teardown (torch's holders keep gloo's threads alive past
    destroy_process_group(), and the teardown can abort a finished rank), exactly as a copy of
    the lesson does without the plumbing."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def _quit(line, code, prefix="error"):
    """One line, then out at once: a rank whose peers are gone must not wait in the libraries' exit
    hooks."""
    remove_debris()
    write_ending(f"{prefix}: {line}", code, _rank())  # (in the folder of a run that trained)
    scratch.remove_private_tmp()  # (os._exit runs no atexit hook)
    sys.stdout.flush()
    say(line, prefix)
    beacon.linger(_rank())  # rank 0 holding the store: until the others have read it
    os._exit(code)
