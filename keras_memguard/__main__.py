"""The `keras-memguard` command (also `python -m keras_memguard`).

Commands:

- `report LOG_DIR [--output FILE.png|FILE.html]`: summarise a run's memory,
  micro-batches and out-of-memory recoveries from its TensorBoard event
  files, and draw them (`pip install "keras-memguard[report]"`).
- `advise MODEL.keras --batch-size N`: measure what mixed precision, the
  remat rung and XLA save in peak memory and step time on a saved model,
  each in a process of its own.
"""

import argparse
import sys


def _report(subparsers):
    from keras_memguard.report import cli

    parser = subparsers.add_parser(
        "report",
        help="summarise and draw a run from its event files",
        description="Summarise a run's memory, micro-batches and out-of-memory "
        "recoveries from its TensorBoard event files, and draw them.",
    )
    cli.add_arguments(parser)
    parser.set_defaults(run=lambda args: cli.run(args, parser.prog))


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
