"""The notes' accuracies agree with each other: every final accuracy a page shows for a course-path command (its
opening excerpt, the demo table on the front page) lies inside the range the course path quotes for that step,
and passes the step's criterion. A page rerun on another CPU must land in the range, or the range is remeasured
(`python tools/ranges.py`)."""
import re

import pytest

from support import ROOT

FRONT = (ROOT / "README.md").read_text()
# A course-path row: | n | [page](folder/README.md)... | `command` | `test accuracy` >= 0.90; 0.936-0.945 |
ROW = re.compile(r"^\| \d+ \| \[[^]]+\]\((?P<page>[\w/]+README\.md)\)[^|]* \| `(?P<cmd>[^`]+)` \| "
                 r"`test accuracy` >= (?P<min>[\d.]+); (?P<lo>[\d.]+)-(?P<hi>[\d.]+) \|$", re.M)
STEPS = {m["page"]: (m["cmd"], float(m["min"]), float(m["lo"]), float(m["hi"])) for m in ROW.finditer(FRONT)}
# The demo table's framework names, by the page of their course-path step (Horovod PyTorch: DDP's weights).
DEMO = {"DDP/README.md": ["PyTorch DDP", "Horovod PyTorch"], "horovod/tensorflow/README.md": ["Horovod TensorFlow"],
        "deepspeed/README.md": ["DeepSpeed"]}
SAME_AS_DDP = "horovod/pytorch/README.md"  # step 2's criterion: step 1's accuracy exactly


def test_the_course_path_quotes_ranges_for_the_accuracy_steps():
    assert set(STEPS) >= set(DEMO), sorted(STEPS)
    for page, (_, minimum, lo, hi) in STEPS.items():
        assert minimum <= lo <= hi < 1, page


@pytest.mark.parametrize("page", sorted(set(DEMO) | {SAME_AS_DDP}))
def test_a_pages_opening_run_lies_in_its_steps_range(page):
    _, minimum, lo, hi = STEPS["DDP/README.md" if page == SAME_AS_DDP else page]
    text = (ROOT / page).read_text()
    found = [float(v) for v in re.findall(r"^(?:\[0\]<stdout>:)?test accuracy\s+([\d.]+)$", text, re.M)]
    assert found, f"{page}: no `test accuracy` line in its excerpt"
    for value in found:
        assert minimum <= value and lo <= value <= hi, f"{page}: {value} outside the course path's {lo}-{hi}"


@pytest.mark.parametrize("page", sorted(DEMO))
def test_the_demo_tables_accuracies_lie_in_the_ranges(page):
    _, minimum, lo, hi = STEPS[page]
    for name in DEMO[page]:
        rows = re.findall(rf"^\| {re.escape(name)} \| [^|]+ \| 2 \| ([\d.]+) \|", FRONT, re.M)
        assert rows, f"no demo row for {name}"
        for value in map(float, rows):
            assert minimum <= value and lo - 5e-4 <= value <= hi + 5e-4, f"{name}: {value} outside {lo}-{hi}"


def test_the_rule_catches_a_number_outside_its_range():
    table = "| 1 | [DDP/](DDP/README.md): x | `run` | `test accuracy` >= 0.90; 0.936-0.945 |"
    (m,) = ROW.finditer(table)
    assert not float(m["lo"]) <= 0.933 <= float(m["hi"])
