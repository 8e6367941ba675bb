"""Ctrl-C (SIGINT to the whole job) and a scheduler's walltime warning (SIGTERM): every rank stops
within seconds with one line (where it stopped, the last good checkpoint, "rerun with --resume
auto"), the conventional exit code, no traceback through the lessons, and the checkpoint loads
again. Also: a run stopped after it trained, before its first result, keeps its folder with how each rank
ended."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support import (
    BIN,
    DDP,
    DS,
    HVD_TF,
    HVD_TORCH,
    LAUNCHED,
    ROOT,
    check,
    deepspeed_launcher,
    error_lines,
    horovodrun,
    kill_tree,
    launchers_in,
    mpiexec,
    ranks_of,
    run,
    stopped_epoch,
    torchrun,
    warm,
)

STOP_DEADLINE_S = 20


def start(cmd, out_path, tmp=None):
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    if tmp:  # the job's temporary folder (TMPDIR), to count what it leaves there
        tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp)
    LAUNCHED.extend(launchers_in(cmd))
    with open(out_path, "w") as out:
        return subprocess.Popen(
            [str(c) for c in cmd],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(proc, out_path, pattern, deadline_s=240):
    deadline = time.monotonic() + deadline_s
    while not re.search(pattern, out_path.read_text()):
        assert proc.poll() is None, (
            f"exited early ({proc.returncode}):\n{out_path.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, (
            f"never saw {pattern!r}:\n{out_path.read_text()[-3000:]}"
        )
        time.sleep(0.2)


def interrupt(tmp_path, script, launcher, sig, at):
    """Start a 2-rank job of 20-step epochs, send `sig` to the whole job (as a terminal's Ctrl-C or
    a scheduler does) once `at` appears; return the launcher's exit code, seconds until every rank
    and the launcher were gone, the output after the signal, and the whole output."""
    out_path = tmp_path / "output.txt"
    proc = start(
        launcher(
            2,
            script,
            "--epochs",
            "50",
            "--max-steps",
            "20",
            "--log-interval",
            "5",
            "--num-threads",
            "1",
            "--log-dir",
            tmp_path / "log",
        ),
        out_path,
        tmp=tmp_path / "tmp",
    )
    try:
        wait_for(proc, out_path, at)
        ranks = list(ranks_of(proc.pid, script).values())
        assert len(ranks) == 2
        before = len(out_path.read_text())
        os.killpg(proc.pid, sig)
        sent = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=STOP_DEADLINE_S)
        assert not alive, (
            f"ranks still running {STOP_DEADLINE_S} s after {sig!r}:\n"
            f"{out_path.read_text()[-3000:]}"
        )
        rc = proc.wait(timeout=STOP_DEADLINE_S)
        took = time.monotonic() - sent
    finally:
        kill_tree(proc)  # the launcher, and any rank it left behind
        proc.wait()
    output = out_path.read_text()
    return rc, took, output[before:], output


CASES = [
    pytest.param(DDP, torchrun, signal.SIGINT, id="ddp-torchrun-sigint"),
    pytest.param(DDP, mpiexec, signal.SIGTERM, id="ddp-mpiexec-sigterm"),
    pytest.param(DS, deepspeed_launcher, signal.SIGINT, id="deepspeed-deepspeed-sigint"),
    pytest.param(HVD_TORCH, horovodrun, signal.SIGTERM, id="hvd-torch-horovodrun-sigterm"),
    pytest.param(HVD_TF, mpiexec, signal.SIGINT, id="hvd-tf-mpiexec-sigint"),
]


@pytest.mark.parametrize("script,launcher,sig", CASES)
def test_a_signal_stops_every_rank_in_one_line_and_the_checkpoint_resumes(
    tmp_path, script, launcher, sig
):
    rc, took, after, output = interrupt(tmp_path, script, launcher, sig, r"epoch 2 step 10/")
    print(
        f"\n[{script} / {launcher.__name__} / {sig.name}] every rank gone after {took:.1f} s, "
        f"launcher exit {rc}"
    )
    stopped = [
        line for line in after.splitlines() if re.search(r"stopped: rank \d stopped by", line)
    ]
    print("\n".join(stopped))
    assert sorted(int(re.search(r"rank (\d)", line).group(1)) for line in stopped) == [0, 1], after[
        -3000:
    ]
    # signalled once "epoch 2 step 10/" was seen: epoch 2 or later, the same on both ranks
    epochs = {stopped_epoch(line, sig.name) for line in stopped if "rerun with --resume auto" in line}
    assert len(epochs) == 1 and min(epochs) >= 2, stopped
    (epoch,) = epochs
    assert not re.search(rf'File "{re.escape(str(ROOT))}/(DDP|horovod|deepspeed)/', output), after[
        -3000:
    ]
    # nothing of the ranks' left in the temporary folder (TensorFlow's autograph writes a file per
    # traced function and removes it only in an exit hook, which a stop skips: course/plumbing.py)
    left = [p.name for p in (tmp_path / "tmp").rglob("*") if "autograph" in p.name or "scaling-dl-tmp" in p.name]
    assert not left, left
    if launcher in (mpiexec,):  # the launcher passes the ranks' exit code on: 128 + the signal
        assert rc == 128 + sig, rc
        # the two lines, a progress line in flight, and Hydra's two on SIGINT ("Sending Ctrl-C to
        # processes")
        assert len(after.splitlines()) <= 5, after
    elif launcher is not horovodrun:  # torchrun: 1; the deepspeed launcher: ended by the signal
        assert rc != 0, (rc, after[-3000:])
    # (horovodrun: usually 1, but 0 when Horovod's two waiters for a rank's shell race: diagnose/hangs.md)
    # the folder keeps how each rank ended (ending.txt), and the rerun says what it found there
    ended = (tmp_path / "log" / "ending.txt").read_text().splitlines()
    assert sorted(int(re.search(r" rank (\d), exit ", line).group(1)) for line in ended) == [0, 1], ended
    assert all("stopped: rank" in line and sig.name in line for line in ended), ended
    # the checkpoint is intact: the same job continues from it (ranks started warm: the claim is the checkpoint's)
    resumed = run(
        warm(
            2,
            script,
            "--epochs",
            str(epoch),
            "--max-steps",
            "2",
            "--num-threads",
            "1",
            "--resume",
            "auto",
            "--log-dir",
            tmp_path / "log",
            launcher="horovodrun" if script in (HVD_TORCH, HVD_TF) else None,
        ),
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing at epoch {epoch}" in resumed.stdout
    assert f"{tmp_path / 'log'} holds a run that ended badly (ending.txt: " in resumed.stdout
    assert not (tmp_path / "log" / "ending.txt").exists()  # the folder is the new run's


def test_stopped_in_the_first_epoch_keeps_its_folder_as_evidence(tmp_path):
    """Stopped after it trained, before any checkpoint: the folder stays (config.json, the event files, each
    rank's line in ending.txt), and the lock goes with the processes: a rerun takes the folder, says what it
    found, and starts at epoch 1. (A start that never trained leaves nothing: tests/test_failures_bad_*.py.)"""
    rc, took, after, _ = interrupt(tmp_path, DDP, mpiexec, signal.SIGINT, r"epoch 1 step 5/")
    assert rc == 130
    assert after.count("no checkpoint written yet: a rerun starts at epoch 1") == 2, after
    log_dir = tmp_path / "log"
    assert (log_dir / "config.json").is_file() and list(log_dir.glob("events.out.tfevents.*"))
    ended = (log_dir / "ending.txt").read_text().splitlines()
    assert len(ended) == 2 and all("exit 130: stopped: rank" in line for line in ended), ended
    rerun = check(run(warm(1, DDP, "--epochs", "1", "--max-steps", "2", "--num-threads", "1", "--log-dir", log_dir),
                      timeout=120))
    assert f"{log_dir} holds a run that ended badly (ending.txt: " in rerun.stdout
    assert "starts at epoch 1" in rerun.stdout and not (log_dir / "ending.txt").exists()


RACE = """
import os, signal, sys
sys.path.append(sys.argv[1])
from course import failures
making_the_line = failures._peer_line


def peer_line_while_the_launcher_sends_sigterm(exc):
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun saw the other rank die: it stops this one
    return making_the_line(exc)


failures._peer_line = peer_line_while_the_launcher_sends_sigterm


def main():
    raise RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer")


failures.run_main(main)
"""


def test_the_launchers_sigterm_while_the_peer_error_is_written_leaves_that_one_line():
    """A launcher that sees one rank die sends the others SIGTERM, and it can land while a rank is
    still making its line about the lost peer (RACE sends it from inside failures._peer_line, so the
    timing is certain). Raised there, the signal's Interrupted would replace that line with a
    traceback; run_main calls interrupts.ending() before making the line, so a later signal is
    noted, not raised. The error that came first is the one reported: one line, exit 1, no traceback."""
    result = run([sys.executable, "-c", RACE, ROOT], timeout=120)
    errors = error_lines(result.stderr)
    assert result.returncode == 1, result.stderr
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost contact with another rank"), result.stderr
    assert "Traceback" not in result.stderr, result.stderr


SIGTERM_NOW = ("        os.kill(os.getpid(), signal.SIGTERM)  # the launcher, as this rank's timeout unwinds\n"
               "        sum(range(1000))  # (the handler runs here)\n")


@pytest.mark.parametrize("lands", ["in-torch", "in-the-course-wrapper"])
def test_a_timeout_the_launchers_sigterm_lands_in_still_names_the_lessons_line(tmp_path, lands):
    """The launcher's SIGTERM can land while a rank's own collective timeout unwinds: inside torch (CI, 2026-12-06,
    tests/test_failures_stuck_rank_named.py: rank 3's line lost "in init_process_group at DDP/main.py:123"), or in
    the course's wrapper around init_process_group (the next CI: "in watched at DDP/main.py:123"). The timeout is
    the line to print; where the lesson called the collective is in the signal's traceback, and which collective in
    the timeout's. A lesson, a torch stand-in and a wrapper in a folder of their own, taken for the repository."""
    (tmp_path / "site-packages" / "distributed").mkdir(parents=True)
    (tmp_path / "site-packages" / "distributed" / "c10d.py").write_text(
        "import os, signal\n"
        "class DistStoreError(RuntimeError):  # (torch's name)\n"
        "    pass\n"
        "def init_process_group():\n"
        "    try:\n"
        "        raise DistStoreError('wait timeout after 8000ms, keys: /default_pg/0//cpu//0/2')\n"
        "    finally:\n" + (SIGTERM_NOW if lands == "in-torch" else "        pass\n"))
    (tmp_path / "course").mkdir()  # (the plumbing's folder: course/wrap.py's `watched`)
    (tmp_path / "course" / "wrapper.py").write_text(
        "import os, signal\n"
        "def watched(join):\n"
        "    try:\n"
        "        join()\n"
        "    finally:\n" + (SIGTERM_NOW if lands != "in-torch" else "        pass\n"))
    (tmp_path / "lesson.py").write_text(
        f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(tmp_path / 'site-packages')!r}, "
        f"{str(tmp_path / 'course')!r}]\n"
        "from course import failures\n"
        f"failures.ROOT = {str(tmp_path)!r}\n"
        "from distributed import c10d\n"
        "import wrapper\n\n\n"
        "def main():\n"
        "    wrapper.watched(c10d.init_process_group)\n\n\n"
        "failures.run_main(main)\n")
    result = run([sys.executable, tmp_path / "lesson.py"], timeout=120)
    errors = error_lines(result.stderr)
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert errors[0].startswith("error: rank 0 waited 8 s in init_process_group at lesson.py:10 "), errors[0]


def test_a_temporary_folder_left_by_a_killed_rank_goes_at_the_next_start(tmp_path, monkeypatch):
    """SIGKILL runs no exit hook: the folder of a process that is gone is removed when the next one
    starts; a running process's folder is kept."""
    # (a test that imported the plumbing into this process has set it here already: the child must choose it)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    from course.scratch import TMP_PREFIX
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, alive = tmp_path / f"{TMP_PREFIX}{gone.pid}", tmp_path / f"{TMP_PREFIX}{os.getpid()}"
    for folder in (dead, alive):
        folder.mkdir()
        (folder / "__autograph_generated_file1.py").write_text("")
    code = ("import os, tempfile, course.plumbing; print(tempfile.gettempdir()); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    result = run([sys.executable, "-c", code], env={"TMPDIR": str(tmp_path)}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not dead.exists() and alive.exists()
    private, compiled = result.stdout.split()
    assert private.startswith(str(tmp_path / TMP_PREFIX))  # its own, removed as it ended
    assert not os.path.exists(private)
    # torch.compile's kernels are not in it: they outlive the run, where torch keeps them (<tmp>/torchinductor_<user>)
    assert os.path.dirname(compiled) == str(tmp_path) and os.path.basename(compiled).startswith("torchinductor_")
