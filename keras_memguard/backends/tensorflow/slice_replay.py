"""Running Keras' one-batch step over slices of a batch, replayed on OOM.

`SlicedStepFunction` is the slicing engine of `ReplayTestFunction` and
`ReplayPredictFunction`; `CompiledBatchStep` compiles their one-batch
steps once per input structure, with an unknown batch size, so that a
slice of any size reuses the trace.

Only `tf.errors.ResourceExhaustedError` is caught; every other exception
passes through unchanged.
"""

import tensorflow as tf
from keras import tree

from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat
from keras_memguard.backends.tensorflow import xla_memory
from keras_memguard.backends.tensorflow.replay import batch_size_of
from keras_memguard.backends.tensorflow.replay import sample_size_of
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches


class SlicedStepFunction:
    """Runs a batch in slices, in smaller slices after running out of memory.

    The engine of `ReplayTestFunction` and `ReplayPredictFunction`, which
    take the same arguments and have the same attributes (see them). A
    batch of `n` samples runs as `micro_batches` slices of sizes as equal as
    possible, one compiled call each; when a slice runs out of memory,
    `on_out_of_memory` chooses a larger count and the samples not yet done
    go on in slices of about `n / micro_batches` samples.

    A subclass sets `_attribute` (the model's step function it replaces),
    `_set_function` (that attribute's writer in
    `keras_memguard.step_functions`) and `_refusal` (the error for a model
    on several replicas, formatted with `replicas`), and defines the hooks:
    `_start_batch()` returns the compiled step for the next batch;
    `_run_slice(step, data, fraction)` runs a slice holding `fraction` of
    the batch (1: all of it) and returns its result; `_combine(parts)`
    returns the batch's result from its slices'. `_on_failed_slice()`,
    `_on_install()` and `_on_restore()` are optional.

    `plan`, when given, is called as `plan(batch_size, sample_size, data)`
    before each batch and returns the count to run it in.

    `plan_compiled`, for a step XLA compiles, is called as
    `plan_compiled(step, data, batch_size, micro_batches)` before each
    batch, after `plan`, with the compiled step `_start_batch()` returned
    (a `CompiledBatchStep`); it returns the count to run the batch in
    (`compiled_slices.CompiledSlicePlanner`).
    """

    _attribute = None
    _set_function = None
    _refusal = None

    def __init__(
        self, model, micro_batches=1, on_out_of_memory=None, plan=None, plan_compiled=None
    ):
        self.model = model
        self.micro_batches = validate_micro_batches(micro_batches)
        self.on_out_of_memory = on_out_of_memory
        self.plan = plan
        self.plan_compiled = plan_compiled
        self.last_batch_size = None
        self.last_sample_size = None
        self.samples_done = 0
        self._previous = None
        self._installed = False

    @staticmethod
    def supports(model):
        """Tells whether a model's batches can be cut in slices.

        Args:
            model: A Keras model.

        Returns:
            `True` unless the model is distributed over several replicas.
        """
        strategy = getattr(model, "distribute_strategy", None)
        return getattr(strategy, "num_replicas_in_sync", 1) == 1

    def install(self):
        """Makes this function the model's `test_function` or `predict_function`.

        Raises:
            UnsupportedTrainingSetupError: If the model runs on several
                replicas (see `supports`).
        """
        if not self.supports(self.model):
            replicas = self.model.distribute_strategy.num_replicas_in_sync
            raise UnsupportedTrainingSetupError(self._refusal.format(replicas=replicas))
        if self._installed:
            return
        self._on_install()
        self._previous = getattr(self.model, self._attribute)
        self._set_function(self.model, self)
        self._installed = True

    def restore(self):
        """Puts back the function found by `install()`. Safe to call twice."""
        if self._installed and getattr(self.model, self._attribute) is self:
            self._set_function(self.model, self._previous)
        self._installed = False
        self._previous = None
        self._on_restore()

    def run(self, data):
        """Runs one batch, in smaller slices after an out-of-memory error.

        Args:
            data: One batch as the dataset yields it.

        Returns:
            The batch's result, joined from its slices' (see `_combine`):
            the test step's logs (the metrics over every batch evaluated so
            far), or the outputs, dense ones as numpy arrays.
        """
        data = single_replica(data)
        step = self._start_batch()
        batch_size = batch_size_of(data)
        self.last_batch_size = batch_size
        self.samples_done = 0
        if not batch_size:
            # Nothing to split (no batch dimension): Keras' behaviour.
            return self._run_slice(step, data, 1)
        if self.plan is not None:
            self.last_sample_size = sample_size_of(data)
            self.micro_batches = validate_micro_batches(
                self.plan(batch_size, self.last_sample_size, data)
            )
        if self.plan_compiled is not None:
            # An XLA step: no count whose compiled program does not fit runs.
            self.micro_batches = validate_micro_batches(
                self.plan_compiled(step, data, batch_size, self.micro_batches)
            )
        parts = []
        while self.samples_done < batch_size:
            done = self.samples_done
            for start, size in slices_of(done, batch_size - done, batch_size, self.micro_batches):
                try:
                    piece = data if size == batch_size else slice_batch(data, start, size)
                    parts.append(self._run_slice(step, piece, size / batch_size))
                except tf.errors.ResourceExhaustedError as error:
                    self._on_failed_slice()
                    self._raise_micro_batches(batch_size, size, error)
                    break
                self.samples_done += size
        return self._combine(parts)

    def _raise_micro_batches(self, batch_size, failed_size, error):
        if self.on_out_of_memory is None:
            raise error
        failed_micro_batches = -(-batch_size // failed_size)
        new = self.on_out_of_memory(batch_size, failed_micro_batches, error)
        new = validate_micro_batches(new)
        if new <= failed_micro_batches:
            # The same slice again would fail again (each failure costs the
            # allocator's retries): insist on smaller slices.
            raise ValueError(
                "`on_out_of_memory` must return more micro-batches than the "
                f"{failed_micro_batches} that ran out of memory. "
                f"Received: {new}"
            ) from error
        self.micro_batches = new

    def _on_failed_slice(self):
        """Undoes what the slice that ran out of memory may have changed."""

    def _on_install(self):
        """Prepares for a run, before the function is installed."""

    def _on_restore(self):
        """Lets go of a run's state, after the function is put back."""


def slices_of(done, remaining, batch_size, micro_batches):
    """Yields `(start, size)` of the slices covering the samples left.

    The samples left are cut into slices of about `batch_size /
    micro_batches` (sizes differ by at most one), so that going on after a
    failure uses the slice size the new count asks for.
    """
    count = min(remaining, -(-micro_batches * remaining // batch_size))
    quotient, extra = divmod(remaining, count)
    start = done
    for i in range(count):
        size = quotient + int(i < extra)
        yield start, size
        start += size


def _slice_rows(item, start, size):
    if item is None:
        return None
    if isinstance(item, tf.SparseTensor):
        rank = item.shape.rank
        return tf.sparse.slice(
            item,
            tf.constant([start] + [0] * (rank - 1), tf.int64),
            tf.concat([tf.constant([size], tf.int64), item.dense_shape[1:]], 0),
        )
    if not isinstance(item, (tf.Tensor, tf.RaggedTensor)):
        item = tf.convert_to_tensor(item)
    if item.shape.rank == 0:
        # A per-batch scalar is shared by every slice.
        return item
    # Slice where the batch lives (the host, for most input pipelines): no
    # copy of the whole batch onto the accelerator.
    with tf.device(getattr(item, "device", None) or None):
        return item[start : start + size]


def slice_batch(data, start, size):
    """Returns the rows `start` to `start + size` of every tensor of a batch."""
    return tree.map_structure(lambda item: _slice_rows(item, start, size), data)


def single_replica(data):
    """Unwraps per-replica values of a one-replica strategy into tensors."""

    def unwrap(item):
        values = getattr(item, "values", None)
        if values is not None and not hasattr(item, "shape") and len(values) == 1:
            return values[0]
        return item

    return tree.map_structure(unwrap, data)


class CompiledBatchStep:
    """Keras' one-batch step, compiled once per input structure.

    Traced with an unknown batch size, as Keras' own step functions are, so
    a slice of any size reuses the trace.

    Args:
        model: The Keras model; its `run_eagerly` and `jit_compile` settings
            apply.
        body: `body(data)`, the step (as Keras' `one_step_on_data`).
    """

    def __init__(self, model, body):
        self._eager = model.run_eagerly
        self._traced = set()
        if not self._eager:
            body = tf.function(body, reduce_retracing=True, jit_compile=model.jit_compile)
        self._function = body

    def call(self, data):
        """Returns what the step returns for one batch."""
        data = compat.optionals_to_none(data)
        if not self._eager:
            key = spec_key(data)
            if key not in self._traced:
                self._function.get_concrete_function(relaxed_spec(data))
                self._traced.add(key)
        return self._function(data)

    def memory(self, data):
        """What XLA assigns to the step for `data`'s shapes, before it runs.

        Returns:
            A `StepMemory` (see `xla_memory.step_memory`), or `None` when
            the step is not compiled by XLA or its program cannot be read.
        """
        if self._eager:
            return None
        return xla_memory.step_memory(self._function, data, 1)


def relaxed_spec(data):
    """The batch's type spec with an unknown batch size, as Keras traces."""

    def relax(item):
        if item is None:
            return None
        spec = tf.type_spec_from_value(item)
        if spec.shape.rank:
            spec = compat.with_unknown_batch_size(spec)
        return spec

    return tree.map_structure(relax, data)


def spec_key(data):
    """A hashable key of a batch's structure, dtypes and inner shapes."""
    return tuple(
        None
        if item is None
        else (type(item).__name__, item.dtype, tuple(item.shape[1:]))
        for item in tf.nest.flatten(data)
    ) + (tf.nest.map_structure(lambda _: 0, data).__repr__(),)
