"""submissions/{aurora,polaris,sophia}: every script under a simulated PBS at 1 and 2 nodes
(tests/jobs_support.py); and each scheduler's train.sh copied alone into a project of its own
(Slurm's under the same simulation).

The dry run prints the plan; the real runs train on CPUs through the launcher's stand-in. Each
printed launch line must be the one written in the script's text, with its variables' values."""

import re
import socket
import sys
from pathlib import Path

import pytest

from jobs_support import (
    EXAMPLES,
    FORWARDED,
    LAUNCHER,
    PBS,
    QUICK,
    SUB,
    copied_alone,
    expected_launch,
    forwarded,
    job_command,
    launches,
    nodes_asked,
    printed,
    ranks_per_node,
    scheduler_env,
    shim_calls,
    shim_launches,
    sweep_points,
)
from support import BIN, ROOT, check, metrics, run

# Aurora's --cpu-bind list (ALCF's PyTorch guide): 4 cores per rank, and oneCCL's worker cores apart.
AURORA_LIST = "list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"
AURORA_CCL = [
    "CCL_PROCESS_LAUNCHER=pmix",
    "CCL_ATL_TRANSPORT=mpi",
    "CCL_KVS_MODE=mpi",
    "FI_MR_CACHE_MONITOR=userfaultfd",
]
POLARIS_NCCL = [
    "NCCL_NET_GDR_LEVEL=PHB",
    "NCCL_CROSS_NIC=1",
    "NCCL_COLLNET_ENABLE=1",
    "NCCL_NET=AWS Libfabric",
    "FI_CXI_DISABLE_HOST_REGISTER=1",
    "FI_MR_CACHE_MONITOR=userfaultfd",
    "FI_CXI_DEFAULT_CQ_SIZE=131072",
]
GPUS_PER_NODE = {"aurora": 12, "polaris": 4, "sophia": 8}  # Aurora: GPU tiles
SETUP = {
    "aurora": ["module load frameworks/2025.3.1"],
    "polaris": ["module use /soft/modulefiles", "module load conda/2025-09-25", "conda activate"],
    "sophia": ["module use /soft/modulefiles", "module load conda", "conda activate base"],
}


def values(machine, env, rpn):
    """The variables of a machine's launch line besides the rank counts."""
    return {
        "aurora": {"CPU_BIND": AURORA_LIST},
        "polaris": {"DEPTH": 32 // rpn},
        "sophia": {"PBS_NODEFILE": env["PBS_NODEFILE"], "FORWARD": forwarded(env)},
    }[machine]


def exports(stdout):
    return [word for words in printed(stdout) if words[0] == "export" for word in words[1:]]


def job(machine, tmp_path, nodes, stem="train", args=(), **settings):
    env = scheduler_env(machine, tmp_path, nodes)
    env.update(settings)
    return run(
        [*job_command(SUB / machine / f"{stem}.sh", tmp_path), *args], env=env, timeout=400
    ), env


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("machine", PBS)
def test_dry_run_plans_every_gpu_with_the_scripts_own_launch_line(tmp_path, machine, nodes):
    script = SUB / machine / "train.sh"
    assert ranks_per_node(script) == GPUS_PER_NODE[machine], "one rank per GPU (Aurora: per tile)"
    result, env = job(machine, tmp_path, nodes, args=["--epochs", "2"], DRY_RUN="1")
    out = check(result).stdout
    assert out.splitlines()[0] == "dry run: nothing is executed"
    commands = [" ".join(words) for words in printed(out)]
    assert commands[: len(SETUP[machine])] == SETUP[machine], commands
    total, rpn = nodes * GPUS_PER_NODE[machine], GPUS_PER_NODE[machine]
    log_dir = tmp_path / "runs" / machine / "ddp" / f"4242.n{total}"
    (words,) = launches(out, machine)
    assert words == expected_launch(
        script, machine, total, rpn, ["--epochs", "2"], log_dir, **values(machine, env, rpn)
    )
    assert f"# ddp on {total} rank(s) = {nodes} node(s) x {rpn}," in out
    if machine == "aurora":  # the guide's oneCCL settings; the connection timeout only across nodes
        assert set(AURORA_CCL + ["ZE_FLAT_DEVICE_HIERARCHY=FLAT", "OMP_NUM_THREADS=4"]) <= set(
            exports(out)
        )
        # each rank's oneCCL worker thread gets a core of its own, outside every rank's compute cores
        (affinity,) = [e.split("=")[1] for e in exports(out) if e.startswith("CCL_WORKER_AFFINITY=")]
        workers = [int(core) for core in affinity.split(",")]
        bound = {core for part in words[words.index("--cpu-bind") + 1].removeprefix("list:").split(":")
                 for core in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
        assert len(set(workers)) == rpn and not set(workers) & bound, (workers, sorted(bound))
        assert ("CCL_KVS_CONNECTION_TIMEOUT=300" in exports(out)) == (nodes > 1)
    if machine == "polaris":  # the NCCL settings are opt-in
        assert not [e for e in exports(out) if e.startswith(("NCCL_", "FI_"))], out
    # a plan only: nothing loaded, launched or written
    assert shim_calls(tmp_path) == [] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("machine", PBS)
def test_sweep_plan_runs_train_sh_at_1_2_4_ranks(tmp_path, machine):
    script = SUB / machine / "scale.sh"
    nodes = nodes_asked(script)
    result, env = job(machine, tmp_path, nodes, stem="scale", DRY_RUN="1", EXAMPLE="deepspeed")
    out = check(result).stdout
    rpn = GPUS_PER_NODE[machine]
    points = sweep_points(nodes * rpn)
    assert [int(w[w.index("-n") + 1]) for w in launches(out, machine)] == points, out
    sweep = tmp_path / "runs" / machine / "deepspeed-scale" / "4242"
    assert launches(out, machine) == [
        expected_launch(
            SUB / machine / "train.sh",
            machine,
            n,
            min(n, rpn),
            (),
            sweep / f"n{n}",
            "deepspeed",
            rpn=rpn,
            **values(machine, env, rpn),
        )
        for n in points
    ]


@pytest.mark.parametrize("machine", PBS)
def test_dry_run_works_with_the_course_venv_active(tmp_path, machine):
    """It only prints, so the laptop .venv may be active; a real run refuses it (next test)."""
    env = scheduler_env(machine, tmp_path, 1)
    env.update(DRY_RUN="1", VIRTUAL_ENV=str(ROOT / ".venv"), PATH=f"{BIN}:{env['PATH']}")
    result = run(job_command(SUB / machine / "train.sh", tmp_path), env=env, timeout=60)
    assert len(launches(check(result).stdout, machine)) == 1


@pytest.mark.parametrize(
    "machine,how",
    [("aurora", "path"), ("polaris", "path"), ("sophia", "path"), ("polaris", "virtual_env")],
)
def test_a_real_run_refuses_the_laptop_venv(tmp_path, machine, how):
    env = scheduler_env(machine, tmp_path, 1)
    if how == "path":
        env["PATH"] = f"{BIN}:{env['PATH']}"
    else:
        env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    result = run(job_command(SUB / machine / "train.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0
    assert (
        result.stderr.count("error: ") == 1
        and ".venv" in result.stderr
        and f"on {machine}" in result.stderr
    )
    assert shim_launches(tmp_path) == [] and not launches(result.stdout, machine)


@pytest.mark.parametrize(
    "machine,example,reason",
    [
        ("aurora", "horovod-pytorch", "Horovod for PyTorch is no longer in Aurora"),
        ("aurora", "horovod-tensorflow", "no Intel GPU path"),
        ("polaris", "horovod-pytorch", "not been in Polaris' conda module since conda/2025-09-25"),
        ("polaris", "horovod-keras", "not been in Polaris' conda module since conda/2025-09-25"),
    ],
)
def test_aurora_and_polaris_refuse_horovod_with_their_reason(tmp_path, machine, example, reason):
    for stem, dry in (("train", "1"), ("train", "0"), ("scale", "0")):
        result, _ = job(machine, tmp_path, 1, stem=stem, DRY_RUN=dry, EXAMPLE=example)
        assert result.returncode != 0
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: ") and reason in line and "EXAMPLE=ddp" in line
        login = ["login-shell"] if stem == "scale" else []  # scale.sh: train.sh in a login shell
        assert shim_calls(tmp_path) == login and not launches(result.stdout, machine)


@pytest.mark.parametrize("machine", PBS)
def test_a_module_that_loads_no_framework_is_one_line_before_any_launch(tmp_path, machine):
    """`module load` can load nothing and exit 0: right after it, python must import what the job
    needs (torch; deepspeed for DeepSpeed), or the job stops naming the module."""
    bad = tmp_path / "bad-bin"
    bad.mkdir()
    (bad / "python").write_text("#!/bin/bash\n[[ $1 == -c ]] && exit 1\nexec python3 \"$@\"\n")
    (bad / "python").chmod(0o755)
    for example, needs in (("ddp", "torch"), ("deepspeed", "torch,deepspeed")):
        env = scheduler_env(machine, tmp_path, 1)
        env.update(EXAMPLE=example, PATH=f"{bad}:{env['PATH']}")
        result = run(job_command(SUB / machine / "train.sh", tmp_path), env=env, timeout=60)
        assert result.returncode != 0
        (line,) = result.stderr.splitlines()
        module = {"aurora": "frameworks/2025.3.1", "polaris": "conda/2025-09-25", "sophia": "conda"}[machine]
        assert line.startswith(f"error: python cannot import {needs} after 'module load {module}'"), line
        assert not shim_launches(tmp_path)


@pytest.mark.parametrize("machine", PBS)
def test_a_module_that_does_not_load_is_one_line_that_says_what_to_try(tmp_path, machine):
    """`module load` itself fails (an unknown module, or one whose dependencies a system update removed): the
    module system's own lines, then the job's one error line naming the module and MODULE=, before any launch."""
    broken = tmp_path / "broken-bin"
    broken.mkdir()
    (broken / "module").write_text('#!/bin/bash\n[[ $1 == load ]] || exit 0\n'
                                   'echo "Lmod has detected the following error: These module(s) or extension(s) '
                                   'exist but cannot be loaded as requested: \\"$2\\"" >&2\nexit 1\n')
    (broken / "module").chmod(0o755)
    env = scheduler_env(machine, tmp_path, 1)
    env.update(PATH=f"{broken}:{env['PATH']}")
    result = run(job_command(SUB / machine / "train.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0
    module = {"aurora": "frameworks/2025.3.1", "polaris": "conda/2025-09-25", "sophia": "conda"}[machine]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [result.stderr.splitlines()[-1]] and len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: 'module load {module}' failed") and "MODULE=" in errors[0], errors[0]
    assert not shim_launches(tmp_path)


def test_bad_example_and_missing_node_file_are_one_line_errors(tmp_path):
    result, _ = job("polaris", tmp_path, 1, EXAMPLE="tensorflow")
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: EXAMPLE must be one of: ") and all(
        name in line for name in EXAMPLES
    )
    result, _ = job("polaris", tmp_path, 1, PBS_NODEFILE="")  # a real run needs the job's nodes
    assert result.returncode != 0 and result.stderr.splitlines() == [
        "error: node file '' missing: run this inside a job (or qsub -I)"
    ]
    assert shim_launches(tmp_path) == [] and not (tmp_path / "runs").exists()
    result, _ = job("polaris", tmp_path, 1, stem="scale", DRY_RUN="1", SWEEP_RANKS="1 8")
    assert result.returncode != 0 and result.stderr.splitlines() == [
        "error: SWEEP_RANKS: '8' is not between 1 and the 4 ranks of this job"
    ]


@pytest.mark.parametrize("machine", PBS)
def test_dry_run_outside_a_job_plans_one_node(tmp_path, machine):
    """`DRY_RUN=1 bash submissions/<machine>/train.sh` on a login node (no PBS variables): the plan
    for 1 node, and one line that says so."""
    env = scheduler_env(machine, tmp_path, 1)
    env.update(DRY_RUN="1", PBS_NODEFILE="", PBS_JOBID="", PBS_O_WORKDIR="")
    result = run(["bash", SUB / machine / "train.sh"], env=env, timeout=60)
    out = check(result).stdout
    assert result.stderr.splitlines() == ["dry run: no node file, assuming 1 node (this host)"]
    rpn = GPUS_PER_NODE[machine]
    (words,) = launches(out, machine)
    assert words[words.index("-n") + 1] == str(rpn)  # Polaris: -n 4
    (log_dir,) = {w for w in words if str(tmp_path / "runs" / machine / "ddp") in w}
    assert words == expected_launch(
        SUB / machine / "train.sh", machine, rpn, rpn, (), log_dir, **values(machine, env, rpn)
    )
    # rank 0's host: this one (MASTER_DOMAIN is empty here: the name as it stands)
    assert f"MASTER_ADDR={socket.gethostname().split('.')[0]}" in exports(out)
    assert shim_calls(tmp_path) == [] and not (tmp_path / "runs").exists()


def test_sophia_listens_on_a_port_of_its_job_unless_one_is_set(tmp_path):
    """by-gpu jobs share nodes: the default MASTER_PORT is 29500 + the job number mod 1000, as
    course/ranks.default_port computes it for the other machines; a MASTER_PORT given wins."""
    result, _ = job("sophia", tmp_path, 1, DRY_RUN="1", MASTER_PORT="")  # job 4242
    assert "MASTER_PORT=29742" in exports(check(result).stdout), exports(result.stdout)
    result, _ = job("sophia", tmp_path, 1, DRY_RUN="1", MASTER_PORT="31000")
    assert "MASTER_PORT=31000" in exports(check(result).stdout), exports(result.stdout)


def test_sophia_passes_the_courses_settings_and_no_empty_ones(tmp_path):
    """Open MPI passes no environment on by itself: the settings the other launchers pass
    implicitly go by -x, each only when set; nothing is exported empty."""
    settings = dict(
        LD_LIBRARY_PATH="/opt/x/lib",
        PYTHONPATH="/opt/py",
        CONDA_PREFIX="/opt/conda",
        COURSE_VERBOSE="1",
        TF_CPP_MIN_LOG_LEVEL="1",
    )
    result, _ = job("sophia", tmp_path, 1, DRY_RUN="1", **settings)
    (words,) = launches(check(result).stdout, "sophia")
    names = [words[i + 1] for i, w in enumerate(words) if w == "-x"]
    assert names == ["PATH", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", *settings], words
    result, _ = job("sophia", tmp_path, 1, DRY_RUN="1", LD_LIBRARY_PATH="")
    out = check(result).stdout
    (words,) = launches(out, "sophia")
    assert "LD_LIBRARY_PATH" not in words, words
    assert not [e for e in exports(out) if e.endswith("=")], exports(out)


def test_polaris_nccl_settings_when_asked(tmp_path):
    result, _ = job(
        "polaris", tmp_path, 2, DRY_RUN="1", POLARIS_NCCL_TUNING="1", LD_LIBRARY_PATH="/opt/x/lib"
    )
    got = exports(check(result).stdout)
    assert set(POLARIS_NCCL) <= set(got), got
    assert (
        "LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:"
        "/soft/libraries/hwloc/lib:/opt/x/lib" in got
    )
    result, _ = job(
        "polaris", tmp_path, 1, POLARIS_NCCL_TUNING="1", POLARIS_OFI_NCCL_DIR=str(tmp_path / "none")
    )
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: no aws-ofi-nccl plugin in ") and str(tmp_path / "none") in line
    assert shim_launches(tmp_path) == []


# --- train.sh copied alone into an attendee's project (submissions/README.md, Your own training script)
def alone_job(machine, tmp_path, project, nodes=1, args=(), **settings):
    """The copy submitted from its project folder: PBS_O_WORKDIR (and Slurm's working folder) is
    the project, the scheduler runs a spool copy of it; no repository anywhere above them."""
    env = scheduler_env(machine, tmp_path, nodes)
    env.update(RUNS_DIR="", **settings)
    if machine in PBS:
        env["PBS_O_WORKDIR"] = str(project)
    cmd = [*job_command(project / "train.sh", tmp_path), *args]
    return run(cmd, env=env, cwd=project, timeout=120), env


SCHEDULERS = (*PBS, "slurm")
RPN = {**GPUS_PER_NODE, "slurm": 4}


@pytest.mark.parametrize("machine", SCHEDULERS)
def test_train_sh_copied_alone_plans_and_runs_your_script(tmp_path, machine):
    """SCRIPT= names what runs; the plan's launch line is the script's own, with the project's
    train.py (Polaris: and its GPU wrapper) and nothing of the repository; a real run (2 ranks on
    CPUs through the launcher's stand-in) starts both ranks and keeps their output in the project."""
    project = copied_alone(machine, tmp_path)
    script = project / "train.py"
    result, env = alone_job(
        machine, tmp_path, project, 2, ["--name", "x"], DRY_RUN="1", SCRIPT=str(script)
    )
    out = check(result).stdout
    assert out.splitlines()[0] == "dry run: nothing is executed" and result.stderr == ""
    (words,) = launches(out, machine)
    assert words[words.index("python") + 1 :] == [str(script), "--name", "x"], words
    assert words[words.index("-n") + 1] == str(2 * RPN[machine]), words
    assert not [w for w in words if str(ROOT) in w], words  # nothing of the repository
    if machine == "polaris":  # ALCF's GPU wrapper, from the folder qsub ran in
        assert str(project / "set_affinity_gpu_polaris.sh") in words, words
    run_dir = project / "runs" / machine / "train" / f"4242.n{2 * RPN[machine]}"
    assert f"log dir {run_dir}" in out, out
    assert shim_calls(tmp_path) == [] and not (project / "runs").exists()

    rpn = {"SLURM_NTASKS_PER_NODE": "2"} if machine == "slurm" else {"RANKS_PER_NODE": "2"}
    result, _ = alone_job(machine, tmp_path, project, 1, ["--name", "x"], SCRIPT=str(script), **rpn)
    out = check(result).stdout
    hello = sorted(line for line in out.splitlines() if line.startswith("hello"))
    assert hello == [f"hello from rank {r} of 2 ['--name', 'x']" for r in (0, 1)], out
    (launched,) = shim_launches(tmp_path)
    assert launched[0] == LAUNCHER[machine] and str(script) in launched, launched
    log = (project / "runs" / machine / "train" / "4242.n2" / "output.log").read_text()
    assert "hello from rank 1 of 2" in log
    assert "samples/s" not in out  # no end-of-job report without the repository


def test_train_sh_alone_without_script_or_polaris_wrapper_is_one_error_line(tmp_path):
    """Alone, with no SCRIPT: one line that names SCRIPT=. Polaris' copy without ALCF's GPU wrapper
    beside it: its dry run names the missing file in one line, and nothing is launched."""
    project = copied_alone("polaris", tmp_path, wrapper=False)
    for dry in ("1", "0"):
        result, _ = alone_job("polaris", tmp_path, project, DRY_RUN=dry)
        assert result.returncode == 1 and result.stderr.splitlines() == [
            "error: SCRIPT=/path/to/train.py is needed: no course repository here"
        ]
        result, _ = alone_job(
            "polaris", tmp_path, project, DRY_RUN=dry, SCRIPT=str(project / "train.py")
        )
        wrapper = project / "set_affinity_gpu_polaris.sh"
        assert result.returncode == 1 and result.stderr.splitlines() == [
            f"error: no such file: {wrapper} (named on the launch line)"
        ]
        assert not launches(result.stdout, "polaris") and shim_launches(tmp_path) == []


@pytest.mark.parametrize("dry", ["1", "0"])
@pytest.mark.parametrize("machine", PBS)
def test_a_missing_script_on_the_launch_line_is_one_error_line(tmp_path, machine, dry):
    """With the repository (plumbing.sh's launch): SCRIPT= naming no file stops the plan, or the
    job, before the launch, in one line that names it."""
    missing = tmp_path / "no-such" / "train.py"
    result, _ = job(machine, tmp_path, 1, DRY_RUN=dry, SCRIPT=str(missing))
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: no such file: {missing} (named on the launch line)"
    ]
    assert not launches(result.stdout, machine) and shim_launches(tmp_path) == []


# --- real runs: 2 ranks on CPUs, one node x 2 or two nodes x 1 ------------------------------------
# Each machine's script for real on 2 simulated nodes (its 1-node launch line: the dry runs above)
RUNS = [pytest.param(machine, 2, "ddp", id=f"{machine}-2node") for machine in PBS]
RUNS += [  # Horovod on Sophia: Polaris' and Aurora's modules no longer have it
    pytest.param(machine, 1, example, id=f"{machine}-1node-{example}")
    for machine, example in (("sophia", "horovod-pytorch"), ("sophia", "horovod-tensorflow"),
                             ("polaris", "deepspeed"))
]


@pytest.mark.parametrize("machine,nodes,example", RUNS)
def test_train_sh_runs_as_pbs_would_run_it(tmp_path, machine, nodes, example):
    rpn = 2 // nodes
    # qsub passes no arguments: the flags go in TRAIN_ARGS, as `qsub -v TRAIN_ARGS=...` would set
    # them
    result, env = job(
        machine,
        tmp_path,
        nodes,
        EXAMPLE=example,
        RANKS_PER_NODE=str(rpn),
        TRAIN_ARGS=" ".join(QUICK),
    )
    out = check(result).stdout
    log_dir = tmp_path / "runs" / machine / example / "4242.n2"
    history = metrics(log_dir)
    assert [(m["epoch"], m["world_size"]) for m in history] == [(1, 2)], history
    assert (log_dir / "output.log").read_text().count("epoch") >= 1
    # the launch line printed and the one the launcher got: the script's own text
    expected = expected_launch(
        SUB / machine / "train.sh",
        machine,
        2,
        rpn,
        QUICK,
        log_dir,
        example,
        **values(machine, env, rpn),
    )
    assert launches(out, machine) == [expected]
    assert shim_launches(tmp_path) == [expected]
    calls = [c for c in shim_calls(tmp_path) if not c.startswith("[")]
    assert calls == SETUP[machine], calls
    # the end-of-job report: one run, so no speedup made up against itself
    assert any(
        line.split()[:2] == ["ranks", "samples/s"] and "speedup" not in line
        for line in out.splitlines()
    )


def test_polaris_sweep_runs_across_two_nodes(tmp_path):
    result, _ = job(
        "polaris", tmp_path, 2, stem="scale", RANKS_PER_NODE="1", TRAIN_ARGS=" ".join(QUICK)
    )
    out = check(result).stdout
    sweep = tmp_path / "runs" / "polaris" / "ddp-scale" / "4242"
    assert sorted(p.name for p in sweep.iterdir()) == ["n1", "n2"]
    for n in (1, 2):
        assert [m["world_size"] for m in metrics(sweep / f"n{n}")] == [n]
    assert [int(c[c.index("-n") + 1]) for c in shim_launches(tmp_path)] == [1, 2]
    # scale.sh ran train.sh in a login shell (where `module` is defined), then loaded the module
    assert [c for c in shim_calls(tmp_path) if not c.startswith("[")] == ["login-shell", *SETUP["polaris"]]
    header = next(line for line in out.splitlines() if line.split()[:2] == ["ranks", "samples/s"])
    assert header.split()[2:4] == ["speedup", "efficiency"], header


def test_a_failed_launch_ends_with_one_error_line(tmp_path):
    result, _ = job(
        "sophia", tmp_path, 1, RANKS_PER_NODE="1", TRAIN_ARGS="--epochs 1 --no-such-flag"
    )
    assert result.returncode != 0
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: ddp on 1 rank(s) exited with 2 (output in "), result.stderr
    assert "Traceback" not in result.stderr
    assert LAUNCHER["sophia"] == shim_launches(tmp_path)[0][0]


# submissions/README.md's dry-run excerpts, each run again and compared line by line. The excerpts show
# the repository at /home/me/scaling-dl and the hosts a real node file names; a local run's log folder
# is named by its start time.
EXCERPT = re.compile(r"`(DRY_RUN=1 [^`]*?bash (submissions/\S+?\.sh)([^`]*))`((?:(?!```).)*?):\n\n```\n(.*?)```",
                     re.S)
HOSTS = {"aurora": ["x4102c5s2b0n0", "x4102c5s3b0n0"], "sophia": ["sophia-gpu-07", "sophia-gpu-08"],
         "polaris": ["x3005c0s7b0n0", "x3005c0s7b1n0"]}
EXCERPT_NODEFILE = "/tmp/excerpt/sophia_nodes"


def readme_excerpts():
    found = [m.groups() for m in EXCERPT.finditer((SUB / "README.md").read_text())]
    return [pytest.param(*groups, id=f"{groups[1].split('/')[1]}-{i}") for i, groups in enumerate(found)]


def normalised(text):
    return re.sub(r"\b\d{8}-\d{6}\b", "YYYYMMDD-HHMMSS", text)


def test_the_readme_shows_each_scripts_dry_run_excerpt():
    assert {p.values[1] for p in readme_excerpts()} == {f"submissions/{m}/train.sh" for m in (*PBS, "local")}


@pytest.mark.parametrize("command,script,args,context,shown", readme_excerpts())
def test_a_readme_dry_run_excerpt_is_what_the_script_prints(tmp_path, command, script, args, context, shown):
    machine = script.split("/")[1]
    nodes = re.search(r"with (\d+) nodes?", context)
    env = scheduler_env(machine, tmp_path, int(nodes.group(1)) if nodes else 1)
    # as shown: none of sophia/train.sh's forwarded settings set (a COURSE_ key would plant faults: run())
    env.update(DRY_RUN="1", RUNS_DIR="", MASTER_PORT="",
               **{name: "" for name in FORWARDED if not name.startswith("COURSE_")})
    if nodes:  # inside a job: the node file names the machine's hosts
        Path(env["PBS_NODEFILE"]).write_text("".join(f"{h}\n" for h in HOSTS[machine][: int(nodes.group(1))]))
        cmd = job_command(ROOT / script, tmp_path)
    else:  # a login node or a workstation
        env.update(PBS_NODEFILE="", PBS_JOBID="", PBS_O_WORKDIR="")
        cmd = ["bash", ROOT / script]
    settings = dict(word.split("=", 1) for word in command.split(" bash ")[0].split())
    env.update(settings)
    # the data folder made (<repository>/data as shown), and MASTER_ADDR's default suffix
    if machine in PBS:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "mnist.npz").touch()
        env.update(DATA_DIR=str(tmp_path / "data"))
    # stdout and stderr in one stream, in order, as the terminal showed them
    out = check(run(["env", "-u", "MASTER_DOMAIN", "bash", "-c", 'exec "$@" 2>&1', "dry-run", *cmd,
                     *args.split()], env=env, timeout=60)).stdout
    this_host = socket.gethostname().split(".")[0]  # a dry run outside a job: rank 0 is this host
    fresh = (out.replace(str(tmp_path / "data"), "/home/me/scaling-dl/data")
             .replace(str(ROOT), "/home/me/scaling-dl").replace(env["PBS_NODEFILE"] or "\0", EXCERPT_NODEFILE)
             .replace(f"MASTER_ADDR={this_host}.", "MASTER_ADDR=polaris-login-01."))
    assert normalised(fresh).splitlines() == normalised(shown).splitlines()


def test_the_readme_polaris_nccl_export_line_is_what_the_script_prints(tmp_path):
    shown = re.search(r"EXAMPLE=deepspeed` on 2 nodes prints, before the launch:\n\n\s*```\n\s*(export .*)\n",
                      (SUB / "README.md").read_text()).group(1)
    result, _ = job("polaris", tmp_path, 2, DRY_RUN="1", POLARIS_NCCL_TUNING="1", EXAMPLE="deepspeed")
    assert shown in check(result).stdout.splitlines()


# Rank 0's address on the fast network: the node file names the management network on Aurora
# (ALCF's PyTorch guide, "use hsn in MASTER_ADDR"); Polaris' DDP examples use .hsn too; ezpz names
# Sophia's nodes on .lab. A wrong network is a hang at init_process_group on a multi-node job.
FAST_NAME = {
    "aurora": ("x4000c0s0b0n0.hostmgmt2000.cm.aurora.alcf.anl.gov",
               "x4000c0s0b0n0.hsn.cm.aurora.alcf.anl.gov"),
    "polaris": ("x3005c0s13b0n0.hsn.cm.polaris.alcf.anl.gov", "x3005c0s13b0n0.hsn.cm.polaris.alcf.anl.gov"),
    "sophia": ("sophia-gpu-07", "sophia-gpu-07.lab.alcf.anl.gov"),
}


@pytest.mark.parametrize("machine", PBS)
def test_rank_0_is_reached_on_the_fast_network(tmp_path, machine):
    listed, expected = FAST_NAME[machine]
    env = scheduler_env(machine, tmp_path, 2)
    Path(env["PBS_NODEFILE"]).write_text(f"{listed}\nx4000c0s0b0n1.other\n")
    env.update(DRY_RUN="1")
    result = run(["env", "-u", "MASTER_DOMAIN", "bash", SUB / machine / "train.sh"], env=env, timeout=60)
    assert f"MASTER_ADDR={expected}" in exports(check(result).stdout), exports(result.stdout)


@pytest.mark.parametrize("machine", PBS)
def test_nodes_are_hosts_not_node_file_lines(tmp_path, machine):
    """A node file can name a host once per chunk (Sophia's by-gpu queue): counting lines would
    multiply the ranks. Two hosts, named 3 and 1 times: 2 nodes' worth of ranks."""
    env = scheduler_env(machine, tmp_path, 2)
    Path(env["PBS_NODEFILE"]).write_text("hostA\nhostA\nhostA\nhostB\n")
    env.update(DRY_RUN="1")
    (words,) = launches(check(run(["bash", SUB / machine / "train.sh"], env=env, timeout=60)).stdout,
                        machine)
    rpn = {"aurora": 12, "polaris": 4, "sophia": 2}[machine]  # Sophia: 4 GPU chunks on 2 hosts
    assert words[words.index("-n") + 1] == str(2 * rpn), words


def test_a_sophia_by_gpu_job_runs_one_rank_per_gpu_chunk(tmp_path):
    env = scheduler_env("sophia", tmp_path, 1)
    Path(env["PBS_NODEFILE"]).write_text("sophia-gpu-03\n" * 3)  # select=3:ngpus=1 on one node
    env.update(DRY_RUN="1")
    (words,) = launches(check(run(["bash", SUB / "sophia" / "train.sh"], env=env, timeout=60)).stdout,
                        "sophia")
    assert words[words.index("-n") + 1] == "3" and words[words.index("-N") + 1] == "3", words


@pytest.mark.parametrize("machine", PBS)
def test_the_data_folder_is_passed_and_a_missing_one_is_one_line(tmp_path, machine):
    """DATA_DIR (default: the repository's data/) goes to the examples as --data-dir. Missing, the
    dry run says where it expects it and how to fill it; a real job stops before launching."""
    missing = tmp_path / "no-mnist-here"
    result, _ = job(machine, tmp_path, 1, DRY_RUN="1", DATA_DIR=str(missing))
    (words,) = launches(check(result).stdout, machine)
    assert words[words.index("--data-dir") + 1] == str(missing)
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"dry run: no MNIST in DATA_DIR={missing}: ") and "tools/get_data.py" in line
    result, _ = job(machine, tmp_path, 1, DATA_DIR=str(missing))
    assert result.returncode != 0 and result.stderr.splitlines() == [line.replace("dry run", "error")]
    assert not shim_launches(tmp_path)


def test_a_job_reads_the_data_folder_that_get_data_made(tmp_path):
    """tools/get_data.py --shipped writes the shipped digits where a job reads them (a real 2-rank
    Polaris job under the simulation): the lesson says it read that file, and trains."""
    folder = tmp_path / "mnist"
    made = check(run([BIN / "python", ROOT / "tools" / "get_data.py", folder, "--shipped"], timeout=120))
    assert f"{folder} holds MNIST from Keras npz {folder}/mnist.npz: 4000 train / 1000" in made.stdout
    again = check(run([BIN / "python", ROOT / "tools" / "get_data.py", folder, "--shipped"], timeout=120))
    assert "already holds" in again.stdout
    result, _ = job("polaris", tmp_path, 1, DATA_DIR=str(folder), RANKS_PER_NODE="2",
                    TRAIN_ARGS=" ".join(QUICK))
    out = check(result).stdout
    assert f"MNIST from Keras npz {folder}/mnist.npz: 4000 train / 1000 test digits" in out
    (words,) = launches(out, "polaris")
    assert words[words.index("--data-dir") + 1] == str(folder)


@pytest.mark.parametrize("machine", PBS)
def test_download_in_the_job_goes_through_the_proxy_and_needs_no_data_folder(tmp_path, machine):
    """--download: the ranks fetch MNIST into DATA_DIR themselves, through ALCF's proxy (the compute
    nodes' only way out), so an empty DATA_DIR is no reason to stop; without it, no proxy is set."""
    missing, proxy = tmp_path / "no-mnist-yet", "http://proxy.alcf.anl.gov:3128"
    result, _ = job(machine, tmp_path, 1, DRY_RUN="1", DATA_DIR=str(missing), TRAIN_ARGS="--download")
    assert check(result).stderr == ""  # no "no MNIST in DATA_DIR" line
    assert {f"{name}={proxy}" for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")} <= set(
        exports(result.stdout))
    (words,) = launches(result.stdout, machine)
    assert words[-3:] == ["--data-dir", str(missing), "--download"], words
    plain, _ = job(machine, tmp_path, 1, DRY_RUN="1")
    assert not [e for e in exports(check(plain).stdout) if "proxy" in e.lower()]


def make_venv(folder, system_site_packages, own_torch=False):
    base = getattr(sys, "_base_executable", sys.executable)
    check(run([base, "-m", "venv", "--without-pip", folder,
               *(["--system-site-packages"] if system_site_packages else [])], timeout=120))
    if own_torch:  # a torch pip put into the venv itself, ahead of the module's
        (site,) = (folder / "lib").glob("python3*/site-packages")
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text("")
    return folder


@pytest.mark.parametrize("machine", PBS)
def test_a_venv_for_extras_sits_on_top_of_the_module_and_never_hides_its_torch(tmp_path, machine):
    """VENV (pure-Python extras the module lacks) is activated right after the module and its import
    check; a venv made without --system-site-packages, or holding a torch of its own, is one line."""
    good = make_venv(tmp_path / "extras", system_site_packages=True)
    result, _ = job(machine, tmp_path, 1, DRY_RUN="1", VENV=str(good))
    commands = [" ".join(words) for words in printed(check(result).stdout)]
    assert commands[len(SETUP[machine])] == f"source {good}/bin/activate", commands
    for venv, words in ((make_venv(tmp_path / "isolated", system_site_packages=False),
                         "is not a venv made with --system-site-packages"),
                        (make_venv(tmp_path / "own", True, own_torch=True), "has a torch of its own")):
        result, _ = job(machine, tmp_path, 1, VENV=str(venv))
        (line,) = result.stderr.splitlines()
        assert result.returncode != 0 and line.startswith(f"error: VENV={venv} ") and words in line, line
        assert not shim_launches(tmp_path)


@pytest.mark.parametrize("machine", PBS)
def test_the_transformer_lessons_run_by_their_names_and_read_no_mnist_folder(tmp_path, machine):
    """EXAMPLE=transformer-ddp (-fsdp) launches transformer/ddp.py (fsdp.py) with the course's flags;
    DATA_DIR (MNIST) is neither checked nor passed: their text is Python's own sources, on every node."""
    for example in ("transformer-ddp", "transformer-fsdp"):
        result, _ = job(machine, tmp_path, 1, DRY_RUN="1", EXAMPLE=example,
                        DATA_DIR=str(tmp_path / "no-mnist-here"))
        (words,) = launches(check(result).stdout, machine)
        script = ROOT / "transformer" / f"{example.split('-')[1]}.py"
        assert str(script) in words and "--data-dir" not in words, words
        assert "--log-dir" in words and result.stderr == ""
