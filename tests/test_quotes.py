"""Code the notes quote from a lesson is the lesson's code, as it is now.

The rule: in a lesson folder's README (and the front README), every line of a ```python block, and every
inline `code` span that reads as a line of the lesson (an assignment that uses the lesson's names, or a call
passed the lesson's flags or record: `args.`, `env.`), must appear in that folder's lesson files, compared
without comments and with whitespace normalised (so a quote may wrap its lines where the lesson does not).
Shorthand such as `hvd.allreduce(..., op=hvd.Sum)` in prose or in the front page's recipe table names an
API, not a line, and is not checked.
`...` in a quote stands for code left out: each piece around it must appear, in order. A block that is not a
quote (a sketch of an idea) says so on the line before its fence: <!-- not a quote -->.
"""
import re

import pytest

from support import ROOT

# A README and the lesson files it quotes from.
QUOTING = {
    "DDP/README.md": ["DDP/main.py"],
    "horovod/pytorch/README.md": ["horovod/pytorch/main.py"],
    "horovod/tensorflow/README.md": ["horovod/tensorflow/main.py", "horovod/tensorflow/keras_main.py"],
    "deepspeed/README.md": ["deepspeed/main.py"],
    "zero/README.md": ["zero/main.py"],
    "README.md": ["DDP/main.py", "horovod/pytorch/main.py", "horovod/tensorflow/main.py",
                  "horovod/tensorflow/keras_main.py", "deepspeed/main.py", "zero/main.py",
                  "transformer/tp.py", "transformer/pp.py"],
}
NOT_A_QUOTE = "<!-- not a quote -->"
# An inline span that reads as a lesson's line: `x = ...` using the lessons' names, or `f(...)` given
# the lesson's flags or record.
ASSIGNMENT = re.compile(r"^[\w.\[\], ]+ = .*\b(args|env|hvd|course|engine|ds|model|optimizer|torch|dist|tf)\.")
CALL_WITH_FLAGS = re.compile(r"^[\w.()]+\(.*\b(args|env)\..*\)$")


def strip_comment(line):
    """The code of one line: without its # comment (a # inside a string literal is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def normalise(code):
    code = re.sub(r"\s+", " ", code).strip()
    return re.sub(r"([(\[{]) | ([)\]}])", r"\1\2", code)  # a wrap after "(" or before ")" is not a difference


def lesson_code(files):
    return normalise(" ".join(strip_comment(line) for f in files for line in (ROOT / f).read_text().splitlines()))


def found(quote, code):
    """Every piece of the quote between `...` elisions appears in the code, in order."""
    at = 0
    for piece in (normalise(p) for p in quote.split("...")):
        piece = piece.strip(" ,")
        if not piece:
            continue
        at = code.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def quotes(readme):
    """(line number, quoted code) for every ```python block line and every code-like inline span."""
    lines = (ROOT / readme).read_text().splitlines()
    out, in_block, skip = [], False, False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            if not in_block and line.strip() == "```python":
                in_block, skip = True, n > 1 and lines[n - 2].strip() == NOT_A_QUOTE
            elif in_block:
                in_block = False
            continue
        if in_block:
            if not skip and strip_comment(line).strip():
                out.append((n, strip_comment(line)))
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if ASSIGNMENT.match(span) or CALL_WITH_FLAGS.match(span):
                out.append((n, strip_comment(span)))
    return out


@pytest.mark.parametrize("readme", QUOTING)
def test_quoted_code_is_in_the_lesson(readme):
    code = lesson_code(QUOTING[readme])
    stale = [f"{readme}:{n}: {q.strip()}" for n, q in quotes(readme) if not found(q, code)]
    assert not stale, ("quoted, but not in " + ", ".join(QUOTING[readme]) + " (update the quote, or mark a "
                       f"sketch with {NOT_A_QUOTE}):\n" + "\n".join(stale))


def test_the_rule_catches_a_stale_quote():
    code = lesson_code(["DDP/main.py"])
    assert found("model = DDP(model, device_ids=[device] if gpu else None)", code)
    assert not found("model = DDP(model, device_ids=None if env.device == \"cpu\" else [env.device])", code)
    assert found("dist.init_process_group(backend, ..., timeout=wait)", code)


# A stack frame quoted in the notes (py-spy's or a traceback's `path/to/file.py:LINE function`) points at a line
# inside that function of the repository's file as it is now: a rewrap of the code must move the notes too.
FRAME = re.compile(r"^\s+((?:DDP|horovod|deepspeed|zero|transformer|utils|course|tests|diagnose)/[\w/]+\.py):(\d+) "
                   r"(\w+|<module>)\s*$", re.M)


def frames_in_notes():
    for md in sorted(ROOT.glob("**/*.md")):
        if ".venv" in md.parts:
            continue
        for match in FRAME.finditer(md.read_text()):
            yield pytest.param(md.relative_to(ROOT), *match.groups(), id=f"{md.relative_to(ROOT)}:{match.group(0)}")


@pytest.mark.parametrize("note, path, line, function", list(frames_in_notes()))
def test_a_quoted_stack_frame_is_a_line_of_code_in_its_function(note, path, line, function):
    """The frame's line is where a statement or a call of that function begins (not a docstring, a comment or
    a blank line): a frame that moved with an edit of the file is caught, not only one that left the function."""
    import ast
    tree = ast.parse((ROOT / path).read_text())
    line = int(line)
    if function == "<module>":
        scopes = [tree]
    else:
        scopes = [node for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function]
    code_lines = {node.lineno for scope in scopes for node in ast.walk(scope)
                  if isinstance(node, (ast.stmt, ast.Call)) and node is not scope
                  and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))}
    assert line in code_lines, f"{note}: {path}:{line} is not a line of code in {function}()"


def test_the_frame_rule_catches_a_docstring_line():
    import ast
    tree = ast.parse((ROOT / "course/failures.py").read_text())
    (run_main,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_main"]
    docstring_line = run_main.body[0].lineno + 1
    with pytest.raises(AssertionError):
        test_a_quoted_stack_frame_is_a_line_of_code_in_its_function("x.md", "course/failures.py", docstring_line,
                                                                      "run_main")
