"""The micro-batched train step for Keras' JAX trainer.

`micro_batch_train_step(model, state, data, micro_batches)` has the
signature and the result of `JAXTrainer.train_step(state, data)`: it is pure,
takes the state tuple `(trainable, non_trainable, optimizer, metrics
variables)` and returns `(logs, state)`. It splits the batch into `k`
micro-batches of `n // k` samples and, when `n % k` samples are left over, a
last smaller one (`micro_batch_segments`), runs the forward and backward
pass of each in a `jax.lax.scan` (a loop, so XLA keeps one micro-batch's
activations alive at a time), sums the gradients weighted by each
micro-batch's share of the samples, and applies them once. The loss tracker
and the compiled metrics are updated once, on the whole batch's predictions
and its sample-weighted mean loss, as `train_step` updates them.

For a loss that is a mean over the batch's samples (Keras' default
`"sum_over_batch_size"` reduction, with or without sample weights) the
update equals the whole batch's to float tolerance; so it does for a loss
reduced by `"sum"`, whose micro-batch sums are scaled to count whole
(`compat.scaling_summed_losses`), and for one loss that averages over a
mask (a Keras mask, `ignore_class`) or over its sample weights
(`"mean_with_sample_weight"`): each micro-batch divides by its own count
of unmasked elements (or its own sum of weights), so it is weighted by its
share of the samples times `valid / total` of its own elements, and the
sum is divided by the whole batch's `valid / total` once the loop is done
(`compat.recording_loss_masks`), as the TensorFlow step does. Not equal:
layers that use batch statistics (`BatchNormalization` normalizes each
micro-batch by its own moments and updates its moving statistics once per
micro-batch), and several loss terms of which some average over a mask
(weighted by the samples, with a warning).

A sparse input (`jax.experimental.sparse.BCOO`, what Keras makes of a
`scipy.sparse` matrix) reaches each micro-batch as its rows made dense: a
slice of a sparse array keeps every element the whole batch stores (its
size is static under `jit`), so the products of a micro-batch's slice
would be as large as the whole batch's, in each of the `k` micro-batches.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import sparse as jax_sparse

from keras_memguard.backends.shared import micro_batch_segments
from keras_memguard.backends.shared import warn_masked_loss_terms_once
from keras_memguard.decider import validate_micro_batches
from keras_memguard.backends import compat


def is_sparse(value):
    """Whether `value` is a JAX sparse array (a `BCOO`): one leaf, not its parts."""
    return isinstance(value, jax_sparse.JAXSparse)


def rows(tree, start, size):
    """Rows `start:start + size` of every array of `tree`, a sparse one's made dense.

    `start` may be traced (a loop's index); `size` is static.
    """

    def cut(a):
        if is_sparse(a):
            zeros = (0,) * (a.ndim - 1)
            return jax_sparse.bcoo_dynamic_slice(
                a, (start,) + zeros, (size,) + tuple(a.shape[1:])
            ).todense()
        return jax.lax.dynamic_slice_in_dim(a, start, size)

    return jax.tree_util.tree_map(cut, tree, is_leaf=is_sparse)


def batch_size_of(data):
    """The number of samples in a batch: the first dimension of its inputs.

    Args:
        data: A batch as Keras' data adapters yield it (`(x, y,
            sample_weight)`, `(x, y)` or `(x,)`), arrays or shape specs.

    Returns:
        An `int`.

    Raises:
        ValueError: If the batch holds no array with a first dimension.
    """
    x, _, _ = compat.unpack_data(data)
    for leaf in jax.tree_util.tree_leaves(x, is_leaf=is_sparse):
        shape = getattr(leaf, "shape", ())
        if shape:
            return int(shape[0])
    raise ValueError(
        "The batch has no input array with a batch dimension. "
        f"Received: data={jax.tree_util.tree_map(jnp.shape, data)!r}"
    )


def _stacked(tree, start, count, size):
    """Rows `start:start + count*size` of every array, as `(count, size, ...)`."""
    return jax.tree_util.tree_map(
        lambda a: a[start : start + count * size].reshape((count, size) + a.shape[1:]),
        tree,
    )


def _whole_batch_outputs(parts):
    """The batch's outputs from its micro-batches' outputs.

    Args:
        parts: `(y_pred, size, stacked)` per run of micro-batches: their
            outputs, the micro-batch's size, and whether `y_pred` stacks
            several micro-batches (a scan's, `(count, size, ...)`).

    Returns:
        The outputs' structure: an output with a row per sample is the
        micro-batches' rows in order; an output without (a scalar a layer
        returns beside the batch's outputs, an auxiliary statistic) is the
        first micro-batch's, as it has no rows to join and the losses were
        computed micro-batch by micro-batch.
    """

    def combine(*leaves):
        rows = []
        for leaf, (_, size, stacked) in zip(leaves, parts):
            shape = leaf.shape[1:] if stacked else leaf.shape
            if not shape or shape[0] != size:
                return leaves[0][0] if parts[0][2] else leaves[0]
            rows.append(leaf.reshape((-1,) + leaf.shape[2:]) if stacked else leaf)
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)

    return jax.tree_util.tree_map(combine, *(y_pred for y_pred, _, _ in parts))


def micro_batch_train_step(model, state, data, micro_batches):
    """One training step of `model` on `data` in `micro_batches` parts.

    Pure, as `JAXTrainer.train_step`: with `micro_batches=1` it is that
    method. Jit it with `micro_batches` static (`make_train_step`).

    Args:
        model: A compiled Keras model on the JAX backend whose class does not
            replace `train_step`.
        state: `(trainable, non_trainable, optimizer, metrics variables)`,
            each a list of arrays, as `fit` passes it.
        data: The batch, as Keras' data adapters yield it.
        micro_batches: The number of micro-batches, an `int` >= 1.

    Returns:
        `(logs, state)`: the metrics' results and the new state, as
        `train_step` returns them.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.
    """
    validate_micro_batches(micro_batches)
    if micro_batches == 1:
        return model.train_step(state, data)
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = compat.unpack_data(data)
    batch_size = batch_size_of(data)

    def run(carry, part, share):
        gradients, non_trainable, metrics_variables, loss, elements = carry
        part_x, part_y, part_weight = part
        # Weighted by its share below, a summed loss must come out as its sum.
        grad_fn = jax.value_and_grad(
            _weighted_loss(model, micro_batches, share), has_aux=True
        )
        with compat.scaling_summed_losses(1.0 / share):
            (_, (aux, mask, weight)), part_gradients = grad_fn(
                trainable,
                non_trainable,
                metrics_variables,
                part_x,
                part_y,
                part_weight,
                training=True,
                optimizer_variables=optimizer_variables,
            )
        unscaled_loss, y_pred, non_trainable, metrics_variables = aux
        gradients = jax.tree_util.tree_map(
            lambda total, g: total + g.astype(total.dtype), gradients, part_gradients
        )
        loss = loss + (unscaled_loss * weight).astype(loss.dtype)
        elements = elements + mask
        return (gradients, non_trainable, metrics_variables, loss, elements), y_pred

    carry = (
        jax.tree_util.tree_map(jnp.zeros_like, trainable),
        non_trainable,
        metrics_variables,
        jnp.zeros((), "float32"),
        jnp.zeros((2,), "float32"),
    )
    predictions = []
    batch = (x, y, sample_weight)
    sparse = any(is_sparse(leaf) for leaf in jax.tree_util.tree_leaves(batch, is_leaf=is_sparse))
    for start, count, size in micro_batch_segments(batch_size, micro_batches):
        body = functools.partial(run, share=size / batch_size)
        if sparse:
            # Each micro-batch's rows cut out inside the loop, by its index.
            def sliced(carry, index, start=start, size=size, body=body):
                return body(carry, rows(batch, start + index * size, size))

            carry, y_pred = jax.lax.scan(sliced, carry, jnp.arange(count))
            predictions.append((y_pred, size, True))
            continue
        parts = _stacked(batch, start, count, size)
        if count == 1:
            carry, y_pred = body(carry, jax.tree_util.tree_map(lambda a: a[0], parts))
            predictions.append((y_pred, size, False))
        else:
            carry, y_pred = jax.lax.scan(body, carry, parts)
            predictions.append((y_pred, size, True))
    gradients, non_trainable, metrics_variables, loss, elements = carry
    # From the samples' share to the unmasked elements' share (1 where the
    # loss averaged over the samples: each micro-batch counted (1, 1)).
    valid, total = elements[0], elements[1]
    correction = jnp.where(valid > 0, total / valid, 0.0)
    gradients = jax.tree_util.tree_map(
        lambda g: (g * correction).astype(g.dtype), gradients
    )
    loss = (loss * correction).astype(loss.dtype)
    y_pred = _whole_batch_outputs(predictions)

    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, gradients, trainable
    )
    logs, metrics_variables = compat.update_metrics_variables(
        model, metrics_variables, loss, x, y, y_pred, sample_weight
    )
    return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)


def _weighted_loss(model, micro_batches, share):
    """The model's loss function, weighted as one micro-batch of the whole.

    `(loss * weight, (aux, mask, weight))`: Keras' stateless loss (already
    multiplied by the optimizer's loss scale) times the micro-batch's
    weight, its share of the samples times its own `valid / total` where
    the loss averaged over a mask; Keras' aux; `mask = [valid, total]`
    where one loss term averaged over a mask's valid elements of its total
    (or over its sample weights' sum), else `[1, 1]` (a mean over the
    samples). Weighted before the backward pass, as the whole batch's
    mean is: the backward pass's values keep the whole batch's magnitude,
    so mixed precision overflows where plain `fit` does, not at a k-th of
    its loss scale. Several terms, some masked: `[1, 1]`, with a warning
    once: weighted by the samples, close to the whole batch's loss, not
    equal to it.
    """
    loss_function = compat.loss_and_updates_function(model)

    def weighted(loss, aux, mask):
        mask = jax.lax.stop_gradient(mask)
        weight = share * jnp.where(mask[1] > 0, mask[0] / mask[1], 0.0)
        return loss * weight.astype(loss.dtype), (aux, mask, weight)

    def loss_and_mask(*args, **kwargs):
        with compat.recording_loss_masks() as masks:
            loss, aux = loss_function(*args, **kwargs)
        if len(masks) == 1 and compat.loss_term_count(model) <= 1:
            mask = jnp.stack([jnp.asarray(v, "float32") for v in masks[0]])
            return weighted(loss, aux, mask)
        if masks:
            warn_masked_loss_terms_once(
                model, max(len(masks), compat.loss_term_count(model)), micro_batches,
                stacklevel=2,
            )
        return weighted(loss, aux, jnp.ones((2,), "float32"))

    return loss_and_mask


def make_train_step(model, micro_batches):
    """`micro_batch_train_step` for one count, jitted, without donation.

    Keras' own step donates the state (`donate_argnums=0`): its buffers are
    consumed by the call. This one does not, so a call that fails (out of
    memory) leaves the state as it was, to replay the batch with. The price
    is one more copy of the state alive during the step; the compiled
    step's `memory_analysis()` counts it.

    Args:
        model: A compiled Keras model on the JAX backend.
        micro_batches: The number of micro-batches, an `int` >= 1.

    Returns:
        A jitted function `(state, data) -> (logs, state)`.

    Example:

    ```python
    step = make_train_step(model, micro_batches=4)
    logs, state = step(state, (x, y))
    ```
    """
    validate_micro_batches(micro_batches)

    def train_step(state, data):
        return micro_batch_train_step(model, state, data, micro_batches)

    return jax.jit(train_step)
