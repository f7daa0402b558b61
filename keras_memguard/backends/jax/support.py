"""What the JAX training core cannot guard, said before `fit` starts."""

from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat


def unsupported_reason(model):
    """Why the micro-batched JAX step cannot train `model`, or `None`.

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
    if model.run_eagerly or not model.jit_compile:
        return (
            "The micro-batched JAX step is compiled with XLA, so the model "
            "must not run eagerly. Received: "
            f"run_eagerly={model.run_eagerly!r}, jit_compile={model.jit_compile!r}. "
            "HINT: compile with Keras' defaults on JAX (`jit_compile=True` "
            "or `\"auto\"`, `run_eagerly=False`); the guard's step is then "
            "the compiled one `fit` would run."
        )
    return None


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
