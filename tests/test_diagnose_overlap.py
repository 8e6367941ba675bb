"""diagnose/overlap.py: the same training step communicated several ways, each timed against the
ceiling (no communication) in one run, and the compressed DDP hooks trained on real digits."""

import json

from support import assert_each_rank_refused, check, run, torchrun, warm

TOOL = "diagnose/overlap.py"


def test_variants_run_and_the_compression_hooks_still_learn(tmp_path):
    out = tmp_path / "overlap.json"
    variants = ["none", "per-param", "flat", "ddp", "ddp-cap25", "ddp-fp16", "ddp-powersgd"]
    result = run(
        warm(
            2,
            TOOL,
            "--variants",
            *variants,
            "--steps",
            "3",
            "--rounds",
            "2",
            "--accuracy-epochs",
            "1",
            "--max-steps",
            "25",
            "--json",
            out,
        ),
        timeout=300,
    )
    check(result)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == variants
    assert rows["none"]["efficiency"] == 1.0 and rows["none"]["exposed_s"] == 0.0
    assert (
        rows["ddp"]["buckets"] == 2
        and rows["ddp-cap25"]["buckets"] == 1
        and rows["ddp-powersgd"]["buckets"] == 1
    )
    for v in (
        "ddp",
        "ddp-fp16",
        "ddp-powersgd",
    ):  # 25 steps on real digits, from the same start (chance: 0.1)
        assert rows[v]["same_weights"], v
        assert rows[v]["test_acc"] > 0.5, (v, rows[v]["test_acc"])
    assert "of ceiling" in result.stdout


def test_an_unknown_variant_is_one_error_line_on_every_rank():
    result = run(torchrun(2, TOOL, "--variants", "ddp", "fast"), timeout=120)
    assert_each_rank_refused(result, "fast", 2, "torchrun")
