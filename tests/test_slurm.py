"""submissions/slurm/train.sh and scale.sh as real jobs: `sbatch` on a 2-node Slurm cluster on this machine.

tools/slurm_cluster.sh (`make slurm-up`) runs munged, slurmctld and two slurmd daemons, nodes n1 and n2 with
2 CPUs each, both this host. Nothing is simulated: sbatch queues the unchanged job script, slurmd runs a copy of
it from its spool directory, and the script's `srun` starts the ranks on one or two nodes. Each job gets only
what differs from a GPU cluster on the sbatch line (OVERRIDES: no GPUs, no `gpu` feature, 2 CPUs per node)
and a framework environment the way the scripts document it: ENV_SETUP (here a venv outside the checkout with
the course's packages, standing in for `module load pytorch`), never the laptop .venv, which the scripts refuse.

The cluster comes up once per session (and goes down at the end if this session brought it up). Where it
cannot (not root, no apt-get), the tests are skipped with the script's reason; under CI (CI=true) that fails.
About 4-7 minutes on 2 cores.
"""
import json
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from jobs_support import expected_launch, launches
from support import BIN, ROOT, check, free_port, metrics, run, stopped_epoch, summary

CLUSTER = ROOT / "tools" / "slurm_cluster.sh"
SLURM = ROOT / "submissions" / "slurm"
CLUSTER_DIR = Path(os.environ.get("SLURM_CLUSTER_DIR") or "/tmp/scaling-dl-slurm")
# What differs from the GPU cluster the scripts' directives describe; options on the sbatch line override them.
OVERRIDES = ["--gpus-per-node=0",  # no GPUs here (the directive asks for 4)
             "--constraint=",      # the nodes have no `gpu` feature (the directive says -C gpu)
             "--time=10"]          # minutes: Slurm itself ends a job that hangs
# -A YOUR_PROJECT and -q debug stay: without an accounting database Slurm accepts and ignores them.
# Settings of the scripts a developer may have exported: empty means "the default" to the scripts.
SETTINGS = ("REPO_DIR", "RUNS_DIR", "SCRIPT", "TRAIN_ARGS", "ENV_SETUP", "EXAMPLE", "DRY_RUN", "SWEEP", "SWEEP_RANKS",
            "SWEEP_DIR", "NRANKS", "VENV", "VIRTUAL_ENV", "OMP_NUM_THREADS", "MASTER_ADDR")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
# 20 steps on 2 ranks reach 0.65-0.81 here (DDP, Horovod PyTorch and TensorFlow); a run that did not learn stays
# near 0.10. Training to the lessons' accuracy is their own tests' job: these check the scheduler's wiring.
MIN_ACC = 0.5
CPU_ARGS = ["--epochs", "1", "--max-steps", "20", "--device", "cpu"]


def cluster(command, timeout=600):
    return run(["bash", CLUSTER, command], timeout=timeout)


@pytest.fixture(scope="session")
def slurm():
    """SLURM_CONF of a running cluster: the one already up, else one this session starts (and stops)."""
    started = False
    if cluster("status", timeout=60).returncode != 0:
        result = cluster("up")
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            reason = errors[-1] if errors else f"exit {result.returncode}: {result.stderr[-500:]}"
            # Only a machine that cannot have Slurm (not root, no apt-get) is a reason to skip; under CI never.
            if os.environ.get("CI", "").lower() == "true" or not reason.startswith("error: cannot bring up Slurm"):
                pytest.fail(f"the Slurm cluster did not come up: {reason}\n{result.stdout[-2000:]}")
            # Why a skip here hides no broken path: these tests need root and apt-get to start Slurm's
            # daemons, which a laptop may not give; the failure above covers every other reason, and under
            # CI (root, apt-get) a cluster that does not come up fails instead of skipping.
            pytest.skip(f"no Slurm cluster on this machine ({reason}); as root with apt-get, or under CI, "
                        "these tests run")
        started = True
    conf = CLUSTER_DIR / "slurm.conf"
    assert conf.exists(), conf
    nodes = check(run(["sinfo", "-h", "-N", "-o", "%N %t"], env={"SLURM_CONF": str(conf)}, timeout=30)).stdout
    assert sorted(nodes.split()[::2]) == ["n1", "n2"], nodes
    yield str(conf)
    if started:
        check(cluster("down", timeout=120))


@pytest.fixture(scope="session")
def frameworks(tmp_path_factory):
    """ENV_SETUP for the jobs: a Python environment outside the checkout that sees the course's installed
    packages (torch, TensorFlow, Horovod, DeepSpeed, mpi4py) and their MPI library, as `module load pytorch`
    would on a cluster. Its `python` is not the repo's .venv/bin/python, so the scripts' refusal stays as it is."""
    env_dir = tmp_path_factory.mktemp("frameworks")
    check(run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", env_dir], timeout=120))
    purelib = Path(sysconfig.get_paths(vars={"base": str(env_dir), "platbase": str(env_dir)})["purelib"])
    (purelib / "course-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    mpi_lib = Path(sys.prefix) / "lib"  # the MPICH wheel's libmpi.so.12 (mpi4py and Horovod load it)
    setup = env_dir / "setup.sh"
    setup.write_text(f"# the frameworks for the Slurm jobs (tests/test_slurm.py)\nsource {env_dir}/bin/activate\n"
                     f"export LD_LIBRARY_PATH={mpi_lib}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\n")
    check(run(["bash", "-c", f"source {setup} && python -c 'import torch, tensorflow, horovod, deepspeed'"],
              env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, timeout=300))
    return {"ENV_SETUP": f"source {setup}"}


def job_env(slurm, frameworks, runs_dir, **settings):
    """What the submitting shell holds: no .venv on PATH, the cluster's SLURM_CONF, the scripts' settings."""
    env = dict.fromkeys(SETTINGS, "")
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", SLURM_CONF=slurm, ENV_SETUP=frameworks["ENV_SETUP"],
               RUNS_DIR=str(runs_dir), MASTER_PORT=str(free_port()))
    env.update(settings)
    return env


def submit(env, script, nodes, per_node, out_dir, args=()):
    """sbatch from the repository root, as the README says; the job's output file goes to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = check(run(["sbatch", "--parsable", *OVERRIDES, "-N", str(nodes), f"--ntasks-per-node={per_node}",
                        "-o", out_dir / "%x-%j.out", script, *args], env=env, timeout=60))
    return result.stdout.strip().split(";")[0]


def wait(env, job_id, timeout=400):
    """The finished job's `scontrol show job` fields; a job still running at the deadline is cancelled: fail."""
    deadline = time.monotonic() + timeout
    while True:
        result = run(["scontrol", "show", "job", "-o", job_id], env=env, timeout=30)
        fields = dict(re.findall(r"(\w+)=(\S*)", result.stdout))
        if fields.get("JobState") in TERMINAL:
            return fields
        if time.monotonic() > deadline:
            run(["scancel", job_id], env=env, timeout=30)
            out = Path(fields["StdOut"]).read_text()[-4000:] if Path(fields.get("StdOut", "-")).is_file() else ""
            pytest.fail(f"job {job_id} not finished after {timeout}s: {result.stdout}{result.stderr}"
                        f"\n--- output\n{out}")
        time.sleep(1)


def output(fields):
    return Path(fields["StdOut"]).read_text()


def finished(fields, state="COMPLETED"):
    assert fields["JobState"] == state, f"job {fields['JobId']}: {fields['JobState']}\n{output(fields)[-4000:]}"
    return output(fields)


# --- the cluster tool ----------------------------------------------------------------------------------------
def test_cluster_script_is_shellcheck_clean():
    check(run([BIN / "shellcheck", "-x", "--severity=info", CLUSTER.relative_to(ROOT)], timeout=120))


def test_cluster_script_bad_input_is_one_line():
    result = run(["bash", CLUSTER, "sideways"], timeout=30)
    assert result.returncode == 2 and "usage:" in result.stderr
    result = run(["bash", CLUSTER, "up"], env={"SLURM_CLUSTER_PORT": "http"}, timeout=30)
    assert result.returncode != 0 and result.stderr.splitlines() == [
        "error: SLURM_CLUSTER_PORT must be a port number (1024-65532), got 'http'"]


def test_up_on_a_running_cluster_changes_nothing(slurm):
    pids = sorted(p.read_text() for p in CLUSTER_DIR.rglob("*.pid"))
    assert len(pids) == 4, pids  # munged, slurmctld, slurmd n1 and n2
    result = check(cluster("up", timeout=120))
    assert "started" not in result.stdout and "up: nodes n1 n2" in result.stdout, result.stdout
    assert sorted(p.read_text() for p in CLUSTER_DIR.rglob("*.pid")) == pids
    status = check(cluster("status", timeout=60)).stdout
    assert status.count("running (pid") == 4 and "idle" in status, status


# --- every example's script as a real job ---------------------------------------------------------------------
# Each example once, the two shapes shared out: each shape starts two frameworks, each launcher family (srun with
# torch's rendezvous, srun with PMI-2 for Horovod) meets both shapes, and DDP at 2 nodes is the sweep below.
SHAPES = [("ddp", 1, 2), ("horovod-pytorch", 2, 1), ("horovod-tensorflow", 1, 2), ("deepspeed", 2, 1)]


@pytest.mark.parametrize("example,nodes,per_node", SHAPES,
                         ids=[f"{e}-{n}node{'s' * (n > 1)}-x{p}" for e, n, p in SHAPES])
def test_job_script_runs_under_slurm(slurm, frameworks, tmp_path, example, nodes, per_node):
    settings = {"EXAMPLE": example}
    if example.startswith("horovod"):
        # Horovod takes its ranks from MPI; MPI gets them from srun through PMI-2. Sites set this as their
        # MpiDefault; Slurm's own default (none) would leave every rank an MPI world of 1.
        settings["SLURM_MPI_TYPE"] = "pmi2"
    env = job_env(slurm, frameworks, tmp_path / "runs", **settings)
    job = wait(env, submit(env, SLURM / "train.sh", nodes, per_node, tmp_path, CPU_ARGS))
    out = finished(job)
    assert job["ExitCode"] == "0:0" and int(job["NumNodes"]) == nodes, job
    assert f"+ {frameworks['ENV_SETUP']}" in out.splitlines()

    (log_dir,) = (tmp_path / "runs" / "slurm" / example).iterdir()
    assert log_dir.name == f"{job['JobId']}.n2"
    # the launch line printed is the one written in the script, with its values (1 CPU per rank here)
    expected = expected_launch(SLURM / "train.sh", "slurm", 2, per_node, CPU_ARGS, log_dir, example,
                               DEPTH=1, CPUS=per_node)  # Slurm gave each task 1 CPU
    assert launches(out, "slurm") == [expected], out
    config = json.loads((log_dir / "config.json").read_text())
    # rank 0 writes config.json: global rank 0 of 2, local rank 0 of the ranks on its node
    assert (config["rank"], config["world_size"]) == (0, 2), config
    assert (config["local_rank"], config["local_world_size"]) == (0, per_node), config
    assert config["launcher"] == "srun", config  # Slurm's numbers, also when PMI-2 adds PMI_RANK for MPI
    if example.startswith("horovod"):
        assert config["backend"] == "horovod-mpi", config
    else:  # every rank met at the allocation's first node (the script asks scontrol)
        assert config["master_addr"] == "n1", config
    history = metrics(log_dir)
    assert [(m["epoch"], m["world_size"]) for m in history] == [(1, 2)], history
    assert history[-1]["test_acc"] >= MIN_ACC, history
    checksums = summary(log_dir)["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums  # both ranks, same weights
    assert (log_dir / "output.log").read_text().count("epoch  1") == 1


def test_scaling_sweep_across_one_and_two_nodes(slurm, frameworks, tmp_path):
    env = job_env(slurm, frameworks, tmp_path / "runs")
    job = wait(env, submit(env, SLURM / "scale.sh", 2, 1, tmp_path, CPU_ARGS))
    out = finished(job)
    sweep = tmp_path / "runs" / "slurm" / "ddp-scale" / job["JobId"]
    assert sorted(p.name for p in sweep.iterdir()) == ["n1", "n2"]
    assert "+ srun -N 1 -n 1 --ntasks-per-node 1 " in out and "+ srun -N 2 -n 2 --ntasks-per-node 1 " in out, out
    for n in (1, 2):
        run_dir = sweep / f"n{n}"
        for name in ("config.json", "metrics.jsonl", "summary.json", "output.log"):
            assert (run_dir / name).stat().st_size > 0, run_dir / name
        assert (run_dir / "checkpoints").is_dir()
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["world_size"], config["local_world_size"]) == (n, 1), config  # n2: one rank per node
        assert [m["world_size"] for m in metrics(run_dir)] == [n]

    lines = out.splitlines()
    columns = ["ranks", "samples/s", "speedup", "efficiency"]
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == columns)
    rows = [line.split() for line in lines[header + 1:header + 3]]
    speed = {n: metrics(sweep / f"n{n}")[-1]["samples_per_s"] for n in (1, 2)}
    assert [row[0] for row in rows] == ["1", "2"] and [row[5] for row in rows] == [str(sweep / "n1"), str(sweep / "n2")]
    assert rows[0][2:4] == ["1.00", "100%"], rows
    speedup = speed[2] / speed[1]
    assert float(rows[1][2]) == pytest.approx(speedup, abs=0.006), (rows, speed)
    assert rows[1][3] == f"{speedup / 2:.0%}", (rows, speed)
    assert all(float(row[4]) >= MIN_ACC for row in rows), rows


# --- failures ---------------------------------------------------------------------------------------------------
def test_a_bad_flag_fails_the_job_with_one_error_line(slurm, frameworks, tmp_path):
    env = job_env(slurm, frameworks, tmp_path / "runs", TRAIN_ARGS="--epochs 1 --no-such-flag")
    job = wait(env, submit(env, SLURM / "train.sh", 1, 1, tmp_path))
    out = finished(job, "FAILED")
    assert job["ExitCode"] != "0:0", job
    flagged = [line for line in out.splitlines() if "error:" in line and "--no-such-flag" in line]
    assert len(flagged) == 1, out  # one rank: one line, not a usage block or a traceback
    assert "Traceback" not in out and "usage:" not in out, out
    assert out.rstrip().splitlines()[-1].startswith("error: ddp on 1 rank(s) exited with 2"), out


def test_the_laptop_venv_is_still_refused_under_slurm(slurm, frameworks, tmp_path):
    env = job_env(slurm, frameworks, tmp_path / "runs", ENV_SETUP=":", PATH=f"{BIN}:/usr/local/bin:/usr/bin:/bin")
    job = wait(env, submit(env, SLURM / "train.sh", 1, 1, tmp_path, CPU_ARGS))
    out = finished(job, "FAILED")
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ".venv" in errors[0] and "slurm" in errors[0], out
    assert not launches(out, "slurm") and not (tmp_path / "runs").exists()


# Walltime under a real scheduler: `scancel --signal=TERM` of a running Slurm job
# (submissions/slurm/train.sh, DDP, 2 ranks) sends SIGTERM to its job step, as `sbatch
# --signal=TERM@<seconds>` does before the walltime; every rank says where it stopped and which
# checkpoint to continue from, in one line, and the job ends. (A plain `scancel` also signals the
# batch script, which passes the signal on to srun while its `tee` ignores it and keeps copying:
# tests/test_jobs_local.py checks that path with the workstation script.)
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
