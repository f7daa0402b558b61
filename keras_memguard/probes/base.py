"""Sample types shared by every probe.

Samples are immutable and hold integer bytes; a value a probe cannot read is
`None`, never a guess. Probes measure and never decide.
"""

import numbers
import re
import sys
import warnings
from typing import NamedTuple, Optional

MIB = 1024 * 1024

# TensorFlow's device strings, long or short: "/device:GPU:0", "GPU:0", "gpu0".
_DEVICE_RE = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu):?(\d+)$", re.IGNORECASE)

# Frames of these top-level packages are skipped when a warning names the
# line that caused it: the user's line is the one that called into them
# (`model.fit(...)`, say), not one inside Keras or this package.
_LIBRARY_PACKAGES = frozenset(
    ("keras_memguard", "keras", "tensorflow", "tf_keras", "optree", "tree")
)


def normalize_device(device):
    """Returns the short TensorFlow form of a CPU or GPU device.

    Args:
        device: A device string such as `"GPU:0"`, `"/device:GPU:0"`,
            `"/job:localhost/replica:0/task:0/device:CPU:1"` or `"gpu0"`, or
            an object with such a `name` (a `tf.config.LogicalDevice`).

    Returns:
        The device as `"GPU:0"` or `"CPU:1"`, or `None` if it is not a CPU or
        GPU device string.
    """
    name = getattr(device, "name", device)
    if not isinstance(name, str):
        return None
    match = _DEVICE_RE.match(name.strip())
    if match is None:
        return None
    return f"{match.group(1).upper()}:{int(match.group(2))}"


def check_bytes(value, label):
    """Checks a memory limit given in bytes; returns it as an int.

    Shared by the probes' `memory_limit` arguments.

    Raises:
        ValueError: Naming `label` and echoing `value`, unless it is a
            positive whole number.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (
            isinstance(value, numbers.Integral)
            or (isinstance(value, float) and value.is_integer())
        )
        or value < 1
    ):
        raise ValueError(
            f"`{label}` must be a positive number of bytes (an int), a dict "
            "mapping device strings to one, or None. "
            f"Received: {label}={value!r}"
        )
    return int(value)


def check_memory_limit(memory_limit):
    """Checks a `memory_limit` argument as every probe takes it.

    Which device names a dict may hold is the probe's to check (each backend
    names its devices); here: `None`, a positive number of bytes, or a dict
    from device strings to one.

    Raises:
        ValueError: Naming the argument and echoing the value otherwise.
    """
    if memory_limit is None:
        return
    if not isinstance(memory_limit, dict):
        check_bytes(memory_limit, "memory_limit")
        return
    for key, value in memory_limit.items():
        if not isinstance(key, str):
            raise ValueError(
                "`memory_limit` keys must be device strings such as 'GPU:0'. "
                f"Received: memory_limit={memory_limit!r}"
            )
        check_bytes(value, f"memory_limit[{key!r}]")


def warn_at_user_code(message, category=UserWarning, stacklevel=2):
    """Warns, naming the first line outside this package, Keras and TF.

    Like `warnings.warn(message, category, stacklevel)`, then further up
    the stack past every frame of those libraries, so a warning raised
    during `fit` points at the user's `fit` call.

    Args:
        message: The warning text.
        category: The warning class. Defaults to `UserWarning`.
        stacklevel: As for `warnings.warn`, counted from the caller of this
            function: where to start looking. Defaults to `2`.
    """
    level = stacklevel
    try:
        frame = sys._getframe(stacklevel)
    except ValueError:  # Fewer frames than asked for.
        frame = None
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in _LIBRARY_PACKAGES:
            break
        frame = frame.f_back
        level += 1
    if frame is None:
        level = stacklevel
    warnings.warn(message, category, stacklevel=level + 1)


class AllocatorSample(NamedTuple):
    """One reading of TensorFlow's allocator for one device.

    Attributes:
        device: Short device name used in tags and logs: `"gpu0"`, `"cpu0"`.
        tf_device: The TensorFlow device string read: `"GPU:0"`, `"CPU:0"`.
        current_bytes: Bytes allocated at the time of reading, or `None`.
        peak_bytes: Highest bytes allocated since the previous reading (the
            per-batch peak when read once per batch), or `None`.
        limit_bytes: The device memory limit in force, or `None` if unknown.
        source: Always `"allocator"`.
    """

    device: str
    tf_device: str
    current_bytes: Optional[int]
    peak_bytes: Optional[int]
    limit_bytes: Optional[int]
    source: str = "allocator"

    @property
    def usage(self):
        """Peak bytes over the limit (0..1, may exceed 1), or `None`."""
        if self.peak_bytes is None or not self.limit_bytes:
            return None
        return self.peak_bytes / self.limit_bytes


class NvmlSample(NamedTuple):
    """One NVML reading of one GPU.

    With TensorFlow's default pre-allocation, `used_bytes` sits near the
    device total whatever the model needs: decide from `AllocatorSample`.

    Attributes:
        device: Short device name: `"gpu0"` for TensorFlow's `GPU:0`.
        nvml_index: The NVML index of that GPU (differs from the TensorFlow
            ordinal when `CUDA_VISIBLE_DEVICES` reorders or hides GPUs).
        total_bytes: Device memory in total, or `None`.
        used_bytes: Device memory used by all processes, or `None`.
        free_bytes: Device memory free, or `None`.
        process_bytes: Device memory used by this process, or `None`.
        gpu_utilization_percent: GPU utilization (0-100) over NVML's last
            sampling period (1/6 s to 1 s), or `None`.
        source: Always `"nvml"`.
    """

    device: str
    nvml_index: int
    total_bytes: Optional[int]
    used_bytes: Optional[int]
    free_bytes: Optional[int]
    process_bytes: Optional[int]
    gpu_utilization_percent: Optional[int]
    source: str = "nvml"
