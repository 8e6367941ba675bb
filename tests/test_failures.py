"""Failure behaviour of every example under every launcher (issue 8): dead ranks, interrupted runs, bad input,
determinism. Every test launches real processes, each with a timeout.

Faults are injected from outside the examples: SIGKILL of a rank found in the launcher's process tree, or
tests/hooks/faults.py, which tests/hooks/sitecustomize.py installs around utils/log.py at interpreter start-up
when a test sets COURSE_FAIL_AT / COURSE_DIE_IN_WRITE / COURSE_DIE_ON_FILE (conftest.run then puts tests/hooks on
PYTHONPATH). No lesson and nothing in utils/ knows about it.

Timing fields (epoch_time_s, train_time_s, samples_per_s) are wall-clock measurements: every comparison of
metrics histories below leaves them out, and compares everything else exactly.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from conftest import (
    BIN,
    ROOT,
    deepspeed_launcher,
    error_lines,
    horovodrun,
    launch_command,
    metrics,
    mpiexec,
    python,
    run,
    summary,
    torchrun,
)

sys.path.append(str(ROOT))
from utils import data

DDP, HVD_TORCH, HVD_TF, KERAS, DS = ("DDP/main.py", "horovod/pytorch/main.py", "horovod/tensorflow/main.py",
                                     "horovod/tensorflow/keras_main.py", "deepspeed/main.py")
SCRIPTS = [DDP, HVD_TORCH, HVD_TF, KERAS, DS]
RESUMABLE = [DDP, HVD_TORCH, HVD_TF, DS]  # keras_main.py (model.fit) has no --resume
TIMING = {"epoch_time_s", "train_time_s", "samples_per_s"}
KILL_DEADLINE_S = 60


def without_timing(history):
    return [{k: v for k, v in m.items() if k not in TIMING} for m in history]


# --- tiny MNIST sets in IDX format (real digits from the shipped set) -------------------------------------
def write_idx_set(folder, n_train, n_test):
    mnist = data.load_shipped()
    arrays = dict(x_train=mnist.x_train[:n_train], y_train=mnist.y_train[:n_train],
                  x_test=mnist.x_test[:n_test], y_test=mnist.y_test[:n_test])
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in data.IDX_FILES.items():
        a = arrays[key].astype(np.uint8)
        header = bytes([0, 0, 0x08, a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape)
        (folder / name).write_bytes(header + a.tobytes())
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """256 training / 64 test digits: 8 steps of 32 per epoch on one rank, 4 on two."""
    return write_idx_set(tmp_path_factory.mktemp("tiny"), 256, 64)


def assert_log_dir_sound(log_dir, before=None):
    """Nothing half-written: every JSON file parses, every metrics line parses, no temporary file is left;
    and every file that existed before (`before`: {name: bytes}) is unchanged."""
    for name, content in (before or {}).items():
        assert (log_dir / name).read_bytes() == content, f"{name} changed"
    if not log_dir.exists():
        return
    for path in log_dir.rglob("*"):
        assert not path.name.startswith(".tmp-"), f"left-over temporary file {path}"
        if path.suffix == ".json":
            json.loads(path.read_text())
        if path.name == "metrics.jsonl":
            [json.loads(line) for line in path.read_text().splitlines()]


# === a rank dies ==========================================================================================
KILL_LAUNCHES = [
    pytest.param(DDP, torchrun, id="ddp-torchrun"),
    pytest.param(DDP, mpiexec, id="ddp-mpiexec"),
    pytest.param(HVD_TORCH, horovodrun, id="hvd-torch-horovodrun-gloo"),
    pytest.param(HVD_TORCH, mpiexec, id="hvd-torch-mpiexec"),
    pytest.param(HVD_TF, horovodrun, id="hvd-tf-horovodrun-gloo"),
    pytest.param(HVD_TF, mpiexec, id="hvd-tf-mpiexec"),
    pytest.param(KERAS, horovodrun, id="keras-horovodrun-gloo"),
    pytest.param(KERAS, mpiexec, id="keras-mpiexec"),
    pytest.param(DS, deepspeed_launcher, id="deepspeed-deepspeed"),
    pytest.param(DS, torchrun, id="deepspeed-torchrun"),
    pytest.param(DS, mpiexec, id="deepspeed-mpiexec"),
]
RANK_VARIABLES = ("HOROVOD_RANK", "RANK", "PMI_RANK")


def ranks_of(launcher_pid, script):
    """{rank: psutil.Process} of the Python processes running `script` below the launcher."""
    found = {}
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmdline, environ, name = proc.cmdline(), proc.environ(), proc.name()
        except psutil.Error:
            continue
        if name.startswith("python") and any(arg.endswith(script) for arg in cmdline):
            rank = next((int(environ[v]) for v in RANK_VARIABLES if v in environ), None)
            if rank is not None:  # not the deepspeed launcher's own per-node helper, which runs `-m ... script`
                found.setdefault(rank, proc)
    return found


def signal_rank_1(tmp_path, script, launcher, sig, *extra):
    """Start a long 2-rank job, send `sig` to rank 1 mid-epoch, and wait (at most KILL_DEADLINE_S) for rank 0
    and then the launcher to end. Returns the launcher's exit code, both delays, and the job's output."""
    # 62 steps per epoch and 50 epochs: the job is nowhere near its end when the signal comes.
    cmd = [str(c) for c in launcher(2, script, "--epochs", "50", "--log-interval", "5", *extra,
                                    "--log-dir", tmp_path / "log")]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
               PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    out_path = tmp_path / "output.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        # Training has started: rank 0's 10th step (custom loops) or Keras' epoch header plus a moment.
        while not re.search(r"epoch 1 step 10/|Epoch 1/", out_path.read_text()):
            assert proc.poll() is None, f"exited early ({proc.returncode}):\n{out_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"training never started:\n{out_path.read_text()[-3000:]}"
            time.sleep(0.2)
        time.sleep(1.0)
        ranks = ranks_of(proc.pid, script)
        assert sorted(ranks) == [0, 1], ranks
        ranks[1].send_signal(sig)
        sent_at = time.monotonic()
        gone, alive = psutil.wait_procs([ranks[0]], timeout=KILL_DEADLINE_S)
        survivor_s = time.monotonic() - sent_at
        assert not alive, f"rank 0 still running {KILL_DEADLINE_S} s after rank 1 got {sig!r}"
        rc = proc.wait(timeout=max(1, KILL_DEADLINE_S - survivor_s))
        launcher_s = time.monotonic() - sent_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, survivor_s, launcher_s, out_path.read_text()


def assert_no_traceback_through_the_example(output):
    """Rank 0 either says so in one line (utils/log.run_main) or is stopped by the launcher first: never a
    traceback through the example (the launchers' own reports are theirs)."""
    assert not re.search(r'File "[^"]*(DDP|horovod|deepspeed)/[^"]*main\.py"', output), output[-4000:]
    for line in error_lines(output):
        assert "error: lost contact with another rank" in line, line


@pytest.mark.parametrize("script,launcher", KILL_LAUNCHES)
def test_sigkill_of_one_rank_ends_the_whole_job(tmp_path, script, launcher):
    """SIGKILL rank 1 mid-epoch: rank 0 must be gone and the launcher must return non-zero within 60 s."""
    rc, survivor_s, launcher_s, output = signal_rank_1(tmp_path, script, launcher, signal.SIGKILL)
    print(f"\n[{script} / {launcher.__name__}] rank 0 gone {survivor_s:.2f} s after SIGKILL of rank 1; "
          f"launcher exit {rc} after {launcher_s:.2f} s")
    assert rc != 0
    assert not (tmp_path / "log" / "summary.json").exists()  # no rank finished as if nothing happened
    assert_log_dir_sound(tmp_path / "log")
    assert_no_traceback_through_the_example(output)


# === interrupted and resumed ==============================================================================
# Single-process runs on the tiny set, 3 epochs of 8 steps. One thread per process: the thread count changes
# how a sum over a tensor is split, hence its rounding (pinned in every run here).
PER_SCRIPT = {DDP: [], HVD_TORCH: [], DS: [],
              # Keras 3 dropout layers draw from a seed generator no checkpoint records: resume without dropout
              HVD_TF: ["--dropout", "0"], KERAS: []}
_straight = {}


def quick(script, log_dir, *extra):
    return python(script, "--epochs", "3", "--batch-size", "32", "--num-threads", "1", "--seed", "7",
                  "--log-interval", "100", *PER_SCRIPT[script], "--log-dir", log_dir, *extra)


def checked(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture
def straight_run(tmp_path_factory, tiny):
    """The uninterrupted run of an example (run once per module, shared by the tests below)."""
    def get(script):
        if script not in _straight:
            log_dir = tmp_path_factory.mktemp("straight")
            checked(run(quick(script, log_dir, "--data-dir", tiny), timeout=240))
            _straight[script] = log_dir
        return _straight[script]
    return get


@pytest.mark.parametrize("script", SCRIPTS)
def test_same_command_twice_gives_identical_metrics(tmp_path, tiny, straight_run, script):
    """Pinned: --seed (weight init: torch.manual_seed / keras.utils.set_random_seed), the data order (numpy
    generator seeded by seed + epoch), dropout masks (reseeded per epoch and rank), the tf.data shuffle seed
    (Keras API), and --num-threads 1 (see above). Timing fields excluded."""
    first = straight_run(script)
    checked(run(quick(script, tmp_path, "--data-dir", tiny), timeout=240))
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(first))
    assert summary(tmp_path)["param_checksums"] == summary(first)["param_checksums"]


@pytest.mark.parametrize("script,fault", [
    # killed while writing epoch 2's checkpoint: half a temporary file, no rename
    (DDP, {"COURSE_DIE_IN_WRITE": "checkpoint.pt:2"}),
    (HVD_TORCH, {"COURSE_DIE_IN_WRITE": "checkpoint.pt:2"}),
    (DS, {"COURSE_DIE_IN_WRITE": "mp_rank_00_model_states.pt:2"}),
    # TensorFlow's CheckpointManager writes ckpt-2 itself: killed the moment its first file appears
    (HVD_TF, {"COURSE_DIE_ON_FILE": "{log_dir}/checkpoints/ckpt-2*"}),
    # killed (SIGKILL) in the middle of epoch 2, after epoch 1's checkpoint
    (HVD_TF, {"COURSE_FAIL_AT": "0:2:3:kill"}),
    (DS, {"COURSE_FAIL_AT": "0:2:3:kill"}),
], ids=["ddp-in-checkpoint-write", "hvd-torch-in-checkpoint-write", "deepspeed-in-checkpoint-write",
        "hvd-tf-in-checkpoint-write", "hvd-tf-mid-epoch", "deepspeed-mid-epoch"])
# (DDP killed mid-epoch under torchrun: test_torchrun_elastic_restart_resumes_from_the_checkpoint)
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, tiny, straight_run, script, fault):
    fault = {k: v.format(log_dir=tmp_path) for k, v in fault.items()}
    killed = run(quick(script, tmp_path, "--data-dir", tiny), timeout=240, env=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    in_save = "COURSE_FAIL_AT" not in fault  # killed in epoch 2's checkpoint save, after its metrics line
    assert [m["epoch"] for m in metrics(tmp_path)] == ([1, 2] if in_save else [1])
    checkpoints = tmp_path / "checkpoints"
    if script in (DDP, HVD_TORCH) and "COURSE_DIE_IN_WRITE" in fault:
        # the previous checkpoint is intact (epoch 1); the half-written one never got the real name
        assert torch.load(checkpoints / "checkpoint.pt", weights_only=True)["epoch"] == 1
        remove_the_half_written_file(checkpoints, ".tmp-checkpoint.pt*")
    if script == DS and "COURSE_DIE_IN_WRITE" in fault:
        assert (checkpoints / "latest").read_text() == "epoch1"  # still names the complete checkpoint
        remove_the_half_written_file(checkpoints / "epoch2", ".tmp-mp_rank_00_model_states.pt*")
    if "COURSE_DIE_ON_FILE" in fault:
        assert "COURSE_DIE_ON_FILE: killed" in killed.stdout
        assert 'model_checkpoint_path: "ckpt-1"' in (checkpoints / "checkpoint").read_text()
    resumed = checked(run(quick(script, tmp_path, "--data-dir", tiny, "--resume"), timeout=240))
    assert "continuing at epoch 2" in resumed.stdout
    reference = straight_run(script)
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(reference))
    assert summary(tmp_path)["param_checksums"] == summary(reference)["param_checksums"]
    assert_log_dir_sound(tmp_path)


def remove_the_half_written_file(folder, pattern):
    """What a crash in atomic_write leaves: one non-empty temporary file. Harmless; removed here so the final
    check (no temporary file anywhere) is strict."""
    partial = list(folder.glob(pattern))
    assert len(partial) == 1 and partial[0].stat().st_size > 0, partial
    partial[0].unlink()


def test_torchrun_elastic_restart_resumes_from_the_checkpoint(tmp_path, tiny):
    """--max-restarts 1, rank 1 exits at epoch 2 step 3 once: torchrun restarts both workers, which pick up
    epoch 1's checkpoint by themselves (--resume auto) and end exactly where an uninterrupted run ends."""
    flags = ["--epochs", "3", "--batch-size", "32", "--num-threads", "1", "--seed", "7", "--data-dir", tiny]
    checked(run(torchrun(2, DDP, *flags, "--log-dir", tmp_path / "straight"), timeout=240))
    elastic = launch_command(DDP, 2, "torchrun", [*flags, "--resume", "auto", "--log-dir", tmp_path / "elastic"],
                             launcher_flags=["--max-restarts", "1"])
    result = checked(run(elastic, timeout=300, env={"COURSE_FAIL_AT": "1:2:3"}))
    output = result.stdout + result.stderr
    assert "COURSE_FAIL_AT: rank 1 stops at epoch 2 step 3" in output
    assert "continuing at epoch 2" in result.stdout  # the restarted workers found epoch 1's checkpoint
    assert without_timing(metrics(tmp_path / "elastic")) == without_timing(metrics(tmp_path / "straight"))
    assert summary(tmp_path / "elastic")["param_checksums"] == summary(tmp_path / "straight")["param_checksums"]


def test_resume_auto_without_a_checkpoint_starts_fresh_and_plain_resume_refuses(tmp_path, tiny):
    flags = ["--epochs", "1", "--max-steps", "1", "--data-dir", tiny, "--num-threads", "1"]
    checked(run(python(DDP, *flags, "--resume", "auto", "--log-dir", tmp_path / "auto"), timeout=120))
    assert [m["epoch"] for m in metrics(tmp_path / "auto")] == [1]
    result = run(python(DDP, *flags, "--resume", "--log-dir", tmp_path / "plain"), timeout=120)
    assert result.returncode == 2 and len(error_lines(result.stderr)) == 1
    assert "--resume: no checkpoint at" in result.stderr


# === bad input ============================================================================================
BAD_FLAGS = [  # (flag and value, words the error line must contain): every common flag of utils/parse_args.py
    (["--epochs", "0"], "--epochs"), (["--batch-size", "-1"], "--batch-size"),
    (["--test-batch-size", "x"], "--test-batch-size"), (["--lr", "nan"], "--lr"),
    (["--lr-warmup-epochs", "-1"], "--lr-warmup-epochs"), (["--momentum", "1"], "--momentum"),
    (["--dropout", "0.5"], "--dropout"), (["--grad-accum", "0"], "--grad-accum"), (["--seed", "-3"], "--seed"),
    (["--max-steps", "0"], "--max-steps"), (["--log-interval", "0"], "--log-interval"),
    (["--device", "tpu"], "--device"), (["--backend", "foo"], "--backend"), (["--num-threads", "0"], "--num-threads"),
    (["--dist-timeout", "0"], "--dist-timeout"), (["--resume", "maybe"], "--resume"),
    (["--data-dir", "/no/such/dir"], "/no/such/dir"), (["--no-such-flag"], "--no-such-flag"),
    (["--epochs"], "--epochs"),
]
# One process per script runs the whole table: it executes the script's __main__ once per row and captures
# what that row prints on stderr and the exit code (all are argparse or early checks: nothing has started).
DRIVER = """
import contextlib, io, json, runpy, sys
script, prefix, rows = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
results = []
for row in rows:
    sys.argv = [script] + prefix + row
    err = io.StringIO()
    code = "finished"
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    results.append({"code": code, "stderr": err.getvalue()})
print("RESULTS " + json.dumps(results))
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_common_flag_with_a_bad_value_is_one_line_and_exit_2(tmp_path, tiny, script):
    # The valid flags come first: a bad value after them wins, and if it were accepted the run would be short.
    prefix = ["--epochs", "1", "--max-steps", "1", "--data-dir", str(tiny), "--log-dir", str(tmp_path / "log")]
    result = run([sys.executable, "-c", DRIVER, str(ROOT / script), json.dumps(prefix),
                  json.dumps([flags for flags, _ in BAD_FLAGS])], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    for (flags, words), outcome in zip(BAD_FLAGS, json.loads(line[len("RESULTS "):])):
        errors = error_lines(outcome["stderr"])
        assert outcome["code"] == 2, (flags, outcome)
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"])
        assert "Traceback" not in outcome["stderr"], (flags, outcome["stderr"])
    assert not (tmp_path / "log").exists() or not any((tmp_path / "log").iterdir())


def unreadable_data(folder):
    write_idx_set(folder, 64, 16)
    path = folder / "train-images-idx3-ubyte"
    path.unlink()
    path.mkdir()  # a folder where a file should be: unreadable even for root (chmod 000 is not)
    return folder, "cannot read"


def corrupted_data(folder):
    write_idx_set(folder, 64, 16)
    (folder / "train-labels-idx1-ubyte").write_bytes(os.urandom(64))
    return folder, "not an MNIST IDX file"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("make", [unreadable_data, corrupted_data], ids=["unreadable", "corrupted"])
def test_bad_data_dir_is_one_line_and_non_zero(tmp_path, script, make):
    folder, words = make(tmp_path / "data")
    result = run(python(script, "--data-dir", folder, "--log-dir", tmp_path / "log", "--num-threads", "1"),
                 timeout=120)
    assert result.returncode == 2
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and words in errors[0] and str(folder) in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert_log_dir_sound(tmp_path / "log")


@pytest.mark.parametrize("script,launcher", [pytest.param(DDP, torchrun, id="ddp-torchrun"),
                                             pytest.param(DS, torchrun, id="deepspeed-torchrun"),
                                             pytest.param(HVD_TORCH, horovodrun, id="hvd-torch-horovodrun-gloo"),
                                             pytest.param(HVD_TF, horovodrun, id="hvd-tf-horovodrun-gloo")])
def test_a_hung_rank_ends_the_job_after_the_collective_timeout(tmp_path, script, launcher):
    """SIGSTOP rank 1 (alive, silent: a hung node): with --dist-timeout 10 rank 0's collective gives up after
    10 s, rank 0 exits with one line, and the launcher tears the job down (SIGKILL reaches a stopped process).
    Horovod's examples turn --dist-timeout into HOROVOD_GLOO_TIMEOUT_SECONDS (utils/dist.horovod_knobs)."""
    rc, survivor_s, launcher_s, output = signal_rank_1(tmp_path, script, launcher, signal.SIGSTOP,
                                                       "--dist-timeout", "10")
    print(f"\n[{script} / hung rank 1] rank 0 gone after {survivor_s:.1f} s; launcher exit {rc} after {launcher_s:.1f} s")
    assert rc != 0
    assert survivor_s >= 9, "rank 0 gave up before the 10 s timeout: it did not wait on the collective"
    # ... and the 10 s came from --dist-timeout, not a library default (gloo in Horovod: 30 s; torch: 30 min)
    assert survivor_s < 25, f"rank 0 waited {survivor_s:.0f} s: --dist-timeout 10 did not reach the collectives"
    assert any("error: lost contact with another rank" in line for line in error_lines(output)), output[-4000:]
    assert_no_traceback_through_the_example(output)
    assert_log_dir_sound(tmp_path / "log")


# --- checkpoints that must not load: corrupted, truncated, or of another model ------------------------------
class OtherNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(784, 10)


class RunsCode:
    """Unpickling this calls os.mkdir(marker): what a malicious checkpoint could do with any function."""
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant_code(path, marker):
    """Add an object that runs code when unpickled to the checkpoint file at `path` (our own file)."""
    state = torch.load(path, weights_only=False)
    state["payload"] = RunsCode(marker)
    torch.save(state, path)


def torch_checkpoints(folder):
    """The torch examples' checkpoint.pt: a real one (truncated, corrupted) and one of another model."""
    from utils.torch_utils import Net
    net = Net()
    real = {"model": net.state_dict(), "optimizer": torch.optim.SGD(net.parameters(), lr=0.1).state_dict(),
            "epoch": 1}
    other = OtherNet()
    foreign = {"model": other.state_dict(), "optimizer": torch.optim.SGD(other.parameters(), lr=0.1).state_dict(),
               "epoch": 1}
    cases = {}
    for name, mutate in [("truncated", lambda b: b[:len(b) // 2]), ("corrupted", lambda b: os.urandom(len(b))),
                         ("other-model", None)]:
        ckpt = folder / name / "checkpoints" / "checkpoint.pt"
        ckpt.parent.mkdir(parents=True)
        torch.save(foreign if mutate is None else real, ckpt)
        if mutate:
            ckpt.write_bytes(mutate(ckpt.read_bytes()))
        cases[name] = folder / name
    ckpt = folder / "runs-code" / "checkpoints" / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save(real, ckpt)
    plant_code(ckpt, folder / "runs-code" / "code-ran")
    cases["runs-code"] = folder / "runs-code"
    return cases


def framework_checkpoint(script, log_dir, tiny):
    """One epoch of one step, to get that framework's own checkpoint files."""
    checked(run(python(script, "--epochs", "1", "--max-steps", "1", "--num-threads", "1", "--data-dir", tiny,
                       "--log-dir", log_dir), timeout=180))
    return log_dir


def corrupt_largest(log_dir, pattern, mutate):
    path = max((log_dir / "checkpoints").rglob(pattern), key=lambda p: p.stat().st_size)
    path.write_bytes(mutate(path.read_bytes()))



@pytest.mark.parametrize("script", RESUMABLE)
def test_bad_checkpoint_is_one_line_and_leaves_the_log_dir_alone(tmp_path, tiny, script):
    import shutil
    if script in (DDP, HVD_TORCH):
        cases = torch_checkpoints(tmp_path)
    else:
        good = framework_checkpoint(script, tmp_path / "good", tiny)
        cases = {}
        for name in ("truncated", "corrupted"):
            shutil.copytree(good, tmp_path / name)
            cases[name] = tmp_path / name
        pattern = "*.data-*" if script == HVD_TF else "*model_states.pt"
        corrupt_largest(cases["truncated"], pattern, lambda b: b[:len(b) // 2])
        corrupt_largest(cases["corrupted"], pattern, lambda b: os.urandom(len(b)))
        cases["other-model"] = other_model_checkpoint(script, good, tmp_path / "other-model")
        if script == DS:  # weights_only=True: DeepSpeed's own loader would run this (weights_only=False)
            shutil.copytree(good, tmp_path / "runs-code")
            plant_code(next((tmp_path / "runs-code" / "checkpoints").rglob("*model_states.pt")),
                       tmp_path / "runs-code" / "code-ran")
            cases["runs-code"] = tmp_path / "runs-code"
    for name, log_dir in cases.items():
        before = {p.relative_to(log_dir): p.read_bytes() for p in log_dir.rglob("*") if p.is_file()}
        result = run(python(script, "--resume", "--data-dir", tiny, "--num-threads", "1", "--log-dir", log_dir),
                     timeout=180)
        errors = error_lines(result.stderr)
        assert result.returncode == 2, (name, result.stderr[-3000:])
        assert len(errors) == 1 and "checkpoint" in errors[0], (name, result.stderr[-3000:])
        assert "Traceback" not in result.stderr, (name, result.stderr[-3000:])
        assert_log_dir_sound(log_dir, before)
        assert not (log_dir / "code-ran").exists(), "a checkpoint ran code while loading"
        print(f"\n[{script} {name}] {errors[0]}")


def other_model_checkpoint(script, good, log_dir):
    """The same framework's checkpoint files, but holding a different model's weights."""
    import shutil
    shutil.copytree(good, log_dir)
    if script == DS:
        path = next((log_dir / "checkpoints").rglob("*model_states.pt"))
        state = torch.load(path, weights_only=False)  # our own file, written a moment ago
        state["module"] = OtherNet().state_dict()
        torch.save(state, path)
    else:  # TensorFlow: a checkpoint of a 2-layer dense model under the same names
        code = ("import os, sys; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; import keras, tensorflow as tf; "
                "m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]); "
                "o = keras.optimizers.SGD(0.1, momentum=0.5); o.build(m.trainable_variables); "
                "c = tf.train.Checkpoint(model=m, optimizer=o, epoch=tf.Variable(1, dtype=tf.int64)); "
                "tf.train.CheckpointManager(c, sys.argv[1], max_to_keep=2).save()")
        shutil.rmtree(log_dir / "checkpoints")
        checked(run([sys.executable, "-c", code, log_dir / "checkpoints"], timeout=120))
    return log_dir


@pytest.mark.parametrize("script", SCRIPTS)
def test_more_ranks_than_training_samples_fails_every_rank(tmp_path, script):
    one = write_idx_set(tmp_path / "one", 1, 10)  # one training digit, two ranks
    result = run(mpiexec(2, script, "--data-dir", one, "--batch-size", "1", "--num-threads", "1",
                         "--log-dir", tmp_path / "log"), timeout=180)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all("too few for 2 ranks" in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "log" / "summary.json").exists()
    assert_log_dir_sound(tmp_path / "log")
