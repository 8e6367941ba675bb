"""Run a lesson once per row of flags in this one process, each as `python lesson.py ROW...` would (its folder
first on sys.path), and print each row's exit code and stderr as one JSON line: support.run_rows, for a lesson's
refusals (each ends before any process group exists). Started warm (tests/warm.py)."""
import contextlib
import io
import json
import os
import runpy
import sys

script, rows = sys.argv[1], json.loads(sys.argv[2])
sys.path[0] = os.path.dirname(os.path.abspath(script))
results = []
for row in rows:
    sys.argv = [script, *row]
    err = io.StringIO()
    code = "finished"
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    results.append({"code": code, "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
