"""tools/phases.py (an example's own step timed phase by phase) and `bench.py --phases`."""
import json
import os

import pytest

from course.ranks import discover
from support import DDP, DS, HVD_TF, check, metrics, python, run
from tools import bench, bench_phases, phases


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_each_phase_counts_its_own_time_and_a_step_ends_with_the_outermost_optimizer_call():
    clock = FakeClock()
    timer = phases.StepTimer(clock)

    def work(seconds, inner=None):
        def call():
            clock.advance(seconds)
            if inner:
                inner()
        return call

    synchronize = timer.wrap("wait", work(0.004))
    inner_step = timer.wrap("optimizer", work(0.001))
    hvd_step = timer.wrap("optimizer", work(0.0005, lambda: (synchronize(), inner_step())))  # Horovod's step
    forward, backward = timer.wrap("forward", work(0.030)), timer.wrap("backward", work(0.050))
    timer.start_epoch(1)
    clock.advance(0.002)  # indexing the batch: no phase of its own
    forward()
    backward()
    inner_step()  # a nested-looking call at top level ends a step too (DDP's SGD.step)
    assert len(timer.records) == 1
    forward()
    backward()
    clock.advance(0.001)
    hvd_step()
    first, second = timer.records
    assert first == pytest.approx({"epoch": 1, "step": 0.083, "forward": 0.030, "backward": 0.050, "wait": 0.0,
                                   "optimizer": 0.001, "other": 0.002})
    # the step's own 0.5 ms and the SGD step's 1 ms are the optimizer; synchronize's 4 ms is waiting
    assert second == pytest.approx({"epoch": 1, "step": 0.0865, "forward": 0.030, "backward": 0.050, "wait": 0.004,
                                    "optimizer": 0.0015, "other": 0.001})
    clock.advance(1.0)  # evaluation between epochs
    forward()
    timer.start_epoch(2)  # ... belongs to no step
    forward()
    backward()
    inner_step()
    assert timer.records[2] == pytest.approx({"epoch": 2, "step": 0.081, "forward": 0.030, "backward": 0.050,
                                              "wait": 0.0, "optimizer": 0.001, "other": 0.0})


class Waiting:
    """A Turns stand-in: the other process's turn takes 5 s of the clock."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def after_step(self, steps_done):
        self.calls.append(steps_done)
        self.clock.advance(5.0)


def test_the_wait_for_a_turn_belongs_to_no_step():
    clock = FakeClock()
    turns = Waiting(clock)
    timer = phases.StepTimer(clock, turns)
    forward = timer.wrap("forward", lambda: clock.advance(0.03))
    step = timer.wrap("optimizer", lambda: clock.advance(0.01))
    timer.start_epoch(1)
    for _ in range(3):
        clock.advance(0.002)
        forward()
        step()
    assert turns.calls == [1, 2, 3]  # after every step, with the count of steps done
    assert [r["step"] for r in timer.records] == pytest.approx([0.042] * 3)  # not the 5 s of the other's turn
    assert [r["other"] for r in timer.records] == pytest.approx([0.002] * 3)


def test_turns_say_done_every_n_steps_then_wait_for_the_go_ahead():
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()
    os.set_inheritable(go_read, True), os.set_inheritable(done_write, True)  # as passed down to a child
    turns = phases.Turns(go_read, done_write, every=2)
    assert not os.get_inheritable(go_read) and not os.get_inheritable(done_write)  # not passed on by the child
    turns.after_step(1)  # not yet: nothing said, no wait
    os.write(go_write, b".")  # the go-ahead is there before it is asked for: the call returns
    turns.after_step(2)
    assert os.read(done_read, 10) == b"."
    os.close(go_write)  # the coordinator is gone: the process runs on freely, saying nothing
    turns.after_step(4)
    turns.after_step(6)
    os.close(done_write)
    assert os.read(done_read, 10) == b"."  # the "done" of step 4, then nothing more (end of file)
    assert os.read(done_read, 10) == b""
    os.close(go_read), os.close(done_read)


def test_phase_means_skip_the_warm_up_epoch():
    records = [{"epoch": 1, "step": 9.0, "forward": 9.0, "backward": 0.0, "wait": 0.0, "optimizer": 0.0, "other": 0.0}]
    records += [{"epoch": 2, "step": s, "forward": s / 2, "backward": s / 4, "wait": 0.0, "optimizer": s / 8,
                 "other": s / 8} for s in (0.08, 0.12)]
    means = bench_phases.phase_means(records)
    assert means == pytest.approx({"step": 100.0, "forward": 50.0, "backward": 25.0, "wait": 0.0,
                                   "optimizer": 12.5, "other": 12.5})
    with pytest.raises(SystemExit, match="no steps after the warm-up"):
        bench_phases.phase_means(records[:1])


def test_the_wrapped_example_trains_exactly_as_it_does_alone(tmp_path):
    """The timers wrap calls and change nothing: same seed, same losses, epoch by epoch."""
    flags = ["--epochs", "2", "--max-steps", "4", "--log-interval", "1000", "--num-threads", "1"]
    check(run(python(DDP, *flags, "--log-dir", tmp_path / "alone"), timeout=300))
    result = check(run(python("tools/phases.py", DDP, *flags, "--log-dir", tmp_path / "timed"),
                       timeout=300, env={"PHASES_OUT": str(tmp_path / "phases")}))
    alone, timed = metrics(tmp_path / "alone"), metrics(tmp_path / "timed")
    assert [m["train_loss"] for m in timed] == [m["train_loss"] for m in alone], result.stdout
    records = json.loads((tmp_path / "phases-rank0.json").read_text())["records"]
    assert [r["epoch"] for r in records] == [1] * 4 + [2] * 4  # every step of both epochs, and no other


def test_a_script_that_is_not_a_pytorch_example_is_refused(tmp_path):
    result = run(python("tools/phases.py", HVD_TF), timeout=60,
                 env={"PHASES_OUT": str(tmp_path / "p")})
    assert result.returncode == 1 and "is not a PyTorch example" in result.stderr, result.stderr
    result = run(python("tools/phases.py", DDP), timeout=60)  # PHASES_OUT unset
    assert result.returncode == 1 and "usage: PHASES_OUT=" in result.stderr, result.stderr
    # the example's own refusal comes through unchanged: its one line, its exit status
    result = run(python("tools/phases.py", DDP, "--batch-size", "0"), timeout=120,
                 env={"PHASES_OUT": str(tmp_path / "p")})
    assert result.returncode == 2 and "error: argument --batch-size" in result.stderr.strip().splitlines()[-1], \
        result.stderr


def test_the_example_and_its_flags_are_found_where_each_launcher_puts_them(monkeypatch):
    flags = ["--epochs", "2", "--seed=3"]
    assert phases.script_and_argv([DDP, *flags]) == (DDP, [DDP, *flags])
    # the deepspeed launcher: `python -u tools/phases.py --local_rank=1 deepspeed/main.py ...`
    assert phases.script_and_argv(["--local_rank=1", DS, *flags]) == (DS, [DS, "--local_rank=1", *flags])
    assert phases.script_and_argv(["--local_rank=1"]) == (None, None)
    for name in list(os.environ):
        if name.startswith(("RANK", "WORLD_SIZE", "HOROVOD_", "PMI_", "PALS_", "OMPI_", "SLURM_", "MPI_")):
            monkeypatch.delenv(name)
    assert discover().rank == 0
    for launcher_env, rank in (({"PMI_RANK": "1", "PMI_SIZE": "2"}, 1),  # mpiexec (MPICH)
                               ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4"}, 3),  # horovodrun
                               ({"PALS_RANKID": "5", "PMI_SIZE": "8"}, 5),  # mpiexec on Aurora and Polaris
                               ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8"}, 6)):  # srun
        with monkeypatch.context() as m:
            for name, value in launcher_env.items():
                m.setenv(name, value)
            assert discover().rank == rank, launcher_env


@pytest.mark.parametrize("argv", [["--phases", "--only", "horovod-tensorflow"],
                                  ["--phases", "--only", "ddp", "--versus=--seed 3"]])
def test_phases_refuses_tensorflow_and_versus(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and "--phases times the PyTorch examples" in capsys.readouterr().err


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_phases_quick_times_every_pytorch_example_under_its_launcher(tmp_path):
    """End to end under torchrun, horovodrun and deepspeed: rank 0's phases at 1 and 2 ranks, means that add up
    to the step, and the communication where each framework puts it."""
    out = tmp_path / "phases.json"
    check(run(python("tools/bench.py", "--phases", "--quick", "--out", out), timeout=600))
    report = json.loads(out.read_text())
    assert set(report["phases"]) == {"ddp", "horovod-pytorch", "deepspeed"} and len(report["rounds"]) == 1
    for name, by_ranks in report["phases"].items():
        # the Horovod example also at 2 ranks under mpiexec (MPI moves the gradients), as in the rest of the bench
        assert set(by_ranks) == ({"1", "2", "2_mpiexec"} if name == "horovod-pytorch" else {"1", "2"}), name
        for ranks, p in by_ranks.items():
            assert p["forward"] > 1 and p["backward"] > 1 and p["optimizer"] > 0, (name, ranks, p)
            assert p["other"] >= 0, (name, ranks, p)
            # every rank wrote its own file (rank found from torchrun's, horovodrun's, MPI's, deepspeed's variables)
            assert len(p["wait_by_rank"]) == int(ranks[0]) and p["wait_by_rank"][0] == p["wait"], (name, ranks, p)
        if name != "horovod-pytorch":  # only Horovod's step waits in synchronize()
            assert by_ranks["1"]["wait"] == by_ranks["2"]["wait"] == 0, (name, by_ranks)
        for ranks, cost in report["step_costs"][name].items():  # one round: its own difference and ratio
            one, two = by_ranks["1"]["step"], by_ranks[ranks]["step"]
            assert cost["extra_ms"] == pytest.approx(two - one) and cost["extra_ms_range"] == [cost["extra_ms"]] * 2
            assert cost["step_efficiency"] == pytest.approx(one / two), (name, ranks, cost)
    hvd = report["phases"]["horovod-pytorch"]
    # synchronize() is timed at 1 rank too; at 2 ranks the gradients really travel before the step, on both ranks
    assert min(hvd["2"]["wait_by_rank"] + hvd["2_mpiexec"]["wait_by_rank"]) > hvd["1"]["wait"] > 0, hvd
