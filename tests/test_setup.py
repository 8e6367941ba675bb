"""make setup (tools/setup_env.sh): a disk too small is one line before anything is installed,
and the room it asks for covers what the course's venv really takes."""
import re
import shutil
import sys
from pathlib import Path

from support import ROOT, run

SETUP = ROOT / "tools" / "setup_env.sh"


def free_gb(path):
    return shutil.disk_usage(path).free / 2**30


def test_a_disk_too_small_is_one_line_before_any_install(tmp_path):
    venv = tmp_path / "venv"
    need = int(free_gb(tmp_path)) + 1000  # more than this disk has
    result = run(["bash", SETUP], timeout=120,
                 env={"VENV": str(venv), "SCALING_DL_NEED_GB": str(need), "PYTHON": sys.executable})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: make setup needs about {need} GB free"), lines
    assert re.search(r"its disk has [\d.]+ GB free", lines[0]), lines
    assert not list(venv.glob("lib/python*/site-packages/torch")), "it installed before checking"


def test_the_room_it_asks_for_covers_the_installed_venv():
    # the venv that `make test` runs in was built by make setup: its size must stay under the figure
    need = int(re.search(r'NEED_GB="\$\{SCALING_DL_NEED_GB:-(\d+)\}"', SETUP.read_text()).group(1))
    venv = Path(sys.prefix)
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    assert size / 2**30 < need, f"{venv} holds {size / 2**30:.1f} GB; setup_env.sh asks for {need} GB"
    assert size / 2**30 > need / 4, f"{venv} holds {size / 2**30:.1f} GB; is {need} GB still the right figure?"
