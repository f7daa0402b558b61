"""configure_devices: TensorFlow's GPU memory settings, in one call.

TensorFlow takes three settings that decide how a GPU's memory is used:
memory growth (`tf.config.experimental.set_memory_growth`), a memory limit
(`tf.config.set_logical_device_configuration` with a
`LogicalDeviceConfiguration(memory_limit=...)`, in MiB) and the allocator
(the `TF_GPU_ALLOCATOR` environment variable). All three must be chosen
before TensorFlow initializes its devices, which the first op, tensor,
Keras model or dataset does; afterwards TensorFlow raises a bare
`RuntimeError`. `configure_devices` applies them with the package's units
(bytes) and errors that say what to do.

The memory limit is kept where `AllocatorProbe` (and so `MemoryMonitor` and
`MemoryGuard`) already looks for one: the logical device configuration of
each GPU. `configured_memory_limits()` returns what was set.
"""

import contextlib
import logging
import numbers
import os
import warnings

from keras_memguard.errors import DevicesAlreadyInitializedError
from keras_memguard.probes.base import MIB
from keras_memguard.backends.tensorflow.probe import logical_device_limits
from keras_memguard.probes.base import normalize_device

logger = logging.getLogger("keras_memguard")

ALLOCATOR_ENV = "TF_GPU_ALLOCATOR"
# The allocators `allocator=` accepts: "bfc" is TensorFlow's default (the
# variable unset), "cuda_malloc_async" CUDA's stream-ordered allocator.
ALLOCATORS = ("bfc", "cuda_malloc_async")

_HINT = (
    "HINT: call keras_memguard.configure_devices(...) first in the program, "
    "before any TensorFlow op runs and before any Keras model, layer, "
    "tensor or dataset is created (in a notebook: restart the kernel)."
)
_CPU_HINT = (
    "TensorFlow cannot limit CPU memory through a logical device. HINT: to "
    "cap the CPU allocator, set TF_CPU_ALLOCATOR_USE_BFC=true, "
    "TF_CPU_BFC_MEM_LIMIT_IN_MB=<MiB> and TF_ENABLE_ONEDNN_OPTS=0 in the "
    "environment before TensorFlow is imported "
    "(keras_memguard.testing.memory_cap_env(mib) returns them); "
    "MemoryGuard reads that cap."
)

# Logical device -> bytes, for the limits configure_devices set.
_configured = {}


def configure_devices(memory_growth=None, memory_limit=None, allocator=None):
    """Sets TensorFlow's GPU memory growth, memory limit and allocator.

    Call it first in the program, before TensorFlow initializes its devices
    (the first op, tensor, Keras model or dataset does). Arguments left at
    `None` are not touched. Each GPU that TensorFlow sees
    (`tf.config.get_visible_devices("GPU")`) gets the setting.

    `memory_limit` is in **bytes**, like the `memory_limit` of
    `MemoryMonitor`, `MemoryGuard` and `AllocatorProbe`. TensorFlow takes
    whole MiB, so it is rounded down to a multiple of 1 MiB. Each limited
    GPU becomes one logical device with that much memory: TensorFlow then
    allocates no more than that on it (the rest stays free for other
    processes), and `MemoryGuard` divides by it (its limit source
    `"logical_device"`), so nothing else needs the number again.

    On a machine where TensorFlow sees no GPU, `memory_growth` and
    `allocator` have nothing to act on (one INFO line on the
    `keras_memguard` logger; the `TF_GPU_ALLOCATOR` variable is still set),
    and `memory_limit` is not applied, with a warning: TensorFlow cannot
    limit CPU memory through a logical device. To cap the CPU allocator, set
    `TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` before
    TensorFlow is imported (see `keras_memguard.testing.memory_cap_env`).

    A setting that is already in force is accepted at any time (running the
    same call twice is fine); changing one after TensorFlow initialized its
    devices raises `DevicesAlreadyInitializedError`.

    Args:
        memory_growth: `True` to let TensorFlow allocate GPU memory as
            needed instead of reserving nearly all of it at start-up (so
            NVML and `nvidia-smi` show what the process uses), `False` for
            TensorFlow's default, `None` to leave it. Cannot be combined
            with `memory_limit`: TensorFlow refuses memory growth on a GPU
            with a logical device configuration. Defaults to `None`.
        memory_limit: GPU memory limit in bytes, at least 1 MiB: an int for
            every GPU, or a dict from GPU device strings to bytes such as
            `{"GPU:0": 8 * 2**30}` (GPUs not named are left as they are).
            `None` leaves the limits. Defaults to `None`.
        allocator: `"cuda_malloc_async"` to set `TF_GPU_ALLOCATOR` to CUDA's
            stream-ordered allocator (less fragmentation on CUDA 11.2 and
            newer), `"bfc"` for TensorFlow's default (the variable removed),
            `None` to leave it. Defaults to `None`.

    Returns:
        The memory limits `configure_devices` has set so far, as
        `configured_memory_limits()` returns them: a dict from logical
        device string (`"GPU:0"`) to bytes.

    Raises:
        ValueError: If an argument is out of range, or names a GPU that
            TensorFlow does not see. The message names the argument and
            echoes the value.
        DevicesAlreadyInitializedError: If TensorFlow has already
            initialized its devices and a setting would change. Nothing is
            changed then.

    Example:

    ```python
    import keras_memguard

    # First thing in the program, before any model or tensor:
    keras_memguard.configure_devices(memory_limit=8 * 2**30)  # 8 GiB per GPU
    # or: configure_devices(memory_growth=True, allocator="cuda_malloc_async")

    model = make_model()
    model.fit(x, y, callbacks=[keras_memguard.MemoryGuard()])  # reads 8 GiB
    ```
    """
    growth = _check_growth(memory_growth)
    limit_all, limits = _check_limit(memory_limit)
    allocator = _check_allocator(allocator)
    if growth and (limit_all is not None or limits):
        raise ValueError(
            "`memory_growth=True` cannot be combined with `memory_limit`: "
            "TensorFlow refuses memory growth on a GPU with a logical device "
            "configuration (a memory limit). Pass one of them. Received: "
            f"memory_growth={memory_growth!r}, memory_limit={memory_limit!r}"
        )
    if growth is None and limit_all is None and not limits and allocator is None:
        return configured_memory_limits()

    import tensorflow as tf

    gpus = list(tf.config.get_visible_devices("GPU"))
    by_name = {}
    for index, gpu in enumerate(gpus):
        by_name[f"GPU:{index}"] = gpu
    if gpus and limits:
        unknown = sorted(set(limits) - set(by_name))
        if unknown:
            raise ValueError(
                f"`memory_limit` names GPUs TensorFlow does not see: {unknown}. "
                f"Visible GPUs: {sorted(by_name)}. "
                f"Received: memory_limit={memory_limit!r}"
            )

    if allocator is not None:
        _set_allocator(allocator, gpus)
    if not gpus:
        _without_gpu(growth, memory_limit, limit_all, limits)
        return configured_memory_limits()

    wanted = {}  # GPU index -> MiB
    for index in range(len(gpus)):
        name = f"GPU:{index}"
        value = limit_all if limit_all is not None else limits.get(name)
        if value is not None:
            wanted[index] = value // MIB

    for index, mib in wanted.items():
        config = [tf.config.LogicalDeviceConfiguration(memory_limit=mib)]
        with _before_initialization(f"memory_limit={memory_limit!r}"):
            tf.config.set_logical_device_configuration(gpus[index], config)
    if growth is not None:
        for index, gpu in enumerate(gpus):
            if index in wanted:
                continue  # Growth is off on a GPU with a memory limit.
            with _before_initialization(f"memory_growth={memory_growth!r}"):
                tf.config.experimental.set_memory_growth(gpu, growth)

    if wanted:
        # Read back as AllocatorProbe reads it, so the two agree.
        configurations = [
            (gpu.name, tf.config.get_logical_device_configuration(gpu))
            for gpu in gpus
        ]
        for logical, (ordinal, limit) in logical_device_limits(
            configurations
        ).items():
            physical = _physical_index(gpus, ordinal)
            if physical in wanted and limit is not None:
                _configured[logical] = limit
    return configured_memory_limits()


def configured_memory_limits():
    """Returns the GPU memory limits `configure_devices` has set.

    The same numbers `AllocatorProbe` reads from TensorFlow's logical device
    configuration (its limit source `"logical_device"`), so `MemoryGuard`
    divides by them.

    Returns:
        A dict from logical device string (`"GPU:0"`) to the limit in bytes
        (a multiple of 1 MiB); empty when `configure_devices` set none.

    Example:

    ```python
    keras_memguard.configure_devices(memory_limit={"GPU:0": 6 * 2**30})
    keras_memguard.configured_memory_limits()  # {"GPU:0": 6442450944}
    ```
    """
    return dict(_configured)


def _physical_index(gpus, ordinal):
    """The position in `gpus` of the physical GPU with `ordinal`."""
    for index, gpu in enumerate(gpus):
        short = normalize_device(gpu.name.replace("physical_device:", ""))
        if short == f"GPU:{ordinal}":
            return index
    return None


def _check_growth(memory_growth):
    if memory_growth is not None and not isinstance(memory_growth, bool):
        raise ValueError(
            "`memory_growth` must be True, False or None. "
            f"Received: memory_growth={memory_growth!r}"
        )
    return memory_growth


def _check_bytes(value, label, memory_limit):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (
            isinstance(value, numbers.Integral)
            or (isinstance(value, float) and value.is_integer())
        )
    ):
        raise ValueError(
            f"`{label}` must be a number of bytes (an int), a dict from GPU "
            "device strings to one, or None. "
            f"Received: memory_limit={memory_limit!r}"
        )
    if value < MIB:
        raise ValueError(
            f"`{label}` must be at least 1 MiB ({MIB} bytes): it is in bytes, "
            "not MiB. HINT: for 8 GiB pass 8 * 2**30. "
            f"Received: memory_limit={memory_limit!r}"
        )
    return int(value)


def _check_limit(memory_limit):
    """Returns `(bytes_for_every_gpu, {"GPU:i": bytes})`."""
    if memory_limit is None:
        return None, {}
    if not isinstance(memory_limit, dict):
        return _check_bytes(memory_limit, "memory_limit", memory_limit), {}
    if not memory_limit:
        raise ValueError(
            "`memory_limit` must not be an empty dict: name at least one GPU, "
            'such as {"GPU:0": 8 * 2**30}, or pass None. '
            f"Received: memory_limit={memory_limit!r}"
        )
    limits = {}
    for key, value in memory_limit.items():
        short = normalize_device(key)
        if short is None:
            raise ValueError(
                '`memory_limit` keys must be GPU device strings such as "GPU:0". '
                f"Received: memory_limit={memory_limit!r}"
            )
        if short.startswith("CPU:"):
            raise ValueError(
                f"`memory_limit` applies to GPUs only; it names {key!r}. "
                f"{_CPU_HINT} Received: memory_limit={memory_limit!r}"
            )
        if short in limits:
            raise ValueError(
                f"`memory_limit` names {short} twice. "
                f"Received: memory_limit={memory_limit!r}"
            )
        limits[short] = _check_bytes(value, f"memory_limit[{key!r}]", memory_limit)
    return None, limits


def _check_allocator(allocator):
    if allocator is not None and allocator not in ALLOCATORS:
        raise ValueError(
            f"`allocator` must be one of {', '.join(map(repr, ALLOCATORS))} or "
            f"None. Received: allocator={allocator!r}"
        )
    return allocator


@contextlib.contextmanager
def _before_initialization(setting):
    """Turns TensorFlow's "cannot be modified" RuntimeError into ours."""
    try:
        yield
    except RuntimeError as error:
        if "initializ" not in str(error):
            raise
        raise DevicesAlreadyInitializedError(
            f"configure_devices cannot apply {setting}: TensorFlow has already "
            f"initialized its devices ({type(error).__name__}: {error}). "
            f"{_HINT}"
        ) from error


def _tensorflow_initialized():
    """Whether TensorFlow has initialized its devices; `None` if unknown."""
    from keras_memguard.backends import compat

    return compat.tensorflow_initialized()


def _set_allocator(allocator, gpus):
    value = None if allocator == "bfc" else allocator
    current = os.environ.get(ALLOCATOR_ENV) or None
    if current == value:
        return
    if gpus and _tensorflow_initialized():
        raise DevicesAlreadyInitializedError(
            f"configure_devices cannot apply allocator={allocator!r}: TensorFlow "
            f"has already initialized its GPUs, and reads {ALLOCATOR_ENV} only "
            f"then (it is {current!r} now). {_HINT}"
        )
    if value is None:
        os.environ.pop(ALLOCATOR_ENV, None)
    else:
        os.environ[ALLOCATOR_ENV] = value
    if not gpus:
        logger.info(
            "configure_devices: TensorFlow sees no GPU; %s=%s is set but only "
            "GPUs use it.",
            ALLOCATOR_ENV,
            value,
        )


def _without_gpu(growth, memory_limit, limit_all, limits):
    if growth is not None:
        logger.info(
            "configure_devices: TensorFlow sees no GPU; memory_growth=%r has "
            "nothing to act on.",
            growth,
        )
    if limit_all is not None or limits:
        warnings.warn(
            "configure_devices: TensorFlow sees no GPU, so "
            f"memory_limit={memory_limit!r} is not applied. {_CPU_HINT}",
            stacklevel=3,
        )
