"""Layers that write their own variables in a training forward pass.

A micro-batched step runs the model's forward pass once per micro-batch,
so a layer that assigns its variables in `call(training=True)` does so
`micro_batches` times a batch where plain `fit` does it once, with no error
to show it. `BatchNormalization` updates its moving statistics from each
micro-batch's moments; `SpectralNormalization` runs its power iteration
and renormalizes its kernel once per micro-batch, so the kernel the
gradients are taken at is not the one plain `fit` uses; a layer of the
user's may count steps or keep an average of its inputs.

Before the first split, `check_once` runs one training forward pass of the
batch's first two samples in a `keras.StatelessScope`, where an assignment
is recorded and reaches no variable, and warns once per model, naming
what was written. Random seed states are left out: each micro-batch
drawing its own dropout mask trains as plain `fit` does, in distribution.
"""

import gc

import keras

from keras_memguard.backends import compat
from keras_memguard.probes.base import warn_at_user_code

_CHECKED_ATTR = "_memguard_forward_writes_checked"
_BATCH_STATS_WARNED_ATTR = "_memguard_batch_statistics_warned"
# Variable paths named in a warning; the rest are counted.
_NAMED = 4


def has_batch_statistics_layers(model):
    """Tells whether a model normalizes with batch statistics in training.

    Such layers (`keras.layers.BatchNormalization`, when trainable) see
    each micro-batch on its own: they normalize with the micro-batch's
    moments and update their moving statistics once per micro-batch.

    Args:
        model: A Keras model or layer.

    Returns:
        `True` if any trainable `BatchNormalization` layer is in `model`.

    Example:

    >>> model = keras.Sequential([keras.layers.BatchNormalization()])
    >>> has_batch_statistics_layers(model)
    True
    """
    return bool(_batch_statistics_layers(compat.all_layers(model)))


def _batch_statistics_layers(layers):
    return [
        layer for layer in layers
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]


def warn_batch_statistics_once(model, micro_batches):
    """Warns once per model that BatchNormalization sees micro-batches."""
    if micro_batches < 2 or getattr(model, _BATCH_STATS_WARNED_ATTR, False):
        return
    if not has_batch_statistics_layers(model):
        return
    # object.__setattr__: a plain flag, not tracked state.
    object.__setattr__(model, _BATCH_STATS_WARNED_ATTR, True)
    warn_at_user_code(
        f"Model {model.name!r} has BatchNormalization layers and trains with "
        f"micro_batches={micro_batches}: each micro-batch is normalized with "
        "its own statistics and the moving statistics are updated once per "
        "micro-batch. HINT: use GroupNormalization or LayerNormalization, "
        "freeze the BatchNormalization layers, or raise their momentum to "
        "momentum ** (1 / micro_batches).",
        stacklevel=3,
    )


def written_variables(model, data, values=None):
    """The paths of the variables a training forward pass of `data` writes.

    One forward pass of the batch's first two samples in training mode, in
    a `keras.StatelessScope`: the model's variables are left as they were.

    Args:
        model: A built Keras model.
        data: A batch: `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`.
        values: Where the model's variables hold no values during `fit`
            (Keras' JAX trainer keeps them in its own state): pairs of a
            variable and its value. Defaults to `None`: the variables' own
            values.

    Returns:
        A tuple of variable paths, in the model's order, random seed
        states left out.

    Example:

    >>> layer = keras.layers.SpectralNormalization(keras.layers.Dense(2))
    >>> model = keras.Sequential([keras.Input((3,)), layer])
    >>> sorted(path.rsplit("/", 1)[-1]
    ...        for path in written_variables(model, np.ones((2, 3))))
    ['kernel', 'vector_u']
    """
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    rows = keras.tree.map_structure(lambda t: None if t is None else t[:2], x)
    with keras.StatelessScope(state_mapping=values) as scope:
        given = dict(scope.state_mapping)
        model(rows, training=True)
    written = []
    for variable in model.trainable_variables + model.non_trainable_variables:
        value = scope.get_current_value(variable)
        if value is None or value is given.get(id(variable)):
            continue
        if "seed_generator" in variable.path:
            continue
        written.append(variable.path)
    return tuple(dict.fromkeys(written))


def due(model, batch_size, micro_batches):
    """Whether `check_once` would run its forward pass for this batch."""
    return micro_batches >= 2 and batch_size >= 2 and not getattr(model, _CHECKED_ATTR, False)


def check_once(model, data, batch_size, micro_batches, values=None):
    """Warns once per model when its training forward pass writes variables.

    At the model's first batch split in two or more. `BatchNormalization`'s
    moving statistics get their own warning (`warn_batch_statistics_once`).
    Nothing is raised: a check that cannot run here leaves training to go
    on, unchecked.

    Args:
        model: A compiled Keras model.
        data: The batch about to run.
        batch_size: Its samples.
        micro_batches: The count it runs at.
        values: As for `written_variables`. Defaults to `None`.
    """
    if not due(model, batch_size, micro_batches):
        return
    # object.__setattr__: a plain flag, not tracked state.
    object.__setattr__(model, _CHECKED_ATTR, True)
    try:
        written = written_variables(model, data, values)
        layers = compat.all_layers(model)
        statistics = {
            variable.path
            for layer in _batch_statistics_layers(layers)
            for variable in layer.non_trainable_variables
        }
    except Exception:  # noqa: BLE001 - a check, never a reason to stop training.
        return
    finally:
        # The eager pass's tensors, in reference cycles, would otherwise
        # sit beside the step about to run.
        gc.collect()
    if any(path in statistics for path in written):
        warn_batch_statistics_once(model, micro_batches)
    others = [path for path in written if path not in statistics]
    if not others:
        return
    named = ", ".join(repr(path) for path in others[:_NAMED])
    if len(others) > _NAMED:
        named += f" and {len(others) - _NAMED} more"
    spectral = getattr(keras.layers, "SpectralNormalization", ())
    example = (
        "SpectralNormalization renormalizes its kernel once per micro-batch, "
        "and the gradients are taken at that kernel"
        if any(isinstance(layer, spectral) for layer in layers)
        else "a count or an average a layer keeps moves once per micro-batch"
    )
    warn_at_user_code(
        f"Model {model.name!r} trains with micro_batches={micro_batches}, and "
        f"its training forward pass writes variables: {named}. Each "
        "micro-batch's forward pass writes them again, so they are updated "
        f"{micro_batches} times a batch where plain `fit` updates them once, "
        f"and the model trains differently ({example}). HINT: train at a "
        "batch that fits whole "
        "(`find_batch_size`), with `MemoryGuard(max_micro_batches=1)` to "
        "keep the guard watching."
    )
