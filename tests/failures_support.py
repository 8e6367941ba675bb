"""What the failure tests share: the lessons, tiny MNIST sets, launching a job and signalling one of its
ranks, and the checks that a log dir holds nothing half-written. Tests import what they use from here.

Faults are injected from outside the examples: signals to a rank found in the launcher's process tree, or
tests/hooks/faults.py, which tests/hooks/sitecustomize.py installs around utils/log.py at interpreter start-up
when a test sets one of its COURSE_* variables (support.run then puts tests/hooks on PYTHONPATH). No lesson
and nothing in utils/ knows about it.

Timing fields (epoch_time_s, train_time_s, samples_per_s) are wall-clock measurements: every comparison of
metrics histories leaves them out, and compares everything else exactly.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from support import (  # noqa: F401
    BIN,
    DDP,
    DS,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    ROOT,
    deepspeed_launcher,
    error_lines,
    horovodrun,
    kill_tree,
    launch_command,
    made_once,
    metrics,
    mpiexec,
    python,
    run,
    summary,
    torchrun,
)

sys.path.append(str(ROOT))
from utils import data

SCRIPTS = [DDP, HVD_TORCH, HVD_TF, HVD_KERAS, DS]
RESUMABLE = [DDP, HVD_TORCH, HVD_TF, DS]  # keras_main.py (model.fit) has no --resume
TIMING = {"epoch_time_s", "train_time_s", "samples_per_s"}
KILL_DEADLINE_S = 60


def without_timing(history):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


# --- tiny MNIST sets in IDX format (real digits from the shipped set) -------------------------------------
def write_idx_set(folder, n_train, n_test):
    mnist = data.load_shipped()
    arrays = dict(x_train=mnist.x_train[:n_train], y_train=mnist.y_train[:n_train],
                  x_test=mnist.x_test[:n_test], y_test=mnist.y_test[:n_test])
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in data.IDX_FILES.items():
        a = arrays[key].astype(np.uint8)
        header = bytes([0, 0, 0x08, a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape)
        (folder / name).write_bytes(header + a.tobytes())
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """256 training / 64 test digits: 8 steps of 32 per epoch on one rank, 4 on two."""
    return write_idx_set(tmp_path_factory.mktemp("tiny"), 256, 64)


def assert_log_dir_sound(log_dir, before=None):
    """Nothing half-written: every JSON file parses, every metrics line parses, no temporary file is left;
    and every file that existed before (`before`: {name: bytes}) is unchanged."""
    for name, content in (before or {}).items():
        assert (log_dir / name).read_bytes() == content, f"{name} changed"
    if not log_dir.exists():
        return
    for path in log_dir.rglob("*"):
        assert not path.name.startswith(".tmp-"), f"left-over temporary file {path}"
        if path.suffix == ".json":
            json.loads(path.read_text())
        if path.name == "metrics.jsonl":
            [json.loads(line) for line in path.read_text().splitlines()]


# === a rank dies ==========================================================================================
LONG = pytest.mark.long  # `make test-all`; `make test` (CI) runs one case per launcher, for CI's time
KILL_LAUNCHES = [
    pytest.param(DDP, torchrun, id="ddp-torchrun"),
    pytest.param(DDP, mpiexec, id="ddp-mpiexec", marks=LONG),
    pytest.param(HVD_TORCH, horovodrun, id="hvd-torch-horovodrun-gloo"),
    pytest.param(HVD_TORCH, mpiexec, id="hvd-torch-mpiexec", marks=LONG),
    pytest.param(HVD_TF, horovodrun, id="hvd-tf-horovodrun-gloo", marks=LONG),
    pytest.param(HVD_TF, mpiexec, id="hvd-tf-mpiexec"),
    pytest.param(HVD_KERAS, horovodrun, id="keras-horovodrun-gloo", marks=LONG),
    pytest.param(HVD_KERAS, mpiexec, id="keras-mpiexec", marks=LONG),
    pytest.param(DS, deepspeed_launcher, id="deepspeed-deepspeed"),
    pytest.param(DS, torchrun, id="deepspeed-torchrun", marks=LONG),
    pytest.param(DS, mpiexec, id="deepspeed-mpiexec", marks=LONG),
]
RANK_VARIABLES = ("HOROVOD_RANK", "RANK", "PMI_RANK")


def ranks_of(launcher_pid, script):
    """{rank: psutil.Process} of the Python processes running `script` below the launcher."""
    found = {}
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline, environ, name = proc.cmdline(), proc.environ(), proc.name()
        except psutil.Error:
            continue
        if name.startswith("python") and any(arg.endswith(script) for arg in cmdline):
            rank = next((int(environ[v]) for v in RANK_VARIABLES if v in environ), None)
            if rank is not None:  # not the deepspeed launcher's own per-node helper, which runs `-m ... script`
                found.setdefault(rank, proc)
    return found


def signal_rank_1(tmp_path, script, launcher, sig, *extra):
    """Start a long 2-rank job, send `sig` to rank 1 mid-epoch, and wait (at most KILL_DEADLINE_S) for rank 0
    and then the launcher to end. Returns the launcher's exit code, both delays, and the job's output."""
    # 62 steps per epoch and 50 epochs: the job is nowhere near its end when the signal comes.
    cmd = [str(c) for c in launcher(2, script, "--epochs", "50", "--log-interval", "5", *extra,
                                    "--log-dir", tmp_path / "log")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    out_path = tmp_path / "output.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # Training has started: rank 0's 10th step (custom loops) or Keras' epoch header plus a moment.
        while not re.search(r"epoch 1 step 10/|Epoch 1/", out_path.read_text()):
            assert proc.poll() is None, f"exited early ({proc.returncode}):\n{out_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"training never started:\n{out_path.read_text()[-3000:]}"
            time.sleep(0.2)
        time.sleep(1.0)
        ranks = ranks_of(proc.pid, script)
        assert sorted(ranks) == [0, 1], ranks
        ranks[1].send_signal(sig)
        sent_at = time.monotonic()
        gone, alive = psutil.wait_procs([ranks[0]], timeout=KILL_DEADLINE_S)
        survivor_s = time.monotonic() - sent_at
        assert not alive, f"rank 0 still running {KILL_DEADLINE_S} s after rank 1 got {sig!r}"
        if sig == signal.SIGSTOP:
            # Rank 0 has given up, which is what the test is about. A stopped rank cannot answer the
            # launcher's SIGTERM: torchrun would wait 30 s before its SIGKILL (on this path it ignores
            # --shutdown-timeout), as diagnose/hangs.md shows from a run. Resumed, rank 1 takes the SIGTERM.
            with contextlib.suppress(psutil.NoSuchProcess):
                ranks[1].send_signal(signal.SIGCONT)
        rc = proc.wait(timeout=max(1, KILL_DEADLINE_S - survivor_s))
        launcher_s = time.monotonic() - sent_at
    finally:
        kill_tree(proc)  # the launcher, and any rank it left behind
        proc.wait()
    return rc, survivor_s, launcher_s, out_path.read_text()


def assert_no_traceback_through_the_example(output):
    """Rank 0 either says so in one line (utils/log.run_main) or is stopped by the launcher first: never a
    traceback through the example (the launchers' own reports are theirs)."""
    assert not re.search(r'File "[^"]*(DDP|horovod|deepspeed)/[^"]*main\.py"', output), output[-4000:]
    for line in error_lines(output):
        assert re.search(r"error: rank \d+ (lost contact with another rank|waited)", line), line



# === interrupted and resumed ==============================================================================
# Single-process runs on the tiny set, 3 epochs of 8 steps. One thread per process: the thread count changes
# how a sum over a tensor is split, hence its rounding (pinned in every run here).
PER_SCRIPT = {DDP: [], HVD_TORCH: [], DS: [],
              # Keras 3 dropout layers draw from a seed generator no checkpoint records: resume without dropout
              HVD_TF: ["--dropout", "0"], HVD_KERAS: []}


def quick(script, log_dir, *extra):
    return python(script, "--epochs", "3", "--batch-size", "32", "--num-threads", "1", "--seed", "7",
                  "--log-interval", "100", *PER_SCRIPT[script], "--log-dir", log_dir, *extra)


def checked(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny):
    """The uninterrupted run of an example (run once per module, shared by the tests below)."""
    def make(script, log_dir):
        checked(run(quick(script, log_dir, "--data-dir", tiny), timeout=240))
        return log_dir
    return made_once(tmp_path_factory, make)



def remove_the_half_written_file(folder, pattern):
    """What a crash in atomic_write leaves: one non-empty temporary file. Harmless; removed here so the final
    check (no temporary file anywhere) is strict."""
    partial = list(folder.glob(pattern))
    assert len(partial) == 1 and partial[0].stat().st_size > 0, partial
    partial[0].unlink()


# Many command lines of one lesson in one process (runpy), each's exit code and stderr: a table of bad
# flags costs one interpreter start, not one per row.
_ROWS_DRIVER = """
import contextlib, io, json, runpy, sys
script, rows = sys.argv[1], json.loads(sys.argv[2])
results = []
for row in rows:
    sys.argv = [script] + row
    err = io.StringIO()
    code = "finished"
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    results.append({"code": code, "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""


def run_rows(script, rows, timeout=240):
    """[{"code": exit code, "stderr": text}] for `script` run with each row of flags, in one process."""
    result = run([sys.executable, "-c", _ROWS_DRIVER, str(ROOT / script), json.dumps(rows)], timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])
