"""Splitting a batch into micro-batches along axis 0.

A batch of `n` samples is split into `k` micro-batches whose sizes differ by
at most one (the first `n % k` are one larger). `k` is a Python `int` fixed
at trace time; the batch size may be a Python `int` (static shape) or a
scalar `int32` tensor (a shape generalized by a retrace). A batch smaller
than `k` is split into one micro-batch per sample.
"""

from typing import Any, NamedTuple

import keras
import tensorflow as tf

from keras_memguard.decider import validate_micro_batches  # noqa: F401 (re-exported)

MODES = ("accumulate", "shrink")


def validate_mode(mode):
    """Checks a micro-batch mode and returns it.

    Args:
        mode: `"accumulate"` or `"shrink"`.

    Returns:
        `mode`, unchanged.

    Raises:
        ValueError: If `mode` is not one of the two modes.

    Example:

    >>> validate_mode("shrink")
    'shrink'
    """
    if mode not in MODES:
        raise ValueError(
            "`micro_batch_mode` must be one of "
            f"{', '.join(repr(m) for m in MODES)}. "
            f"Received: micro_batch_mode={mode!r}"
        )
    return mode


class MicroBatch(NamedTuple):
    """One part of a split batch.

    Attributes:
        x: The inputs of the micro-batch, same structure as the batch's.
        y: The targets, or `None`.
        sample_weight: The sample weights, or `None`.
        size: Number of samples: a Python `int` when the batch size is known
            at trace time, else a scalar `int32` tensor. It is 0 for the
            extra parts when the batch has fewer than `k` samples.
        fraction: `size / batch_size`, a scalar `float32` tensor: the weight
            of the micro-batch's mean loss in the full batch's mean loss.
    """

    x: Any
    y: Any
    sample_weight: Any
    size: Any
    fraction: Any


def first_tensor(x):
    for item in keras.tree.flatten(x):
        if item is not None:
            return item
    raise ValueError(
        "Cannot split a batch without any input tensor. "
        f"Received: x={x!r}"
    )


def leading_size(x):
    """Returns the batch size: a Python int if static, else an int32 tensor."""
    first = first_tensor(x)
    static = tf.TensorShape(first.shape)
    if static.rank and static[0] is not None:
        return int(static[0])
    return tf.shape(first, out_type=tf.int32)[0]


def bounds(batch_size, micro_batches):
    """Yields `(start, size)` of each part, as equal as possible."""
    if isinstance(batch_size, int):
        quotient, remainder = divmod(batch_size, micro_batches)
        for i in range(micro_batches):
            yield i * quotient + min(i, remainder), quotient + int(
                i < remainder
            )
        return
    quotient = batch_size // micro_batches
    remainder = batch_size % micro_batches
    for i in range(micro_batches):
        start = i * quotient + tf.minimum(i, remainder)
        size = quotient + tf.cast(i < remainder, tf.int32)
        yield start, size


def slice_rows(item, start, size):
    if item is None:
        return None
    if isinstance(item, tf.SparseTensor):
        zeros = [tf.constant(0, tf.int64)] * (item.shape.rank - 1)
        begin = tf.stack([tf.cast(start, tf.int64)] + zeros)
        extent = tf.concat(
            [[tf.cast(size, tf.int64)], item.dense_shape[1:]], axis=0
        )
        return tf.sparse.slice(item, begin, extent)
    if not isinstance(item, (tf.Tensor, tf.RaggedTensor, tf.Variable)):
        item = tf.convert_to_tensor(item)
    if item.shape.rank == 0:
        # A per-batch scalar (rare) is shared by all micro-batches.
        return item
    if isinstance(item, tf.RaggedTensor) or item.shape.rank is None:
        # Unknown rank: a retrace generalized the shape (`reduce_retracing`).
        return item[start : start + size]
    # `tf.slice` (dynamic start, size constant per loop) compiles with XLA.
    # The inner extents are the item's own, not -1: with a start known only
    # at run time, XLA lowers a -1 extent by padding the item by its whole
    # size in every dimension (2^rank times the batch's bytes, inside the
    # micro-batch loop); a static extent is a plain dynamic slice.
    rank = item.shape.rank
    begin = tf.stack([start] + [0] * (rank - 1))
    extent = tf.concat(
        [
            tf.reshape(tf.cast(size, begin.dtype), [1]),
            tf.shape(item, out_type=begin.dtype)[1:],
        ],
        0,
    )
    sliced = tf.slice(item, begin, extent)
    # A dynamic `extent` hides every dimension; the inner ones are the
    # batch's (Keras 3.8's Flatten needs them known).
    rows = size if isinstance(size, int) else None
    sliced.set_shape(tf.TensorShape([rows]).concatenate(item.shape[1:]))
    return sliced


def slice_structure(structure, start, size):
    return keras.tree.map_structure(
        lambda item: slice_rows(item, start, size), structure
    )


def _fraction(size, batch_size):
    # 0 for an empty batch (a replica's part of a short last batch).
    return tf.math.divide_no_nan(
        tf.cast(size, tf.float32), tf.cast(batch_size, tf.float32)
    )


def make_micro_batch(x, y, sample_weight, start, size, batch_size):
    return MicroBatch(
        x=slice_structure(x, start, size),
        y=slice_structure(y, start, size),
        sample_weight=slice_structure(sample_weight, start, size),
        size=size,
        fraction=_fraction(size, batch_size),
    )


def split_micro_batches(data, micro_batches):
    """Splits a batch into micro-batches along axis 0.

    Every tensor of the nested `(x, y, sample_weight)` structure (tuples,
    dicts) is split into `micro_batches` parts of sizes as equal as possible:
    with `n` samples, the first `n % micro_batches` parts have one sample
    more. The batch size may be unknown at trace time (the last batch of an
    epoch is smaller); the boundaries are then computed from its dynamic
    shape. When the batch has fewer samples than `micro_batches`, the extra
    parts are empty (size 0).

    Args:
        data: A batch as `train_step` receives it: `x`, `(x,)`, `(x, y)` or
            `(x, y, sample_weight)`.
        micro_batches: The number of parts, a Python `int` >= 1.

    Returns:
        A `list` of `micro_batches` `MicroBatch` tuples
        `(x, y, sample_weight, size, fraction)`.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1, or the batch
            has no input tensor.

    Example:

    >>> parts = split_micro_batches((tf.zeros([10, 3]), tf.zeros([10])), 4)
    >>> [int(p.size) for p in parts]
    [3, 3, 2, 2]
    """
    micro_batches = validate_micro_batches(micro_batches)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch_size = leading_size(x)
    return [
        make_micro_batch(x, y, sample_weight, start, size, batch_size)
        for start, size in bounds(batch_size, micro_batches)
    ]


def minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tf.minimum(a, b)


def plan_split(batch_size, micro_batches):
    """Returns `(count, quotient, remainder)` of a batch's split.

    A batch smaller than `micro_batches` runs one micro-batch per sample:
    `count = min(batch_size, micro_batches)` parts, the first `remainder`
    of `quotient + 1` samples, the others of `quotient`. An empty batch
    (under a `tf.distribute` strategy, a replica's part of an epoch's last
    batch when it has fewer samples than replicas) runs one empty
    micro-batch that contributes nothing, as Keras' own step does. Python
    ints when the batch size is static, else scalar `int32` tensors.
    """
    count = maximum(minimum(batch_size, micro_batches), 1)
    return count, batch_size // count, batch_size % count


def maximum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return tf.maximum(a, b)

