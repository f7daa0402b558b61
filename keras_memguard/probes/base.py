"""What every probe shares: sample types, argument checks, bookkeeping.

Samples are immutable and hold integer bytes; a value a probe cannot read is
`None`, never a guess. Probes measure and never decide. `DeviceMemoryProbe`
is what each backend's device-memory probe builds on; it imports no
framework.
"""

import logging
import numbers
import re
import sys
import warnings
from typing import NamedTuple, Optional

logger = logging.getLogger("keras_memguard")

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


def parse_memory_limit(memory_limit, normalize, keys):
    """Checks a probe's `memory_limit`; returns `(limit_for_all, limits)`.

    Args:
        memory_limit: `None`, bytes for every device, or a dict mapping
            device strings to bytes.
        normalize: The backend's `normalize_device`: a key's short form, or
            `None` for a key it does not read.
        keys: What a key must be, for the error, such as
            `'device strings such as "GPU:0"'`.

    Returns:
        `(limit_for_all, {short_device: limit})`: bytes or `None`, and a
        dict that is empty unless `memory_limit` is one.

    Raises:
        ValueError: Echoing `memory_limit`, unless it is `None`, a positive
            number of bytes, or a dict of them keyed by device strings.
    """
    if memory_limit is None:
        return None, {}
    if not isinstance(memory_limit, dict):
        return check_bytes(memory_limit, "memory_limit"), {}
    limits = {}
    for key, value in memory_limit.items():
        short = normalize(key)
        if short is None:
            raise ValueError(
                f"`memory_limit` keys must be {keys}. "
                f"Received: memory_limit={memory_limit!r}"
            )
        limits[short] = check_bytes(value, f"memory_limit[{key!r}]")
    return None, limits


def log_once(told, key, message, *args):
    """Logs an INFO line unless `key` is in `told`, a set kept per process.

    For a limitation of the machine, said once however many probes meet it.
    """
    if key not in told:
        told.add(key)
        logger.info(message, *args)


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


_LIMIT_HINT = (
    "HINT: pass `memory_limit=<bytes>` (an int, or a dict such as "
    '{"GPU:0": 16 * 2**30}) to the probe or callback.'
)


class DeviceMemoryProbe:
    """What the backends' device-memory probes share.

    A backend's probe subclasses this and says how it finds its devices
    (`_setup`) and names them (`_normalize`). This class keeps the entry of
    each device read (a named tuple with at least `tf_device`, `mode`,
    `limit` and `source`), answers the per-device queries, resolves the
    user's limits and says each problem once. It never raises inside `fit`:
    setup runs on first use, and one that fails leaves the probe reading
    nothing, with a warning.

    A subclass sets these class attributes:

    - `_MODE_ORDER`: modes from least to most reliable; `mode` is the first
      one any device has, else the first device's.
    - `_NAME` and `_LIBRARY`: the probe and the library whose version to
      report in the could-not-start warning (`"allocator probe"`,
      `"TensorFlow"`).
    - `_normalize`: its backend's `normalize_device`, as a `staticmethod`.
      Defaults to TensorFlow's short form (this module's).

    Args:
        limit_all: The user's limit in bytes for every device, or `None`.
        limits: The user's limits by short device name (`"GPU:0"`), or
            `None`. As `parse_memory_limit` returns them.
    """

    _MODE_ORDER = ("unavailable",)
    _NAME = "memory probe"
    _LIBRARY = "framework"
    _normalize = staticmethod(normalize_device)

    def __init__(self, limit_all=None, limits=None):
        self._limit_all = limit_all
        self._limits = limits or {}
        # Devices whose limit a caller applies itself (None: all of them).
        self._covered = frozenset()
        self._entries = None
        self._by_device = {}
        self._messages = []
        self._logged = set()

    def limits_given_elsewhere(self, memory_limit):
        """Says that the caller applies its own limit to some devices.

        A caller that reads this probe but divides by its own `memory_limit`
        (a callback given one) tells the probe so before first use: the
        devices that limit covers are not warned about as having no known
        limit. The probe's own limits do not change.

        Args:
            memory_limit: The caller's limit: bytes for every device, a dict
                from device string to bytes, or `None` (no device covered).
        """
        if memory_limit is None:
            self._covered = frozenset()
        elif isinstance(memory_limit, dict):
            self._covered = frozenset(self._normalize(k) for k in memory_limit)
        else:
            self._covered = None  # every device

    @property
    def devices(self):
        """Tuple of the device strings read, e.g. `("GPU:0", "GPU:1")`."""
        self._ensure_ready()
        return tuple(e.tf_device for e in self._entries)

    @property
    def mode(self):
        """How far the readings can be trusted: the least reliable mode.

        The mode among the devices read that the class docstring lists as
        least reliable; see `device_mode()` for one device. `"unavailable"`
        when the probe reads no device.
        """
        self._ensure_ready()
        modes = {e.mode for e in self._entries}
        for mode in self._MODE_ORDER:
            if mode in modes:
                return mode
        return self._entries[0].mode if self._entries else "unavailable"

    def device_mode(self, device):
        """Returns the mode of one device read by the probe (see `mode`).

        Args:
            device: A device string such as `"GPU:0"` or `"gpu0"`.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        return self._entry(device).mode

    def limit_bytes(self, device):
        """Returns the memory limit of one device in bytes, or `None`.

        Args:
            device: A device string such as `"GPU:0"` or `"gpu0"`.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        return self._entry(device).limit

    def limit_source(self, device):
        """Returns where the limit of one device came from.

        Args:
            device: A device string such as `"GPU:0"` or `"gpu0"`.

        Returns:
            One of the sources the class docstring lists, in the order
            they are tried: `"user"` first, `"unknown"` last.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        return self._entry(device).source

    def _setup(self):
        """Resolves devices, modes and limits once; returns the entries.

        May queue warnings in `self._messages`; may raise (then the probe
        reads nothing).
        """
        raise NotImplementedError

    def _index_entries(self, entries):
        """Keeps what the sample path reads of `entries`; for subclasses."""

    def _ensure_ready(self, stacklevel=3):
        # stacklevel=3 names the caller of the public method that called
        # this helper: the line `stacklevel=2` would name if inlined there.
        if self._entries is None:
            try:
                entries = tuple(self._setup())
            except Exception as e:  # Setup runs inside fit: never raise.
                entries = ()
                self._messages.append(
                    f"The {self._NAME} could not start ({e!r}); it reads "
                    f"nothing. HINT: report this with the {self._LIBRARY} "
                    "version."
                )
            self._entries = entries
            self._by_device = {e.tf_device: e for e in entries}
            self._index_entries(entries)
        while self._messages:
            warn_at_user_code(self._messages.pop(0), stacklevel=stacklevel)

    def _entry(self, device):
        self._ensure_ready(stacklevel=4)
        entry = self._by_device.get(self._normalize(device))
        if entry is None:
            raise ValueError(
                f"The probe does not read device {device!r}. It reads: "
                f"{[e.tf_device for e in self._entries]}."
            )
        return entry

    def _user_limit(self, tf_device):
        """The `memory_limit` given for `tf_device`, or `None`."""
        if self._limit_all is not None:
            return self._limit_all
        return self._limits.get(tf_device)

    def _limit_unknown(self, entry):
        """Whether neither the probe nor its caller knows `entry`'s limit."""
        covered = self._covered
        return (
            entry.source == "unknown"
            and covered is not None
            and entry.tf_device not in covered
        )

    def _warn_stray_limits(self, devices, hint=""):
        """Queues a warning for `memory_limit` keys of devices not read."""
        stray = sorted(set(self._limits) - set(devices))
        if stray:
            self._messages.append(
                f"`memory_limit` names devices the probe does not read: "
                f"{stray}; they are ignored. The probe reads "
                f"{list(devices)}.{hint}"
            )

    def _warn_unknown_limits(self, entries, said=("unavailable",), note=""):
        """Queues one warning naming every device without a known limit.

        Devices in a mode of `said` are left out: their own warning says it.
        `note` follows the first sentence.
        """
        unknown = [
            e.tf_device
            for e in entries
            if e.mode not in said and self._limit_unknown(e)
        ]
        if unknown:
            self._messages.append(
                f"{', '.join(unknown)}: no memory limit is known, so usage is "
                f"None.{note} {_LIMIT_HINT}"
            )

    def _log_failure_once(self, key, error, failed, *args):
        """Logs a failed read once per `key`, not on every batch.

        `failed % args` names the call: `"GPU:0.memory_stats() failed"`.
        """
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(
                failed + ": %s. Its readings are None; this message is shown "
                "once per device.",
                *args,
                error,
            )
