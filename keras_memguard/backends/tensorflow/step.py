"""Step assembly: the micro-batched `train_step` and its compiled functions.

`micro_batch_train_step` is the built-in TensorFlow `train_step` made of
micro-batches: in `"accumulate"` mode it applies the summed gradients once
(the whole batch's update), in `"shrink"` mode it applies each
micro-batch's own update. Every state update of an accumulate step (loss
tracker, per-output loss trackers, optimizer, metrics) runs only after every
micro-batch's gradients exist, so a step that fails part-way with an
out-of-memory error changes nothing and the same batch can be replayed with
a larger `k`. BatchNormalization moving statistics, updated inside each
micro-batch's forward pass, are the exception.

`make_step_function` compiles one batch's step for a given `k`, as Keras'
`_make_function` compiles its own, and `cached_function` keeps every
compiled function of a model in one cache keyed on what it captured.
"""

import warnings

import keras
import tensorflow as tf

from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.forward_writes import warn_batch_statistics_once
from keras_memguard.backends import compat
from keras_memguard.backends.tensorflow import remat
from keras_memguard.backends.tensorflow import xla_memory
from keras_memguard.backends.tensorflow.setup import gradient_bytes
from keras_memguard.backends.tensorflow.accumulation import ACCUMULATED_ATTR
from keras_memguard.backends.tensorflow.accumulation import _micro_batch
from keras_memguard.backends.tensorflow.accumulation import accumulate_gradients
from keras_memguard.backends.tensorflow.accumulation import build_metrics
from keras_memguard.backends.tensorflow.accumulation import compiled_loss_compute
from keras_memguard.backends.tensorflow.accumulation import flat_tensors
from keras_memguard.backends.tensorflow.accumulation import run_micro_batches
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.splitting import validate_mode

_CACHE_ATTR = "_memguard_function_cache"


def build_optimizer(model):
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


# Set on `MemGuardMixin.train_step`, so this module need not import the
# mixin (which imports it): an override of the mixin's step lacks it.
MIXIN_STEP_MARK = "_memguard_mixin_step"


def trains_with_own_step(model):
    """Whether `model.train_step` is neither Keras' nor the mixin's."""
    step = type(model).train_step
    return step is not keras.Model.train_step and not getattr(
        step, MIXIN_STEP_MARK, False
    )


def build_training_state(model, data):
    """Creates the model's, metrics' and optimizer's variables before a step.

    Keras defers this to the first traced step when no distribution strategy
    is set. A first step that runs out of memory must not be the one that
    creates and initializes state, so it is built symbolically here, as
    Keras' own `_symbolic_build` does under a strategy. A model with a
    `train_step` of its own that Keras cannot build this way (no `call`, as
    in a VAE made of an encoder and a decoder) gets its optimizer built
    from the weights it has; the rest is built by its first step.
    """
    if isinstance(keras.tree.flatten(data)[0], tf.distribute.DistributedValues):
        return  # `fit` already built it under the strategy.
    try:
        try:
            compat.symbolic_build(model, data)
        except (ValueError, NotImplementedError, TypeError, RuntimeError):
            if not trains_with_own_step(model):
                raise
            build_optimizer(model)
    except tf.errors.ResourceExhaustedError as error:
        raise state_does_not_fit(model, error) from error


def state_does_not_fit(model, error):
    """The error for training state that ran out of memory as it was created.

    No micro-batch count changes the memory the model's weights and its
    optimizer's slots take, so the guard stops with what does not fit
    rather than TensorFlow's message about one of the variables.
    """
    weights = gradient_bytes(model)
    optimizer = type(model.optimizer).__name__ if model.optimizer else "none"
    return MicroBatchTooLargeError(
        "The model's training state does not fit in device memory: creating it "
        "before the first step ran out of memory. Its trainable weights take "
        f"{weights / 2**20:.1f} MiB, and the optimizer ({optimizer}) keeps "
        "variables of its own beside them (Adam two per weight, SGD with "
        "momentum one); no micro-batch count makes room for them. HINT: an "
        "optimizer that keeps "
        "less per weight, mixed precision, a smaller model, or less held on "
        f"the device beside it. TensorFlow said: {error.message.splitlines()[0]}"
    )


def _update_output_losses(model, output_losses):
    """Updates each `<output>_loss` tracker once, as Keras does per batch.

    Keras weighs each update by the batch size known when its train
    function was traced, from the dataset's element spec: unknown for a
    batched dataset with a short last batch (weight 1 per batch), or the
    same for every batch. Weight 1 per batch gives the same mean in both
    cases.
    """
    metrics = compat.per_output_loss_metrics(model)
    if not output_losses or len(metrics) != len(output_losses):
        return
    for metric, value in zip(metrics, output_losses):
        metric.update_state(value)


def finish_step(model, data, result, gradients):
    """The state updates of a micro-batched step; returns the step's logs.

    Updates the loss tracker with the whole batch's loss, each output's loss
    tracker once, applies `gradients` (`None`: already applied, shrink mode)
    and updates the compiled metrics: from `result.metric_state` when they
    were updated micro-batch by micro-batch, else from the whole batch's
    outputs. Call it under `tf.control_dependencies(result.control_inputs())`.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    tracker = compat.loss_tracker(model)
    if tracker is not None:
        tracker.update_state(result.loss, sample_weight=result.batch_size)
    _update_output_losses(model, result.output_losses)
    if gradients is not None:
        if model.trainable_weights:
            model.optimizer.apply(gradients, model.trainable_weights)
        else:
            warnings.warn("The model does not have any trainable weights.")
    if result.metric_state is not None:
        metrics = compat.compiled_metrics(model)
        for variable, value in zip(metrics.variables, result.metric_state):
            variable.assign(value)
        return model.get_metrics_result()
    return model.compute_metrics(x, y, result.y_pred, sample_weight=sample_weight)


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
    object.__setattr__(model, ACCUMULATED_ATTR, True)
    variables = model.trainable_weights
    compute = compiled_loss_compute(model, micro_batches)

    def update(micro_batch):
        part = _micro_batch(model, micro_batch, variables, compute, weighted=False)
        if variables:
            model.optimizer.apply(part.gradients, variables)
        # Reading `iterations` after the update (automatic control
        # dependencies order it after the write) gives the next micro-batch
        # something to wait for.
        done = tf.identity(model.optimizer.iterations)
        return [part.loss, done] + part.output_losses, part.y_pred

    def first(micro_batch):
        carry, y_pred = update(micro_batch)
        return carry, y_pred, [False] * len(carry)

    def rest(micro_batch, carry):
        values, y_pred = update(micro_batch)
        summed = [carry[0] + values[0], values[1]]
        summed += [a + b for a, b in zip(carry[2:], values[2:])]
        return summed, y_pred

    # The compiled metrics are updated once from the whole batch's outputs.
    keep_outputs = (
        compat.compiled_metrics(model) is not None
        or type(model).compute_metrics is not keras.Model.compute_metrics
    )
    carry, y_pred, batch_size = run_micro_batches(
        data, micro_batches, first, rest, collect_outputs=keep_outputs,
        xla=xla_memory.uses_xla(model),
    )
    return carry, y_pred, batch_size


class _ShrinkResult:
    def __init__(self, carry, y_pred, batch_size):
        self.loss = compat.unscale_loss_for_distribution(carry[0])
        self.output_losses = carry[2:]
        self.y_pred = y_pred
        self.batch_size = batch_size
        self.metric_state = None
        self._carry = carry

    def control_inputs(self):
        return list(self._carry) + flat_tensors(self.y_pred)


def micro_batch_train_step(model, data, micro_batches, mode="accumulate"):
    """A micro-batched `train_step` for any compiled Keras model.

    Use it as the body of `train_step` (the `MemGuardMixin` does), or
    through `make_step_function` for a compiled step per `micro_batches`.

    In `"accumulate"` mode it computes the same update as the built-in
    `train_step` on the whole batch (see `accumulate_gradients`): one
    `optimizer.apply` with the summed gradients; the loss tracker and each
    output's loss tracker are updated once with the whole batch's values,
    and the compiled metrics see every sample once. All these updates run
    only after every micro-batch's gradients exist, so a step that fails
    part-way (an out-of-memory error) leaves them untouched;
    BatchNormalization moving statistics, updated during each forward pass,
    are the exception.

    In `"shrink"` mode each micro-batch makes its own optimizer update (with
    its own mean loss): `micro_batches` updates per batch, each from fewer
    samples. The learning rate is not scaled here. The trackers and the
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
        The logs `dict` the built-in `train_step` returns.

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
    warn_batch_statistics_once(model, micro_batches)
    build_optimizer(model)
    if mode == "accumulate":
        result = accumulate_gradients(
            model, data, micro_batches, update_metrics=True
        )
        if result.y_pred is not None:
            _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            build_metrics(model, y, result.y_pred)
        with tf.control_dependencies(result.control_inputs()):
            return finish_step(model, data, result, result.gradients)
    result = _ShrinkResult(*_shrink_step(model, data, micro_batches))
    if result.y_pred is not None:
        _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        build_metrics(model, y, result.y_pred)
    with tf.control_dependencies(result.control_inputs()):
        return finish_step(model, data, result, None)


def _refusal(model, micro_batches):
    name = type(model).__name__
    return UnsupportedTrainingSetupError(
        f"{name} has its own `train_step`, which does not split the batch: at "
        f"micro_batches={micro_batches} it would still run the whole batch "
        "at once. HINT: compute the gradients with "
        "`result = self.accumulate_gradients(data, compute_loss)`, where "
        "`compute_loss(x, y, sample_weight)` runs one micro-batch and returns "
        "its mean loss (or `(loss, extras)`), then apply `result.gradients` "
        "and update your trackers under "
        "`tf.control_dependencies(result.control_inputs())`; see the README."
    )


def step_body(model, micro_batches, mode):
    """The per-replica `train_step` of the compiled step for `micro_batches`.

    A `MemGuardMixin` model runs its own (maybe overridden) `train_step`
    with `micro_batches` pinned to this `k`; an override that does not go
    through `accumulate_gradients` is refused at `k > 1` (it would report
    `k` micro-batches while running the whole batch). Any other model with
    a `train_step` of its own runs it, whole, at `k = 1` only.
    """
    pinned = getattr(model, "_memguard_train_step_for", None)
    if pinned is None and trains_with_own_step(model):
        # A step of the model's own, outside the mixin: nothing in it can be
        # split, so it runs whole (the guard caps the count at one).
        if micro_batches > 1:
            raise _refusal(model, micro_batches)
        return model.train_step
    if pinned is None:

        def train_step(data):
            return micro_batch_train_step(model, data, micro_batches, mode)

        return train_step
    inner = pinned(micro_batches, mode)

    def checked_train_step(data):
        object.__setattr__(model, ACCUMULATED_ATTR, False)
        logs = inner(data)
        if micro_batches > 1 and not model.__dict__.get(ACCUMULATED_ATTR):
            raise _refusal(model, micro_batches)
        return logs

    return checked_train_step


def make_step_function(model, micro_batches, mode="accumulate"):
    """Builds the compiled training step of one batch for a given `k`.

    The step is what Keras' `_make_function` compiles for one batch:
    `model.distribute_strategy.run(train_step, args=(data,))` followed by
    Keras' per-replica reduction, wrapped in
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
    - In `"accumulate"` mode a `tf.errors.ResourceExhaustedError` raised by
      the call leaves weights, optimizer variables, metrics and trackers
      unchanged (BatchNormalization moving statistics excepted): the same
      `data` can be passed again to a step with a larger `k`.
    - It captures the model's optimizer, metrics and loss tracker when first
      traced: get steps through `cached_function`, which drops them when
      the model is compiled again.

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
    logs = step(next(iterator))
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    mode = validate_mode(mode)
    train_step = step_body(model, micro_batches, mode)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = model.distribute_strategy.run(train_step, args=(data,))
        return compat.reduce_per_replica(
            outputs, model.distribute_strategy, reduction="auto"
        )

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=model.jit_compile,
        )
        compat.omit_frequent_tracing_warning(one_step_on_data)
    step = compat.autoconvert_optionals(model, one_step_on_data)
    if step is not one_step_on_data:
        step.compiled_step = one_step_on_data
    return step


def tracing_count(step):
    """How many times a step from `make_step_function` was traced.

    With `reduce_retracing=True` a step traces once for its first input
    shapes and once more, with the varying dimensions left open, for all
    later ones. `None` for a step that runs eagerly.
    """
    compiled = getattr(step, "compiled_step", step)
    count = getattr(compiled, "experimental_get_tracing_count", None)
    return None if count is None else count()


def _summed_added_losses(model):
    """The marked losses, where any is marked: what a trace counts whole.

    The model's own tuple (marked once), so the cache compares it by
    identity as the rest.
    """
    summed = compat.summed_added_losses(model)
    return summed if summed and any(summed) else None


def cached_function(model, key, build):
    """Returns the model's compiled function for `key`, building it once.

    The one cache of compiled functions (train steps per `k`, the
    multi-worker phases, the test step). It lives on the model (the
    functions close over it, so a cache elsewhere would keep the model
    alive) and is kept across `fit` calls; it is dropped when the model is
    compiled again or its execution settings change, since a function
    captures the optimizer, loss and metrics when traced; and when the
    guard marks losses the layers add as sums over samples
    (`compat.mark_summed_added_losses`), which a trace reads too.

    Args:
        model: The Keras model.
        key: A hashable key, e.g. `("train", k, mode)`.
        build: `build() -> function`, called on a miss.

    Returns:
        The function.
    """
    compiled_with = (
        # `None` for a model never compiled (it may still predict).
        getattr(model, "optimizer", None),
        compat.compiled_loss(model),
        compat.compiled_metrics(model),
        model.run_eagerly,
        model.jit_compile,
        _summed_added_losses(model),
    )
    entry = model.__dict__.get(_CACHE_ATTR)
    if entry is None or any(
        a is not b for a, b in zip(entry[0], compiled_with)
    ):
        entry = (compiled_with, {})
        # Plain Python state, kept out of Keras' attribute tracking.
        object.__setattr__(model, _CACHE_ATTR, entry)
    functions = entry[1]
    function = functions.get(key)
    if function is None:
        function = functions[key] = build()
    return function


def step_function(model, micro_batches, mode):
    """Returns the cached compiled step of `model` for `(micro_batches, mode)`."""
    return cached_function(
        model,
        ("train", micro_batches, mode, remat.is_on(model)),
        lambda: make_step_function(model, micro_batches, mode),
    )
