"""Reads JAX devices' memory: `jax.Device.memory_stats()`.

The JAX counterpart of `AllocatorProbe`, with the same interface and the
same `AllocatorSample`s, so the callbacks read either. Imports neither
TensorFlow nor Keras; JAX is imported on first use.

Two things differ from TensorFlow's allocator:

- JAX cannot reset a device's peak. `peak_bytes` of a sample is the
  device's high-water mark since the process started
  (`peak_bytes_in_use`); `interval_peaks()` gives a sampling interval's own
  peak where it is known: when the mark rose during the interval, the new
  mark was reached in it.
- CPU devices keep no statistics (`memory_stats()` is `None`): their
  current and peak bytes are `None`, said once in an INFO line.
"""

import numbers
import re
from typing import NamedTuple, Optional

from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import DeviceMemoryProbe
from keras_memguard.probes.base import log_once
from keras_memguard.probes.base import parse_memory_limit

LIMIT_SOURCES = ("user", "device", "unknown")
PEAK_MEANING = "since_start"

_DEVICE_RE = re.compile(r"^(?:.*/)?(?:device:)?([a-z]+):?(\d+)$", re.IGNORECASE)
# Device sets already told about in this process: one INFO line each.
_told = set()


class _Entry(NamedTuple):
    device: object  # the jax.Device
    tf_device: str  # "GPU:0": the name the callbacks key limits by
    name: str  # "gpu0": the name in tags and logs
    mode: str
    limit: Optional[int]
    source: str


def normalize_device(device):
    """Returns the short form of a device: `"GPU:0"`, `"CPU:1"`, `"TPU:0"`.

    Args:
        device: A string such as `"GPU:0"`, `"gpu0"` or `"/device:GPU:0"`.

    Returns:
        The short form, or `None` if `device` is not such a string.
    """
    if not isinstance(device, str):
        return None
    match = _DEVICE_RE.match(device.strip())
    if match is None:
        return None
    return f"{match.group(1).upper()}:{int(match.group(2))}"


def _stat(stats, key):
    value = stats.get(key) if stats else None
    return int(value) if isinstance(value, numbers.Integral) else None


class JaxMemoryProbe(DeviceMemoryProbe):
    """Reads JAX devices' memory: bytes in use, high-water mark, limit.

    Each `sample()` reads `memory_stats()` of every device. On GPU (and TPU)
    it gives `bytes_in_use`, `peak_bytes_in_use`, `bytes_limit` and, where
    the runtime reports it, `largest_free_block_bytes`. JAX cannot reset the
    peak: a sample's `peak_bytes` is the high-water mark since the process
    started, and `interval_peaks()` the interval's own peak where it is
    known. CPU devices keep no statistics: their readings are `None`, said
    once in an INFO line on the `keras_memguard` logger. The probe never
    raises while sampling.

    The mode of a device (`device_mode()`) is its platform (`"gpu"`,
    `"tpu"`) when it keeps memory statistics, `"unavailable"` when it does
    not (CPU); `mode` is `"unavailable"` if any device is, else the
    platform.

    The memory limit of each device is, in this order (`limit_source()`):
    `"user"` (the `memory_limit` argument), `"device"` (`bytes_limit` of
    `memory_stats()`: what XLA's allocator may use, after
    `XLA_PYTHON_CLIENT_MEM_FRACTION`), `"unknown"` (warned once, unless a
    caller applies its own limit: `limits_given_elsewhere`).

    Args:
        devices: The devices to read: `jax.Device`s, or strings such as
            `"GPU:0"` (the i-th local device of that platform). Defaults to
            `None`: every local device of JAX's default backend, resolved on
            first use.
        memory_limit: Device memory limit in bytes: one `int` for every
            device, or a dict mapping device strings to bytes. Defaults to
            `None`: resolved as above.

    Raises:
        ValueError: If `memory_limit` is not a positive number of bytes or a
            dict of them keyed by device strings, or `devices` is empty.

    Example:

    ```python
    probe = JaxMemoryProbe()
    probe.reset()
    model.fit(x, y, epochs=1)
    (s,) = probe.sample()
    print(s.device, s.current_bytes, s.peak_bytes, s.limit_bytes)
    ```
    """

    # JAX has no per-interval peak reset; see the class docstring.
    peak_resets = False

    _MODE_ORDER = ("unavailable",)
    _NAME = "JAX memory probe"
    _LIBRARY = "jax"
    _normalize = staticmethod(normalize_device)

    def __init__(self, devices=None, memory_limit=None):
        if devices is not None:
            if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
                devices = [devices]
            if not devices:
                raise ValueError(
                    "`devices` must be a non-empty list of JAX devices or "
                    f'device strings such as "GPU:0". Received: devices={devices!r}'
                )
        self._requested = None if devices is None else tuple(devices)
        super().__init__(
            *parse_memory_limit(
                memory_limit, normalize_device, 'device strings such as "GPU:0"'
            )
        )
        self._marks = None
        self._interval_peaks = ()
        self._largest_free = {}

    @property
    def jax_devices(self):
        """Tuple of the `jax.Device`s read, in `devices` order."""
        self._ensure_ready()
        return tuple(e.device for e in self._entries)

    def largest_free_bytes(self, device):
        """The largest free block of one device at the last sample, or `None`.

        Args:
            device: A device string such as `"GPU:0"` or `"gpu0"`.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        return self._largest_free.get(self._entry(device).tf_device)

    def reset(self):
        """Starts a new interval: the marks read now are the baseline.

        JAX cannot reset the devices' peaks; see `interval_peaks()`.
        """
        self._ensure_ready()
        self._marks = tuple(
            _stat(self._stats(e), "peak_bytes_in_use") for e in self._entries
        )

    def sample(self):
        """Reads every device.

        Returns:
            A tuple of `AllocatorSample`, one per device in `devices` order:
            `current_bytes` is `bytes_in_use`, `peak_bytes` the high-water
            mark since the process started, `limit_bytes` the resolved
            limit; `None` where the device keeps no statistics.
        """
        self._ensure_ready()
        readings = []
        marks = []
        for entry in self._entries:
            stats = self._stats(entry)
            current = _stat(stats, "bytes_in_use")
            peak = _stat(stats, "peak_bytes_in_use")
            self._largest_free[entry.tf_device] = _stat(stats, "largest_free_block_bytes")
            limit = entry.limit
            readings.append(
                AllocatorSample(entry.name, entry.tf_device, current, peak, limit, "jax")
            )
            marks.append(peak)
        previous = self._marks or (None,) * len(marks)
        # A mark that rose was set in this interval: it is the interval's
        # peak. One that did not tells only that the interval stayed under it.
        self._interval_peaks = tuple(
            new if new is not None and old is not None and new > old else None
            for old, new in zip(previous, marks)
        )
        self._marks = tuple(marks)
        return tuple(readings)

    def interval_peaks(self):
        """Each device's own peak over the last sampling interval, or `None`.

        Known exactly when the device's high-water mark rose during the
        interval (between the previous `sample()` or `reset()` and the last
        `sample()`); otherwise `None`: the interval stayed under an earlier
        peak.

        Returns:
            A tuple of ints or `None`, in `devices` order.
        """
        return self._interval_peaks

    def _stats(self, entry):
        if entry.mode == "unavailable":
            return None
        try:
            return entry.device.memory_stats()
        except Exception as e:  # A probe never stops training.
            self._log_failure_once(
                entry.tf_device, e, "%s.memory_stats() failed", entry.tf_device
            )
            return None

    def _entry(self, device):
        if not isinstance(device, str):
            # A jax.Device: named by its place among the devices read.
            self._ensure_ready(stacklevel=4)
            device = getattr(device, "platform", "?") + ":" + str(
                next(
                    (i for i, e in enumerate(self._entries) if e.device == device),
                    "?",
                )
            )
        return super()._entry(device)

    def _setup(self):
        import jax

        local = list(jax.local_devices())
        names = {}
        counters = {}
        for device in sorted(
            set(local) | set(d for d in self._requested or () if not isinstance(d, str)),
            key=lambda d: (d.platform, d.id),
        ):
            index = counters.get(device.platform, 0)
            counters[device.platform] = index + 1
            names[device] = f"{device.platform.upper()}:{index}"
        by_name = {name: device for device, name in names.items()}

        if self._requested is None:
            chosen = local
        else:
            chosen = []
            for requested in self._requested:
                if isinstance(requested, str):
                    device = by_name.get(normalize_device(requested))
                    if device is None:
                        raise ValueError(
                            f"JAX has no local device {requested!r}. It has: "
                            f"{sorted(by_name)}."
                        )
                else:
                    device = requested
                if device not in chosen:
                    chosen.append(device)

        entries = []
        for device in chosen:
            tf_device = names[device]
            try:
                stats = device.memory_stats()
            except Exception:
                stats = None
            mode = device.platform if stats else "unavailable"
            user = self._user_limit(tf_device)
            if user is not None:
                limit, source = user, "user"
            elif _stat(stats, "bytes_limit"):
                limit, source = _stat(stats, "bytes_limit"), "device"
            else:
                limit, source = None, "unknown"
            entries.append(
                _Entry(device, tf_device, tf_device.lower().replace(":", ""), mode, limit, source)
            )
        self._warn_stray_limits([e.tf_device for e in entries])
        self._tell(entries)
        return entries

    def _tell(self, entries):
        """One INFO line per kind of limitation, once per process."""
        unavailable = tuple(e.tf_device for e in entries if e.mode == "unavailable")
        if unavailable:
            log_once(
                _told,
                ("unavailable", unavailable),
                "%s: JAX keeps no memory statistics on %s (memory_stats() is "
                "None), so the device memory readings are absent; micro-batch "
                "plans come from the compiled step's memory analysis.",
                ", ".join(unavailable),
                "this device" if len(unavailable) == 1 else "these devices",
            )
        measured = tuple(e.tf_device for e in entries if e.mode != "unavailable")
        if measured:
            log_once(
                _told,
                ("peak", measured),
                "%s: JAX cannot reset a device's peak, so the peak read is the "
                "highest since the process started; a batch's own peak is "
                "known when it sets a new high.",
                ", ".join(measured),
            )
        self._warn_unknown_limits(entries)
