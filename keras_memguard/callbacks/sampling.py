"""One allocator reading per training batch, shared by every callback.

`MemoryMonitor` and `MemoryGuard` on the same model must not read (and so
reset) the allocator twice in one batch: the second reader would see an
empty interval. `shared_reader(model)` gives both the same reader; it reads
the probe once per batch and keeps, for each consumer, the highest peak seen
since that consumer's previous read, so a consumer that reads every N
batches still gets the true peak of its whole interval.

Under a `tf.distribute` strategy the reader's probe reads every replica's
device (`strategy.extended.worker_devices`), so the callbacks see, log and
decide on all of them. Logical devices that share one physical allocator
(several logical CPUs on one host) all report that allocator's numbers.

The probe is the backend's: TensorFlow's allocator (`AllocatorProbe`),
`jax.Device.memory_stats()` (`JaxMemoryProbe`) on Keras' JAX backend, or
PyTorch's CUDA allocator or the host's resident memory (`TorchMemoryProbe`)
on its PyTorch backend; all give the same samples.
"""

import weakref

from keras_memguard import backends
from keras_memguard.probes.base import normalize_device


def backend_probe(devices=None, memory_limit=None):
    """A memory probe for the Keras backend in use.

    Args:
        devices: The devices to read, or `None` for the probe's default.
        memory_limit: As the probe takes it, or `None`.

    Returns:
        The backend's probe (`keras_memguard.backends.current().make_probe`):
        an `AllocatorProbe` on TensorFlow, a `JaxMemoryProbe` on JAX, a
        `TorchMemoryProbe` on PyTorch.
    """
    return backends.current().make_probe(devices=devices, memory_limit=memory_limit)


_readers = weakref.WeakKeyDictionary()


class _Consumer:
    """A consumer's bookkeeping: the peaks it missed, and what it has seen."""

    __slots__ = ("seen", "missed", "__weakref__")

    def __init__(self, seen):
        # The number of the last reading this consumer was given, or of
        # the last reset.
        self.seen = seen
        # Highest peak per device over readings taken since and not given
        # to this consumer (another consumer's reads), or None.
        self.missed = None


class SharedAllocatorReader:
    """Reads an `AllocatorProbe` once per batch on behalf of several consumers.

    The probe is made on first use of `probe`. Each consumer applies its
    own `memory_limit` (see `resolve_limits`); when every consumer has one,
    the probe is told so and does not warn that no limit is known.

    Consumers that read every batch with the batch's key cost one probe
    reading and a few comparisons per batch; only a consumer that skipped a
    reading another took gets new samples with the peaks folded in.

    Args:
        probe: The `AllocatorProbe` to read, or `None` to make one for
            `devices` on first use. Defaults to `None`.
        devices: The devices the probe reads when the reader makes it
            (`None`: the probe's default). Defaults to `None`.
    """

    def __init__(self, probe=None, devices=None):
        self._probe = probe
        self._own_probe = probe is None
        # The devices `shared_reader` asked the probe for (None: default).
        self.devices = devices
        # consumer -> the memory limit it registered with (or None).
        self._limits = weakref.WeakKeyDictionary()
        # id(consumer) -> _Consumer. Keyed by id, not weakly by the
        # consumer (a callback, which holds the model that must stay
        # collectable): a finalizer removes the entry.
        self._consumers = {}
        self._readings = 0
        self._last_key = None
        self._last_samples = ()

    @property
    def probe(self):
        """The backend's probe read (`backend_probe`), made on first use."""
        if self._probe is None:
            self._probe = backend_probe(devices=self.devices)
            self._probe.limits_given_elsewhere(self._common_limit())
        return self._probe

    def register(self, consumer, memory_limit=None):
        """Starts tracking interval peaks for `consumer` (weak-referenceable).

        Args:
            consumer: The consumer (a callback).
            memory_limit: The limit the consumer divides by itself (bytes,
                or a dict from device string to bytes), or `None`. When
                every consumer has one, the probe does not warn that no
                limit is known. Defaults to `None`.
        """
        key = id(consumer)
        if key not in self._consumers:
            self._consumers[key] = _Consumer(self._readings)
            weakref.finalize(consumer, self._consumers.pop, key, None)
        self._limits[consumer] = memory_limit
        if self._own_probe and self._probe is not None:
            # Takes effect if the probe has not resolved its devices yet.
            self._probe.limits_given_elsewhere(self._common_limit())

    def _common_limit(self):
        """A limit covering what every consumer's own limit covers."""
        limits = list(self._limits.values())
        if not limits or any(limit is None for limit in limits):
            return None
        whole = [limit for limit in limits if not isinstance(limit, dict)]
        if len(whole) == len(limits):
            return whole[0]
        keys = None
        for limit in limits:
            if isinstance(limit, dict):
                names = {normalize_device(key) for key in limit}
                keys = names if keys is None else keys & names
        return {key: 1 for key in keys}

    def reset(self):
        """Resets the allocator peaks and forgets every pending interval."""
        self.probe.reset()
        self._last_key = None
        for state in self._consumers.values():
            state.seen = self._readings
            state.missed = None

    def read_aside(self):
        """Samples the probe without ending any consumer's interval.

        For memory the caller takes and frees itself (the guard's tries of
        a compiled step's buffers, one of which can reach the limit): the
        probe's reading resets the allocator peaks, so those blocks reach
        no consumer's peak, and each consumer keeps what it had pending.

        Returns:
            A tuple of `AllocatorSample`, one per device.
        """
        return self.probe.sample()

    def read(self, consumer, key=None):
        """Returns samples whose peak covers `consumer`'s interval.

        Args:
            consumer: A registered consumer.
            key: Identifies the batch. Consumers passing the same key share
                one probe reading; `None` always reads afresh.

        Returns:
            A tuple of `AllocatorSample`, one per device, where `peak_bytes`
            is the highest peak since `consumer` last read (or since the
            last `reset`).
        """
        state = self._consumers.get(id(consumer))
        if key is None or key != self._last_key:
            previous = self._readings
            if previous:
                # Whoever did not get the previous reading keeps its peaks.
                for other in self._consumers.values():
                    if other.seen != previous and other is not state:
                        other.missed = _max_peaks(other.missed, self._last_samples)
            probe = self._probe
            if probe is None:
                probe = self.probe
            samples = probe.sample()
            self._readings = previous + 1
            self._last_key = key
            self._last_samples = samples
        else:
            samples = self._last_samples
        if state is None:  # not registered: the reading alone
            return samples
        state.seen = self._readings
        missed = state.missed
        if missed is None:
            return samples
        state.missed = None
        return tuple(
            sample._replace(peak_bytes=peak)
            for sample, peak in zip(samples, _max_peaks(missed, samples))
        )


def _max_peaks(peaks, samples):
    """Folds the peaks of `samples` into a running per-device maximum."""
    if peaks is None:
        return [sample.peak_bytes for sample in samples]
    return [
        None if old is None or new.peak_bytes is None else max(old, new.peak_bytes)
        for old, new in zip(peaks, samples)
    ]


def replica_devices(model):
    """Returns the devices `model` trains on under its distribution strategy.

    Args:
        model: A Keras model (TensorFlow backend).

    Returns:
        A tuple of short TensorFlow device strings (`"GPU:0"`, `"CPU:1"`),
        one per local replica device of `model.distribute_strategy`, or
        `None` when the model is not distributed (the default strategy) or
        its strategy runs on no CPU or GPU device (a TPU): the probe then
        picks its default devices.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"])
    with strategy.scope():
        model = make_model()
    replica_devices(model)  # ("GPU:0", "GPU:1")
    ```
    """
    strategy = getattr(model, "distribute_strategy", None)
    try:
        devices = strategy.extended.worker_devices
    except (AttributeError, NotImplementedError, RuntimeError):
        # The default strategy raises RuntimeError: not distributed.
        return None
    short = []
    for device in devices:
        name = normalize_device(device)
        if name is None:
            return None
        if name not in short:
            short.append(name)
    return tuple(short) or None


def shared_reader(model):
    """Returns the reader shared by every callback of `model`.

    The reader's probe reads the devices of `model.distribute_strategy`'s
    replicas (`replica_devices`), or the probe's default devices when the
    model is not distributed. Its probe resolves limits itself; a callback
    given its own `memory_limit` applies it through `resolve_limits` and
    registers it (`SharedAllocatorReader.register`), so that the probe warns
    of an unknown limit only when some callback has none.

    Args:
        model: The Keras model being trained.

    Returns:
        A `SharedAllocatorReader`.
    """
    devices = replica_devices(model)
    reader = _readers.get(model)
    if reader is None or reader.devices != devices:
        reader = SharedAllocatorReader(devices=devices)
        _readers[model] = reader
    return reader


def resolve_limits(probe, memory_limit=None):
    """Returns the memory limit of each of the probe's devices.

    Args:
        probe: An `AllocatorProbe`.
        memory_limit: A callback's own limit: bytes for every device, a dict
            from TensorFlow device string to bytes, or `None`.

    Returns:
        A list of ints or `None`, in the order of `probe.devices`.
    """
    limits = []
    for device in probe.devices:
        limit = memory_limit
        if isinstance(memory_limit, dict):
            limit = memory_limit.get(device)
        limits.append(limit if limit is not None else probe.limit_bytes(device))
    return limits
