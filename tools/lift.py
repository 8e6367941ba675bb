"""A lesson lifted out of the course, as an attendee copies it into a project: the lesson file as main.py,
the JSON files of its folder (DeepSpeed's config), the modules of its own folder it imports (the transformer's
model.py, text.py) and a utils/ holding only the helpers it imports outside a try block. The course's plumbing
(the one optional import) stays home. tests/test_lift_out.py runs these copies; tools/soak.py counts how they end.
"""
import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def chapter_modules(lesson):
    """The modules of the lesson's own folder that it imports, directly or through one another
    (transformer/chapter.py, model.py): part of the chapter, taken along beside it, not counted as
    helpers."""
    chapter, found, todo = lesson.parent.name, set(), [lesson]
    while todo:
        names = set()
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == chapter:  # from zero import flags
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(chapter + "."):
                names.add(node.module.split(".")[1])  # from zero.flags import Checked
        # (only files of the folder: deepspeed/ and horovod/ share their names with the libraries)
        for path in (lesson.parent / f"{name}.py" for name in names - found):
            if path.is_file() and path != lesson:
                found.add(path.stem)
                todo.append(path)
    return sorted(lesson.parent / f"{name}.py" for name in found)


def helpers_of(lesson):
    """utils/__init__.py and every utils module the lesson needs, directly, through its chapter's
    modules or through another helper."""
    needed, todo = set(), set().union(*map(utils_imports, [lesson, *chapter_modules(lesson)]))
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo |= utils_imports(ROOT / "utils" / f"{name}.py")
    return [ROOT / "utils" / "__init__.py"] + sorted(ROOT / "utils" / f"{n}.py" for n in needed)


def lift(lesson, folder):
    """Copy `lesson` (a path) into the empty `folder` as an attendee would; returns folder/main.py."""
    lesson, folder = Path(lesson), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(lesson, folder / "main.py")
    for config in lesson.parent.glob("*.json"):
        shutil.copy(config, folder / config.name)
    for module in chapter_modules(lesson):
        (folder / lesson.parent.name).mkdir(exist_ok=True)
        shutil.copy(module, folder / lesson.parent.name / module.name)
    (folder / "utils").mkdir()
    for helper in helpers_of(lesson):
        shutil.copy(helper, folder / "utils" / helper.name)
    return folder / "main.py"
