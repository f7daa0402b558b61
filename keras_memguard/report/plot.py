"""Draws runs with matplotlib (the `report` extra), as PNG or an HTML page.

matplotlib is imported on first use, and through its object-oriented API
only (`matplotlib.figure.Figure`), so drawing neither needs a display nor
changes the backend of a program that calls it.
"""

import base64
import html
import io
import os

from keras_memguard.errors import MissingExtraError

# One run is drawn this size (inches, at DPI): device memory above, the
# host's resident memory in the middle, k below.
WIDTH_IN = 12.0
RUN_HEIGHT_IN = 7.5
DPI = 100
# Heights of the three panels of a run, relative to each other.
PANEL_RATIOS = (3.0, 1.3, 1.0)

INSTALL_HINT = 'pip install "keras-memguard[report]"'


def _figure_class():
    """matplotlib's `Figure`, or a `MissingExtraError` naming the install."""
    try:
        import matplotlib  # noqa: F401  The seam: fails first when missing.
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingExtraError(
            "Drawing the report needs matplotlib, which is not installed "
            f"({error}). HINT: {INSTALL_HINT}",
            extra="report",
        ) from error
    return Figure


def figure_size_pixels(run_count):
    """The PNG's `(width, height)` in pixels for `run_count` runs."""
    count = max(1, run_count)
    return int(WIDTH_IN * DPI), int(RUN_HEIGHT_IN * count * DPI)


def draw(runs, summaries):
    """Draws each run: memory against the limit over steps, host memory, `k`.

    Per run, the upper axes show each device's per-batch peak (solid),
    current (thin), limit (dashed) and, where the growth test ran, its
    floor per epoch (dash-dotted) in MiB, the highest peak marked; the
    middle axes the process's resident host memory (RSS) in MiB, its
    highest point marked; the lower axes the micro-batch count `k` as a
    step line with each change marked. Out-of-memory recoveries are red
    vertical lines, epoch ends grey dotted lines, on all three, and each
    recovery a red cross under `k`.

    Args:
        runs: A list of `RunData`.
        summaries: Their `RunSummary`, in the same order.

    Returns:
        A `matplotlib.figure.Figure` of `figure_size_pixels(len(runs))`.

    Raises:
        MissingExtraError: If matplotlib is not installed.
    """
    Figure = _figure_class()
    count = max(1, len(runs))
    figure = Figure(figsize=(WIDTH_IN, RUN_HEIGHT_IN * count), dpi=DPI)
    grid = figure.add_gridspec(
        3 * count, 1, height_ratios=list(PANEL_RATIOS) * count, hspace=0.5,
        left=0.07, right=0.82, top=1 - 0.05 / count, bottom=0.07 / count,
    )
    colors = [f"C{i}" for i in range(10)]
    for index, (run, summary) in enumerate(zip(runs, summaries)):
        memory = figure.add_subplot(grid[3 * index])
        host = figure.add_subplot(grid[3 * index + 1], sharex=memory)
        ks = figure.add_subplot(grid[3 * index + 2], sharex=memory)
        name = run.name
        if name == ".":
            name = os.path.basename(os.path.dirname(run.path)) or name
        memory.set_title(f"{name}: memory per batch", loc="left", fontsize=11)
        memory.set_ylabel("MiB")
        for number, (device, series) in enumerate(run.devices.items()):
            color = colors[number % len(colors)]
            if series["peak"]:
                memory.plot(series["peak"].steps, series["peak"].values,
                            color=color, linewidth=1.6, label=f"{device} peak")
            if series["current"]:
                memory.plot(series["current"].steps, series["current"].values,
                            color=color, linewidth=0.8, alpha=0.6,
                            label=f"{device} current")
            if series["limit"]:
                memory.plot(series["limit"].steps, series["limit"].values,
                            color=color, linewidth=1.2, linestyle="--",
                            drawstyle="steps-post", label=f"{device} limit")
            if series["floor"]:
                memory.plot(series["floor"].steps, series["floor"].values,
                            color=color, linewidth=1.0, linestyle="-.", marker="s",
                            markersize=3, label=f"{device} floor (per epoch)")
        highest = summary.highest
        if highest is not None:
            memory.plot([highest.peak_step], [highest.peak_mib], marker="v",
                        color="black", linestyle="none",
                        label=f"highest peak (step {highest.peak_step})")
        if not run.devices:
            memory.text(0.5, 0.5, "no memory scalars (MemoryMonitor with log_dir)",
                        ha="center", va="center", transform=memory.transAxes)

        host.set_ylabel("host RSS, MiB")
        if run.host_rss:
            host.plot(run.host_rss.steps, run.host_rss.values, color="C4",
                      linewidth=1.4, label="host RSS (this process)")
            if run.host_floor:
                host.plot(run.host_floor.steps, run.host_floor.values, color="C4",
                          linewidth=1.0, linestyle="-.", marker="s", markersize=3,
                          label="floor (per epoch)")
            if summary.host is not None:
                host.plot([summary.host.peak_step], [summary.host.peak_mib],
                          marker="v", color="black", linestyle="none",
                          label=f"highest (step {summary.host.peak_step})")
            low, high = min(run.host_rss.values), max(run.host_rss.values)
            # From zero would flatten a pipeline's growth on top of the
            # runtime's own resident memory: margins around the values instead.
            margin = max((high - low) * 0.15, high * 0.02, 1.0)
            host.set_ylim(bottom=max(0.0, low - margin), top=high + margin)
            host.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                        frameon=False)
        else:
            host.text(0.5, 0.5, "no host memory scalars (MemoryMonitor with log_dir, "
                      "on Linux)", ha="center", va="center", transform=host.transAxes)
        host.grid(alpha=0.3)

        ks.set_ylabel("micro-batches k")
        ks.set_xlabel("step (batches)")
        if run.micro_batches:
            ks.plot(run.micro_batches.steps, run.micro_batches.values,
                    drawstyle="steps-post", color="C0", label="k")
            if summary.k_changes:
                ks.plot([c.step for c in summary.k_changes],
                        [c.new for c in summary.k_changes], marker="o",
                        color="C0", linestyle="none", label="k changed")
            ks.set_ylim(bottom=0, top=max(run.micro_batches.values) * 1.25 + 0.5)
        else:
            ks.text(0.5, 0.5, "no micro-batch scalars (MemoryGuard with log_dir)",
                    ha="center", va="center", transform=ks.transAxes)

        for axes in (memory, host, ks):
            for number, end in enumerate(summary.epoch_ends):
                axes.axvline(end + 0.5, color="grey", linestyle=":", linewidth=1,
                             label="epoch end" if number == 0 and axes is memory else None)
            for number, recovery in enumerate(summary.recoveries):
                axes.axvline(recovery.step, color="red", linewidth=1.2, alpha=0.7,
                             label="out-of-memory recovery"
                             if number == 0 and axes is memory else None)
        for recovery in summary.recoveries:
            ks.plot([recovery.step], [0], marker="x", color="red", markersize=9,
                    clip_on=False)
            text = "OOM" if recovery.count == 1 else f"OOM x{recovery.count}"
            if recovery.seconds is not None:
                text += f", {recovery.seconds:.1f} s"
            memory.annotate(text, (recovery.step, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(3, -12), textcoords="offset points",
                            color="red", fontsize=8,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        highest_value = max(
            (max(series[key].values) for series in run.devices.values()
             for key in ("current", "peak", "limit", "epoch_peak") if series[key]),
            default=0.0,
        )
        # Headroom above the limit line for the recovery labels.
        memory.set_ylim(bottom=0, top=highest_value * 1.15 or None)
        memory.grid(alpha=0.3)
        ks.grid(alpha=0.3)
        memory.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
        if run.micro_batches:
            ks.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                      frameon=False)
    return figure


def png_bytes(runs, summaries):
    """The drawing (see `draw`) as PNG bytes.

    Raises:
        MissingExtraError: If matplotlib is not installed.
    """
    figure = draw(runs, summaries)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def html_page(title, png, text):
    """A self-contained HTML page: the PNG embedded (base64) and the text.

    Args:
        title: The page title.
        png: PNG bytes.
        text: The summary text, shown preformatted.

    Returns:
        The page as a string.
    """
    encoded = base64.b64encode(png).decode("ascii")
    title = html.escape(title)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n"
        "<style>body{font-family:sans-serif;margin:2em;} "
        "img{max-width:100%;height:auto;} "
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto;}</style>\n"
        "</head>\n<body>\n"
        f"<h1>{title}</h1>\n"
        f'<img alt="memory per batch, micro-batches and out-of-memory recoveries" '
        f'src="data:image/png;base64,{encoded}">\n'
        f"<pre>{html.escape(text)}</pre>\n"
        "</body>\n</html>\n"
    )
