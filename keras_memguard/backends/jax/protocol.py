"""The JAX backend as `keras_memguard.backends.current()` gives it."""

NAME = "jax"
VALIDATION_IN_FIT = False
PROFILES_SPIKES = False


def make_probe(devices=None, memory_limit=None):
    """`jax.Device.memory_stats()` (`JaxMemoryProbe`)."""
    from keras_memguard.backends.jax.probe import JaxMemoryProbe

    return JaxMemoryProbe(devices=devices, memory_limit=memory_limit)


def training_run(guard, log_key):
    """The run of one `fit` under `guard` (`JaxTrainingRun`)."""
    from keras_memguard.backends.jax.run import JaxTrainingRun

    return JaxTrainingRun(guard, min(l for l in guard._limits if l), log_key)


def inference_run(guard, kind):
    """The run of one `evaluate` or `predict`."""
    from keras_memguard.backends.jax import run

    return run.inference_run(guard, kind)


def mixin_class():
    """`MemGuardMixin` on JAX."""
    from keras_memguard.backends.jax.mixin import MemGuardMixin

    return MemGuardMixin
