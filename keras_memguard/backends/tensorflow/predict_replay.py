"""A `Model.predict_function` that predicts a batch in slices when memory runs out.

Keras' `predict` calls `model.predict_function` with the batches of one
execution and keeps every batch's outputs, as tensors on the device, until
it concatenates them after the last batch: a long `predict` fills the
device with its own outputs, and a batch that runs out of memory ends it.
`ReplayPredictFunction` runs Keras' `predict_step` on each batch in slices
(as many as its plan says), copies each slice's outputs to host memory
(numpy) at once, and after an out-of-memory error goes on with the samples
not yet predicted in smaller slices. Predicting has no state, so nothing is
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

from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.eval_replay import optionals_to_none
from keras_memguard.backends.tensorflow.eval_replay import relaxed_spec
from keras_memguard.backends.tensorflow.eval_replay import single_replica
from keras_memguard.backends.tensorflow.eval_replay import slice_batch
from keras_memguard.backends.tensorflow.eval_replay import slices_of
from keras_memguard.backends.tensorflow.eval_replay import spec_key
from keras_memguard.backends.tensorflow.replay import batch_size_of
from keras_memguard.backends.tensorflow.replay import sample_size_of
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.step import cached_function


class ReplayPredictFunction:
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
            batch, or `None`.
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
        plan: Called as `plan(batch_size, sample_size)` before each batch;
            returns the number of slices to predict it in. `None` keeps the
            count in force. Defaults to `None`.

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

    def __init__(self, model, micro_batches=1, on_out_of_memory=None, plan=None):
        self.model = model
        self.micro_batches = validate_micro_batches(micro_batches)
        self.on_out_of_memory = on_out_of_memory
        self.plan = plan
        self.last_batch_size = None
        self.last_sample_size = None
        self.samples_done = 0
        self._previous = None
        self._installed = False

    @staticmethod
    def supports(model):
        """Tells whether a model's predictions can be cut in slices.

        Args:
            model: A Keras model.

        Returns:
            `True` unless the model is distributed over several replicas.
        """
        strategy = getattr(model, "distribute_strategy", None)
        return getattr(strategy, "num_replicas_in_sync", 1) == 1

    def install(self):
        """Makes this function the model's `predict_function`.

        Raises:
            UnsupportedTrainingSetupError: If the model runs on several
                replicas (see `supports`).
        """
        if not self.supports(self.model):
            replicas = self.model.distribute_strategy.num_replicas_in_sync
            raise UnsupportedTrainingSetupError(
                "ReplayPredictFunction cannot split prediction batches of a "
                f"model distributed over {replicas} replicas. HINT: predict "
                "with Keras' own predict function (do not install this one)."
            )
        if self._installed:
            return
        compat.concatenate_predictions_on_host()
        self._previous = self.model.predict_function
        functions.set_predict_function(self.model, self)
        self._installed = True

    def restore(self):
        """Puts back the `predict_function` found by `install()`. Safe to call twice."""
        if self._installed and self.model.predict_function is self:
            functions.set_predict_function(self.model, self._previous)
        self._installed = False
        self._previous = None

    def __call__(self, batches):
        try:
            outputs = [self.run(batch) for batch in batches]
        except BaseException:
            # `predict` stops here without `on_predict_end`.
            self.restore()
            raise
        if len(outputs) == 1:
            return outputs[0]
        return tree.map_structure(lambda *parts: _join(parts), *outputs)

    def run(self, data):
        """Predicts one batch, in smaller slices after an out-of-memory error.

        Args:
            data: One batch as the dataset yields it.

        Returns:
            The batch's outputs, dense ones as numpy arrays.
        """
        data = single_replica(data)
        step = predict_step_function(self.model)
        batch_size = batch_size_of(data)
        self.last_batch_size = batch_size
        if not batch_size:
            return _to_host(step.call(data))
        if self.plan is not None:
            self.last_sample_size = sample_size_of(data)
            self.micro_batches = validate_micro_batches(
                self.plan(batch_size, self.last_sample_size)
            )
        parts = []
        self.samples_done = 0
        while self.samples_done < batch_size:
            done = self.samples_done
            for start, size in slices_of(done, batch_size - done, batch_size, self.micro_batches):
                piece = data if size == batch_size else slice_batch(data, start, size)
                try:
                    parts.append(_to_host(step.call(piece)))
                except tf.errors.ResourceExhaustedError as error:
                    self._raise_micro_batches(batch_size, size, error)
                    break
                self.samples_done += size
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *pieces: _join(pieces), *parts)

    def _raise_micro_batches(self, batch_size, failed_size, error):
        if self.on_out_of_memory is None:
            raise error
        failed_micro_batches = -(-batch_size // failed_size)
        new = validate_micro_batches(
            self.on_out_of_memory(batch_size, failed_micro_batches, error)
        )
        if new <= failed_micro_batches:
            raise ValueError(
                "`on_out_of_memory` must return more micro-batches than the "
                f"{failed_micro_batches} that ran out of memory. "
                f"Received: {new}"
            ) from error
        self.micro_batches = new


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


class _PredictStep:
    """Keras' one-batch predict step, compiled once per input structure.

    Traced with an unknown batch size, as Keras' own predict function is, so
    a slice of any size reuses the trace.
    """

    def __init__(self, model):
        self._eager = model.run_eagerly
        self._traced = set()
        model_ref = weakref.ref(model)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            model = model_ref()
            outputs = model.distribute_strategy.run(model.predict_step, args=(data,))
            return compat.reduce_per_replica(
                outputs, model.distribute_strategy, reduction="concat"
            )

        if not self._eager:
            one_step_on_data = tf.function(
                one_step_on_data,
                reduce_retracing=True,
                jit_compile=model.jit_compile,
            )
        self._function = one_step_on_data

    def call(self, data):
        """Returns the model's outputs for one batch."""
        data = optionals_to_none(data)
        if not self._eager:
            key = spec_key(data)
            if key not in self._traced:
                self._function.get_concrete_function(relaxed_spec(data))
                self._traced.add(key)
        return self._function(data)


def predict_step_function(model):
    """Returns the model's cached compiled one-batch predict step.

    Args:
        model: A Keras model on the TensorFlow backend.

    Returns:
        An object whose `call(data)` returns the model's outputs for one
        batch.
    """
    return cached_function(model, ("predict",), lambda: _PredictStep(model))
