"""A lesson lifts out: copied into an empty folder with the few helper files it imports, and nothing else
of the course, it runs under torchrun and under mpiexec, and its helpers stay small.

The lessons listed in LIFTS_OUT import only arguments, logging and data from utils/ (utils/README.md);
every distributed step is torch's own call in the lesson file. The course's plumbing (one-line failures,
flag checks, noise filters, TensorBoard) comes in through one optional import, and a copy runs without it.
"""
import ast
import json
import shutil

import pytest

from support import BIN, DDP, DS, HVD_KERAS, HVD_TF, HVD_TORCH, ROOT, check, run, without_timing
from tools.launch import launch_command

# Each lesson that lifts out, and the launchers its copy is run under (the first: also compared with
# the lesson run in the course, digit for digit).
LAUNCHED_BY = {ROOT / DDP: ("torchrun", "mpiexec"), ROOT / HVD_TORCH: ("horovodrun", "mpiexec"),
               ROOT / HVD_TF: ("horovodrun", "mpiexec"), ROOT / HVD_KERAS: ("horovodrun", "mpiexec"),
               ROOT / DS: ("torchrun", "mpiexec")}
LIFTS_OUT = list(LAUNCHED_BY)
RUNS = [(lesson, launcher) for lesson, launchers in LAUNCHED_BY.items() for launcher in launchers]
HELPER_LINES = 400  # the helpers a lifted lesson takes along, all together
OPTIONAL = "plumbing"  # the module a lesson imports in try/except ImportError: not taken along


def utils_imports(path):
    """The utils modules `path` imports outside a try block (what a copy must take along)."""
    tree = ast.parse(path.read_text())
    optional = {id(node) for t in ast.walk(tree) if isinstance(t, ast.Try) for node in ast.walk(t)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in optional or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "utils":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("utils."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("utils.")}
    return found


def helpers_of(lesson):
    """utils/__init__.py and every utils module the lesson needs, directly or through another helper."""
    needed, todo = set(), utils_imports(lesson)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo |= utils_imports(ROOT / "utils" / f"{name}.py")
    return [ROOT / "utils" / "__init__.py"] + sorted(ROOT / "utils" / f"{n}.py" for n in needed)


@pytest.mark.parametrize("lesson", LIFTS_OUT, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_helpers_a_lesson_takes_along_are_few_and_small(lesson):
    helpers = helpers_of(lesson)
    names = [p.name for p in helpers]
    assert f"{OPTIONAL}.py" not in names, names
    assert set(names) <= {"__init__.py", "parse_args.py", "log.py", "data.py"}, names  # arguments, logging, data
    lines = sum(len(p.read_text().splitlines()) for p in helpers)
    assert lines <= HELPER_LINES, f"{lesson.name} takes {names} along: {lines} lines (at most {HELPER_LINES})"


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    """Each lesson copied alone as main.py (with the JSON files of its folder: DeepSpeed's config),
    beside a utils/ holding only its helpers."""
    copies = {}
    for lesson in LIFTS_OUT:
        folder = tmp_path_factory.mktemp(lesson.parent.name.lower())
        shutil.copy(lesson, folder / "main.py")
        for config in lesson.parent.glob("*.json"):
            shutil.copy(config, folder / config.name)
        (folder / "utils").mkdir()
        for helper in helpers_of(lesson):
            shutil.copy(helper, folder / "utils" / helper.name)
        copies[lesson] = folder
    return copies


@pytest.mark.parametrize("lesson,launcher", RUNS, ids=[f"{p.relative_to(ROOT).with_suffix('')}-{n}" for p, n in RUNS])
def test_a_copy_of_the_lesson_runs_alone_under_each_launcher(lifted, lesson, launcher, tmp_path):
    folder = lifted[lesson]
    flags = ["--epochs", "2", "--max-steps", "15", "--num-threads", "1", "--log-dir", str(tmp_path / "run")]
    # cwd: the copy, far from the repository (whose utils/ it must not reach)
    check(run(launch_command(folder / "main.py", 2, launcher, flags), timeout=240, cwd=folder))
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2] and history[1]["train_loss"] < history[0]["train_loss"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    checksums = summary["param_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums  # both ranks, the same weights
    if lesson != ROOT / HVD_KERAS:  # (model.fit's lesson writes none)
        assert list((tmp_path / "run" / "checkpoints").iterdir())  # checkpoint.pt, or TensorFlow's ckpt-2.*
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))  # no TensorBoard: plumbing stayed home
    if launcher == LAUNCHED_BY[lesson][0]:  # the same training as the lesson in the course, digit for digit
        check(run(launch_command(lesson, 2, launcher, [*flags[:-1], tmp_path / "course"]), timeout=240))
        course = [json.loads(line) for line in (tmp_path / "course" / "metrics.jsonl").read_text().splitlines()]
        assert without_timing(history) == without_timing(course)
        assert json.loads((tmp_path / "course" / "summary.json").read_text())["param_checksums"] == checksums


@pytest.mark.parametrize("lesson", LIFTS_OUT, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_copy_refuses_a_bad_flag_in_one_line(lifted, lesson):
    result = run([str(BIN / "python"), "main.py", "--batch-size", "0"], timeout=120, cwd=lifted[lesson])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "main.py: error: argument --batch-size: must be a positive integer, got 0 (see main.py --help)"]


def test_the_deepspeed_lesson_reads_the_launchers_as_the_ddp_lesson_does():
    """[1] is written out in both lessons (each lifts out alone): the same table, the same reading."""
    def step_1(path):
        tree = ast.parse(path.read_text())
        return [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Assign, ast.FunctionDef))
                and getattr(node, "name", None) == "who_am_i" or isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "LAUNCHERS" for t in node.targets)]
    assert len(step_1(ROOT / DDP)) == 2 and step_1(ROOT / DS) == step_1(ROOT / DDP)
