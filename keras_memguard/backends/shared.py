"""What the JAX and PyTorch backends share, framework-free.

How a batch is cut into micro-batches, and the counts a replay gets where
no memory figure is known (`MemGuardMixin` trained without `MemoryGuard`),
which come from the decider: one replay policy for every backend. Also the
check of what an `on_out_of_memory` handler returns, the memory in use read
from a probe's samples, the swap of a model's test or predict function
for a guarded `evaluate` or `predict`, and which metrics a micro-batched
step updates per micro-batch (TensorFlow's step too).
"""

import warnings

import keras

from keras_memguard import decider
from keras_memguard import step_functions
from keras_memguard.backends import compat
from keras_memguard.decider import validate_micro_batches
from keras_memguard.errors import MicroBatchTooLargeError


def micro_batch_segments(batch_size, micro_batches):
    """How a batch is cut: runs of micro-batches of one size.

    `k` micro-batches of `n // k` samples, then the `n % k` left over (fewer
    than `k`) as one last, smaller micro-batch: the same cut on JAX and
    PyTorch, so a count means the same micro-batch size there. (XLA gives a
    loop's temporaries and those of the step around it separate buffers:
    keeping the last micro-batch below `k` samples keeps that small.)

    Args:
        batch_size: Samples in the batch, an `int` >= 1.
        micro_batches: The number of micro-batches, an `int` >= 1; a batch
            smaller than it is cut into one micro-batch per sample.

    Returns:
        A tuple of `(start, count, size)`: `count` micro-batches of `size`
        samples each, starting at row `start`.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    >>> micro_batch_segments(10, 4)
    ((0, 4, 2), (8, 1, 2))
    """
    k = min(validate_micro_batches(micro_batches), batch_size)
    size, left_over = divmod(batch_size, k)
    segments = [(0, k, size)]
    if left_over:
        segments.append((k * size, 1, left_over))
    return tuple(segments)


def replay_count(failure):
    """The count to replay a training batch with where no figure is known.

    `decider.fail_without_figures`: the micro-batch at most halves, so the
    count about doubles.

    Args:
        failure: A record with `batch_size`, `micro_batches` and `error`
            (each backend's `StepOutOfMemory`).

    Returns:
        The count to replay with.

    Raises:
        MicroBatchTooLargeError: If one sample per micro-batch failed.
    """
    config = decider.make_config()
    decided, _ = decider.fail_without_figures(
        config, decider.init(config), failure.batch_size, failure.micro_batches
    )
    if decided.cannot_split is not None:
        raise MicroBatchTooLargeError(
            "A micro-batch of one sample ran out of memory "
            f"(batch of {failure.batch_size} in {failure.micro_batches} "
            "micro-batches). HINT: use a smaller model, mixed precision, or a "
            "device with more memory."
        ) from failure.error
    return decided.micro_batches


def double_micro_batches(failure):
    """The default handler: `keras_memguard.backends.shared.replay_count`.

    Args:
        failure: A `StepOutOfMemory`.

    Returns:
        The count to replay with (about twice the one that failed).

    Raises:
        MicroBatchTooLargeError: If one sample per micro-batch failed.
    """
    return replay_count(failure)


def slice_count(failure):
    """The slice count to go on evaluating or predicting a batch with.

    `decider.fail_evaluation`: each slice becomes at most half as large.

    Args:
        failure: As for `replay_count`.

    Returns:
        The slice count to go on with.

    Raises:
        MicroBatchTooLargeError: If a slice of one sample failed.
    """
    config = decider.make_config()
    decided, _ = decider.fail_evaluation(
        config, decider.init(config), failure.batch_size, failure.micro_batches
    )
    if decided.cannot_split is not None:
        raise MicroBatchTooLargeError(
            "A slice of one sample ran out of memory (batch of "
            f"{failure.batch_size}). HINT: use a smaller model, mixed "
            "precision, or a device with more memory."
        ) from failure.error
    return decided.micro_batches


def prepare_multi_worker(model):
    """`keras_memguard.prepare_multi_worker` where Keras' backend is not TensorFlow.

    `MultiWorkerMirroredStrategy` exists on TensorFlow only, and the call
    does nothing under any other strategy: here it returns `model`
    unchanged, so that code calling it runs on every backend.

    Args:
        model: A Keras model.

    Returns:
        `model`.
    """
    return model


def checked_larger_count(larger, failed, batch_size, error, unit="micro-batch"):
    """What an `on_out_of_memory` handler returned, checked to be a larger count.

    Args:
        larger: The handler's return value.
        failed: The count that ran out of memory.
        batch_size: Samples in the batch.
        error: The out-of-memory error, chained to the one raised here.
        unit: What is counted, for the message: `"micro-batch"` or
            `"slice"`.

    Returns:
        `larger`.

    Raises:
        ValueError: If `larger` is not an `int` that, capped at
            `batch_size`, is larger than `failed` (a smaller one would fail
            again, or loop).
    """
    if isinstance(larger, bool) or not isinstance(larger, int) or min(larger, batch_size) <= failed:
        raise ValueError(
            f"`on_out_of_memory` must return a {unit} count larger than the "
            f"one that failed ({failed}), for a batch of {batch_size}. "
            f"Received: {larger!r}"
        ) from error
    return larger


def in_use_bytes(samples):
    """The memory in use a probe's samples show: the most of any device's.

    Args:
        samples: Memory samples, each with `current_bytes` (or `None`).

    Returns:
        A float, or `None` where no sample knows it.
    """
    in_use = [s.current_bytes for s in samples if s.current_bytes is not None]
    return float(max(in_use)) if in_use else None


def install_inference_function(model, kind, function):
    """Puts `function` in place of the model's test or predict function.

    Args:
        model: The Keras model.
        kind: `"evaluate"` (its test function) or `"predict"`.
        function: The guarded function.

    Returns:
        The function it replaced, for `restore_inference_function`.
    """
    if kind == "evaluate":
        previous = model.test_function
        step_functions.set_test_function(model, function)
    else:
        previous = model.predict_function
        step_functions.set_predict_function(model, function)
    return previous


def restore_inference_function(model, kind, previous):
    """Puts back the function `install_inference_function` replaced.

    Args:
        model: The Keras model.
        kind: `"evaluate"` or `"predict"`, as installed.
        previous: What `install_inference_function` returned.
    """
    if kind == "evaluate":
        step_functions.set_test_function(model, previous)
    else:
        step_functions.set_predict_function(model, previous)


def metrics_update_per_micro_batch(model):
    """Tells whether the compiled metrics can be updated micro-batch by micro-batch.

    True when every compiled metric is one of Keras' own that accumulate
    over samples (`compat.metric_accumulates_per_sample`: updating them per
    micro-batch gives the whole batch's result without keeping its
    outputs) and `compute_metrics` is Keras' own. Other metrics see the
    whole batch's outputs, once.

    Args:
        model: A compiled Keras model.

    Returns:
        A bool.
    """
    metrics = compat.compiled_metrics(model)
    if metrics is None:
        return False
    if type(model).compute_metrics is not keras.Model.compute_metrics:
        return False
    inner = getattr(metrics, "metrics", None) or []
    return all(compat.metric_accumulates_per_sample(m) for m in inner)


def metrics_read_whole_batch_outputs(model, update_per_micro_batch=metrics_update_per_micro_batch):
    """Tells whether the step must keep the whole batch's outputs.

    False when `compute_metrics` is Keras' own and there are no compiled
    metrics (nothing reads the outputs), or they are updated micro-batch by
    micro-batch (`update_per_micro_batch(model)`, a backend's rule, by
    default `metrics_update_per_micro_batch`). Keeping the outputs costs the
    whole batch's outputs whatever the micro-batch count: on a language
    model the logits are the largest tensor of the step.
    """
    if type(model).compute_metrics is not keras.Model.compute_metrics:
        return True
    if compat.compiled_metrics(model) is None:
        return False
    return not update_per_micro_batch(model)


# Set on a model once it was warned that its masked loss terms are combined
# by their share of the samples.
_MASKED_LOSSES_WARNED_ATTR = "_memguard_masked_losses_warned"


def warn_masked_loss_terms_once(model, terms, micro_batches, stacklevel):
    """Warns once per model that its masked loss terms are weighted by samples.

    Exact combination needs every term of the loss to average over the same
    elements (one masked loss on a model with one output); with several,
    each micro-batch's loss is weighted by its share of the samples.
    `stacklevel` as `warnings.warn` counts it from the caller.
    """
    if getattr(model, _MASKED_LOSSES_WARNED_ATTR, False):
        return
    object.__setattr__(model, _MASKED_LOSSES_WARNED_ATTR, True)
    warnings.warn(
        f"Model {model.name!r} has {terms} loss terms, and some average over "
        "a mask (a Keras mask or `ignore_class`) or over their sample weights "
        f"(`mean_with_sample_weight`). Under micro_batches={micro_batches} "
        "each micro-batch's loss is weighted by its share of the samples, "
        "not of what it averaged over: close to the whole batch's loss, not "
        "equal to it. One such loss on a model with one output is combined "
        "exactly.",
        stacklevel=stacklevel + 1,
    )
