"""keras_memguard: keep Keras training alive when GPU memory runs short."""

from keras_memguard.errors import MemGuardError
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import NvmlSample

__version__ = "0.1.0.dev0"

__all__ = [
    "AllocatorSample",
    "MemGuardError",
    "MemoryLimitUnknownError",
    "MicroBatchTooLargeError",
    "NvmlSample",
    "UnsupportedTrainingSetupError",
]
