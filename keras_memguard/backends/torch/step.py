"""The micro-batched train step for Keras' PyTorch trainer.

`micro_batch_train_step(model, data, micro_batches)` has the signature and
the result of `TorchTrainer.train_step(data)`: it trains the model on the
batch and returns the logs. With `micro_batches=1` it is that method
(Keras' own, also when called from a `train_step` override). With
more, the batch is cut as `micro_batch_segments` says and each micro-batch
runs forward (`training=True`), computes its loss as `train_step` does
(the compiled loss plus `model.losses`), scales it by its share of the
batch and calls `backward()`: torch adds every micro-batch's gradients into
the variables' `.grad`, so nothing else holds them. Only after the last
micro-batch does the optimizer apply them, once, under `torch.no_grad()`.
One micro-batch's activations are alive at a time; the whole batch's
outputs are kept only when a metric reads them (`metrics_update_per_micro_batch`
is false), detached.

The share is the micro-batch's share of the samples, `n_i / n`: a loss that
is a mean over the batch (Keras' default `"sum_over_batch_size"`, with or
without sample weights) then sums to the whole batch's. A single loss that
averages over a mask (a Keras mask, `ignore_class`) divides by its count of
unmasked elements instead: each micro-batch is weighted by its share of
those, and the gradients are corrected once at the end, as the TensorFlow
engine does. Exact, to float tolerance: the weights, the loss and the
metrics of `fit` equal plain `fit`'s for such losses, multi-output models
(unmasked losses) and embeddings. Not equal: `BatchNormalization` (each
micro-batch is normalized by its own moments, and the moving statistics
are updated once per micro-batch), several loss terms of which some are
masked (combined by their share of the samples, with a warning), and
losses added in `call` that sum over the batch's samples rather than
average.

In `"shrink"` mode each micro-batch is its own optimizer update, from its
own mean loss: `micro_batches` smaller updates per batch.
"""

import warnings

import keras
import torch

from keras_memguard.backends import compat
from keras_memguard.backends.shared import metrics_read_whole_batch_outputs
from keras_memguard.backends.shared import metrics_update_per_micro_batch
from keras_memguard.backends.shared import micro_batch_segments
from keras_memguard.backends.shared import warn_masked_loss_terms_once
from keras_memguard.decider import validate_micro_batches

MODES = ("accumulate", "shrink")


def validate_mode(mode):
    """Checks a micro-batch mode and returns it.

    Args:
        mode: `"accumulate"` or `"shrink"`.

    Returns:
        `mode`.

    Raises:
        ValueError: If `mode` is not one of the two.

    Example:

    >>> validate_mode("shrink")
    'shrink'
    """
    if mode not in MODES:
        raise ValueError(
            "`micro_batch_mode` must be one of 'accumulate', 'shrink'. "
            f"Received: micro_batch_mode={mode!r}"
        )
    return mode


def micro_batch_rows(batch_size, micro_batches):
    """The `(start, stop)` rows of each micro-batch, in order.

    Args:
        batch_size: Samples in the batch, an `int` >= 1.
        micro_batches: The number of micro-batches, an `int` >= 1.

    Returns:
        A list of `(start, stop)` pairs covering `range(batch_size)`.

    Example:

    >>> micro_batch_rows(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    rows = []
    for start, count, size in micro_batch_segments(batch_size, micro_batches):
        for i in range(count):
            rows.append((start + i * size, start + (i + 1) * size))
    return rows


def batch_size_of(data):
    """The number of samples in a batch: the first dimension of its inputs.

    Args:
        data: A batch as Keras' data adapters yield it (`(x, y,
            sample_weight)`, `(x, y)` or `(x,)`).

    Returns:
        An `int`.

    Raises:
        ValueError: If the batch holds no input array with a first dimension.
    """
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    for leaf in keras.tree.flatten(x):
        shape = getattr(leaf, "shape", ())
        if leaf is not None and len(shape):
            return int(shape[0])
    raise ValueError(
        "The batch has no input array with a batch dimension. "
        f"Received: data of type {type(data).__name__}"
    )


def rows(structure, start, stop):
    """Rows `start:stop` of every array in a nested structure (`None` kept)."""
    if structure is None:
        return None
    return keras.tree.map_structure(
        lambda a: None if a is None else a[start:stop], structure
    )


def _detached(structure):
    """Tensors without their graph, each with its Keras mask (detached too)."""

    def detach(tensor):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        mask = compat.keras_mask(tensor)
        detached = tensor.detach()
        return detached if mask is None else compat.set_keras_mask(detached, mask.detach())

    return keras.tree.map_structure(detach, structure)


def concatenated(parts, rows=None):
    """The parts' rows in one structure, with their Keras masks concatenated.

    Args:
        parts: The parts' outputs, in order.
        rows: The samples of each part, or `None`. Given, an output whose
            first dimension is not its part's samples (a statistic a layer
            returns beside the batch's outputs: a scalar, a vector per
            layer) has no rows to join: it is the first part's.
    """
    if len(parts) == 1:
        return parts[0]

    def concatenate(*tensors):
        if rows is not None and any(
            t.dim() == 0 or t.shape[0] != n for t, n in zip(tensors, rows)
        ):
            return tensors[0]
        whole = torch.cat(tensors, dim=0)
        masks = [compat.keras_mask(t) for t in tensors]
        if all(mask is not None for mask in masks):
            compat.set_keras_mask(whole, torch.cat(masks, dim=0))
        return whole

    return keras.tree.map_structure(concatenate, *parts)


def forward(model, x):
    """`model(x, training=True)`, as Keras' torch `train_step` calls it."""
    if compat.call_has_training_arg(model):
        return model(x, training=True)
    return model(x)


class StepProgress:
    """How far a micro-batched step got; read by the replaying function.

    Attributes:
        applying: `True` once the optimizer update has started (in
            `"shrink"` mode: the current micro-batch's). An error from
            there on may have changed some variables: not replayable.
        rows_done: Rows whose update is applied (`"shrink"` mode only: a
            replay goes on from there).
        outputs: The applied micro-batches' detached outputs, when the
            metrics read the whole batch's (`"shrink"` mode).
        output_rows: The samples of each of `outputs`.
        on_applied: Called with no argument after each applied micro-batch
            in `"shrink"` mode (the replaying function keeps that point to
            roll back to), or `None`.
    """

    def __init__(self, on_applied=None):
        self.applying = False
        self.rows_done = 0
        self.outputs = []
        self.output_rows = []
        self.on_applied = on_applied


def _exact_mask(model, masks, micro_batches):
    """The one `(valid, total)` the model's loss averaged over, or `None`.

    Exact combination needs every term of the loss to average over the same
    elements: one masked loss on a model with one compiled loss. Several
    terms with a mask are combined by their share of the samples, with a
    warning once.
    """
    if len(masks) == 1 and compat.loss_term_count(model) <= 1:
        # Plain numbers: read without a gradient, the step weights by them.
        return tuple(float(keras.ops.convert_to_numpy(value)) for value in masks[0])
    if masks:
        warn_masked_loss_terms_once(
            model, max(len(masks), compat.loss_term_count(model)), micro_batches,
            stacklevel=3,
        )
    return None


def _micro_batch_loss(model, x, y, sample_weight, micro_batches):
    """Forward pass and loss of one micro-batch: `(loss, y_pred, mask)`."""
    y_pred = forward(model, x)
    with compat.recording_loss_masks() as masks:
        loss = compat.compute_loss(model, x, y, y_pred, sample_weight)
    return loss, y_pred, _exact_mask(model, masks, micro_batches)


def _backward(model, loss):
    target = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
    if model.trainable_weights and target.requires_grad:
        target.backward()


def _apply(model, progress):
    """One optimizer update from the variables' `.grad`, as `train_step`."""
    trainable = model.trainable_weights[:]
    if not trainable:
        warnings.warn("The model does not have any trainable weights.")
        return
    gradients = [v.value.grad for v in trainable]
    progress.applying = True
    with torch.no_grad():
        model.optimizer.apply(gradients, trainable)
    progress.applying = False


def _update_metrics(model, y, y_pred, sample_weight):
    with torch.no_grad():
        compat.compiled_metrics(model).update_state(y, y_pred, sample_weight)


def _accumulate(model, data, micro_batches, progress):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch_size = batch_size_of(data)
    per_micro_batch = metrics_update_per_micro_batch(model)
    keep_outputs = metrics_read_whole_batch_outputs(model)
    outputs, output_rows = [], []
    loss_sum = None
    valid_sum = total_sum = 0.0
    masked = False
    model.zero_grad()
    for start, stop in micro_batch_rows(batch_size, micro_batches):
        part_x, part_y = rows(x, start, stop), rows(y, start, stop)
        part_weight = rows(sample_weight, start, stop)
        share = (stop - start) / batch_size
        # Weighted by its share below, a summed loss must come out as its sum.
        with compat.scaling_summed_losses(1.0 / share):
            loss, y_pred, mask = _micro_batch_loss(
                model, part_x, part_y, part_weight, micro_batches
            )
        if mask is not None:
            # Weighted by the unmasked elements' share, up to a factor the
            # whole batch's counts give once every micro-batch is done.
            valid, total = mask
            share *= valid / total if total else 0.0
            valid_sum += valid
            total_sum += total
            masked = True
        weighted = loss * share
        _backward(model, weighted)
        value = weighted.detach()
        loss_sum = value if loss_sum is None else loss_sum + value
        if per_micro_batch:
            _update_metrics(model, part_y, _detached(y_pred), part_weight)
        if keep_outputs:
            outputs.append(_detached(y_pred))
            output_rows.append(stop - start)
        # One micro-batch's graph and activations alive at a time.
        del loss, y_pred, weighted
    if masked:
        correction = total_sum / valid_sum if valid_sum else 0.0
        loss_sum = loss_sum * correction
        with torch.no_grad():
            for variable in model.trainable_weights:
                grad = variable.value.grad
                if grad is not None:
                    grad.mul_(correction)
    tracker = compat.loss_tracker(model)
    if tracker is not None:
        tracker.update_state(loss_sum, sample_weight=batch_size)
    _apply(model, progress)
    if keep_outputs:
        return model.compute_metrics(
            x, y, concatenated(outputs, output_rows), sample_weight=sample_weight
        )
    return model.get_metrics_result()


def _shrink(model, data, micro_batches, progress):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    batch_size = batch_size_of(data)
    per_micro_batch = metrics_update_per_micro_batch(model)
    keep_outputs = metrics_read_whole_batch_outputs(model)
    tracker = compat.loss_tracker(model)
    first = progress.rows_done
    for start, stop in micro_batch_rows(batch_size - first, micro_batches):
        start, stop = start + first, stop + first
        part_x, part_y = rows(x, start, stop), rows(y, start, stop)
        part_weight = rows(sample_weight, start, stop)
        model.zero_grad()
        loss, y_pred, _ = _micro_batch_loss(
            model, part_x, part_y, part_weight, micro_batches
        )
        _backward(model, loss)
        _apply(model, progress)
        # The tracker's mean over micro-batches weighted by their samples
        # is the batch's mean of the micro-batches' mean losses.
        if tracker is not None:
            tracker.update_state(loss.detach(), sample_weight=stop - start)
        if per_micro_batch:
            _update_metrics(model, part_y, _detached(y_pred), part_weight)
        if keep_outputs:
            progress.outputs.append(_detached(y_pred))
            progress.output_rows.append(stop - start)
        del loss, y_pred
        progress.rows_done = stop
        if progress.on_applied is not None:
            progress.on_applied()
    if keep_outputs:
        return model.compute_metrics(
            x, y, concatenated(progress.outputs, progress.output_rows),
            sample_weight=sample_weight,
        )
    return model.get_metrics_result()


def micro_batch_train_step(model, data, micro_batches, mode="accumulate", progress=None):
    """One training step of `model` on `data` in `micro_batches` parts.

    With `micro_batches=1` it is Keras' own `train_step`. Use it as the
    body of a model's `train_step`, or through `ReplayingTrainFunction`
    (which also replays a batch that runs out of memory).

    In `"accumulate"` mode (the default) it makes the whole batch's update:
    every micro-batch's gradients, weighted by its share, summed in the
    variables' `.grad`, then one `optimizer.apply`; the loss tracker and
    the compiled metrics end as `train_step` leaves them. Nothing but the
    forward passes (BatchNormalization moving statistics, seed generators),
    the per-output loss trackers and the micro-batch by micro-batch metric
    updates changes state before the optimizer update, which comes last.

    In `"shrink"` mode each micro-batch is its own step: its own mean
    loss, its own `optimizer.apply`. The learning rate is not scaled.

    Args:
        model: A compiled Keras model on the PyTorch backend.
        data: The batch, as `train_step` receives it.
        micro_batches: The number of micro-batches, an `int` >= 1. A batch
            with fewer samples runs one micro-batch per sample.
        mode: `"accumulate"` or `"shrink"`. Defaults to `"accumulate"`.
        progress: A `StepProgress` the step reports to (the replaying
            function passes one; with `micro_batches=1` Keras' own step
            runs and reports nothing). Defaults to `None`.

    Returns:
        The logs `dict` `train_step` returns.

    Raises:
        ValueError: If `micro_batches` or `mode` is invalid.

    Example:

    ```python
    class MyModel(keras.Model):
        def train_step(self, data):
            return micro_batch_train_step(self, data, 4)
    ```
    """
    micro_batches = validate_micro_batches(micro_batches)
    mode = validate_mode(mode)
    if micro_batches == 1 and progress is None:
        # Keras' own step, also when this is the body of an override.
        return compat.torch_trainer_class().train_step(model, data)
    return run_step(model, data, micro_batches, mode, progress or StepProgress())


def run_step(model, data, micro_batches, mode, progress):
    """The micro-batched step at any count (`1` included), reporting `progress`.

    `micro_batch_train_step` without its `micro_batches=1` shortcut: the
    replaying function runs every count here, so that it can tell an error
    in the optimizer update (not replayable) from one in a micro-batch. At
    one micro-batch it computes what `train_step` computes.

    Args:
        model: A compiled Keras model on the PyTorch backend.
        data: The batch.
        micro_batches: The number of micro-batches, an `int` >= 1.
        mode: `"accumulate"` or `"shrink"`.
        progress: A `StepProgress`.

    Returns:
        The logs `dict`.
    """
    if mode == "shrink":
        return _shrink(model, data, micro_batches, progress)
    return _accumulate(model, data, micro_batches, progress)
