"""The `report` command: `keras-memguard report LOG_DIR [--output FILE]`."""

import argparse
import os
import sys
import warnings

from keras_memguard.errors import MissingExtraError
from keras_memguard.report import advice as advice_lib
from keras_memguard.report import events
from keras_memguard.report import summary as summary_lib

OUTPUT_KINDS = (".png", ".html")


def make_report(log_dir, output=None):
    """Summarises the runs under `log_dir` and, with `output`, draws them.

    Under each run's summary comes the result of `keras-memguard advise`
    where the run directory holds one (`<log_dir>/memguard/advise.json`);
    a log directory that holds only that is reported too. A malformed
    advice file is left out with a `UserWarning`.

    Args:
        log_dir: The `log_dir` given to `MemoryMonitor` or `MemoryGuard`
            (or a directory above several), or a `memguard` run directory.
        output: A path ending in `.png` (the drawing) or `.html` (a
            self-contained page with the drawing and the summary), or `None`
            to draw nothing (matplotlib is then not needed). Defaults to
            `None`.

    Returns:
        The summary text.

    Raises:
        FileNotFoundError: If `log_dir` does not exist, or holds neither
            keras_memguard event files nor an advice file.
        ValueError: If `output` does not end in `.png` or `.html`.
        MissingExtraError: If `output` is given and matplotlib is not
            installed.

    Example:

    ```python
    from keras_memguard.report import make_report

    print(make_report("logs", output="memory.html"))
    ```
    """
    kind = None
    if output is not None:
        kind = os.path.splitext(os.fspath(output))[1].lower()
        if kind not in OUTPUT_KINDS:
            raise ValueError(
                "`output` must be a file ending in .png or .html. "
                f"Received: output={os.fspath(output)!r}"
            )
    log_dir = os.fspath(log_dir)
    if not os.path.isdir(log_dir):
        raise FileNotFoundError(f"LOG_DIR {log_dir!r} is not a directory.")
    runs = events.load_runs(log_dir)
    if not runs:
        advice = advice_lib.read_advice(log_dir)
        if advice is not None:
            if output is not None:
                raise FileNotFoundError(
                    f"Nothing to draw under {log_dir!r}: it holds an advice "
                    "file but no keras_memguard event files. HINT: leave out "
                    "--output, or pass the log_dir given to MemoryMonitor."
                )
            return advice_lib.format_advice(advice, indent="")
        raise FileNotFoundError(
            f"No keras_memguard event files under {log_dir!r} (looked for "
            f"*/memguard/events.out.tfevents.*). HINT: pass the log_dir given "
            "to MemoryMonitor or MemoryGuard."
        )
    summaries = [summary_lib.summarize(run) for run in runs]
    parts = []
    for run, summary in zip(runs, summaries):
        parts.append(summary_lib.format_summary(summary))
        advice = advice_lib.read_advice(run.path)
        if advice is not None:
            parts.append(advice_lib.format_advice(advice))
    text = "\n".join(parts)
    if output is not None:
        from keras_memguard.report import plot

        png = plot.png_bytes(runs, summaries)
        if kind == ".png":
            with open(output, "wb") as f:
                f.write(png)
        else:
            title = f"keras_memguard report: {os.path.abspath(log_dir)}"
            with open(output, "w", encoding="utf-8") as f:
                f.write(plot.html_page(title, png, text))
    return text


def add_arguments(parser):
    """Adds the `report` command's arguments to an `argparse` parser."""
    parser.add_argument(
        "log_dir",
        metavar="LOG_DIR",
        help="the log_dir given to MemoryMonitor / MemoryGuard",
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="draw the run to FILE.png, or FILE.html (drawing and summary "
        "in one page); needs matplotlib, which the cpu, gpu and report "
        "extras install",
    )


def run(args, prog="keras-memguard report"):
    """Runs the command on parsed arguments; returns the exit status."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            text = make_report(args.log_dir, args.output)
        except (FileNotFoundError, ValueError, MissingExtraError) as error:
            _print_warnings(caught, prog)
            print(f"{prog}: error: {error}", file=sys.stderr)
            return 1
    _print_warnings(caught, prog)
    print(text)
    if args.output is not None:
        print(f"Wrote {args.output}")
    return 0


def _print_warnings(caught, prog):
    # One line each, as the errors are, not Python's file:line format.
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            print(f"{prog}: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno
            )


def main(argv=None):
    """`keras-memguard report ...` without the command name.

    Args:
        argv: The arguments after `report`. Defaults to `None`:
            `sys.argv[1:]`.

    Returns:
        The exit status: 0, 1 on an error (message on standard error), 2 on
        bad usage.
    """
    parser = argparse.ArgumentParser(
        prog="keras-memguard report",
        description="Summarise and draw a run's memory from its event files.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv), parser.prog)
