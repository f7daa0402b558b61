"""Draws the plots of docs/performance.md into docs/plots/.

Run from the repository root: `python3 docs/make_plots.py` (needs matplotlib).

Every figure below is copied from bench/RESULTS.md; the comment above each
names the section it comes from. Nothing is measured here: when a benchmark
is re-run, update its numbers in RESULTS.md first, then here, and run this
script again.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.ticker  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plots")
DPI = 110
BLUE, ORANGE, GREEN, GREY, RED = "#1f77b4", "#ff7f0e", "#2ca02c", "#8c8c8c", "#d62728"


def save(fig, name):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    print("wrote", os.path.relpath(path))


def settled_against_best():
    """Settled micro-batch over the best fixed count, per workload."""
    # (label, first run, cached run or None, best with no error or None).
    # "Best" is the largest micro-batch a fixed count keeps under the guard's
    # 90% threshold, measured by hand.
    rows = [
        # "The same run from an empty plan cache, again and again
        # (2026-11-25)": the other planning workloads re-measured, with the
        # cached runs of "Planning on the decider, re-measured".
        ("CNN, tf.data, batch 272, 600 MiB", 136 / 136, 136 / 136, None),
        ("CNN, tf.data, batch 408, 600 MiB", 136 / 136, 136 / 136, None),
        ("CNN, tf.data, batch 1024, 600 MiB", 147 / 147, 147 / 147, None),
        # "The numpy-fed CNN and EfficientNetB0 against fixed counts in the
        # guard's own conditions (2026-11-25, later)".
        ("CNN, numpy, batch 408, 600 MiB", 82 / 82, 82 / 82, 82 / 102),
        ("CNN, numpy, batch 1024, 600 MiB", 12 / 13, 12 / 13, None),
        # "The same run from an empty plan cache, again and again
        # (2026-11-25)": 6 runs from an empty cache, all settled at 8.
        ("CNN, prefetched pipeline, 89 MiB (6 runs)", 1.00, None, None),
        # "The text's 512-token bucket against the best under the
        # threshold (2026-11-25)".
        ("Text, 512-token bucket, 200 MiB", 86 / 86, 86 / 86, 86 / 128),
        # "keras.applications against the best by hand under the threshold
        # (2026-11-25)".
        ("EfficientNetB0, 169 MiB", 1 / 1, 1 / 1, None),
        ("MobileNetV2, 120 MiB", 1 / 1, 1 / 1, None),
        # Same section and "... in the guard's own conditions (2026-11-25,
        # later)": 2 samples against 5 under 176 MiB.
        ("EfficientNetB0, 176 MiB", 2 / 5, None, None),
        # "Models the tests never use: bench/bench_unseen.py, first figures"
        # and "The grid, second run: the decoders" (2026-11-26).
        ("MobileNetV3Small, 97 MiB", 1 / 1, 1 / 1, None),
        ("Decoder, 90 MiB", 11 / 11, 11 / 11, None),
        ("Decoder, XLA, 100 MiB", 5 / 5, 5 / 5, None),
        ("Decoder, masked loss, 88 MiB", 11 / 11, 11 / 11, None),
        ("Decoder, masked loss, XLA, 138 MiB", 5 / 5, 5 / 5, None),
    ]
    fig, ax = plt.subplots(figsize=(8.2, 6.2))
    ys = list(range(len(rows)))[::-1]
    for y, (label, first, cached, no_error) in zip(ys, rows):
        color = GREEN if first >= 0.95 else (ORANGE if first >= 0.85 else RED)
        ax.barh(y, first, height=0.6, color=color, alpha=0.85)
        ax.text(first + 0.01, y, f"{first:.2f}", va="center", fontsize=8)
        if cached is not None:
            ax.plot([cached], [y], marker="|", color="black", markersize=14, mew=2)
        if no_error is not None:
            ax.plot([no_error], [y], marker="D", color="white", mec="black",
                    markersize=6)
    ax.set_yticks(ys)
    ax.set_yticklabels([r[0] for r in rows], fontsize=8.5)
    ax.set_xlim(0, 1.15)
    ax.axvline(1.0, color=GREY, lw=1, ls="--")
    ax.set_xlabel("settled micro-batch / best fixed micro-batch under the threshold")
    ax.set_title("MemoryGuard's settled micro-batch against the best by hand "
                 "(0 out-of-memory errors in every run)", fontsize=10)
    ax.plot([], [], marker="|", color="black", ls="", markersize=10, mew=2,
            label="cached run (plan cache)")
    ax.plot([], [], marker="D", color="white", mec="black", ls="",
            label="first run against the best that runs without error")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.08), ncol=2, fontsize=8)
    ax.text(0.0, -0.19, "TensorFlow 2.21, Keras 3.15.1, CPU allocator capped "
            "(2 CPU cores, no GPU); 2026-11-25 and 2026-11-26; bench/RESULTS.md",
            transform=ax.transAxes, fontsize=7.5, color=GREY)
    save(fig, "settled-vs-best.png")


def guard_cost():
    """The guard's per-batch cost: hooks in microseconds, whole fits in ratios."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(10.5, 4.2), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    # "Re-measured at the end of the day (2026-11-25, later)": medians of
    # the three runs' per-batch figures, microseconds, in a real TF fit.
    hooks = [
        ("MemoryMonitor,\nafter the step", 25.67),
        ("MemoryGuard,\nafter the step", 14.88),
        ("MemoryGuard,\nbefore the step", 18.85),
    ]
    left_bottom = 0.0
    for (label, us), color in zip(hooks, (BLUE, ORANGE, GREEN)):
        left.bar(0, us, bottom=left_bottom, color=color, width=0.5, label=label)
        left.text(0, left_bottom + us / 2, f"{us:.1f}", ha="center",
                  va="center", fontsize=8, color="white")
        left_bottom += us
    # Same section: "real fit: both callbacks' hooks summed", median run
    # (it also counts the hooks' batch-end calls, not drawn).
    left.text(0, left_bottom + 1, f"{left_bottom:.1f} µs\n(all: 61.3)",
              ha="center", fontsize=8.5)
    # Same section: fit's per-batch path outside a real step.
    path = [("fit's path:\nmonitor + guard", 9.35),
            ("with the guard's\nplanning step", 15.74)]
    for x, (label, us) in enumerate(path, start=1):
        left.bar(x, us, color=GREY, width=0.5)
        left.text(x, us + 1, f"{us:.1f} µs", ha="center", fontsize=9)
    left.set_xticks([0, 1, 2])
    left.set_xticklabels(["real fit:\nhooks, per batch", path[0][0], path[1][0]],
                         fontsize=8)
    left.set_ylabel("µs per batch")
    left.set_ylim(0, 80)
    left.legend(fontsize=7.5, loc="upper right")
    left.set_title("TensorFlow, per batch (2026-11-25)", fontsize=10)

    # "One harness for every backend ... (2026-11-26)", part 1: median
    # per-round wall ratio against plain fit, same batch (B=256).
    cases = ["TF\nMLP", "TF\nCNN", "JAX\nMLP", "JAX\nCNN", "torch\nMLP", "torch\nCNN"]
    series = {
        "no-op batch callback": [1.090, 1.005, 0.948, 1.000, 1.056, 1.001],
        "MemoryMonitor": [1.085, 1.005, 1.018, 1.003, 1.079, 1.037],
        "MemoryGuard k=1 (planning)": [1.080, 1.012, 1.100, 0.996, 1.227, 1.087],
        "MemoryGuard k=1 (fixed)": [1.083, 1.016, 1.145, 0.990, 1.088, 1.096],
    }
    width = 0.2
    for i, ((label, values), color) in enumerate(
        zip(series.items(), (GREY, BLUE, ORANGE, GREEN))
    ):
        xs = [c + (i - 1.5) * width for c in range(len(cases))]
        right.bar(xs, values, width=width, color=color, label=label)
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xticks(range(len(cases)))
    right.set_xticklabels(cases, fontsize=8.5)
    right.set_ylim(0.9, 1.25)
    right.set_ylabel("fit time / plain fit (median per-round ratio)")
    right.set_title("Whole fits against plain fit, k=1 (2026-11-26, shared CPU "
                    "under load)", fontsize=10)
    right.legend(fontsize=7.5, loc="upper left", ncol=2)
    fig.text(0.01, -0.03, "2 CPU cores, no GPU; TensorFlow 2.21, JAX 0.10.2, "
             "torch 2.13 (CPU), Keras 3.15.1.\nThe no-op callback shows the "
             "noise: on TF MLP it 'costs' as much as the guard; torch's MLP wall figures "
             "are noise. bench/RESULTS.md",
             fontsize=7.5, color=GREY)
    fig.tight_layout()
    save(fig, "guard-cost.png")


def guard_against_keras_accumulation():
    """The guard at k micro-batches against Keras' gradient_accumulation_steps=k."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 4.0))
    # "MemoryGuard performance", part 1 (2026-11-22): ratio of median CPU
    # time, guard k of B=256 / Keras GA k fed B/k.
    ks = [2, 4, 8]
    cpu = {"small CNN": [0.900, 0.842, 0.816], "MLP 512-512-10": [0.838, 0.699, 0.562]}
    for (label, values), color in zip(cpu.items(), (BLUE, ORANGE)):
        left.plot(ks, values, marker="o", color=color, label=label)
        for k, v in zip(ks, values):
            left.annotate(f"{v:.2f}x", (k, v), textcoords="offset points",
                          xytext=(6, 4), fontsize=8)
    left.axhline(1.0, color="black", lw=0.8)
    left.axhline(1.05, color=GREY, lw=0.8, ls="--")
    left.text(2, 1.06, "goal: at most 1.05x", fontsize=8, color=GREY)
    left.set_xscale("log", base=2)
    left.set_xticks(ks)
    left.set_xticklabels([str(k) for k in ks])
    left.set_ylim(0.4, 1.15)
    left.set_xlim(1.7, 10.5)
    left.set_xlabel("k (micro-batches of a batch of 256)")
    left.set_ylabel("guard / Keras' accumulation (CPU time)")
    left.set_title("TensorFlow, k = 2, 4, 8 (2026-11-22)", fontsize=10)
    left.legend(fontsize=8, loc="lower left")

    # "One harness for every backend ... (2026-11-26)", part 2: guard k=4
    # of 256 / Keras GA k=4 fed 64; per-round wall ratio and CPU ratio.
    cases = ["TF\nMLP", "TF\nCNN", "JAX\nMLP", "JAX\nCNN", "torch\nMLP", "torch\nCNN"]
    wall = [1.003, 0.933, 0.568, 10.037, 0.931, 1.198]
    cpu4 = [0.708, 0.933, 0.553, 9.914, 0.611, 1.137]
    xs = range(len(cases))
    right.bar([x - 0.18 for x in xs], wall, width=0.36, color=BLUE,
              label="wall (median per-round ratio)")
    right.bar([x + 0.18 for x in xs], cpu4, width=0.36, color=ORANGE,
              label="CPU (ratio of medians)")
    right.axhline(1.0, color="black", lw=0.8)
    right.set_yscale("log")
    right.set_ylim(0.4, 14)
    right.set_yticks([0.5, 1, 2, 5, 10])
    right.set_yticklabels(["0.5x", "1x", "2x", "5x", "10x"])
    right.set_xticks(list(xs))
    right.set_xticklabels(cases, fontsize=8.5)
    right.set_ylabel("guard / Keras' accumulation (log)")
    right.set_title("k=4, every backend (2026-11-26, CPU under load)", fontsize=10)
    right.annotate("XLA:CPU convolutions\ninside a scan", (3, 10.0),
                   xytext=(3.6, 5.0), fontsize=8,
                   arrowprops=dict(arrowstyle="->", color=GREY))
    right.legend(fontsize=7.5, loc="upper left")
    fig.text(0.01, -0.03, "Below 1x the guard is faster. 2 CPU cores, no GPU; "
             "TensorFlow 2.21, JAX 0.10.2, torch 2.13 (CPU), Keras 3.15.1. "
             "bench/RESULTS.md", fontsize=7.5, color=GREY)
    fig.tight_layout()
    save(fig, "guard-vs-keras-accumulation.png")


def memory_against_k():
    """Step peak: the guard at k micro-batches of 256 against plain fit at 256/k."""
    # "MemoryGuard performance", part 2 (2026-11-22): median (min..max) of
    # two processes, MiB.
    ks = [1, 2, 4, 8]
    models = {
        "64x64 CNN (2 x Conv2D(64))": {
            "guard": [788.1, 409.0, 219.2, 120.1],
            "guard_range": [(761.7, 814.4), (395.3, 422.7), (212.9, 225.4), (114.2, 126.0)],
            "plain": [788.0, 400.0, 214.3, 107.4],
            "ticks": [100, 200, 400, 800],
        },
        "32x32 small CNN": {
            "guard": [60.3, 47.0, 44.2, 37.6],
            "guard_range": [(59.6, 61.0), (43.5, 50.4), (41.1, 47.3), (34.9, 40.3)],
            "plain": [60.3, 47.4, 39.0, 34.2],
            "ticks": [35, 40, 50, 60],
        },
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (name, m) in zip(axes, models.items()):
        low = [g - r[0] for g, r in zip(m["guard"], m["guard_range"])]
        high = [r[1] - g for g, r in zip(m["guard"], m["guard_range"])]
        ax.errorbar(ks, m["guard"], yerr=[low, high], marker="o", color=ORANGE,
                    capsize=3, label="guard: k micro-batches of 256")
        ax.plot(ks, m["plain"], marker="s", color=BLUE, ls="--",
                label="plain fit at 256 / k")
        for k, g, p in zip(ks, m["guard"], m["plain"]):
            ax.annotate(f"{g / p:.2f}x", (k, g), textcoords="offset points",
                        xytext=(5, 6), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks(m["ticks"])
        ax.set_yticklabels([str(t) for t in m["ticks"]])
        ax.set_xlabel("k")
        ax.set_ylabel("allocator peak of one step (MiB)")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    fig.text(0.01, -0.03, "TensorFlow 2.21 on the capped CPU allocator, 2 shared "
             "CPU cores, 2026-11-22. bench/RESULTS.md, 'MemoryGuard performance', "
             "part 2", fontsize=7.5, color=GREY)
    fig.tight_layout()
    save(fig, "memory-vs-k.png")


def finder():
    """find_batch_size against a bisection and a doubling search."""
    # "The largest batch: find_batch_size against searches that run out of
    # memory (2026-11-24)" (bisection and power) and its "Re-measured with
    # the secant and the proportional bound" (memguard).
    # (model, method, fraction of the largest, out-of-memory errors, seconds)
    runs = [
        ("CNN", "find_batch_size", 0.96, 0, 6.9), ("CNN", "find_batch_size", 0.94, 0, 5.4),
        ("CNN", "find_batch_size", 0.95, 0, 5.0),
        ("Transformer", "find_batch_size", 0.73, 1, 12.4),
        ("Transformer", "find_batch_size", 0.74, 1, 12.9),
        ("Transformer", "find_batch_size", 0.74, 1, 12.6),
        ("MobileNetV2", "find_batch_size", 0.83, 0, 18.1),
        ("MobileNetV2", "find_batch_size", 0.83, 0, 16.7),
        ("MobileNetV2", "find_batch_size", 0.90, 0, 13.5),
        ("CNN", "bisection", 0.994, 6, 68.8), ("CNN", "bisection", 1.000, 6, 70.8),
        ("Transformer", "bisection", 1.000, 5, 54.8),
        ("Transformer", "bisection", 0.850, 4, 44.8),
        ("MobileNetV2", "bisection", 1.000, 4, 61.2),
        ("MobileNetV2", "bisection", 0.923, 5, 76.5),
        ("CNN", "doubling (power)", 0.790, 1, 14.9), ("CNN", "doubling (power)", 0.790, 1, 15.0),
        ("Transformer", "doubling (power)", 0.640, 1, 12.8),
        ("Transformer", "doubling (power)", 0.640, 1, 13.0),
        ("MobileNetV2", "doubling (power)", 0.615, 1, 35.6),
        ("MobileNetV2", "doubling (power)", 0.615, 1, 31.0),
    ]
    colors = {"find_batch_size": GREEN, "bisection": BLUE, "doubling (power)": ORANGE}
    markers = {"CNN": "o", "Transformer": "^", "MobileNetV2": "s"}
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for model, method, fraction, ooms, seconds in runs:
        ax.scatter(seconds, fraction, color=colors[method], marker=markers[model],
                   s=40 + 25 * ooms, alpha=0.8, edgecolors="black", linewidths=0.5)
    for method, color in colors.items():
        ax.scatter([], [], color=color, marker="o", label=method)
    for model, marker in markers.items():
        ax.scatter([], [], color="white", edgecolors="black", marker=marker, label=model)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([5, 10, 20, 40, 80])
    ax.set_xticklabels(["5", "10", "20", "40", "80"])
    ax.set_xlabel("seconds for the search (log)")
    ax.set_ylabel("batch found / largest that trains")
    ax.set_ylim(0.55, 1.05)
    ax.set_title("Searching the largest batch (marker size: out-of-memory errors, "
                 "0 to 6)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.text(0.0, -0.18, "TensorFlow 2.21, capped CPU allocator, 2 shared CPU cores, "
            "2026-11-24; bisection and power: 2 runs, find_batch_size: 3 runs. "
            "bench/RESULTS.md", transform=ax.transAxes, fontsize=7.5, color=GREY)
    save(fig, "finder.png")


def main():
    settled_against_best()
    guard_cost()
    guard_against_keras_accumulation()
    memory_against_k()
    finder()


if __name__ == "__main__":
    main()
