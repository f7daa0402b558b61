"""Whether a model's own loss is the mean of its micro-batches' losses.

Micro-batching is exact when the loss of a batch is the sample-weighted
mean of its parts' losses: every built-in Keras loss is, and the guard
combines masked ones by their unmasked share. A `compute_loss` of the
model's own need not be: a contrastive loss with in-batch negatives
(SimCLR, CLIP), or one that normalizes by statistics of the whole batch,
sees fewer samples per micro-batch and trains another objective, with no
error to show it. Before the first split of such a model, `check_once`
computes its loss on two micro-batches' worth of samples, whole and in
halves (inference mode, so no dropout, from one forward pass), and warns
once, with both figures, where they differ.
"""

import math

import keras

from keras_memguard.backends import compat
from keras_memguard.probes.base import warn_at_user_code

# The relative difference past which the halves' mean is not the loss of
# the whole: float32 sums of a few thousand terms stay far below it.
RELATIVE_TOLERANCE = 1e-3

_CHECKED_ATTR = "_memguard_split_loss_checked"


def overrides_compute_loss(model):
    """Whether `model`'s class computes its loss in a `compute_loss` of its own."""
    return type(model).compute_loss is not keras.Model.compute_loss


def halves_and_whole(model, data, size):
    """`(whole, halves)`: the loss of the first `size` samples, and its halves' mean.

    Both from one forward pass in inference mode. The model's metric
    variables and random seed states are put back afterwards, so the check
    leaves training as it found it.

    Args:
        model: A compiled Keras model, its variables readable.
        data: A batch, `(x, y, sample_weight)` as the train step gets it.
        size: An even number of samples, at most the batch's.

    Returns:
        Two floats.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def rows(value, start, stop):
        return keras.tree.map_structure(
            lambda t: None if t is None else t[start:stop], value
        )

    kept = [
        (variable, keras.ops.convert_to_numpy(variable))
        for variable in list(model.metrics_variables)
        + [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    ]
    try:
        first = rows(x, 0, size)
        y_pred = model(first, training=False)
        losses = []
        for start, stop in ((0, size), (0, size // 2), (size // 2, size)):
            loss = compat.compute_loss(
                model,
                rows(x, start, stop),
                rows(y, start, stop),
                rows(y_pred, start, stop),
                rows(sample_weight, start, stop),
            )
            losses.append(float(keras.ops.convert_to_numpy(loss)))
    finally:
        for variable, value in kept:
            variable.assign(value)
    whole, left, right = losses
    return whole, (left + right) / 2.0


def check_once(model, data, batch_size, micro_batches, values=None):
    """Warns once per model when its own loss is not its parts' mean.

    Only for a model with a `compute_loss` of its own, at its first batch
    split in two or more. Nothing is raised: a check that cannot run here
    (a forward pass that does not fit, inputs that cannot be sliced)
    leaves training to go on, unchecked.

    Args:
        model: A compiled Keras model.
        data: The batch about to run.
        batch_size: Its samples.
        micro_batches: The count it runs at.
        values: Where the model's variables hold no values during `fit`
            (Keras' JAX trainer keeps them in its own state): pairs of a
            variable and its value, read in a `keras.StatelessScope`,
            where nothing assigned reaches the variables. Defaults to
            `None`: the variables' own values.
    """
    if micro_batches < 2 or batch_size < 2 or getattr(model, _CHECKED_ATTR, False):
        return
    # object.__setattr__: a plain flag, not tracked state.
    object.__setattr__(model, _CHECKED_ATTR, True)
    if not overrides_compute_loss(model):
        return
    size = min(batch_size, 2 * math.ceil(batch_size / micro_batches))
    size -= size % 2
    try:
        if values is None:
            whole, halves = halves_and_whole(model, data, size)
        else:
            with keras.StatelessScope(state_mapping=values):
                whole, halves = halves_and_whole(model, data, size)
    except Exception:  # noqa: BLE001 - a check, never a reason to stop training.
        return
    if not (math.isfinite(whole) and math.isfinite(halves)):
        return
    if abs(whole - halves) <= RELATIVE_TOLERANCE * max(abs(whole), abs(halves), 1e-12):
        return
    warn_at_user_code(
        f"Model {model.name!r} computes its loss in a `compute_loss` of its "
        f"own, and it is not the mean of its parts' losses: {size} samples "
        f"give {whole:.6g} whole and {halves:.6g} as the mean of their halves. "
        f"At micro_batches={micro_batches} each micro-batch's loss sees only "
        "its own samples (in-batch negatives, batch statistics), so the "
        "model trains another objective than plain `fit` does. HINT: a loss "
        "that is a mean over samples splits exactly; otherwise train with a "
        "batch that fits whole (`find_batch_size`), with "
        "`MemoryGuard(max_micro_batches=1)` to keep the guard watching."
    )
