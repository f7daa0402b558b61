"""What the JAX and PyTorch backends share, framework-free.

How a batch is cut into micro-batches, and the counts a replay gets where
no memory figure is known (`MemGuardMixin` trained without `MemoryGuard`),
which come from the decider: one replay policy for every backend.
"""

from keras_memguard import decider
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

