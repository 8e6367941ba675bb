"""pytest's hooks and the fixtures tests share (a test names a fixture as an argument; nothing imports it). The
helpers live in tests/support.py (run, check, the launchers, the failure tests' helpers)."""
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent))  # `import support` works from any working directory
from support import ROOT, check, launch_command, made_once, quick, run, write_idx_set


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_the_session(tmp_path_factory):
    """What the launchers leave in the temporary folder goes into this session's folder (pytest keeps the last
    three sessions' and removes older ones), not into /tmp: torchrun leaves a torchelastic_* folder per launch
    (its workers' log folders, empty unless asked to redirect), and one suite run launches it hundreds of times."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # (tempfile reads TMPDIR again)
    yield
    if before is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


# Every process a test starts carries this session's mark (a worker's, under `make test`'s workers): what a test
# looks for among the machine's processes is its own session's, not a neighbouring worker's.
SESSION_MARK = "SCALING_DL_TEST_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}"


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """shared_run(script, launcher, flags): a 2-rank run of a lesson under a launcher with these flags, made once
    and read by every test that asks for the same one: a lesson's own tests (the loss falls, the ranks agree, a
    resumed run ends where it ended) and tests/test_lift_out.py (a copy of the lesson ends the same, digit for
    digit). Returns (log dir, stdout + stderr). Under `make test`'s workers (pytest-xdist) the run is made once for
    all of them: the first to ask makes it in their common folder, under a lock the others wait on."""
    from filelock import FileLock
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    base = tmp_path_factory.getbasetemp()
    common = (base.parent if worker else base) / "shared-runs"
    common.mkdir(exist_ok=True)

    def get(script, launcher, flags, timeout=300):
        key = ((ROOT / script).resolve(), launcher, tuple(map(str, flags)))
        name = f"{key[0].parent.name}-{key[0].stem}-{launcher}-{hashlib.sha256(repr(key).encode()).hexdigest()[:10]}"
        log_dir, output = common / name.lower(), common / f"{name.lower()}.out"
        with FileLock(f"{log_dir}.lock"):
            if not output.exists():
                shutil.rmtree(log_dir, ignore_errors=True)  # (a run that failed before: made again, and checked)
                result = check(run(launch_command(script, 2, launcher, [*flags, "--log-dir", log_dir]),
                                   timeout=timeout))
                output.write_text(result.stdout + result.stderr)
        return log_dir, output.read_text()
    return get


@pytest.fixture(autouse=True)
def no_tensorflow_in_the_test_process():
    """The test process never imports TensorFlow: with torch 2.14.1, TensorFlow 2.21 and triton 3.8 here, a process that
    loads TensorFlow and then triton (torch imports it lazily, e.g. from torch.optim or the flop counter)
    dies of a segfault, and with it the whole test session. Tests that need TensorFlow run it as a child."""
    yield
    assert "tensorflow" not in sys.modules, "this test imported TensorFlow into the test process"


@pytest.fixture(autouse=True)
def a_test_that_names_a_launcher_runs_it(request):
    """support.launcher_named_but_not_run, over what the test started."""
    import support
    support.LAUNCHED.clear()
    yield
    problem = support.launcher_named_but_not_run(request.node.nodeid, support.LAUNCHED)
    if problem:
        pytest.fail(problem)


@pytest.fixture(autouse=True)
def no_stopped_process_left_behind():
    """A test that stops a rank (SIGSTOP) must end it too: a stopped process never ends by itself,
    and holds its memory and ports for the rest of the session."""
    yield
    import psutil
    root = str(Path(__file__).resolve().parents[1])
    left = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if (proc.info["status"] == psutil.STATUS_STOPPED and root in " ".join(proc.info["cmdline"] or [])
                    and proc.environ().get(SESSION_MARK) == os.environ[SESSION_MARK]):
                left.append(proc)
        except psutil.Error:
            continue
    for proc in left:
        proc.kill()
    assert not left, f"stopped processes left behind: {[' '.join(p.info['cmdline'])[:200] for p in left]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """256 training / 64 test digits: 8 steps of 32 per epoch on one rank, 4 on two."""
    return write_idx_set(tmp_path_factory.mktemp("tiny"), 256, 64)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny):
    """The uninterrupted run of an example (run once per module, shared by the tests below)."""
    def make(script, log_dir):
        check(run(quick(script, log_dir, "--data-dir", tiny), timeout=240))
        return log_dir
    return made_once(tmp_path_factory, make)
