"""Reads TensorFlow's allocator: current and per-interval peak bytes."""

import os
from typing import NamedTuple, Optional

from keras_memguard.probes.base import MIB
from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import DeviceMemoryProbe
from keras_memguard.probes.base import normalize_device
from keras_memguard.probes.base import parse_memory_limit
from keras_memguard.probes.base import warn_at_user_code

# TensorFlow's own default when TF_CPU_BFC_MEM_LIMIT_IN_MB is unset or not an
# integer (tensorflow/core/common_runtime/process_state.cc: 1 << 16 MiB).
TF_DEFAULT_CPU_BFC_LIMIT_MIB = 1 << 16

LIMIT_SOURCES = ("user", "logical_device", "cpu_bfc_env", "nvml", "unknown")
MODES = ("bfc", "default", "unavailable", "gpu")

# TensorFlow device -> the highest peak any probe read in this process. The
# probes reset the allocator's peak at every sample, and what the allocator
# grew for that peak stays reserved (`region.reserve_region` needs it).
_highest_peaks = {}

_BFC_HINT = (
    "HINT: set TF_CPU_ALLOCATOR_USE_BFC=true (and TF_CPU_BFC_MEM_LIMIT_IN_MB="
    "<MiB> for a cap) in the environment before TensorFlow is imported."
)


class _Entry(NamedTuple):
    tf_device: str
    name: str
    kind: str
    mode: str
    limit: Optional[int]
    source: str


def _env_flag(name):
    # TensorFlow's ReadBoolFromEnvVar accepts "true"/"1", case-insensitively.
    return os.environ.get(name, "").strip().lower() in ("true", "1")


def cpu_bfc_limit_bytes():
    """The CPU BFC cap TensorFlow applies, or `None` when BFC is off."""
    if not _env_flag("TF_CPU_ALLOCATOR_USE_BFC"):
        return None
    try:
        mib = int(os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip())
    except ValueError:  # TensorFlow falls back to its default likewise.
        mib = TF_DEFAULT_CPU_BFC_LIMIT_MIB
    return mib * MIB if mib > 0 else None


def logical_device_limits(physical_devices):
    """Maps logical devices to their physical ordinal and configured limit.

    Logical devices are numbered per type across the visible physical
    devices in order; a physical device with a logical device configuration
    holds one logical device per entry, otherwise exactly one.

    Args:
        physical_devices: Pairs `(physical_device_name, configurations)`:
            the name as `tf.config.PhysicalDevice.name`
            (`"/physical_device:GPU:1"`), and the list
            `tf.config.get_logical_device_configuration` returns, or `None`.

    Returns:
        A dict mapping `"GPU:i"`/`"CPU:i"` to `(physical_ordinal,
        memory_limit_bytes_or_None)`.
    """
    result = {}
    counters = {}
    for physical_name, configurations in physical_devices:
        short = normalize_device(physical_name.replace("physical_device:", ""))
        if short is None:
            continue
        kind, ordinal = short.split(":")
        limits = [None]
        if configurations:
            limits = [getattr(c, "memory_limit", None) for c in configurations]
        for limit_mib in limits:
            logical = counters.get(kind, 0)
            counters[kind] = logical + 1
            limit = int(limit_mib) * MIB if limit_mib else None
            result[f"{kind}:{logical}"] = (int(ordinal), limit)
    return result


def _parse_limits(memory_limit, devices):
    """Validates `memory_limit`; returns `(limit_for_all, {device: limit})`."""
    limit_all, limits = parse_memory_limit(
        memory_limit, normalize_device, 'CPU or GPU device strings such as "GPU:0"'
    )
    if devices is not None and set(limits) - set(devices):
        raise ValueError(
            "`memory_limit` names devices the probe does not read: "
            f"{sorted(set(limits) - set(devices))}. "
            f"Received: memory_limit={memory_limit!r} with "
            f"devices={list(devices)!r}"
        )
    smallest = min([limit_all or MIB] + list(limits.values()))
    if smallest < MIB:
        warn_at_user_code(
            f"`memory_limit` of {smallest} bytes is under 1 MiB: it is "
            "in bytes, not MiB. HINT: for 8 GiB pass 8 * 2**30. "
            f"Received: memory_limit={memory_limit!r}",
            stacklevel=3,
        )
    return limit_all, limits


class AllocatorProbe(DeviceMemoryProbe):
    """Reads TensorFlow's allocator: current bytes and the peak per interval.

    Each `sample()` reads `tf.config.experimental.get_memory_info` for every
    device, then `reset_memory_stats`, so `peak_bytes` is the high-water mark
    since the previous sample: the per-batch peak when sampled once per batch.
    Call `reset()` at train begin. The probe never raises while sampling: a
    value it cannot read is `None`, and a problem is warned about once.

    Devices, modes and limits are resolved on first use (the first call of
    any method or property), so configure TensorFlow's devices
    (`set_visible_devices`, `set_logical_device_configuration`) before.

    The mode of a device (`device_mode()`) says how far its readings can be
    trusted; `mode` is the least reliable among the devices read
    (`"unavailable"`, then `"default"`):

    - `"bfc"`: the CPU BFC allocator is on
      (`TF_CPU_ALLOCATOR_USE_BFC=true`): every allocation is counted and
      a cap is enforced, as on a GPU. The project's GPU stand-in.
    - `"default"`: TensorFlow's default CPU allocator (oneDNN on):
      readings work but small allocations are not counted, so a small
      model can read 0 bytes. Warned once.
    - `"unavailable"`: TensorFlow keeps no statistics for the device
      (`get_memory_info` raises `ValueError`, e.g. CPU with oneDNN off
      and no BFC, or a device that does not exist): current and peak
      are `None`. Warned once, with a hint.
    - `"gpu"`: a GPU's allocator: every allocation is counted.

    The memory limit of each device is resolved in this order; see
    `limit_source()`:

    1. `"user"`: the `memory_limit` argument.
    2. `"logical_device"`: the `memory_limit` (MiB) of the device's entry in
       `tf.config.get_logical_device_configuration(physical_device)`.
    3. `"cpu_bfc_env"` (CPU): `TF_CPU_BFC_MEM_LIMIT_IN_MB` when
       `TF_CPU_ALLOCATOR_USE_BFC` is `true` or `1`; TensorFlow's own
       default of 64 GiB when that variable is unset. TensorFlow reads these
       once at import; the probe reads `os.environ` at first use.
    4. `"nvml"` (GPU): the device total from NVML (`NvmlProbe`). TensorFlow
       keeps part of it back and other processes may use some, so usage
       reads a little low: pass `memory_limit` where that matters.
    5. `"unknown"`: the limit and so `usage` are `None`; warned once.

    Logical devices that share one physical allocator (several logical CPUs
    `"CPU:0"`, `"CPU:1"` under a `tf.distribute` strategy) are each read and
    report the same shared numbers. All devices are read before any is
    reset, so a shared allocator's peak is not lost between them.

    Args:
        devices: TensorFlow device strings to read, such as
            `["GPU:0", "GPU:1"]`; full names like
            `strategy.extended.worker_devices` are accepted. Defaults to
            `None`: every logical GPU, or `["CPU:0"]` without a GPU,
            resolved on first use.
        memory_limit: Device memory limit in bytes: one `int` for every
            device, or a dict mapping device strings to bytes. Defaults to
            `None`: resolved as above.

    Raises:
        ValueError: If `devices` is not a non-empty list of CPU or GPU device
            strings, or `memory_limit` is not a positive number of bytes or
            a dict of them for those devices.

    Example:

    ```python
    probe = AllocatorProbe(memory_limit={"GPU:0": 16 * 2**30})
    probe.reset()
    model.train_on_batch(x, y)
    (s,) = probe.sample()
    print(s.device, s.peak_bytes, s.usage)
    ```
    """

    _MODE_ORDER = ("unavailable", "default", "bfc", "gpu")
    _NAME = "allocator probe"
    _LIBRARY = "TensorFlow"

    def __init__(self, devices=None, memory_limit=None):
        if devices is not None:
            if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
                devices = [devices] if normalize_device(devices) else devices
            if not isinstance(devices, (list, tuple)) or not devices:
                raise ValueError(
                    "`devices` must be a non-empty list of TensorFlow device "
                    'strings such as ["GPU:0"] or ["CPU:0"], or None. '
                    f"Received: devices={devices!r}"
                )
            normalized = []
            for device in devices:
                short = normalize_device(device)
                if short is None:
                    raise ValueError(
                        "`devices` must hold CPU or GPU device strings such "
                        'as "GPU:0" or "/device:CPU:0". '
                        f"Received: devices={devices!r}"
                    )
                if short not in normalized:
                    normalized.append(short)
            devices = tuple(normalized)
        self._requested_devices = devices
        super().__init__(*_parse_limits(memory_limit, devices))
        self._readable = ()
        self._get_memory_info = None
        self._reset_memory_stats = None

    def reset(self):
        """Resets every device's peak to its current bytes (at train begin)."""
        if self._entries is None:
            self._ensure_ready()
        get = self._get_memory_info
        for entry in self._readable:
            try:
                _record_peak(entry.tf_device, get(entry.tf_device)["peak"])
            except Exception as e:  # A probe never stops training.
                self._log_failure("get_memory_info", entry, e)
        self._reset_all()

    def sample(self):
        """Reads every device, then resets its peak.

        Returns:
            A tuple of `AllocatorSample`, one per device in `devices` order,
            with `peak_bytes` the high-water mark since the previous
            `sample()` or `reset()`. Values that cannot be read are `None`.
        """
        if self._entries is None:
            self._ensure_ready()
        get = self._get_memory_info
        readings = []
        for entry in self._entries:
            current = peak = None
            if entry.mode != "unavailable":
                try:
                    info = get(entry.tf_device)
                    current = info["current"]
                    peak = info["peak"]
                    _record_peak(entry.tf_device, peak)
                except Exception as e:  # A probe never stops training.
                    self._log_failure("get_memory_info", entry, e)
            readings.append(
                AllocatorSample(entry.name, entry.tf_device, current, peak, entry.limit)
            )
        # Every device is read before any is reset: logical devices can
        # share one allocator.
        reset = self._reset_memory_stats
        for entry in self._readable:
            try:
                reset(entry.tf_device)
            except Exception as e:  # A probe never stops training.
                self._log_failure("reset_memory_stats", entry, e)
        return tuple(readings)

    def _reset_all(self):
        reset = self._reset_memory_stats
        for entry in self._readable:
            try:
                reset(entry.tf_device)
            except Exception as e:  # A probe never stops training.
                self._log_failure("reset_memory_stats", entry, e)

    def _log_failure(self, what, entry, error):
        self._log_failure_once(
            (what, entry.tf_device),
            error,
            "tf.config.experimental.%s(%r) failed",
            what,
            entry.tf_device,
        )

    def _setup(self):
        """Resolves devices, modes, limits and names, once."""
        import tensorflow as tf

        self._get_memory_info = tf.config.experimental.get_memory_info
        self._reset_memory_stats = tf.config.experimental.reset_memory_stats

        logical = {}
        existing = set()
        for kind in ("GPU", "CPU"):
            physical = [
                (p.name, tf.config.get_logical_device_configuration(p))
                for p in tf.config.get_visible_devices(kind)
            ]
            logical.update(logical_device_limits(physical))
            existing.update(
                normalize_device(d) for d in tf.config.list_logical_devices(kind)
            )

        devices = self._requested_devices
        if devices is None:
            devices = sorted(
                (d for d in existing if d.startswith("GPU:")),
                key=lambda d: int(d.split(":")[1]),
            ) or ["CPU:0"]
            self._warn_stray_limits(
                devices, " HINT: pass `devices=` or fix the keys."
            )

        cpu_bfc_limit = cpu_bfc_limit_bytes()
        nvml = None
        entries = []
        for tf_device in devices:
            kind = tf_device.split(":")[0]
            try:
                self._get_memory_info(tf_device)
                if kind == "GPU":
                    mode = "gpu"
                elif _env_flag("TF_CPU_ALLOCATOR_USE_BFC"):
                    mode = "bfc"
                else:
                    mode = "default"
            except Exception:
                mode = "unavailable"

            physical_ordinal, logical_limit = logical.get(tf_device, (None, None))
            user = self._user_limit(tf_device)
            if user is not None:
                limit, source = user, "user"
            elif logical_limit is not None:
                limit, source = logical_limit, "logical_device"
            elif kind == "CPU" and cpu_bfc_limit is not None:
                limit, source = cpu_bfc_limit, "cpu_bfc_env"
            elif kind == "GPU" and physical_ordinal is not None:
                if nvml is None:
                    from keras_memguard.probes.nvml import NvmlProbe

                    nvml = NvmlProbe()
                    # Fold NVML's own warning into the unknown-limit one.
                    nvml.start(warn=False)
                limit = nvml.total_bytes(physical_ordinal)
                source = "nvml" if limit is not None else "unknown"
            else:
                limit, source = None, "unknown"
            entries.append(
                _Entry(
                    tf_device, tf_device.lower().replace(":", ""), kind, mode,
                    limit, source,
                )
            )
        if nvml is not None:
            nvml.close()

        self._warn_about(entries, existing, nvml)
        return entries

    def _index_entries(self, entries):
        self._readable = tuple(e for e in entries if e.mode != "unavailable")

    def _warn_about(self, entries, existing, nvml):
        """Queues one warning per kind of problem, naming every device."""

        def names(predicate):
            return [e.tf_device for e in entries if predicate(e)]

        def join(devices):
            return ", ".join(devices)

        missing = names(lambda e: e.tf_device not in existing)
        if missing:
            self._messages.append(
                f"TensorFlow has no device {join(missing)}: its readings are "
                f"None. HINT: read one of {join(sorted(existing))}."
            )
        unavailable = names(
            lambda e: e.mode == "unavailable" and e.tf_device in existing
        )
        if unavailable:
            self._messages.append(
                f"{join(unavailable)}: TensorFlow keeps no allocator "
                "statistics (the default CPU allocator with oneDNN off), so "
                "memory readings are None" + self._limit_clause(entries, unavailable)
                + f". {_BFC_HINT}"
            )
        default = names(lambda e: e.mode == "default")
        if default:
            self._messages.append(
                f"{join(default)}: TensorFlow's default CPU allocator does "
                "not count small allocations, so a small model can read 0 "
                "bytes" + self._limit_clause(entries, default) + f". {_BFC_HINT}"
            )
        nvml_note = ""
        if nvml is not None and nvml.message:
            nvml_note = f" NVML could not help: {nvml.message}"
        # The warnings above already said the limit of these modes.
        self._warn_unknown_limits(entries, ("unavailable", "default"), nvml_note)

    def _limit_clause(self, entries, devices):
        if any(self._limit_unknown(e) for e in entries if e.tf_device in devices):
            return ", and no memory limit is known, so usage is None"
        return ""


def _record_peak(tf_device, peak):
    if peak > _highest_peaks.get(tf_device, 0):
        _highest_peaks[tf_device] = peak


def highest_peak_bytes(tf_device):
    """The highest peak any `AllocatorProbe` read on `tf_device` in this process.

    The probes reset TensorFlow's peak at every sample, so the allocator's
    own peak forgets what it grew its regions for; this does not. 0 before
    any reading.

    Args:
        tf_device: A TensorFlow device string as the probe reads it,
            e.g. `"CPU:0"`.

    Returns:
        An int, in bytes.
    """
    return _highest_peaks.get(tf_device, 0)
