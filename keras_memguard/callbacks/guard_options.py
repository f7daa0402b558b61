"""`MemoryGuard`'s arguments, checked: each error names the argument, the value and what is valid."""

import os

from keras_memguard import decider
from keras_memguard.decider import validate_micro_batches
from keras_memguard.backends.tensorflow.probe import AllocatorProbe

MODES = ("accumulate", "auto", "shrink")
# Opt-in rungs past one sample per micro-batch (the `RUNG` of
# `backends/tensorflow/remat.py`).
RUNGS = ("remat",)


def decider_config(
    threshold,
    release,
    mode,
    max_micro_batches,
    cooldown,
    micro_batches,
    memory_limit,
    plan,
    escalate,
    **flags,
):
    """The decider's `Config` for the guard's arguments; raises `ValueError`.

    `flags` are the arguments that must be `True` or `False`.
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    for name, value in dict(flags, plan=plan).items():
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    if isinstance(escalate, str) or not isinstance(escalate, (tuple, list)) or any(
        rung not in RUNGS for rung in escalate
    ):
        raise ValueError(
            f"`escalate` must be a tuple of rung names from {RUNGS}. "
            f"Received: escalate={escalate!r}"
        )
    validate_micro_batches(micro_batches)
    # Validates threshold, release, cooldown and max_micro_batches.
    config = decider.make_config(
        threshold=threshold,
        release=release,
        cooldown=cooldown,
        first_split=micro_batches if micro_batches > 1 else None,
        max_micro_batches=max_micro_batches,
        predictive=plan,
    )
    if max_micro_batches is not None and micro_batches > max_micro_batches:
        raise ValueError(
            "`micro_batches` must not exceed `max_micro_batches`. Received: "
            f"micro_batches={micro_batches}, max_micro_batches={max_micro_batches}"
        )
    if memory_limit is not None:
        AllocatorProbe(memory_limit=memory_limit)  # validates it
    return config


def check_folder(name, value):
    """Raises `ValueError` unless `value` is `None` or a path a folder is at
    or can be made at: argument `name` (`backup_dir`) is written at the end
    of every epoch, and an existing file there stopped `fit` after its first
    epoch with `FileExistsError`."""
    if value is None:
        return
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(
            f"`{name}` must be a folder's path (a str or os.PathLike) or None. "
            f"Received: {name}={value!r}"
        )
    if os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(
            f"`{name}` must be a folder's path; a file is there. "
            f"Received: {name}={os.fspath(value)!r}"
        )
