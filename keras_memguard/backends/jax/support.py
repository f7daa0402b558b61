"""What the JAX training core cannot guard, said before `fit` starts."""

from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat


def unsupported_reason(model):
    """Why the guard cannot watch `model`'s JAX training at all, or `None`.

    Args:
        model: A compiled Keras model.

    Returns:
        A message naming what is not supported, with a hint, or `None`.
    """
    import keras

    if keras.backend.backend() != "jax":
        return (
            "The JAX training core runs on Keras' JAX backend only. "
            f"Received: backend={keras.backend.backend()!r}. "
            "HINT: set KERAS_BACKEND=jax before importing Keras."
        )
    return None


def eager_reason(model):
    """Why Keras runs `model`'s step without XLA, or `None`.

    The micro-batched step is compiled with XLA and planned from XLA's own
    analysis; a model Keras runs eagerly (`run_eagerly=True`,
    `jit_compile=False`, or a layer without XLA support, such as
    `RandomRotation` or `RandomZoom`, which makes `jit_compile="auto"`
    and `True` resolve to `False`) trains its batches whole instead, as
    in plain `fit`.

    Args:
        model: A compiled Keras model.

    Returns:
        The cause in a few words ("`jit_compile=False`", "its layer
        'random_rotation' (RandomRotation) does not support XLA"), or
        `None` where the step is compiled.
    """
    if model.run_eagerly:
        return "`run_eagerly=True`"
    if model.jit_compile:
        return None
    for layer in compat.all_layers(model):
        if not getattr(layer, "supports_jit", True):
            return (
                f"its layer {layer.name!r} ({type(layer).__name__}) does not "
                "support XLA"
            )
    return "`jit_compile=False`"


def distribution_text():
    """The global `keras.distribution` in words, or `None` where none is set.

    Under a distribution Keras spreads each batch over the devices of its
    mesh; the micro-batched step is compiled for one device, so the guard
    and the mixin run Keras' own step there.
    """
    distribution = compat.distribution()
    if distribution is None:
        return None
    devices = getattr(getattr(distribution, "device_mesh", None), "devices", None)
    count = getattr(devices, "size", None)
    return type(distribution).__name__ + (f" over {count} devices" if count else "")


def data_sharding(shape):
    """The sharding Keras gives a batch of `shape` under the distribution, or `None`."""
    distribution = compat.distribution()
    if distribution is None:
        return None
    return distribution.get_data_layout(tuple(shape)).backend_layout


def batch_shards():
    """Into how many parts the distribution splits a batch (1 without one).

    Keras requires every batch to be a multiple of it.
    """
    sharding = data_sharding((1,))
    if sharding is None or not sharding.spec or sharding.spec[0] is None:
        return 1
    names = sharding.spec[0]
    names = names if isinstance(names, tuple) else (names,)
    count = 1
    for name in names:
        count *= sharding.mesh.shape[name]
    return count


def check_supported(model):
    """Raises if the micro-batched JAX step cannot train `model`.

    Call it at `fit` start, before any step runs.

    Args:
        model: A compiled Keras model.

    Raises:
        UnsupportedTrainingSetupError: Naming what is not supported (see
            `unsupported_reason`).
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedTrainingSetupError(reason)
