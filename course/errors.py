"""The course's two kinds of expected failure, each one line on stderr instead of a traceback, and the
line for a checkpoint that does not load.

Its own module so that every module (rank discovery, logging, arguments) can raise them without
importing the others.
"""
import json
import os
import sys
import time


class UserError(Exception):
    """A problem with the user's input or files (not a bug): reported as one line, exit code 2."""


class NonFiniteLoss(Exception):
    """A loss that is NaN or infinite, at a step or an epoch's end (course/watch.py): the run stops
    there, before it writes a checkpoint, in one line (course/failures.py), exit code 1."""

    def __init__(self, loss, epoch, step=None, total=None, which="training"):
        super().__init__(f"non-finite {which} loss {loss}")
        self.loss, self.epoch, self.step, self.total, self.which = loss, epoch, step, total, which


def record_for_torchrun(line):
    """Under torchrun, write `line` to the error file it gave this worker (TORCHELASTIC_ERROR_FILE),
    in the format of torch.distributed.elastic's @record: torchrun's failure report then shows this
    line as the worker's error (and the root cause, if it came first) instead of
    `error_file: <N/A>`."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
    data = {"message": {"message": line, "extraInfo": extra}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report then says <N/A>, as before: not worth a second error


def say(message, prefix="error"):
    """One line on stderr (and in torchrun's error file), written whole."""
    # One write of the whole line (print() writes the text and the newline separately): lines from
    # several ranks sharing one stderr pipe (mpiexec) then never interleave.
    line = f"{prefix}: {message}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if prefix == "error":
        record_for_torchrun(line)


def fail(message, code=2):
    """One clear line on stderr and a non-zero exit: for bad input, on every rank, instead of a
    traceback."""
    say(message)
    sys.exit(code)


def checkpoint_problem(exc):
    """One line for a checkpoint torch or TensorFlow cannot load (what `exc` came from), or that
    does not fit the model, or None (course/failures.py says it)."""
    import traceback
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    reason = " ".join(str(exc).split())[:300]
    for frame in frames:
        code = frame.f_code
        torch_load = code.co_filename.endswith(os.path.join("torch", "serialization.py"))
        if code.co_name == "load" and torch_load:
            path = frame.f_locals.get("f", "")
            return f"checkpoint {path} is unreadable (truncated or corrupted?): {reason}"
    if any(frame.f_code.co_name == "load_state_dict" for frame in frames):
        return f"the checkpoint does not fit this model: {reason}"
    if any(os.path.join("tensorflow", "python", "checkpoint") in f.f_code.co_filename
           for f in frames):
        return f"the checkpoint does not load (truncated, corrupted or of another model?): {reason}"
    return None
