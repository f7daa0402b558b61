"""Models whose batches must run whole: layers that keep a state per sample.

A recurrent layer built with `stateful=True` carries its state from one
batch to the next, one row per sample of a batch size fixed when the model
is built (its `batch_shape`). A micro-batch, a slice or a smaller batch
would need a state of another size, which Keras refuses (a `ValueError`
from the layer), and would break the sequences the state carries besides.
The guard trains such a model's batches whole, and the batch size finder
refuses to search a size the model fixes; both ask `stateful_layers`, and
`MemGuardMixin` refuses a count above one (`check_micro_batches`).
"""

from keras_memguard.backends import compat
from keras_memguard.callbacks import messages
from keras_memguard.errors import UnsupportedTrainingSetupError


def stateful_layers(model):
    """The names of `model`'s layers that keep their state between batches.

    Args:
        model: A Keras model.

    Returns:
        A tuple of layer names, in the model's order; empty where no layer
        was built with `stateful=True` (or the model cannot be walked).

    Example:

    >>> import keras
    >>> model = keras.Sequential([
    ...     keras.Input(batch_shape=(4, 10, 2)),
    ...     keras.layers.LSTM(8, stateful=True, name="lstm"),
    ... ])
    >>> stateful_layers(model)
    ('lstm',)
    """
    try:
        layers = compat.all_layers(model)
    except Exception:  # A model Keras cannot walk: nothing known.
        return ()
    return tuple(
        layer.name for layer in layers
        if layer is not model and getattr(layer, "stateful", False) is True
    )


def check_micro_batches(model, micro_batches):
    """Raises where `micro_batches` above one is asked of a model with stateful layers.

    Args:
        model: A Keras model.
        micro_batches: The count asked for, an `int` >= 1.

    Returns:
        `micro_batches`.

    Raises:
        UnsupportedTrainingSetupError: Naming the layers and the count.
    """
    if micro_batches > 1:
        layers = stateful_layers(model)
        if layers:
            raise UnsupportedTrainingSetupError(
                messages.stateful_split_refused(type(model).__name__, layers, micro_batches)
            )
    return micro_batches
