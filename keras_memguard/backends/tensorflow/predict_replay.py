"""A `Model.predict_function` that predicts a batch in slices when memory runs out.

Keras' `predict` calls `model.predict_function` with the batches of one
execution and keeps every batch's outputs, as tensors on the device, until
it concatenates them after the last batch: a long `predict` fills the
device with its own outputs, and a batch that runs out of memory ends it.
`ReplayPredictFunction` runs Keras' `predict_step` on each batch in slices
(as many as its plan says), copies each slice's outputs to host memory
(numpy) at once, and after an out-of-memory error goes on with the samples
not yet predicted in smaller slices (the slicing engine is
`slice_replay.SlicedStepFunction`). Predicting has no state, so nothing is
put back after a failure. `concatenate_on_host` (installed by `install`)
makes Keras' final concatenation join those host arrays with numpy instead
of a device op.

Only `tf.errors.ResourceExhaustedError` is caught; every other exception
passes through unchanged.
"""

import weakref

import numpy as np
import tensorflow as tf
from keras import tree

from keras_memguard.backends import compat
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.slice_replay import CompiledBatchStep
from keras_memguard.backends.tensorflow.slice_replay import SlicedStepFunction
from keras_memguard.backends.tensorflow.step import cached_function


class ReplayPredictFunction(SlicedStepFunction):
    """Predicts each batch in slices, in smaller slices after running out of memory.

    Install it as `model.predict_function` (with `install()`) for the
    duration of a `predict`. Every dense output leaves the device as soon
    as its slice is done; a batch's slices are joined in order, so the
    outputs equal those of a `predict` at any smaller batch size.

    Requires one replica (no multi-replica `tf.distribute` strategy): the
    slices are cut from the batch in Python.

    Attributes:
        micro_batches: The number of slices each batch is split into now.
        last_batch_size: The number of samples of the last batch, or `None`.
        last_sample_size: Elements of one sample's inputs in the last
            batch (read when a `plan` is given), or `None`.
        samples_done: How many samples of the current batch are predicted.

    Args:
        model: The compiled (or built) Keras model to predict with.
        micro_batches: The number of slices to split each batch into, an
            integer >= 1. Defaults to `1`.
        on_out_of_memory: Called as `on_out_of_memory(batch_size,
            micro_batches, error)` when a slice of about `batch_size /
            micro_batches` samples runs out of memory; returns a larger
            count to go on with, or raises. `None` re-raises the error.
            Defaults to `None`.
        plan: Called as `plan(batch_size, sample_size, data)` before each batch;
            returns the number of slices to predict it in. `None` keeps the
            count in force. Defaults to `None`.
        plan_compiled: For a step XLA compiles: called as
            `plan_compiled(step, data, batch_size, micro_batches)` after
            `plan`; returns the count the compiled program fits at (see
            `SlicedStepFunction`). Defaults to `None`.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    ```python
    function = ReplayPredictFunction(model, micro_batches=4)
    function.install()
    try:
        predictions = model.predict(x, batch_size=512)
    finally:
        function.restore()
    ```
    """

    _attribute = "predict_function"
    _set_function = staticmethod(functions.set_predict_function)
    _refusal = (
        "ReplayPredictFunction cannot split prediction batches of a "
        "model distributed over {replicas} replicas. HINT: predict "
        "with Keras' own predict function (do not install this one)."
    )

    def __call__(self, batches):
        try:
            outputs = [self.run(batch) for batch in batches]
        except BaseException:
            # `predict` stops here without `on_predict_end`.
            self.restore()
            raise
        return self._combine(outputs)

    def _start_batch(self):
        return predict_step_function(self.model)

    def _run_slice(self, step, data, fraction):
        return _to_host(step.call(data))

    def _combine(self, parts):
        # Also joins the batches of one execution.
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *pieces: _join(pieces), *parts)

    def _on_install(self):
        compat.concatenate_predictions_on_host()


def _to_host(outputs):
    """Copies every dense output to host memory; leaves ragged and sparse ones."""

    def move(item):
        if isinstance(item, tf.Tensor):
            # A copy: on the CPU `.numpy()` shares the tensor's buffer,
            # which would keep it in the device allocator.
            return np.array(item)
        return item

    return tree.map_structure(move, outputs)


def _join(parts):
    """Joins the outputs of consecutive slices along the batch axis."""
    if all(isinstance(part, np.ndarray) for part in parts):
        if parts[0].ndim == 0:
            return np.stack(parts)
        return np.concatenate(parts, axis=0)
    return tf.concat(list(parts), axis=0)


def _predict_step(model):
    """Keras' one-batch predict step, compiled once per input structure."""
    # Weak: the step lives in a cache keyed weakly by the model.
    model_ref = weakref.ref(model)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        model = model_ref()
        # As Keras' `_make_function` does for `model.predict_step`.
        outputs = model.distribute_strategy.run(model.predict_step, args=(data,))
        return compat.reduce_per_replica(
            outputs, model.distribute_strategy, reduction="concat"
        )

    return CompiledBatchStep(model, one_step_on_data)


def predict_step_function(model):
    """Returns the model's cached compiled one-batch predict step.

    Args:
        model: A Keras model on the TensorFlow backend.

    Returns:
        An object whose `call(data)` returns the model's outputs for one
        batch.
    """
    return cached_function(model, ("predict",), lambda: _predict_step(model))
