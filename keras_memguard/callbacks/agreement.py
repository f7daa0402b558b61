"""What the workers of a `MultiWorkerMirroredStrategy` cluster decide from.

Every worker runs the same pure decider; to plan the same `k` they must feed
it the same numbers. Each worker's allocator reads against its own limit, so
its memory is agreed as a fraction of that limit: the largest fraction over
the workers, times the smallest limit, is the most constrained worker's
bytes, and the same number on every worker. One small all-gather each
(`keras_memguard.backends.tensorflow.multi_worker.agree_max`); every worker must call
these at the same point.
"""

from keras_memguard.backends.tensorflow import multi_worker


def agreed_limit(strategy, limits):
    """The smallest memory limit over the workers, in bytes.

    Args:
        strategy: The `tf.distribute.Strategy`.
        limits: This worker's device limits (`None` where unknown).

    Returns:
        A float, the same on every worker.
    """
    (negative,) = multi_worker.agree_max(strategy, [-min(l for l in limits if l)])
    return -negative


def agreed_usage(strategy, samples, limits, limit):
    """`(peak, in_use)` every worker agreed on, in bytes of the agreed limit.

    Args:
        strategy: The `tf.distribute.Strategy`.
        samples: This worker's `AllocatorSample`s, one per device.
        limits: This worker's device limits, in the same order.
        limit: The agreed limit (`agreed_limit`).

    Returns:
        Two floats, or `None` where no worker could read the value.
    """
    peak = in_use = -1.0
    for sample, device_limit in zip(samples, limits):
        if not device_limit:
            continue
        if sample.peak_bytes is not None:
            peak = max(peak, sample.peak_bytes / device_limit)
        if sample.current_bytes is not None:
            in_use = max(in_use, sample.current_bytes / device_limit)
    peak, in_use = multi_worker.agree_max(strategy, [peak, in_use])
    return (
        None if peak < 0 else peak * limit,
        None if in_use < 0 else in_use * limit,
    )


def agreed_failure(strategy, failure, own_limit, limit):
    """The out-of-memory failure every worker sizes the replay from.

    Every worker's handler runs at the same point, so the largest memory in
    use (as a fraction of each worker's limit) and the largest failed
    allocation are agreed; what only one worker's allocator saw (the failed
    shape, its largest free block) is left out.

    Args:
        strategy: The `tf.distribute.Strategy`.
        failure: This worker's `keras_memguard.decider.Failure`.
        own_limit: This worker's limit, in bytes.
        limit: The agreed limit.

    Returns:
        A `Failure`, the same on every worker.
    """
    in_use, allocation = multi_worker.agree_max(
        strategy,
        [
            -1.0 if failure.in_use_bytes is None else failure.in_use_bytes / own_limit,
            -1.0 if failure.allocation_bytes is None else failure.allocation_bytes,
        ],
    )
    return failure._replace(
        in_use_bytes=None if in_use < 0 else in_use * limit,
        allocation_bytes=None if allocation < 0 else allocation,
        allocation_shape=None,
        largest_free_bytes=None,
    )
