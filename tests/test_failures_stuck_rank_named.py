"""A stuck rank among 4 is named by the others, whenever it stops: right after joining, mid-epoch, or
at the evaluation. Each rank keeps its last step in the run's store (course/beacon.py), so the ranks that
give up waiting name the one that went silent, its last step, and its pid and host, in their one line:
under torchrun (the agent holds the store), under mpiexec (rank 0's process holds it) and under horovodrun
(its rendezvous server).
4 ranks on 2 cores: oversubscribed, which only makes each step slower."""
import contextlib
import os
import re
import signal
import socket
import subprocess
import time

import psutil
import pytest

from support import (
    BIN,
    DDP,
    HVD_TORCH,
    LAUNCHED,
    LONG,
    ROOT,
    assert_log_dir_sound,
    assert_no_traceback_through_the_example,
    error_lines,
    horovodrun,
    kill_tree,
    launchers_in,
    mpiexec,
    ranks_of,
    torchrun,
)

STEPS = 4  # training steps per epoch (--max-steps)
MOMENTS = {  # COURSE_PLANT (tests/hooks/faults.py) -> where the others must say rank 2 was last
    "joined": ("stop-early:2", "before its first training step"),
    "mid-epoch": ("stop:2:1:2", "in epoch 1 after step 2/4"),
    "evaluation": (f"stop:2:1:{STEPS}", f"in epoch 1 after step {STEPS}/{STEPS}"),  # its last step done
}


def stuck_job(tmp_path, launcher, plant, script=DDP):
    """4 ranks with rank 2 stopping itself where `plant` says; returns (launcher exit code, output, rank 2's
    pid). Once the others have said their line, every process is resumed, so that the stopped rank takes the
    launcher's SIGTERM (torchrun would wait 30 s before its SIGKILL: diagnose/hangs.md)."""
    cmd = [str(c) for c in launcher(4, script, "--epochs", "3", "--max-steps", str(STEPS), "--log-interval", "1",
                                    "--num-threads", "1", "--dist-timeout", "8", "--log-dir", tmp_path / "log")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", COURSE_PLANT=plant, PATH=f"{BIN}:{os.environ['PATH']}",
               PYTHONPATH=str(ROOT / "tests" / "hooks"))
    out_path = tmp_path / "output.txt"
    LAUNCHED.extend(launchers_in(cmd))
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pid = None
    try:
        deadline = time.monotonic() + 150
        while len(error_lines(out_path.read_text())) < 3 and proc.poll() is None:
            assert time.monotonic() < deadline, f"no line from the waiting ranks:\n{out_path.read_text()[-3000:]}"
            if pid is None and "COURSE_PLANT: rank 2 stops" in out_path.read_text():
                pid = ranks_of(proc.pid, script)[2].pid
            time.sleep(0.2)
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.send_signal(signal.SIGCONT)
        rc = proc.wait(timeout=60)
    finally:
        kill_tree(proc)
        proc.wait()
    return rc, out_path.read_text(), pid


# `make test` runs each moment under one launcher, each launcher at least once; `make test-all` all six
CASES = [pytest.param(moment, launcher, id=f"{moment}-{launcher.__name__}",
                      marks=[] if (moment, launcher) in {("joined", mpiexec), ("mid-epoch", torchrun),
                                                         ("evaluation", mpiexec)} else [LONG])
         for moment in MOMENTS for launcher in (torchrun, mpiexec)]


@pytest.mark.parametrize("moment,launcher", CASES + [
    pytest.param("mid-epoch", horovodrun, id="mid-epoch-horovodrun-gloo-horovod-pytorch")])
def test_the_ranks_that_waited_name_the_stuck_rank_and_its_last_step(tmp_path, launcher, moment):
    """Also Horovod under `horovodrun --gloo`: its rendezvous server is the store there."""
    plant, last = MOMENTS[moment]
    script = HVD_TORCH if launcher is horovodrun else DDP
    rc, output, pid = stuck_job(tmp_path, launcher, plant, script)
    assert rc != 0
    assert pid, output[-3000:]
    lines = [re.sub(r"^\[\d+\]<stderr>:", "", line) for line in error_lines(output)]  # (horovodrun's prefix)
    # each rank that waited (0, 1 and 3), once: how long, where, and for whom
    named = (rf"for rank 2 \(silent \d+ s {re.escape(last)}; pid {pid} on {re.escape(socket.gethostname())}\)"
             r" \(hung, stopped or elsewhere\); next: .*diagnose/stacks\.py")
    # (a rank whose peer gave up first sees its connection closed: it says that, and still whom they waited for)
    for rank in (0, 1, 3):
        mine = [line for line in lines if line.startswith(f"error: rank {rank} ")]
        said = (rf"error: rank {rank} (?:waited (\d+) s|lost contact with another rank) in \w+ at "
                rf"{re.escape(script)}:\d+ ")
        match = len(mine) == 1 and re.match(said + ".*" + named, mine[0])
        assert match and (match[1] is None or int(match[1]) >= 8), output[-4000:]  # at least --dist-timeout
    assert_no_traceback_through_the_example(output)
    assert_log_dir_sound(tmp_path / "log")


def test_a_rank_stopped_before_it_joined_is_named_by_the_ranks_that_waited(tmp_path):
    """Rank 2 of 4 stops as it starts, before init_process_group: the others wait --dist-timeout there and name
    it (gloo's wait names the key rank 2 never wrote; under torchrun the agent holds the store). Under mpiexec,
    where rank 0 holds the store and counts the ranks that reached it: test_failures_dead_ranks.py."""
    rc, output, pid = stuck_job(tmp_path, torchrun, "stop-before-join:2")
    assert rc != 0 and pid, output[-3000:]
    for rank in (0, 1, 3):
        mine = [line for line in error_lines(output) if line.startswith(f"error: rank {rank} ")]
        said = len(mine) == 1 and re.match(rf"error: rank {rank} waited (\d+) s in init_process_group at "
                                           rf"{re.escape(DDP)}:\d+ .*for rank 2, which never joined it", mine[0])
        assert said and int(said[1]) >= 8, output[-4000:]  # at least --dist-timeout (more on a loaded machine)
    assert_no_traceback_through_the_example(output)
