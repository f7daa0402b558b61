"""The `keras-memguard` command (also `python -m keras_memguard`).

Commands:

- `report LOG_DIR [--output FILE.png|FILE.html]`: summarise a run's memory,
  micro-batches and out-of-memory recoveries from its TensorBoard event
  files, and draw them (`pip install "keras-memguard[report]"`).
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
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
