"""The `keras-memguard` command (also `python -m keras_memguard`).

Commands:

- `report LOG_DIR [--output FILE.png|FILE.html]`: summarise a run's memory,
  micro-batches and out-of-memory recoveries from its TensorBoard event
  files, and draw them (with matplotlib, which the `cpu`, `gpu` and
  `report` extras install). It does not import TensorFlow.
- `advise MODEL.keras --batch-size N`: measure what mixed precision, the
  remat rung and XLA save in peak memory and step time on a saved model,
  each in a process of its own.
"""

import argparse
import os
import sys
import types


def _read_events_without_tensorflow():
    """Has TensorBoard's event reader work without importing TensorFlow.

    TensorBoard's reader imports TensorFlow when it is installed: seconds
    of start-up, and TensorFlow's start-up lines on standard error (oneDNN
    and CPU feature notices) before the report. The report reads local
    event files, which TensorBoard's own pure-Python implementation reads
    as well; an importable `tensorboard.compat.notf` is TensorBoard's
    switch to it (the module its `no_tensorflow` build adds). Applied only
    in a process that has not imported TensorFlow, where nothing else can
    have needed it.
    """
    # Should TensorFlow be imported all the same, its INFO and WARNING
    # lines stay out of the output (unless the user asked for them).
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" not in sys.modules:
        name = "tensorboard.compat.notf"
        sys.modules.setdefault(name, types.ModuleType(name))


def _run_report(args, prog):
    from keras_memguard.report import cli

    _read_events_without_tensorflow()
    return cli.run(args, prog)


def _report(subparsers):
    from keras_memguard.report import cli

    parser = subparsers.add_parser(
        "report",
        help="summarise and draw a run from its event files",
        description="Summarise a run's memory, micro-batches and out-of-memory "
        "recoveries from its TensorBoard event files, and draw them.",
    )
    cli.add_arguments(parser)
    parser.set_defaults(run=lambda args: _run_report(args, parser.prog))


def _advise(subparsers):
    from keras_memguard.advice import cli as advice_cli

    parser = subparsers.add_parser(
        "advise",
        help="measure what each memory-saving technique saves on a saved model",
        description="Measure a saved, compiled model's fixed memory, memory per "
        "sample and largest batch, and what mixed_float16, mixed_bfloat16, the "
        "remat rung and jit_compile change in peak memory and step time at "
        "--batch-size, each variant in a process of its own.",
    )
    advice_cli.add_arguments(parser)
    parser.set_defaults(run=lambda args: advice_cli.run(args, parser.prog))


def main(argv=None):
    """Runs `keras-memguard COMMAND ...`.

    Args:
        argv: The arguments, without the program name. Defaults to `None`:
            `sys.argv[1:]`.

    Returns:
        The exit status (0 on success).
    """
    parser = argparse.ArgumentParser(
        prog="keras-memguard",
        description="keras_memguard's command line.",
    )
    subparsers = parser.add_subparsers(metavar="COMMAND", required=True)
    _report(subparsers)
    _advise(subparsers)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
