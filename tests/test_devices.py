"""Devices, backends and multi-node launches.

- The device and backend choice: `--device auto` takes xpu (Intel GPUs, Aurora), then cuda, then cpu, pinned by
  local rank; `--backend auto` maps xpu -> xccl, cuda -> nccl, cpu -> gloo. The selection logic runs here against
  a torch whose `xpu`/`cuda` modules claim devices (no GPU exists on these machines); every impossible choice is
  refused by each lesson in one `error:` line and a non-zero exit, no traceback; under a real launcher, on every rank.
- Multi-node, rehearsed on one machine: two torchrun launchers with --nnodes 2 and a c10d rendezvous on loopback
  (or one Hydra launch over two host entries), so local ranks restart on each "node" while global ranks do not;
  the result equals the same world on one node (which it could not if shards were cut by local rank).
"""
import sys
import types

import pytest
import torch

from support import (
    DDP,
    DS,
    HVD_TF,
    HVD_TORCH,
    PP,
    ROOT,
    TP,
    assert_each_rank_refused,
    error_lines,
    mpiexec,
    run,
    run_rows,
    warm,
)

sys.path.append(str(ROOT))
from course import dist as course
from tools import launch

SHORT = ["--epochs", "1", "--max-steps", "8", "--num-threads", "1"]


# --- the one check of --device and --backend, against a torch that claims devices ----------------------------
def fake_devices(monkeypatch, xpu=0, cuda=0):
    for kind, count in (("xpu", xpu), ("cuda", cuda)):
        monkeypatch.setattr(torch, kind, types.SimpleNamespace(is_available=lambda c=count: c > 0,
                                                               device_count=lambda c=count: c))
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: xpu > 0, raising=False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: cuda > 0, raising=False)


@pytest.mark.parametrize("requested, device, words", [
    ("nccl", "xpu:0", "--backend nccl connects cuda devices"),
    ("xccl", "cuda:0", "--backend xccl connects xpu devices"),
    ("gloo", "xpu:0", "--backend gloo cannot move xpu tensors"),
    ("nccl", "cpu", "--backend nccl connects cuda devices, not cpu"),
])
def test_a_backend_that_cannot_reach_the_device_is_one_line(monkeypatch, requested, device, words):
    """course/dist.py's backend_problem, the one rule course/checks.py's parse() applies to --backend."""
    fake_devices(monkeypatch, xpu=12, cuda=4)
    assert words in course.backend_problem(requested, device)
    assert course.backend_problem("auto", device) is None


def test_xccl_missing_from_the_torch_build_is_one_line(monkeypatch):
    fake_devices(monkeypatch, xpu=12)
    monkeypatch.setattr(torch.distributed, "is_xccl_available", lambda: False, raising=False)
    assert "this torch build has no xccl backend" in course.backend_problem("xccl", "xpu:0")


def test_a_device_torch_cannot_see_is_one_line(monkeypatch):
    fake_devices(monkeypatch, xpu=0, cuda=4)
    assert "--device xpu: this torch" in course.device_problem("xpu")
    assert course.device_problem("cuda") is None and course.device_problem("cpu") is None


# --- impossible choices, for real: every rank says one line and the job ends ------------------------------
# What is impossible depends on the machine: a device kind counts only where torch sees none of it. The
# pairings that argparse refuses (a GPU backend with --device cpu) are impossible everywhere, so every list
# below keeps cases on any machine, GPU nodes included.
MISSING = {kind for kind in ("xpu", "cuda") if not getattr(torch, kind).is_available()}
NEEDS = {"xpu": "xpu", "cuda": "cuda", "xccl": "xpu", "nccl": "cuda"}  # a --device or --backend value -> kind


def impossible_here(cases):
    """The cases whose flags ask for a device kind this machine lacks, or pair a GPU backend with --device cpu."""
    def impossible(flags):
        return "cpu" in flags or any(NEEDS.get(value) in MISSING for value in flags)
    return [case for case in cases if impossible(case[-2])]


IMPOSSIBLE = impossible_here([(["--device", "xpu"], "--device xpu"), (["--device", "cuda"], "--device cuda"),
                              (["--backend", "xccl"], "--backend xccl"), (["--backend", "nccl"], "--backend nccl"),
                              (["--device", "cpu", "--backend", "nccl"], "--backend nccl")])


def test_an_impossible_device_ends_every_rank_with_one_line(tmp_path):
    flags, words = IMPOSSIBLE[0]
    result = run(mpiexec(2, DDP, *SHORT, *flags, "--log-dir", tmp_path / "log"), timeout=120)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all(words in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "log" / "summary.json").exists()


# Every other impossible choice, lesson by lesson: the lesson's rows in one interpreter (support.run_rows). Each
# refusal comes before any rendezvous, on every rank alike (what the test above and
# tests/test_failures_bad_paths_and_values.py's launch of every lesson show, one case each).
REFUSALS = [(DDP, flags, words) for flags, words in IMPOSSIBLE[1:]] + impossible_here([
    (HVD_TORCH, ["--device", "xpu"], "--device xpu"), (DS, ["--device", "xpu"], "--device xpu"),
    (TP, ["--device", "cuda"], "--device cuda"), (PP, ["--backend", "xccl"], "--backend xccl"),
    (HVD_TF, ["--device", "cuda"], "TensorFlow sees no GPU"),
    (DS, ["--device", "cpu", "--backend", "xccl"], "--backend xccl"),
]) + [(HVD_TF, ["--device", "xpu"], "on Intel GPUs (Aurora) use DDP/main.py")]  # TensorFlow: never xpu
# TensorFlow's refusals come after hvd.init(), from the device TensorFlow sees: each a run of 2 ranks of its own
# (warm, as horovodrun's: a claim about the refusal, not a launcher).
BY_SCRIPT = {script: [(f, w) for s, f, w in REFUSALS if s == script] for script, _, _ in REFUSALS if script != HVD_TF}
TF_REFUSALS = [(f, w) for s, f, w in REFUSALS if s == HVD_TF]


@pytest.mark.parametrize("flags, words", TF_REFUSALS, ids=[" ".join(f) for f, _ in TF_REFUSALS])
def test_tensorflow_refuses_a_missing_device_on_every_rank(tmp_path, flags, words):
    result = run(warm(2, HVD_TF, *SHORT, *flags, "--log-dir", tmp_path / "log", launcher="horovodrun"), timeout=180)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all(words in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script", BY_SCRIPT)
def test_every_pytorch_example_refuses_a_missing_device(tmp_path, script):
    table = BY_SCRIPT[script]
    outcomes = run_rows(script, [[*SHORT, *flags, "--log-dir", str(tmp_path / f"log{i}")]
                                 for i, (flags, _) in enumerate(table)])
    for i, ((flags, words), outcome) in enumerate(zip(table, outcomes)):
        errors = error_lines(outcome["stderr"])
        assert outcome["code"] not in (0, None, "finished"), (flags, outcome)
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"][-3000:])
        assert "Traceback" not in outcome["stderr"], (flags, outcome["stderr"][-3000:])
        assert not (tmp_path / f"log{i}" / "summary.json").exists()


def test_horovod_built_without_pytorch_is_one_line_that_names_ddp(tmp_path):
    # Aurora's frameworks module has Horovod without its PyTorch extension: `import horovod.torch` then
    # raises Horovod's own "Extension horovod.torch has not been built" ImportError, reproduced here.
    package = tmp_path / "horovod" / "torch"
    package.mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "raise ImportError('Extension horovod.torch has not been built: mpi_lib_v2.so not found\\n'\n"
        "                  'If this is not expected, reinstall Horovod with HOROVOD_WITH_PYTORCH=1 to debug.')\n")
    result = run([sys.executable, ROOT / HVD_TORCH, *SHORT], env={"PYTHONPATH": str(tmp_path)}, timeout=120)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "without PyTorch support" in errors[0] and "DDP/main.py" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


# A framework older than the lessons need (an ALCF module can be: Polaris' conda/2024-04-29 has
# torch 2.3): one line naming the version found, on every rank, before any of the lesson runs. The
# old version is a distribution record put first on the path; the check reads only that.
@pytest.mark.parametrize("launch_with", ["python", "mpiexec", "torchrun"])
def test_a_torch_older_than_the_lessons_need_is_one_line_on_every_rank(tmp_path, launch_with):
    record = tmp_path / "old" / "torch-2.3.0.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.3.0\n")
    n = 1 if launch_with == "python" else 2
    cmd = launch.launch_command(DDP, n, launch_with, ["--log-dir", tmp_path / "run"])
    result = run(cmd, env={"PYTHONPATH": str(tmp_path / "old")}, timeout=120)
    assert_each_rank_refused(result, "this lesson needs torch >= 2.7 (torch.accelerator", n, launch_with)
    assert all("found 2.3.0" in line for line in error_lines(result.stderr))
    if launch_with != "torchrun":  # (torchrun adds its own report of the workers' exit)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
