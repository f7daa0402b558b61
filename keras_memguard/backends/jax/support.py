"""What the JAX training core cannot guard yet, said before `fit` starts."""

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
    distribution = compat.distribution()
    if distribution is not None:
        devices = getattr(getattr(distribution, "device_mesh", None), "devices", None)
        count = getattr(devices, "size", None)
        return (
            "Planning and micro-batching under `keras.distribution` "
            f"({type(distribution).__name__}"
            + (f" over {count} devices" if count else "")
            + ") is not supported on the JAX backend yet. HINT: train on one "
            "device, or without `MemoryGuard`."
        )
    return None


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
