"""tools/bench.py and its modules: the efficiency arithmetic on fixed inputs, the overhead's turn-taking
with real processes, the commands it starts (recorded), and the quick mode end to end."""
import json
import sys

import pytest

from support import DDP, DS, HVD_TORCH, ROOT, check, python, run
from tools import bench, bench_cpu, bench_overhead, bench_report, bench_runs, bench_split, bench_transformer, bench_wire


def test_efficiency_arithmetic():
    assert bench_report.efficiency(500.0, 900.0) == pytest.approx(0.9)
    assert bench_report.efficiency(500.0, 1000.0) == pytest.approx(1.0)  # perfect weak scaling
    assert bench_report.ceiling_efficiency(500.0, [450.0, 450.0]) == pytest.approx(0.9)


def steps(epoch, *seconds):
    return [{"epoch": epoch, "step": s} for s in seconds]


def test_the_overhead_compares_mean_steps_epoch_by_epoch_after_the_warm_up():
    example = steps(1, 9.0, 9.0) + steps(2, 1.03, 1.03) + steps(3, 1.0, 0.94)
    bare = steps(1, 0.1, 0.1) + steps(2, 1.0, 1.0) + steps(3, 1.0, 1.0)
    assert bench_report.step_ratios(example, bare) == pytest.approx([0.03, -0.03])  # epoch 1 (warm-up) left out
    # a different number of steps: means per step, not sums
    assert bench_report.step_ratios(steps(2, 1.1, 1.1, 1.1), steps(2, 1.0, 1.0)) == pytest.approx([0.1])
    with pytest.raises(SystemExit, match="bare loop timed no step in epoch 3"):
        bench_report.step_ratios(example, bare[:4])
    with pytest.raises(SystemExit, match="no step after the warm-up"):
        bench_report.step_ratios(steps(1, 1.0), steps(1, 1.0))


TAKER = """
import sys
sys.path.append(sys.argv[3])
from tools import phases
name, log = sys.argv[1], sys.argv[2]
timer = phases.StepTimer(turns=phases.Turns.from_env())
for step in range(1, 4):
    with open(log, "a") as f:
        f.write(f"{name}{step}\\n")
    timer.end_step()  # as the outermost optimizer step does: says "done", waits for the go-ahead
sys.exit(int(sys.argv[4]))
"""


def taker(name, log, code=0):
    return [sys.executable, "-c", TAKER, name, log, ROOT, code]


def test_two_real_processes_take_turns_step_by_step(tmp_path):
    """bench_overhead.take_turns with phases.Turns on both sides, through real pipes: after the first step (run
    by both at once) only one process steps at a time, in the order a b, b a, a b ... (3 steps each)."""
    log = tmp_path / "order"
    bench_overhead.take_turns({"a": (taker("a", log), tmp_path / "a"), "b": (taker("b", log), tmp_path / "b")},
                              every=1, timeout=120, work=tmp_path)
    order = log.read_text().split()
    assert sorted(order[:2]) == ["a1", "b1"] and order[2:] == ["a2", "b2", "b3", "a3"], order


def test_a_process_that_fails_while_taking_turns_is_reported(tmp_path):
    log = tmp_path / "order"
    with pytest.raises(SystemExit, match=r"overhead, b failed \(exit 3\)"):
        bench_overhead.take_turns({"a": (taker("a", log), tmp_path / "a"), "b": (taker("b", log, 3), tmp_path / "b")},
                                  every=1, timeout=120, work=tmp_path)
    assert sorted(log.read_text().split()) == ["a1", "a2", "a3", "b1", "b2", "b3"]  # both ran to the end


def test_rounds_combine_into_medians_and_ranges():
    rounds = [{"examples": [{"example": "ddp", "efficiency": e, "overhead": o}]}
              for e, o in [(0.80, 0.05), (0.90, -0.01), (0.86, 0.02)]]
    (row,) = bench_report.combine(rounds)
    assert row["efficiency"] == 0.86 and row["efficiency_range"] == [0.80, 0.90]
    assert row["overhead"] == 0.02 and row["overhead_range"] == [-0.01, 0.05]


def test_the_reported_knobs_are_the_examples_defaults(monkeypatch):
    from course.dist import HOROVOD_CPU_KNOBS
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    assert bench_report.knob_settings() == HOROVOD_CPU_KNOBS
    assert bench_report.knob_settings()["HOROVOD_CYCLE_TIME"] == HOROVOD_CPU_KNOBS["HOROVOD_CYCLE_TIME"]
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "1")  # the environment overrides the examples' default
    assert bench_report.knob_settings()["HOROVOD_CYCLE_TIME"] == "1"


def test_steady_throughput_skips_the_warm_up_epoch():
    history = [{"samples_per_s": 10.0}, {"samples_per_s": 500.0}, {"samples_per_s": 520.0},
               {"samples_per_s": 480.0}]
    assert bench_report.steady_throughput(history) == 500.0
    assert bench_report.steady_throughput([{"samples_per_s": 7.0}]) == 7.0


def test_cores_by_thread_kind_from_two_samples():
    before = {100: {100: ("python", 50), 101: ("tf_Compute", 10), 102: ("python", 0)},
              200: {200: ("python", 40), 202: ("python", 5)}}
    after = {100: {100: ("python", 100), 101: ("tf_Compute", 210), 102: ("python", 20), 103: ("python", 10)},
             200: {200: ("python", 240), 202: ("python", 25)}}
    cores = bench_cpu.cpu_by_kind(before, after, seconds=2.0, ticks_per_s=100)
    # rank 100: main 0.25, tf pool 1.0, others (102, and 103 that started in between) 0.15; rank 200: main 1.0,
    # other 0.1. Averaged over the two ranks:
    assert cores == pytest.approx({"main": 0.625, "tf_pool": 0.5, "other": 0.125, "total": 1.25})
    assert bench_cpu.cpu_by_kind(before, {}, seconds=2.0) is None  # the ranks had gone: nothing to report


def test_the_ranks_are_found_by_script_and_log_dir_not_the_launcher(tmp_path):
    import subprocess
    import time
    log_dir, script = tmp_path / "run", tmp_path / "main.py"
    script.write_text("import time\ntime.sleep(30)\n")
    rank = subprocess.Popen([sys.executable, "-u", str(script), "--log-dir", str(log_dir)])
    # a launcher names the script among its arguments too, but does not run it
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", str(script), str(log_dir)])
    other_run = subprocess.Popen([sys.executable, str(script), "--log-dir", str(tmp_path / "other")])
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not bench_cpu.rank_pids("main.py", log_dir):
            time.sleep(0.1)
        assert bench_cpu.rank_pids("main.py", log_dir) == [rank.pid]
        ticks = bench_cpu.thread_ticks([rank.pid])
        assert rank.pid in ticks[rank.pid] and all(t >= 0 for _, t in ticks[rank.pid].values())
    finally:
        for proc in (rank, launcher, other_run):
            proc.kill()
            proc.wait()


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_quick_mode_emits_every_field(tmp_path):
    out = tmp_path / "latest.json"
    check(run(python("tools/bench.py", "--quick", "--out", out), timeout=900))
    report = json.loads(out.read_text())
    assert report["repeat"] == 1 and len(report["rounds"]) == 1
    assert {r["example"] for r in report["examples"]} == set(bench_runs.BENCHED)
    assert set(report["rounds"][0]["independent_pair_samples_per_s"]) == {"torch", "tf"}  # a ceiling per framework
    for r in report["examples"]:
        for key in ("efficiency", "ceiling_efficiency", "overhead", "samples_per_s_1", "samples_per_s_2"):
            assert isinstance(r[key], float) and r[key] == r[key], (r["example"], key)  # a number, not nan
        for key in ("efficiency", "ceiling_efficiency", "samples_per_s_1", "samples_per_s_2"):
            assert r[key + "_range"] == [r[key], r[key]]  # one round: the range is the value
        # the overhead: the example's own step against a bare loop's, 2 pairs of processes (--quick)
        assert len(r["overhead_pairs"]) == 2 and r["overhead_range"] == [min(r["overhead_pairs"]),
                                                                          max(r["overhead_pairs"])]
        assert -0.5 < r["overhead"] < 0.5, r  # a ratio of two timings of the same work, not garbage
        assert r["samples_per_s_1"] > 0 and r["samples_per_s_2"] > 0
        assert r["efficiency"] == pytest.approx(r["samples_per_s_2"] / (2 * r["samples_per_s_1"]))
        kind = bench_runs.BENCHED[r["example"]][1]
        pair = report["rounds"][0]["independent_pair_samples_per_s"][kind]
        assert r["ceiling_efficiency"] == pytest.approx(sum(pair) / (2 * r["samples_per_s_1"]))
        if r["example"] in bench_runs.LIBRARY_DEFAULTS:  # the Horovod knob, measured against Horovod's default
            assert r["knob_speedup"] == pytest.approx(r["samples_per_s_2"] / r["samples_per_s_2_library_defaults"])
        if r["example"] in bench_runs.MPIEXEC_RUNS:  # the same example at 2 ranks under mpiexec (MPI operations)
            assert r["efficiency_mpiexec"] == pytest.approx(r["samples_per_s_2_mpiexec"] / (2 * r["samples_per_s_1"]))
            assert r["relative_to_ceiling_mpiexec"] == pytest.approx(r["efficiency_mpiexec"] / r["ceiling_efficiency"])
        # where the cores went, per rank and thread kind, at 1 and 2 ranks (and under mpiexec where it runs)
        for run_tag in ("1", "2") + (("2_mpiexec",) if r["example"] in bench_runs.MPIEXEC_RUNS else ()):
            parts = {part: r[f"cores_{part}_{run_tag}"] for part in ("main", "tf_pool", "other", "total")}
            assert all(v >= 0 for v in parts.values()), (r["example"], run_tag, parts)
            assert parts["total"] == pytest.approx(parts["main"] + parts["tf_pool"] + parts["other"])
            assert 0.2 < parts["total"] <= report["cpu_count"] + 0.1, (r["example"], run_tag, parts)
            if kind == "torch":  # PyTorch has no "tf_" threads; at one thread per rank the main thread computes
                assert parts["tf_pool"] == 0 and parts["main"] > parts["other"], (r["example"], run_tag, parts)
            else:  # TensorFlow runs its kernels on its op pool, not on the main thread
                assert parts["tf_pool"] > 0.1, (r["example"], run_tag, parts)
    assert {r["example"] for r in report["examples"] if "efficiency_mpiexec" in r} == set(bench_runs.MPIEXEC_RUNS)
    # one all-reduce of the gradients' size, timed by every way the examples move gradients
    from course.torch_utils import Net
    gradient_bytes = 4 * sum(p.numel() for p in Net().parameters())
    assert set(report["allreduce"]) == set(bench_wire.ALLREDUCE_WAYS)
    for way, timing in report["allreduce"].items():
        assert timing["bytes"] == gradient_bytes and 0 < timing["ms"] < 1000, (way, timing)
    assert report["knobs"] == {"HOROVOD_CYCLE_TIME": "5"}
    fractions = report["breakdown"]["fraction"]
    assert set(fractions) == {"data", "forward_backward", "communication", "optimizer"}
    assert sum(fractions.values()) == pytest.approx(1.0)


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_every_round_is_measured_in_full(tmp_path):
    """Two rounds: the second must measure everything the first did (an earlier bench let round 2 reuse
    round 1's log folders, and its 2-rank CPU samples went missing), and the report takes medians over both.
    With --versus, each round also measures the example with the other flags, and its overhead too."""
    out = tmp_path / "latest.json"
    result = check(run(python("tools/bench.py", "--quick", "--repeat", "2", "--only", "ddp", "--versus=--seed 3",
                              "--out", out), timeout=600))
    assert "; ddp with no flags, against --seed 3" in result.stdout, result.stdout
    report = json.loads(out.read_text())
    assert report["versus_args"] == ["--seed", "3"]
    for r in [round_["examples"][0] for round_ in report["rounds"]]:
        assert r["versus_speedup_1"] == pytest.approx(r["samples_per_s_1"] / r["samples_per_s_1_versus"])
        assert r["versus_speedup_2"] == pytest.approx(r["samples_per_s_2"] / r["samples_per_s_2_versus"])
    assert len(report["examples"][0]["overhead_versus_pairs"]) == 2
    assert report["repeat"] == 2 and len(report["rounds"]) == 2
    first, second = (r["examples"][0] for r in report["rounds"])
    assert set(second) == set(first), set(first) ^ set(second)
    for tag in ("1", "2"):
        assert all(r[f"cores_total_{tag}"] > 0.2 for r in (first, second)), (first, second)
    (row,) = report["examples"]
    for key in ("samples_per_s_2", "ceiling_efficiency", "cores_total_2"):
        values = sorted([first[key], second[key]])
        assert row[key + "_range"] == values and row[key] == pytest.approx(sum(values) / 2), key


def test_flags_for_one_example_reach_its_real_runs(tmp_path):
    """End to end: a data dir that does not exist, given to `--only ddp`, must make the example's first run fail
    with the example's own one-line error (the ceiling's runs, which start first, do not get it)."""
    missing = tmp_path / "no-such-dir"
    result = run(python("tools/bench.py", "--quick", "--only", "ddp", "--data-dir", missing), timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bench: ddp 1 rank failed" in result.stderr and f"--data-dir {missing}: no such directory" in result.stderr


def test_an_unknown_flag_is_refused_unless_it_goes_to_one_examples_overhead():
    result = run(python("tools/bench.py", "--quick", "--zero-stage", "0"), timeout=60)
    assert result.returncode == 2 and "unrecognized arguments: --zero-stage 0" in result.stderr, result.stderr
    result = run(python("tools/bench.py", "--part-steps", "0"), timeout=60)
    assert result.returncode == 2 and "and --part-steps must be at least 1" in result.stderr, result.stderr


@pytest.fixture
def recorded_launches(monkeypatch):
    """The bench's launches recorded instead of run: every run reports 100 samples/s (80 in a `-versus` log
    folder); every overhead pair of processes is recorded too, and times the example's steps 1% slower than
    the bare loop's. Returns the list the commands go to; `turns` holds the overhead's orders of going first."""
    commands = type("Commands", (list,), {})()
    monkeypatch.setattr(bench_runs, "launch", lambda cmd, timeout, extra_env=None, **popen: (
        commands.append(list(map(str, cmd))), timeout))
    monkeypatch.setattr(bench_runs, "wait", lambda proc, timeout, what: "")
    monkeypatch.setattr(bench_runs, "history", lambda log_dir: [{"samples_per_s": 80.0 if "versus" in log_dir.name
                                                                 else 100.0}] * 2)
    monkeypatch.setattr(bench_cpu, "watch_cpu", lambda *a: type("NoWatch", (), {"result": lambda self: None})())

    def take_turns(sides, every, timeout, work):
        commands.turns.append(list(sides))
        for side, (cmd, out) in sides.items():
            commands.append(list(map(str, cmd)))
            step = 0.101 if side == "example" else 0.1
            records = [{"epoch": e, "step": step} for e in (1, 2)]
            (out.parent / f"{out.name}-rank0.json").write_text(json.dumps({"records": records}))
    commands.turns = []
    monkeypatch.setattr(bench_overhead, "take_turns", take_turns)
    return commands


def test_example_flags_reach_every_run_of_that_example_and_no_other(tmp_path, recorded_launches):
    """`--only horovod-pytorch --seed 7`: the flags go to every command the bench starts for that example (1 rank,
    2 ranks, the library defaults, mpiexec, the overhead's runs under phases.py), never to the ceiling's
    independent DDP runs nor to the overhead's bare loop. The commands are recorded, not run."""
    commands = recorded_launches
    args = bench.parse_args(["--quick", "--only", "horovod-pytorch", "--seed", "7"])
    assert args.example_args == ["--seed", "7"]
    bench_runs.measure_round(args.only, args, tmp_path, 1)
    assert bench_overhead.measure_overhead("horovod-pytorch", args) == pytest.approx([0.01, 0.01])  # 2 pairs
    example = [c for c in commands if HVD_TORCH in " ".join(c)]
    ceiling = [c for c in commands if c[1].endswith(DDP)]
    bare = [c for c in commands if c[1].endswith("tools/bare_loop.py")]
    assert len(example) == 6 and len(ceiling) == 2 and len(bare) == 2 and len(commands) == 10, commands
    assert all(c[-2:] == ["--seed", "7"] for c in example), example
    assert not any("--seed" in c for c in ceiling + bare), ceiling + bare
    overhead = [c for c in example if c[1].endswith("tools/phases.py")]  # the example unchanged under phases.py
    assert len(overhead) == 2 and all(c[2].endswith(HVD_TORCH) for c in overhead), overhead
    assert recorded_launches.turns == [["example", "bare"], ["bare", "example"]]  # who starts alternates


def test_the_bare_loop_gets_the_examples_optimizer_and_data(tmp_path):
    args = bench.parse_args(["--quick", "--only", "deepspeed", "--deepspeed_config=my.json", "--data-dir", "d"])
    commands = bench_overhead.overhead_commands("deepspeed", args, args.example_args, tmp_path)
    bare = commands["bare"][0]
    assert bare[bare.index("--optimizer") + 1] == "adam" and bare[bare.index("--adam-config") + 1] == "my.json"
    assert bare[bare.index("--data-dir") + 1] == "d" and bare[bare.index("--max-steps") + 1] == "8"
    ddp = bench_overhead.overhead_commands("ddp", args, [], tmp_path)["bare"][0]
    assert "--optimizer" not in ddp and "--data-dir" not in ddp  # SGD with momentum, the shipped digits
    tf = bench_overhead.overhead_commands("horovod-tensorflow", args, [], tmp_path)
    assert "phases.py" not in " ".join(tf["example"][0]) and tf["bare"][0][-4:] == [
        "--framework", "tf", "--log-dir", str(tmp_path / "horovod-tensorflow-overhead-bare")]


@pytest.mark.parametrize("argv,message", [
    (["--only", "ddp", "--num-thr", "2"], "--num-thr: the bench sets this flag itself"),
    (["--only", "ddp", "--log-dir=/tmp/x"], "--log-dir=/tmp/x: the bench sets this flag itself"),
    (["--only", "ddp", "deepspeed", "--seed", "3"], "need exactly one --only NAME"),
], ids=["abbreviated", "with-equals", "two-examples"])
def test_flags_the_bench_sets_or_for_several_examples_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_an_examples_short_flag_is_not_taken_for_the_benchs_own():
    args = bench.parse_args(["--only", "ddp", "ddp", "--s", "3"])  # argparse would read `--s` as --steps
    assert args.steps == 40 and args.example_args == ["--s", "3"] and args.only == ["ddp"]


def test_versus_runs_the_example_with_the_other_flags_taking_turns(tmp_path, recorded_launches):
    """`--only deepspeed --zero-stage 2 --versus='--zero-stage 0'`: every round runs the example with each set of
    flags at 1 and 2 ranks (the versus runs with their flags only), the two taking turns going first, and the row
    holds the ratios taken within the round. Commands recorded, not run; the versus runs report 80 samples/s."""
    commands = recorded_launches
    args = bench.parse_args(["--quick", "--only", "deepspeed", "--zero-stage", "2", "--versus=--zero-stage 0"])
    assert args.example_args == ["--zero-stage", "2"] and args.versus_args == ["--zero-stage", "0"]
    orders = []
    for round_no in (1, 2):
        commands.clear()
        row = bench_runs.measure_round(args.only, args, tmp_path / str(round_no), round_no)["examples"][0]
        example = [c for c in commands if DS in " ".join(c)]
        assert len(example) == 4 and all(c[-2:] in (["--zero-stage", "2"], ["--zero-stage", "0"]) for c in example)
        versus = [c for c in example if any(part.endswith("-versus") for part in c)]
        assert len(versus) == 2 and all(c[-2:] == ["--zero-stage", "0"] for c in versus), example
        orders.append(example.index(versus[0]))
        assert row["samples_per_s_1_versus"] == row["samples_per_s_2_versus"] == 80.0
        assert row["versus_speedup_1"] == row["versus_speedup_2"] == pytest.approx(100 / 80)
        assert row["efficiency_versus"] == pytest.approx(80 / (2 * 80))
    assert orders == [2, 0]  # round 1: the bench's flags first; round 2: the versus flags first
    assert bench_overhead.measure_overhead("deepspeed", args, args.versus_args) == pytest.approx([0.01, 0.01])
    overhead = [c for c in commands if c[1].endswith("tools/phases.py")]
    assert overhead and all(c[-2:] == ["--zero-stage", "0"] and c[2].endswith(DS) for c in overhead)


def test_versus_rounds_default_to_an_even_count():
    assert bench.parse_args(["--only", "ddp", "--versus=--seed 3"]).repeat == 4
    assert bench.parse_args(["--only", "ddp"]).repeat == 3


def test_versus_needs_one_example_and_not_the_flags_the_bench_sets(capsys):
    for argv, message in ((["--versus", "--seed 1"], "needs exactly one --only NAME"),
                          (["--only", "ddp", "--versus", "--batch-size 8"], "--batch-size: the bench sets this flag")):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_no_tool_imports_a_lesson_or_builds_its_own_launch_command():
    """Tools run the examples as programs, and only tools/launch.py knows launchers: no other tool (the
    course's tools and the diagnosis chapter's) names a main.py module, a launcher's flags or a port of its own."""
    sources = [*(ROOT / "tools").glob("*.py"), *(ROOT / "diagnose").glob("*.py")]
    assert ROOT / "tools" / "launch.py" in sources
    for source in sources:
        if source.name == "launch.py":  # the one place
            continue
        text = source.read_text()
        words = ["spec_from_file_location", "import_module", "train_epoch", '"--nproc_per_node"', '"--master_port"',
                 '"-np"', '"--num_gpus"', "def free_port", "socket.socket", "29500", "29600"]
        if source.name != "doctor.py":  # its network row resolves the host name (import socket), no port
            words.append("import socket")
        for word in words:
            assert word not in text, (source.name, word)


# --- the transformer chapter (tools/bench_transformer.py) -----------------------------------------------------
def test_transformer_rounds_combine_into_medians_and_ranges(capsys):
    def lesson(per_rank, ceiling):
        return {"tokens_per_s_per_rank": per_rank, "of_ceiling": per_rank / ceiling, "mfu": 0.2,
                "peak_memory_bytes": 900 * 2**20}

    def knob(tokens, peak):
        return {"tokens_per_s": tokens, "first_step_s": 0.3, "step_s": 2048 / tokens, "peak_memory_bytes": peak,
                "mfu": 0.3, "step_vs_plain": 0.0, "memory_vs_plain": 0.0}
    rounds = [{"ceiling": c, "lessons": {"transformer-ddp": lesson(d, c)}, "fsdp_alone_vs_ddp_alone": d / c,
               "knobs": {"plain": knob(t, 800 * 2**20)}} for c, d, t in ((1000, 900, 2048), (800, 700, 1024),
                                                                         (900, 850, 4096))]
    combined = bench_transformer.combine(rounds)
    assert combined["ceiling"] == (900, [800, 1000])
    row = combined["lessons"]["transformer-ddp"]
    assert row["tokens_per_s_per_rank"] == (850, [700, 900])
    assert row["of_ceiling"] == (pytest.approx(0.9), [pytest.approx(0.875), pytest.approx(850 / 900)])
    assert combined["knobs"]["plain"]["step_s"] == (1.0, [0.5, 2.0])
    assert combined["fsdp_alone_vs_ddp_alone"][0] == pytest.approx(0.9)
    report = json.loads(json.dumps({"combined": combined, "repeat": 3, "epochs": 3, "steps": 20, "date": "d"}))
    bench_transformer.print_report(report)
    out = capsys.readouterr().out
    assert "ceiling: 900 (800-1,000) tokens/s per process" in out
    assert "transformer-ddp" in out and "0.90 (0.88-0.94)" in out and "ddp.py alone" in out
    assert "1000" in out.split("plain")[-1]  # the median step, in ms


@pytest.mark.long  # compiling alone takes about 45 s of a core: `make test-all`
def test_the_transformer_bench_measures_each_lesson_and_each_knob_from_its_runs(tmp_path):
    out = tmp_path / "transformer.json"
    check(run(python("tools/bench.py", "--transformer", "--quick", "--out", out), timeout=1200))
    report = json.loads(out.read_text())
    (r,) = report["rounds"]
    assert set(r["lessons"]) == set(bench_transformer.LESSONS) and set(r["knobs"]) == set(bench_transformer.KNOBS)
    for row in r["lessons"].values():
        assert row["of_ceiling"] == pytest.approx(row["tokens_per_s_per_rank"] / r["ceiling"])
        assert 0 < row["mfu"] < 1 and row["peak_memory_bytes"] > 100 * 2**20
    plain = r["knobs"]["plain"]
    for name, row in r["knobs"].items():
        assert row["step_vs_plain"] == pytest.approx(row["step_s"] / plain["step_s"])
        assert row["memory_vs_plain"] == pytest.approx(row["peak_memory_bytes"] / plain["peak_memory_bytes"])
        assert row["peak_memory_bytes"] > 100 * 2**20 and 0 < row["mfu"] < 1, (name, row)
    assert report["combined"]["ceiling"] == [r["ceiling"], [r["ceiling"], r["ceiling"]]]
    assert 0 < r["fsdp_alone_vs_ddp_alone"] < 2


# --- the split lessons (tools/bench_split.py) -----------------------------------------------------------------
def test_split_rounds_combine_into_medians_and_ranges(capsys):
    def row(tokens, ddp, wire, idle=None):
        r = {"tokens_per_s_per_rank": tokens, "wire_bytes": wire, "peak_memory_bytes": 800 * 2**20,
             "vs_ddp": tokens / ddp}
        return r if idle is None else dict(r, idle=idle, idle_theory=0.2)
    rounds = [{"ddp": row(d, d, 2**20), "pp 1f1b": row(p, d, 2**19, idle)}
              for d, p, idle in ((1000, 900, 0.3), (800, 800, 0.25), (900, 450, 0.4))]
    combined = bench_split.combine(rounds)
    assert combined["ddp"]["vs_ddp"] == (1.0, [1.0, 1.0])
    assert combined["pp 1f1b"]["vs_ddp"] == (pytest.approx(0.9), [0.5, 1.0])
    assert combined["pp 1f1b"]["idle"] == (0.3, [0.25, 0.4])
    report = json.loads(json.dumps({"combined": combined, "repeat": 3, "epochs": 3, "steps": 20, "date": "d"}))
    bench_split.print_report(report)
    out = capsys.readouterr().out
    assert "0.90 (0.50-1.00)" in out and "30% (20%)" in out and "1.00" in out.split("ddp")[1]


@pytest.mark.long  # 8 runs at 2 ranks, about 2 minutes: `make test-all`
def test_the_split_bench_measures_every_lesson_against_ddp_from_its_runs(tmp_path):
    out = tmp_path / "split.json"
    check(run(python("tools/bench.py", "--split", "--quick", "--out", out), timeout=900))
    report = json.loads(out.read_text())
    (r,) = report["rounds"]
    assert set(r) == set(bench_split.RUNS)
    for name, row in r.items():
        assert row["vs_ddp"] == pytest.approx(row["tokens_per_s_per_rank"] / r["ddp"]["tokens_per_s_per_rank"])
        assert row["wire_bytes"] > 0 and row["peak_memory_bytes"] > 100 * 2**20, (name, row)
        assert ("idle" in row) == name.startswith("pp") and 0 < row.get("idle", 0.5) < 1, (name, row)
    assert r["tp"]["wire_bytes"] > r["ddp"]["wire_bytes"] > r["pp 1f1b"]["wire_bytes"]  # activations, weights, edges
