"""What the guard says about an out-of-memory error: explained, reported, or raised.

`explain` reads the allocator's latest dump (captured while the guard
runs) into an `OomExplanation`; `report` logs it in one WARNING line and,
with `log_dir`, writes `<log_dir>/memguard/oom-<step>.json`;
`cannot_split_error` is the `MicroBatchTooLargeError` for a batch no
micro-batch count can help. Shared by `fit`, `evaluate` and `predict`, on
every backend.
"""

import logging
import os

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard.callbacks import messages
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.sinks import tensorboard as tb

logger = logging.getLogger("keras_memguard")


def explain(guard, error, batch_size, micro_batches):
    """Why the batch ran out of memory, from the allocator's dump."""
    dump = guard._dumps.take_latest() if guard._dumps is not None else None
    limits = [limit for limit in guard._limits or () if limit]
    return oom_explanation.explain(
        getattr(error, "message", None) or str(error),
        dump,
        guard.model,
        step=guard._step + 1,
        batch_size=batch_size,
        micro_batches=micro_batches,
        limit_bytes=min(limits) if limits else None,
    )


def report(guard, explanation):
    """One WARNING line, and `<log_dir>/memguard/oom-<step>.json`."""
    guard.last_oom_explanation = explanation
    text = oom_explanation.describe(explanation)
    if explanation.replayed_with is not None:
        text += f"; replaying with {decider.micro_batches_text(explanation.replayed_with)}"
    if guard.log_dir is not None:
        try:
            path = oom_explanation.write(
                explanation, os.path.join(guard.log_dir, tb.RUN_NAME), text
            )
            text += f" ({path})"
        except OSError as write_error:
            text += f" (not written: {write_error})"
    logger.warning("%s", text)


def cannot_split_error(
    guard,
    decided,
    batch_size,
    micro_batches,
    evaluating=False,
    remat_refusal=messages.NO_RUNGS,
):
    """The `MicroBatchTooLargeError` for a batch no count can help.

    `remat_refusal` is `messages.too_large`'s: `None` where the remat rung
    can be used on the model, else why not (training on TensorFlow), or
    `messages.NO_RUNGS`.
    """
    samples = guard._reader.read(guard, None)
    peak = max((s.peak_bytes or 0 for s in samples), default=0) or None
    limit = max((l or 0 for l in guard._limits), default=0) or None
    prefix = "Validation: " if evaluating else ""
    if decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE:
        controller = guard.controller
        tried = controller.rungs_on + tuple(
            f"{rung} (not possible: {reason})"
            for rung, reason in controller.rungs_refused.items()
        )
        message = messages.too_large(
            batch_size,
            micro_batches,
            peak,
            limit,
            guard.escalate,
            tried,
            remat_refusal=remat_refusal,
        )
    elif decided.cannot_split == decider.CANNOT_SPLIT_ALLOCATION:
        message = messages.allocation_does_not_shrink(decided.reason, batch_size, peak, limit)
    else:
        message = messages.cap_reached(micro_batches, batch_size, evaluating)
    return MicroBatchTooLargeError(prefix + message, peak_bytes=peak, limit_bytes=limit)
