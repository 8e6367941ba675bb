"""Where things live: utils/ holds what the design card gives it (arguments, logging, data), the course's plumbing
lives in course/, and no module of either imports another in a circle; the maintainers' tools live in tools/; no
module replaces another module's attributes but course/wrap.py; a checkpoint's folder is decided in one place;
--backend is checked by one function. Each rule reads the code itself (imports are read with ast, every `import`,
at any depth)."""
import ast
import subprocess
import sys
from pathlib import Path

from support import EXAMPLES, ROOT, run

UTILS = {p.stem: p for p in (ROOT / "utils").glob("*.py")}  # "__init__": what `import utils` runs
COURSE = {p.stem: p for p in (ROOT / "course").glob("*.py")}
DESIGN_CARD = {"__init__", "parse_args", "log", "data"}  # arguments, logging, data
# The lessons: every example, the modules beside them that they import, and the diagnose/ chapter's scripts
LESSONS = sorted({ROOT / s for s in EXAMPLES.values()} | set((ROOT / "zero").glob("*.py"))
                 | set((ROOT / "diagnose").glob("*.py")) | set((ROOT / "transformer").glob("*.py")))
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def imported(path):
    """The top-level names and `utils.X`/`course.X` modules `path` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module in ("utils", "course"):  # from utils import data, log
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def modules_of(path, package="utils"):
    """The modules of `package` (utils or course) that `path` imports; "__init__" for the package itself."""
    names, modules = imported(path), UTILS if package == "utils" else COURSE
    inside = {n.split(".")[1] for n in names if n.startswith(package + ".")} & set(modules)
    return inside | ({"__init__"} if any(n == package or n.startswith(package + ".") for n in names) else set())


def utils_modules(path):
    return modules_of(path, "utils")


def test_utils_holds_what_the_design_card_gives_it_and_never_needs_the_course():
    """A lesson's copy takes utils/ along without course/: nothing in utils/ may import it."""
    assert set(UTILS) == DESIGN_CARD, sorted(set(UTILS) ^ DESIGN_CARD)
    users = [name for name, path in UTILS.items() if modules_of(path, "course")]
    assert users == [], f"utils/ modules that import course/: {users}"


def test_utils_and_course_modules_import_each_other_without_a_cycle():
    # (a module of a package always runs its __init__.py first: that edge is not a cycle)
    graph = {f"{package}.{name}": {f"{other}.{m}" for other in ("utils", "course")
                                   for m in modules_of(path, other) - {"__init__"}} - {f"{package}.{name}"}
             for package, modules in (("utils", UTILS), ("course", COURSE)) for name, path in modules.items()}
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
    assert not cycles, f"import cycles in utils/ and course/: {cycles}"


def test_the_cycle_rule_sees_an_import_inside_a_function(tmp_path):
    # the rule must read function-level imports too: a cycle hidden in a function is a cycle
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from utils.log import info\n    from course import seal\n")
    assert utils_modules(module) == {"__init__", "log"} and modules_of(module, "course") == {"__init__", "seal"}


def test_utils_holds_only_what_the_lessons_import():
    reached, todo = set(), [m for lesson in LESSONS for m in utils_modules(lesson)]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += utils_modules(UTILS[name])
    assert set(UTILS) - reached == set(), "utils/ modules no lesson imports (tools belong in tools/)"
    assert not (ROOT / "utils" / "tools").exists(), "the maintainers' tools live in tools/, not under utils/"


def test_no_module_outside_the_lessons_is_over_250_lines():
    """A smell detector: a module that grew past it holds two jobs (utils/, course/, tools/)."""
    long = {name: n for name in TRACKED if name.endswith(".py") and name.startswith(("utils/", "course/", "tools/"))
            and (n := len((ROOT / name).read_text().splitlines())) > 250}
    assert long == {}


def test_every_course_module_is_used():
    """Reached from what the lessons, diagnose/ and the tools import: no module nobody calls."""
    users = [ROOT / name for name in TRACKED if name.endswith(".py") and not name.startswith(("course/", "tests/"))]
    reached, todo = set(), [m for user in users for m in modules_of(user, "course")]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += modules_of(COURSE[name], "course")
    assert set(COURSE) - reached == set(), "course/ modules nothing imports"


# The one module that replaces another module's attributes (the framework calls the plumbing watches), and the
# timing tool, which measures from outside by design; and the attributes Python documents as settings.
WRAPS = {"course/wrap.py", "tools/phases.py"}
SETTINGS = {("sys", "excepthook"): "Python's hook for an uncaught exception",
            ("sys", "argv"): "a lesson run as __main__ by a driver (diagnose/profile_ranks.py)",
            ("tempfile", "tempdir"): "the documented way to move the temporary folder"}


def replaced_attributes(source):
    """(name, attribute, line) for each `name.attr = ...` or `setattr(name, ...)` where `name` was bound by an
    import in the file: another module's attribute (or an imported class's) replaced."""
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            bound |= {(a.asname or a.name) for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in bound:
                    found.append((t.value.id, t.attr, node.lineno))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and isinstance(node.args[0], ast.Name) and node.args[0].id in bound):
            attr = node.args[1].value if isinstance(node.args[1], ast.Constant) else "?"
            found.append((node.args[0].id, attr, node.lineno))
    return [f for f in found if f[:2] not in SETTINGS]


def test_no_module_replaces_another_modules_attributes_but_the_one_place():
    found = {name: replaced_attributes((ROOT / name).read_text()) for name in TRACKED
             if name.endswith(".py") and not name.startswith("tests/") and name not in WRAPS}
    assert {name: f for name, f in found.items() if f} == {}


def test_the_replacement_rule_catches_a_swap_and_a_setattr():
    source = ("from utils import log\nimport torch.distributed as dist\nimport sys\n"
              "def f(x):\n    log.Progress, log.RunLog = 1, 2\n    setattr(dist, 'init_process_group', x)\n"
              "    x.y = 3\n    sys.excepthook = x\n")
    assert replaced_attributes(source) == [("log", "Progress", 5), ("log", "RunLog", 5),
                                           ("dist", "init_process_group", 6)]


def test_no_lesson_and_no_utils_module_imports_the_tools():
    """Neither `import tools.x` nor the tools' folder put on sys.path (they then import each other by name)."""
    users = [str(p.relative_to(ROOT)) for p in [*LESSONS, *UTILS.values()]
             if any(name == "tools" or name.startswith("tools.") for name in imported(p))
             or '/ "tools"' in p.read_text()]
    # Two drivers, not lessons: zero/report.py launches zero/main.py once per variant (launchers are known in one
    # place), and diagnose/profile_ranks.py wraps a lesson with the phase timer's patches (tools/phases.py).
    assert sorted(users) == ["diagnose/profile_ranks.py", "zero/report.py"], users


def test_the_tools_import_one_another_one_way():
    """`from tools import bench_runs` or `from tools.launch import ...`, never by bare name (which needs tools/ on
    sys.path, and can load one module twice under two names), in the tools, the tests and diagnose/."""
    own = {p.stem for p in (ROOT / "tools").glob("*.py")}
    files = [*(ROOT / "tools").glob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "diagnose").glob("*.py")]
    by_name = sorted(f"{p.relative_to(ROOT)}: {name}" for p in files for name in imported(p)
                     if name.split(".")[0] in own)
    assert by_name == [], by_name


def test_one_rule_says_where_a_checkpoint_lives():
    """utils/log.py's checkpoint_folder: no lesson spells out <log dir>/checkpoints itself."""
    spelled = [str(p.relative_to(ROOT)) for p in [*LESSONS, *UTILS.values()] if '"checkpoints"' in p.read_text()]
    assert spelled == ["utils/log.py"], spelled
    sys.path.append(str(ROOT))
    from utils.log import checkpoint_folder
    assert checkpoint_folder(None, "runs/x") == Path("runs/x/checkpoints")
    assert checkpoint_folder("/ckpt", "runs/x") == Path("/ckpt")
    assert checkpoint_folder(None, None) is None


def test_the_backend_is_checked_by_one_function():
    """parse() refuses --backend with course/dist.py's backend_problem line, the one rule (each lesson then picks
    its backend in plain code). --device cpu with --backend nccl is impossible on every machine."""
    code = (
        "import sys; sys.path.append(sys.argv[1]); import torch\n"
        "from course.dist import backend_problem\n"
        "from course.checks import parse\n"
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
TOP = ("DDP", "horovod", "deepspeed", "zero", "transformer", "diagnose", "utils", "course", "tools", "submissions",
       "tests", "assets")
NAMED = r"(?<![\w./~-])((?:%s)/[\w./-]*\w\.(?:py|sh|md|json|tsv|png|txt|patch))\b" % "|".join(TOP)
LIBRARY_PATHS = {"deepspeed/runtime/zero/stage_1_and_2.py"}  # DeepSpeed's file, quoted in tools/PERFORMANCE.md
PLACEHOLDERS = {"transformer/X.py"}  # part2.md: "X" stands for each split lesson's name


def named_paths(text):
    import re
    return {m.group(1) for m in re.finditer(NAMED, text)} - LIBRARY_PATHS - PLACEHOLDERS


def test_every_file_a_note_a_job_script_or_a_tool_names_exists():
    missing = {}
    for name in TRACKED:
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
