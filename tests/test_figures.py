"""tools/figures.py (with figures_plots.py, figures_diagrams.py, figures_runs.py) and the course notes: plots
draw the right data, the grad-accum emulation equals a real larger world, the README's figure commands run, and
every README image exists and every figure is used."""
import json
import re
import shlex

import pytest
import torch

from course.torch_utils import Net
from support import DDP, HVD_TORCH, ROOT, check, metrics, python, run, warm
from tools import figures, figures_plots, figures_runs
from utils.parse_args import clip_flag, get_parser

IMAGE_EXT = (".png", ".svg", ".jpg", ".jpeg", ".gif")


def history(sps, epochs=3, acc0=0.5, epoch_time=None, world_size=1, lr=0.1):
    """A metrics.jsonl history: the first epoch slower (warm-up), the rest at `sps` samples/s."""
    t = epoch_time or 4000 / sps
    return [dict(epoch=e, train_loss=1.0 / e, train_acc=acc0 + 0.1 * e, test_loss=1.0 / e, test_acc=acc0 + 0.1 * e,
                 lr=lr, epoch_time_s=t, train_time_s=t * (2 if e == 1 else 1), samples_per_s=sps / 2 if e == 1 else sps,
                 world_size=world_size, framework="pytorch-ddp", launcher="torchrun") for e in range(1, epochs + 1)]


def approx(values, expected):
    return values == pytest.approx(expected, rel=1e-6)


# --- plotting: small metrics in, each figure out with the right data ------------------------------------------
def test_scaling_plots_draw_the_right_data(tmp_path):
    weak = {1: history(1000), 2: history(1800, world_size=2), 4: history(3000, world_size=4)}
    strong = {1: history(1000), 2: history(1500, world_size=2), 4: history(2000, world_size=4)}
    tables = {"weak (64/rank)": figures_runs.scaling_table(weak),
              "strong (64 global)": figures_runs.scaling_table(strong)}

    data = figures_plots.plot_speedup(tables, tmp_path / "speedup.png", "test")
    assert approx(data["speedup|ideal"][1], [1, 4])
    assert data["speedup|weak (64/rank)"][0] == [1, 2, 4]
    assert approx(data["speedup|weak (64/rank)"][1], [1.0, 1.8, 3.0])  # warm-up epoch 1 is left out
    assert approx(data["speedup|strong (64 global)"][1], [1.0, 1.5, 2.0])

    data = figures_plots.plot_efficiency(tables, tmp_path / "efficiency.png", "test")
    assert approx(data["efficiency|weak (64/rank)"][1], [1.0, 0.9, 0.75])
    assert approx(data["efficiency|strong (64 global)"][1], [1.0, 0.75, 0.5])
    assert approx(data["efficiency|ideal"][1], [1, 1])

    data = figures_plots.plot_epoch_time(tables, tmp_path / "epoch_time.png", "test")
    assert approx(data["time per epoch|weak (64/rank)"][1], [4.0, 4000 / 1800, 4000 / 3000])
    assert approx(data["time per epoch|ideal: weak"][1], [4.0, 2.0, 1.0])

    data = figures_plots.plot_accuracy({"weak": weak, "strong": strong}, tmp_path / "accuracy.png", "test")
    assert data["weak|4 rank(s)"] == ([1.0, 2.0, 3.0], pytest.approx([0.6, 0.7, 0.8]))
    assert set(data) == {f"{p}|{n} rank(s)" for p in ("weak", "strong") for n in (1, 2, 4)}

    sizes, eff = figures_runs.batch_efficiency({8: history(500), 64: history(1000)},
                                          {8: history(600, world_size=2), 64: history(1800, world_size=2)})
    data = figures_plots.plot_batch_efficiency(sizes, eff, tmp_path / "batch.png", "test")
    assert data["efficiency vs batch per rank|2 ranks"] == ([8.0, 64.0], pytest.approx([0.6, 0.9]))

    for name in ("speedup", "efficiency", "epoch_time", "accuracy", "batch"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000


def test_lr_lesson_plot_draws_every_variant(tmp_path):
    runs = {8: {"no warmup": history(1, acc0=0.6, lr=0.08), "warmup 5 epochs": history(1, acc0=0.5, lr=0.08)},
            128: {"no warmup": history(1, acc0=0.0, lr=1.28), "warmup + clip 1": history(1, acc0=0.6, lr=1.28)}}
    data = figures_plots.plot_lr_lesson(runs, tmp_path / "lr.png", "test")
    assert set(data) == {"8 workers (lr 0.08)|no warmup", "8 workers (lr 0.08)|warmup 5 epochs",
                         "128 workers (lr 1.28)|no warmup", "128 workers (lr 1.28)|warmup + clip 1"}
    assert data["128 workers (lr 1.28)|warmup + clip 1"] == ([1.0, 2.0, 3.0], pytest.approx([0.7, 0.8, 0.9]))
    assert (tmp_path / "lr.png").exists()


def write_run(folder, hist, batch_size, device="cuda:0"):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in hist))
    (folder / "config.json").write_text(json.dumps({"batch_size": batch_size, "grad_accum": 1, "device": device}))


def test_from_logs_plots_an_alcf_sweep(tmp_path):
    """submissions/*/scale.sh's layout: runs/<machine>/<example>-scale/<job id>/n<ranks>/."""
    sweep = tmp_path / "runs" / "polaris" / "ddp-scale" / "1234.polaris"
    for n, sps in [(1, 5000), (4, 18000), (8, 32000)]:
        write_run(sweep / f"n{n}", history(sps, world_size=n), batch_size=64)
    assert figures_runs.sweep_kind(figures_runs.find_sweeps(sweep)[sweep]) == "weak (64/rank)"
    drawn = figures.main(["scaling", "--from-logs", str(tmp_path / "runs" / "polaris"), "--out", str(tmp_path / "out")])
    names = sorted(p.name for p in drawn)
    assert names == [f"polaris_scaling_{k}.png" for k in ("accuracy", "efficiency", "epoch_time", "speedup")]
    data = drawn[tmp_path / "out" / "polaris_scaling_speedup.png"]
    assert data["speedup|ddp weak (64/rank)"] == ([1.0, 4.0, 8.0], pytest.approx([1.0, 3.6, 6.4]))
    assert all(p.exists() for p in drawn)


def test_from_logs_names_a_strong_sweep(tmp_path):
    dirs = {}
    for n in (1, 2, 4):
        write_run(tmp_path / f"n{n}", history(1000, world_size=n), batch_size=256 // n)
        dirs[n] = tmp_path / f"n{n}"
    assert figures_runs.sweep_kind(dirs) == "strong (256 global)"


# --- the emulation: 2 ranks x accum 2 == 4 ranks x accum 1 ---------------------------------------------------
def test_grad_accum_equals_a_real_larger_world(tmp_path):
    quick = ["--epochs", "1", "--max-steps", "3", "--batch-size", "8", "--dropout", "0", "--lr", "0.05",
             "--num-threads", "1", "--save-model", "--log-interval", "1000"]
    check(run(warm(2, DDP, *quick, "--grad-accum", "2", "--log-dir", tmp_path / "emulated"), timeout=240))
    check(run(warm(4, DDP, *quick, "--log-dir", tmp_path / "real"), timeout=240))
    emulated = torch.load(tmp_path / "emulated" / "model.pt", weights_only=True)
    real = torch.load(tmp_path / "real" / "model.pt", weights_only=True)
    torch.manual_seed(42)  # the scripts' initial weights (--seed 42): the same CNN, its tensors in the same order
    initial = dict(zip(real, Net(0).state_dict().values()))
    assert metrics(tmp_path / "emulated")[-1]["lr"] == metrics(tmp_path / "real")[-1]["lr"] == pytest.approx(0.2)
    for name in real:
        moved = (real[name] - initial[name]).abs().max().item()
        assert moved > 1e-3, f"{name} hardly trained: the comparison would be vacuous"
        torch.testing.assert_close(emulated[name], real[name], rtol=1e-4, atol=1e-5, msg=name)


def test_the_pipeline_plot_draws_each_ranks_forwards_and_backwards_where_they_ran(tmp_path):
    """plot_pipeline takes pp.py's summary: each rank's (kind, micro-batch, stage, start, end) in seconds of one
    clock; it draws them in ms from the step's first start, one row per rank, one panel per schedule."""
    timeline = [[["F", 0, 0, 10.000, 10.010], ["F", 1, 0, 10.010, 10.020], ["B", 0, 0, 10.050, 10.070]],
                [["F", 0, 1, 10.012, 10.022], ["B", 0, 1, 10.025, 10.045]]]
    summary = {"timeline": timeline, "stages": 2, "micro_batches": 2, "idle_fraction": [0.3, 0.2],
               "idle_fraction_theory": 1 / 3}
    data = figures_plots.plot_pipeline({"1f1b": summary, "gpipe": summary}, tmp_path / "pipe.png", "test")
    assert set(data) == {f"{s}|rank {r}" for s in ("1f1b", "gpipe") for r in (0, 1)}
    assert data["1f1b|rank 0"] == (pytest.approx([0, 10, 50]), pytest.approx([10, 20, 70]))
    assert data["1f1b|rank 1"] == (pytest.approx([12, 25]), pytest.approx([22, 45]))
    assert (tmp_path / "pipe.png").stat().st_size > 5000


# --- the README's commands, with quick flags --------------------------------------------------------------------
QUICK = ["--epochs", "2", "--max-steps", "2", "--batch-size", "32", "--global-batch", "64", "--batch-sizes", "32",
         "--workers", "4", "--rescue-from", "4", "--lr-epochs", "2", "--warmup", "1"]
EXPECTED = ["diagram_parallelism", "diagram_allreduce", "diagram_tensor_parallel", "diagram_ring_attention",
            "pipeline_schedules", "scaling_speedup", "scaling_efficiency",
            "scaling_epoch_time", "scaling_accuracy", "scaling_batch_efficiency", "lr_lesson"]


@pytest.mark.long  # `make test-all`; not in `make test` (CI's time)
def test_make_figures_runs_quick_then_replots(tmp_path):
    """`python tools/figures.py` (what `make figures` calls) end to end, then `--replot` from its logs."""
    out, runs = tmp_path / "assets", tmp_path / "runs"
    result = check(run(python("tools/figures.py", *QUICK, "--out", out, "--runs-dir", runs), timeout=400))
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(EXPECTED)
    assert "efficiency at 2 ranks by batch per rank: 32:" in result.stdout
    assert re.search(r"4 workers: no warmup \d\.\d+ .*warmup 1 epochs .*warmup \+ clip 1 ", result.stdout)
    lesson = metrics(runs / "lr" / "w4-warmup-clip-1")
    assert lesson[-1]["world_size"] == 2 and lesson[-1]["lr"] == pytest.approx(0.04)
    assert json.loads((runs / "lr" / "w4-warmup-clip-1" / "config.json").read_text())["clip_grad_norm"] == 1.0
    for png in out.glob("*.png"):
        png.unlink()
    check(run(python("tools/figures.py", *QUICK, "--out", out, "--runs-dir", runs, "--replot"), timeout=120))
    assert sorted(p.stem for p in out.glob("*.png")) == sorted(EXPECTED)


def test_makefile_figures_target_calls_the_script():
    assert re.search(r"^figures:.*\n\t@?\$\(PY\) tools/figures\.py", (ROOT / "Makefile").read_text(), re.M)


NOTES = ["README.md", "DDP/README.md", "DDP/large-batches.md", "horovod/pytorch/README.md"]


def readme_commands():
    """Shell lines in the ```bash blocks of the notes that run figures.py and the PyTorch lessons (comments and
    continuations joined/stripped)."""
    text = "\n".join((ROOT / page).read_text() for page in NOTES)
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_readme_commands_name_real_flags():
    """Every README command for figures.py or an example's main.py parses with that script's own parser,
    and every `make X` is a Makefile target: the notes cannot drift from the code."""
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    checked = 0
    for line in readme_commands():
        for command in re.split(r";|&&|&", line):
            words = shlex.split(command.replace("<", "").replace(">", ""))
            if not words:
                continue
            if words[0] == "make":
                assert set(words[1:]) <= targets, line
                checked += 1
            scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
            if not scripts:
                continue
            script, flags = words[scripts[0]], words[scripts[0] + 1:]
            if words[0] in ("cp", "diff") or "/" not in script:  # a copy, or the reader's own copy of a lesson
                continue
            assert (ROOT / script).exists(), line
            if script == "tools/figures.py":
                figures.get_parser().parse_args(flags)
                checked += 1
            elif script in (DDP, HVD_TORCH):
                switches = {"--fp16-allreduce", "--use-adasum"}  # Horovod's own flags (and their values)
                valued = {"--backward-passes-per-step", "--gradient-predivide-factor"}
                common = [f for i, f in enumerate(flags) if f.split("=")[0] not in switches | valued
                          and (i == 0 or flags[i - 1] not in valued)]
                clip_flag(get_parser("x")).parse_args(common)
                checked += 1
    assert checked >= 8


# --- images: every one referenced exists, every figure is referenced -----------------------------------------
def readmes():
    skip = {".venv", "runs", ".git", "node_modules", ".pytest_cache"}
    return [p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)]


def referenced_images():
    found = {}
    for md in readmes():
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)|<img [^>]*src=\"([^\"]+)\"", md.read_text()):
            target = next(t for t in target if t)
            if not target.startswith(("http://", "https://")):
                found.setdefault((md.parent / target).resolve(), []).append(md.relative_to(ROOT))
    return found


def test_every_readme_image_exists():
    found = referenced_images()
    assert found, "no README references an image"
    missing = {str(path): where for path, where in found.items() if not path.exists()}
    assert not missing, f"images referenced but missing: {missing}"


def test_every_figure_in_assets_is_referenced():
    found = referenced_images()
    figures_in_assets = [p.resolve() for p in (ROOT / "assets").iterdir() if p.suffix.lower() in IMAGE_EXT]
    unused = [p.name for p in figures_in_assets if p not in found]
    assert not unused, f"figures in assets/ that no README shows: {unused}"
    for p in figures_in_assets:
        assert p.stat().st_size < 400_000, f"{p.name} is large: keep figures small (dpi ~100)"
