"""Bad flags, data, checkpoints and world sizes: one `error:` line per rank, exit 2, nothing half-written."""
import os
import socket
import sys

import pytest
import torch

from support import (
    BIN,
    DDP,
    DS,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    RESUMABLE,
    SCRIPTS,
    assert_log_dir_sound,
    check,
    error_lines,
    run,
    run_rows,
    warm,
    write_idx_set,
)

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_common_flag_with_a_bad_value_is_one_line_and_exit_2(tmp_path, tiny, script):
    # The valid flags come first: a bad value after them wins, and if it were accepted the run would be short.
    prefix = ["--epochs", "1", "--max-steps", "1", "--data-dir", str(tiny), "--log-dir", str(tmp_path / "log")]
    # Horovod picks its own controller and collectives: it has no --backend, and refuses one
    table = BAD_FLAGS + ([(["--backend", "gloo"], "--backend")] if script in (HVD_TORCH, HVD_TF, HVD_KERAS) else [])
    outcomes = run_rows(script, [prefix + flags for flags, _ in table])
    for (flags, words), outcome in zip(table, outcomes):
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
def test_bad_data_dir_is_one_line_and_non_zero(tmp_path, script):
    """An unreadable and a corrupted data folder, one command line each (both in one interpreter)."""
    cases = [make(tmp_path / make.__name__) for make in (unreadable_data, corrupted_data)]
    outcomes = run_rows(script, [["--data-dir", str(folder), "--log-dir", str(tmp_path / f"log{i}"),
                                  "--num-threads", "1"] for i, (folder, _) in enumerate(cases)])
    for i, ((folder, words), outcome) in enumerate(zip(cases, outcomes)):
        errors = error_lines(outcome["stderr"])
        assert outcome["code"] == 2, (words, outcome)
        assert len(errors) == 1 and words in errors[0] and str(folder) in errors[0], outcome["stderr"][-3000:]
        assert "Traceback" not in outcome["stderr"]
        assert_log_dir_sound(tmp_path / f"log{i}")



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
    from course.torch_utils import Net
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
    check(run(warm(1, script, "--epochs", "1", "--max-steps", "1", "--num-threads", "1", "--data-dir", tiny,
                   "--log-dir", log_dir), timeout=180))
    return log_dir


def corrupt_largest(log_dir, pattern, mutate):
    path = max((log_dir / "checkpoints").rglob(pattern), key=lambda p: p.stat().st_size)
    path.write_bytes(mutate(path.read_bytes()))


def in_place(raw, size=4096):
    """4 KB of random bytes written into the middle: the length and the archive's structure stay."""
    middle = len(raw) // 2 - size // 2
    return raw[:middle] + os.urandom(size) + raw[middle + size:]


# The file a lesson's checkpoint holds its weights in (the largest of its kind), damaged in place.
WEIGHTS = {DDP: "checkpoint.pt", HVD_TORCH: "checkpoint.pt", HVD_TF: "*.data-*", DS: "*model_states.pt"}



@pytest.mark.parametrize("script", RESUMABLE)
def test_bad_checkpoint_is_one_line_and_leaves_the_log_dir_alone(tmp_path, tiny, script):
    import shutil
    good = framework_checkpoint(script, tmp_path / "good", tiny)  # the lesson's own, as it writes it
    shutil.copytree(good, tmp_path / "in-place")
    corrupt_largest(tmp_path / "in-place", WEIGHTS[script], in_place)  # (not only truncation)
    if script in (DDP, HVD_TORCH):
        cases = {**torch_checkpoints(tmp_path), "in-place": tmp_path / "in-place"}
    else:
        cases = {"in-place": tmp_path / "in-place"}
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
    for name, log_dir in cases.items():  # the others without SHA256SUMS (an older checkpoint, a copied
        for sums in log_dir.rglob("SHA256SUMS") if name != "in-place" else ():  # lesson's): the loaders' checks
            sums.unlink()
    before = {name: {p.relative_to(log_dir): p.read_bytes() for p in log_dir.rglob("*") if p.is_file()}
              for name, log_dir in cases.items()}
    # one command line per case, all in one interpreter (run_rows): each is refused before training
    outcomes = run_rows(script, [["--resume", "--data-dir", str(tiny), "--num-threads", "1", "--log-dir",
                                  str(log_dir)] for log_dir in cases.values()])
    for (name, log_dir), outcome in zip(cases.items(), outcomes):
        errors = error_lines(outcome["stderr"])
        assert outcome["code"] == 2, (name, outcome["stderr"][-3000:])
        assert len(errors) == 1 and "checkpoint" in errors[0], (name, outcome["stderr"][-3000:])
        assert "Traceback" not in outcome["stderr"], (name, outcome["stderr"][-3000:])
        assert_log_dir_sound(log_dir, before[name])
        assert not (log_dir / "code-ran").exists(), "a checkpoint ran code while loading"
        if name == "in-place":  # the archive or TensorFlow's files still load: their SHA256SUMS catches it
            assert " is damaged: its bytes are not the ones written" in errors[0], errors[0]
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
        check(run([sys.executable, "-c", code, log_dir / "checkpoints"], timeout=120))
    return log_dir


@pytest.mark.parametrize("script", SCRIPTS)
def test_more_ranks_than_training_samples_fails_every_rank(tmp_path, script):
    one = write_idx_set(tmp_path / "one", 1, 10)  # one training digit, two ranks
    # (a claim about the data check, not a launcher: warm ranks, as horovodrun's for the Horovod lessons)
    result = run(warm(2, script, "--data-dir", one, "--batch-size", "1", "--num-threads", "1", "--log-dir",
                      tmp_path / "log", launcher="horovodrun" if script in (HVD_TORCH, HVD_TF, HVD_KERAS) else None),
                 timeout=180)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all("too few for 2 ranks" in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "log").exists(), "a run that failed before its first epoch left its log dir"


def test_a_master_port_in_use_is_one_line_on_rank_0_that_names_it(tmp_path):
    """MASTER_PORT in use by another program (here an outgoing connection holds it): rank 0 cannot
    listen on it and says so in one line; rank 1, which never meets it, gives up after --dist-timeout.
    What ended a Slurm job of the suite once, when the tests still took MASTER_PORT from the kernel's
    ephemeral range, where srun's own listening ports come from (course/ranks.free_port now takes it
    from below)."""
    from tools.launch import launch_command
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client, server.accept()[0]:
            port = client.getsockname()[1]
            result = run(launch_command(DDP, 2, "mpiexec", ["--epochs", "1", "--dist-timeout", "5", "--log-dir",
                                                            tmp_path / "log"], port=port), timeout=120)
    assert result.returncode != 0
    said = [line for line in error_lines(result.stderr) if "cannot listen on MASTER_PORT" in line]
    assert len(said) == 1 and said[0].startswith(f"error: rank 0 cannot listen on MASTER_PORT {port}: address "
                                                 "already in use"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert_log_dir_sound(tmp_path / "log")
    print(f"\n{said[0]}")


def test_a_port_in_use_ends_torchrun_itself_and_standalone_picks_a_free_one(tmp_path):
    """Under torchrun the port is the launcher's: a port in use ends torchrun in its own traceback, before any
    rank (diagnose/hangs.md says so); the advice there, `--standalone`, runs with the same port still held."""
    from course.ranks import free_port
    port, short = free_port(), [DDP, "--epochs", "1", "--max-steps", "1", "--num-threads", "1"]
    with socket.socket() as held:
        held.bind(("0.0.0.0", port))
        held.listen()
        taken = run([BIN / "torchrun", "--nproc_per_node", "1", "--master_port", port, *short, "--log-dir",
                     tmp_path / "taken"], timeout=120)
        assert taken.returncode != 0 and "EADDRINUSE" in taken.stderr, taken.stderr[-3000:]
        assert not (tmp_path / "taken").exists()  # no rank started
        check(run([BIN / "torchrun", "--standalone", "--nproc_per_node", "1", *short, "--log-dir",
                   tmp_path / "standalone"], timeout=120))


def test_free_ports_come_from_below_the_ephemeral_range():
    from course.ranks import free_port
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for port in (free_port() for _ in range(20)):
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # and free


@pytest.mark.serial  # the machine's ports: no other worker's jobs listening meanwhile
def test_a_port_from_free_port_survives_other_programs_taking_kernel_picked_ports():
    """While other programs keep listening on ports the kernel picks (srun, gloo, a TCPStore; here
    tools/soak.py's pressure, far more of them), a port picked by binding port 0 is soon taken
    again, and one from free_port() never is. The control makes the test able to fail."""
    import time

    from course.ranks import free_port
    from tools.launch import kernel_port, port_pressure

    def still_free(port):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False
    with port_pressure():
        time.sleep(1)  # the pressure's sockets in place
        picks = [(kernel_port(), free_port()) for _ in range(60)]
        time.sleep(2)  # what a job takes from the pick to rank 0's listen
        taken = [(not still_free(old), not still_free(new)) for old, new in picks]
    assert sum(old for old, _ in taken) >= 5, taken  # the race is real under this pressure...
    assert not any(new for _, new in taken), taken   # ...and free_port() is out of it


INTERFACES = [  # (script, variable, value): each names no interface of this machine (course/network.py)
    (DDP, "GLOO_SOCKET_IFNAME", "eth0,no-such-if9"),  # gloo: a list, every name must exist
    (DDP, "NCCL_SOCKET_IFNAME", "=no-such-if"),  # NCCL: "=" an exact name (else a prefix)
    (HVD_TF, "HOROVOD_GLOO_IFACE", "no-such-if9"),  # Horovod's gloo
]


@pytest.mark.parametrize("script,variable,value", INTERFACES, ids=[v for _, v, _ in INTERFACES])
def test_an_interface_variable_naming_no_interface_here_is_one_line_per_rank_and_exit_2(tmp_path, script, variable,
                                                                                         value):
    """Refused before anything starts, on every rank, with this node's interfaces listed. (One that exists but does
    not reach the other nodes: tests/test_nodes.py, across two network namespaces.)"""
    nproc = 1 if script == HVD_TF else 2  # (TensorFlow's lesson: one process, warm ranks import no TensorFlow)
    cmd = warm(nproc, script, "--epochs", "1", "--max-steps", "1", "--log-dir", tmp_path / "log")
    result = run(cmd, env={variable: value}, timeout=240)
    errors = error_lines(result.stderr)
    assert result.returncode == 2 and len(errors) == nproc, (result.returncode, result.stderr[-3000:])
    assert all(f"{variable}={value} names no interface of this node" in line and "lo 127.0.0.1" in line
               for line in errors), errors
    assert "Traceback" not in result.stderr and not (tmp_path / "log").exists()
    # the check refuses nothing real: loopback exists on every machine, and NCCL's prefix "l" matches it
    check(run(warm(1, DDP, "--epochs", "1", "--max-steps", "1", "--num-threads", "1", "--log-dir", tmp_path / "ok"),
              env={"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "l"}, timeout=240))
