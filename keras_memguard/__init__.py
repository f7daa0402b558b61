"""keras_memguard: keep Keras training alive when GPU memory runs short.

Callbacks (`MemoryMonitor`, `MemoryGuard`) and a `train_step` mixin
(`MemGuardMixin`) for Keras 3 on the TensorFlow, JAX and PyTorch backends.

Public names are loaded on first use, so that `keras_memguard.testing` can
set TensorFlow's environment before TensorFlow is imported.
"""

import importlib

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "AllocatorProbe": "keras_memguard.backends.tensorflow.probe",
    "AllocatorSample": "keras_memguard.probes.base",
    "BatchSizeResult": "keras_memguard.batch_size_finder",
    "CompiledStepOutOfMemoryError": "keras_memguard.errors",
    "DevicesAlreadyInitializedError": "keras_memguard.errors",
    "DistributedOutOfMemoryError": "keras_memguard.errors",
    "GrowthResult": "keras_memguard.growth",
    "MemGuardError": "keras_memguard.errors",
    "MemGuardMixin": "keras_memguard.backends",
    "MemoryGuard": "keras_memguard.callbacks.guard",
    "MemoryLimitUnknownError": "keras_memguard.errors",
    "MemoryMonitor": "keras_memguard.callbacks.monitor",
    "MicroBatchTooLargeError": "keras_memguard.errors",
    "MissingExtraError": "keras_memguard.errors",
    "NvmlProbe": "keras_memguard.probes.nvml",
    "NvmlSample": "keras_memguard.probes.base",
    "UnsupportedTrainingSetupError": "keras_memguard.errors",
    "advise": "keras_memguard.advice",
    "configure_devices": "keras_memguard.devices",
    "configured_memory_limits": "keras_memguard.devices",
    "check_growth": "keras_memguard.growth_check",
    "find_batch_size": "keras_memguard.batch_size_finder",
    "prepare_multi_worker": "keras_memguard.backends.tensorflow.multi_worker",
}

# Names whose implementation depends on Keras' backend: each backend's own,
# from the backend chosen once (`keras_memguard.backends.current()`).
_BACKEND_EXPORTS = {
    "MemGuardMixin": lambda protocol: protocol.mixin_class(),
    "prepare_multi_worker": lambda protocol: protocol.multi_worker_preparer(),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_memguard' has no attribute {name!r}")
    if name in _BACKEND_EXPORTS:
        from keras_memguard import backends

        value = _BACKEND_EXPORTS[name](backends.current())
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
