"""Graph-side micro-batching: split a batch, accumulate gradients, apply once.

A batch of `n` samples is split along axis 0 into `k` micro-batches whose
sizes differ by at most one (the first `n % k` are one larger). Each
micro-batch runs forward and backward on its own, one after the other, so the
activation memory of a step is that of a batch of about `n / k` samples.

Two modes:

- `"accumulate"` (gradient accumulation): each micro-batch's loss is weighted
  by its share of the samples `n_i / n`, the (loss-scaled) gradients are
  summed and the optimizer is applied once. For the losses Keras builds from
  `compile()` (`"sum_over_batch_size"` reduction, with or without sample and
  class weights, regularization counted once in total) this computes the
  same update as training on the whole batch.
- `"shrink"`: one optimizer update per micro-batch: more, smaller updates.
  The step does not scale the learning rate; whoever switches the mode (the
  callback) owns that choice.

`k` is a Python `int` fixed at trace time: build one compiled step function
per `k` with `make_step_function` and keep them in a cache. A batch with
fewer than `k` samples (the last batch of an epoch) runs one micro-batch per
sample.

Guarantees of a step in `"accumulate"` mode:

- Sequential micro-batches: micro-batch 0 runs first, the others in
  `tf.while_loop`s (one per micro-batch size, so slice shapes are constant
  inside a loop, as XLA needs) with `parallel_iterations=1` and control
  dependencies on the previous micro-batch's gradients. The graph executor
  cannot run two micro-batches side by side (which would bring back the
  full batch's peak memory), and the trace time does not grow with `k`.
- Atomicity: the optimizer update, the metric updates and the loss-tracker
  update run only after every micro-batch's gradients exist. A step that
  fails part-way (`tf.errors.ResourceExhaustedError`) leaves weights,
  optimizer variables and metrics unchanged, so the same batch can be
  replayed with a larger `k`. (Keras' built-in step is not atomic: the
  optimizer's `iterations` and the metric counts can be updated before an
  out-of-memory error in the backward pass.) Exception: BatchNormalization
  moving statistics are updated inside each micro-batch's forward pass (`k`
  updates per step) and are not rolled back.

Batch-statistics layers (`keras.layers.BatchNormalization`) normalize each
micro-batch with its own moments; a warning is issued once per model.

Exactness limits of `"accumulate"` mode: a loss normalized by something
other than the number of samples (a `"mean_with_sample_weight"` reduction, a
masked loss whose valid count differs between micro-batches, a custom
`compute_loss`) is normalized per micro-batch, which is close to but not
exactly the full-batch value. Dropout and other random layers draw
different random numbers than on the whole batch.

Recipe: micro-batching inside your own `train_step`. `accumulate_gradients`
does the splitting, the sequential forward/backward passes and the
summation; run every state update under `tf.control_dependencies` on its
`control_inputs()` to keep the step atomic:

```python
import tensorflow as tf
import keras
from keras_memguard.training.micro_batch import accumulate_gradients
from keras_memguard.training.mixin import MemGuardMixin

class MyModel(MemGuardMixin, keras.Model):
    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        result = accumulate_gradients(self, data, self.micro_batches)
        # Change `result.gradients` here if needed; under mixed precision
        # they are still multiplied by the loss scale (`apply` unscales).
        with tf.control_dependencies(result.control_inputs()):
            self._loss_tracker.update_state(
                result.loss, sample_weight=result.batch_size
            )
            self.optimizer.apply(result.gradients, self.trainable_weights)
            return self.compute_metrics(
                x, y, result.y_pred, sample_weight=sample_weight
            )
```
"""

import warnings
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from keras_memguard.errors import UnsupportedTrainingSetupError

# Private Keras helpers, used exactly as the built-in TensorFlow `train_step`
# and `_make_function` use them (checked against Keras 3.15).
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.losses.loss import unscale_loss_for_distribution

MODES = ("accumulate", "shrink")

_BATCH_STATS_WARNED_ATTR = "_memguard_batch_statistics_warned"


def validate_micro_batches(micro_batches):
    """Checks a micro-batch count and returns it.

    Args:
        micro_batches: The number of micro-batches, an `int` >= 1.

    Returns:
        `micro_batches`, unchanged.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    >>> validate_micro_batches(4)
    4
    """
    if (
        isinstance(micro_batches, bool)
        or not isinstance(micro_batches, int)
        or micro_batches < 1
    ):
        raise ValueError(
            "`micro_batches` must be an integer >= 1. "
            f"Received: micro_batches={micro_batches!r}"
        )
    return micro_batches


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


class AccumulatedGradients(NamedTuple):
    """What `accumulate_gradients` returns.

    Attributes:
        gradients: One gradient per variable (same order), summed over the
            micro-batches and still multiplied by the optimizer's loss scale
            (`optimizer.apply` unscales). `None` for variables the loss does
            not depend on, as `tf.GradientTape.gradient` gives.
        y_pred: The model outputs of the whole batch (the micro-batches'
            outputs concatenated).
        loss: The full-batch mean loss: the micro-batch losses weighted by
            their share of the samples, summed, and unscaled for
            distribution (the value the built-in step gives the loss tracker).
        batch_size: The number of samples in the batch, a scalar `int32`
            tensor.
    """

    gradients: list
    y_pred: Any
    loss: Any
    batch_size: Any

    def control_inputs(self):
        """Returns the tensors every state update must wait for.

        Returns:
            A flat `list` of tensors: all gradients, the loss and the
            outputs. Put optimizer, metric and loss-tracker updates under
            `tf.control_dependencies(result.control_inputs())`.
        """
        tensors = _flat_tensors([self.gradients, self.loss, self.y_pred])
        return tensors + _replica_barrier(tensors)


def _replica_barrier(tensors):
    """Returns a tensor that exists only once every replica has `tensors`.

    Under a `tf.distribute` strategy with several replicas, metric and
    loss-tracker variables are replica-local: a replica that has finished
    its micro-batches would update them even when another replica's
    out-of-memory error then aborts the step, and the replay would count
    its samples twice. An all-reduce waits for every replica.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return []
    with tf.control_dependencies(tensors):
        done = tf.ones([], tf.float32)
    return [context.all_reduce("SUM", done)]


def _flat_tensors(structure):
    tensors = []
    for item in keras.tree.flatten(structure):
        if item is None:
            continue
        if isinstance(item, tf.IndexedSlices):
            tensors.extend([item.values, item.indices])
        else:
            tensors.append(item)
    return tensors


def _first_tensor(x):
    for item in keras.tree.flatten(x):
        if item is not None:
            return item
    raise ValueError(
        "Cannot split a batch without any input tensor. "
        f"Received: x={x!r}"
    )


def _batch_size(x):
    """Returns the batch size: a Python int if static, else an int32 tensor."""
    first = _first_tensor(x)
    static = tf.TensorShape(first.shape)
    if static.rank and static[0] is not None:
        return int(static[0])
    return tf.shape(first, out_type=tf.int32)[0]


def _bounds(batch_size, micro_batches):
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


def _slice_rows(item, start, size):
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
    rank = item.shape.rank
    begin = tf.stack([start] + [0] * (rank - 1))
    extent = tf.stack([size] + [-1] * (rank - 1))
    return tf.slice(item, begin, extent)


def _slice_structure(structure, start, size):
    return keras.tree.map_structure(
        lambda item: _slice_rows(item, start, size), structure
    )


def _fraction(size, batch_size):
    # 0 for an empty batch (a replica's part of a short last batch).
    return tf.math.divide_no_nan(
        tf.cast(size, tf.float32), tf.cast(batch_size, tf.float32)
    )


def _make_micro_batch(x, y, sample_weight, start, size, batch_size):
    return MicroBatch(
        x=_slice_structure(x, start, size),
        y=_slice_structure(y, start, size),
        sample_weight=_slice_structure(sample_weight, start, size),
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
    batch_size = _batch_size(x)
    return [
        _make_micro_batch(x, y, sample_weight, start, size, batch_size)
        for start, size in _bounds(batch_size, micro_batches)
    ]


def _forward(model, x):
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


def _default_loss_fn(model):
    # The same call as the built-in TensorFlow `train_step`.
    def loss_fn(x, y, y_pred, sample_weight):
        return model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )

    return loss_fn


def _micro_batch_gradients(model, micro_batch, variables, loss_fn, weighted):
    """Forward and backward pass of one micro-batch.

    Returns `(gradients, y_pred, weighted_loss)`. With `weighted`, the
    gradients are those of the loss times the micro-batch's share of the
    samples (accumulation); without, those of its own mean loss (one update
    per micro-batch). The returned loss is always weighted, before loss
    scaling: the micro-batches' losses sum to the full-batch loss.
    """
    with tf.GradientTape() as tape:
        y_pred = _forward(model, micro_batch.x)
        loss = loss_fn(
            micro_batch.x, micro_batch.y, y_pred, micro_batch.sample_weight
        )
        weighted_loss = loss * tf.cast(micro_batch.fraction, loss.dtype)
        target = weighted_loss if weighted else loss
        if model.optimizer is not None:
            target = model.optimizer.scale_loss(target)
    gradients = tape.gradient(target, variables)
    return list(gradients), y_pred, weighted_loss


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tf.minimum(a, b)


def _plan(batch_size, micro_batches):
    """Returns `(count, quotient, remainder)` of a batch's split.

    A batch smaller than `micro_batches` runs one micro-batch per sample:
    `count = min(batch_size, micro_batches)` parts, the first `remainder`
    of `quotient + 1` samples, the others of `quotient`. An empty batch
    (under a `tf.distribute` strategy, a replica's part of an epoch's last
    batch when it has fewer samples than replicas) runs one empty
    micro-batch that contributes nothing, as Keras' own step does. Python
    ints when the batch size is static, else scalar `int32` tensors.
    """
    count = _max(_min(batch_size, micro_batches), 1)
    return count, batch_size // count, batch_size % count


def _run_micro_batches(data, micro_batches, first, rest):
    """Runs the micro-batches of a batch one after the other.

    `first(micro_batch) -> (carry, y_pred, growing)` runs micro-batch 0
    (one of the larger ones, never empty) and fixes the structure of
    `carry`, a flat list of tensors; `growing` flags the tensors whose first
    dimension grows from one micro-batch to the next (rows of sparse
    gradients). `rest(micro_batch, carry) -> (carry, y_pred)` runs each
    further micro-batch.

    Micro-batches 1 .. count-1 run in at most two `tf.while_loop`s, one per
    micro-batch size (`quotient + 1`, then `quotient`): the trace time does
    not grow with `micro_batches`, and every slice has a size that is
    constant within its loop, which XLA needs. The loops run one iteration
    at a time (`parallel_iterations=1`) and each micro-batch is sliced under
    control dependencies on the previous carry, so two micro-batches'
    activations are never alive together. No empty micro-batch runs
    (its forward pass would give NaN and write NaN BatchNormalization
    statistics), except for an empty batch, as Keras' own step does.

    Returns:
        `(carry, y_pred, batch_size)`: the last carry, the outputs of the
        whole batch, and the batch size as a scalar `int32` tensor.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    xys = (x, y, sample_weight)
    batch_size = _batch_size(x)
    count, quotient, remainder = _plan(batch_size, micro_batches)
    larger = quotient + 1
    if isinstance(remainder, int):
        first_size = larger if remainder > 0 else quotient
    else:
        first_size = quotient + tf.cast(remainder > 0, tf.int32)
    carry, y_pred, growing = first(
        _make_micro_batch(*xys, 0, first_size, batch_size)
    )
    outputs = [y_pred]
    if micro_batches > 1:
        # Micro-batches [1, remainder) have `quotient + 1` samples, the
        # rest up to `count` have `quotient`.
        segments = [
            (1, _max(remainder, 1), larger),
            (_max(remainder, 1), count, quotient),
        ]
        for begin, end, size in segments:
            if isinstance(begin, int) and isinstance(end, int) and begin >= end:
                continue
            carry, part = _run_segment(
                xys,
                batch_size,
                (quotient, remainder),
                (begin, end, size),
                rest,
                carry,
                growing,
                y_pred,
            )
            outputs.append(part)
    batch_size = tf.shape(_first_tensor(x), out_type=tf.int32)[0]
    return list(carry), _concat_rows(outputs), batch_size


def _max(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return tf.maximum(a, b)


def _run_segment(xys, batch_size, split, segment, rest, carry, growing, y0):
    """Runs micro-batches `begin .. end-1`, all of `size` samples, in a loop.

    The outputs are written into a preallocated buffer with a scatter
    (XLA rejected a `TensorArray` here).
    """
    quotient, remainder = split
    begin, end, size = segment
    y_leaves = keras.tree.flatten(y0)
    rows = (end - begin) * size
    # At least one micro-batch of room: XLA compiles the loop body even
    # when the loop runs zero times, and rejects a scatter into nothing.
    buffers = [
        tf.zeros(
            tf.concat([[_max(rows, size)], tf.shape(leaf)[1:]], 0), leaf.dtype
        )
        for leaf in y_leaves
    ]

    def body(i, carry, buffers):
        with tf.control_dependencies(carry):
            start = i * quotient + tf.minimum(i, remainder)
            micro_batch = _make_micro_batch(*xys, start, size, batch_size)
            carry, part = rest(micro_batch, list(carry))
        offset = (i - begin) * size
        # `offset + range(size)`: XLA needs the range's size constant.
        positions = tf.expand_dims(offset + tf.range(size), 1)
        buffers = [
            tf.tensor_scatter_nd_update(buffer, positions, leaf)
            for buffer, leaf in zip(buffers, keras.tree.flatten(part))
        ]
        return i + 1, carry, buffers

    invariants = [
        tf.TensorShape([None]).concatenate(t.shape[1:]) if grows else t.shape
        for t, grows in zip(carry, growing)
    ]
    _, carry, buffers = tf.while_loop(
        lambda i, carry, buffers: i < end,
        body,
        (tf.convert_to_tensor(begin, tf.int32), list(carry), buffers),
        shape_invariants=(
            tf.TensorShape([]),
            invariants,
            [buffer.shape for buffer in buffers],
        ),
        # One micro-batch in flight at a time: that is the memory saving.
        parallel_iterations=1,
    )
    buffers = [buffer[:rows] for buffer in buffers]
    return carry, keras.tree.pack_sequence_as(y0, buffers)


def _concat_rows(parts):
    if len(parts) == 1:
        return parts[0]
    return keras.tree.map_structure(
        lambda *items: tf.concat(items, axis=0), *parts
    )


def _gradient_layout(gradients, keep_sparse):
    """Records, per variable, whether its gradient is None, dense or sparse.

    Sparse gradients (embeddings) are summed as growing IndexedSlices, as
    the full batch's gradient would be; with `keep_sparse=False` (XLA, whose
    loops need fixed shapes) they are summed dense.
    """
    layout = []
    for gradient in gradients:
        if gradient is None:
            layout.append(None)
        elif keep_sparse and isinstance(gradient, tf.IndexedSlices):
            layout.append("sparse")
        else:
            layout.append("dense")
    return layout


def _pack_gradients(gradients, layout, variables):
    """Flattens gradients to tensors following `layout`.

    A `tf.while_loop` carry needs one fixed structure: `None` gradients are
    dropped, IndexedSlices become `(values, int64 indices)`, a gradient
    missing in this micro-batch only becomes zeros.
    """
    flat = []
    for kind, gradient, variable in zip(layout, gradients, variables):
        if kind is None:
            continue
        if kind == "dense":
            if gradient is None:
                gradient = tf.zeros(variable.shape, variable.dtype)
            flat.append(tf.convert_to_tensor(gradient))
        elif gradient is None:
            inner = list(variable.shape[1:])
            flat.append(tf.zeros([0] + inner, variable.dtype))
            flat.append(tf.zeros([0], tf.int64))
        elif isinstance(gradient, tf.IndexedSlices):
            flat.append(gradient.values)
            flat.append(tf.cast(gradient.indices, tf.int64))
        else:
            rows = tf.shape(gradient, out_type=tf.int64)[0]
            flat.append(gradient)
            flat.append(tf.range(rows))
    return flat


def _add_packed(total, part, layout):
    summed = []
    position = 0
    for kind in layout:
        if kind == "dense":
            summed.append(total[position] + part[position])
            position += 1
        elif kind == "sparse":
            # Stay sparse, as the full batch's embedding gradient would be.
            for offset in (0, 1):
                summed.append(
                    tf.concat(
                        [total[position + offset], part[position + offset]], 0
                    )
                )
            position += 2
    return summed


def _unpack_gradients(flat, layout, variables):
    gradients = []
    position = 0
    for kind, variable in zip(layout, variables):
        if kind is None:
            gradients.append(None)
        elif kind == "dense":
            gradients.append(flat[position])
            position += 1
        else:
            gradients.append(
                tf.IndexedSlices(
                    flat[position],
                    flat[position + 1],
                    tf.constant(list(variable.shape), tf.int64),
                )
            )
            position += 2
    return gradients


def _uses_xla(model):
    return bool(getattr(model, "jit_compile", False))


def accumulate_gradients(
    model, data, micro_batches, loss_fn=None, variables=None
):
    """Computes a batch's gradients micro-batch by micro-batch.

    The batch is split as `split_micro_batches` does. Micro-batch `i` runs
    `y_pred_i = model(x_i, training=True)` and `loss_i = loss_fn(...)`,
    weights the loss by its share of the samples `n_i / n`, multiplies it by
    the optimizer's loss scale (`optimizer.scale_loss`, for mixed precision)
    and takes its gradients; the gradients are summed. Micro-batch `i + 1`
    starts only after micro-batch `i`'s gradients have been added to the
    sum, so one micro-batch's activations are alive at a time. A batch
    smaller than `micro_batches` runs one micro-batch per sample.

    Nothing is updated here except what the forward pass itself updates
    (BatchNormalization moving statistics, seed generators): run the
    optimizer, metric and loss-tracker updates under
    `tf.control_dependencies(result.control_inputs())`, so that a step
    failing part-way leaves them untouched.

    Args:
        model: A built or buildable Keras model on the TensorFlow backend,
            compiled when `loss_fn` is `None`.
        data: The batch, as `train_step` receives it.
        micro_batches: The number of micro-batches, a Python `int` >= 1.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight) -> scalar`, the mean
            loss of one micro-batch. Defaults to what the built-in step
            uses: `model._compute_loss(..., training=True)` (the compiled
            loss plus `model.losses`, which then count once in total since
            the weights `n_i / n` sum to 1).
        variables: The variables to differentiate. Defaults to
            `model.trainable_weights`.

    Returns:
        An `AccumulatedGradients` tuple
        `(gradients, y_pred, loss, batch_size)`.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    ```python
    result = accumulate_gradients(model, data, 4)
    with tf.control_dependencies(result.control_inputs()):
        model.optimizer.apply(result.gradients, model.trainable_weights)
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    if loss_fn is None:
        loss_fn = _default_loss_fn(model)
    if variables is None:
        variables = model.trainable_weights
    variables = list(variables)
    layout = []

    def first(micro_batch):
        gradients, y_pred, loss = _micro_batch_gradients(
            model, micro_batch, variables, loss_fn, weighted=True
        )
        layout.extend(
            _gradient_layout(gradients, keep_sparse=not _uses_xla(model))
        )
        carry = _pack_gradients(gradients, layout, variables) + [loss]
        # Only the (values, indices) of sparse gradients grow.
        sizes = {"dense": [False], "sparse": [True, True], None: []}
        growing = [flag for kind in layout for flag in sizes[kind]]
        return carry, y_pred, growing + [False]

    def rest(micro_batch, carry):
        gradients, y_pred, loss = _micro_batch_gradients(
            model, micro_batch, variables, loss_fn, weighted=True
        )
        packed = _pack_gradients(gradients, layout, variables)
        summed = _add_packed(carry[:-1], packed, layout)
        return summed + [carry[-1] + loss], y_pred

    carry, y_pred, batch_size = _run_micro_batches(
        data, micro_batches, first, rest
    )
    return AccumulatedGradients(
        gradients=_unpack_gradients(carry[:-1], layout, variables),
        y_pred=y_pred,
        loss=unscale_loss_for_distribution(carry[-1]),
        batch_size=batch_size,
    )


def has_batch_statistics_layers(model):
    """Tells whether a model normalizes with batch statistics in training.

    Such layers (`keras.layers.BatchNormalization`, when trainable) see
    each micro-batch on its own: they normalize with the micro-batch's
    moments and update their moving statistics once per micro-batch.

    Args:
        model: A Keras model or layer.

    Returns:
        `True` if any trainable `BatchNormalization` layer is in `model`.

    Example:

    >>> model = keras.Sequential([keras.layers.BatchNormalization()])
    >>> has_batch_statistics_layers(model)
    True
    """
    return any(
        isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        for layer in model._flatten_layers(include_self=True, recursive=True)
    )


def _warn_batch_statistics_once(model, micro_batches):
    if micro_batches < 2 or getattr(model, _BATCH_STATS_WARNED_ATTR, False):
        return
    if not has_batch_statistics_layers(model):
        return
    # object.__setattr__: a plain flag, not tracked state.
    object.__setattr__(model, _BATCH_STATS_WARNED_ATTR, True)
    warnings.warn(
        f"Model {model.name!r} has BatchNormalization layers and trains with "
        f"micro_batches={micro_batches}: each micro-batch is normalized with "
        "its own statistics and the moving statistics are updated once per "
        "micro-batch. HINT: use GroupNormalization or LayerNormalization, "
        "freeze the BatchNormalization layers, or raise their momentum to "
        "momentum ** (1 / micro_batches).",
        stacklevel=2,
    )


def _build_optimizer(model):
    """Creates the optimizer's variables, as its first `apply` would.

    Done before any control dependency: XLA cannot lift the creation of a
    variable out of a compiled function when it depends on graph tensors.
    """
    optimizer = model.optimizer
    if optimizer is None or optimizer.built or not model.trainable_weights:
        return
    with keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(model.trainable_weights)
    optimizer.built = True


def _build_metrics(model, y, y_pred):
    """Creates the compiled metrics' variables (see `_build_optimizer`)."""
    metrics = getattr(model, "_compile_metrics", None)
    if metrics is not None and not metrics.built:
        metrics.build(y, y_pred)


def _finish_step(
    model, x, y, sample_weight, y_pred, loss, batch_size, gradients
):
    """The state updates of a step: loss tracker, optimizer, metrics."""
    model._loss_tracker.update_state(loss, sample_weight=batch_size)
    if gradients is not None:
        if model.trainable_weights:
            model.optimizer.apply(gradients, model.trainable_weights)
        else:
            warnings.warn("The model does not have any trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _shrink_step(model, data, micro_batches):
    if tf.distribute.has_strategy():
        # Each update all-reduces gradients (a `merge_call`), which cannot
        # run inside the micro-batch loop.
        strategy = type(tf.distribute.get_strategy()).__name__
        raise UnsupportedTrainingSetupError(
            "`micro_batch_mode='shrink'` is not supported under a "
            f"tf.distribute strategy ({strategy}). "
            "HINT: use micro_batch_mode='accumulate'."
        )
    variables = model.trainable_weights
    loss_fn = _default_loss_fn(model)

    def update(micro_batch):
        gradients, y_pred, loss = _micro_batch_gradients(
            model, micro_batch, variables, loss_fn, weighted=False
        )
        if variables:
            model.optimizer.apply(gradients, variables)
        # Reading `iterations` after the update (automatic control
        # dependencies order it after the write) gives the next micro-batch
        # something to wait for.
        done = tf.identity(model.optimizer.iterations)
        return loss, done, y_pred

    def first(micro_batch):
        loss, done, y_pred = update(micro_batch)
        return [loss, done], y_pred, [False, False]

    def rest(micro_batch, carry):
        loss, done, y_pred = update(micro_batch)
        return [carry[0] + loss, done], y_pred

    carry, y_pred, batch_size = _run_micro_batches(
        data, micro_batches, first, rest
    )
    return unscale_loss_for_distribution(carry[0]), y_pred, batch_size, carry


def micro_batch_train_step(model, data, micro_batches, mode="accumulate"):
    """A micro-batched `train_step` for any compiled Keras model.

    Use it as the body of `train_step` (the `MemGuardMixin` does), or
    through `make_step_function` for a compiled step per `micro_batches`.

    In `"accumulate"` mode it computes the same update as the built-in
    `train_step` on the whole batch (see `accumulate_gradients`): one
    `optimizer.apply` with the summed gradients; the loss tracker is updated
    with the full-batch loss and weight `batch_size`, and the metrics with
    the whole batch's outputs. All these updates run only after every
    micro-batch's gradients exist, so a step that fails part-way (an
    out-of-memory error) leaves them untouched; BatchNormalization moving
    statistics, updated during each forward pass, are the exception.

    In `"shrink"` mode each micro-batch makes its own optimizer update (with
    its own mean loss): `micro_batches` updates per batch, each from fewer
    samples. The learning rate is not scaled here. The loss tracker and the
    metrics are updated once at the end, but the weight updates of the
    micro-batches that ran before a failure stay applied.

    Args:
        model: A compiled Keras model on the TensorFlow backend.
        data: The batch, as `train_step` receives it.
        micro_batches: The number of micro-batches, a Python `int` >= 1,
            fixed at trace time. A batch with fewer samples uses one
            micro-batch per sample.
        mode: `"accumulate"` or `"shrink"`. Defaults to `"accumulate"`.

    Returns:
        The logs `dict` the built-in `train_step` returns
        (`model.compute_metrics(...)`).

    Raises:
        ValueError: If `micro_batches` or `mode` is invalid.
        UnsupportedTrainingSetupError: If `mode` is `"shrink"` under a
            `tf.distribute` strategy (its updates cannot synchronize
            inside the micro-batch loop).

    Example:

    ```python
    class MyModel(keras.Model):
        def train_step(self, data):
            return micro_batch_train_step(self, data, 4)
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    mode = validate_mode(mode)
    _warn_batch_statistics_once(model, micro_batches)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    _build_optimizer(model)
    if mode == "accumulate":
        result = accumulate_gradients(model, data, micro_batches)
        _build_metrics(model, y, result.y_pred)
        with tf.control_dependencies(result.control_inputs()):
            return _finish_step(
                model,
                x,
                y,
                sample_weight,
                result.y_pred,
                result.loss,
                result.batch_size,
                result.gradients,
            )
    loss, y_pred, batch_size, carry = _shrink_step(model, data, micro_batches)
    _build_metrics(model, y, y_pred)
    with tf.control_dependencies(carry + _flat_tensors(y_pred)):
        return _finish_step(
            model, x, y, sample_weight, y_pred, loss, batch_size, None
        )


def _step_body(model, micro_batches, mode):
    # A MemGuardMixin model runs its own (maybe overridden) `train_step`
    # with `micro_batches` pinned to this function's `k`.
    train_step_for = getattr(model, "_memguard_train_step_for", None)
    if train_step_for is not None:
        return train_step_for(micro_batches, mode)

    def train_step(data):
        return micro_batch_train_step(model, data, micro_batches, mode)

    return train_step


def make_step_function(model, micro_batches, mode="accumulate"):
    """Builds the compiled training step of one batch for a given `k`.

    The step is what Keras' `_make_function` compiles for one batch:
    `model.distribute_strategy.run(train_step, args=(data,))` followed by
    `reduce_per_replica(..., reduction="auto")`, wrapped in
    `tf.function(reduce_retracing=True, jit_compile=model.jit_compile)`
    (plain Python when `model.run_eagerly`). The train step is
    `micro_batch_train_step(model, data, micro_batches, mode)`; for a
    `MemGuardMixin` model it is the model's own `train_step`, run with
    `model.micro_batches` and `model.micro_batch_mode` reading
    `micro_batches` and `mode`.

    Contract of the returned `step(data) -> logs`:

    - `data` is one batch as `next(iterator)` gives it (a per-replica value
      under a `tf.distribute` strategy); `logs` is a `dict` of scalar
      tensors, as `model.train_function` returns.
    - Call it between batches, not inside another `tf.function`.
    - In `"accumulate"` mode a `tf.errors.ResourceExhaustedError` raised by
      the call leaves weights, optimizer variables and metrics unchanged
      (BatchNormalization moving statistics excepted): the same `data` can
      be passed again to a step with a larger `k`.
    - It captures the model's optimizer, metrics and loss tracker when first
      traced: build new step functions after `model.compile()`. Tracing
      happens on the first call (and again for new input shapes); keep one
      step function per `(micro_batches, mode)`.

    Args:
        model: A compiled Keras model on the TensorFlow backend.
        micro_batches: The number of micro-batches, a Python `int` >= 1.
        mode: `"accumulate"` or `"shrink"`. Defaults to `"accumulate"`.

    Returns:
        The step function.

    Raises:
        ValueError: If `micro_batches` or `mode` is invalid.

    Example:

    ```python
    step = make_step_function(model, 4)
    iterator = iter(dataset)
    logs = step(next(iterator))
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    mode = validate_mode(mode)
    train_step = _step_body(model, micro_batches, mode)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = model.distribute_strategy.run(train_step, args=(data,))
        return reduce_per_replica(
            outputs, model.distribute_strategy, reduction="auto"
        )

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
        )
    # Keras' iterators may yield `tf.experimental.Optional` for missing
    # elements; the built-in converts them to None the same way.
    return model._autoconvert_optionals(one_step_on_data)
