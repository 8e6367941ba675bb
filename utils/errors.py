"""The course's two kinds of expected failure, each one line on stderr instead of a traceback.

Its own module so that every module (rank discovery, logging, arguments) can raise them without
importing the others.
"""
import sys


class UserError(Exception):
    """A problem with the user's input or files (not a bug): reported as one line, exit code 2."""


def fail(message, code=2):
    """One clear line on stderr and a non-zero exit: for bad input, on every rank, instead of a
    traceback."""
    # One write of the whole line (print() writes the text and the newline separately): lines from
    # several ranks sharing one stderr pipe (mpiexec) then never interleave.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)
