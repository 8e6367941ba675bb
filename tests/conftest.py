"""pytest's own hooks only. The helpers the tests share live in tests/support.py (run, check, the launchers)."""
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent))  # `import support` works from any working directory


@pytest.fixture(autouse=True)
def no_tensorflow_in_the_test_process():
    """The test process never imports TensorFlow: with torch 2.14.1, TensorFlow 2.21 and triton 3.8 here, a process that
    loads TensorFlow and then triton (torch imports it lazily, e.g. from torch.optim or the flop counter)
    dies of a segfault, and with it the whole test session. Tests that need TensorFlow run it as a child."""
    yield
    assert "tensorflow" not in sys.modules, "this test imported TensorFlow into the test process"


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
            if proc.info["status"] == psutil.STATUS_STOPPED and root in " ".join(proc.info["cmdline"] or []):
                left.append(proc)
        except psutil.Error:
            continue
    for proc in left:
        proc.kill()
    assert not left, f"stopped processes left behind: {[' '.join(p.info['cmdline'])[:200] for p in left]}"
