"""submissions/local: the workstation scripts run for real with the course's .venv (2 ranks, a few
steps)."""

import os
import re
import signal
import subprocess
import time

from jobs_support import EXAMPLES, QUICK, SUB, expected_launch, launches, printed
from support import BIN, ROOT, check, kill_tree, metrics, run

PATH = "/usr/local/bin:/usr/bin:/bin"  # no .venv on PATH: the script activates it itself


def local_env(tmp_path, **settings):
    env = {
        "PATH": PATH,
        "RUNS_DIR": str(tmp_path / "runs"),
        "EXAMPLE": "",
        "NRANKS": "",
        "DRY_RUN": "",
        "TRAIN_ARGS": "",
        "VIRTUAL_ENV": "",
        "SWEEP": "",
        "SWEEP_RANKS": "",
        "REPO_DIR": "",
        "VENV": "",
    }
    env.update(settings)
    return env


def test_dry_run_prints_the_plan_with_or_without_the_venv_active(tmp_path):
    plans = []
    for path, venv in ((PATH, ""), (f"{BIN}:{PATH}", str(ROOT / ".venv"))):
        env = local_env(tmp_path, DRY_RUN="1", NRANKS="3", PATH=path, VIRTUAL_ENV=venv)
        out = check(
            run(["bash", SUB / "local" / "train.sh", "--epochs", "1"], env=env, timeout=60)
        ).stdout
        assert out.splitlines()[0] == "dry run: nothing is executed"
        plans.append(printed(out))
    assert plans[0] == plans[1]
    assert plans[0][0] == ["source", str(ROOT / ".venv" / "bin" / "activate")]
    assert not (tmp_path / "runs").exists()


def test_train_sh_runs_and_prints_its_own_launch_line(tmp_path):
    env = local_env(tmp_path, NRANKS="2")
    result = check(run(["bash", SUB / "local" / "train.sh", *QUICK], env=env, timeout=300))
    (log_dir,) = (tmp_path / "runs" / "local" / "ddp").iterdir()
    assert log_dir.name.endswith(".n2")
    assert [(m["epoch"], m["world_size"]) for m in metrics(log_dir)] == [(1, 2)]
    assert launches(result.stdout, "local") == [
        expected_launch(SUB / "local" / "train.sh", "local", 2, 2, QUICK, log_dir)
    ]
    assert "need a 1-rank run" in result.stdout


def test_scale_sh_sweeps_1_and_2_ranks(tmp_path):
    env = local_env(tmp_path, NRANKS="2", EXAMPLE="deepspeed")
    result = check(run(["bash", SUB / "local" / "scale.sh", *QUICK], env=env, timeout=400))
    (sweep,) = (tmp_path / "runs" / "local" / "deepspeed-scale").iterdir()
    assert sorted(p.name for p in sweep.iterdir()) == ["n1", "n2"]
    for n in (1, 2):
        assert [m["world_size"] for m in metrics(sweep / f"n{n}")] == [n]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ranks", "samples/s"])
    assert lines[header].split()[2:4] == ["speedup", "efficiency"]
    assert lines[header + 1].split()[:1] == ["1"] and lines[header + 1].split()[2:4] == [
        "1.00",
        "100%",
    ]


def test_a_copy_runs_your_own_script_after_one_changed_line(tmp_path):
    """Copy train.sh and plumbing.sh into a project, change the SCRIPT= line: it runs that script on
    2 ranks with its own arguments only (--num-threads and --log-dir are for the examples)."""
    project = tmp_path / "myproject"
    (project / "submissions" / "local").mkdir(parents=True)
    (project / "submissions" / "plumbing.sh").write_text((SUB / "plumbing.sh").read_text())
    text = (SUB / "local" / "train.sh").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("SCRIPT=")]
    copy = project / "submissions" / "local" / "train.sh"
    copy.write_text(text.replace(line, f"SCRIPT={project}/hello.py"))
    (project / "hello.py").write_text(  # line-buffered, as submissions/README.md advises
        "import os, sys\nsys.stdout.reconfigure(line_buffering=True, write_through=False)\n"
        "print('hello from rank', os.environ['PMI_RANK'], sys.argv[1:])\n"
    )
    env = local_env(tmp_path, VENV=str(ROOT / ".venv"))
    result = check(run(["bash", copy, "--name", "x"], env=env, cwd=project, timeout=120))
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("hello")) == [
        "hello from rank 0 ['--name', 'x']",
        "hello from rank 1 ['--name', 'x']",
    ]
    (run_dir,) = (tmp_path / "runs" / "local" / "hello").iterdir()
    assert "hello from rank 0" in (run_dir / "output.log").read_text()
    assert "samples/s" not in result.stdout  # the metrics table is for the course's examples


def test_sigterm_to_the_script_reaches_the_ranks_and_their_lines_reach_the_log(tmp_path):
    """qdel, a walltime or a plain scancel signal the job's shell: train.sh passes SIGTERM on to
    its launcher (not to tee), waits, and exits 143; each rank's "stopped" line reaches
    output.log."""
    args = "--epochs 50 --max-steps 20 --log-interval 5 --device cpu --num-threads 1"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(local_env(tmp_path, NRANKS="2", EXAMPLE="ddp", TRAIN_ARGS=args))
    job_out = tmp_path / "job.out"
    with open(job_out, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(SUB / "local" / "train.sh")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while not re.search(r"^epoch 1 step 5/", job_out.read_text(), re.MULTILINE):  # ranks train
            assert proc.poll() is None, f"exited early ({proc.returncode}):\n{job_out.read_text()}"
            assert time.monotonic() < deadline, f"no training line:\n{job_out.read_text()[-3000:]}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the script's own process, not its process group
        rc = proc.wait(timeout=60)
    finally:
        kill_tree(proc)
        proc.wait()
    output = job_out.read_text()
    assert rc == 143, f"exit {rc}:\n{output[-3000:]}"
    (run_dir,) = (tmp_path / "runs" / "local" / "ddp").iterdir()
    log = (run_dir / "output.log").read_text()
    for text in (log, output):
        ranks = re.findall(r"^stopped: rank (\d) stopped by SIGTERM", text, re.MULTILINE)
        assert sorted(ranks) == ["0", "1"], text[-3000:]
        assert "Traceback" not in text, text[-3000:]


def test_every_example_in_the_table_exists():
    for name, script in EXAMPLES.items():
        assert (ROOT / script).is_file(), (name, script)
