"""Our folders horovod/ and deepspeed/ share names with the libraries: they must never shadow them."""
import subprocess
import sys

import pytest

from support import ROOT

PROBE = "import horovod.torch, deepspeed; print('AT', horovod.torch.__file__); print('AT', deepspeed.__file__)"


@pytest.mark.parametrize("how", ["cwd", "sys.path[0]"])
def test_libraries_resolve_to_site_packages(how):
    # From the repo root (cwd on sys.path, as `python -m pytest` and `python -c` have it), and even with the
    # root placed first on sys.path, the installed packages win: our folders hold no __init__.py.
    code = PROBE if how == "cwd" else f"import sys; sys.path.insert(0, {str(ROOT)!r}); " + PROBE
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    paths = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("AT ")]  # not warnings
    assert len(paths) == 2
    for path in paths:
        assert "site-packages" in path and not path.startswith(str(ROOT / "horovod")) \
            and not path.startswith(str(ROOT / "deepspeed")), path


def test_no_init_py_in_library_named_folders():
    for folder in ("horovod", "deepspeed"):
        assert not list((ROOT / folder).rglob("__init__.py")), folder
