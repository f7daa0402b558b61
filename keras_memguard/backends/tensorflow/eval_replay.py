"""A `Model.test_function` that evaluates a batch in slices when memory runs out.

Keras' own test function pulls the next batch inside the compiled call, so a
step that raises `tf.errors.ResourceExhaustedError` takes its batch, and the
whole `fit`, with it. `ReplayTestFunction` pulls the batch first and runs
Keras' compiled one-batch test step on it. On an out-of-memory error it asks
its handler for more micro-batches and goes on evaluating the *rest* of the
batch in smaller slices, one compiled call per slice (the slicing engine is
`slice_replay.SlicedStepFunction`).

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

from keras_memguard.backends import compat
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.replay import run_execution
from keras_memguard.backends.tensorflow.slice_replay import CompiledBatchStep
from keras_memguard.backends.tensorflow.slice_replay import SlicedStepFunction
from keras_memguard.backends.tensorflow.step import cached_function


class ReplayTestFunction(SlicedStepFunction):
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
        last_sample_size: Elements of one sample's inputs in the last
            batch (read when a `plan` is given), or `None`.
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
        plan: Called as `plan(batch_size, sample_size, data)` before each batch
            (`sample_size`: elements of one sample's inputs; `data`: the
            batch as the dataset yields it); returns the
            number of slices to evaluate it in. `None` keeps the count in
            force. Defaults to `None`.
        plan_compiled: For a step XLA compiles: called as
            `plan_compiled(step, data, batch_size, micro_batches)` after
            `plan`; returns the count the compiled program fits at (see
            `SlicedStepFunction`). Defaults to `None`.

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

    _attribute = "test_function"
    _set_function = staticmethod(functions.set_test_function)
    _refusal = (
        "ReplayTestFunction cannot split evaluation batches of a model "
        "distributed over {replicas} replicas. HINT: evaluate with "
        "Keras' own test function (do not install this one)."
    )

    def __init__(
        self, model, micro_batches=1, on_out_of_memory=None, plan=None, plan_compiled=None
    ):
        super().__init__(model, micro_batches, on_out_of_memory, plan, plan_compiled)
        # (variable, value) of every metric variable after the last slice
        # that completed; `None` until the first batch of an evaluation.
        self._saved = None
        # The data iterator of the current evaluation (weakly).
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

    def _start_batch(self):
        if self._saved is None:
            self._saved = _read_metrics(self.model)
        return test_step_function(self.model)

    def _run_slice(self, step, data, fraction):
        logs, after = step.call(data, fraction)
        if fraction == 1:
            self._saved = after
        else:
            self._saved = _count_slice_once(self.model, self._saved, after, fraction)
        return logs

    def _combine(self, parts):
        # The logs of the last slice: the metrics over every batch so far.
        logs = parts[-1]
        if logs is not None and self.micro_batches > 1 and _per_call_variables(self.model):
            # The step's own logs predate the reweighing of the slices.
            logs = compat.metrics_result_or_logs(self.model, logs)
        return logs

    def _on_failed_slice(self):
        _write_metrics(self.model, self._saved)

    def _on_install(self):
        self._saved = None

    def _on_restore(self):
        self._saved = None
        self._iterator = None


def _reference(value):
    try:
        return weakref.ref(value)
    except TypeError:  # Not weakly referenceable: keep it.
        return lambda: value


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


class _TestStep(CompiledBatchStep):
    """Keras' compiled one-batch test step, also returning the metric values.

    The values of the metric variables after the step are read inside the
    same call (ordered after the updates by the function's automatic
    control dependencies), so keeping them costs no extra call per slice.
    """

    def __init__(self, model):
        self.variables = None
        # Keras' loss tracker weighs each call's loss by its samples: a
        # slice's summed loss times the inverse of its share of the batch
        # then adds up to the batch's sum (`compat.scaling_summed_losses`).
        # A variable, read when the step runs: one trace serves every slice.
        self._summed_scale = tf.Variable(1.0, trainable=False, dtype=tf.float32)
        self._scale = 1.0
        # Weak: the step lives in a cache keyed weakly by the model.
        model_ref = weakref.ref(model)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            model = model_ref()
            # As Keras' `_make_function` does for `model.test_step`.
            with compat.scaling_summed_losses(self._summed_scale):
                outputs = model.distribute_strategy.run(model.test_step, args=(data,))
            outputs = compat.reduce_per_replica(
                outputs, model.distribute_strategy, reduction="auto"
            )
            variables = list(model.metrics_variables)
            self.variables = variables
            return outputs, [tf.identity(v.value) for v in variables]

        super().__init__(model, one_step_on_data)

    def call(self, data, fraction=1.0):
        """Returns `(logs, [(variable, value after the step), ...])`.

        `fraction`: the slice's share of its batch.
        """
        scale = 1.0 / float(fraction)
        if scale != self._scale:
            self._summed_scale.assign(scale)
            self._scale = scale
        logs, values = super().call(data)
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
