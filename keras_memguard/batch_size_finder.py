"""The largest batch that trains in `fit`, found with planned trials.

Lightning's `BatchSizeFinder`, accelerate's `find_executable_batch_size`
and transformers' `auto_find_batch_size` search by running out of memory
on purpose (doubling, then halving or bisecting). `find_batch_size` plans
every trial instead from real training steps (the memory in use before
each and its peak). The next trial closes half of the remaining gap
between the largest trial's peak and the target, at the growth per sample
between the last two trials, and never goes past the proportional bound:
the batch at which the peak would reach the target if the step's memory
above the gradients grew in proportion to the batch. A line through small
trials is no guide far beyond them (a workspace that does not grow hides
the samples' memory, which later grows faster than the first trials
showed); the bound is, because a step's fixed part is at least its
gradients. So the search grows geometrically while the peak is flat and
closes in by halves near the top.

It stops when the next step would add less than `tolerance`, or once a
larger trial near the top peaked no higher than the one before (a block
the allocator rounded up then sets the peak, and the batch that outgrows
it jumps past what any line through the peaks can see). Once a trial has
run out of memory, or ran but peaked above the target (a fresh `fit`
holds a few MiB more than a trial, so a step that ran at the very limit
here can fail there), the search bisects between the largest batch that
ran under the target and the smallest that did not, until the middle
gains less than `tolerance`: no line is drawn through peaks read after
an error. Where
the backend says no further trial can run in this process (on TensorFlow,
a temporary a failed step left behind), the search stops there. It
answers from the largest batch that ran, never one it only predicted. The
decider's memory model, fitted to the trials, answers how many
micro-batches a requested batch needs, never fewer than a micro-batch no
larger than a batch that ran.

Each trial runs the model's own train function as `fit` in a fresh
process runs it: made anew at the trial's batch size, fed by Keras' own
data adapter from the user's input (numpy arrays or tensors, a
`keras.utils.PyDataset`, and on TensorFlow a `tf.data.Dataset`), for four
steps (the input repeated where it holds fewer samples: a step's peak can
grow over its first steps), so a custom `train_step`, the input
pipeline's buffers and the arrays `fit` holds are all measured. Each
trial's memory counts from what was in use before it (on TensorFlow) or
before the first trial (on PyTorch, whose CPU memory a trial freed may
stay with the process), so what an earlier trial left behind does not
shrink the answer. Without a
compiled step the answer is the largest batch that ran under the target,
at least a tenth (or `tolerance`, if larger) below the smallest that did
not: at the very top, a batch trains or not depending on where the
prefetched batches and the step's buffers land, and a trial there may
still run out of memory (recovered). Where none failed,
it is the largest batch that ran when the search stopped with the peaks
still growing (the target is then within `tolerance` of it, and its own
peak is under the target), at least a tenth below where the line through
the last peaks reaches the target, and a tenth below it when a larger trial
peaked no higher (a rounded block, past which a few samples more can
fail, or the step's noise: the stalled trial is at the edge either way).
Where `fit` runs a step compiled by XLA, whose buffers are assigned before
it runs, the search reads the compiled step's memory instead: on
TensorFlow with XLA it reads the buffer assignment of the train step at
each batch after one measured trial (itself run only at a batch whose
program fits), and runs one step at the answer (an error in a compiled
program can end the process); on JAX it runs no step
at all, and bisects over `memory_analysis()` of Keras' own train step
compiled for each batch asked about, against the memory in use (or the
step's arguments, where the device keeps no statistics), as `MemoryGuard`
plans on JAX. Before the first trial every weight, optimizer variable
(slots and the step counter) and metric variable is copied; afterwards
all are put back, bit for bit.

The search is the same code on every backend; what it asks of the
backend (a trial step, its out-of-memory error, the compiled step's
memory) is the backend's `finder` module
(`keras_memguard.backends.current().batch_size_finder()`).
"""

import collections.abc
import contextlib
import logging
import time
from typing import NamedTuple, Optional, Tuple

import keras
import numpy as np
from keras import tree

from keras_memguard import backends
from keras_memguard.backends import compat
from keras_memguard import decider
from keras_memguard import keras_models
from keras_memguard import oom_explanation
from keras_memguard.callbacks import messages
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.compiled_plan import plan_micro_batches
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.whole_batches import stateful_layers

__all__ = ["BatchSizeResult", "BatchTrial", "find_batch_size"]

logger = logging.getLogger("keras_memguard")

# The first trial: small enough to fit wherever one sample does, large
# enough that its demand says something about the samples.
FIRST_TRIAL = 4
# Each later trial closes this share of the gap between the usage
# measured and the target.
GAP_SHARE = 0.5
# A peak that stops growing counts as the allocator's rounding only above
# this share of the target.
STALL_SHARE = 0.5
_MIB = 1024 * 1024
# The compiled search's largest step up from a batch that fits.
MAX_GROWTH = 64
# Steps per trial. Batches the input pipeline prefetches take memory
# between steps, and where they land splits the free memory: a step can
# fail after two ran, and a step's peak can grow over the first steps by a
# quarter (bench/RESULTS.md).
TRIAL_STEPS = 4
# Below the smallest batch that failed (ran out of memory or peaked above
# the target), the answer leaves at least this share: a fresh `fit` lays
# its buffers out anew, and where the free memory splits differently a
# batch 7-9% under that edge ran out of memory in a fresh process
# (bench/RESULTS.md).
FRESH_FIT_MARGIN = 0.1


class BatchTrial(NamedTuple):
    """One measured training step of `find_batch_size`.

    On JAX no step runs: a trial is the memory analysis of the train step
    compiled at its batch, `predicted_peak_bytes` what that analysis says
    the step needs beside what is in use, and `peak_bytes` the same where
    it fits under `threshold` of the limit (`None` where it does not).

    Attributes:
        batch_size: Samples in the step.
        in_use_bytes: Memory in use right before the step.
        predicted_peak_bytes: The peak predicted before it ran, or `None`
            for the first trial.
        peak_bytes: The measured peak, or `None` if the step ran out of
            memory.
        seconds: Wall time of the step (the first of a batch shape includes
            tracing).
    """

    batch_size: int
    in_use_bytes: float
    predicted_peak_bytes: Optional[float]
    peak_bytes: Optional[float]
    seconds: float


class BatchSizeResult(NamedTuple):
    """What `find_batch_size` found.

    Attributes:
        largest_batch_size: The batch to train with. On XLA (and on JAX,
            where no step runs), the largest
            whose compiled step fits under `threshold` of the limit (a step
            at it ran on TensorFlow). Otherwise the largest batch whose
            trial steps ran under `threshold` of the limit, at least a
            tenth (or `tolerance`, if larger) below the smallest that did
            not (where none did: that batch, at least a tenth below where
            the line through the last peaks reaches the target, or a tenth
            below it when the peaks stopped growing; on PyTorch, that
            batch): at the very top, whether a
            batch trains depends on where the input pipeline's batches
            land in TensorFlow's allocator.
        measured_peak_bytes: The measured peak of the largest trial that ran.
        predicted_peak_bytes: The peak the memory model predicts for it.
        limit_bytes: The device memory limit searched against.
        in_use_bytes: Memory in use before a step (weights, optimizer
            slots and anything else held), as measured before the last trial.
        fixed_bytes: The step's own memory that does not grow with the
            batch (gradients and temporaries), from the memory model.
        bytes_per_sample: The step's memory per sample, from the model.
        batch_size: The batch asked about, or `None`.
        micro_batches: The micro-batch count `MemoryGuard` would plan for
            `batch_size` (1 when it fits whole), or `None` (no `batch_size`
            given, or on JAX under `keras.distribution`, where batches are
            not split, one that does not fit whole).
        trials: Every `BatchTrial`, in order.
        out_of_memory_errors: Trials that ran out of memory (each a
            prediction that was wrong; 0 in the normal case).
    """

    largest_batch_size: int
    measured_peak_bytes: float
    predicted_peak_bytes: float
    limit_bytes: float
    in_use_bytes: float
    fixed_bytes: float
    bytes_per_sample: float
    batch_size: Optional[int]
    micro_batches: Optional[int]
    trials: Tuple[BatchTrial, ...]
    out_of_memory_errors: int


def find_batch_size(
    model,
    x,
    y=None,
    sample_weight=None,
    batch_size=None,
    threshold=0.95,
    tolerance=0.05,
    max_batch_size=None,
    max_trials=8,
    memory_limit=None,
    verbose=1,
):
    """Finds the largest batch that trains in one step on this device.

    Runs a few planned trials of four training steps on `x` (repeated
    where it holds fewer samples than four batches), each at a batch whose
    predicted peak stays under `threshold` of the memory limit, and
    returns the batch to train with (see `BatchSizeResult`). The model's weights, optimizer
    state (slots and step counter) and metrics are restored exactly
    afterwards. Call it after `compile`, on the device training will use.

    Args:
        model: A compiled Keras model.
        x: The input `fit` will get: a numpy array or tensor, or a list or
            dict of them (at least one sample), a batched `tf.data.Dataset`
            (on TensorFlow; re-batch it at the answer) or a
            `keras.utils.PyDataset` (make it with the answer as its batch
            size).
        y: Targets, in the same form as array `x`, or `None` (always `None`
            with a dataset). Defaults to `None`.
        sample_weight: Sample weights, or `None`. Defaults to `None`.
        batch_size: A batch you plan to train with, or `None`. When given,
            the result also says how many micro-batches `MemoryGuard` would
            split it into (1 when it fits whole). Defaults to `None`.
        threshold: The share of the limit a trial's peak may reach, in
            (0, 1]. Defaults to `0.95`.
        tolerance: Stop when the predicted largest batch is within this
            share of the largest measured one, in (0, 1). Defaults to `0.05`.
        max_batch_size: The largest batch to consider, or `None` for no
            bound. Defaults to `None`.
        max_trials: At most this many training steps, an integer >= 2. On
            JAX, where no step runs, the compiled analyses are not bounded
            by it. Defaults to `8`.
        memory_limit: The device memory limit in bytes, or `None` to
            resolve it as `MemoryGuard` does. A trial that peaks above it
            counts as one that ran out of memory. Required on JAX's CPU
            (no memory statistics) and on PyTorch's CPU without a cgroup or
            address-space limit. Defaults to `None`.
        verbose: `1` logs each trial at INFO level, `0` is silent.
            Defaults to `1`.

    Returns:
        A `BatchSizeResult`.

    Raises:
        ValueError: If an argument is out of range, the model is not
            compiled, or `x` is not input the search can batch again (a
            generator, a dataset of single samples), holds no sample, or
            holds another number of samples than `y` or `sample_weight`.
        MemoryLimitUnknownError: If no memory limit can be resolved.
        MicroBatchTooLargeError: If a step of one sample does not fit.
        UnsupportedTrainingSetupError: If `model` is not a Keras 3 model,
            or its train step raises on a batch the search tries (code that
            assumes the batch size), or the model has stateful layers,
            which fix its batch size; on JAX, if the device gives no
            memory analysis of a compiled step.

    Example:

    ```python
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    result = keras_memguard.find_batch_size(model, x_train, y_train, batch_size=1024)
    print(result.largest_batch_size, result.micro_batches)
    model.fit(x_train, y_train, batch_size=result.largest_batch_size)
    ```
    """
    keras_models.check_model(model, "find_batch_size")
    if not model.compiled:
        # What `fit` says; without it the search failed on a missing
        # optimizer.
        raise ValueError(
            "find_batch_size needs a compiled model: call `model.compile(...)` "
            "first, as before `fit`. Received: a model that was not compiled"
        )
    _validate(threshold, tolerance, max_batch_size, max_trials, batch_size, verbose)
    stateful = stateful_layers(model)
    if stateful:
        raise UnsupportedTrainingSetupError(
            messages.stateful_search_refused(type(model).__name__, stateful)
        )
    protocol = backends.current()
    backend = protocol.batch_size_finder()
    source = _TrialInput(x, y, sample_weight, backend)
    probe = protocol.make_probe()
    # No warning about a limit the probe cannot read when it is given here.
    probe.limits_given_elsewhere(memory_limit)
    limits = [l for l in resolve_limits(probe, memory_limit) if l]
    if not limits:
        raise MemoryLimitUnknownError(
            "find_batch_size needs the device memory limit, which could not "
            f"be read for {probe.devices}{backend.LIMIT_UNKNOWN}. HINT: pass "
            "memory_limit=<bytes>."
        )
    limit = float(min(limits))
    target = threshold * limit
    backend.prepare_process(probe)
    first = source.first_sample()
    with _refused_where_the_step_fails(model, 1, backend, first=True):
        backend.build_state(model, first)
    sample_size = backend.sample_size(first) or 1.0
    if backend.SEARCH == "compiled":
        return _compiled_search(
            model, backend, probe, first, limit, threshold, max_batch_size,
            batch_size, sample_size, verbose,
        )
    saved = _save_state(model)
    # What a fresh process holds before `fit` builds its input: the memory
    # in use before the first trial. Later trials are measured from the
    # memory in use before each, so what an earlier one left behind (traced
    # functions, pieces of its input) does not count against the answer.
    baseline = None
    compiled = backend.uses_compiled_step(model)
    config = decider.make_config(threshold=threshold)
    state = decider.init(
        config,
        fixed_bytes=backend.gradient_bytes(model),
        sample_bytes=oom_explanation.layer_output_bytes(model),
    )
    upper = max_batch_size or float("inf")
    # The gradients: memory every step holds at once, whatever the batch.
    floor = backend.gradient_bytes(model)
    trials = []
    errors = 0
    best = None  # (batch_size, peak, predicted)
    failed = None  # The smallest batch that ran out of memory.
    # Where the line through peaks that still grow reaches the target.
    line_edge = None
    try:
        size = int(min(FIRST_TRIAL, upper))
        predicted = None
        if compiled:
            size = _first_compiled_trial(model, backend, probe, source, size, target, limit)
        while len(trials) < max_trials:
            try:
                with _refused_where_the_step_fails(model, size, backend):
                    in_use, input_bytes, peak, seconds = backend.run_trial(
                        model, probe, source, size
                    )
            except backends.TrialsCannotGoOn as stopped:
                logger.warning(
                    "find_batch_size: stopped after %d trials, before batch %d: "
                    "%s. The answer comes from the trials that ran.",
                    len(trials), size, stopped,
                )
                break
            if baseline is None:
                baseline, fit_input_bytes = in_use, input_bytes
            elif peak is not None and backend.PEAK_FROM_IN_USE:
                peak = baseline + (peak - in_use)
            in_use = baseline
            trial = BatchTrial(size, in_use, predicted, peak, seconds)
            trials.append(trial)
            if verbose:
                _log_trial(trial, limit)
            if peak is not None and peak > limit and not (compiled and trials[1:]):
                # It ran only because the device has more than the limit
                # asked about (`memory_limit`): as good as out of memory.
                peak = None
            elif peak is None:
                errors += 1
            if peak is not None and peak <= in_use and len(trials) == 1:
                # The step's own memory read nothing: every batch would look
                # free, and the next trial as large as an integer goes.
                raise UnsupportedTrainingSetupError(
                    f"find_batch_size cannot measure the training step on "
                    f"{', '.join(probe.devices)}: batch {size} peaked at "
                    f"{peak / _MIB:.1f} MiB with {in_use / _MIB:.1f} MiB in use "
                    "before it, so the step's own memory read 0 bytes and no "
                    f"batch size can be told from another. {backend.NOTHING_MEASURED}"
                )
            if peak is None:
                if size <= 1:
                    raise MicroBatchTooLargeError(
                        "One sample does not fit in one training step: it ran out "
                        f"of memory with {in_use / _MIB:.1f} MiB of "
                        f"{limit / _MIB:.1f} MiB in use before it. HINT: use mixed "
                        "precision, a smaller model or input, or "
                        "MemoryGuard(escalate=('remat',)).",
                        limit_bytes=limit,
                    )
                _, state = decider.fail(
                    config,
                    state,
                    decider.Failure(size, 1, sample_size, in_use, limit),
                )
                upper = size - 1
                failed = size if failed is None else min(failed, size)
            else:
                _, state = decider.observe(
                    config,
                    state,
                    decider.Reading(size, 1, sample_size, in_use, peak, limit),
                )
                if peak > target and not compiled:
                    # It ran, but at the very top: a fresh `fit` holds a few
                    # MiB more than the trial (its prefetched batches), so a
                    # batch that ran here can fail there. It bounds the
                    # search as a failure would, without counting as one.
                    upper = size - 1
                    failed = size if failed is None else min(failed, size)
                elif best is None or size > best[0]:
                    best = (size, peak, predicted)
            if failed is not None and best is not None:
                # The edge is between the largest batch that ran and the
                # smallest that did not: the middle next, while that gains
                # more than `tolerance`. No line through the peaks: one can
                # overshoot the edge, and a trial after an error can peak far
                # above the line through the trials before it
                # (bench/RESULTS.md), so a line would also stop short of it.
                middle = (best[0] + failed) // 2
                gain = best[0] * (1.0 + tolerance)
                ceiling = _below_failure(failed, tolerance)
                if backend.TOP_VARIES and middle >= ceiling:
                    # Nothing larger is answered (the margin below a
                    # failure): that batch next, if any larger than the best.
                    middle, gain = ceiling, best[0]
                if compiled or middle <= gain:
                    break
                size, predicted = middle, None
                continue
            if compiled and best is not None and len(trials) == 1:
                # XLA assigns the step's buffers before it runs: the search
                # reads them instead of running steps, and one step at the
                # answer confirms it (an error inside an XLA program can
                # leave the process unable to go on).
                room = target - baseline - fit_input_bytes
                found, needed = backend.largest_compiled(model, source, room, best[0], upper)
                if found is None:
                    compiled = False  # Not readable here: measure instead.
                elif found <= best[0]:
                    break
                else:
                    size, predicted = found, baseline + fit_input_bytes + needed
                    continue
            if compiled and len(trials) > 1:
                break
            if backend.PEAK_STALL_IS_ROUNDING and _peaks_stalled(trials, target):
                # A larger batch peaked no higher: a block the allocator
                # rounded up, not the samples, sets the peak here, and the
                # batch that outgrows it jumps past any line (a few samples
                # more can run out of memory far above the plateau). No
                # further guesses.
                break
            measured = best[0] if best else 0
            slope = _secant(trials)
            bound = _proportional_bound(best, in_use, floor, target)
            largest = min(
                _batch_for(target, state, best, slope, sample_size, in_use, upper), bound
            )
            if largest <= measured * (1.0 + tolerance) or largest < 1:
                # The target is within `tolerance` of the largest batch
                # that ran, by a line through peaks that still grow.
                if best is not None:
                    line_edge = _line_edge(best, slope, target, largest, upper, bound)
                break
            # Close half of the gap: a slope off by less than that stays
            # under the target.
            reached = best[1] if best else in_use
            step_target = reached + GAP_SHARE * (target - reached)
            size = _batch_for(step_target, state, best, slope, sample_size, in_use, upper)
            # Never past the proportional bound: a peak can grow faster
            # than the trials so far showed.
            size = min(max(size, measured + 1), bound)
            if size == float("inf"):
                size = 2 * measured  # Neither a slope nor a bound: double.
            size = int(size)
            if size <= measured:
                break
            if size == bound:
                predicted = _proportional_peak(best, in_use, floor, size)
            elif slope:
                predicted = best[1] + slope * (size - measured)
            else:
                predicted = in_use + _predicted(state, size, sample_size)
    finally:
        _restore_state(model, saved)
        # A train function not yet traced, as `fit` in a fresh process has.
        model.make_train_function(force=True)
    if best is None:
        raise MicroBatchTooLargeError(
            f"No trial step ran without running out of memory ({len(trials)} "
            f"tried, the smallest at batch {min(t.batch_size for t in trials)}; "
            f"limit {limit / _MIB:.1f} MiB). HINT: free memory held beside the "
            "model, or use mixed precision or a smaller model.",
            limit_bytes=limit,
        )
    fitted = _line(state)
    last_in_use = trials[-1].in_use_bytes
    largest, peak, predicted = best
    if not compiled and backend.TOP_VARIES:
        largest = _answer_below_edge(largest, failed, line_edge, tolerance)
    micro_batches = None
    if batch_size is not None:
        decided, _ = decider.plan(
            decider.make_config(),
            state._replace(micro_batches=1),
            decider.Batch(batch_size, sample_size, last_in_use, limit),
        )
        # Never a micro-batch larger than a batch that ran.
        micro_batches = (
            1 if batch_size <= largest
            else max(decided.micro_batches, -(-batch_size // largest))
        )
    return BatchSizeResult(
        largest_batch_size=largest,
        measured_peak_bytes=peak,
        predicted_peak_bytes=predicted if predicted is not None else peak,
        limit_bytes=limit,
        in_use_bytes=last_in_use,
        fixed_bytes=fitted[0],
        bytes_per_sample=fitted[1] * sample_size,
        batch_size=batch_size,
        micro_batches=micro_batches,
        trials=tuple(trials),
        out_of_memory_errors=errors,
    )


@contextlib.contextmanager
def _refused_where_the_step_fails(model, size, backend, first=False):
    """Turns the model's own error at a batch of `size` (one of the
    backend's `STEP_ERRORS`) into a refusal that says what a search cannot
    do with it. `first`: the step that builds the training state, before
    any trial, where an input `fit` cannot train either fails too."""
    try:
        yield
    except Exception as error:
        own = compat.error_behind_build(error)
        if not isinstance(own, backend.STEP_ERRORS):
            raise
        raise UnsupportedTrainingSetupError(
            messages.code_batch_search_refused(type(model).__name__, size, own, first)
        ) from error


def _below_failure(failed, tolerance):
    """The largest batch answered below `failed`, a batch that did not fit."""
    return int(failed * (1.0 - max(tolerance, FRESH_FIT_MARGIN)))


def _answer_below_edge(largest, failed, line_edge, tolerance):
    """The answer under `largest`, the largest trial that ran, without XLA.

    At the top, whether a batch trains depends on where the input
    pipeline's prefetched batches and the step's buffers land in memory:
    the same batch can run in one fresh process and fail in the next, and
    a trial a few MiB under the target is at that edge. The margin for
    that: `FRESH_FIT_MARGIN` (or `tolerance`, if larger) below the smallest
    batch that failed or peaked above the target (`failed`) where one did,
    else below `line_edge`, where the line through peaks that still grow
    reaches the target (within `tolerance` above the largest trial, or
    further where only `max_batch_size` stopped the search), else (a larger
    trial peaked no higher: the allocator's rounding, or a peak that moves
    by more than the samples add) the same margin below the largest that
    ran: a stalled trial is at the edge too. Never above the largest that
    ran.
    """
    if largest <= 1:
        return largest
    if failed is not None:
        edge = _below_failure(failed, tolerance)
    elif line_edge is not None:
        edge = _below_failure(line_edge, tolerance)
    else:
        edge = _below_failure(largest, tolerance)
    return max(1, min(largest, edge))


def _line_edge(best, slope, target, under_target, upper, bound):
    """The batch, fractional, at which the trials' peaks reach `target`, or `None`.

    Along the secant through the last trials; where there is none yet, the
    decider's line (`under_target`, its largest batch under the target, unless
    `upper` capped it). Never below the largest trial that ran, never past
    the proportional `bound`; `None` where nothing says the target is near
    (a peak that did not rise, a search capped by `upper`).
    """
    if slope is None:
        edge = under_target if under_target < upper else bound
    elif slope > 0:
        edge = best[0] + max(target - best[1], 0.0) / slope
    else:
        edge = bound
    edge = min(edge, bound)
    return None if edge == float("inf") else max(edge, float(best[0]))


def _in_use_now(probe):
    """The most memory in use on any of the probe's devices now, or `None`."""
    in_use = [s.current_bytes for s in probe.sample() if s.current_bytes is not None]
    return float(max(in_use)) if in_use else None


def _first_compiled_trial(model, backend, probe, source, size, target, limit):
    """The first trial's batch on XLA: `size`, or less where its program does not fit.

    An out-of-memory error inside an XLA program can end the process, so
    even the first trial runs only at a batch whose compiled step fits
    beside what is in use (XLA's buffer assignment, read without running
    it). Where the program cannot be read here, `size`.
    """
    in_use = _in_use_now(probe) or 0.0
    room = target - in_use
    found, needed = backend.largest_compiled(model, source, room, size, size)
    if found is None or needed <= room:
        return size
    found, needed = backend.largest_compiled(model, source, room, 1, size - 1)
    if found is None:
        return size
    if needed > room:
        # Infinite where the buffers do not fit the free memory as the
        # allocator would hand it out (or the batch itself does not).
        needs = (
            f"needs {needed / _MIB:.1f} MiB" if needed < float("inf")
            else "does not fit"
        )
        raise MicroBatchTooLargeError(
            f"One sample does not fit in one training step: its compiled step "
            f"(XLA) {needs} beside the {in_use / _MIB:.1f} MiB in use, under "
            f"the target of {target / _MIB:.1f} MiB of {limit / _MIB:.1f} MiB. "
            "The step was not run (an out-of-memory error inside an XLA "
            "program can end the process). HINT: use mixed precision, a "
            "smaller model or input, or a device with more memory.",
            limit_bytes=limit,
        )
    return found


def _compiled_search(model, backend, probe, first, limit, threshold, max_batch_size,
                     batch_size, sample_size, verbose):
    """The search where every step is compiled before it runs (JAX).

    Bisects over the memory analyses of the model's own train step
    compiled at each batch asked about: doubling from `FIRST_TRIAL` until a
    batch does not fit, then halving the gap to the largest that does. A
    batch fits when what is in use before the step (the step's arguments,
    where the device keeps no statistics) plus what the step allocates
    stays under `threshold` of the limit, as `MemoryGuard` plans on JAX.
    Nothing runs, so nothing needs putting back.
    """
    analyse = backend.step_analyser(model, first)
    target = threshold * limit
    in_use = _in_use_now(probe)
    config = decider.make_config(threshold=threshold)
    state = decider.init(
        config,
        fixed_bytes=backend.gradient_bytes(model),
        sample_bytes=oom_explanation.layer_output_bytes(model),
    )
    upper = max_batch_size or float("inf")
    trials = []
    best = None  # (batch_size, usage, in use)
    low, high = 0, None
    analysed = {}  # batch -> usage
    sides = []  # whether each analysis fit, in order
    size = int(min(FIRST_TRIAL, upper))
    while True:
        start = time.perf_counter()
        with _refused_where_the_step_fails(model, size, backend):
            memory = analyse(size)
        seconds = time.perf_counter() - start
        if memory is None:
            raise UnsupportedTrainingSetupError(
                "find_batch_size plans from XLA's memory analysis of the "
                "compiled train step, which this device does not give "
                f"({', '.join(probe.devices)}). HINT: find the batch size "
                "on a GPU, or train with MemoryGuard, which replays a batch "
                "that runs out of memory."
            )
        before = max(in_use or 0.0, float(memory.argument_bytes))
        usage = before + memory.demand_bytes
        fits = usage < target
        trial = BatchTrial(size, before, usage, usage if fits else None, seconds)
        trials.append(trial)
        if verbose:
            _log_analysis(trial, limit)
        analysed[size] = usage
        if fits:
            low = size
            best = (size, usage, before)
            _, state = decider.observe(
                config,
                state,
                decider.Reading(size, 1, sample_size, before, usage, limit),
            )
        else:
            high = size
        sides.append(fits)
        size = _next_compiled(analysed, low, high, upper, target, sides)
        if size is None:
            break
    if best is None:
        raise MicroBatchTooLargeError(
            "One sample does not fit in one training step: its compiled step "
            f"needs {trials[-1].predicted_peak_bytes / _MIB:.1f} MiB of "
            f"{limit / _MIB:.1f} MiB (target {threshold:.0%}). HINT: use mixed "
            "precision, a smaller model or input, or a device with more memory.",
            limit_bytes=limit,
        )
    largest, usage, before = best
    # Under a distribution each batch is a multiple of its shards: the
    # step of `largest` was analysed at the next multiple, which fits.
    multiple = backend.batch_multiple(model)
    if multiple > 1:
        rounded = -(-largest // multiple) * multiple
        largest = rounded if rounded <= upper else max(multiple, largest // multiple * multiple)
    micro_batches = None
    if batch_size is not None:
        # Never a micro-batch larger than the largest batch that fits.
        fewest = -(-batch_size // largest)
        micro_batches = fewest
        if fewest > 1 and multiple > 1:
            micro_batches = None  # Such a step is not split (`MemoryGuard`).
        elif fewest > 1:
            planned = plan_micro_batches(
                lambda k: analyse(batch_size, k),
                batch_size,
                limit,
                threshold=threshold,
                in_use_bytes=in_use,
                min_micro_batches=fewest,
            )
            micro_batches = max(fewest, planned.micro_batches)
    fitted = _line(state)
    return BatchSizeResult(
        largest_batch_size=largest,
        measured_peak_bytes=usage,
        predicted_peak_bytes=usage,
        limit_bytes=limit,
        in_use_bytes=before,
        fixed_bytes=fitted[0],
        bytes_per_sample=fitted[1] * sample_size,
        batch_size=batch_size,
        micro_batches=micro_batches,
        trials=tuple(trials),
        out_of_memory_errors=0,
    )


def _next_compiled(analysed, low, high, upper, target, sides):
    """The next batch to analyse in the compiled search, or `None` when done.

    A compiled step's memory grows close to linearly with the batch, so the
    next batch is where the line through two analyses reaches `target`:
    while no batch failed to fit, one past the line's largest fitting batch
    from the last two analyses (at most `MAX_GROWTH` times the largest that
    fits, doubling before two exist); once the edge is bracketed, the
    line's point between the largest batch that fits and the smallest that
    does not (bisection after two analyses on the same side in a row).
    Done when they are one apart, or nothing larger may be asked about.
    """
    if high is None:
        if low >= upper:
            return None
        if low == 0:
            return None  # Not reached: the first analysis did not fit.
        below = sorted(b for b in analysed if b < low)
        size = 2 * low
        if below:
            previous = below[-1]
            slope = (analysed[low] - analysed[previous]) / (low - previous)
            if slope > 0:
                size = int((target - analysed[low]) / slope) + low + 1
        size = max(low + 1, min(size, MAX_GROWTH * low))
        return int(min(size, upper))
    if high - low <= 1:
        return None
    if low == 0 or sides[-2:] in ([True, True], [False, False]):
        return (low + high) // 2
    share = (target - analysed[low]) / (analysed[high] - analysed[low])
    size = low + int(share * (high - low))
    return min(max(size, low + 1), high - 1)


def _log_analysis(trial, limit):
    logger.info(
        "find_batch_size: batch %d's compiled step needs %.1f MiB of %.1f MiB "
        "(%.0f%%)%s, %.2f s",
        trial.batch_size,
        trial.predicted_peak_bytes / _MIB,
        limit / _MIB,
        100 * trial.predicted_peak_bytes / limit,
        "" if trial.peak_bytes is not None else ": does not fit",
        trial.seconds,
    )


def _validate(threshold, tolerance, max_batch_size, max_trials, batch_size, verbose):
    if not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}")
    if not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"`tolerance` must be in (0, 1). Received: tolerance={tolerance!r}")
    for name, value, low in (
        ("max_batch_size", max_batch_size, 1),
        ("batch_size", batch_size, 1),
    ):
        if value is not None and (not _is_int(value) or value < low):
            raise ValueError(
                f"`{name}` must be an integer >= {low} or None. Received: {name}={value!r}"
            )
    if not _is_int(max_trials) or max_trials < 2:
        raise ValueError(f"`max_trials` must be an integer >= 2. Received: max_trials={max_trials!r}")
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")


def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class _TrialInput:
    """The input `fit` gets at a trial's batch size, built from the user's.

    A trial runs on what `fit` would build from the same input at that
    batch size, through Keras' own data adapter: arrays stay whole (on a
    device whose allocator holds the host's memory, as the capped CPU
    does, `fit` keeps them there for the whole run), a `tf.data.Dataset`
    is re-batched, and a `PyDataset`'s samples are served in batches of
    the trial's size. The batch size the step is traced with, the input
    pipeline's buffers and the arrays held are then the ones `fit` has.
    """

    def __init__(self, x, y, sample_weight, backend):
        self.backend = backend
        dataset = backend.is_dataset(x)
        if dataset or isinstance(x, keras.utils.PyDataset):
            if y is not None or sample_weight is not None:
                raise ValueError(
                    f"`y` and `sample_weight` must be None when `x` is a "
                    f"{type(x).__name__} (it yields them). Received: "
                    f"y={_type_name(y)}, sample_weight={_type_name(sample_weight)}"
                )
            self.kind = "dataset" if dataset else "py_dataset"
            self.batches = x
        else:
            for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
                _check_arrays(name, value)
            self.kind = "arrays"
            self.arrays = tree.map_structure(self._as_array, (x, y, sample_weight))
            if not _sample_count(self.arrays):
                raise ValueError(
                    "`x` must hold at least one sample. Received: x with no samples"
                )
            _check_sample_counts(self.arrays)

    def first_sample(self):
        """`(x, y, sample_weight)` of one sample, as numpy arrays."""
        if self.kind == "arrays":
            return _slice(self.arrays, 1)
        return _slice(self._samples(1), 1)

    def adapter_arguments(self, size):
        """`(x, y, sample_weight)` to hand Keras' data adapter at `size`.

        Enough for `TRIAL_STEPS` steps: later steps run with the pipeline's
        prefetch buffer filled, as `fit`'s steps do. Arrays of fewer
        samples are repeated to that many: a step's peak can grow over its
        first steps, and `fit` runs them over epochs if not in one.
        """
        if self.kind == "arrays":
            if _sample_count(self.arrays) >= TRIAL_STEPS * size:
                return self.arrays
            return _slice(self.arrays, TRIAL_STEPS * size)
        if self.kind == "dataset":
            return self.backend.rebatched(self.batches, size), None, None
        return _ServedInBatches(self._samples(TRIAL_STEPS * size), size), None, None

    def steps(self, size):
        """Training steps of a trial at `size`: `TRIAL_STEPS` (the input has them)."""
        return TRIAL_STEPS

    def _samples(self, count):
        """`count` samples from the batches, as arrays (repeated if needed)."""
        parts = []
        held = 0
        for batch in self._cycle():
            batch = keras.utils.unpack_x_y_sample_weight(batch)
            batch = tree.map_structure(
                self._as_array, tuple(batch) + (None,) * (3 - len(batch))
            )
            if any(a is not None and not a.ndim for a in tree.flatten(batch)):
                raise ValueError(
                    "`x` must yield batches, as `fit` takes them (a "
                    "`tf.data.Dataset` batched with `.batch(...)`). Received: "
                    f"{self.batches!r}, whose elements include a scalar: a "
                    "single sample, not a batch"
                )
            parts.append(batch)
            held += _sample_count(batch)
            if held >= count:
                break
        return tree.map_structure(
            lambda *leaves: None if leaves[0] is None else np.concatenate(leaves), *parts
        )

    def _as_array(self, value):
        if value is None or isinstance(value, np.ndarray):
            return value
        return self.backend.as_array(value)

    def _cycle(self):
        while True:
            produced = False
            if self.kind == "dataset":
                batches = self.backend.dataset_batches(self.batches)
            else:
                batches = (self.batches[i] for i in range(len(self.batches)))
            for batch in batches:
                produced = True
                yield batch
            if not produced:
                raise ValueError(
                    f"`x` must yield at least one batch. Received: {self.batches!r}"
                )


class _ServedInBatches(keras.utils.PyDataset):
    """Samples served in batches of `size`, as a `PyDataset` of that size would."""

    def __init__(self, arrays, size):
        super().__init__()
        self._arrays, self._size = arrays, size

    def __len__(self):
        return -(-_sample_count(self._arrays) // self._size)

    def __getitem__(self, index):
        start = index * self._size
        parts = tree.map_structure(
            lambda a: None if a is None else a[start : start + self._size], self._arrays
        )
        return keras.utils.pack_x_y_sample_weight(*(p for p in parts if p is not None))


def _type_name(value):
    return "None" if value is None else type(value).__name__


def _check_arrays(name, value):
    """Raises where argument `name` holds batches rather than arrays: a
    Python generator or iterator, or an iterable without a shape (a
    PyTorch `DataLoader`).

    `fit` reads such input once, batch after batch; the search needs the
    samples again at every batch size it tries, and would use up a
    generator the user's `fit` is to read.
    """
    for leaf in tree.flatten(value):
        if isinstance(leaf, collections.abc.Iterable) and not (
            hasattr(leaf, "shape") or isinstance(leaf, (str, bytes))
        ):
            raise ValueError(
                f"`{name}` must be a numpy array or tensor (or a list or dict of "
                "them), a batched `tf.data.Dataset` or a `keras.utils.PyDataset`: "
                "the search batches the samples again at each size it tries. "
                f"Received: {name}={leaf!r}. HINT: pass the arrays it "
                "reads from, or a `keras.utils.PyDataset` over them."
            )


def _check_sample_counts(arrays):
    """Raises where `x`, `y` and `sample_weight` hold different numbers of
    samples (what `fit` refuses as ambiguous data cardinality)."""
    counts = {}
    for name, value in zip(("x", "y", "sample_weight"), arrays):
        sizes = sorted({len(a) for a in tree.flatten(value) if a is not None and a.ndim})
        if sizes:
            counts[name] = sizes
    if len({size for sizes in counts.values() for size in sizes}) > 1:
        held = ", ".join(
            f"{name} with {' and '.join(map(str, sizes))}" for name, sizes in counts.items()
        )
        raise ValueError(
            "`x`, `y` and `sample_weight` must hold the same number of samples, "
            f"as in `fit`. Received: {held} samples"
        )


def _sample_count(arrays):
    counts = [len(a) for a in tree.flatten(arrays) if a is not None and a.ndim]
    return min(counts) if counts else 0


def _slice(arrays, size):
    """`size` samples, the first ones repeated as often as needed."""

    def take(array):
        if array is None or not array.ndim:
            return array
        if size <= len(array):
            return array[:size]
        return np.take(array, np.arange(size) % len(array), axis=0)

    x, y, sample_weight = tree.map_structure(take, arrays)
    return x, y, sample_weight


def _peaks_stalled(trials, target):
    """Whether the last two trials that ran grew in batch but not in peak.

    Only near the top (a peak above half the target): lower down, the
    order the step's ops happen to run in moves its peak by more than a
    few samples do, and a stalled peak says nothing about rounding.
    """
    ran = [t for t in trials if t.peak_bytes is not None]
    if len(ran) < 2:
        return False
    before, last = ran[-2], ran[-1]
    return (
        last.batch_size > before.batch_size
        and before.peak_bytes >= last.peak_bytes > STALL_SHARE * target
    )


def _proportional_bound(best, in_use, floor, target):
    """The largest batch under `target` if the step's memory grows in proportion.

    The step's memory above `floor` (the gradients, held at every batch)
    is taken to grow in proportion to the batch from the largest trial
    that ran, `best`. A step's fixed part is at least the floor, so this
    over-predicts where a line through the trials may under-predict: at
    batches many times the ones measured, where activations, workspaces
    and the allocator's rounding grow faster than the first trials showed.
    """
    line = _proportional_line(best, in_use, floor)
    if line is None:
        return float("inf")
    base, per_sample = line
    return int((target - base) / per_sample)


def _proportional_peak(best, in_use, floor, size):
    base, per_sample = _proportional_line(best, in_use, floor)
    return base + per_sample * size


def _proportional_line(best, in_use, floor):
    """`(base, per sample)` of the proportional bound, or `None`."""
    if best is None:
        return None
    size, peak, _ = best
    grown = peak - in_use - floor
    if grown <= 0:
        grown, floor = peak - in_use, 0.0
    if grown <= 0:
        return None
    return in_use + floor, grown / size


def _secant(trials):
    """Growth of the peak per sample between the last two trials that ran.

    `None` before two ran (the decider's line, with its prior, is all there
    is then); `0.0` where the peak did not grow (no slope to go by: the
    proportional bound sets the step).
    """
    ran = [t for t in trials if t.peak_bytes is not None]
    if len(ran) < 2:
        return None
    before, last = ran[-2], ran[-1]
    if last.batch_size <= before.batch_size:
        return 0.0
    return max(last.peak_bytes - before.peak_bytes, 0.0) / (last.batch_size - before.batch_size)


def _batch_for(peak, state, best, slope, sample_size, in_use, upper):
    """The largest batch predicted to peak under `peak`.

    From the largest trial that ran along the secant where there is one;
    from the decider's line (fitted to the trials over its prior) before.
    """
    if best is None or slope is None:
        return _largest_fitting(state, sample_size, peak - in_use, upper)
    if slope <= 0:
        return upper
    return min(upper, best[0] + int(max(peak - best[1], 0.0) / slope))


def _predicted(state, size, sample_size):
    return decider.predict_demand(state, size * sample_size) or 0.0


def _line(state):
    """`(fixed, slope per work)` of the memory model, from two predictions."""
    one = decider.predict_demand(state, 1.0) or 0.0
    two = decider.predict_demand(state, 2.0) or 0.0
    return max(one - (two - one), 0.0), max(two - one, 0.0)


def _largest_fitting(state, sample_size, room, upper):
    """The largest batch whose predicted demand fits `room` bytes (<= upper)."""
    if room <= 0 or _predicted(state, 1, sample_size) > room:
        return 0
    low, high = 1, 2
    while high <= upper and _predicted(state, high, sample_size) <= room:
        low, high = high, high * 2
        if high > 1 << 40:
            return int(min(upper, high))
    high = int(min(high, upper + 1))
    while high - low > 1:
        middle = (low + high) // 2
        if _predicted(state, middle, sample_size) <= room:
            low = middle
        else:
            high = middle
    return low


def _save_state(model):
    """Copies of every variable a training step changes."""
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    variables += list(model.metrics_variables)
    seen, unique = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return [(variable, np.array(variable.numpy(), copy=True)) for variable in unique]


def _restore_state(model, saved):
    for variable, value in saved:
        variable.assign(value)


def _log_trial(trial, limit):
    if trial.peak_bytes is None:
        logger.info(
            "find_batch_size: batch %d ran out of memory (%.1f MiB in use before it)",
            trial.batch_size,
            trial.in_use_bytes / _MIB,
        )
        return
    predicted = (
        f", predicted {trial.predicted_peak_bytes / _MIB:.1f} MiB"
        if trial.predicted_peak_bytes is not None
        else ""
    )
    logger.info(
        "find_batch_size: batch %d peaked at %.1f MiB of %.1f MiB (%.0f%%)%s, %.2f s",
        trial.batch_size,
        trial.peak_bytes / _MIB,
        limit / _MIB,
        100 * trial.peak_bytes / limit,
        predicted,
        trial.seconds,
    )
