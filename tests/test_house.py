"""Where things live: utils/ holds only what the lessons import, with no import cycle among its modules; the
maintainers' tools live in tools/; a checkpoint's folder is decided in one place; --backend is checked by one
function. Each rule reads the code itself (imports are read with ast, every `import`, at any depth)."""
import ast
import sys
from pathlib import Path

from support import EXAMPLES, ROOT, run

UTILS = {p.stem: p for p in (ROOT / "utils").glob("*.py")}  # "__init__": what `import utils` runs
# The lessons: every example, the modules beside them that they import, and the diagnose/ chapter's scripts
LESSONS = sorted({ROOT / s for s in EXAMPLES.values()} | set((ROOT / "zero").glob("*.py"))
                 | set((ROOT / "diagnose").glob("*.py")) | set((ROOT / "transformer").glob("*.py")))


def imported(path):
    """The top-level names and `utils.X` modules `path` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "utils":  # from utils import data, log
                names |= {f"utils.{alias.name}" for alias in node.names}
    return names


def utils_modules(path):
    names = imported(path)
    package = {"__init__"} if any(n == "utils" or n.startswith("utils.") for n in names) else set()
    return ({n.split(".")[1] for n in names if n.startswith("utils.")} & set(UTILS)) | package


def test_utils_modules_import_each_other_without_a_cycle():
    # (a module of the package always runs utils/__init__.py first: that edge is not a cycle)
    graph = {name: utils_modules(path) - {name, "__init__"} for name, path in UTILS.items()}
    done, cycles = set(), []

    def visit(name, stack):
        for dep in sorted(graph[name]):
            if dep in stack:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, stack + [dep])
        done.add(name)

    for name in sorted(graph):
        visit(name, [name])
    assert not cycles, f"import cycles in utils/: {cycles}"


def test_the_cycle_rule_sees_an_import_inside_a_function(tmp_path):
    # the rule must read function-level imports too: a cycle hidden in a function is a cycle
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from utils.log import info\n")
    assert utils_modules(module) == {"__init__", "log"}


def test_utils_holds_only_what_the_lessons_import():
    reached, todo = set(), [m for lesson in LESSONS for m in utils_modules(lesson)]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += utils_modules(UTILS[name])
    assert set(UTILS) - reached == set(), "utils/ modules no lesson imports (tools belong in tools/)"
    assert not (ROOT / "utils" / "tools").exists(), "the maintainers' tools live in tools/, not under utils/"


def test_no_lesson_and_no_utils_module_imports_the_tools():
    """Neither `import tools.x` nor the tools' folder put on sys.path (they then import each other by name)."""
    users = [str(p.relative_to(ROOT)) for p in [*LESSONS, *UTILS.values()]
             if any(name == "tools" or name.startswith("tools.") for name in imported(p))
             or '/ "tools"' in p.read_text()]
    # Two drivers, not lessons: zero/report.py launches zero/main.py once per variant (launchers are known in one
    # place), and diagnose/profile_ranks.py wraps a lesson with the phase timer's patches (tools/phases.py).
    assert sorted(users) == ["diagnose/profile_ranks.py", "zero/report.py"], users


def test_one_rule_says_where_a_checkpoint_lives():
    """utils/log.py's checkpoint_folder: no lesson spells out <log dir>/checkpoints itself."""
    spelled = [str(p.relative_to(ROOT)) for p in [*LESSONS, *UTILS.values()] if '"checkpoints"' in p.read_text()]
    assert spelled == ["utils/log.py"], spelled
    sys.path.append(str(ROOT))
    from utils.log import checkpoint_folder
    assert checkpoint_folder(None, "runs/x") == Path("runs/x/checkpoints")
    assert checkpoint_folder("/ckpt", "runs/x") == Path("/ckpt")
    assert checkpoint_folder(None, None) is None


def test_the_backend_is_checked_by_one_function_before_and_after_the_device_is_picked():
    """parse() (with --device) and pick_backend() (with the rank's device) say the same line: both are
    utils/dist.py's backend_problem. --device cpu with --backend nccl is impossible on every machine."""
    code = (
        "import sys; sys.path.append(sys.argv[1]); import torch\n"
        "from utils.dist import backend_problem\n"
        "from utils.checks import parse\n"
        "from utils.parse_args import get_parser\n"
        "print(backend_problem('nccl', 'cpu'), flush=True)\n"
        "parse(get_parser('x'), ['--backend', 'nccl', '--device', 'cpu'])\n"
    )
    result = run([sys.executable, "-c", code, ROOT], timeout=120)
    expected = result.stdout.strip().splitlines()[0]
    assert expected.startswith("--backend nccl connects cuda devices, not cpu"), result.stdout
    assert result.returncode == 2 and f"error: {expected}" in result.stderr, result.stderr


# A path into the course's own folders, as notes, job scripts and tools name one (a library's own path, such as
# DeepSpeed's deepspeed/runtime/..., is under site-packages: named with its package, below).
TOP = ("DDP", "horovod", "deepspeed", "zero", "transformer", "diagnose", "utils", "tools", "submissions", "tests",
       "assets")
NAMED = r"(?<![\w./~-])((?:%s)/[\w./-]*\w\.(?:py|sh|md|json|tsv|png|txt|patch))\b" % "|".join(TOP)
LIBRARY_PATHS = {"deepspeed/runtime/zero/stage_1_and_2.py"}  # DeepSpeed's file, quoted in tools/PERFORMANCE.md
PLACEHOLDERS = {"transformer/X.py"}  # part2.md: "X" stands for each split lesson's name


def named_paths(text):
    import re
    return {m.group(1) for m in re.finditer(NAMED, text)} - LIBRARY_PATHS - PLACEHOLDERS


def test_every_file_a_note_a_job_script_or_a_tool_names_exists():
    import subprocess
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = {}
    for name in tracked:
        if name.endswith((".md", ".sh", ".py", ".tsv")) and not name.startswith("tests/"):
            for path in named_paths((ROOT / name).read_text(errors="replace")):
                if not (ROOT / path).exists():
                    missing.setdefault(path, []).append(name)
    assert not missing, missing


def test_the_named_file_rule_catches_a_stale_name():
    assert named_paths("the Keras CNN of utils/tf_utils.py, and ~/my-project/utils/log.py") == {"utils/tf_utils.py"}


def test_the_front_page_is_at_most_250_lines():
    """The front page is course notes' first page: what a lesson needs is in its own README."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
