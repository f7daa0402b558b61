"""Whether a model's loss is what its micro-batches' losses add up to.

Micro-batching is exact when the guard's combination of the parts' losses
is the loss of the whole: a mean over samples weighted by each part's
share of them, a sum counted whole, a masked mean by each part's share of
the unmasked elements. Keras' built-in per-sample losses are. A loss
computed over the whole batch at once is not: `keras.losses.Dice` and
`Tversky` without an `axis` (one ratio over every pixel of the batch), a
contrastive loss with in-batch negatives in a `compute_loss` of the
model's own, a loss normalized by statistics of the batch. Split, it sees
fewer samples per micro-batch and trains another objective, with no error
to show it. Before the first split, `check_once` computes the loss of one
micro-batch's worth of samples whole and from two parts, its first
sample and the rest, combined as the guard combines micro-batches
(inference mode, one forward pass of the samples), and warns once, with
both figures, where they differ. Parts that unequal make a loss over the whole batch
show itself: on samples alike, halves can agree with the whole to 1e-5.

The same forward passes tell what each loss a layer adds (`add_loss`, an
activity regularizer) is: a mean over the batch (exact when weighted by
the share of the samples), or a sum over its samples, as in Keras'
`add_loss(ops.sum(x))` example and Keras 3.8's activity regularizers. A
sum is marked (`compat.mark_summed_added_losses`) and counted whole in
each micro-batch from then on, as a summed compiled loss is.
"""

import gc
import math

import keras

from keras_memguard.backends import compat
from keras_memguard.probes.base import warn_at_user_code

# The relative difference past which the parts' combination is not the
# loss of the whole: float32 sums of a few thousand terms stay far below it.
RELATIVE_TOLERANCE = 1e-3

_CHECKED_ATTR = "_memguard_split_loss_checked"


def _number(value):
    return float(keras.ops.convert_to_numpy(value))


def _added_values(model):
    """Each of `model.losses` as one number, summed as Keras sums it.

    Keras adds an added loss of several values (an `add_loss` of one loss
    per sample, keras.io's CTC layer) as their sum.
    """
    return [_number(keras.ops.sum(value)) for value in model.losses]


def parts_and_whole(model, data, size, exact_masks=True):
    """`(whole, parts)`: the loss of the first `size` samples, and its parts' combination.

    The parts are the first sample and the other `size - 1`. Both from one
    forward pass in inference mode (and, where layers add losses from
    their inputs, one pass of each part, which also marks the added losses
    that sum over samples); the parts combined as the guard combines
    micro-batches (by their share of the samples, a summed loss counted
    whole, one masked loss by the unmasked elements' share). The model's
    metric variables and random seed states are put back afterwards, so
    the check leaves training as it found it.

    Args:
        model: A compiled Keras model, its variables readable.
        data: A batch, `(x, y, sample_weight)` as the train step gets it.
        size: Samples, at least 2 and at most the batch's.
        exact_masks: Whether the backend combines one masked loss by the
            unmasked elements' share (TensorFlow, PyTorch). Defaults to
            `True`.

    Returns:
        Two floats, or `None` where the combination is not exact by design
        (several loss terms that average over a mask, or a masked loss
        where `exact_masks` is `False`): said elsewhere.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def rows(value, start, stop):
        return keras.tree.map_structure(
            lambda t: None if t is None else t[start:stop], value
        )

    def predicted_rows(value, start, stop):
        # A part's outputs keep their Keras mask (`mask_zero`, `Masking`),
        # as a micro-batch's own forward pass gives it: a slice has none,
        # and the part's loss would average over the padding too.
        def cut(t):
            if t is None:
                return None
            mask = compat.keras_mask(t)
            part = t[start:stop]
            return part if mask is None else compat.set_keras_mask(part, mask[start:stop])

        return keras.tree.map_structure(cut, value)

    kept = [
        (variable, variable.numpy())
        for variable in list(model.metrics_variables)
        + [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    ]
    try:
        y_pred = model(rows(x, 0, size), training=False)
        added_whole = _added_values(model)
        # Losses the layers add from their inputs need each part's own
        # forward pass; weight regularization alone does not.
        regularized = sum(
            getattr(v, "regularizer", None) is not None for v in model.trainable_weights
        )
        own_passes = len(added_whole) > regularized

        def loss(start, stop, predicted):
            # A copy of the weights: Keras' loss multiplies them by a mask in
            # place on PyTorch, which would change the batch about to train.
            weights = keras.tree.map_structure(
                lambda w: None if w is None else keras.ops.copy(w),
                rows(sample_weight, start, stop),
            )
            return compat.compute_loss(
                model, rows(x, start, stop), rows(y, start, stop), predicted, weights
            )

        whole = _number(loss(0, size, y_pred))
        parts = []
        for start, stop in ((0, 1), (1, size)):
            share = (stop - start) / size
            if own_passes:
                predicted = model(rows(x, start, stop), training=False)
                added = _added_values(model)
            else:
                predicted, added = predicted_rows(y_pred, start, stop), None
            with compat.scaling_summed_losses(1.0 / share), compat.recording_loss_masks() as masks:
                value = _number(loss(start, stop, predicted))
            parts.append((share, value, [tuple(_number(v) for v in pair) for pair in masks], added))
    finally:
        for variable, value in kept:
            variable.assign(value)
    if own_passes:
        summed = _summed_added_losses(added_whole, [(share, added) for share, _, _, added in parts])
        compat.mark_summed_added_losses(model, summed)
        # Counted whole from now on: the parts' values as the guard's
        # micro-batches will give them.
        parts = [
            (
                share,
                value + sum((1.0 / share - 1.0) * a for a, s in zip(added, summed) if s),
                masks,
                added,
            )
            for share, value, masks, added in parts
        ]
    parts = [(share, value, masks) for share, value, masks, _ in parts]
    if not any(masks for _, _, masks in parts):
        return whole, sum(share * value for share, value, _ in parts)
    if (
        not exact_masks
        or any(len(masks) != 1 for _, _, masks in parts)
        or compat.loss_term_count(model) > 1
    ):
        return None
    valid = sum(masks[0][0] for _, _, masks in parts)
    total = sum(masks[0][1] for _, _, masks in parts)
    if not valid or not total:
        return None
    combined = sum(
        share * value * masks[0][0] / masks[0][1] for share, value, masks in parts if masks[0][1]
    )
    return whole, combined * total / valid


def _close(a, b):
    return abs(a - b) <= RELATIVE_TOLERANCE * max(abs(a), abs(b), 1e-12)


def _summed_added_losses(whole, parts):
    """Per added loss, whether it is a sum over samples (not a mean).

    `whole`: each added loss's value on the whole; `parts`: `(share,
    values)` per part. A mean over samples is the parts' share-weighted
    values; a sum is their plain sum. A loss that is neither (or both, as a
    weight's regularization is when zero), or lists that do not line up,
    is left as a mean: the check of the whole loss says what is wrong.
    """
    if any(len(values) != len(whole) for _, values in parts):
        return [False] * len(whole)
    summed = []
    for index, value in enumerate(whole):
        mean = sum(share * values[index] for share, values in parts)
        total = sum(values[index] for _, values in parts)
        summed.append(
            math.isfinite(value) and not _close(value, mean) and _close(value, total)
        )
    return summed


def check_once(model, data, batch_size, micro_batches, values=None, exact_masks=True):
    """Warns once per model when its loss is not what its parts' losses add up to.

    At the model's first batch split in two or more. Nothing is raised: a
    check that cannot run here (a forward pass that does not fit, inputs
    that cannot be sliced) leaves training to go on, unchecked.

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
        exact_masks: As for `parts_and_whole`. Defaults to `True`.
    """
    if micro_batches < 2 or batch_size < 2 or getattr(model, _CHECKED_ATTR, False):
        return
    # object.__setattr__: a plain flag, not tracked state.
    object.__setattr__(model, _CHECKED_ATTR, True)
    # One micro-batch's samples: a forward pass of them, without gradients,
    # needs less than the step about to run at that count.
    size = min(batch_size, max(2, math.ceil(batch_size / micro_batches)))
    try:
        if values is None:
            found = parts_and_whole(model, data, size, exact_masks)
        else:
            with keras.StatelessScope(state_mapping=values, collect_losses=True):
                found = parts_and_whole(model, data, size, exact_masks)
    except Exception:  # noqa: BLE001 - a check, never a reason to stop training.
        return
    finally:
        # The eager forward pass leaves its tensors in reference cycles: held
        # until the next collection, they would sit beside the step about to
        # run (an XLA step planned without them runs out of memory).
        gc.collect()
    if found is None:
        return
    whole, combined = found
    if not (math.isfinite(whole) and math.isfinite(combined)):
        return
    if _close(whole, combined):
        return
    warn_at_user_code(
        f"The loss of model {model.name!r} is not what its micro-batches' "
        f"losses add up to: {size} samples give {whole:.6g} whole and "
        f"{combined:.6g} from their first sample and the rest, combined as "
        f"micro-batches are. At micro_batches={micro_batches} "
        "each micro-batch's loss sees only its own samples, so the model "
        "trains another objective than plain `fit` does: a loss computed "
        "over the whole batch at once (`keras.losses.Dice` or `Tversky` "
        "without an `axis`, in-batch negatives, batch statistics). HINT: "
        "compute the loss per sample (Dice: `axis=` the non-batch axes), "
        "or train at a batch that fits whole (`find_batch_size`), with "
        "`MemoryGuard(max_micro_batches=1)` to keep the guard watching."
    )
