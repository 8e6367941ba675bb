"""make figures' diagrams, drawn by code: data versus model parallelism, the all-reduce, one block under
tensor parallelism, ring attention. Each is written to `path` (the course notes show them from assets/)."""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

DPI = 100


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end, text="", color="black", style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, lw=1.2,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.15, text, ha="center", fontsize=7, color=color)


def diagram_parallelism(path):
    """Data parallelism (full model per worker, a slice of the batch each) vs model parallelism (layers split)."""
    layer_colors = ["#9ecae1", "#6baed6", "#4292c6", "#2171b5"]
    data_colors = ["#fdd0a2", "#fdae6b", "#fd8d3c", "#e6550d"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.9))
    for ax in axes:
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 7.5)
        ax.axis("off")
    ax = axes[0]
    ax.set_title("data parallelism: every worker holds the whole model", fontsize=9)
    for r in range(4):
        x = 0.3 + r * 2.45
        _box(ax, x, 5.6, 1.9, 0.7, f"batch slice {r}", data_colors[r])
        for li in range(4):
            _box(ax, x + 0.2, 1.5 + li * 0.8, 1.5, 0.6, f"layer {li + 1}", layer_colors[li], fontsize=7)
        ax.text(x + 0.95, 0.95, f"GPU {r}", ha="center", fontsize=8, weight="bold")
        _arrow(ax, (x + 0.95, 5.6), (x + 0.95, 4.75))
    ax.plot([0.4, 9.6], [0.55, 0.55], color="#31a354", lw=2)
    ax.text(5, 0.1, "all-reduce: average the gradients, every copy takes the same step", ha="center",
            fontsize=8, color="#31a354")
    ax = axes[1]
    ax.set_title("model parallelism: each worker holds some layers", fontsize=9)
    _box(ax, 0.2, 5.6, 2.2, 0.7, "whole batch", "#fdae6b")
    for r in range(4):
        x = 0.3 + r * 2.45
        _box(ax, x + 0.2, 3.0, 1.5, 0.8, f"layer {r + 1}", layer_colors[r])
        ax.text(x + 0.95, 0.95, f"GPU {r}", ha="center", fontsize=8, weight="bold")
        if r < 3:
            _arrow(ax, (x + 1.75, 3.4), (x + 2.6, 3.4), color="#756bb1")
    _arrow(ax, (1.25, 5.6), (1.25, 3.85))
    ax.text(5.2, 4.3, "activations forward, their gradients backward", ha="center", fontsize=8, color="#756bb1")
    ax.text(5, 0.1, "(pipeline: layers split; tensor parallel: each layer split)", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)


def diagram_allreduce(path):
    """Each rank's gradient g_r -> ring all-reduce (reduce-scatter, all-gather) -> the average on every rank."""
    grads = [[0.8, 0.2, 0.5, 0.3], [0.4, 0.6, 0.1, 0.7], [0.6, 0.4, 0.9, 0.1], [0.2, 0.8, 0.5, 0.5]]
    mean = [sum(g[i] for g in grads) / 4 for i in range(4)]
    colors = ["#e6550d", "#31a354", "#3182bd", "#756bb1"]
    fig, ax = plt.subplots(figsize=(9, 3.9))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.7, 6.6)
    ax.axis("off")

    def bars(x0, y0, values, color, label):
        for i, v in enumerate(values):
            ax.add_patch(plt.Rectangle((x0 + i * 0.3, y0), 0.24, v * 1.1, fc=color, ec="black", lw=0.5))
        ax.text(x0 + 0.55, y0 - 0.35, label, ha="center", fontsize=8)

    for r in range(4):
        x = 0.6 + r * 2.9
        bars(x, 4.6, grads[r], colors[r], f"rank {r}: g{r}")
        bars(x, 0.6, mean, "#bdbdbd", f"rank {r}: (g0+g1+g2+g3)/4")
        _arrow(ax, (x + 0.55, 4.15), (x + 0.55, 3.35))
        _arrow(ax, (x + 0.55, 2.55), (x + 0.55, 1.85))
    _box(ax, 0.4, 2.6, 11.2, 0.7, "ring all-reduce: N-1 reduce-scatter steps, then N-1 all-gather steps; "
         "each rank sends 2(N-1)/N x S bytes", "#f0f0f0")
    ax.text(6, 6.35, "after backward: a different gradient on every rank (each saw different data)",
            ha="center", fontsize=9)
    ax.text(6, -0.6, "after the all-reduce: the same average everywhere, so every copy of the model stays identical",
            ha="center", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)


def diagram_tensor_parallel(path):
    """One block under tensor + sequence parallelism at 2 ranks (transformer/tp.py): what each rank holds and
    computes, and the collectives between."""
    colors = ["#9ecae1", "#fdae6b"]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.set_xlim(0, 22)
    ax.set_ylim(-0.6, 6.2)
    ax.axis("off")
    steps = [("norm1\nits T/2 tokens", 1.6), ("q, k, v: columns\nof its heads", 1.9),
             ("attention of\nits heads, all T", 1.9), ("proj: its rows\npartial sums, all T", 2.0),
             ("+ x, norm2\nits T/2 tokens", 1.7), ("MLP fc1: its\n2C columns, GELU", 2.0),
             ("fc2: its rows\npartial sums, all T", 2.0), ("+ x\nits T/2 tokens", 1.5)]
    between = {0: ("all-gather", "#31a354"), 3: ("reduce-\nscatter", "#e6550d"), 4: ("all-gather", "#31a354"),
               6: ("reduce-\nscatter", "#e6550d")}
    for rank, y in ((0, 3.6), (1, 0.6)):
        x = 0.9
        ax.text(0.4, y + 0.55, f"rank {rank}", rotation=90, ha="center", va="center", fontsize=8, weight="bold")
        for i, (text, width) in enumerate(steps):
            _box(ax, x, y, width, 1.1, text, colors[rank], fontsize=7)
            if i < len(steps) - 1:
                label, color = between.get(i, ("", "black"))
                _arrow(ax, (x + width + 0.05, y + 0.55), (x + width + 0.75, y + 0.55), color=color)
                if label and rank == 0:
                    ax.text(x + width + 0.4, 2.45, label, ha="center", va="center", fontsize=7, color=color)
            x += width + 0.8
    ax.text(11, 5.75, "Megatron's layout with sequence parallelism: between the matmuls each rank holds T/2 of the "
            "tokens; around them an all-gather and a reduce-scatter of [B, T, C]", ha="center", fontsize=8)
    ax.text(11, -0.45, "backward: the same collectives, reversed (a reduce-scatter for each all-gather and back); "
            "the norms' weight gradients summed over the ranks", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)


def diagram_ring(path, ranks=4):
    """Ring attention (transformer/cp.py): the keys and values passed round the ranks, and which block of the
    causal attention matrix each rank computes at which step."""
    fig, (ring, grid) = plt.subplots(1, 2, figsize=(9, 4.2))
    ring.set_xlim(-1.6, 1.6)
    ring.set_ylim(-1.6, 1.6)
    ring.set_aspect("equal")
    ring.axis("off")
    ring.set_title("each step: every rank sends the K, V it holds\nto the next, receives the previous rank's",
                   fontsize=9)
    where = [(math.sin(2 * math.pi * r / ranks), math.cos(2 * math.pi * r / ranks)) for r in range(ranks)]
    for r, (x, y) in enumerate(where):
        _box(ring, x - 0.32, y - 0.2, 0.64, 0.4, f"rank {r}\ntokens {r}", "#c6dbef", fontsize=7)
        nx, ny = where[(r + 1) % ranks]
        _arrow(ring, (x * 0.8 + nx * 0.2, y * 0.8 + ny * 0.2), (x * 0.2 + nx * 0.8, y * 0.2 + ny * 0.8),
               color="#756bb1", rad=-0.2)
    ring.text(0, 0, "K, V", ha="center", va="center", fontsize=9, color="#756bb1")
    cmap = plt.get_cmap("viridis", ranks)
    for q in range(ranks):
        for k in range(ranks):
            if k > q:
                grid.add_patch(plt.Rectangle((k, ranks - 1 - q), 1, 1, fc="#f0f0f0", ec="white"))
                continue
            grid.add_patch(plt.Rectangle((k, ranks - 1 - q), 1, 1, fc=cmap(q - k), ec="white", alpha=0.8))
            label = f"step {q - k}" + ("\n(causal\nmask)" if q == k else "")
            grid.text(k + 0.5, ranks - 0.5 - q, label, ha="center", va="center", fontsize=7,
                      color="white" if q - k < ranks / 2 else "black")
    grid.set_xlim(0, ranks)
    grid.set_ylim(0, ranks)
    grid.set_xticks([k + 0.5 for k in range(ranks)], [f"keys of {k}" for k in range(ranks)], fontsize=7)
    grid.set_yticks([ranks - 0.5 - q for q in range(ranks)], [f"rank {q}'s\nqueries" for q in range(ranks)],
                    fontsize=7)
    grid.set_title("rank q computes block (q, k) at step q - k;\nlater tokens' blocks (grey) are skipped", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"[figures] wrote {path}", flush=True)
