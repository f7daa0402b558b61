"""The accumulation engine: micro-batch by micro-batch forward and backward passes.

`accumulate_gradients` runs the micro-batches of a batch one after the other
and adds up what the whole batch's step needs: the gradients, the loss, each
output's loss, the extras of a custom loss, and (where it gives the same
result) the compiled metrics' state. Each micro-batch's loss is weighted by
its share of the samples `n_i / n`, so the sums are the whole batch's means;
a loss that averages over a mask (a Keras mask, `ignore_class`) is weighted
by its share of the unmasked elements instead.

Micro-batch 0 runs first, the others in `tf.while_loop`s (one per
micro-batch size, so slice shapes are constant inside a loop, as XLA needs)
with `parallel_iterations=1` and control dependencies on the previous
micro-batch's results: two micro-batches are never alive together, and the
trace time does not grow with `k`.

Sparse gradients (`tf.IndexedSlices`, from embedding lookups) are summed
with duplicate rows added together: Keras' optimizers apply element-wise ops
to `IndexedSlices` row by row (Adam squares each row), so a row that appears
twice would be updated differently from the dense gradient. The reference
is the whole batch's dense gradient, which is what Keras'
`gradient_accumulation_steps` accumulates. A step of one micro-batch sums
nothing: its sparse gradients reach the optimizer as Keras made them, one
row per lookup, so a step the guard does not split updates as plain `fit`.

Nothing here changes a variable except the forward pass itself
(BatchNormalization moving statistics, seed generators): the caller runs the
optimizer, metric and tracker updates under
`tf.control_dependencies(result.control_inputs())`.
"""

import warnings
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from keras_memguard.backends import compat
from keras_memguard.backends import shared
from keras_memguard.backends.tensorflow import remat
from keras_memguard.backends.tensorflow.splitting import first_tensor
from keras_memguard.backends.tensorflow.splitting import leading_size
from keras_memguard.backends.tensorflow.splitting import make_micro_batch
from keras_memguard.backends.tensorflow.splitting import maximum
from keras_memguard.backends.tensorflow.splitting import plan_split
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.xla_memory import uses_xla

# Set on a model while one of its steps is traced and `accumulate_gradients`
# ran: a `train_step` override that never calls it cannot be split.
ACCUMULATED_ATTR = "_memguard_accumulated"
_INPUT_LOSS_WARNED_ATTR = "_memguard_input_loss_warned"


class AccumulatedGradients(NamedTuple):
    """What `accumulate_gradients` returns.

    Attributes:
        gradients: One gradient per variable (same order), summed over the
            micro-batches and still multiplied by the optimizer's loss scale
            (`optimizer.apply` unscales). `None` for variables the loss does
            not depend on, as `tf.GradientTape.gradient` gives. Sparse
            gradients have each row once.
        y_pred: The model outputs of the whole batch (the micro-batches'
            outputs concatenated), or `None` when they were not kept: with
            a custom `compute_loss`, or with `update_metrics` where no
            metric reads them.
        loss: The whole batch's mean loss: the micro-batch losses weighted
            by their share of the samples, summed; for the model's own loss,
            unscaled for distribution (the value the built-in step gives the
            loss tracker); a `loss_fn` or `compute_loss` of yours comes back
            on the scale it returned, as `extras` do.
        batch_size: The number of samples in the batch, a scalar `int32`
            tensor.
        extras: A `dict` of the extras `compute_loss` returned, each
            combined as `loss` is (share-weighted sum: the whole batch's
            mean of a per-micro-batch mean). Empty without them.
        output_losses: Each output's unweighted loss for the whole batch,
            in the order of the compiled loss's `<output>_loss` metrics
            (multi-output models); empty otherwise.
        metric_state: The compiled metrics' variable values after every
            micro-batch, or `None` when the metrics were not updated here.
    """

    gradients: list
    y_pred: Any
    loss: Any
    batch_size: Any
    extras: dict = {}
    output_losses: list = []
    metric_state: Any = None

    def control_inputs(self):
        """Returns the tensors every state update must wait for.

        Returns:
            A flat `list` of tensors: all gradients, the losses and the
            outputs. Put optimizer, metric and loss-tracker updates under
            `tf.control_dependencies(result.control_inputs())`.
        """
        tensors = flat_tensors(
            [
                self.gradients,
                self.loss,
                self.y_pred,
                self.extras,
                self.output_losses,
                self.metric_state,
            ]
        )
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


def flat_tensors(structure):
    """The tensors of a nested structure (`IndexedSlices` as two tensors)."""
    tensors = []
    for item in keras.tree.flatten(structure):
        if item is None:
            continue
        if isinstance(item, tf.IndexedSlices):
            tensors.extend([item.values, item.indices])
        else:
            tensors.append(item)
    return tensors


def forward(model, x):
    """`model(x, training=True)`, as the built-in train step calls it.

    With the `"remat"` rung on, the same layers in recomputed segments.
    """
    segments = remat.segments_of(model)
    if segments:
        return remat.recomputed_forward(segments, x)
    if compat.call_has_training_arg(model):
        return model(x, training=True)
    return model(x)


def metrics_read_whole_batch_outputs(model):
    """Tells whether the step's metrics need the whole batch's outputs.

    `shared.metrics_read_whole_batch_outputs` with this backend's
    `metrics_update_per_micro_batch`.
    """
    return shared.metrics_read_whole_batch_outputs(model, metrics_update_per_micro_batch)


def metrics_update_per_micro_batch(model):
    """Tells whether the compiled metrics can be updated micro-batch by micro-batch.

    `shared.metrics_update_per_micro_batch`, where one replica trains (the
    replicas' metrics are updated from the whole batch's outputs).
    """
    if not shared.metrics_update_per_micro_batch(model):
        return False
    context = tf.distribute.get_replica_context()
    return context is None or context.num_replicas_in_sync <= 1


def _warn_input_dependent_losses(model, losses, inputs, micro_batches):
    """Warns once when `add_loss` values depend on the micro-batch's inputs.

    A loss added in `call` that is a mean over the batch is combined
    exactly (weighted by each micro-batch's share); one that is a sum over
    the batch's samples ends up about `1 / micro_batches` of its size,
    unless the guard's check before its first split measured it and
    marked it to be counted whole (`split_loss`): then nothing is said
    here. Weight regularization does not depend on the inputs: always
    exact.
    """
    if micro_batches < 2 or getattr(model, _INPUT_LOSS_WARNED_ATTR, False):
        return
    if compat.summed_added_losses(model) is not None:
        return
    if not tf.inside_function():
        return
    sources = {id(t.op) for t in flat_tensors(inputs) if hasattr(t, "op")}
    # A mean over the batch is exact; only a sum (a `Sum` op between the
    # inputs and the loss, and no `Mean`) is not.
    if not any(_sums_over_inputs(loss, sources) for loss in losses):
        return
    object.__setattr__(model, _INPUT_LOSS_WARNED_ATTR, True)
    warnings.warn(
        f"Model {model.name!r} adds losses that depend on its inputs "
        "(`add_loss` in `call`, or an activity regularizer). Under "
        f"micro_batches={micro_batches} each micro-batch's value is weighted "
        "by its share of the samples: exact for a mean over the batch "
        "(`ops.mean`), but a sum over the batch's samples (`ops.sum`) "
        f"counts about 1/{micro_batches} of its value. HINT: reduce such "
        "losses with a mean over the batch.",
        stacklevel=2,
    )


def _sums_over_inputs(tensor, source_ops, limit=100000):
    """Whether `tensor` sums over values computed from `source_ops`.

    Walks the graph back from `tensor` to the inputs: true when it reaches
    them through a `Sum` and no `Mean` (`ops.mean` is exact).
    """
    if not hasattr(tensor, "op"):
        return False
    seen = set()
    types = set()
    reached = False
    stack = [tensor.op]
    while stack and len(seen) < limit:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        if id(op) in source_ops:
            reached = True
            continue
        types.add(op.type)
        stack.extend(t.op for t in op.inputs)
    return reached and "Sum" in types and "Mean" not in types


def _input_losses(model):
    try:
        return list(model.losses)
    except Exception:  # noqa: BLE001 - a warning's check must not fail a step.
        return []


class _MicroBatchResult(NamedTuple):
    gradients: list
    y_pred: Any
    loss: Any
    output_losses: list
    extras: dict
    # `(valid, total)` elements of the mask the loss averaged over, or None.
    mask_share: Any = None


def _micro_batch(model, micro_batch, variables, compute, weighted):
    """Forward and backward pass of one micro-batch.

    `compute(micro_batch) -> (loss, y_pred, output_losses, extras,
    mask_share)` gives the micro-batch's mean loss. With `weighted`, the
    gradients are those of the loss times the micro-batch's share of the
    samples (accumulation); without, those of its own mean loss (one update
    per micro-batch). The returned losses and extras are always weighted,
    before loss scaling: the micro-batches' values sum to the whole
    batch's. A loss that averaged over a mask's `(valid, total)` elements
    (`mask_share`) is weighted by its share of the samples times
    `valid / total`: summed, that is the whole batch's masked mean times
    `sum(valid) / sum(total)`, which `_Engine.result` divides out.
    """
    # Accumulating, a summed loss's share-weighted value must be its own sum.
    summed_scale = 1.0 / micro_batch.fraction if weighted else 1.0
    with tf.GradientTape() as tape, compat.scaling_summed_losses(summed_scale):
        loss, y_pred, output_losses, extras, mask_share = compute(micro_batch)
        fraction = tf.cast(micro_batch.fraction, loss.dtype)
        if weighted and mask_share is not None:
            valid, total = mask_share
            fraction *= tf.math.divide_no_nan(
                tf.cast(valid, loss.dtype), tf.cast(total, loss.dtype)
            )
        weighted_loss = loss * fraction
        target = weighted_loss if weighted else loss
        if model.optimizer is not None:
            target = model.optimizer.scale_loss(target)
    gradients = tape.gradient(target, variables)

    def weigh(value):
        value = tf.convert_to_tensor(value)
        return value * tf.cast(fraction, value.dtype)

    return _MicroBatchResult(
        gradients=list(gradients),
        y_pred=y_pred,
        loss=weighted_loss,
        output_losses=[weigh(v) for v in output_losses],
        extras={name: weigh(v) for name, v in extras.items()},
        mask_share=mask_share if weighted else None,
    )


def compiled_loss_compute(model, micro_batches):
    """The per-micro-batch computation of the built-in train step.

    Runs the model and its compiled loss (plus `model.losses`), and records
    the compiled loss's per-output values instead of letting it update
    their trackers once per micro-batch.
    """

    def compute(micro_batch):
        y_pred = forward(model, micro_batch.x)
        with compat.recording_per_output_losses(model) as recorded:
            with compat.recording_loss_masks() as masks:
                loss = compat.compute_loss(
                    model,
                    micro_batch.x,
                    micro_batch.y,
                    y_pred,
                    micro_batch.sample_weight,
                )
        _warn_input_dependent_losses(
            model, _input_losses(model), micro_batch.x, micro_batches
        )
        output_losses = [values[-1] for values in recorded if values]
        return loss, y_pred, output_losses, {}, _mask_share(model, masks, output_losses, micro_batches)

    return compute


def _mask_share(model, masks, output_losses, micro_batches):
    """The one mask a model's loss averaged over, or `None`.

    Exact combination needs every term of the loss to average over the same
    elements: one masked loss on a model with one loss. Several loss terms
    with a mask are combined by their share of the samples, with a warning.
    """
    if len(masks) == 1 and len(output_losses) <= 1:
        return masks[0]
    if masks and micro_batches > 1:
        shared.warn_masked_loss_terms_once(
            model, len(output_losses) or len(masks), micro_batches, stacklevel=2
        )
    return None


def custom_loss_compute(compute_loss):
    """Wraps a user's `compute_loss(x, y, sample_weight)` for the engine."""

    def compute(micro_batch):
        result = compute_loss(
            micro_batch.x, micro_batch.y, micro_batch.sample_weight
        )
        extras = {}
        if isinstance(result, (tuple, list)):
            if len(result) != 2 or not isinstance(result[1], dict):
                raise ValueError(
                    "`compute_loss` must return a scalar loss or a tuple "
                    "`(loss, extras)` with `extras` a dict of scalars. "
                    f"Received: {result!r}"
                )
            result, extras = result
        loss = tf.convert_to_tensor(result)
        if loss.shape.rank:
            raise ValueError(
                "`compute_loss` must return the micro-batch's mean loss, a "
                f"scalar. Received a tensor of shape {loss.shape}."
            )
        return loss, None, [], dict(extras), None

    return compute


def accumulate_gradients(
    model,
    data,
    micro_batches,
    loss_fn=None,
    variables=None,
    compute_loss=None,
    update_metrics=False,
):
    """Computes a batch's gradients micro-batch by micro-batch.

    The batch is split as `split_micro_batches` does. Micro-batch `i` runs
    forward and computes its mean loss, weights it by its share of the
    samples `n_i / n`, multiplies it by the optimizer's loss scale
    (`optimizer.scale_loss`, for mixed precision) and takes its gradients;
    the gradients are summed. Micro-batch `i + 1` starts only after
    micro-batch `i`'s gradients have been added to the sum, so one
    micro-batch's activations are alive at a time. A batch smaller than
    `micro_batches` runs one micro-batch per sample.

    Nothing is updated here except what the forward pass itself updates
    (BatchNormalization moving statistics, seed generators): run the
    optimizer, metric and tracker updates under
    `tf.control_dependencies(result.control_inputs())`, so that a step
    failing part-way leaves them untouched.

    Args:
        model: A built or buildable Keras model on the TensorFlow backend.
        data: The batch, as `train_step` receives it.
        micro_batches: The number of micro-batches, a Python `int` >= 1.
        loss_fn: `loss_fn(x, y, y_pred, sample_weight) -> scalar`, the mean
            loss of one micro-batch from the model's outputs. Defaults to
            what the built-in step uses: the compiled loss plus
            `model.losses`.
        variables: The variables to differentiate. Defaults to
            `model.trainable_weights`.
        compute_loss: For a `train_step` of your own:
            `compute_loss(x, y, sample_weight)` runs one micro-batch (call
            your layers in it) and returns its mean loss, or a tuple
            `(loss, extras)` with `extras` a dict of scalar means to
            combine the same way (in `result.extras`). Replaces `loss_fn`
            and the model's own forward pass. Defaults to `None`.
        update_metrics: Update the compiled metrics' state micro-batch by
            micro-batch (in `result.metric_state`) instead of keeping the
            whole batch's outputs, where that gives the same result (see
            `metrics_update_per_micro_batch`), and keep the outputs only
            where the metrics read them (`result.y_pred` is `None`
            otherwise). Defaults to `False`.

    Returns:
        An `AccumulatedGradients` tuple.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1, or
            `compute_loss` returns something other than a scalar loss or
            `(loss, extras)`.

    Example:

    ```python
    result = accumulate_gradients(model, data, 4)
    with tf.control_dependencies(result.control_inputs()):
        model.optimizer.apply(result.gradients, model.trainable_weights)
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    object.__setattr__(model, ACCUMULATED_ATTR, True)
    if compute_loss is not None:
        compute = custom_loss_compute(compute_loss)
        update_metrics = False
    elif loss_fn is not None:

        def compute(micro_batch):
            y_pred = forward(model, micro_batch.x)
            loss = loss_fn(
                micro_batch.x, micro_batch.y, y_pred, micro_batch.sample_weight
            )
            return loss, y_pred, [], {}, None

    else:
        compute = compiled_loss_compute(model, micro_batches)
    # The built-in step's metrics read the outputs only where they cannot
    # be updated micro-batch by micro-batch; a loss of the caller's keeps
    # them for the caller.
    keep_outputs = compute_loss is None and (
        not update_metrics or metrics_read_whole_batch_outputs(model)
    )
    update_metrics = update_metrics and metrics_update_per_micro_batch(model)
    if variables is None:
        variables = model.trainable_weights
    variables = list(variables)
    # Keras' own loss is scaled down by the replica count (its gradients
    # are summed over replicas); a loss of the user's is not.
    unscale = compute_loss is None and loss_fn is None
    engine = _Engine(
        model, variables, compute, update_metrics, unscale, whole=micro_batches == 1
    )
    carry, y_pred, batch_size = run_micro_batches(
        data,
        micro_batches,
        engine.first,
        engine.rest,
        collect_outputs=keep_outputs,
        xla=uses_xla(model),
    )
    return engine.result(carry, y_pred, batch_size)


class _Engine:
    """Builds the loop carry of `accumulate_gradients` and reads it back.

    The carry is a flat list: the packed gradients, the loss, the output
    losses, the extras (sorted by name), the summed `(valid, total)` of a
    loss's mask where it has one, then the metric state.
    """

    def __init__(self, model, variables, compute, update_metrics, unscale=True,
                 whole=False):
        self.model = model
        # One micro-batch: nothing is summed, and the gradients stay as given.
        self.whole = whole
        self.unscale = unscale
        self.variables = variables
        self.compute = compute
        self.update_metrics = update_metrics
        self.layout = []
        self.sizes = None
        self.extra_names = []

    def _metrics_update(self, state, micro_batch, y_pred):
        metrics = compat.compiled_metrics(self.model)
        state = list(state)
        updated = metrics.stateless_update_state(
            state, micro_batch.y, y_pred, micro_batch.sample_weight
        )
        # A variable the update did not write comes back as the variable.
        return [
            old if isinstance(new, keras.Variable) else new
            for old, new in zip(state, updated)
        ]

    def first(self, micro_batch):
        part = _micro_batch(
            self.model, micro_batch, self.variables, self.compute, weighted=True
        )
        self.layout = _gradient_layout(
            part.gradients,
            keep_sparse=not uses_xla(self.model),
            as_given=self.whole,
        )
        self.extra_names = sorted(part.extras)
        carry = _pack_gradients(part.gradients, self.layout, self.variables)
        carry += [part.loss] + part.output_losses
        carry += [part.extras[name] for name in self.extra_names]
        masks = _mask_values(part.mask_share)
        carry += masks
        metric_state = []
        if self.update_metrics:
            build_metrics(self.model, micro_batch.y, part.y_pred)
            metrics = compat.compiled_metrics(self.model)
            initial = [v.value for v in metrics.variables]
            metric_state = list(
                self._metrics_update(initial, micro_batch, part.y_pred)
            )
        self.sizes = (
            len(carry) - 1 - len(part.output_losses) - len(self.extra_names) - len(masks),
            len(part.output_losses),
            len(self.extra_names),
            len(masks),
            len(metric_state),
        )
        kinds = {"dense": [False], "sparse": [True, True], "rows": [True, True], None: []}
        growing = [flag for kind in self.layout for flag in kinds[kind]]
        growing += [False] * (len(carry) - len(growing) + len(metric_state))
        return carry + metric_state, part.y_pred, growing

    def rest(self, micro_batch, carry):
        part = _micro_batch(
            self.model, micro_batch, self.variables, self.compute, weighted=True
        )
        n_grads, n_outputs, n_extras, n_masks, n_metrics = self.sizes
        packed = _pack_gradients(part.gradients, self.layout, self.variables)
        summed = _add_packed(carry[:n_grads], packed, self.layout)
        scalars = [part.loss] + part.output_losses
        scalars += [part.extras[name] for name in self.extra_names]
        scalars += _mask_values(part.mask_share)
        position = n_grads
        for value in scalars:
            summed.append(carry[position] + value)
            position += 1
        if n_metrics:
            summed += list(
                self._metrics_update(carry[position:], micro_batch, part.y_pred)
            )
        return summed, part.y_pred

    def result(self, carry, y_pred, batch_size):
        n_grads, n_outputs, n_extras, n_masks, n_metrics = self.sizes
        position = n_grads
        loss = carry[position]
        outputs = carry[position + 1 : position + 1 + n_outputs]
        position += 1 + n_outputs
        extras = dict(zip(self.extra_names, carry[position : position + n_extras]))
        position += n_extras
        gradients = _unpack_gradients(carry[:n_grads], self.layout, self.variables)
        if n_masks:
            # From the samples' share to the unmasked elements' share.
            valid, total = carry[position : position + 2]
            correction = tf.math.divide_no_nan(total, valid)
            loss = loss * tf.cast(correction, loss.dtype)
            outputs = [v * tf.cast(correction, v.dtype) for v in outputs]
            gradients = [_scaled(g, correction) for g in gradients]
        position += n_masks
        metric_state = carry[position:] if n_metrics else None
        return AccumulatedGradients(
            gradients=gradients,
            y_pred=y_pred,
            loss=compat.unscale_loss_for_distribution(loss) if self.unscale else loss,
            batch_size=batch_size,
            extras=extras,
            output_losses=list(outputs),
            metric_state=metric_state,
        )


def _mask_values(mask_share):
    if mask_share is None:
        return []
    return [tf.convert_to_tensor(value) for value in mask_share]


def _scaled(gradient, factor):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def build_metrics(model, y, y_pred):
    """Creates the compiled metrics' variables, as their first update would."""
    metrics = compat.compiled_metrics(model)
    if metrics is not None and not metrics.built:
        metrics.build(y, y_pred)


def run_micro_batches(data, micro_batches, first, rest, collect_outputs=True, xla=False):
    """Runs the micro-batches of a batch one after the other.

    `first(micro_batch) -> (carry, y_pred, growing)` runs micro-batch 0
    (one of the larger ones, never empty) and fixes the structure of
    `carry`, a flat list of tensors; `growing` flags the tensors whose first
    dimension may change from one micro-batch to the next (rows of sparse
    gradients). `rest(micro_batch, carry) -> (carry, y_pred)` runs each
    further micro-batch.

    Micro-batches 1 .. count-1 run in at most two `tf.while_loop`s, one per
    micro-batch size (`quotient + 1`, then `quotient`): the trace time does
    not grow with `micro_batches`, and every slice has a size that is
    constant within its loop, which XLA needs. The loops run one iteration
    at a time (`parallel_iterations=1`) and each micro-batch is sliced under
    control dependencies on the previous carry, so two micro-batches'
    activations are never alive together. No empty micro-batch runs (its
    forward pass would give NaN and write NaN BatchNormalization
    statistics), except for an empty batch, as Keras' own step does.

    With `collect_outputs`, the micro-batches' outputs are kept and
    concatenated (the whole batch's `y_pred`); without, they are dropped
    as soon as each micro-batch is done.

    With `xla` (the step is compiled by XLA), each loop's bound is hidden
    from the compiler: XLA replaces a loop it can count to one iteration
    by its body and then schedules that micro-batch beside micro-batch 0,
    both alive together. Every count of 2, and any count whose split
    leaves a loop of one micro-batch (3 of 128 is 43, 43 and 42: two such
    loops), then needed what the whole batch, or two micro-batches, need.
    Hidden, the loop stays a loop.

    Returns:
        `(carry, y_pred, batch_size)`: the last carry, the outputs of the
        whole batch (or `None`), and the batch size as a scalar `int32`
        tensor.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    xys = (x, y, sample_weight)
    batch_size = leading_size(x)
    count, quotient, remainder = plan_split(batch_size, micro_batches)
    larger = quotient + 1
    if isinstance(remainder, int):
        first_size = larger if remainder > 0 else quotient
    else:
        first_size = quotient + tf.cast(remainder > 0, tf.int32)
    carry, y_pred, growing = first(
        make_micro_batch(*xys, 0, first_size, batch_size)
    )
    outputs = [y_pred]
    # Per output: whether it has a row per sample (not a scalar statistic).
    has_rows = None if y_pred is None else [
        _has_rows(leaf, first_size) for leaf in keras.tree.flatten(y_pred)
    ]
    if micro_batches > 1:
        # Micro-batches [1, remainder) have `quotient + 1` samples, the
        # rest up to `count` have `quotient`.
        segments = [
            (1, maximum(remainder, 1), larger),
            (maximum(remainder, 1), count, quotient),
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
                y_pred if collect_outputs else None,
                has_rows,
                xla,
            )
            outputs.append(part)
    batch_size = tf.shape(first_tensor(x), out_type=tf.int32)[0]
    y_pred = _concat_rows(outputs, has_rows) if collect_outputs else None
    return list(carry), y_pred, batch_size


def _run_segment(xys, batch_size, split, segment, rest, carry, growing, y0, has_rows, xla):
    """Runs micro-batches `begin .. end-1`, all of `size` samples, in a loop.

    With outputs to keep (`y0` not `None`), they are written into a
    preallocated buffer with a scatter (XLA rejected a `TensorArray` here).
    """
    quotient, remainder = split
    begin, end, size = segment
    # Outputs with no row per sample (a scalar statistic) are not gathered.
    y_leaves = [] if y0 is None else [
        leaf for leaf, rows in zip(keras.tree.flatten(y0), has_rows) if rows
    ]
    rows = (end - begin) * size
    # At least one micro-batch of room: XLA compiles the loop body even
    # when the loop runs zero times, and rejects a scatter into nothing.
    # Every row below `rows` is written by the loop, so the buffer starts
    # as copies of the first micro-batch's first row: a value computed at
    # run time. A `tf.zeros` of a static shape is folded into a constant
    # when the function is instantiated, allocated then outside the step
    # (under memory pressure TensorFlow's constant folding crashes, or the
    # constant fails to load) and kept for the function's life.
    buffers = [
        tf.broadcast_to(
            leaf[:1],
            tf.concat([[maximum(rows, size)], tf.shape(leaf)[1:]], 0),
        )
        for leaf in y_leaves
    ]

    def body(i, carry, buffers):
        with tf.control_dependencies(carry):
            start = i * quotient + tf.minimum(i, remainder)
            micro_batch = make_micro_batch(*xys, start, size, batch_size)
            carry, part = rest(micro_batch, list(carry))
        if buffers:
            offset = (i - begin) * size
            # `offset + range(size)`: XLA needs the range's size constant.
            positions = tf.expand_dims(offset + tf.range(size), 1)
            leaves = [
                leaf for leaf, rows in zip(keras.tree.flatten(part), has_rows) if rows
            ]
            buffers = [
                tf.tensor_scatter_nd_update(buffer, positions, leaf)
                for buffer, leaf in zip(buffers, leaves)
            ]
        return i + 1, carry, buffers

    invariants = [
        tf.TensorShape([None]).concatenate(t.shape[1:]) if grows else t.shape
        for t, grows in zip(carry, growing)
    ]
    # Under XLA a loop of one known iteration would be inlined, and its
    # micro-batch run beside micro-batch 0 (see `run_micro_batches`).
    bound = compat.hidden_from_xla(end) if xla else end
    _, carry, buffers = tf.while_loop(
        lambda i, carry, buffers: i < bound,
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
    if y0 is None:
        return carry, None
    buffers = iter(buffer[:rows] for buffer in buffers)
    return carry, keras.tree.pack_sequence_as(
        y0,
        [
            next(buffers) if rows else leaf
            for leaf, rows in zip(keras.tree.flatten(y0), has_rows)
        ],
    )


def _has_rows(output, size):
    """Whether an output of a micro-batch of `size` samples has a row per sample.

    Not a scalar, nor a statistic of a fixed length (a layer's vector
    returned beside the batch's outputs): its first dimension is unknown
    or, where the micro-batch's size is known, that size.
    """
    if output.shape.rank == 0:
        return False
    first = output.shape[0]
    return first is None or (isinstance(size, int) and first == size)


def _concat_rows(parts, has_rows):
    """The batch's outputs: the rows of each in order; one without, the first's."""
    if len(parts) == 1:
        return parts[0]
    leaves = [keras.tree.flatten(part) for part in parts]
    joined = [
        tf.concat(items, axis=0) if rows else items[0]
        for items, rows in zip(zip(*leaves), has_rows)
    ]
    return keras.tree.pack_sequence_as(parts[0], joined)


def _gradient_layout(gradients, keep_sparse, as_given=False):
    """Records, per variable, whether its gradient is None, dense or sparse.

    Sparse gradients (embeddings) are summed as IndexedSlices with each row
    once; with `keep_sparse=False` (XLA, whose loops need fixed shapes)
    they are summed dense. With `as_given` (a step of one micro-batch,
    which sums nothing, on XLA too) they keep Keras' rows, one per lookup
    (`"rows"`): the optimizer then gets what plain `fit` gives it.
    """
    layout = []
    for gradient in gradients:
        if gradient is None:
            layout.append(None)
        elif as_given and isinstance(gradient, tf.IndexedSlices):
            layout.append("rows")
        elif keep_sparse and isinstance(gradient, tf.IndexedSlices):
            layout.append("sparse")
        else:
            layout.append("dense")
    return layout


def _unique_rows(values, indices):
    """Adds up the rows of a sparse gradient that share an index."""
    unique, positions = tf.unique(indices)
    summed = tf.math.unsorted_segment_sum(
        values, positions, tf.shape(unique)[0]
    )
    return summed, unique


def _pack_gradients(gradients, layout, variables):
    """Flattens gradients to tensors following `layout`.

    A `tf.while_loop` carry needs one fixed structure: `None` gradients are
    dropped, IndexedSlices become `(values, int64 indices)` with each index
    once, a gradient missing in this micro-batch only becomes zeros.
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
        elif kind == "rows":
            flat.append(gradient.values)
            flat.append(tf.cast(gradient.indices, tf.int64))
        elif isinstance(gradient, tf.IndexedSlices):
            flat.extend(
                _unique_rows(gradient.values, tf.cast(gradient.indices, tf.int64))
            )
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
            # Stay sparse, each row once, as the dense gradient would have it.
            values = tf.concat([total[position], part[position]], 0)
            indices = tf.concat([total[position + 1], part[position + 1]], 0)
            summed.extend(_unique_rows(values, indices))
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
