"""One run per folder (course/runfiles.take_log_dir): while a run holds its --log-dir, a second run on it is refused
on every rank in one line that names the holder, and writes nothing there; once the first has ended, the folder is
free again. The lock dies with its process (a kernel record lock, not a pid file)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support import (
    BIN,
    DDP,
    DS,
    HVD_KERAS,
    HVD_TORCH,
    LAUNCHED,
    ROOT,
    assert_each_rank_refused,
    assert_log_dir_sound,
    check,
    deepspeed_launcher,
    horovodrun,
    kill_tree,
    launchers_in,
    mpiexec,
    run,
    warm,
)

SHORT = ["--epochs", "1", "--max-steps", "2", "--num-threads", "1"]
REFUSED = "is in use by another run (pid "


def files_of(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def start(cmd, out_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", PATH=f"{BIN}:{os.environ['PATH']}")
    LAUNCHED.extend(launchers_in(cmd))
    with open(out_path, "w") as out:
        return subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_for(proc, out_path, pattern, seconds=120):
    deadline = time.monotonic() + seconds
    while not re.search(pattern, out_path.read_text()):
        assert proc.poll() is None, f"exited early ({proc.returncode}):\n{out_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, out_path.read_text()[-3000:]
        time.sleep(0.2)


def test_a_second_run_on_a_running_runs_folder_is_refused_on_every_rank(tmp_path):
    """A real 2-rank run under mpiexec, mid-training; the same command on its folder, its ranks started warm."""
    first = start(mpiexec(2, DDP, "--epochs", "50", "--num-threads", "1", "--log-dir", tmp_path / "run"),
                  tmp_path / "first.txt")
    try:
        wait_for(first, tmp_path / "first.txt", r"epoch 1 step \d+/")
        before = {k: v for k, v in files_of(tmp_path / "run").items() if k.name in ("config.json", ".lock")}
        second = run(warm(2, DDP, *SHORT, "--lr", "0.5", "--log-dir", tmp_path / "run"), timeout=120)
        assert_each_rank_refused(second, REFUSED, 2, "warm")
        holder = re.search(r"\(pid (\d+) on \S+ since [\d-]+ [\d:]+: (.*)\): wait for it", second.stderr)
        assert holder and "DDP/main.py --epochs 50" in holder.group(2), second.stderr[-2000:]
        assert_log_dir_sound(tmp_path / "run", before)  # its config.json stays the first run's
        assert first.poll() is None  # and the first run trains on
    finally:
        kill_tree(first)
        first.wait()


HOLDER = """
import sys, time
sys.path.append(sys.argv[1])
from course.runfiles import take_log_dir
for rank in (0, 1):
    take_log_dir(sys.argv[2], rank, "a first run of 2 ranks")
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("script, launcher", [(DDP, mpiexec), (HVD_TORCH, horovodrun), (HVD_KERAS, mpiexec),
                                              (DS, deepspeed_launcher)],
                         ids=["ddp-mpiexec", "hvd-torch-horovodrun", "keras-mpiexec", "deepspeed-deepspeed"])
def test_every_launcher_refuses_a_held_folder_on_both_ranks(tmp_path, script, launcher):
    """The folder held by a first run of 2 ranks (its ranks' locks, taken by one process here); then, the holder
    gone (killed: no clean-up at all), the same folder is free."""
    holder = start([sys.executable, "-c", HOLDER, ROOT, tmp_path / "run"], tmp_path / "holder.txt")
    try:
        wait_for(holder, tmp_path / "holder.txt", "held")
        before = files_of(tmp_path / "run")
        second = run(launcher(2, script, *SHORT, "--log-dir", tmp_path / "run"), timeout=180)
        assert_each_rank_refused(second, f"{tmp_path / 'run'} {REFUSED}{holder.pid} on ", 2, launcher)
        assert "a first run of 2 ranks): wait for it to end" in second.stdout + second.stderr
        assert files_of(tmp_path / "run") == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    if launcher is mpiexec and script == DDP:  # the lock died with its holder
        check(run(warm(1, script, *SHORT, "--log-dir", tmp_path / "run"), timeout=120))
