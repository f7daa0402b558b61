"""Probes read memory; they never decide and never raise during `fit`.

The sample types, NVML and the host's memory: what reads the same on every
backend. Each backend's own probe is in its folder under
`keras_memguard.backends` (`keras_memguard.AllocatorProbe` is TensorFlow's).
"""

from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import NvmlSample
from keras_memguard.probes.nvml import NvmlProbe

__all__ = [
    "AllocatorSample",
    "NvmlProbe",
    "NvmlSample",
]
