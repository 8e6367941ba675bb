"""A lesson lifts out: copied into an empty folder with the few helper files it imports, and nothing else
of the course, it runs under torchrun and under mpiexec, and its helpers stay small.

The lessons listed in LIFTS_OUT import only arguments, logging and data from utils/ (utils/README.md);
every distributed step is torch's own call in the lesson file. The course's plumbing (one-line failures,
flag checks, noise filters, TensorBoard) comes in through one optional import, and a copy runs without it.
"""
import ast
import json
import re

import pytest
import torch

import support
from course.quiet import TF_IMPORT_NOISE
from support import (
    BIN,
    DDP,
    DS,
    GPT_SPLIT,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    PP,
    ROOT,
    TP,
    ZERO,
    check,
    run,
    warm,
    weights_digest,
    without_timing,
)
from tools.launch import launch_command
from tools.lift import OPTIONAL, chapter_modules, helpers_of, lift

# Each lesson that lifts out, and the launchers its copy is run under: under both it ends as the lesson's
# 2-rank run in the course under the first, digit for digit (mpiexec's run is the copy's alone).
LAUNCHED_BY = {ROOT / DDP: ("torchrun", "mpiexec"), ROOT / HVD_TORCH: ("horovodrun", "mpiexec"),
               ROOT / HVD_TF: ("horovodrun", "mpiexec"), ROOT / HVD_KERAS: ("horovodrun", "mpiexec"),
               ROOT / DS: ("torchrun", "mpiexec"), ROOT / TP: ("torchrun", "mpiexec"),
               ROOT / PP: ("torchrun", "mpiexec")}
# The flags of each lesson's 2-rank run in its own tests (support.QUICK): the course's run under the first launcher
# is that same run (conftest.py's shared_run), and the copy runs with the same flags.
QUICK = support.QUICK
FLAGS = {ROOT / DS: [*QUICK, "--zero-stage", "3"], ROOT / HVD_TF: [*QUICK, "--dropout", "0"], ROOT / TP: GPT_SPLIT,
         ROOT / PP: GPT_SPLIT}
SPLIT = {ROOT / TP, ROOT / PP}  # the model split: each rank holds other weights, and no checkpoint
# zero/: a few Adam steps and a JSON file, no epochs: each variant under both launchers (the first: also compared
# with the course's run), and FSDP2's sharded checkpoint saved at 2 ranks, loaded by one process.
ZERO_RUNS = [(ROOT / ZERO, "torchrun", "ds3"), (ROOT / ZERO, "mpiexec", "torch-fsdp2"),
             (ROOT / support.FSDP_CKPT, "torchrun", None), (ROOT / support.FSDP_CKPT, "mpiexec", None)]
CHAPTER = [ROOT / "transformer" / f"{name}.py" for name in ("ddp", "fsdp", "tp", "cp", "ep", "pp")]
LIFTS_OUT = list(dict.fromkeys([*LAUNCHED_BY, ROOT / ZERO, ROOT / support.FSDP_CKPT, *CHAPTER]))
RUNS = [(lesson, launcher) for lesson, launchers in LAUNCHED_BY.items() for launcher in launchers]
HELPER_LINES = 440  # the helpers a lifted lesson takes along, all together (399 before log.py's extension points)


@pytest.mark.parametrize("lesson", LIFTS_OUT, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_helpers_a_lesson_takes_along_are_few_and_small(lesson):
    helpers = helpers_of(lesson)
    names = [p.name for p in helpers]
    assert f"{OPTIONAL}.py" not in names, names
    assert set(names) <= {"__init__.py", "parse_args.py", "log.py", "data.py"}, names  # arguments, logging, data
    lines = sum(len(p.read_text().splitlines()) for p in helpers)
    assert lines <= HELPER_LINES, f"{lesson.name} takes {names} along: {lines} lines (at most {HELPER_LINES})"


@pytest.mark.parametrize("page", ["DDP/README.md", "deepspeed/README.md", "utils/README.md"])
def test_the_helpers_line_count_a_page_quotes_is_the_files(page):
    """The pages say how many lines a copy takes along: the count of the files themselves, not a typed number."""
    helpers = helpers_of(ROOT / DS) if page.startswith("deepspeed") else helpers_of(ROOT / DDP)
    lines = sum(len(p.read_text().splitlines()) for p in helpers)
    quoted = re.findall(r"(\d+) lines\s+together", (ROOT / page).read_text())
    assert quoted == [str(lines)], f"{page} quotes {quoted}; the helpers have {lines} lines"


@pytest.mark.parametrize("lesson", [ROOT / "transformer" / f"{name}.py" for name in ("ddp", "fsdp", "tp", "cp",
                                                                                     "ep", "pp")],
                         ids=lambda p: p.name)
def test_the_lines_a_chapter_copy_takes_along_are_the_files(lesson):
    """transformer/README.md's count of what a copy of a chapter lesson takes along (its four modules and the
    helpers), the same for each of the six lessons: the files' own count today."""
    counted = sum(len(p.read_text().splitlines()) for p in chapter_modules(lesson) + helpers_of(lesson))
    quoted = re.findall(r"takes (\d+) lines along", (ROOT / "transformer" / "README.md").read_text().replace("\n", " "))
    assert quoted == [str(counted)], f"transformer/README.md quotes {quoted}; {lesson.name} takes {counted} lines"


@pytest.fixture(scope="module")
def lifted(tmp_path_factory):
    """Each lesson copied alone as main.py (with the JSON files of its folder: DeepSpeed's config),
    beside a utils/ holding only its helpers."""
    copies = {}
    for lesson in LIFTS_OUT:
        copies[lesson] = lift(lesson, tmp_path_factory.mktemp(lesson.parent.name.lower())).parent
    return copies


@pytest.mark.parametrize("lesson,launcher", RUNS, ids=[f"{p.relative_to(ROOT).with_suffix('')}-{n}" for p, n in RUNS])
def test_a_copy_of_the_lesson_runs_alone_under_each_launcher(lifted, shared_run, lesson, launcher, tmp_path):
    folder, flags = lifted[lesson], FLAGS.get(lesson, QUICK)
    # cwd: the copy, far from the repository (whose utils/ it must not reach)
    check(run(launch_command(folder / "main.py", 2, launcher, [*flags, "--log-dir", tmp_path / "run"]), timeout=240,
              cwd=folder))
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2] and history[1]["train_loss"] < history[0]["train_loss"]
    assert all(m["world_size"] == 2 and m["launcher"] == launcher for m in history), history

    def checksums_of(run_dir):  # every rank's weights (the model split: the whole model, gathered)
        if lesson in SPLIT:
            return [weights_digest(run_dir)] * 2
        return json.loads((run_dir / "summary.json").read_text())["param_checksums"]
    checksums = checksums_of(tmp_path / "run")
    assert len(checksums) == 2 and checksums[0] == checksums[1], checksums  # both ranks, the same weights
    if lesson not in SPLIT | {ROOT / HVD_KERAS}:  # (model.fit's lesson writes none)
        assert list((tmp_path / "run" / "checkpoints").iterdir())  # checkpoint.pt, or TensorFlow's ckpt-2.*
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))  # no TensorBoard: plumbing stayed home
    # the same training as the lesson in the course, digit for digit, whichever launcher started the ranks
    course_dir, _ = shared_run(lesson, LAUNCHED_BY[lesson][0], flags)
    course = [json.loads(line) for line in (course_dir / "metrics.jsonl").read_text().splitlines()]
    assert without_timing(history, "launcher") == without_timing(course, "launcher")
    assert checksums_of(course_dir) == checksums


@pytest.mark.parametrize("lesson,launcher,variant", ZERO_RUNS,
                         ids=[f"{p.relative_to(ROOT).with_suffix('')}-{n}" for p, n, _ in ZERO_RUNS])
def test_a_copy_of_a_zero_script_runs_alone(lifted, lesson, launcher, variant, tmp_path):
    folder, out = lifted[lesson], tmp_path / "run.json"
    if variant:  # zero/main.py: one variant, a few steps of a small MLP
        flags = ["--variant", variant, "--hidden", "64", "--layers", "1", "--steps", "3", "--json", str(out)]
    else:  # zero/fsdp_checkpoint.py: saves at 2 ranks ...
        flags = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--hidden", "64", "--json", str(out)]
    check(run(launch_command(folder / "main.py", 2, launcher, flags), timeout=240, cwd=folder))
    result = json.loads(out.read_text())
    if variant:
        assert len(result["losses"]) == 3 and [r["rank"] for r in result["per_rank"]] == [0, 1], result
        if launcher == "torchrun":  # the same steps as the lesson in the course, digit for digit
            check(run(warm(2, lesson, *flags[:-1], tmp_path / "course.json"), timeout=240))  # (warm: the reference)
            assert json.loads((tmp_path / "course.json").read_text())["losses"] == result["losses"]
    else:  # ... and one process of the copy goes on from the shards both ranks wrote
        check(run([str(BIN / "python"), "main.py", *flags[:-1], str(tmp_path / "resumed.json"), "--resume"],
                  timeout=240, cwd=folder))
        resumed = json.loads((tmp_path / "resumed.json").read_text())
        assert resumed["written_by"] == 2 and resumed["loaded_checksum"] == result["saved_checksum"], resumed


def test_a_copy_of_the_transformer_lesson_runs_alone(lifted, shared_run, tmp_path):
    """The chapter's lesson with its two modules (the model; the text and flags) beside it: the same training
    as the course's 2-rank run under torchrun, digit for digit."""
    lesson = ROOT / support.GPT_DDP
    check(run(launch_command(lifted[lesson] / "main.py", 2, "torchrun",
                             [*support.GPT_QUICK, "--log-dir", tmp_path / "run"]), timeout=240, cwd=lifted[lesson]))
    course_dir, _ = shared_run(lesson, "torchrun", support.GPT_QUICK)
    copy = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    course = [json.loads(line) for line in (course_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(copy) == 2 and without_timing(copy) == without_timing(course)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["param_checksums"] == json.loads(
        (course_dir / "summary.json").read_text())["param_checksums"]


def test_a_copy_of_the_fsdp2_lesson_saves_its_sharded_checkpoints_and_trains_as_ddp(lifted, shared_run, tmp_path):
    """transformer/fsdp.py copied alone, under mpiexec: each epoch's DCP checkpoint saved in the background
    (the last one left, a file per rank), and the same training as the course's DDP lesson on the same global
    batch, to fp32 reduction order (FSDP2 reduce-scatters where DDP all-reduces)."""
    lesson = ROOT / "transformer" / "fsdp.py"
    check(run(launch_command(lifted[lesson] / "main.py", 2, "mpiexec",
                             [*support.GPT_QUICK, "--log-dir", tmp_path / "run"]), timeout=240, cwd=lifted[lesson]))
    saved = tmp_path / "run" / "checkpoints"
    assert (saved / "latest").read_text() == "epoch2" and len(list((saved / "epoch2").glob("*.distcp"))) == 2
    assert not (saved / "epoch1").exists()
    course_dir, _ = shared_run(ROOT / support.GPT_DDP, "torchrun", support.GPT_QUICK)
    copy = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    course = [json.loads(line) for line in (course_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in copy] == [1, 2] and all(m["launcher"] == "mpiexec" for m in copy), copy
    for a, b in zip(copy, course, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5), (a, b)
    ddp, fsdp = (torch.load(d / "model.pt", weights_only=True) for d in (course_dir, tmp_path / "run"))
    for key in ddp:
        torch.testing.assert_close(fsdp[key], ddp[key], rtol=0, atol=2e-5, msg=key)


@pytest.mark.parametrize("lesson", LIFTS_OUT, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_copy_refuses_a_bad_flag_in_one_line(lifted, lesson):
    """The lesson's one line; TensorFlow's own start-up lines may come before it (on a CPU where oneDNN's custom
    operations are on, TensorFlow 2.21 writes that from C++ whatever TF_CPP_MIN_LOG_LEVEL says), which only the
    course's plumbing filters."""
    result = run(warm(1, lifted[lesson] / "main.py", "--batch-size", "0"), timeout=120, cwd=lifted[lesson])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not re.search(TF_IMPORT_NOISE, line)]
    assert lines == [
        "main.py: error: argument --batch-size: must be a positive integer, got 0 (see main.py --help)"]


@pytest.mark.parametrize("lesson", [ROOT / DS, ROOT / ZERO, ROOT / support.FSDP_CKPT, *CHAPTER],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_torch_lesson_reads_the_launchers_as_the_ddp_lesson_does(lesson):
    """[1] is written out in every torch lesson (each lifts out alone): the same table, the same reading."""
    def step_1(path):
        tree = ast.parse(path.read_text())
        return [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Assign, ast.FunctionDef))
                and getattr(node, "name", None) == "who_am_i" or isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "LAUNCHERS" for t in node.targets)]
    assert len(step_1(ROOT / DDP)) == 2 and step_1(lesson) == step_1(ROOT / DDP)


# Every lesson whose ranks join a torch.distributed group (gloo's threads) ends in the same lines; the Horovod lessons
# end in hvd.shutdown() and the interpreter's own teardown.
TORCH_LESSONS = [ROOT / DDP, ROOT / DS, ROOT / ZERO, ROOT / support.FSDP_CKPT, *CHAPTER,
                 ROOT / "diagnose" / "overlap.py", ROOT / "diagnose" / "collectives.py"]


def ending(path):
    """The statements of the lesson's `if __name__ == "__main__":` block after main() has run: from the first
    `sys.stdout.flush()` on."""
    tree = ast.parse(path.read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    start = [i for i, node in enumerate(block.body) if ast.unparse(node) == "sys.stdout.flush()"]
    return block.body[start[0]:] if start else []


@pytest.mark.parametrize("lesson", TORCH_LESSONS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_torch_lesson_ends_itself_without_the_interpreters_teardown(lesson):
    """After main() (through the plumbing, or alone in a copy): MPI finalized where mpi4py started it, the output
    flushed, exit 0, with nothing after it; torch's holders keep gloo's threads alive past destroy_process_group(),
    and the teardown can abort a finished rank (tools/PERFORMANCE.md, "The same abort in a lifted copy")."""
    lines = [ast.unparse(node) for node in ending(lesson)]
    assert lines and lines[-1] == "os._exit(0)", lines
    assert lines == [ast.unparse(node) for node in ending(ROOT / DDP)], lesson  # one ending, the same everywhere
    text = lesson.read_text()
    assert "pytorch/pytorch#179291" in text and "destroy_process_group()" in text  # says why


@pytest.mark.parametrize("lesson", [ROOT / HVD_TORCH, ROOT / HVD_TF, ROOT / HVD_KERAS],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_horovod_lesson_shuts_horovod_down_and_ends_as_python_does(lesson):
    tree = ast.parse(lesson.read_text())
    (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert ast.unparse(main.body[-1]) == "hvd.shutdown()"
    assert not ending(lesson) and "os._exit" not in lesson.read_text()


def test_the_lessons_ending_finalizes_mpi_under_mpiexec(tmp_path):
    """The lesson's own ending lines, run by 2 ranks under mpiexec that started MPI through mpi4py (as a rank
    discovering its master address does): each rank's summary, still in Python's buffer (no PYTHONUNBUFFERED, as
    in a copy), reaches the terminal, and MPI_Finalize runs before os._exit. MPICH's mpiexec may end a rank
    that is past MPI_Finalize once another has exited (here 1 run in 5, 2026-12-02): the summary was once
    flushed after MPI_Finalize, and one rank's line was lost."""
    code = "\n".join(ast.unparse(node) for node in ending(ROOT / DDP))
    probe = tmp_path / "probe.py"
    probe.write_text(f"""import os, sys, types
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()
print(f"rank {{rank}}: the summary")  # buffered: stdout is a pipe


def finalize():  # MPI.Finalize, leaving word first (mpiexec may end the rank once it has returned)
    with open(os.path.join({str(tmp_path)!r}, f"finalized.{{rank}}"), "w") as f:
        f.write("MPI_Finalize called")
    MPI.Finalize()


mpi = types.SimpleNamespace(Is_initialized=MPI.Is_initialized, Is_finalized=MPI.Is_finalized, Finalize=finalize)
exits = types.SimpleNamespace(_exit=lambda code: os._exit(code if MPI.Is_finalized() else 3))
exec({code!r}, {{"sys": types.SimpleNamespace(modules={{"mpi4py.MPI": mpi}}, stdout=sys.stdout,
                                             stderr=sys.stderr), "os": exits}})
os._exit(4)  # the ending did not end the process
""")
    for attempt in range(5):  # a lost line is a race: give it several chances to show
        result = run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "python"), str(probe)], timeout=120,
                     env={"PYTHONUNBUFFERED": ""})
        assert result.returncode == 0, result.stdout + result.stderr  # 3: os._exit before MPI_Finalize
        assert sorted(result.stdout.splitlines()) == ["rank 0: the summary", "rank 1: the summary"], result
        for rank in (0, 1):
            assert (tmp_path / f"finalized.{rank}").read_text() == "MPI_Finalize called"
            (tmp_path / f"finalized.{rank}").unlink()


def test_the_plumbing_returns_to_the_lesson_after_a_finished_run():
    """failures.run_main runs the exit handlers and returns, so that the course's own runs end in the lesson's
    lines, as a copy does (it used to leave through os._exit itself, and the lesson's ending never ran)."""
    code = ("import atexit, sys; from course import failures; atexit.register(print, 'exit handler'); "
            "failures.run_main(lambda: print('main')); print('back in the lesson'); sys.stdout.flush()")
    result = run([str(BIN / "python"), "-c", code], timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["main", "exit handler", "back in the lesson"], result.stdout


@pytest.mark.parametrize("note, lesson", [("DDP/README.md", ROOT / DDP), ("deepspeed/README.md", ROOT / DS),
                                          ("utils/README.md", ROOT / DDP)])
def test_the_helpers_line_count_a_note_quotes_is_counted(note, lesson):
    """The lines a copy takes along, as the note says them, are the files' own count today."""
    counted = sum(len(p.read_text().splitlines()) for p in helpers_of(lesson))
    quoted = [int(n) for n in re.findall(r"(\d+) lines", (ROOT / note).read_text().replace("\n", " "))]
    assert counted in quoted, f"{note} quotes {quoted}; the helpers {lesson.name} takes along are {counted} lines"
