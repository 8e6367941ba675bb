"""make figures' plots: each returns the data it drew, {"panel|label": (x, y)} read back from the axes (what
tests/test_figures.py checks). The diagrams drawn by code: figures_diagrams.py."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

DPI = 100


# --- plots: each returns {"panel|label": (x, y)} read back from the axes -------------------------------------
def plotted(fig):
    return {f"{ax.get_title()}|{line.get_label()}": (list(map(float, line.get_xdata())),
                                                     list(map(float, line.get_ydata())))
            for ax in fig.axes for line in ax.get_lines() if not line.get_label().startswith("_")}


def save(fig, path, title):
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    data = plotted(fig)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
    return data


def plot_speedup(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    top = max(max(t["ranks"]) for t in tables.values())
    lo = min(min(t["ranks"]) for t in tables.values())
    ax.plot([lo, top], [lo, top], "k--", label="ideal")
    for label, t in tables.items():
        ax.plot(t["ranks"], t["speedup"], "o-", label=label)
    ax.set(xlabel="ranks", ylabel="speedup (throughput vs 1 rank)", title="speedup")
    ax.set_xticks(sorted({n for t in tables.values() for n in t["ranks"]}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_efficiency(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ranks = sorted({n for t in tables.values() for n in t["ranks"]})
    ax.plot([ranks[0], ranks[-1]], [1, 1], "k--", label="ideal")
    for label, t in tables.items():
        ax.plot(t["ranks"], t["efficiency"], "o-", label=label)
    ax.set(xlabel="ranks", ylabel="efficiency (speedup / ranks)", title="efficiency", ylim=(0, 1.15))
    ax.set_xticks(ranks)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_epoch_time(tables, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for label, t in tables.items():
        line, = ax.plot(t["ranks"], t["epoch_time_s"], "o-", label=label)
        ideal = [t["epoch_time_s"][0] * t["ranks"][0] / n for n in t["ranks"]]
        ax.plot(t["ranks"], ideal, ":", color=line.get_color(), label=f"ideal: {label.split(' ')[0]}")
    ax.set(xlabel="ranks", ylabel="training time per epoch (s)", title="time per epoch", ylim=(0, None))
    ax.set_xticks(sorted({n for t in tables.values() for n in t["ranks"]}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_accuracy(curves, path, title):
    """curves: {panel: {ranks: history}} -> test accuracy against epoch, one line per rank count."""
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False, sharey=True)
    for ax, (panel, runs) in zip(axes[0], curves.items()):
        for n in sorted(runs):
            ax.plot([m["epoch"] for m in runs[n]], [m["test_acc"] for m in runs[n]], "o-", label=f"{n} rank(s)")
        ax.set(xlabel="epoch", title=panel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    return save(fig, path, title)


def plot_batch_efficiency(sizes, eff, path, title):
    fig, ax = plt.subplots(figsize=(5, 3.6))
    ax.plot([sizes[0], sizes[-1]], [1, 1], "k--", label="ideal")
    ax.plot(sizes, eff, "o-", label="2 ranks")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set(xlabel="batch size per rank", ylabel="efficiency at 2 ranks", title="efficiency vs batch per rank",
           ylim=(0, 1.15))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path, title)


def plot_lr_lesson(runs, path, title):
    """runs: {workers: {variant: history}} -> one panel per worker count, accuracy vs epoch per variant."""
    workers = sorted(runs)
    fig, axes = plt.subplots(1, len(workers), figsize=(3.2 * len(workers), 3.3), squeeze=False, sharey=True)
    styles = {}
    for ax, w in zip(axes[0], workers):
        lr = runs[w][next(iter(runs[w]))][-1]["lr"]
        for variant, history in runs[w].items():
            fmt = styles.setdefault(variant, ["o-", "s-", "^-", "v-"][len(styles) % 4])
            ax.plot([m["epoch"] for m in history], [m["test_acc"] for m in history], fmt, ms=3, label=variant)
        ax.set(xlabel="epoch", title=f"{w} workers (lr {lr:.3g})", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    data = plotted(fig)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
    return data


def plot_pipeline(runs, path, title):
    """Measured pipeline schedules (transformer/pp.py's `timeline`: each rank's forwards F, backwards B and, for
    zero bubble, weight-gradient parts W of one training step) as time lines, one row per rank. Returns
    {"schedule|rank r": (starts, ends)} in ms from the step's first start."""
    colors = {"F": "#6baed6", "B": "#fd8d3c", "W": "#74c476"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.3 * len(runs) + 0.6), squeeze=False)
    data = {}
    for ax, (schedule, s) in zip(axes[:, 0], runs.items()):
        t0 = min(e[3] for events in s["timeline"] for e in events)
        end = max(e[4] for events in s["timeline"] for e in events)
        for rank, events in enumerate(s["timeline"]):
            y = len(s["timeline"]) - 1 - rank
            for kind, chunk, stage, start, stop in events:
                ax.broken_barh([((start - t0) * 1e3, (stop - start) * 1e3)], (y + 0.1, 0.8), fc=colors[kind],
                               ec="black", lw=0.4, alpha=1.0 if stage < len(s["timeline"]) else 0.6)
                ax.text((start + stop - 2 * t0) / 2 * 1e3, y + 0.5, f"{kind}{chunk}", ha="center", va="center",
                        fontsize=6)
            data[f"{schedule}|rank {rank}"] = ([(e[3] - t0) * 1e3 for e in events], [(e[4] - t0) * 1e3
                                                                                    for e in events])
        ax.set_yticks([len(s["timeline"]) - 0.5 - r for r in range(len(s["timeline"]))],
                      [f"rank {r}" for r in range(len(s["timeline"]))], fontsize=7)
        ax.set_xlim(0, (end - t0) * 1e3)
        ax.set_title(f"{schedule}: {s['stages']} stages, {s['micro_batches']} micro-batches; idle share of the "
                     f"run's steps {', '.join(f'{i:.0%}' for i in s['idle_fraction'])} (bubble formula "
                     f"{s['idle_fraction_theory']:.0%})", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms within one training step (F forward, B backward, W weights' gradients; "
                           "paler: a rank's second stage)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
    return data
