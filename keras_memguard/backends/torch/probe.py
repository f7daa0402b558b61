"""Reads memory on Keras' PyTorch backend: CUDA's allocator, or the host.

The PyTorch counterpart of `AllocatorProbe` and `JaxMemoryProbe`, with the
same interface and the same `AllocatorSample`s, so the callbacks read any of
them. Imports neither TensorFlow, JAX nor Keras; torch is imported on first
use.

- On a CUDA device (`"GPU:i"`, torch's `cuda:i`) it reads PyTorch's caching
  allocator (`torch.cuda.memory_stats_as_nested_dict`, the statistics of
  `torch.cuda.memory_stats` before they are flattened into one dict): the
  bytes held by tensors now and their peak since the previous reading, the
  peak being reset after each reading (`torch.cuda.reset_peak_memory_stats`).
- Without CUDA (`"CPU:0"`, Keras' `cpu` device) tensors live in the host's
  memory, so it reads the process's resident memory from
  `/proc/self/status` (Linux): `VmRSS` now and `VmHWM`, its high-water mark,
  reset after each reading by writing `5` to `/proc/self/clear_refs`. The
  resident memory counts everything the process holds (Python, libraries,
  the input pipeline's arrays), not only tensors.
"""

import logging
import os
import re
import threading
import weakref
from typing import NamedTuple, Optional

from keras_memguard.probes.base import AllocatorSample
from keras_memguard.probes.base import DeviceMemoryProbe
from keras_memguard.probes.base import log_once
from keras_memguard.probes.base import parse_memory_limit

logger = logging.getLogger("keras_memguard")

LIMIT_SOURCES = ("user", "memory_fraction", "device", "cgroup", "rlimit_as", "unknown")
MODES = ("cuda", "host", "host_sampled", "unavailable")

STATUS_PATH = "/proc/self/status"
CLEAR_REFS_PATH = "/proc/self/clear_refs"

# `/proc/self/status` is one to two KiB; a long `Groups:` line can push the
# `Vm*` lines further, so a reading that misses them reads more.
_STATUS_BYTES = 4096
_STATUS_BYTES_MAX = 65536
# Writing this to clear_refs sets the process's VmHWM to its VmRSS
# (Linux's CLEAR_REFS_MM_HIWATER_RSS; the other values clear page bits).
_RESET_HWM = b"5"
# cgroup v1 writes "no limit" as the largest page-aligned int64.
_CGROUP_V1_UNLIMITED = 1 << 62

_DEVICE_RE = re.compile(
    r"^(?:.*/)?(?:device:)?(cpu|gpu|cuda):?(\d+)?$", re.IGNORECASE
)
# Things already told about in this process: one INFO line each.
_told = set()

# Host readers with open files, reopened in a forked child: an inherited
# descriptor still reads and resets the parent's `/proc/<pid>` files.
_open_readers = weakref.WeakSet()
_fork_hook_lock = threading.Lock()
_fork_hook_registered = False


def _forget_files_in_child():
    for reader in list(_open_readers):
        reader.forget()


def _register_fork_hook():
    global _fork_hook_registered
    with _fork_hook_lock:
        if not _fork_hook_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forget_files_in_child)
        _fork_hook_registered = True


class _Entry(NamedTuple):
    tf_device: str  # "GPU:0": the name the callbacks key limits by
    name: str  # "gpu0": the name in tags and logs
    index: Optional[int]  # the CUDA device index; None for the host
    mode: str
    limit: Optional[int]
    source: str


def normalize_device(device):
    """Returns the short form of a device: `"GPU:0"` or `"CPU:0"`.

    PyTorch's `cuda:i` is `"GPU:i"`, as Keras spells it (`gpu:i`) and as
    the other backends' probes name devices, so tags and `memory_limit`
    keys read the same on every backend.

    Args:
        device: A string such as `"GPU:0"`, `"gpu0"`, `"cuda:1"`, `"cpu"`
            or `"/device:GPU:0"`, or a `torch.device` with an index.

    Returns:
        The short form, or `None` if `device` is not such a device, or is a
        CUDA device without an index (`"cuda"`: torch's current device,
        resolved by the probe).
    """
    kind, index = _parse(device)
    if kind is None or index is None:
        return None
    return f"{kind}:{index}"


def _parse(device):
    """`(kind, index)`: `("GPU", 1)`, `("GPU", None)` for "cuda", `("CPU", 0)`."""
    if not isinstance(device, str):
        # A torch.device: its `type` and `index`, without importing torch.
        kind, index = getattr(device, "type", None), getattr(device, "index", None)
        if not isinstance(kind, str) or not (index is None or isinstance(index, int)):
            return None, None
        device = kind if index is None else f"{kind}:{index}"
    match = _DEVICE_RE.match(device.strip())
    if match is None:
        return None, None
    kind = "CPU" if match.group(1).lower() == "cpu" else "GPU"
    index = match.group(2)
    if index is None:
        return kind, 0 if kind == "CPU" else None
    return kind, int(index)


def _nested(stats, group, key):
    """`stats[group]["all"][key]` as an int, or `None`."""
    try:
        value = stats[group]["all"][key]
    except (KeyError, TypeError):
        return None
    return int(value) if isinstance(value, int) else None


class _HostStatus:
    """The process's `VmRSS` and `VmHWM`, and the reset of `VmHWM`.

    Both files are opened once and kept open: a reading is one `os.pread`,
    a reset one `os.write`.
    """

    def __init__(self, status_path=None, clear_refs_path=None):
        self.status_path = status_path or STATUS_PATH
        self.clear_refs_path = clear_refs_path or CLEAR_REFS_PATH
        self._status = None
        self._clear = None
        self.why_not_readable = None
        self.why_no_reset = None

    def open(self):
        """Opens the files; returns whether the status can be read."""
        try:
            self._status = os.open(self.status_path, os.O_RDONLY)
            self.read()
        except (OSError, ValueError) as error:
            self.close()
            self.why_not_readable = f"{self.status_path} cannot be read ({error})"
            return False
        try:
            self._clear = os.open(self.clear_refs_path, os.O_WRONLY)
            os.write(self._clear, _RESET_HWM)
        except OSError as error:
            if self._clear is not None:
                os.close(self._clear)
                self._clear = None
            self.why_no_reset = f"{self.clear_refs_path} cannot be written ({error})"
        _open_readers.add(self)
        _register_fork_hook()
        return True

    @property
    def resets(self):
        return self._clear is not None

    def read(self):
        """Returns `(rss_bytes, hwm_bytes)`; raises `OSError`/`ValueError`."""
        size = _STATUS_BYTES
        while True:
            data = os.pread(self._status, size, 0)
            hwm = data.find(b"VmHWM:")
            rss = data.find(b"VmRSS:", hwm)
            if hwm >= 0 and rss >= 0 and data.find(b"kB", rss) >= 0:
                break
            if len(data) < size or size >= _STATUS_BYTES_MAX:
                raise ValueError(f"no VmHWM and VmRSS in {self.status_path}")
            size *= 4
        return (
            int(data[rss + 6 : data.index(b"kB", rss)]) * 1024,
            int(data[hwm + 6 : data.index(b"kB", hwm)]) * 1024,
        )

    def reset(self):
        """Sets `VmHWM` to `VmRSS`; raises `OSError`."""
        os.write(self._clear, _RESET_HWM)

    def forget(self):
        """In a forked child: reopen the child's own files."""
        self.close()
        self.open()

    def close(self):
        for attribute in ("_status", "_clear"):
            fd = getattr(self, attribute)
            setattr(self, attribute, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _cgroup_limit_bytes():
    """The smallest memory limit of this process's cgroups, or `None`.

    cgroup v2: `memory.max` of the process's cgroup and of each ancestor;
    cgroup v1: `memory.limit_in_bytes` of its memory cgroup. Read once, at
    setup; `None` where there is none or it cannot be read.
    """
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            base, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            candidate = os.path.join(base, *parts[:depth], name)
            try:
                with open(candidate) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and 0 < int(text) < _CGROUP_V1_UNLIMITED:
                limits.append(int(text))
    return min(limits) if limits else None


def _rlimit_as_bytes():
    """The soft `RLIMIT_AS` of this process, or `None` when unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return int(soft)


class TorchMemoryProbe(DeviceMemoryProbe):
    """Reads memory on Keras' PyTorch backend: bytes in use and the peak.

    Each `sample()` reads every device, then resets its peak, so a sample's
    `peak_bytes` is the highest use since the previous `sample()` or
    `reset()`: the per-batch peak when sampled once per batch. The probe
    never raises while sampling: a value it cannot read is `None`, and a
    problem is said once.

    What is read depends on the device (`device_mode()`):

    - `"cuda"` (`"GPU:i"`): PyTorch's CUDA caching allocator.
      `current_bytes` is the memory held by tensors
      (`allocated_bytes.all.current` of `torch.cuda.memory_stats`),
      `peak_bytes` its peak (`allocated_bytes.all.peak`), reset after each
      reading with `torch.cuda.reset_peak_memory_stats`, which resets all of
      torch's peak statistics of the device: `torch.cuda.max_memory_allocated`
      then counts from the last sample too. The memory the allocator has
      reserved from the device (held tensors plus its cache; what
      `nvidia-smi` sees of the process, less the CUDA context) is
      `reserved_bytes()`.
    - `"host"` (`"CPU:0"`, Linux): the process's resident memory.
      `current_bytes` is `VmRSS`, `peak_bytes` `VmHWM` of
      `/proc/self/status`, reset after each reading by writing `5` to
      `/proc/self/clear_refs`.
    - `"host_sampled"`: as `"host"` where `clear_refs` cannot be written
      (a sandbox that refuses it). `VmHWM` is then the high-water mark since
      the process started: the interval's peak is it when it rose during
      the interval, otherwise the highest resident memory read at the
      interval's start and end, which misses a peak between the two.
    - `"unavailable"`: no reading (no `/proc`, as on macOS and Windows; a
      CUDA device that does not exist): current and peak are `None`.

    `mode` is the least reliable among the devices read: `"unavailable"`,
    then `"host_sampled"`, `"host"`, `"cuda"`.

    The memory limit of each device is, in this order (`limit_source()`):

    1. `"user"`: the `memory_limit` argument.
    2. `"memory_fraction"` (CUDA): the device total times the fraction set
       with `torch.cuda.set_per_process_memory_fraction`, when under 1. The
       allocator applies it to its reserved memory, cache included.
    3. `"device"` (CUDA): the device total (`torch.cuda.mem_get_info`).
       Other processes on the GPU and the CUDA context take part of it.
    4. `"cgroup"` or `"rlimit_as"` (host): the smaller of the memory limit
       of the process's cgroups (shared with every process in them) and its
       `RLIMIT_AS`. `RLIMIT_AS` caps the address space, which runs well
       above the resident memory, so usage against it reads low.
    5. `"unknown"`: the limit and so `usage` are `None`; warned once,
       unless a caller applies its own limit (`limits_given_elsewhere`).

    Devices, modes and limits are resolved on first use (the first call of
    any method or property).

    Args:
        devices: The devices to read: strings such as `"GPU:0"`, `"cuda:1"`
            or `"CPU:0"`, or `torch.device`s; `"cuda"` is torch's current
            CUDA device. Defaults to `None`: the device Keras places tensors
            on, resolved on first use: `KERAS_TORCH_DEVICE` when set, else
            torch's current CUDA device when CUDA is available, else the
            host (`"CPU:0"`). A device Keras uses that is neither CUDA nor
            the CPU (`mps`, `xpu`) is not read; the host's resident memory is.
        memory_limit: Memory limit in bytes: one `int` for every device, or
            a dict mapping device strings to bytes. Defaults to `None`:
            resolved as above.

    Raises:
        ValueError: If `devices` is not a non-empty list of CUDA or CPU
            devices, or `memory_limit` is not a positive number of bytes or
            a dict of them keyed by device strings.

    Example:

    ```python
    probe = TorchMemoryProbe()
    probe.reset()
    model.train_on_batch(x, y)
    (s,) = probe.sample()
    print(s.device, s.current_bytes, s.peak_bytes, s.limit_bytes)
    ```
    """

    _MODE_ORDER = ("unavailable", "host_sampled", "host", "cuda")
    _NAME = "PyTorch memory probe"
    _LIBRARY = "torch"
    _normalize = staticmethod(normalize_device)

    def __init__(self, devices=None, memory_limit=None):
        if devices is not None:
            if isinstance(devices, (str, bytes)) or not isinstance(devices, (list, tuple)):
                devices = [devices]
            requested = []
            for device in devices:
                kind, index = _parse(device)
                if kind is None or (kind == "CPU" and index != 0):
                    raise ValueError(
                        "`devices` must hold CUDA or CPU devices such as "
                        '"GPU:0", "cuda:1", "cuda" or "CPU:0" (the host is '
                        f"one device, CPU:0). Received: devices={devices!r}"
                    )
                if (kind, index) not in requested:
                    requested.append((kind, index))
            if not requested:
                raise ValueError(
                    "`devices` must be a non-empty list of devices such as "
                    f'"GPU:0" or "CPU:0", or None. Received: devices={devices!r}'
                )
            devices = tuple(requested)
        self._requested = devices
        super().__init__(
            *parse_memory_limit(
                memory_limit,
                normalize_device,
                'device strings with an index such as "GPU:0", "cuda:0" or "CPU:0"',
            )
        )
        self._cuda = ()  # entries read from CUDA's allocator
        self._host_entries = ()  # entries read from /proc/self/status
        self._host = None
        self._stats = None
        self._reset_peak = None
        self._reserved = {}
        self._interval_peaks = ()
        # The host's last (rss, hwm), for "host_sampled".
        self._host_last = None

    @property
    def cuda_indices(self):
        """Tuple of the CUDA device index of each device read (`None`: host).

        The index is torch's (`cuda:i`), counted within
        `CUDA_VISIBLE_DEVICES` like TensorFlow's GPU ordinals, so it is the
        ordinal `NvmlProbe(tf_gpu_ordinals=...)` takes.
        """
        self._ensure_ready()
        return tuple(e.index for e in self._entries)

    @property
    def peak_resets(self):
        """Whether every device's peak is reset at each reading.

        `False` where a device is `"host_sampled"` or `"unavailable"`.
        """
        return self.mode in ("cuda", "host")

    def reserved_bytes(self, device):
        """The memory CUDA's caching allocator reserved at the last sample.

        What the allocator holds from the device: the tensors' memory and
        its cache of freed blocks (`reserved_bytes.all.current`).

        Args:
            device: A device string such as `"GPU:0"` or `"gpu0"`.

        Returns:
            An int, or `None` for the host, before the first sample, or
            when it could not be read.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        return self._reserved.get(self._entry(device).tf_device)

    def largest_free_bytes(self, device):
        """Always `None`: PyTorch's statistics do not give the largest free
        block cheaply.

        Args:
            device: A device string such as `"GPU:0"`.

        Raises:
            ValueError: If the probe does not read `device`.
        """
        self._entry(device)
        return None

    def reset(self):
        """Starts a new interval: resets every device's peak to its current use."""
        self._ensure_ready()
        self._reset_cuda()
        if self._host_entries:
            self._host_last = self._read_host()
            self._reset_host()

    def sample(self):
        """Reads every device, then resets its peak.

        Returns:
            A tuple of `AllocatorSample`, one per device in `devices` order,
            with `peak_bytes` the highest use since the previous `sample()`
            or `reset()`. Values that cannot be read are `None`.
        """
        if self._entries is None:
            self._ensure_ready()
        readings = []
        host = None
        if self._host_entries:
            host = self._host_peak()
        stats = self._stats
        for entry in self._entries:
            current = peak = None
            if entry.index is not None:
                source = "torch_cuda"
                if entry.mode == "cuda":
                    try:
                        values = stats(entry.index)
                    except Exception as e:  # A probe never stops training.
                        self._log_failure("memory_stats_as_nested_dict", entry, e)
                        values = None
                    current = _nested(values, "allocated_bytes", "current")
                    peak = _nested(values, "allocated_bytes", "peak")
                    self._reserved[entry.tf_device] = _nested(
                        values, "reserved_bytes", "current"
                    )
            else:
                source = "host_rss"
                if host is not None:
                    current, peak = host
            readings.append(
                AllocatorSample(entry.name, entry.tf_device, current, peak, entry.limit, source)
            )
        # Every device is read before any is reset.
        self._reset_cuda()
        if host is not None and self._host.resets:
            self._reset_host()
        samples = tuple(readings)
        self._interval_peaks = tuple(s.peak_bytes for s in samples)
        return samples

    def interval_peaks(self):
        """Each device's peak over the last sampling interval, or `None`.

        The probe resets its peaks at every reading, so these are the last
        samples' `peak_bytes`; kept for callers written for probes that
        cannot reset them (`JaxMemoryProbe.interval_peaks`).

        Returns:
            A tuple of ints or `None`, in `devices` order.
        """
        return self._interval_peaks

    def close(self):
        """Closes the host's files; a probe used afterwards reads nothing."""
        if self._host is not None:
            self._host.close()

    def _host_peak(self):
        """`(current, interval peak)` of the host, or `None`."""
        reading = self._read_host()
        if reading is None:
            return None
        rss, hwm = reading
        if self._host.resets:
            return rss, max(rss, hwm)
        # host_sampled: VmHWM counts from the process's start.
        last = self._host_last
        self._host_last = reading
        peak = rss
        if last is not None:
            last_rss, last_hwm = last
            peak = max(peak, last_rss)
            if hwm > last_hwm:
                peak = max(peak, hwm)
        return rss, peak

    def _read_host(self):
        try:
            return self._host.read()
        except (OSError, ValueError, TypeError) as e:  # Never stop training.
            self._log_failure("read", self._host_entries[0], e, self._host.status_path)
            return None

    def _reset_host(self):
        if not self._host.resets:
            return
        try:
            self._host.reset()
        except OSError as e:  # A probe never stops training.
            self._log_failure("reset", self._host_entries[0], e, self._host.clear_refs_path)

    def _reset_cuda(self):
        reset = self._reset_peak
        for entry in self._cuda:
            try:
                reset(entry.index)
            except Exception as e:  # A probe never stops training.
                self._log_failure("reset_peak_memory_stats", entry, e)

    def _log_failure(self, what, entry, error, where=None):
        if where is None:
            where = f"torch.cuda.{what}({entry.index})"
        self._log_failure_once(
            (what, entry.tf_device), error, "%s failed for %s", where, entry.tf_device
        )

    def _default_device(self, torch):
        """`(kind, index)` of the device Keras places tensors on."""
        chosen = os.environ.get("KERAS_TORCH_DEVICE")
        if chosen:
            kind, index = _parse(chosen)
            if kind is None:
                log_once(
                    _told,
                    ("other", chosen),
                    "KERAS_TORCH_DEVICE=%s: the memory of that device is not "
                    "read; the host's resident memory is (CPU:0).",
                    chosen,
                )
                return ("CPU", 0)
            return kind, index
        if torch.cuda.is_available():
            return ("GPU", None)
        return ("CPU", 0)

    def _setup(self):
        """Resolves devices, modes and limits, once."""
        import torch

        cuda = torch.cuda
        requested = self._requested or (self._default_device(torch),)
        entries = {}
        missing = []
        for kind, index in requested:
            if kind == "GPU":
                available = cuda.is_available()
                count = cuda.device_count() if available else 0
                if index is None:
                    index = cuda.current_device() if available else 0
                tf_device = f"GPU:{index}"
                if tf_device in entries:
                    continue
                if index >= count:
                    missing.append(tf_device)
                    mode, limit, source = "unavailable", None, "unknown"
                    if self._user_limit(tf_device) is not None:
                        limit, source = self._user_limit(tf_device), "user"
                else:
                    mode = "cuda"
                    limit, source = self._cuda_limit(cuda, tf_device, index)
                entry = _Entry(tf_device, f"gpu{index}", index, mode, limit, source)
            else:
                tf_device = "CPU:0"
                if tf_device in entries:
                    continue
                self._host = _HostStatus()
                if not self._host.open():
                    mode = "unavailable"
                elif self._host.resets:
                    mode = "host"
                else:
                    mode = "host_sampled"
                if self._user_limit(tf_device) is not None:
                    limit, source = self._user_limit(tf_device), "user"
                else:
                    limit, source = self._host_limit()
                entry = _Entry(tf_device, "cpu0", None, mode, limit, source)
            entries[tf_device] = entry
        entries = tuple(entries.values())
        self._warn_stray_limits([e.tf_device for e in entries])
        if any(e.mode == "cuda" for e in entries):
            self._stats = cuda.memory_stats_as_nested_dict
            self._reset_peak = cuda.reset_peak_memory_stats
        self._explain(entries, missing)
        return entries

    def _index_entries(self, entries):
        self._cuda = tuple(e for e in entries if e.mode == "cuda")
        self._host_entries = tuple(
            e for e in entries if e.index is None and e.mode != "unavailable"
        )

    def _cuda_limit(self, cuda, tf_device, index):
        user = self._user_limit(tf_device)
        if user is not None:
            return user, "user"
        try:
            _, total = cuda.mem_get_info(index)
            total = int(total)
        except Exception as e:  # The limit is then unknown, and said so.
            logger.warning(
                "torch.cuda.mem_get_info(%d) failed for %s: %s. Its memory "
                "limit is unknown.", index, tf_device, e,
            )
            return None, "unknown"
        fraction = None
        getter = getattr(cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            try:
                fraction = float(getter(index))
            except Exception:  # Older torch, or none set: the total holds.
                fraction = None
        if fraction is not None and 0.0 < fraction < 1.0:
            return int(total * fraction), "memory_fraction"
        return total, "device"

    def _host_limit(self):
        cgroup = _cgroup_limit_bytes()
        rlimit = _rlimit_as_bytes()
        if cgroup is not None and (rlimit is None or cgroup <= rlimit):
            return cgroup, "cgroup"
        if rlimit is not None:
            return rlimit, "rlimit_as"
        return None, "unknown"

    def _explain(self, entries, missing):
        if missing:
            self._messages.append(
                f"PyTorch has no CUDA device {', '.join(missing)}: its readings "
                "are None. HINT: read one of the devices torch.cuda lists "
                "(torch.cuda.device_count()) or pass devices=['CPU:0']."
            )
        host = self._host
        for entry in entries:
            if entry.mode == "unavailable" and entry.index is None:
                log_once(
                    _told,
                    ("unavailable", host.why_not_readable),
                    "CPU:0: the process's resident memory cannot be read: %s. "
                    "Its readings are None.",
                    host.why_not_readable,
                )
            elif entry.mode == "host_sampled":
                log_once(
                    _told,
                    ("sampled", host.why_no_reset),
                    "CPU:0: the peak of resident memory cannot be reset: %s. "
                    "A sample's peak is VmHWM when it rose since the previous "
                    "sample, otherwise the higher of the two readings.",
                    host.why_no_reset,
                )
        self._warn_unknown_limits(entries)
