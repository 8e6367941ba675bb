"""Quiet by default (course/quiet.py): the library lines that teach nothing are gone from the examples' output,
every other warning stays, COURSE_VERBOSE=1 brings them all back; and the tools write nothing tracked unless
asked (figures.py's PNGs go to runs/figures/ unless `--out assets`)."""
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from course.ranks import free_port
from support import BIN, DS, HVD_TF, HVD_TORCH, ROOT, check, horovodrun, python, run, torchrun

VERBOSE = {"COURSE_VERBOSE": "1"}
# A shell without the Makefile's variables, as an attendee's after `source .venv/bin/activate`.
BARE_SHELL = {"TF_CPP_MIN_LOG_LEVEL": "", "PYTHONUNBUFFERED": ""}
ACCELERATOR_NOTE = "Setting accelerator to CPU"
RANK_LINE = re.compile(r"^\[(\d+)\]")  # horovodrun's prefix on what a rank prints: `[1] ` (MPI), `[1]<stderr>:` (gloo)
TF_BANNER = re.compile(r"cpu_feature_guard|This TensorFlow binary is optimized|oneDNN custom operations"
                       r"|absl::InitializeLog")


def lines(result):
    return (result.stdout + result.stderr).splitlines()


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_zero3_under_torchrun_prints_few_lines_and_verbose_brings_the_noise_back(tmp_path):
    """The issue's run: 2 ranks of ZeRO-3 under torchrun printed 533 lines, 248 of them torch's FutureWarnings
    about the collectives DeepSpeed calls. Quiet: 22 lines here for 20 steps (4 of them torchrun's own)."""
    args = ("--zero-stage", "3", "--epochs", "1", "--max-steps", "20", "--num-threads", "1")
    quiet = check(run(torchrun(2, DS, *args, "--log-dir", tmp_path / "quiet"), timeout=240))
    out = lines(quiet)
    assert len(out) < 30, "\n".join(out)
    assert not [line for line in out if "FutureWarning" in line or ACCELERATOR_NOTE in line], "\n".join(out)
    assert any(line.startswith("epoch  1  train_loss") for line in out)  # the lesson's own lines are all there

    loud = check(run(torchrun(2, DS, *args, "--log-dir", tmp_path / "verbose"), env=VERBOSE,
                     timeout=240))
    if not torch.cuda.is_available():  # DeepSpeed's note of a machine without GPUs, once per rank
        assert sum(ACCELERATOR_NOTE in line for line in lines(loud)) == 2, loud.stdout[-3000:]
    assert len(lines(loud)) > len(out)


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_tensorflow_under_horovodrun_prints_no_banner_per_rank(tmp_path):
    """`horovodrun -np 2 python horovod/tensorflow/main.py` from a bare shell: no rank prints TensorFlow's
    CPU-feature, oneDNN or absl lines (the lines horovodrun prints itself, unprefixed, are Horovod's)."""
    args = ("--epochs", "1", "--max-steps", "5", "--num-threads", "1")
    quiet = check(run(horovodrun(2, HVD_TF, *args, "--log-dir", tmp_path / "quiet"),
                      env=BARE_SHELL, timeout=300))
    banners = [line for line in lines(quiet) if RANK_LINE.match(line) and TF_BANNER.search(line)]
    assert not banners, "\n".join(banners)
    assert any("test accuracy" in line for line in lines(quiet))

    loud = check(run(horovodrun(2, HVD_TF, *args, "--log-dir", tmp_path / "verbose"),
                     env=dict(BARE_SHELL, **VERBOSE), timeout=300))
    ranks = {RANK_LINE.match(line)[1] for line in lines(loud) if RANK_LINE.match(line) and TF_BANNER.search(line)}
    assert ranks == {"0", "1"}, loud.stderr[-3000:]


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_horovodrun_mpi_keeps_lines_whole(tmp_path):
    """With PYTHONUNBUFFERED=1 (the Makefile's) print() wrote its text and newline apart and MPICH's `mpiexec -l`
    cut most progress lines in two (`[0] epoch 1 step 2/60 loss 2.3213[0] `); line-buffered output keeps them
    whole."""
    result = check(run(horovodrun(2, HVD_TORCH, "--epochs", "1", "--max-steps", "60",
                                  "--log-interval", "1", "--num-threads", "1", "--log-dir", tmp_path,
                                  controller="--mpi"), env={"PYTHONUNBUFFERED": "1"}, timeout=240))
    progress = [line for line in lines(result) if " step " in line]
    assert len(progress) >= 60, result.stdout[-3000:]
    cut = [line for line in lines(result) if re.search(r".\[\d+\] ", line)]
    assert not cut, "\n".join(cut[:10])


UNIT = """
import logging, os, sys, warnings
sys.path.append(os.getcwd())
from course import plumbing
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
x = torch.ones(2)
dist.all_gather_into_tensor(torch.zeros(2), x)
dist.reduce_scatter_tensor(torch.zeros(2), x)
warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning)
from deepspeed.accelerator import get_accelerator
get_accelerator()
logging.getLogger("DeepSpeed").warning("a DeepSpeed warning of its own")
logging.getLogger("torch.distributed.tensor._redistribute").warning(  # as torch words it (tp.py --dp 2)
    "While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate()), 2 "
    "sequential all_gather operations will be performed. This is suboptimal")
logging.getLogger("torch.distributed.tensor._redistribute").warning("While redistributing from (Shard(0),) ...")
import torch.utils.cpp_extension  # with CUDA_HOME set and no GPU, torch notes it
"""


def test_filters_drop_only_their_lines(tmp_path):
    env = {"CUDA_HOME": str(tmp_path)}
    quiet = "\n".join(lines(check(run([sys.executable, "-c", UNIT, free_port()], env=env, timeout=120))))
    loud = "\n".join(lines(check(run([sys.executable, "-c", UNIT, free_port()], env=dict(env, **VERBOSE),
                                      timeout=120))))
    dropped = ["`torch.distributed.all_gather_into_tensor` is deprecated",
               "`torch.distributed.reduce_scatter_tensor` is deprecated", ACCELERATOR_NOTE,
               f"No CUDA runtime is found, using CUDA_HOME='{tmp_path}'", "2 sequential all_gather operations"]
    if torch.cuda.is_available():  # the two notes about a missing GPU are not printed where there is one
        dropped = [*dropped[:2], dropped[-1]]
    kept = ["FutureWarning: `torch.distributed.something_else` is deprecated", "a DeepSpeed warning of its own",
            "While redistributing from (Shard(0),)"]
    for text in dropped:
        assert text not in quiet and text in loud, (text, quiet, loud)
    for text in kept:
        assert text in quiet and text in loud, (text, quiet)


def test_doctor_explains_the_cpu_fallback_and_reports_intel_gpus():
    """`make doctor` printed DeepSpeed's "Setting accelerator to CPU" warning unexplained, and TensorFlow's
    banners; now its table says what the fallback means, plus two information rows for Intel GPUs."""
    result = check(run(python("tools/doctor.py"), env=BARE_SHELL, timeout=180))
    out = lines(result)
    assert not [line for line in out if ACCELERATOR_NOTE in line or TF_BANNER.search(line)], "\n".join(out)
    rows = {line.split("│")[1].strip(): line for line in out if line.count("│") >= 3}
    assert re.search(r"torch\.xpu available (True|False); Intel GPU devices: \d+|not in this torch build",
                     rows["Intel GPU"]), rows
    assert re.search(r"xccl backend available (True|False)|not in this torch build", rows["xccl"]), rows
    # the network row: what this host's name resolves to, and on which interface (diagnose/hangs.md)
    host = socket.gethostname()
    assert re.search(rf"{re.escape(host)} resolves to ({re.escape(socket.gethostbyname(host))}) \(",
                     rows["network"]), rows
    if not torch.cuda.is_available():
        assert "accelerator cpu (no GPU seen: DeepSpeed's CPU fallback" in rows["DeepSpeed"], rows


def test_the_stderr_filter_keeps_what_a_dying_process_wrote():
    """TensorFlow's import runs with fd 2 through a filter process: if the importer dies (TensorFlow aborting on a
    CPU it was not built for), its last words still come out."""
    code = ("import os, sys; sys.path.append(os.getcwd()); from course.quiet import filtered_stderr\n"
            "with filtered_stderr('^noise'):\n"
            "    os.write(2, b'noise line\\nlast words\\n'); os.abort()")
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode != 0
    assert "last words" in result.stderr and "noise line" not in result.stderr, result.stderr


def test_figures_write_nothing_tracked_by_default():
    """`figures.py diagrams` draws into runs/figures/ (ignored by git); assets/ changes only with --out assets."""
    assets = {p: p.stat().st_mtime_ns for p in (ROOT / "assets").glob("*.png")}
    start = time.time()
    check(run(python("tools/figures.py", "diagrams"), timeout=120))
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "assets").glob("*.png")} == assets
    for name in ("diagram_parallelism.png", "diagram_allreduce.png"):
        assert (ROOT / "runs" / "figures" / name).stat().st_mtime >= start - 1
    ignored = subprocess.run(["git", "check-ignore", "-q", "runs/figures/diagram_allreduce.png"], cwd=ROOT)
    assert ignored.returncode in (0, 128)  # 128: not a git checkout (a tarball)
    make = shutil.which("make")
    if make:
        dry = subprocess.run([make, "-n", "figures", f"VENV={BIN.parent}"], cwd=ROOT, capture_output=True, text=True)
        assert "tools/figures.py" in dry.stdout and "--out" not in dry.stdout, dry.stdout
        asked = subprocess.run([make, "-n", "figures", "OUT=assets", f"VENV={BIN.parent}"], cwd=ROOT,
                               capture_output=True, text=True).stdout
        assert "tools/figures.py --out assets" in asked, asked
