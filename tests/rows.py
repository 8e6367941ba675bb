"""Run a lesson once per row of flags, each as `python lesson.py ROW...` would (its folder first on sys.path),
and print each row's exit code and stderr as one JSON line: support.run_rows, for a lesson's refusals. Each row
runs in a process forked from this one, which is warm (tests/warm.py) and has no group or thread of its own: a
row refused after it joined its group (DeepSpeed's data check comes after [1]) takes that group, and what
DeepSpeed caches of it, with it, as a process of its own would. What the lesson imports at its top level is
imported once, before the forks (TensorFlow's import alone is 4 s a row otherwise); that starts no thread, which
is checked, since a fork copies none."""
import contextlib
import importlib
import io
import json
import os
import runpy
import sys

from warm import preamble  # (this folder: sys.path[0], until the next lines)

script, rows = sys.argv[1], json.loads(sys.argv[2])
sys.path[0] = os.path.dirname(os.path.abspath(script))
variables, imports = preamble(script)  # what the lesson sets and imports first, as it would
os.environ.update(variables)
threads = len(os.listdir("/proc/self/task"))
for name in imports:  # (not the optional plumbing: it sits in a try)
    with contextlib.suppress(ImportError):
        importlib.import_module(name)
assert len(os.listdir("/proc/self/task")) == threads, "the lesson's imports started threads: a fork would copy them"
results = []
for row in rows:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the row's own process: its outcome goes back through the pipe
        os.close(read)
        sys.argv = [script, *row]
        err = io.StringIO()
        code = "finished"
        with contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                code = exc.code
        with os.fdopen(write, "w") as out:
            json.dump({"code": code, "stderr": err.getvalue()}, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as inp:
        outcome = inp.read()
    _, status = os.waitpid(pid, 0)
    assert outcome, f"row {row} ended without an outcome (wait status {status})"
    results.append(json.loads(outcome))
print("RESULTS " + json.dumps(results))
