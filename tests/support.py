"""Helpers for tests that launch real processes through real launchers, always with a timeout (imported by the
test modules as `support`; pytest puts this folder on sys.path)."""
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: torchrun, mpiexec, horovodrun, deepspeed
sys.path.append(str(ROOT))  # after site-packages: `import horovod` stays the library
import events
from course.ranks import free_port  # noqa: F401  (the tests import it from here)
from tools.launch import EXAMPLES, launch_command
from utils import data
from warm import WarmCommand, run_warm, warm

# The examples' scripts, relative to the repository root, from the one table of them (tools/examples.tsv).
DDP = EXAMPLES["ddp"]
HVD_TORCH = EXAMPLES["horovod-pytorch"]
HVD_TF = EXAMPLES["horovod-tensorflow"]
HVD_KERAS = EXAMPLES["horovod-keras"]
DS = EXAMPLES["deepspeed"]
ZERO = EXAMPLES["zero"]
FSDP_CKPT = "zero/fsdp_checkpoint.py"  # a lesson script that is not in tools/examples.tsv
# A lesson's 2-rank run in its own tests, shared (conftest.py's shared_run) with the lift-out test's comparison and
# the simulated-nodes test's one-node run: one thread per rank, so that runs with another number of ranks per node
# compute alike.
QUICK = ["--epochs", "2", "--max-steps", "8", "--log-interval", "4", "--num-threads", "1"]
# The transformer chapter: a small GPT, and its 2-rank run, shared as QUICK's is
GPT_DDP = EXAMPLES["transformer-ddp"]
GPT_FSDP = EXAMPLES["transformer-fsdp"]
GPT_SMALL = ["--layers", "2", "--width", "64", "--heads", "2", "--context", "32", "--num-threads", "1"]
GPT_QUICK = [*GPT_SMALL, "--epochs", "2", "--max-steps", "3", "--no-lr-scaling", "--save-model",
             "--batch-size", "4"]
# The chapter's model-splitting lessons (part 2): tensor + sequence parallel and the pipeline stand for the
# class in the tests of every lesson (failures, devices, nodes, lift-out), with this 2-rank run, shared as QUICK's
# is. They keep no checkpoint and their ranks hold different weights: --save-model gathers the whole model.
TP = EXAMPLES["transformer-tp"]
PP = EXAMPLES["transformer-pp"]
SPLIT = (TP, PP)
GPT_SPLIT = [*GPT_SMALL, "--epochs", "2", "--max-steps", "8", "--log-interval", "4", "--no-lr-scaling",
             "--save-model", "--batch-size", "4"]


def weights_digest(log_dir):
    """The digest of a run's whole model as --save-model wrote it (model.pt): equal digests, equal weights."""
    import torch
    state = torch.load(Path(log_dir) / "model.pt", weights_only=True)
    return hashlib.sha256(b"".join(k.encode() + state[k].numpy().tobytes() for k in sorted(state))).hexdigest()[:16]


def run(cmd, timeout=300, env=None, cwd=ROOT):
    """Run `cmd` in its own process group; on timeout kill the whole group and fail (a hang is a failure)."""
    started = time.monotonic()
    try:
        return _run(cmd, timeout, env, cwd)
    finally:
        if os.environ.get("COURSE_LAUNCH_LOG"):  # an inventory of the suite's launches (tools/PERFORMANCE.md)
            with open(os.environ["COURSE_LAUNCH_LOG"], "a") as log:
                log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                                      "cmd": [str(c) for c in cmd][:12], "warm": isinstance(cmd, WarmCommand),
                                      "s": round(time.monotonic() - started, 2)}) + "\n")


def _run(cmd, timeout, env, cwd):
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                    PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    full_env.update(env or {})
    if any(name.startswith("COURSE_") for name in env or {}):  # test-only fault injection (tests/hooks/faults.py)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "hooks"),
                                                                 full_env.get("PYTHONPATH")]))
    LAUNCHED.extend(["warm"] if isinstance(cmd, WarmCommand) else launchers_in(cmd))
    if isinstance(cmd, WarmCommand):  # ranks forked from a warm interpreter (tests/warm.py)
        code, out, err, timed_out = run_warm(cmd, timeout, full_env, cwd)
        if timed_out:
            pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stdout\n{out[-3000:]}\n"
                        f"--- stderr\n{err[-3000:]}")
        return subprocess.CompletedProcess(cmd, code, out, err)
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n--- stdout\n{out[-3000:]}\n"
                    f"--- stderr\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


LAUNCHER_NAMES = re.compile(r"torchrun|mpiexec|mpirun|horovodrun|srun|sbatch|qsub|deepspeed[-_]launcher")
LAUNCHED = []  # what the running test started (conftest.py empties it before each test): "warm" or launchers' names


def launchers_in(cmd):
    """The launchers a command runs, by name (a test that starts one itself, outside run(), adds them too)."""
    names = {"torchrun", "mpiexec", "mpirun", "horovodrun", "srun", "sbatch", "qsub", "deepspeed"}
    return [Path(str(part)).name for part in cmd if Path(str(part)).name in names]


def launcher_named_but_not_run(test_id, launched):
    """The rule (tests/README.md): a test whose id names a launcher makes a claim about it, so it runs it. One
    that also starts warm ranks (a reference run, the other half of a comparison) must have run that launcher
    too. What is wrong, in a line, or None."""
    named = LAUNCHER_NAMES.search(test_id.split("::", 1)[-1])  # (the DeepSpeed launcher's command: deepspeed)
    if named and "warm" in launched and re.split("[-_]", named.group())[0] not in launched:
        return (f"{test_id} names {named.group()} but started its ranks warm and never ran {named.group()}: "
                "a test that names a launcher launches it (tests/README.md)")
    return None


def kill_tree(proc):
    """SIGKILL a launcher started with start_new_session and everything it started. Killing its
    process group is not enough: torchrun starts each worker in a session of its own, so a worker
    outlives a killed torchrun (for ever, if it was stopped with SIGSTOP)."""
    import psutil
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for victim in family:
        try:
            victim.kill()  # SIGKILL ends a stopped process too
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    psutil.wait_procs(family, timeout=10)


def made_once(tmp_path_factory, make):
    """For a module fixture whose runs several tests read (a 2-rank run, and the resume test that compares
    with it): get(key) calls make(key, a new folder) the first time a key is asked for, and returns
    what it returned every time."""
    done = {}

    def get(key):
        if key not in done:
            name = re.sub(r"\W+", "-", getattr(key, "__name__", str(key)))
            done[key] = make(key, tmp_path_factory.mktemp(name))
        return done[key]
    return get


def check(result):
    """Assert exit 0, showing the output's tail when not."""
    assert result.returncode == 0, (f"exit {result.returncode}: {' '.join(map(str, result.args))}\n"
                                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
    return result


def metrics(log_dir):
    with open(Path(log_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(log_dir):
    with open(Path(log_dir) / "summary.json") as f:
        return json.load(f)


def torchrun(nproc, script, *args):
    return launch_command(script, nproc, "torchrun", args)


def mpiexec(nproc, script, *args):
    return launch_command(script, nproc, "mpiexec", args)


def python(script, *args):
    return launch_command(script, 1, "python", args)


def deepspeed_launcher(nproc, script, *args):
    return launch_command(script, nproc, "deepspeed", args)


def error_lines(stderr):
    """stderr lines that our scripts print for bad input (one per rank): `error: ...` from course.errors.fail or
    `main.py: error: ...` from argparse, possibly behind horovodrun's `[rank]<stderr>:` prefix."""
    return [line for line in stderr.splitlines() if re.search(r"(^|<stderr>:)(\S+\.py: )?error: ", line)]


def assert_each_rank_refused(result, words, nproc, launcher):
    """Bad input on `nproc` ranks: a non-zero exit, and every `error:` line names `words`. How many
    ranks get to print depends on the launcher (`launcher`: its name or its command function).
    mpiexec lets every rank finish, and so do warm ranks (tests/warm.py): one line per rank.
    torchrun, horovodrun and the deepspeed launcher stop the other workers the moment one exits, so
    a slower rank (still importing its framework) may not reach its check: torchrun's report names
    it (exitcode -15, or 143 with our `stopped` line); the other two only say that they killed it,
    so there at least one line."""
    launcher = getattr(launcher, "__name__", launcher)
    output = result.stdout + result.stderr
    errors = error_lines(output)
    assert result.returncode != 0, output[-3000:]
    assert errors and all(words in e for e in errors) and len(errors) <= nproc, output[-3000:]
    if launcher in ("mpiexec", "python", "warm"):  # (python: one process; warm: every rank runs to its end)
        assert len(errors) == nproc, output[-3000:]
    elif launcher == "torchrun":  # a rank that printed its line may still be reported as stopped
        stopped = len(re.findall(r"exitcode\s*:\s*(?:-15|143)\b", output))
        assert len(errors) + stopped >= nproc, output[-3000:]
    else:
        assert launcher in ("horovodrun", "deepspeed_launcher"), launcher


def stopped_epoch(line, sig_name):
    """A rank's "stopped by SIG in epoch N after step S/T: last good checkpoint: ... (epoch M)"
    line: assert M == N - 1 (the checkpoint is the epoch before the one stopped in) and return N.
    A test signals a running job on a timer, so the epoch it lands in is not fixed; the relation is."""
    stopped = re.search(rf"stopped by {sig_name} in epoch (\d+) after step \d+/\d+", line)
    kept = re.search(r"last good checkpoint: .* \(epoch (\d+)\)", line)
    assert stopped and kept, line
    assert int(kept.group(1)) == int(stopped.group(1)) - 1, line
    return int(stopped.group(1))


def horovodrun(nproc, script, *args, controller="--gloo"):
    return launch_command(script, nproc, "horovodrun" if controller == "--gloo" else "horovodrun-mpi", args)


def event_scalars(log_dir, tensorflow=False):
    """(event files, {tag: {step: value}}) from the TensorBoard event files in log_dir, read with TensorBoard's own
    reader (tests/events.py). By default in this process, as TensorBoard reads them where TensorFlow is not
    installed: its own stub of TensorFlow's record reader (checksums and all), which it takes whenever a module
    `tensorboard.compat.notf` exists (its no_tensorflow build). tensorflow=True: in a child process, where that
    reader imports TensorFlow, as a TensorBoard beside TensorFlow reads them (4.9 s of TensorFlow's start-up; and
    TensorFlow and triton, which torch loads lazily, crash a process that holds both: conftest.py).
    test_tensorboard_events.py holds the two readers to the same numbers."""
    files = sorted(Path(log_dir).glob("events.out.tfevents.*"))
    if not files:
        return files, {}
    if tensorflow:
        result = run([sys.executable, events.__file__, *files], timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
        found = json.loads(result.stdout.strip().splitlines()[-1])
        return files, {tag: {int(step): value for step, value in steps.items()} for tag, steps in found.items()}
    if "tensorboard.compat.notf" not in sys.modules:  # (before TensorBoard's compat layer first picks its tf)
        sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
    found = events.scalars(files)
    assert "tensorflow" not in sys.modules, "TensorBoard's reader imported TensorFlow into the test process"
    return files, found


def assert_event_epochs(log_dir):
    """Every epoch of metrics.jsonl is in the run's TensorBoard event files, with the same test accuracy."""
    files, found = event_scalars(log_dir)
    assert files, f"no TensorBoard event file in {log_dir}"
    epochs = {m["epoch"]: m["test_acc"] for m in metrics(log_dir)}
    assert {e: round(v, 5) for e, v in found.get("epoch/test_acc", {}).items()} == \
        {e: round(v, 5) for e, v in epochs.items()}, (found.get("epoch/test_acc"), epochs)
    # and the loss at the logged steps: at least each epoch's last step, finite
    steps = found.get("step/train_loss", {})
    assert len(steps) >= len(epochs) and all(0 <= v < 100 for v in steps.values()), steps


# === the failure tests' helpers ======================================================================
# What the failure tests share: the lessons, tiny MNIST sets, launching a job and signalling one of its
# ranks, and the checks that a log dir holds nothing half-written. Tests import what they use from here.
#
# Faults are injected from outside the examples: signals to a rank found in the launcher's process tree, or
# tests/hooks/faults.py, which tests/hooks/sitecustomize.py installs around utils/log.py
# at interpreter start-up when a test sets one of its COURSE_* variables (support.run then puts tests/hooks on
# PYTHONPATH). No lesson and nothing in utils/ knows about it.
#
# Timing fields (epoch_time_s, train_time_s, samples_per_s) are wall-clock measurements: every comparison of
# metrics histories leaves them out, and compares everything else exactly.
SCRIPTS = [DDP, HVD_TORCH, HVD_TF, HVD_KERAS, DS]
RESUMABLE = [DDP, HVD_TORCH, HVD_TF, DS]  # keras_main.py (model.fit) has no --resume
TIMING = {"epoch_time_s", "train_time_s", "samples_per_s"}
KILL_DEADLINE_S = 60


def without_timing(history, *also):
    """The history without its wall-clock fields (and the fields named in `also`)."""
    return [{k: v for k, v in m.items() if k not in TIMING and k not in also} for m in history]


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


def assert_log_dir_sound(log_dir, before=None):
    """Nothing half-written: every JSON file parses, every metrics line parses, no temporary file is left;
    and every file that existed before (`before`: {name: bytes}) is unchanged."""
    for name, content in (before or {}).items():  # (.lock: a run's lock, naming its latest holder)
        assert Path(name).name == ".lock" or (log_dir / name).read_bytes() == content, f"{name} changed"
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
    LAUNCHED.extend(launchers_in(cmd))
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
    """Rank 0 either says so in one line (course/failures.run_main) or is stopped by the launcher first: never a
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


def remove_the_half_written_file(folder, pattern):
    """What a crash in atomic_write leaves: one non-empty temporary file. Harmless; removed here so the final
    check (no temporary file anywhere) is strict."""
    partial = list(folder.glob(pattern))
    assert len(partial) == 1 and partial[0].stat().st_size > 0, partial
    partial[0].unlink()


# Many command lines of one lesson in one process (runpy), each's exit code and stderr: a table of bad
# flags costs one interpreter start, not one per row.
# What torchrun sets for rank 0 of 2 on one node: rows whose refusal depends on the world size (checked when the
# flags are parsed, before any rendezvous) run as that rank. One real 2-rank launch per lesson shows every rank
# refusing (tests/test_transformer_split.py, tests/test_zero.py).
RANK_0_OF_2 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def run_rows(script, rows, timeout=240, env=None):
    """[{"code": exit code, "stderr": text}] for `script` run with each row of flags, each row forked from one warm
    interpreter that imported the lesson's frameworks once (tests/rows.py)."""
    result = run(warm(1, ROOT / "tests" / "rows.py", ROOT / script, json.dumps(rows)), timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


# --- nodes: simulated on one host (tests/test_devices.py), or namespaces over a link (tests/test_nodes.py) ---
def run_together(commands, timeout):
    """Start every command at once (one per simulated node) and wait for all; a hang fails the test."""
    for c in commands:
        LAUNCHED.extend(launchers_in(c))
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c in commands]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"simulated nodes timed out after {timeout}s: {commands[0]}")
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def same_training(one_node, two_nodes):
    assert without_timing(metrics(one_node), "launcher") == without_timing(metrics(two_nodes), "launcher")
    if (one_node / "model.pt").exists():  # the model-splitting lessons: the whole model, gathered
        assert weights_digest(one_node) == weights_digest(two_nodes)
    else:
        checksums = summary(one_node)["param_checksums"]
        assert checksums == summary(two_nodes)["param_checksums"]  # identical weights, rank by rank
