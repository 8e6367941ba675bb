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
