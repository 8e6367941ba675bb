"""Walltime under a real scheduler: `scancel --signal=TERM` of a running Slurm job
(submissions/slurm/train.sh, DDP, 2 ranks) sends SIGTERM to its job step, as `sbatch
--signal=TERM@<seconds>` does before the walltime; every rank says where it stopped and which
checkpoint to continue from, in one line, and the job ends. (A plain `scancel` also signals the
batch script, which passes the signal on to srun while its `tee` ignores it and keeps copying:
tests/test_jobs_local.py checks that path with the workstation script.) Uses tests/test_slurm.py's
cluster (`make slurm-up`) and job helpers."""

import re
import time
from pathlib import Path

from support import run, stopped_epoch
from test_slurm import SLURM, frameworks, job_env, output, slurm, submit, wait  # noqa: F401


def test_scancel_stops_every_rank_in_one_line(slurm, frameworks, tmp_path):
    env = job_env(slurm, frameworks, tmp_path / "runs")
    job_id = submit(
        env,
        SLURM / "train.sh",  # EXAMPLE unset: DDP
        1,
        2,
        tmp_path,
        ["--epochs", "50", "--max-steps", "20", "--log-interval", "5"],
    )
    deadline = time.monotonic() + 300
    out_file = None
    while time.monotonic() < deadline:
        out_file = next(tmp_path.glob(f"*-{job_id}.out"), None)
        if out_file and "epoch 2 step 10/" in Path(out_file).read_text():
            break
        time.sleep(1)
    else:
        run(["scancel", job_id], env=env, timeout=30)
        shown = Path(out_file).read_text()[-3000:] if out_file else ""
        raise AssertionError(f"job {job_id} never reached epoch 2:\n{shown}")
    run(["scancel", "--signal=TERM", job_id], env=env, timeout=30)
    fields = wait(env, job_id, timeout=120)
    text = output(fields)
    stopped = [
        line
        for line in text.splitlines()
        if re.search(r"stopped: rank \d stopped by SIGTERM", line)
    ]
    print(f"\n[scancel] job {job_id}: {fields['JobState']}\n" + "\n".join(stopped))
    assert fields["JobState"] in ("FAILED", "CANCELLED"), fields  # ended, not left running
    assert sorted(re.search(r"rank (\d)", line).group(1) for line in stopped) == ["0", "1"], text[
        -3000:
    ]
    # Stopped in epoch 2 or later (the poll is once a second): the checkpoint named is the epoch before.
    assert all(stopped_epoch(line, "SIGTERM") >= 2 for line in stopped), stopped
    assert "Traceback" not in text, text[-3000:]
