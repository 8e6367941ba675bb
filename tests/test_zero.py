"""zero/: every ZeRO stage (and offload, and PyTorch's counterparts) trains exactly like stage 0, and the measured
per-rank bytes follow the ZeRO paper's formula. zero/report.py launches zero/main.py once per variant under
torchrun; zero/census.py counts the bytes."""
import json
import sys

import pytest

from support import (
    RANK_0_OF_2,
    ROOT,
    ZERO,
    assert_each_rank_refused,
    check,
    error_lines,
    python,
    run,
    run_rows,
    torchrun,
    warm,
)

sys.path.append(str(ROOT))  # after site-packages (see tests/test_shadowing.py)
from zero.census import formula
from zero.main import VARIANTS

LESSON, REPORT = ZERO, "zero/report.py"
SMALL = ["--hidden", "64", "--layers", "1"]  # ~55k parameters: seconds per launch


MODEL = ["--hidden", "512", "--layers", "2", "--steps", "4", "--lr", "0.003"]  # ~0.9M parameters, 4 Adam steps


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One run of every variant on 2 ranks, started warm (the claims are about what the ranks hold and compute;
    zero/report.py's own torchrun launches: test_the_report_...)."""
    folder, runs = tmp_path_factory.mktemp("zero"), {}
    for variant in VARIANTS:
        out = folder / f"{variant}.json"
        check(run(warm(2, LESSON, "--variant", variant, *MODEL, "--json", out), timeout=300,
                  env={"OMP_NUM_THREADS": "1"}))
        runs[variant] = json.loads(out.read_text())
    return runs


def test_formula_matches_the_paper():
    psi, n = 1000, 4
    assert formula(0, psi, n) == {"params": 4000, "grads": 4000, "optim": 8000}
    assert formula(1, psi, n) == {"params": 4000, "grads": 4000, "optim": 2000}
    assert formula(2, psi, n) == {"params": 4000, "grads": 1000, "optim": 2000}
    assert formula(3, psi, n) == {"params": 1000, "grads": 1000, "optim": 2000}


def test_every_variant_ran_on_two_ranks(results):
    assert set(results) == set(VARIANTS)
    assert all(r["ranks"] == 2 and len(r["per_rank"]) == 2 for r in results.values())
    assert all(sorted(pr["rank"] for pr in r["per_rank"]) == [0, 1] for r in results.values())


def test_every_stage_trains_and_matches_stage_0(results):
    """ZeRO is an exact memory optimisation: the same losses as plain data parallelism, step by step."""
    reference = results["ds0"]["losses"]
    assert len(reference) == 4 and reference[-1] < reference[0]
    for variant, r in results.items():
        assert r["losses"] == pytest.approx(reference, rel=1e-5, abs=1e-6), variant


@pytest.mark.parametrize("variant", ["ds1", "ds2", "ds3"])
def test_optimizer_state_per_rank_is_the_formula(results, variant):
    r = results[variant]
    expected = r["formula"]["optim"]  # 8 Psi / N: Adam's two fp32 moments of this rank's partition
    for rank in r["per_rank"]:
        assert abs(rank["optim"] - expected) <= 0.10 * expected, (variant, rank["optim"], expected)


def test_parameters_are_partitioned_only_at_stage_3(results):
    psi = results["ds0"]["psi"]
    for variant, stage_3 in [("ds0", False), ("ds1", False), ("ds2", False), ("ds3", True), ("torch-fsdp2", True)]:
        expected = 4 * psi / (2 if stage_3 else 1)
        for rank in results[variant]["per_rank"]:
            assert abs(rank["params"] - expected) <= 0.10 * expected, (variant, rank["params"], expected)
    # stage 0 keeps everything: full gradients and full Adam state on every rank
    for rank in results["ds0"]["per_rank"]:
        assert rank["grads"] == pytest.approx(4 * psi, rel=0.1) and rank["optim"] == pytest.approx(8 * psi, rel=0.1)


def test_the_report_launches_each_variant_under_torchrun_and_prints_its_rows(results, tmp_path):
    """zero/report.py as a user runs it, on two of the variants (its loop is the same for each): a torchrun launch
    per variant, whose losses are the warm runs' digit for digit, and a bytes row and a loss line for each."""
    variants, out = ["ds0", "torch-fsdp2"], tmp_path / "report.json"
    stdout = check(run(python(REPORT, "--ranks", "2", "--variants", *variants, *MODEL, "--json", out),
                       timeout=600)).stdout
    reported = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(reported) == variants and all(r["ranks"] == 2 for r in reported.values()), reported
    for variant, r in reported.items():
        assert r["losses"] == results[variant]["losses"], variant
        assert f"| {r['label']} | " in stdout, variant
        assert f"| {variant} | {' '.join(f'{v:.6f}' for v in r['losses'])} | " in stdout, variant


def test_the_lesson_runs_in_one_process_without_a_launcher(tmp_path):
    """No launcher: a process group of one, which DeepSpeed's ZeRO-3 engine needs too; every byte stays here."""
    out = tmp_path / "one.json"
    result = check(run(warm(1, LESSON, "--variant", "ds3", *SMALL, "--steps", "2", "--json", out), timeout=300))
    assert "on 1 rank(s) via python" in result.stdout and "step 2  loss" in result.stdout, result.stdout
    r = json.loads(out.read_text())
    assert r["ranks"] == 1 and [pr["rank"] for pr in r["per_rank"]] == [0] and len(r["losses"]) == 2
    assert r["per_rank"][0]["params"] == pytest.approx(4 * r["psi"], rel=0.1)  # a slice of one is the whole
    assert r["per_rank"][0]["optim"] == pytest.approx(8 * r["psi"], rel=0.1)


def test_bad_input_fails_every_rank_with_one_line():
    result = run(torchrun(2, LESSON, *SMALL, "--variant", "ds4"), timeout=180)
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert errors
    assert_each_rank_refused(result, "--variant", 2, "torchrun")  # one line from each rank torchrun let run
    assert f'File "{ROOT / LESSON}"' not in result.stderr  # no traceback from the lesson (torchrun prints its own)


@pytest.mark.parametrize("script,env,table", [
    (LESSON, RANK_0_OF_2, [(["--steps", "1"], "--steps must be at least 2"),
                           (["--steps", "100"], "needs more than the 4,000 training digits")]),
    (REPORT, None, [(["--ranks", "0"], "--ranks"), (["--hidden", "8"], "--hidden")]),
], ids=["lesson-at-2-ranks", "report"])
def test_more_bad_input_is_one_line_and_exit_2(script, env, table):
    """(All rows of a script in one interpreter: each refusal comes when the flags are parsed.)"""
    outcomes = run_rows(script, [[*SMALL, *flags] if script == LESSON else flags for flags, _ in table], env=env)
    for (flags, words), outcome in zip(table, outcomes):
        assert outcome["code"] == 2, (flags, outcome)
        errors = error_lines(outcome["stderr"])
        assert len(errors) == 1 and words in errors[0], (flags, outcome["stderr"][-3000:])
        assert "Traceback" not in outcome["stderr"], (flags, outcome["stderr"])
