"""Reads NVIDIA GPU memory and utilization through NVML."""

import importlib
import logging
import numbers
import os

from keras_memguard.probes.base import NvmlSample
from keras_memguard.probes.base import warn_at_user_code

logger = logging.getLogger("keras_memguard")

_INSTALL_HINT = (
    "HINT: install the NVML bindings with `pip install nvidia-ml-py` "
    "(the module is named `pynvml`)."
)
_DRIVER_HINT = (
    "HINT: NVML ships with the NVIDIA driver; check that `nvidia-smi` works "
    "in this environment (in a container, start it with GPU access, e.g. "
    "`docker run --gpus all`). Without an NVIDIA GPU this is expected and "
    "only the backend's own memory readings (TensorFlow's allocator, JAX's "
    "device statistics) are watched."
)


class NvmlProbe:
    """Reads memory and utilization of NVIDIA GPUs through NVML.

    In the spirit of nvitop's device API: `pynvml` (from the
    `nvidia-ml-py` package) is imported and `nvmlInit` called lazily, once,
    on first use; a value NVML cannot give is `None`; the probe never raises
    while sampling. When `pynvml` is missing, NVML cannot start (no driver)
    or no GPU is visible, `available` is `False`, `sample()` returns `()`,
    and one message says what to do: a warning when TensorFlow sees a GPU,
    an INFO log through the `keras_memguard` logger when it sees none (a
    machine without an NVIDIA GPU, where NVML is not expected).

    TensorFlow GPU ordinals (`GPU:i`) are mapped to NVML indices through
    `CUDA_VISIBLE_DEVICES`, read when NVML starts: a comma-separated list of
    integers, GPU UUIDs (`GPU-...`, a unique prefix is enough) or MIG device
    UUIDs (`MIG-...`). As in CUDA, the list ends at the first entry that is
    invalid, out of range or repeated, so an empty value or `-1` means no
    GPU; unset means every GPU in NVML order. Integer entries are NVML
    indices only when CUDA enumerates GPUs in PCI bus order: set
    `CUDA_DEVICE_ORDER=PCI_BUS_ID` on machines with mixed GPU models.
    The ordinals here are TensorFlow's *physical* GPU ordinals (the CUDA
    ordinals), before `tf.config.set_visible_devices` or virtual devices.
    On Keras' JAX and PyTorch backends they are the CUDA ordinals too: a
    torch device `cuda:i` is ordinal `i`.

    With TensorFlow's default pre-allocation, NVML's `used_bytes` and
    `process_bytes` sit near 100% of the device whatever the model needs:
    TensorFlow reserves the memory up front and manages it itself. Decide
    from the allocator numbers (`AllocatorProbe`); NVML readings are for
    context (other processes, utilization, the device total). `used_bytes`
    is what `nvidia-smi` shows as used: where the driver has NVML's memory
    info version 2, the memory the driver reserves for itself is left out.

    Each NVML query is a call into the driver (listing processes is the
    slowest), so sample NVML less often than every batch on busy multi-GPU
    hosts.

    Args:
        tf_gpu_ordinals: TensorFlow physical GPU ordinals to read, e.g.
            `[0, 1]` for `GPU:0` and `GPU:1`. Ordinals without a visible GPU
            are skipped with a warning. Defaults to `None`, every GPU
            visible under `CUDA_VISIBLE_DEVICES`.

    Raises:
        ValueError: If `tf_gpu_ordinals` is not a list of non-negative
            integers.

    Example:

    ```python
    probe = NvmlProbe()
    if probe.available:
        for s in probe.sample():
            print(s.device, s.used_bytes, s.total_bytes)
    ```
    """

    def __init__(self, tf_gpu_ordinals=None):
        if tf_gpu_ordinals is not None:
            if isinstance(tf_gpu_ordinals, (str, bytes)) or not _is_iterable(
                tf_gpu_ordinals
            ):
                raise ValueError(
                    "`tf_gpu_ordinals` must be a list of non-negative "
                    "integers or None. "
                    f"Received: tf_gpu_ordinals={tf_gpu_ordinals!r}"
                )
            tf_gpu_ordinals = tuple(tf_gpu_ordinals)
            for ordinal in tf_gpu_ordinals:
                if (
                    isinstance(ordinal, bool)
                    or not isinstance(ordinal, numbers.Integral)
                    or ordinal < 0
                ):
                    raise ValueError(
                        "`tf_gpu_ordinals` must be a list of non-negative "
                        "integers or None. "
                        f"Received: tf_gpu_ordinals={tf_gpu_ordinals!r}"
                    )
            tf_gpu_ordinals = tuple(dict.fromkeys(int(o) for o in tf_gpu_ordinals))
        self._requested = tf_gpu_ordinals
        self._started = False
        self._pynvml = None
        # Whether to ask for memory info version 2 (see `_memory_info`).
        self._memory_v2 = False
        # (tf_ordinal, device name, nvml_index, handle) per GPU read.
        self._targets = ()
        self._by_ordinal = {}
        self._message = None
        # NVML missing where TensorFlow sees no GPU either is expected: the
        # message is then logged at INFO instead of warned.
        self._quiet = False
        self._warned = False
        self._logged = set()

    @property
    def available(self):
        """Whether NVML started and at least one requested GPU is mapped."""
        if not self._started:
            self._start()
        self._warn_once()
        return bool(self._targets)

    @property
    def nvml_indices(self):
        """Dict mapping each TensorFlow GPU ordinal read to its NVML index."""
        if not self._started:
            self._start()
        self._warn_once()
        return {ordinal: index for ordinal, _, index, _ in self._targets}

    @property
    def message(self):
        """Why NVML reads no GPU, or skips some, in words; `None` when all is well.

        Set once NVML was started (by `start` or the first reading).
        """
        return self._message

    def start(self, warn=True):
        """Starts NVML and maps the GPUs now, once.

        Args:
            warn: Whether `message` is still warned about (or logged) at the
                first use. `False` for a caller that folds `message` into a
                warning of its own. Defaults to `True`.
        """
        if not self._started:
            self._start()
        if not warn:
            self._warned = True

    def sample(self):
        """Reads every mapped GPU once.

        Returns:
            A tuple of `NvmlSample`, one per mapped GPU in TensorFlow ordinal
            order; `()` when NVML is not available. A query that fails gives
            `None` for its values and is logged once per GPU and query.
        """
        if not self._started:
            self._start()
        if not self._warned and self._message:
            self._warn_once()
        if not self._targets:
            return ()
        pid = os.getpid()
        return tuple(
            self._read(name, index, handle, pid)
            for _, name, index, handle in self._targets
        )

    def total_bytes(self, tf_ordinal):
        """Returns the total memory of one GPU in bytes.

        Args:
            tf_ordinal: TensorFlow physical GPU ordinal (`0` for `GPU:0`).

        Returns:
            The device total as an `int`, or `None` when NVML is not
            available, the ordinal maps to no GPU or the query fails.
        """
        if not self._started:
            self._start()
        self._warn_once()
        target = self._by_ordinal.get(tf_ordinal)
        if target is None:
            return None
        _, name, index, handle = target
        memory = self._query(
            "nvmlDeviceGetMemoryInfo", name, index, handle, "memory info"
        )
        return None if memory is None else int(memory.total)

    def close(self):
        """Shuts NVML down if this probe started it. Safe to call twice."""
        pynvml = self._pynvml
        self._pynvml = None
        self._targets = ()
        self._by_ordinal = {}
        if pynvml is not None:
            try:
                pynvml.nvmlShutdown()
            except Exception:  # Shutting down must never fail the caller.
                pass

    def _warn_once(self):
        # Called directly by the public methods, so stacklevel=3 names their
        # caller (or, inside `fit`, the user's line that called `fit`).
        if self._message and not self._warned:
            self._warned = True
            if self._quiet:
                logger.info("%s", self._message)
            else:
                warn_at_user_code(self._message, stacklevel=3)

    def _start(self):
        """Imports pynvml, starts NVML and maps GPUs, once."""
        self._started = True
        try:
            pynvml = importlib.import_module("pynvml")
        except ImportError as e:
            self._message = (
                f"NVML is not available: `pynvml` cannot be imported ({e}). "
                f"GPU readings from NVML are skipped. {_INSTALL_HINT}"
            )
            self._quiet = not _backend_sees_gpu()
            return
        try:
            pynvml.nvmlInit()
        except Exception as e:
            self._message = (
                f"NVML is not available: nvmlInit() failed ({e}). "
                f"GPU readings from NVML are skipped. {_DRIVER_HINT}"
            )
            self._quiet = not _backend_sees_gpu()
            return
        self._pynvml = pynvml
        self._memory_v2 = hasattr(pynvml, "nvmlMemory_v2")
        cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            visible = _visible_gpus(pynvml, cuda_visible)
        except Exception as e:
            visible = []
            self._message = (
                f"NVML started but listing GPUs failed ({e}). GPU readings "
                f"from NVML are skipped. {_DRIVER_HINT}"
            )
        ordinals = self._requested
        if ordinals is None:
            ordinals = range(len(visible))
        targets = []
        missing = []
        for ordinal in ordinals:
            if ordinal < len(visible):
                index, handle = visible[ordinal]
                targets.append((ordinal, f"gpu{ordinal}", index, handle))
            else:
                missing.append(ordinal)
        self._targets = tuple(targets)
        self._by_ordinal = {t[0]: t for t in targets}
        if self._message is None and not visible:
            self._quiet = not _backend_sees_gpu()
            self._message = (
                "NVML found no visible GPU "
                f"(CUDA_VISIBLE_DEVICES={cuda_visible!r}). GPU readings from "
                "NVML are skipped. HINT: unset CUDA_VISIBLE_DEVICES or list "
                "the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1."
            )
        elif missing:
            self._message = (
                f"No visible GPU for TensorFlow GPU ordinal(s) {missing} "
                f"({len(visible)} visible, "
                f"CUDA_VISIBLE_DEVICES={cuda_visible!r}); they are skipped. "
                "HINT: pass ordinals in range(number of visible GPUs) as "
                "`tf_gpu_ordinals`."
            )

    def _query(self, function, name, index, handle, what):
        try:
            return getattr(self._pynvml, function)(handle)
        except Exception as e:
            key = (index, what)
            if key not in self._logged:
                self._logged.add(key)
                logger.warning(
                    "NVML could not read %s of %s (NVML index %d): %s. The "
                    "value is reported as None; this message is shown once "
                    "per GPU and query. HINT: run `nvidia-smi -i %d` to check "
                    "the GPU; values stay None until the query succeeds.",
                    what,
                    name,
                    index,
                    e,
                    index,
                )
            return None

    def _memory_info(self, name, index, handle):
        """`nvmlDeviceGetMemoryInfo`, version 2 where the driver has it.

        Version 1 counts the memory the driver reserves for itself as used;
        version 2 leaves it out, as `nvidia-smi` does. An older driver or
        binding gives version 1.
        """
        if self._memory_v2:
            try:
                return self._pynvml.nvmlDeviceGetMemoryInfo(
                    handle, version=self._pynvml.nvmlMemory_v2
                )
            except Exception:  # no version 2 here: version 1 from now on
                self._memory_v2 = False
        return self._query("nvmlDeviceGetMemoryInfo", name, index, handle, "memory info")

    def _read(self, name, index, handle, pid):
        memory = self._memory_info(name, index, handle)
        if memory is None:
            total = used = free = None
        else:
            total, used, free = int(memory.total), int(memory.used), int(memory.free)
        processes = self._query(
            "nvmlDeviceGetComputeRunningProcesses",
            name,
            index,
            handle,
            "running processes",
        )
        process_bytes = None
        if processes is not None:
            mine = [p.usedGpuMemory for p in processes if p.pid == pid]
            # No entry for this pid usually means a PID namespace (container)
            # hides it, not zero bytes; None (NVML's "not available") taints.
            if mine and all(m is not None for m in mine):
                process_bytes = int(sum(mine))
        rates = self._query(
            "nvmlDeviceGetUtilizationRates", name, index, handle, "utilization"
        )
        utilization = None if rates is None else int(rates.gpu)
        return NvmlSample(
            device=name,
            nvml_index=index,
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            process_bytes=process_bytes,
            gpu_utilization_percent=utilization,
        )


def _backend_sees_gpu():
    """Whether Keras' backend lists a GPU (`False` when it cannot tell).

    Only asked when NVML is missing, so the cost (importing TensorFlow on
    the TensorFlow backend) is paid only then.
    """
    try:
        from keras_memguard import backends

        return bool(backends.current().sees_gpu())
    except Exception:  # No such backend, or it cannot list devices.
        return False


def _is_iterable(value):
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _as_str(value):
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_gpus(pynvml, cuda_visible_devices):
    """Lists `(nvml_index, handle)` in CUDA ordinal order.

    Follows CUDA's reading of `CUDA_VISIBLE_DEVICES`: the list ends at the
    first invalid, out-of-range or repeated entry.
    """
    count = pynvml.nvmlDeviceGetCount()
    if cuda_visible_devices is None:
        return [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    visible = []
    seen = set()
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            break
        if token.lstrip("+-").isdigit():
            index = int(token)
            if not 0 <= index < count:
                break
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            key = index
        elif token.upper().startswith(("GPU-", "MIG-")):
            handle = _handle_by_uuid(pynvml, token, count)
            if handle is None:
                break
            if token.upper().startswith("MIG-"):
                parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
                index = int(pynvml.nvmlDeviceGetIndex(parent))
                key = _as_str(pynvml.nvmlDeviceGetUUID(handle))
            else:
                index = int(pynvml.nvmlDeviceGetIndex(handle))
                key = index
        else:
            break
        if key in seen:
            break
        seen.add(key)
        visible.append((index, handle))
    return visible


def _handle_by_uuid(pynvml, token, count):
    """Finds a GPU or MIG handle by full UUID, or a GPU by unique prefix."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(token)
    except Exception:  # Not a full UUID: CUDA also accepts a unique prefix.
        pass
    if token.upper().startswith("MIG-"):
        return None
    matches = []
    for i in range(count):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        if _as_str(pynvml.nvmlDeviceGetUUID(handle)).lower().startswith(
            token.lower()
        ):
            matches.append(handle)
    return matches[0] if len(matches) == 1 else None
