"""The JAX backend as `keras_memguard.backends.current()` gives it."""

NAME = "jax"
VALIDATION_IN_FIT = False
PROFILES_SPIKES = False


def make_probe(devices=None, memory_limit=None):
    """`jax.Device.memory_stats()` (`JaxMemoryProbe`)."""
    from keras_memguard.backends.jax.probe import JaxMemoryProbe

    return JaxMemoryProbe(devices=devices, memory_limit=memory_limit)


def training_run(session, fit, log_key):
    """The run of one `fit` with the guard's `GuardSession` (`JaxTrainingRun`)."""
    from keras_memguard.backends.jax.run import JaxTrainingRun

    return JaxTrainingRun(session, fit, log_key)


def inference_run(session, kind):
    """The run of one `evaluate` or `predict`."""
    from keras_memguard.backends.jax import run

    return run.inference_run(session, kind)


def mixin_class():
    """`MemGuardMixin` on JAX."""
    from keras_memguard.backends.jax.mixin import MemGuardMixin

    return MemGuardMixin


def multi_worker_preparer():
    """`prepare_multi_worker`: nothing to prepare off TensorFlow."""
    from keras_memguard.backends.shared import prepare_multi_worker

    return prepare_multi_worker


def batch_size_finder():
    """What `find_batch_size` asks of JAX (its `finder` module)."""
    from keras_memguard.backends.jax import finder

    return finder


def advice():
    """What `advise`'s measuring child asks of JAX (its `advice` module)."""
    from keras_memguard.backends.jax import advice as module

    return module


def sees_gpu():
    """Whether JAX lists a GPU device."""
    import jax

    return any(d.platform == "gpu" for d in jax.devices())


def record_writer(path):
    """`None`: TensorBoard's own record writer is used (no TensorFlow here)."""
    return None


def growth_evidence():
    """What the growth evidence asks of jax (its `growth` module)."""
    from keras_memguard.backends.jax import growth

    return growth
