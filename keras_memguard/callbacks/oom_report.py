"""What the guard says about an out-of-memory error: explained, reported, or raised.

`explain` reads the allocator's latest dump (captured while the guard
runs) into an `OomExplanation`; `report` logs it in one WARNING line and,
with `log_dir`, writes `<log_dir>/memguard/oom-<step>.json`;
`cannot_split_error` is the `MicroBatchTooLargeError` for a batch no
micro-batch count can help; `compiled_step_error` and
`compiled_step_too_large` stop `fit` where an XLA step ran out of memory or
would at every count. Shared by `fit`, `evaluate` and `predict`, on
every backend; each takes the guard's `GuardSession` (`session.py`).
"""

import logging
import math
import os

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard.callbacks import messages
from keras_memguard.errors import CompiledStepOutOfMemoryError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.sinks import tensorboard as tb

logger = logging.getLogger("keras_memguard")

# A refusal suggests a higher `threshold` only where the step would leave
# at least this much of the limit free: at the very top, where the step's
# buffers land decides whether it runs.
MAX_SUGGESTED_THRESHOLD = 0.98


def explain(session, error, batch_size, micro_batches):
    """Why the batch ran out of memory, from the allocator's dump."""
    dump = session.take_latest_dump()
    limits = [limit for limit in session.limits or () if limit]
    return oom_explanation.explain(
        getattr(error, "message", None) or str(error),
        dump,
        session.model,
        step=session.step + 1,
        batch_size=batch_size,
        micro_batches=micro_batches,
        limit_bytes=min(limits) if limits else None,
    )


def report(session, explanation):
    """One WARNING line, and `<log_dir>/memguard/oom-<step>.json`."""
    session.last_oom_explanation = explanation
    text = oom_explanation.describe(explanation)
    if explanation.replayed_with is not None:
        text += f"; replaying with {decider.micro_batches_text(explanation.replayed_with)}"
    log_dir = session.options.log_dir
    if log_dir is not None:
        try:
            path = oom_explanation.write(
                explanation, os.path.join(log_dir, tb.RUN_NAME), text
            )
            text += f" ({path})"
        except OSError as write_error:
            text += f" (not written: {write_error})"
    logger.warning("%s", text)


def cannot_split_error(
    session,
    decided,
    batch_size,
    micro_batches,
    evaluating=False,
    remat_refusal=messages.NO_RUNGS,
    accumulation=None,
):
    """The `MicroBatchTooLargeError` for a batch no count can help.

    `remat_refusal` is `messages.too_large`'s: `None` where the remat rung
    can be used on the model, else why not (training on TensorFlow), or
    `messages.NO_RUNGS`; so is `accumulation`.
    """
    samples = session.read()
    peak = max((s.peak_bytes or 0 for s in samples), default=0) or None
    limit = max((l or 0 for l in session.limits), default=0) or None
    prefix = "Validation: " if evaluating else ""
    if decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE:
        controller = session.controller
        tried = controller.rungs_on + tuple(
            f"{rung} (not possible: {reason})"
            for rung, reason in controller.rungs_refused.items()
        )
        message = messages.too_large(
            batch_size,
            micro_batches,
            peak,
            limit,
            session.options.escalate,
            tried,
            remat_refusal=remat_refusal,
            accumulation=accumulation,
        )
    elif decided.cannot_split == decider.CANNOT_SPLIT_ALLOCATION:
        message = messages.allocation_does_not_shrink(decided.reason, batch_size, peak, limit)
    else:
        message = messages.cap_reached(
            micro_batches, batch_size, evaluating, session.stateful_layers,
            session.whole_step,
        )
    return MicroBatchTooLargeError(prefix + message, peak_bytes=peak, limit_bytes=limit)


# The weights saved under `backup_dir` when an XLA step ran out of memory.
WEIGHTS_FILE = "memguard_out_of_memory.weights.h5"


def save_weights_for_restart(session):
    """Saves the model's weights under `backup_dir`; the path, or `None`."""
    backup_dir = session.options.backup_dir
    if backup_dir is None:
        return None
    path = os.path.join(backup_dir, WEIGHTS_FILE)
    try:
        os.makedirs(backup_dir, exist_ok=True)
        session.model.save_weights(path)
    except Exception as error:  # noqa: BLE001 - the error to raise is the OOM's.
        logger.warning("weights not saved to %s: %s", path, error)
        return None
    return path


def compiled_step_error(session, explanation, weights_path, call="fit"):
    """The `CompiledStepOutOfMemoryError` that ends `call` after an XLA step's OOM."""
    head = (
        f"An XLA-compiled step of `{call}` ran out of memory at step {explanation.step} "
        f"({decider.micro_batches_text(explanation.micro_batches)} of a batch of "
        f"{explanation.batch_size}): {oom_explanation.describe(explanation)}. "
        "After an out-of-memory error inside an XLA program TensorFlow can abort "
        "the process at the next step, so the batch is not "
    )
    if call != "fit":
        message = head + (
            "run again in slices. HINT: pass a smaller `batch_size` to "
            f"`{call}`, or compile with `jit_compile=False`, whose errors the "
            "guard replays in slices."
        )
        return CompiledStepOutOfMemoryError(message, weights_path=None)
    saved = (
        f" The weights were saved to {weights_path}."
        if weights_path
        else " Pass `backup_dir` to have the weights saved at such an error."
    )
    message = head + (
        "replayed; the weights are those after the last batch that completed."
        + saved + " HINT: the guard plans XLA steps from their compiled program "
        "and the memory in use before them, so memory taken while the step ran "
        "(an input pipeline's buffers, another model) was missing: lower "
        "`threshold`, or compile with `jit_compile=False`, whose errors the "
        "guard replays."
    )
    return CompiledStepOutOfMemoryError(message, weights_path=weights_path)


def compiled_step_too_large(
    session, planned, batch_size, in_use_bytes, no_free_block=False, shrinking=False
):
    """The error for an XLA step no count fits, raised before it runs.

    Where the last count fits in total, what stopped it is that its
    buffers found no place in the free memory (`no_free_block`: a probe
    of them failed): said with the largest buffer's size, since a step
    under the target would otherwise read as one that fits. The hint
    offers only what could change the answer: a smaller batch and
    `mode="shrink"` while the step accumulates (without accumulators a
    smaller batch needs less; `shrinking`: the step already updates per
    micro-batch, down to one sample), and a higher `threshold` where the
    step fits under the limit but not under the target.
    """
    limit = session.controller.limit_bytes
    memory = planned.memory
    peak = None if memory is None else (in_use_bytes or 0) + memory.demand_bytes
    no_block = ""
    if planned.fits and no_free_block:
        no_block = (
            "; its buffers at that count (the largest "
            f"{messages.mib_text(memory.largest_allocation_bytes)}, allocated in one "
            "piece) found no place in the free memory, which is in smaller pieces "
            "or is a block the allocator would hand whole to that buffer"
        )
    hints = [] if shrinking else ["a smaller batch", '`mode="shrink"` (no accumulators)']
    leaves_room = peak is not None and limit and peak <= MAX_SUGGESTED_THRESHOLD * limit
    if leaves_room and not no_free_block:
        share = math.ceil(100 * peak / limit) / 100
        hints.append(
            f"`threshold={share:.2f}` or more (the step needs {peak / limit:.0%} of the limit)"
        )
    hints += [
        "less memory held beside the step (weights, optimizer state, input)",
        "mixed precision",
        "`jit_compile=False`",
    ]
    message = (
        f"No micro-batch count fits a batch of {batch_size} in the XLA-compiled "
        f"train step: {planned.reason}, counting the "
        f"{messages.mib_text(in_use_bytes)} in use{no_block}. The step was not "
        "run (an out-of-memory error inside an XLA program can abort the "
        f"process). HINT: {', '.join(hints[:-1])} or {hints[-1]}."
    )
    return MicroBatchTooLargeError(message, peak_bytes=peak, limit_bytes=limit)
