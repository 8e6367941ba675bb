"""Helpers for tests that launch real processes through real launchers, always with a timeout (imported by the
test modules as `support`; pytest puts this folder on sys.path)."""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: torchrun, mpiexec, horovodrun, deepspeed
sys.path.append(str(ROOT))  # after site-packages: `import horovod` stays the library
from utils.dist import free_port  # noqa: F401  (the tests import it from here)
from utils.tools.launch import EXAMPLES, launch_command

# The examples' scripts, relative to the repository root, from the one table of them (utils/tools/examples.tsv).
DDP = EXAMPLES["ddp"]
HVD_TORCH = EXAMPLES["horovod-pytorch"]
HVD_TF = EXAMPLES["horovod-tensorflow"]
HVD_KERAS = EXAMPLES["horovod-keras"]
DS = EXAMPLES["deepspeed"]
ZERO = EXAMPLES["zero"]
TP = EXAMPLES["tensor-parallel"]
PP = EXAMPLES["pipeline-parallel"]


def run(cmd, timeout=300, env=None, cwd=ROOT):
    """Run `cmd` in its own process group; on timeout kill the whole group and fail (a hang is a failure)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                    PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    full_env.update(env or {})
    if any(name.startswith("COURSE_") for name in env or {}):  # test-only fault injection (tests/hooks/faults.py)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "hooks"),
                                                                 full_env.get("PYTHONPATH")]))
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
    """stderr lines that our scripts print for bad input (one per rank): `error: ...` from utils.log.fail or
    `main.py: error: ...` from argparse, possibly behind horovodrun's `[rank]<stderr>:` prefix."""
    return [line for line in stderr.splitlines() if re.search(r"(^|<stderr>:)(\S+\.py: )?error: ", line)]


def assert_each_rank_refused(result, words, nproc, launcher):
    """Bad input on `nproc` ranks: a non-zero exit, and every `error:` line names `words`. How many
    ranks get to print depends on the launcher (`launcher`: its name or its command function).
    mpiexec lets every rank finish: one line per rank. torchrun, horovodrun and the deepspeed
    launcher stop the other workers the moment one exits, so a slower rank (still importing its
    framework) may not reach its check: torchrun's report names it (exitcode -15, or 143 with our
    `stopped` line); the other two only say that they killed it, so there at least one line."""
    launcher = getattr(launcher, "__name__", launcher)
    output = result.stdout + result.stderr
    errors = error_lines(output)
    assert result.returncode != 0, output[-3000:]
    assert errors and all(words in e for e in errors) and len(errors) <= nproc, output[-3000:]
    if launcher == "mpiexec":
        assert len(errors) == nproc, output[-3000:]
    elif launcher == "torchrun":  # a rank that printed its line may still be reported as stopped
        stopped = len(re.findall(r"exitcode\s*:\s*(?:-15|143)\b", output))
        assert len(errors) + stopped >= nproc, output[-3000:]
    else:
        assert launcher in ("horovodrun", "deepspeed_launcher"), launcher


def horovodrun(nproc, script, *args, controller="--gloo"):
    return launch_command(script, nproc, "horovodrun" if controller == "--gloo" else "horovodrun-mpi", args)


READ_EVENTS = """
import json, sys
from pathlib import Path
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
found = {}
for path in sys.argv[1:]:
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        found.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
print(json.dumps(found))
"""


def event_scalars(log_dir):
    """(event files, {tag: {step: value}}) from the TensorBoard event files in log_dir, read with
    TensorBoard's own reader in a child process: that reader imports TensorFlow, and TensorFlow and
    triton (which torch loads lazily) crash a process that holds both (see conftest.py)."""
    files = sorted(Path(log_dir).glob("events.out.tfevents.*"))
    if not files:
        return files, {}
    result = run([sys.executable, "-c", READ_EVENTS, *files], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    return files, {tag: {int(step): value for step, value in steps.items()} for tag, steps in found.items()}


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
