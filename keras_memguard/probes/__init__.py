"""Probes read memory; they never decide and never raise during `fit`."""

from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import NvmlSample
from keras_memguard.probes.nvml import NvmlProbe
from keras_memguard.probes.tf_allocator import AllocatorProbe

__all__ = [
    "AllocatorProbe",
    "AllocatorSample",
    "NvmlProbe",
    "NvmlSample",
]
