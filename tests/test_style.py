"""The style written down once (pyproject.toml): ruff finds nothing, lessons (and the diagnose/ scripts) keep to
100 columns, and the lessons' first lines keep their order (the repo root appended to sys.path, then the
course plumbing's import, then the frameworks)."""
import re
import subprocess
import sys

import pytest

from support import ROOT

# Lessons and the utils/ modules they import: 100 columns (the .ruff.toml in their folders). Everything else: 120.
LESSONS = ["DDP/main.py", "horovod/pytorch/main.py", "horovod/tensorflow/main.py",
           "horovod/tensorflow/keras_main.py", "deepspeed/main.py", "zero/main.py", "zero/census.py",
           "zero/report.py", "zero/fsdp_checkpoint.py"]
# The diagnose/ chapter's scripts are read beside its README like a lesson: 100 columns too. Only overlap.py runs
# as a lesson does (the plumbing's import, then torch at the top); the others import torch inside functions.
DIAGNOSE = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "diagnose").glob("*.py"))
UTILS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "utils").glob("*.py"))
FRAMEWORKS = ("torch", "tensorflow", "tf_keras", "keras", "horovod", "deepspeed")


def ruff(*args):
    """The pinned ruff of this environment (requirements.txt; `make setup` installs it)."""
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def line_length(path):
    """The line length ruff applies to `path` (its nearest config: pyproject.toml or a folder's .ruff.toml)."""
    result = ruff("check", "--no-cache", "--show-settings", path)
    assert result.returncode == 0, f"ruff is in requirements.txt (`make setup` installs it): {result.stderr}"
    return int(re.search(r"^linter\.line_length = (\d+)$", result.stdout, re.M).group(1))


def test_ruff_finds_nothing():
    result = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, f"ruff check (fix these, see pyproject.toml):\n{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", LESSONS + DIAGNOSE + UTILS)
def test_lessons_and_utils_keep_to_100_columns(path):
    assert line_length(path) == 100, f"{path}: no .ruff.toml with line-length = 100 in its folder"


@pytest.mark.parametrize("path", ["tools/launch.py", "tests/test_style.py"])
def test_tools_and_tests_keep_to_120_columns(path):
    assert line_length(path) == 120, path


@pytest.mark.parametrize("path", [p for p in LESSONS if p.endswith(("main.py", "_parallel.py", "_checkpoint.py"))]
                         + ["diagnose/overlap.py"])
def test_the_plumbing_comes_before_the_frameworks(path):
    """Import sorting must not move these: the sys.path line makes `utils` importable, and the plumbing
    must run before a framework import can fail or print."""
    lines = (ROOT / path).read_text().splitlines()

    def first(pattern):
        found = [i for i, line in enumerate(lines) if re.match(pattern, line)]
        assert found, f"{path}: no line matches {pattern!r}"
        return found[0]

    framework = first(rf"(import|from) ({'|'.join(FRAMEWORKS)})\b")
    if any(line.startswith("    from course import plumbing") for line in lines):  # a lesson that lifts out
        plumbing = first(r"try:  # course plumbing, ")  # the comment says what it is
        assert lines[plumbing + 1].startswith("    from course import plumbing  #"), path
        assert lines[plumbing + 2:plumbing + 4] == ["except ImportError:", "    plumbing = None"], path
        assert first(r"sys\.path\.append\(") < plumbing < framework, \
            f"{path}: sys.path.append, the optional plumbing import, then the frameworks"
        return
    plumbing = first(r"from course import plumbing  # noqa: F401  \(course plumbing: ")  # the comment says what
    assert first(r"sys\.path\.append\(") < plumbing < framework, \
        f"{path}: sys.path.append, the plumbing's import (it filters the noise), then the frameworks"
