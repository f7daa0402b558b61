"""Reads `keras-memguard advise`'s result from a log directory, and its text.

`keras-memguard advise MODEL --log-dir LOG_DIR` writes
`<LOG_DIR>/memguard/advise.json` (`"format": "keras_memguard.advise"`,
version 1): the model's fixed memory, memory per sample and largest batch,
and per variant (`float32`, `mixed_float16`, ...) its status, largest
batch, peak, step time and savings against `float32`. The report reads it
here, against that schema only (keys it does not know are ignored), and
prints it under the run's summary. Pure Python: no TensorFlow.
"""

import json
import numbers
import os
import warnings
from typing import NamedTuple, Optional, Tuple

from keras_memguard.sinks import tensorboard as tb

FILE_NAME = "advise.json"
FORMAT = "keras_memguard.advise"
VERSION = 1
STATUSES = ("ok", "unsupported", "failed")


class AdviceVariant(NamedTuple):
    """One variant of the advice, as in the file's `variants` list.

    Attributes:
        name: The variant (`"float32"`, `"mixed_float16"`, `"remat"`, ...).
        status: `"ok"`, `"unsupported"` or `"failed"`.
        reason: Why it is not `"ok"`, or `None`.
        largest_batch_size: The largest batch that trained in one step.
        peak_mib: The peak at the advised batch (MiB).
        step_seconds: The step time at the advised batch.
        peak_saving: `1 - peak / float32's peak`.
        time_saving: `1 - step time / float32's step time`.
        micro_batches: The micro-batch count the batch trained with, where
            the file gives it, else `None`.
    """

    name: str
    status: str
    reason: Optional[str]
    largest_batch_size: Optional[int]
    peak_mib: Optional[float]
    step_seconds: Optional[float]
    peak_saving: Optional[float]
    time_saving: Optional[float]
    micro_batches: Optional[int] = None


class AdviceResult(NamedTuple):
    """An `advise.json` as the report reads it.

    Attributes:
        path: The file read.
        model: The model path, as given to `advise`.
        batch_size: The batch the variants were compared at.
        device: The device measured (`"GPU:0"`, `"CPU:0"`), or `None`.
        limit_mib: Its memory limit, or `None`.
        fixed_mib: The model's memory whatever the batch, or `None`.
        per_sample_mib: The float32 step's memory per sample, or `None`.
        largest_batch_size: The float32 model's largest batch, or `None`.
        variants: An `AdviceVariant` per variant, in the file's order.
    """

    path: str
    model: Optional[str]
    batch_size: Optional[int]
    device: Optional[str]
    limit_mib: Optional[float]
    fixed_mib: Optional[float]
    per_sample_mib: Optional[float]
    largest_batch_size: Optional[int]
    variants: Tuple[AdviceVariant, ...]


class _Malformed(ValueError):
    pass


def _number(data, key, where, integer=False):
    value = data.get(key)
    if value is None:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        wanted = "an integer" if integer else "a number"
        raise _Malformed(f"{where}`{key}` must be {wanted} or null, not {value!r}")
    return int(value) if integer else float(value)


def _text(data, key, where, required=False):
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise _Malformed(f"{where}`{key}` must be a string, not {value!r}")
    return value


def _variant(data, index):
    where = f"variants[{index}]: "
    if not isinstance(data, dict):
        raise _Malformed(f"{where}a JSON {type(data).__name__}, not an object")
    status = _text(data, "status", where, required=True)
    if status not in STATUSES:
        raise _Malformed(
            f"{where}`status` must be one of {', '.join(STATUSES)}, not {status!r}"
        )
    return AdviceVariant(
        name=_text(data, "name", where, required=True),
        status=status,
        reason=_text(data, "reason", where),
        largest_batch_size=_number(data, "largest_batch_size", where, integer=True),
        peak_mib=_number(data, "peak_mib", where),
        step_seconds=_number(data, "step_seconds", where),
        peak_saving=_number(data, "peak_saving", where),
        time_saving=_number(data, "time_saving", where),
        micro_batches=_number(data, "micro_batches", where, integer=True),
    )


def parse_advice(data, path="advise.json"):
    """Checks an advice object against the schema and returns it.

    Args:
        data: The file's JSON value.
        path: The file it came from, kept in the result. Defaults to
            `"advise.json"`.

    Returns:
        An `AdviceResult`.

    Raises:
        ValueError: If `data` does not follow the schema (the message says
            where).
    """
    if not isinstance(data, dict):
        raise _Malformed(f"a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        raise _Malformed(f"`format` must be {FORMAT!r}, not {data.get('format')!r}")
    version = data.get("version")
    if version != VERSION:
        raise _Malformed(
            f"`version` {version!r} is not one this keras_memguard reads ({VERSION})"
        )
    variants = data.get("variants")
    if not isinstance(variants, list):
        raise _Malformed(f"`variants` must be a list, not {variants!r}")
    return AdviceResult(
        path=os.fspath(path),
        model=_text(data, "model", ""),
        batch_size=_number(data, "batch_size", "", integer=True),
        device=_text(data, "device", ""),
        limit_mib=_number(data, "limit_mib", ""),
        fixed_mib=_number(data, "fixed_mib", ""),
        per_sample_mib=_number(data, "per_sample_mib", ""),
        largest_batch_size=_number(data, "largest_batch_size", "", integer=True),
        variants=tuple(_variant(v, i) for i, v in enumerate(variants)),
    )


def advice_path(log_dir):
    """Where `advise --log-dir log_dir` writes its JSON.

    Args:
        log_dir: A log directory, or its `memguard` run directory.

    Returns:
        `<log_dir>/memguard/advise.json` (or `<log_dir>/advise.json` when
        `log_dir` is itself a `memguard` directory).
    """
    log_dir = os.fspath(log_dir)
    if os.path.basename(os.path.normpath(log_dir)) == tb.RUN_NAME:
        return os.path.join(log_dir, FILE_NAME)
    return os.path.join(log_dir, tb.RUN_NAME, FILE_NAME)


def read_advice(log_dir):
    """Reads `<log_dir>/memguard/advise.json`, if there is one.

    A file that cannot be read or does not follow the schema gives a
    `UserWarning` that names it and says why, and `None`: the rest of the
    report goes on.

    Args:
        log_dir: The `log_dir` given to `keras-memguard advise --log-dir`
            (and to the callbacks), or its `memguard` run directory.

    Returns:
        An `AdviceResult`, or `None` when there is no such file or it is
        malformed.

    Example:

    ```python
    advice = read_advice("logs")
    if advice is not None:
        print(format_advice(advice))
    ```
    """
    path = advice_path(log_dir)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return parse_advice(data, path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # json's errors are ValueErrors
        warnings.warn(
            f"{path} is left out of the report: it is not a readable "
            f"keras-memguard advise result ({error}).",
            stacklevel=2,
        )
        return None


def _percent(value):
    return "-" if value is None else f"{100 * value:+.0f}%"


def _or_dash(value, text):
    return "-" if value is None else text


def format_advice(advice, indent="  "):
    """The advice as text: a header line, the figures, a table of variants.

    Args:
        advice: An `AdviceResult`.
        indent: Put before every line. Defaults to two spaces.

    Returns:
        The text, lines joined with newlines (no trailing newline).
    """
    device = advice.device or "an unknown device"
    limit = "unknown" if advice.limit_mib is None else f"{advice.limit_mib:.1f} MiB"
    head = f"advice ({os.path.basename(advice.path)}): model {advice.model or '?'}"
    if advice.batch_size is not None:
        head += f", batch {advice.batch_size}"
    lines = [f"{head} on {device} (limit {limit})"]
    figures = []
    if advice.fixed_mib is not None:
        figures.append(f"fixed {advice.fixed_mib:.1f} MiB")
    if advice.per_sample_mib is not None:
        figures.append(f"per sample {advice.per_sample_mib:.3f} MiB")
    if advice.largest_batch_size is not None:
        figures.append(f"largest batch {advice.largest_batch_size}")
    if figures:
        lines.append("  " + "; ".join(figures))
    if not advice.variants:
        lines.append("  no variants")
        return "\n".join(indent + line for line in lines)
    with_k = any(v.micro_batches is not None for v in advice.variants)
    header = ["variant", "largest batch", "peak MiB", "step ms", "saving vs float32"]
    if with_k:
        header.append("micro-batches")
    rows = []
    for v in advice.variants:
        if v.status != "ok":
            rows.append([v.name, f"{v.status}: {v.reason or 'no reason given'}"])
            continue
        row = [
            v.name,
            _or_dash(v.largest_batch_size, str(v.largest_batch_size)),
            _or_dash(v.peak_mib, f"{v.peak_mib:.1f}" if v.peak_mib is not None else ""),
            _or_dash(
                v.step_seconds,
                f"{1000 * v.step_seconds:.1f}" if v.step_seconds is not None else "",
            ),
            f"peak {_percent(v.peak_saving)}, time {_percent(v.time_saving)}",
        ]
        if with_k:
            row.append(_or_dash(v.micro_batches, str(v.micro_batches)))
        rows.append(row)
    widths = [len(h) for h in header]
    for row in rows:
        if len(row) == len(header):
            widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells):
        first = cells[0].ljust(widths[0])
        if len(cells) != len(header):  # not ok: the reason, unaligned
            return f"  {first}  {cells[1]}"
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return f"  {first}  {rest}"

    lines.append(line(header))
    lines.extend(line(row) for row in rows)
    return "\n".join(indent + line for line in lines)
