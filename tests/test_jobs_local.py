"""submissions/local: the workstation scripts run for real with the course's .venv (2 ranks, a few
steps)."""

import os
import re
import signal
import subprocess
import time

from jobs_support import EXAMPLES, QUICK, SUB, copied_alone, expected_launch, launches, printed
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
        "SCRIPT": "",
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
    # the run's folder is named for the second it started (date +%Y%m%d-%H%M%S): the two plans may differ there
    stamp = re.compile(r"/\d{8}-\d{6}(?=\.n3$)")
    assert [[stamp.sub("/<time>", w) for w in line] for line in plans[0]] == [
        [stamp.sub("/<time>", w) for w in line] for line in plans[1]]
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


def test_train_sh_copied_alone_runs_your_script_on_2_ranks(tmp_path):
    """local/train.sh copied alone into a project with a train.py of its own (no repository, no
    plumbing.sh): SCRIPT= and VENV= (here the course's, for its mpiexec) are all it needs. The plan
    names the project's train.py and nothing of the repository; the run starts both ranks, keeps
    their output in the project's runs/, and ends without the course's report."""
    project = copied_alone("local", tmp_path)
    env = local_env(tmp_path, RUNS_DIR="", SCRIPT="train.py", VENV=str(ROOT / ".venv"))
    cmd = ["bash", project / "train.sh", "--name", "x"]
    out = check(run(cmd, env={**env, "DRY_RUN": "1"}, cwd=project, timeout=60)).stdout
    (words,) = launches(out, "local")
    assert words == ["mpiexec", "-n", "2", "python", "train.py", "--name", "x"], words
    assert not [w for w in words if str(ROOT) in w]
    assert printed(out)[0] == ["source", str(ROOT / ".venv" / "bin" / "activate")]
    assert not (project / "runs").exists()
    result = check(run(cmd, env=env, cwd=project, timeout=120))
    hello = sorted(line for line in result.stdout.splitlines() if line.startswith("hello"))
    assert hello == [f"hello from rank {r} of 2 ['--name', 'x']" for r in (0, 1)], result.stdout
    (run_dir,) = (project / "runs" / "local" / "train").iterdir()
    assert run_dir.name.endswith(".n2") and "hello from rank 0" in (run_dir / "output.log").read_text()
    assert "samples/s" not in result.stdout and result.stderr == ""


def test_train_sh_copied_alone_says_what_is_missing_in_one_line(tmp_path):
    project = copied_alone("local", tmp_path)
    env = local_env(tmp_path, DRY_RUN="1", VENV=str(ROOT / ".venv"))
    for script, error in (
        ("", "error: SCRIPT=/path/to/train.py is needed: no course repository here"),
        ("trian.py", "error: no such file: trian.py (named on the launch line)"),
    ):
        result = run(["bash", project / "train.sh"], env={**env, "SCRIPT": script}, cwd=project,
                     timeout=60)
        assert result.returncode == 1 and result.stderr.splitlines() == [error]
        assert not launches(result.stdout, "local")


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
