"""submissions/: what can be checked without running a job: shellcheck, the directives, the README's
node and rank statements against the scripts, the one table of examples, Polaris' GPU affinity."""

import re

import pytest

from jobs_support import (
    EXAMPLES,
    MACHINES,
    PBS,
    SUB,
    directives,
    launch_text,
    nodes_asked,
    ranks_per_node,
)
from support import BIN, ROOT, check, run

SCRIPTS = sorted(SUB.glob("*/*.sh"))
LIVE = [s for s in SCRIPTS if s.parent.name != "retired"]
WALLTIME = re.compile(r"^(\d+):([0-5]\d):([0-5]\d)$")


def rel(path):
    return str(path.relative_to(ROOT))


def test_shellcheck_clean():
    """Every script, the retired references too."""
    assert len(SCRIPTS) == 2 * len(MACHINES) + 3  # train.sh + scale.sh each; affinity; two retired
    check(
        run(
            [
                BIN / "shellcheck",
                "-x",
                "--severity=info",
                rel(SUB / "plumbing.sh"),
                *map(rel, SCRIPTS),
            ],
            timeout=120,
        )
    )


def test_one_train_and_one_scale_script_per_machine_short_and_executable():
    for machine in MACHINES:
        assert sorted(p.name for p in (SUB / machine).glob("*.sh") if "affinity" not in p.name) == [
            "scale.sh",
            "train.sh",
        ], machine
    for script in [*SCRIPTS, SUB / "plumbing.sh"]:
        long = [n for n, line in enumerate(script.read_text().splitlines(), 1) if len(line) > 100]
        assert not long, f"{rel(script)}: lines over 100 columns: {long}"
    for script in SCRIPTS:
        assert script.stat().st_mode & 0o100, f"{rel(script)} is not executable"
    # 160: launch's check of the files on the launch line took it past the 150 lines it had
    assert len((SUB / "plumbing.sh").read_text().splitlines()) <= 160


def standalone_block(script):
    """A train.sh's stand-in for plumbing.sh, from its `else` to its `fi`."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("else  # this file alone"))
    return lines[start : lines.index("fi", start) + 1]


def test_every_train_sh_has_the_same_short_stand_in_for_plumbing():
    """What a train.sh copied alone does without plumbing.sh: one block, the same in each."""
    blocks = {machine: standalone_block(SUB / machine / "train.sh") for machine in MACHINES}
    assert all(block == blocks["local"] for block in blocks.values())
    assert len(blocks["local"]) <= 30


def test_the_examples_table_is_written_once():
    """Only tools/examples.tsv maps example names to scripts; no live script names one."""
    for script in [*LIVE, SUB / "plumbing.sh"]:
        text = script.read_text()
        for path in EXAMPLES.values():
            assert path not in text, (
                f"{rel(script)} names {path}: read it from tools/examples.tsv"
            )


@pytest.mark.parametrize("machine", MACHINES)
def test_the_launch_line_is_written_as_the_guides_write_it(machine):
    words = launch_text(SUB / machine / "train.sh")
    assert words[-3:] == ["$SCRIPT", "${COURSE_FLAGS[@]}", "$@"] and words[-4] in ("python",)
    expected_start = {
        "aurora": ["mpiexec", "-n", "$NRANKS", "--ppn", "$PPN", "--cpu-bind", "$CPU_BIND"],
        "polaris": [
            "mpiexec",
            "-n",
            "$NRANKS",
            "--ppn",
            "$PPN",
            "--depth",
            "$DEPTH",
            "--cpu-bind",
            "depth",
            "$AFFINITY_DIR/set_affinity_gpu_polaris.sh",
        ],
        "sophia": [
            "mpirun",
            "-n",
            "$NRANKS",
            "-N",
            "$PPN",
            "--hostfile",
            "$PBS_NODEFILE",
            "-x",
            "PATH",
        ],
        "slurm": [
            "srun",
            "-N",
            "$(((NRANKS + PPN - 1) / PPN))",
            "-n",
            "$NRANKS",
            "--ntasks-per-node",
            "$PPN",
        ],
        "local": ["mpiexec", "-n", "$NRANKS"],
    }[machine]
    assert words[: len(expected_start)] == expected_start, words
    if machine == "aurora":
        (bind,) = re.findall(
            r"^CPU_BIND=(\S+)", (SUB / "aurora" / "train.sh").read_text(), re.MULTILINE
        )
        assert bind == "list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79"


def hours(walltime):
    h, m, s = map(int, WALLTIME.match(walltime).groups())
    return h + m / 60 + s / 3600


SCHEDULED = [s for s in LIVE if s.parent.name in (*PBS, "slurm") and s.stem in ("train", "scale")]


@pytest.mark.parametrize("script", SCHEDULED, ids=rel)
def test_directives_are_complete(script):
    found = directives(script)
    opts = dict(found)
    machine = script.parent.name
    assert opts["-A"] == "YOUR_PROJECT"  # nobody's real project: qsub -A / sbatch -A sets yours
    assert nodes_asked(script) == (1 if script.stem == "train" else 2)
    if machine == "slurm":
        assert (
            WALLTIME.match(opts["-t"])
            and opts["--gpus-per-node"] == opts["--ntasks-per-node"] == "4"
        )
        return
    resources = dict(v.split("=", 1) for o, v in found if o == "-l")
    assert 5 / 60 <= hours(resources["walltime"]) <= 1
    # one rank set per node where whole nodes are asked for; Sophia's by-gpu chunks share one node (no place=)
    assert resources.get("place") == (None if machine == "sophia" else "scatter"), machine
    assert opts["-j"] == "oe"
    disk = {"aurora": "flare", "polaris": "eagle", "sophia": "eagle"}[machine]
    assert resources["filesystems"] == f"home:{disk}"
    if machine == "polaris":
        assert re.fullmatch(r"[12]:system=polaris", resources["select"]) and opts["-q"] == "debug"
    elif machine == "aurora":
        assert opts["-k"] == "doe" and opts["-q"] == "debug" and resources["select"] in ("1", "2")
    else:
        assert opts["-q"] == "by-node"


def test_retired_scripts_say_so_and_keep_their_launch_lines():
    for name, launcher, successor in (
        ("theta", "aprun -n", "submissions/aurora/train.sh"),
        ("thetagpu", "mpirun -np", "submissions/sophia/train.sh"),
    ):
        text = (SUB / "retired" / f"{name}.sh").read_text()
        assert (
            "stopped running jobs at 23:59 on\n# 2023-12-31" in text
            or "23:59 on 2023-12-31" in text
        )
        assert launcher in text and successor in text
    live = "".join(s.read_text() for s in [*LIVE, SUB / "plumbing.sh"])
    assert "aprun" not in live and "COBALT" not in live  # no branch for them in the live scripts


# --- the README's statements against the scripts --------------------------------------------------
ROW = re.compile(r"^\| \[`(\w+)/(train|scale)\.sh`\]\(\w+/\w+\.sh\) \| (\d+) \| (\d+) \| (.+?) \|$")


def test_readme_nodes_and_ranks_match_the_scripts():
    rows = [ROW.match(line) for line in (SUB / "README.md").read_text().splitlines()]
    rows = [m.groups() for m in rows if m]
    expected = [(m, s) for m in (*PBS, "slurm") for s in ("train", "scale")]
    assert sorted((m, s) for m, s, *_ in rows) == sorted(expected)
    for machine, stem, nodes, per_node, ranks in rows:
        script = SUB / machine / f"{stem}.sh"
        assert int(nodes) == nodes_asked(script), (machine, stem)
        assert int(per_node) == ranks_per_node(SUB / machine / "train.sh"), (machine, stem)
        total = int(nodes) * int(per_node)
        if stem == "train":
            assert ranks == str(total), (machine, stem, ranks)
        else:
            points, n = [], 1
            while n < total:
                points.append(str(n))
                n *= 2
            assert ranks == ", ".join([*points, str(total)]), (machine, stem, ranks)


# --- Polaris' GPU affinity ------------------------------------------------------------------------
AFFINITY = SUB / "polaris" / "set_affinity_gpu_polaris.sh"


def test_polaris_gpu_affinity_reverse_order():
    got = []
    for local_rank in range(5):
        env = {
            "PMI_LOCAL_RANK": str(local_rank),
            "CUDA_VISIBLE_DEVICES": "",
            "AFFINITY_VERBOSE": "1",
        }
        result = check(
            run([AFFINITY, "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"], env=env, timeout=30)
        )
        got.append(result.stdout.strip())
    assert got == ["3", "2", "1", "0", "3"]  # local rank 0 sits on NUMA 0, nearest GPU 3


def test_polaris_gpu_affinity_needs_a_launcher():
    env = dict.fromkeys(("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID"), "")
    result = run([AFFINITY, "true"], env=env, timeout=30)
    assert (
        result.returncode != 0
        and result.stderr.startswith("error: ")
        and len(result.stderr.splitlines()) == 1
    )
