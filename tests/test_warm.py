"""Warm ranks (tests/warm.py) are what a launcher would have started: the same process in every way a test can see,
the same environment, the same ending and the same training, digit for digit. Each test here compares a warm start
with a cold one; the rule of which tests may start warm is in tests/README.md, and is enforced by support.run."""
import json
import os
import time

import psutil
import pytest

from support import (
    DDP,
    HVD_KERAS,
    HVD_TF,
    HVD_TORCH,
    QUICK,
    check,
    launch_command,
    metrics,
    run,
    summary,
    warm,
    without_timing,
)

ENDINGS = {  # a script's last act -> (how it ends: the exit code as Popen gives it)
    "ok": "print('done')",
    "exit-7": "raise SystemExit(7)",
    "exit-message": "raise SystemExit('error: said once, exit 1')",
    "exception": "raise ValueError('a traceback, exit 1')",
    "sigterm": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "keyboard-interrupt": "raise KeyboardInterrupt",
    "atexit": "import atexit; atexit.register(print, 'exit handler ran')",
}


def test_a_warm_child_is_a_process_of_its_own(tmp_path):
    """Its own pid and session, the argv, folder, environment and streams it was given, a script run as __main__
    with its folder first on sys.path; buffered output (no PYTHONUNBUFFERED) still arrives; torch was imported
    before the script ran (the one thing that differs, and the point)."""
    script = tmp_path / "lesson dir" / "probe.py"
    script.parent.mkdir()
    script.write_text("""import json, os, sys
print(json.dumps({"name": __name__, "pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
                  "path0": sys.path[0], "mark": os.environ.get("WARM_MARK"), "torch": "torch" in sys.modules,
                  "rank": os.environ.get("RANK")}))
print("on stderr", file=sys.stderr)
open("written", "w").write("a file")
raise SystemExit(7)
""")
    result = run(warm(1, script, "two words", "--x"), cwd=tmp_path, env={"WARM_MARK": "given",
                                                                          "PYTHONUNBUFFERED": ""})
    assert result.returncode == 7, result
    seen = json.loads(result.stdout)
    assert seen["name"] == "__main__" and seen["argv"] == [str(script), "two words", "--x"]
    assert seen["pid"] != os.getpid() and seen["sid"] == seen["pid"]  # a session (and process group) of its own
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(script.parent) and seen["mark"] == "given"
    assert seen["torch"] and seen["rank"] is None  # one process: no launcher's variables
    assert result.stderr == "on stderr\n" and (tmp_path / "written").read_text() == "a file"


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_warm_child_ends_as_the_same_script_under_python(tmp_path, ending):
    """Exit code (a signal's too), what is printed on the way out, exit handlers: as `python script`."""
    script = tmp_path / "end.py"
    script.write_text(f"print('before')\n{ENDINGS[ending]}\n")
    cold = run(launch_command(script, 1, "python"), cwd=tmp_path)
    warmed = run(warm(1, script), cwd=tmp_path)
    assert (warmed.returncode, warmed.stdout) == (cold.returncode, cold.stdout), (warmed, cold)
    assert warmed.stderr.splitlines()[-1:] == cold.stderr.splitlines()[-1:], (warmed.stderr, cold.stderr)


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_warm_ranks_get_the_variables_a_real_launch_gives(tmp_path, launcher):
    """Each rank's environment, less the parent's, is the launcher's for its workers, but for the port's number
    and, for torchrun, the agent's own store and error file (no agent: rank 0 hosts the store, as under mpiexec).
    horovodrun's rendezvous server runs in the test's process."""
    # (each rank writes a file of its own: two ranks' lines of several KB on one pipe can interleave)
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\n"
                      "rank = os.environ.get('RANK', os.environ.get('HOROVOD_RANK'))\n"
                      "with open(os.path.join(sys.argv[1], 'env.' + rank), 'w') as f:\n"
                      "    json.dump(dict(os.environ), f)\n")
    own, port = dict(os.environ), {"torchrun": "MASTER_PORT", "horovodrun": "HOROVOD_GLOO_RENDEZVOUS_PORT"}[launcher]

    def added(result, folder):
        check(result)
        envs = [json.loads(path.read_text()) for path in folder.glob("env.*")]
        assert len(envs) == 2, envs
        return sorted(({k: v for k, v in e.items() if own.get(k) != v and k not in (port, "_")}
                       for e in envs), key=lambda e: e.get("RANK", e.get("HOROVOD_RANK")))

    (tmp_path / "launched").mkdir()
    (tmp_path / "warm").mkdir()
    launched = added(run(launch_command(script, 2, launcher, [tmp_path / "launched"])), tmp_path / "launched")
    if launcher == "torchrun":
        for e in launched:
            assert e.pop("TORCHELASTIC_USE_AGENT_STORE") == "True" and e.pop("TORCHELASTIC_ERROR_FILE")
    as_launcher = {"horovodrun": "horovodrun"}.get(launcher)
    assert added(run(warm(2, script, tmp_path / "warm", launcher=as_launcher)), tmp_path / "warm") == launched


def test_warm_ranks_refuse_a_start_no_launcher_would_make():
    """Warm ranks start as torchrun's or horovodrun's; across nodes as torchrun's, as many on each node."""
    with pytest.raises(ValueError, match="torchrun's .*or horovodrun's, not 'mpiexec'"):
        warm(2, DDP, launcher="mpiexec")
    with pytest.raises(ValueError, match="across nodes start as torchrun's, not 'horovodrun'"):
        warm(2, DDP, launcher="horovodrun", nodes=["course-x-node0", "course-x-node1"])
    with pytest.raises(ValueError, match="the same number on each node, not 3 on 2"):
        warm(3, DDP, nodes=["course-x-node0", "course-x-node1"])


def test_a_warm_run_past_its_timeout_is_killed_and_fails(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(f"import os, time\nrank = os.environ['RANK']\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'pid.' + rank), 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 5s"):
        run(warm(2, script), timeout=5)
    assert time.monotonic() - started < 60
    pids = [int((tmp_path / f"pid.{rank}").read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10  # reaped by the server within its loop's 0.05 s
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(pid) for pid in pids)


@pytest.mark.parametrize("script,launcher,flags", [(DDP, "torchrun", QUICK), (HVD_TORCH, "horovodrun", QUICK),
                                                   (HVD_TF, "horovodrun", [*QUICK, "--dropout", "0"]),
                                                   (HVD_KERAS, "horovodrun", QUICK)],
                         ids=["ddp", "horovod-pytorch", "horovod-tensorflow", "horovod-keras"])  # (shared_run's)
def test_two_warm_ranks_end_as_a_launched_run_digit_for_digit(shared_run, tmp_path, script, launcher, flags):
    """The lesson's QUICK run: the same weights and the same metrics as the 2-rank run under its launcher.
    (TensorFlow's ranks fork from a server of their own, which imported TensorFlow and no torch; the Keras lesson's
    from one that imported it with the variable the lesson sets first, TF_USE_LEGACY_KERAS, and not Horovod's Keras
    module, which the lesson imports after it makes `keras` mean tf_keras: warm.preamble.)"""
    launched = shared_run(script, launcher, flags)[0]
    check(run(warm(2, script, *flags, "--log-dir", tmp_path, launcher={"horovodrun": "horovodrun"}.get(launcher))))
    assert summary(tmp_path)["param_checksums"] == summary(launched)["param_checksums"]
    assert without_timing(metrics(tmp_path)) == without_timing(metrics(launched))


def test_a_test_that_names_a_launcher_and_starts_warm_ranks_must_run_the_launcher_too():
    """The rule (tests/README.md): a claim about a launcher launches it. A test whose id names one may start warm
    ranks (a reference run) only beside a real launch of it; conftest.py fails it after it ran otherwise."""
    from support import launcher_named_but_not_run
    test = "tests/test_x.py::test_every_rank_refuses[ddp-mpiexec]"
    assert "never ran mpiexec" in launcher_named_but_not_run(test, ["warm"])
    assert "never ran mpiexec" in launcher_named_but_not_run(test, ["warm", "torchrun"])
    assert launcher_named_but_not_run(test, ["warm", "mpiexec"]) is None
    assert launcher_named_but_not_run(test, ["mpiexec"]) is None  # (and one that starts nothing warm)
    assert launcher_named_but_not_run("tests/test_x.py::test_it[keras-deepspeed_launcher]", ["warm", "deepspeed"]) \
        is None
    assert launcher_named_but_not_run("tests/test_x.py::test_every_rank_refuses[ddp]", ["warm"]) is None
