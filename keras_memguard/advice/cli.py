"""The `advise` command: `keras-memguard advise MODEL --batch-size N`."""

import argparse
import os
import sys

from keras_memguard import advice as advice_lib

_MIB = 1024 * 1024


def _integers(text, what):
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what} must be integers separated by commas, such as 64,64,3. "
            f"Received: {text!r}"
        ) from None
    return values


def _shape(text):
    shape = _integers(text, "--input-shape")
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(
            f"--input-shape dimensions must be >= 1. Received: {text!r}"
        )
    return shape


def _range(text):
    values = _integers(text, "--input-range")
    if len(values) != 2 or values[0] >= values[1]:
        raise argparse.ArgumentTypeError(
            f"--input-range must be LOW,HIGH with LOW < HIGH. Received: {text!r}"
        )
    return values


def _variants(text):
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n not in advice_lib.VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--variants must be names from {','.join(advice_lib.VARIANTS)}. "
            f"Received: {text!r}"
        )
    return names


def add_arguments(parser):
    """Adds the `advise` command's arguments to an `argparse` parser."""
    parser.add_argument("model", help="a compiled model saved with model.save (.keras)")
    parser.add_argument(
        "--batch-size", type=int, required=True, help="the batch to compare the variants at"
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        metavar="D1,D2,...",
        help="one sample's shape without the batch dimension, e.g. 64,64,3 "
        "(once per input; default: the model's input specs)",
    )
    parser.add_argument(
        "--input-range",
        type=_range,
        metavar="LOW,HIGH",
        help="integer inputs are drawn from [LOW, HIGH) (default: below the "
        "first Embedding layer's input_dim)",
    )
    parser.add_argument(
        "--variants",
        type=_variants,
        metavar="NAME,...",
        help=f"variants to measure (default: all: {','.join(advice_lib.VARIANTS)}); "
        "float32 always runs",
    )
    parser.add_argument("--steps", type=int, default=6, help="training steps per variant (default 6)")
    parser.add_argument(
        "--max-trials", type=int, default=8, help="steps of the largest-batch search (default 8)"
    )
    parser.add_argument(
        "--memory-limit-mib",
        type=float,
        help="the device memory limit in MiB (default: resolved as MemoryGuard does)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the result as JSON to FILE")
    parser.add_argument(
        "--log-dir", metavar="DIR", help="write the JSON to DIR/memguard/advise.json too"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds per variant (default 600)"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print only the table, no line per variant"
    )


def run(args, prog="keras-memguard advise"):
    """Runs the command; returns the exit status.

    0 when float32 was measured (other variants may be "unsupported" or
    "failed", as the table says), 1 when float32 itself failed, 2 for a
    bad argument.
    """
    # The children inherit it: TensorFlow's start-up lines stay out.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    input_shape = args.input_shape
    if input_shape is not None and len(input_shape) == 1:
        input_shape = input_shape[0]
    memory_limit = None
    if args.memory_limit_mib is not None:
        memory_limit = int(args.memory_limit_mib * _MIB)
    try:
        advice = advice_lib.advise(
            args.model,
            args.batch_size,
            input_shape=input_shape,
            input_range=args.input_range,
            variants=args.variants,
            steps=args.steps,
            memory_limit=memory_limit,
            max_trials=args.max_trials,
            json_path=args.json,
            log_dir=args.log_dir,
            timeout=args.timeout,
            verbose=0 if args.quiet else 1,
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    if args.quiet:
        print(advice.table())
    baseline = advice.variants[0]
    return 0 if baseline.status == "ok" else 1
