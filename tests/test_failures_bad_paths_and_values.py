"""Bad input on every path, in every lesson and under every launcher: an unusable path flag, a float
that is not finite or a backend this process cannot use is one `error:` line per rank naming the
flag, exit 2, before anything starts, and nothing is created; a thread count above the cores is one
warning line."""

import os
import re

import pytest

from support import (
    DDP,
    DS,
    FSDP_CKPT,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    PP,
    ROOT,
    TP,
    ZERO,
    assert_each_rank_refused,
    deepspeed_launcher,
    error_lines,
    horovodrun,
    mpiexec,
    run,
    run_rows,
    torchrun,
)

TORCH_DISTRIBUTED = [DDP, DS, TP, PP]  # --backend: torch.distributed's (Horovod picks its own, and has no flag)
COMMON = TORCH_DISTRIBUTED + [HVD_TORCH, HVD_TF, HVD_KERAS]  # the lessons on utils/parse_args.py's shared flags
NOT_A_FOLDER = "/dev/null/x"  # below a file: nothing can be created there, even by root
NO_WRITE = "/proc/x"  # /proc takes no new entries, even from root (chmod does not stop root)

# (flags, words the one error line must contain); {new} is a path below a folder that does not exist
# yet,
# {file} an existing file. The run must not create {new}'s folder.
COMMON_ROWS = [
    (["--log-dir", NO_WRITE], "--log-dir /proc/x: cannot write in /proc"),
    (["--log-dir", "{file}"], "is not a folder"),
    (
        ["--checkpoint-dir", NOT_A_FOLDER, "--log-dir", "{new}"],
        "--checkpoint-dir /dev/null/x: /dev/null is not a folder",
    ),
    (["--log-dir", "{new}", "--checkpoint-dir", NO_WRITE], "--checkpoint-dir /proc/x"),
    (["--data-dir", "{new}"], "--data-dir"),
    (["--data-dir", NO_WRITE, "--download"], "--data-dir /proc/x: cannot write in /proc"),
    (["--log-dir", "{new}", "--lr", "inf"], "--lr: must be a finite number > 0, got inf"),
    (["--log-dir", "{new}", "--momentum", "nan"], "--momentum"),
]
# torch.distributed's backends: refused in one process too (no process group is needed to know)
TORCH_ROWS = [
    (["--log-dir", "{new}", "--backend", "nccl"], "--backend nccl"),
    (["--log-dir", "{new}", "--backend", "mpi"], "--backend mpi: this torch"),
]
OWN_ROWS = {  # the flags of the lessons' own parsers
    ZERO: [
        (["--json", "/proc/x/out.json"], "--json /proc/x/out.json"),
        (["--json", "{dir}"], "is a folder"),
        (["--lr", "inf"], "--lr"),
        (["--json", "{new}/out.json", "--lr", "-inf"], "--lr"),
    ],
    FSDP_CKPT: [
        (["--checkpoint-dir", NO_WRITE], "--checkpoint-dir /proc/x: cannot write in /proc"),
        (["--checkpoint-dir", "{file}"], "is not a folder"),
        (["--checkpoint-dir", "{new}", "--resume"], "--resume: no checkpoint in"),
        (["--checkpoint-dir", "{new}", "--json", "{dir}"], "is a folder"),
        (["--checkpoint-dir", "{new}", "--lr", "nan"], "--lr"),
    ],
    DS: [
        (["--deepspeed_config", "{new}/ds.json"], "--deepspeed_config"),
        (["--log-dir", "{new}", "--lr", "1e999"], "--lr"),
    ],
    HVD_TORCH: [
        (
            ["--log-dir", "{new}", "--gradient-predivide-factor", "inf"],
            "--gradient-predivide-factor",
        ),
        (["--log-dir", "{new}", "--clip-grad-norm", "inf"], "--clip-grad-norm"),
    ],
    HVD_TF: [
        (
            ["--log-dir", "{new}", "--gradient-predivide-factor", "nan"],
            "--gradient-predivide-factor",
        )
    ],
}


def rows_for(script):
    if script in (ZERO, FSDP_CKPT):
        return OWN_ROWS[script]
    rows = COMMON_ROWS + (TORCH_ROWS if script in TORCH_DISTRIBUTED else []) + OWN_ROWS.get(script, [])
    if script in (TP, PP):  # they keep no checkpoints: the flag itself is refused, before its path is looked at
        rows = [(flags, "keeps no checkpoints" if "--checkpoint-dir" in flags else words) for flags, words in rows]
    return rows


# One process per lesson runs its whole table: it executes the lesson's __main__ once per row and
# keeps what
# that row printed on stderr and its exit code (all refusals come before anything starts).


@pytest.mark.parametrize("script", [DDP, HVD_TORCH, HVD_TF, HVD_KERAS, DS, ZERO, FSDP_CKPT, TP, PP])
def test_every_unusable_path_and_non_finite_float_is_one_line_exit_2_and_creates_nothing(
    tmp_path, script
):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    names = dict(
        new=str(tmp_path / "new" / "run"),
        file=str(tmp_path / "a-file"),
        dir=str(tmp_path / "a-dir"),
    )
    table = rows_for(script)
    rows = [[flag.format(**names) for flag in flags] for flags, _ in table]
    for (flags, words), outcome in zip(table, run_rows(script, rows)):
        errors = error_lines(outcome["stderr"])
        assert outcome["code"] == 2, (script, flags, outcome)
        assert len(errors) == 1 and words in errors[0], (script, flags, outcome["stderr"])
        assert "Traceback" not in outcome["stderr"], (script, flags, outcome["stderr"])
        print(f"\n[{script} {' '.join(flags)}] {errors[0]}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"], (
        "a refused run created something"
    )
    assert not any((tmp_path / "a-dir").iterdir())


LAUNCHES = [
    pytest.param(DDP, torchrun, id="ddp-torchrun"),
    pytest.param(DDP, mpiexec, id="ddp-mpiexec"),
    pytest.param(HVD_TORCH, horovodrun, id="hvd-torch-horovodrun"),
    pytest.param(HVD_TF, mpiexec, id="hvd-tf-mpiexec"),
    pytest.param(HVD_KERAS, horovodrun, id="keras-horovodrun"),
    pytest.param(DS, deepspeed_launcher, id="deepspeed-deepspeed"),
    pytest.param(ZERO, torchrun, id="zero-torchrun"),
    pytest.param(TP, mpiexec, id="tp-mpiexec"),
    pytest.param(PP, torchrun, id="pp-torchrun"),
]


@pytest.mark.parametrize("script,launcher", LAUNCHES)
def test_an_unusable_path_is_one_line_per_rank_under_every_launcher(tmp_path, script, launcher):
    flags = (
        ["--json", "/proc/x/out.json"]
        if script == ZERO
        else ["--log-dir", str(tmp_path / "new" / "run"), "--checkpoint-dir", NOT_A_FOLDER]
    )
    result = run(launcher(2, script, *flags), timeout=240)
    output = result.stdout + result.stderr
    assert_each_rank_refused(result, flags[-2], 2, launcher)  # each launcher's way with the others
    assert not re.search(
        rf'File "{re.escape(str(ROOT))}/(DDP|horovod|deepspeed|zero|transformer)/', output
    ), output[
        -3000:
    ]  # (the launchers' own tracebacks are theirs: horovodrun raises one when a rank fails)
    assert list(tmp_path.iterdir()) == []
    if launcher is torchrun:  # the line is torchrun's root cause, not `error_file: <N/A>`
        root_cause = output[output.index("Root Cause") :]
        assert "error_file: <N/A>" not in root_cause and flags[-2] in root_cause, root_cause


def test_more_threads_than_cores_is_one_warning_for_the_node(tmp_path, tiny):
    cores = len(os.sched_getaffinity(0))
    result = run(
        mpiexec(
            2,
            DDP,
            "--num-threads",
            cores + 1,
            "--epochs",
            "1",
            "--max-steps",
            "1",
            "--data-dir",
            tiny,
            "--log-dir",
            tmp_path / "log",
        ),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [
        line for line in result.stderr.splitlines() if line.startswith("warning: --num-threads")
    ]
    assert len(warnings) == 1 and f"more than the {cores} core(s)" in warnings[0], result.stderr[
        -3000:
    ]
