"""A rank dies (SIGKILL) or hangs (SIGSTOP) mid-epoch: the whole job ends, under every launcher, in one line."""
import re
import signal

import pytest

from support import (
    DDP,
    DS,
    HVD_TF,
    HVD_TORCH,
    KILL_LAUNCHES,
    LONG,
    PP,
    ROOT,
    TP,
    assert_log_dir_sound,
    assert_no_traceback_through_the_example,
    error_lines,
    free_port,
    horovodrun,
    run,
    signal_rank_1,
    torchrun,
    warm,
)


@pytest.mark.parametrize("script,launcher", KILL_LAUNCHES)
def test_sigkill_of_one_rank_ends_the_whole_job(tmp_path, script, launcher):
    """SIGKILL rank 1 mid-epoch: rank 0 must be gone and the launcher must return non-zero within 60 s."""
    rc, survivor_s, launcher_s, output = signal_rank_1(tmp_path, script, launcher, signal.SIGKILL)
    print(f"\n[{script} / {launcher.__name__}] rank 0 gone {survivor_s:.2f} s after SIGKILL of rank 1; "
          f"launcher exit {rc} after {launcher_s:.2f} s")
    assert rc != 0
    assert not (tmp_path / "log" / "summary.json").exists()  # no rank finished as if nothing happened
    assert_log_dir_sound(tmp_path / "log")
    assert_no_traceback_through_the_example(output)


TORN_DOWN = """import sys
sys.path.append(sys.argv[1])
import horovod.torch as hvd
import torch
from course import failures


def main():
    hvd.init()
    pending = hvd.allreduce_async(torch.ones(3), name="grad")
    hvd.mpi_ops.mpi_lib.horovod_torch_reset()  # what the process's exit does to the table of pending ones
    hvd.synchronize(pending)  # (in the lesson: optimizer.step())


failures.run_main(main)
"""


def test_a_horovod_wait_torn_down_by_mpis_abort_is_one_line(tmp_path):
    """Under mpiexec, rank 1's SIGKILL fails rank 0's MPI_Allreduce on Horovod's thread, and MPI's abort exits the
    process from there; before mpiexec's kill lands, the exit empties Horovod PyTorch's table of pending operations
    under the lesson's wait: ValueError "Handle N was not created or has been cleared." (make test-all, 2026-12-06:
    a traceback through horovod/pytorch/main.py, test_sigkill_of_one_rank_ends_the_whole_job[hvd-torch-mpiexec]).
    Here Horovod's own reset empties it, so the timing is certain: one line that says a peer was lost, exit 1."""
    (tmp_path / "rank.py").write_text(TORN_DOWN)
    result = run(warm(1, tmp_path / "rank.py", ROOT), timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        "error: rank 0 lost contact with another rank before any training step it reported (it died, or hung past "
        "the collective timeout): Handle 1 was not created or has been cleared."], result.stderr[-3000:]


PAIR_CLOSED = """import argparse, os, sys, time
from datetime import timedelta
sys.path.append(sys.argv[1])
import torch
import torch.distributed as dist
from course import failures


def main():
    failures.note_args(argparse.Namespace(dist_timeout=2))
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:  # silent past rank 0's timeout
        time.sleep(5)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1000))  # "Timed out waiting 2000ms": gloo closes the pair...
    except RuntimeError:
        pass  # (in DDP: the bucket whose wait on gloo's other thread came first)
    dist.all_reduce(torch.ones(1000))  # ...and the next wait on it says why it is closed


failures.run_main(main)
"""


def test_a_wait_on_the_pair_a_timeout_closed_is_one_line(tmp_path):
    """A hung rank 1 under DDP: each bucket's all-reduce waits on one of gloo's threads; the first to time out closes
    the pair, and the wait the lesson meets may be the other one: RuntimeError "Application timeout caused pair
    closure" (make test K=ddp, 2026-12-06: a traceback through DDP/main.py in
    test_a_hung_rank_ends_the_job_after_the_collective_timeout[ddp-torchrun]). Here the next collective meets the
    closed pair every time: rank 0 says it waited, in one line, exit 1."""
    (tmp_path / "ranks.py").write_text(PAIR_CLOSED)
    result = run(warm(2, tmp_path / "ranks.py", ROOT), timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and re.match(r"error: rank 0 waited 2 s .*\[Application timeout caused pair closure\]$",
                                         errors[0]), result.stderr[-3000:]


@pytest.mark.serial  # a deadline in seconds: measured alone on the machine
@pytest.mark.parametrize("script,launcher", [pytest.param(DDP, torchrun, id="ddp-torchrun"),
                                             pytest.param(DS, torchrun, id="deepspeed-torchrun", marks=LONG),
                                             pytest.param(HVD_TORCH, horovodrun, id="hvd-torch-horovodrun-gloo",
                                                          marks=LONG),
                                             pytest.param(HVD_TF, horovodrun, id="hvd-tf-horovodrun-gloo",
                                                          marks=LONG)])
def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path, script, launcher):
    """SIGSTOP rank 1 (alive, silent: a hung node): with --dist-timeout 10 rank 0's collective gives up after
    10 s, rank 0 exits with one line, and the launcher tears the job down (rank 1, resumed once rank 0 is gone,
    takes the launcher's SIGTERM: see signal_rank_1). Horovod's examples turn --dist-timeout into
    HOROVOD_GLOO_TIMEOUT_SECONDS (course/dist.horovod_knobs)."""
    rc, survivor_s, launcher_s, output = signal_rank_1(tmp_path, script, launcher, signal.SIGSTOP,
                                                       "--dist-timeout", "10")
    print(f"\n[{script} / hung rank 1] rank 0 gone after {survivor_s:.1f} s; "
          f"launcher exit {rc} after {launcher_s:.1f} s")
    assert rc != 0
    assert survivor_s >= 9, "rank 0 gave up before the 10 s timeout: it did not wait on the collective"
    # ... and the 10 s came from --dist-timeout, not a library default (gloo in Horovod: 30 s; torch: 30 min)
    assert survivor_s < 25, f"rank 0 waited {survivor_s:.0f} s: --dist-timeout 10 did not reach the collectives"
    # the one line names the waiting rank, the call and line it waited in, how long, epoch and step (not a
    # fixed one: rank 1 is stopped on a timer), what next
    said = (r"error: rank 0 waited 1\d s in \w+ at \S+:\d+ in epoch \d+ after step \d+/\d+ for rank 1 \(silent "
            r".*diagnose/stacks.py")  # (rank 1 named: course/beacon.py)
    waited = [line for line in error_lines(output) if re.search(said, line)]
    assert len(waited) == 1, output[-4000:]
    if launcher is torchrun:  # torchrun's report names that line as the root cause, from the worker's error file
        root_cause = output.split("Root Cause (first observed failure):")[-1]
        assert "Root Cause" in output and "error_file: <N/A>" not in root_cause, output[-3000:]
        assert re.search(r"traceback : " + said, root_cause), root_cause
    assert_no_traceback_through_the_example(output)
    assert_log_dir_sound(tmp_path / "log")




def test_ranks_waiting_for_one_that_never_joined_say_so_at_the_lessons_line(tmp_path):
    """Ranks 0 and 1 of 3, rank 2 never started: each waits --dist-timeout in init_process_group, then one line
    that names the lesson's own line of the call (not a frame of the course's plumbing around it) and that a rank
    never joined; c10d's socket timeouts are not shown. The run's folder, which it made, is removed (no result in
    it); the empty folder above it, which was there before, is not."""
    from concurrent.futures import ThreadPoolExecutor
    port = free_port()
    (tmp_path / "empty").mkdir()

    def rank(r):
        env = {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test"}
        return run(warm(1, DDP, "--dist-timeout", "5", "--log-dir", tmp_path / "empty" / "log"), env=env,
                   timeout=120)  # (each a process of its own, given a launcher's variables by hand)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, (0, 1)))
    assert (tmp_path / "empty").is_dir() and not (tmp_path / "empty" / "log").exists()
    for r, result in enumerate(results):
        assert result.returncode != 0
        lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("warning: ")]
        assert len(lines) == 1, result.stderr[-3000:]
        # rank 0 holds the store and counts who reached it; rank 1 waits for rank 0, which waits itself
        who = "1 of the 3 ranks, which never joined it" if r == 0 else "a rank that never joined it"
        assert re.match(rf"error: rank {r} waited 5 s.* in init_process_group at DDP/main\.py:\d+ .*{who}",
                        lines[0]), lines[0]


@pytest.mark.parametrize("script", [DDP, TP, PP])
def test_a_rank_with_no_rank_0_anywhere_says_so_in_one_line(tmp_path, script):
    """Rank 1 of 2 started alone (or rank 0 died before it listened): one line naming the address where
    rank 0 was expected, and nothing else on stderr: c10d's retry lines and their C++ frames (about 40 lines) are
    dropped while the rank joins, and shown with COURSE_VERBOSE=1; a non-zero exit."""
    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    result = run(warm(1, script, "--dist-timeout", "3", "--log-dir", tmp_path / "log"), env=env, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: rank 1 found no rank 0 at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT; rank 0 listens there): "
        "rank 0 never started, died before, or listens elsewhere; start every rank with one launcher, or check "
        "the address"], result.stderr[-3000:]
    if script == DDP:  # the frames are torch's, and there: the filter is what hides them
        verbose = run(warm(1, script, "--dist-timeout", "3", "--log-dir", tmp_path / "log"),
                      env={**env, "COURSE_VERBOSE": "1"}, timeout=120)
        assert re.search(r"^frame #\d+: ", verbose.stderr, re.M) and "[c10d]" in verbose.stderr, verbose.stderr[-3000:]


def test_a_rank_whose_peer_refused_bad_input_says_so_and_exits_2(tmp_path):
    """Rank 1 finds bad input after it joined (planted: a UserError at step 2): its one line, exit 2, and its line
    left in the run's store; rank 0, whose collective then loses it, says that rank 1 refused and why (not "lost
    contact"), and exits 2 too: the job ended on bad input."""
    result = run(warm(2, DDP, "--epochs", "1", "--max-steps", "4", "--num-threads", "1", "--log-dir",
                      tmp_path / "log"), env={"COURSE_PLANT": "refuse:1:1:2"}, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    refused = "COURSE_PLANT: rank 1 refuses at epoch 1 step 2"
    assert sorted(error_lines(result.stderr)) == [f"error: {refused}",
                                                  f"error: rank 0 stopped: rank 1 refused: {refused}"], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
