"""A `Model.test_function` that evaluates a batch in slices when memory runs out.

Keras' own test function pulls the next batch inside the compiled call, so a
step that raises `tf.errors.ResourceExhaustedError` takes its batch, and the
whole `fit`, with it. `ReplayTestFunction` pulls the batch first and runs
Keras' compiled one-batch test step on it. On an out-of-memory error it asks
its handler for more micro-batches and goes on evaluating the *rest* of the
batch in smaller slices, one compiled call per slice.

Keras' evaluation metrics (the loss tracker, the compiled metrics)
accumulate over samples, so evaluating the slices one after the other gives the
metrics of the whole batch. Two rules keep that exact after a failure:

- The samples already evaluated are counted once: evaluation goes on from
  the first sample of the slice that failed, never from the batch's start.
- A slice that fails changes nothing: the metric variables are put back to
  their values after the last slice that completed (an out-of-memory error
  can strike after the loss tracker was updated, while a metric is still
  being computed).

One Keras metric does not accumulate over samples: with several outputs,
each output's loss (`<output>_loss`) is recorded once per call of the test
step, whatever the batch size. A sliced batch's updates of those trackers
are weighed by each slice's share of the batch, so that they add up to the
one update Keras makes for the whole batch.

The number of micro-batches of evaluation is its own: it never changes the
training step's, and an evaluation batch's memory says nothing about a
training step's.

Only `tf.errors.ResourceExhaustedError` is caught; every other exception
passes through unchanged.
"""

import weakref

import tensorflow as tf
from keras import tree

from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.replay import batch_size_of
from keras_memguard.backends.tensorflow.replay import run_execution
from keras_memguard.backends.tensorflow.replay import sample_size_of
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.step import cached_function


class ReplayTestFunction:
    """Evaluates one batch at a time, in smaller slices after running out of memory.

    Install it as `model.test_function` (with `install()`) for the duration
    of an evaluation; Keras' `evaluate` (and so `fit`'s validation) calls it
    with the epoch's data iterator once per execution (`steps_per_execution`
    batches), reading `model.test_function` afresh at every step.

    A batch of `n` samples runs as `micro_batches` slices of sizes as equal as
    possible, one compiled call of `model.test_step` each (`micro_batches=1`:
    the whole batch in one call, as Keras does). When a slice runs out of
    memory, the metric variables are put back to their values after the
    last completed slice, `on_out_of_memory` chooses a larger count, and the
    samples not yet evaluated are split into slices of about
    `n / micro_batches` samples. The new count stays for the next batches.

    Requires one replica (no multi-replica `tf.distribute` strategy): the
    slices are cut from the batch in Python. A custom `test_step` must
    update only metrics that accumulate over samples (as Keras' own do).

    Attributes:
        micro_batches: The number of slices each batch is split into now.
        last_batch_size: The number of samples of the last batch, or `None`.
        samples_done: How many samples of the current batch are evaluated
            (read by `on_out_of_memory`: where evaluation goes on from).

    Args:
        model: The compiled Keras model to evaluate.
        micro_batches: The number of slices to split each batch into, an
            integer >= 1. Defaults to `1`.
        on_out_of_memory: Called as `on_out_of_memory(batch_size,
            micro_batches, error)` when a slice runs out of memory, where the
            failed slice held about `batch_size / micro_batches` samples (a
            slice of one sample gives `micro_batches == batch_size`). It
            returns a larger number of micro-batches to go on with, or
            raises. `None` re-raises the error. Defaults to `None`.
        plan: Called as `plan(batch_size, sample_size)` before each batch
            (`sample_size`: elements of one sample's inputs); returns the
            number of slices to evaluate it in. `None` keeps the count in
            force. Defaults to `None`.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    ```python
    function = ReplayTestFunction(model, micro_batches=4)
    function.install()
    try:
        model.evaluate(x, y, batch_size=256)
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
        # (variable, value) of every metric variable after the last slice
        # that completed; `None` until the first batch of an evaluation.
        self._saved = None
        # The data iterator of the current evaluation (weakly).
        self._iterator = None

    @staticmethod
    def supports(model):
        """Tells whether a model's evaluation can be replayed in slices.

        Args:
            model: A compiled Keras model.

        Returns:
            `True` unless the model is distributed over several replicas.
        """
        strategy = getattr(model, "distribute_strategy", None)
        return getattr(strategy, "num_replicas_in_sync", 1) == 1

    def install(self):
        """Makes this function the model's `test_function`.

        Raises:
            UnsupportedTrainingSetupError: If the model runs on several
                replicas (see `supports`).
        """
        if not self.supports(self.model):
            replicas = self.model.distribute_strategy.num_replicas_in_sync
            raise UnsupportedTrainingSetupError(
                "ReplayTestFunction cannot split evaluation batches of a model "
                f"distributed over {replicas} replicas. HINT: evaluate with "
                "Keras' own test function (do not install this one)."
            )
        if self._installed:
            return
        self._previous = self.model.test_function
        functions.set_test_function(self.model, self)
        self._installed = True
        self._saved = None

    def restore(self):
        """Puts back the `test_function` found by `install()`. Safe to call twice."""
        if self._installed and self.model.test_function is self:
            functions.set_test_function(self.model, self._previous)
        self._installed = False
        self._previous = None
        self._saved = None
        self._iterator = None

    def __call__(self, iterator):
        if self._iterator is None or self._iterator() is not iterator:
            # A new evaluation (each has its own iterator): `evaluate` reset
            # the metrics after `on_test_begin`, so read them at its first
            # batch, not before.
            self._iterator = _reference(iterator)
            self._saved = None
        try:
            return run_execution(self.model, iterator, self.run)
        except tf.errors.OutOfRangeError:
            raise  # The end of the data, not a failure.
        except BaseException:
            # `evaluate` (and `fit`) stop here without `on_test_end`: leave
            # the model with the test function it had.
            self.restore()
            raise

    def run(self, data):
        """Evaluates one batch, in smaller slices after an out-of-memory error.

        Args:
            data: One batch as the dataset yields it.

        Returns:
            The test step's logs after the batch: the metrics over every
            batch evaluated so far.
        """
        data = single_replica(data)
        step = test_step_function(self.model)
        batch_size = batch_size_of(data)
        self.last_batch_size = batch_size
        self.samples_done = 0
        if self._saved is None:
            self._saved = _read_metrics(self.model)
        if not batch_size:
            # Nothing to split (no batch dimension): Keras' behaviour.
            logs, self._saved = step.call(data)
            return logs
        if self.plan is not None:
            self.last_sample_size = sample_size_of(data)
            self.micro_batches = validate_micro_batches(
                self.plan(batch_size, self.last_sample_size)
            )
        logs = None
        while self.samples_done < batch_size:
            remaining = batch_size - self.samples_done
            for start, size in slices_of(
                self.samples_done, remaining, batch_size, self.micro_batches
            ):
                try:
                    if size == batch_size:
                        logs, self._saved = step.call(data)
                    else:
                        logs, after = step.call(slice_batch(data, start, size))
                        self._saved = _count_slice_once(
                            self.model, self._saved, after, size / batch_size
                        )
                except tf.errors.ResourceExhaustedError as error:
                    _write_metrics(self.model, self._saved)
                    self._raise_micro_batches(batch_size, size, error)
                    break
                self.samples_done += size
        if logs is not None and self.micro_batches > 1 and _per_call_variables(self.model):
            # The step's own logs predate the reweighing above.
            logs = compat.metrics_result_or_logs(self.model, logs)
        return logs

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


def _reference(value):
    try:
        return weakref.ref(value)
    except TypeError:  # Not weakly referenceable: keep it.
        return lambda: value


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
    return tree.map_structure(lambda item: _slice_rows(item, start, size), data)


def single_replica(data):
    """Unwraps per-replica values of a one-replica strategy into tensors."""

    def unwrap(item):
        values = getattr(item, "values", None)
        if values is not None and not hasattr(item, "shape") and len(values) == 1:
            return values[0]
        return item

    return tree.map_structure(unwrap, data)


def _read_metrics(model):
    return [(variable, tf.identity(variable.value)) for variable in model.metrics_variables]


def _write_metrics(model, saved):
    """Puts the metric variables back to `saved`.

    A metric with a variable `saved` does not hold was created by the call
    that failed: it goes back to its initial state.
    """
    known = set()
    for variable, value in saved:
        variable.assign(value)
        known.add(id(variable))
    for metric in model.metrics:
        if any(id(variable) not in known for variable in metric.variables):
            metric.reset_state()


def _per_call_variables(model):
    """The variables of the metrics Keras updates once per call, not per sample.

    Keras' compiled loss records each output's loss with the batch size known
    at trace time, which is unknown here (as in Keras' own test function):
    one update of weight 1 per call.
    """
    metrics = compat.per_output_loss_metrics(model)
    return {id(variable) for metric in metrics for variable in metric.variables}


def _count_slice_once(model, before, after, fraction):
    """Weighs a slice's per-call metric updates by its share of the batch.

    The slices of a batch then add up to one update, the batch's.
    """
    per_call = _per_call_variables(model)
    if not per_call:
        return after
    old = {id(variable): value for variable, value in before}
    scaled = []
    for variable, value in after:
        start = old.get(id(variable))
        if id(variable) in per_call and start is not None:
            value = start + (value - start) * tf.cast(fraction, value.dtype)
            variable.assign(value)
        scaled.append((variable, value))
    return scaled


def optionals_to_none(data):
    # As Keras' `_autoconvert_optionals`, before the spec is read.
    return tree.map_structure(
        lambda item: None if isinstance(item, tf.experimental.Optional) else item,
        data,
    )


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
    return tuple(
        None
        if item is None
        else (type(item).__name__, item.dtype, tuple(item.shape[1:]))
        for item in tf.nest.flatten(data)
    ) + (tf.nest.map_structure(lambda _: 0, data).__repr__(),)


class _TestStep:
    """Keras' compiled one-batch test step, also returning the metric values.

    Traced once per input structure with an unknown batch size, as Keras'
    own test function is (so a slice of any size reuses the trace, and the
    metrics behave as in Keras). The values of the metric variables after
    the step are read inside the same call (ordered after the updates by the
    function's automatic control dependencies), so keeping them costs no
    extra call per slice.
    """

    def __init__(self, model):
        self.variables = None
        self._eager = model.run_eagerly
        self._traced = set()
        # Weak: the step lives in a cache keyed weakly by the model.
        model_ref = weakref.ref(model)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            model = model_ref()
            # As Keras' `_make_function` does for `model.test_step`.
            outputs = model.distribute_strategy.run(model.test_step, args=(data,))
            outputs = compat.reduce_per_replica(
                outputs, model.distribute_strategy, reduction="auto"
            )
            variables = list(model.metrics_variables)
            self.variables = variables
            return outputs, [tf.identity(v.value) for v in variables]

        if not self._eager:
            one_step_on_data = tf.function(
                one_step_on_data,
                reduce_retracing=True,
                jit_compile=model.jit_compile,
            )
        self._function = one_step_on_data

    def call(self, data):
        """Returns `(logs, [(variable, value after the step), ...])`."""
        data = optionals_to_none(data)
        if not self._eager:
            key = spec_key(data)
            if key not in self._traced:
                self._function.get_concrete_function(relaxed_spec(data))
                self._traced.add(key)
        logs, values = self._function(data)
        return logs, list(zip(self.variables, values))


def test_step_function(model):
    """Returns the model's cached compiled one-batch test step.

    The step is rebuilt when the model is compiled again (a new loss or new
    metrics), since it captures them when traced.

    Args:
        model: A compiled Keras model on the TensorFlow backend.

    Returns:
        An object whose `call(data)` evaluates one batch and returns
        `(logs, saved)`: Keras' test-step logs and the metric variables with
        their values after the step.
    """
    return cached_function(model, ("test",), lambda: _TestStep(model))
