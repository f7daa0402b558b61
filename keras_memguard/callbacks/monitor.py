"""MemoryMonitor: log device and host memory every batch to TensorBoard and the logs."""

import logging
import math
import numbers
import warnings

import keras

from keras_memguard import backends
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.probes import host as host_memory
from keras_memguard.probes.base import check_memory_limit
from keras_memguard.probes.nvml import NvmlProbe
from keras_memguard.sinks import tensorboard as tb

logger = logging.getLogger("keras_memguard")

PEAK_LOG_KEY = "memory_peak_mib"
_MIB = float(1024 * 1024)
USAGE_LOG_KEY = "memory_usage"
HOST_RSS_LOG_KEY = "host_rss_mib"


class MemoryMonitor(keras.callbacks.Callback):
    """Logs device memory to TensorBoard and to the Keras logs.

    Every sampled batch, the TensorFlow allocator of each device in use
    (the devices of the model's `tf.distribute` strategy;
    otherwise `GPU:i`, or `CPU:0` without a GPU) is read: the bytes in use and the
    highest bytes in use since the previous sample (the per-batch peak, which
    is what predicts the next out-of-memory error). On NVIDIA GPUs, NVML's
    device-wide readings are logged beside them. The process's resident
    memory on the host (RSS, from `/proc/self/statm` on Linux) is read with
    them, so an input pipeline that holds its data in host memory (a
    `.cache()`d dataset, arrays copied every epoch) shows up too.

    TensorBoard scalars are written to the run `<log_dir>/memguard`, next to
    the runs of `keras.callbacks.TensorBoard` (`{dev}` is `gpu0`, `gpu1`, ...,
    or `cpu0`):

    - `memory/{dev}/current_mib`, `memory/{dev}/peak_mib`,
      `memory/{dev}/limit_mib` (when the limit is known) and
      `memory/{dev}/usage` (peak / limit, 0..1);
    - with NVML: `memory/{dev}/nvml_used_mib`,
      `memory/{dev}/nvml_process_mib`, `utilization/{dev}/gpu_percent`;
    - `memory/host/rss_mib`: the process's resident memory (not written
      where there is no `/proc`; one INFO line on the `keras_memguard`
      logger says so);
    - at each epoch end: `memory/{dev}/epoch_peak_mib`.

    The step is a global batch counter that keeps rising across epochs and
    across repeated `fit` calls with the same callback; epoch scalars are
    written at the step of the epoch's last batch.

    The batch and epoch `logs` get `memory_peak_mib` and `memory_usage` (the
    highest over devices): in the batch logs, the peak of the batches since
    the previous sample (the batch's own peak with `update_freq="batch"`);
    in the epoch logs, the epoch's peak. They are added to the logs the
    train function returns, so every callback sees them whatever its place
    in the `callbacks` list: the progress bar, `History`, `CSVLogger` and
    `keras.callbacks.TensorBoard` (`batch_memory_peak_mib`,
    `epoch_memory_peak_mib`, ...). With `steps_per_execution > 1`, one
    sample covers every step of the execution. `host_rss_mib` goes with
    them: the RSS at the sample in the batch logs, the highest sampled in
    the epoch in the epoch logs.

    Args:
        log_dir: Directory for TensorBoard logs, usually the same as the one
            given to `keras.callbacks.TensorBoard`. `None` writes no event
            file and only adds the `logs` keys. Defaults to `None`.
        update_freq: `"batch"` to sample every batch, an integer `N` to
            sample every `N` batches (the peak still covers all of them), or
            `"epoch"` to sample once per epoch. Defaults to `"batch"`.
        memory_limit: Device memory limit in bytes (an int for every device,
            or a dict from TensorFlow device string to bytes) used for
            `usage`. `None` resolves it as `AllocatorProbe` documents.
            Defaults to `None`.
        nvml: Whether to read NVML on NVIDIA GPUs. When NVML cannot start
            although TensorFlow sees a GPU, this is skipped with one warning;
            on a machine without a GPU, silently. Defaults to `True`.
        profile_spikes: Whether to trace the batch after a memory spike with
            the TensorFlow profiler. A spike is a sample whose peak (the
            highest over devices) is more than `spike_fraction` above the
            previous sample's in the same `fit`. The trace covers the next
            call of the train function (one batch; one execution with
            `steps_per_execution > 1`), memory events included, and is
            written to `<log_dir>/plugins/profile/<timestamp>/<host>.xplane.pb`,
            where TensorBoard's Profile tab reads it (its Memory Profile and
            Trace Viewer tools). One INFO line is logged when a trace starts
            and one when it is written; `profiles` lists the files. When
            another profiler session is running (`keras.callbacks.TensorBoard(
            profile_batch=...)`, `tf.profiler.experimental.start`), the spike
            is not traced and one INFO line per `fit` says so. If the traced
            batch raises (an out-of-memory error), the trace is still
            written; the profiler is never left running. The Memory Profile
            needs allocator events, which TensorFlow's BFC allocator records:
            the GPU default, and on CPU only with
            `TF_CPU_ALLOCATOR_USE_BFC=true`. Needs `log_dir`. Defaults to
            `False`.
        spike_fraction: How far above the previous sample's peak a peak must
            be to count as a spike, as a fraction of the previous peak:
            `0.25` traces after a peak more than 25% higher. Defaults to
            `0.25`.
        max_profiles: The most traces written per `fit`, so that a spiky run
            does not fill the disk (each trace is typically a few hundred
            KiB to a few MiB). Later spikes are only compared. Defaults to
            `1`.

    Raises:
        ValueError: If an argument is not valid (the message names it and
            the value received), or `profile_spikes=True` comes without a
            `log_dir`.

    Example:

    ```python
    monitor = keras_memguard.MemoryMonitor(log_dir="logs")
    model.fit(x, y, epochs=2, callbacks=[monitor])
    # tensorboard --logdir logs
    ```

    Tracing the batch after the first jump of more than 50% in the peak:

    ```python
    monitor = keras_memguard.MemoryMonitor(
        log_dir="logs", profile_spikes=True, spike_fraction=0.5
    )
    model.fit(dataset, epochs=2, callbacks=[monitor])
    print(monitor.profiles)  # ['logs/plugins/profile/2025_.../host.xplane.pb']
    # tensorboard --logdir logs: Profile tab, tool "memory_profile"
    ```
    """

    def __init__(
        self,
        log_dir=None,
        update_freq="batch",
        memory_limit=None,
        nvml=True,
        profile_spikes=False,
        spike_fraction=0.25,
        max_profiles=1,
    ):
        super().__init__()
        if update_freq not in ("batch", "epoch") and (
            isinstance(update_freq, bool)
            or not isinstance(update_freq, int)
            or update_freq < 1
        ):
            raise ValueError(
                "`update_freq` must be 'batch', 'epoch' or a positive integer. "
                f"Received: update_freq={update_freq!r}"
            )
        if not isinstance(nvml, bool):
            raise ValueError(f"`nvml` must be True or False. Received: nvml={nvml!r}")
        if not isinstance(profile_spikes, bool):
            raise ValueError(
                "`profile_spikes` must be True or False. "
                f"Received: profile_spikes={profile_spikes!r}"
            )
        if (
            isinstance(spike_fraction, bool)
            or not isinstance(spike_fraction, numbers.Real)
            or not math.isfinite(spike_fraction)
            or spike_fraction <= 0
        ):
            raise ValueError(
                "`spike_fraction` must be a finite number greater than 0 "
                "(0.25: a peak more than 25% above the previous one). "
                f"Received: spike_fraction={spike_fraction!r}"
            )
        if (
            isinstance(max_profiles, bool)
            or not isinstance(max_profiles, int)
            or max_profiles < 1
        ):
            raise ValueError(
                "`max_profiles` must be a positive integer. "
                f"Received: max_profiles={max_profiles!r}"
            )
        if profile_spikes and log_dir is None:
            raise ValueError(
                "`profile_spikes=True` needs a `log_dir`: the traces are "
                "written to `<log_dir>/plugins/profile`, where TensorBoard's "
                "Profile tab reads them. Received: log_dir=None"
            )
        traces = profile_spikes
        if profile_spikes and not backends.current().PROFILES_SPIKES:
            # Said once, here; the monitor goes on without traces.
            warnings.warn(
                "`profile_spikes=True` traces batches with TensorFlow's "
                f"profiler, which the {keras.backend.backend()} backend does "
                "not have: no traces are written; memory is still logged. "
                "Received: profile_spikes=True",
                stacklevel=2,
            )
            traces = False
        self.log_dir = log_dir
        self.update_freq = update_freq
        self.memory_limit = memory_limit
        self.nvml = nvml
        self.profile_spikes = profile_spikes
        self.spike_fraction = spike_fraction
        self.max_profiles = max_profiles
        # None when off: the per-batch paths check only this attribute.
        self._spikes = (
            backends.current().spike_profiler(log_dir, spike_fraction, max_profiles)
            if traces
            else None
        )
        self._every = 1 if update_freq == "batch" else update_freq
        self._writer = tb.writer_for(log_dir) if log_dir is not None else None
        self._nvml_probe = NvmlProbe() if nvml else None
        self._host_probe = host_memory.shared_probe()
        self._reader = None
        self._tags = {}
        # Global batch counter across epochs and fits, and the epoch's state.
        self._step = 0
        self._last_batch = -1
        self._since_sample = 0
        self._open_interval = False
        self._in_fit = False
        # Per fit: one entry per device, in the probe's order.
        self._limits = ()
        self._limits_mib = ()
        self._devices = None
        self._batch_tags = None
        self._nvml_on = False
        self._steps_per_execution = 1
        self._epoch_steps = None
        # The epoch's highest peak per device (bytes), and over devices.
        self._epoch_peaks = None
        self._epoch_peak_mib = None
        self._epoch_usage = None
        self._epoch_rss_mib = None
        # The logs dict the train function returned last, once this monitor
        # added its values to it; None when on_train_batch_end must.
        self._contributed = None
        self._carrier = None
        if memory_limit is not None:
            check_memory_limit(memory_limit)

    def set_model(self, model):
        super().set_model(model)
        self._reader = shared_reader(model)
        self._reader.register(self, self.memory_limit)

    @property
    def profiles(self):
        """The trace files written with `profile_spikes`, oldest first.

        Paths of `xplane.pb` files under `<log_dir>/plugins/profile`, over
        every `fit` this monitor was used in.
        """
        return list(self._spikes.paths) if self._spikes is not None else []

    def on_train_begin(self, logs=None):
        self._in_fit = True
        probe = self._reader.probe
        self._limits = resolve_limits(probe, self.memory_limit)
        self._limits_mib = [tb.to_mib(limit) for limit in self._limits]
        self._devices = self._batch_tags = None  # from the first sample
        self._steps_per_execution = self.model.steps_per_execution or 1
        self._epoch_steps = (self.params or {}).get("steps")
        self._nvml_on = self._nvml_probe is not None and self._nvml_probe.available
        self._reader.reset()
        # Opens the statm file now (or says once that it cannot), not in a
        # batch.
        self._host_probe.available
        if self._writer is not None:
            self._writer.acquire(self)
        if self._spikes is not None:
            self._spikes.begin_fit()
        self._contributed = None
        self._carrier = logs_carrier.attach(
            self.model, self, self._contribute, self.params
        )

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._contributed = None
        if self._spikes is not None:
            self._spikes.end_fit()
        logs_carrier.detach(self.model, self)
        if self._writer is not None:
            self._writer.release(self)

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1
        self._since_sample = 0
        self._epoch_steps = (self.params or {}).get("steps")
        self._epoch_peaks = None
        self._epoch_peak_mib = None
        self._epoch_usage = None
        self._epoch_rss_mib = None

    def _contribute(self, logs):
        """Adds the batch's values to the train function's own logs.

        Called by the model's `LogsCarrier` right after each train function
        call, before Keras hands the logs to the callbacks.
        """
        # The batch number Keras 3.15 passes to on_train_batch_end: the
        # execution's last step.
        self._after_batch(
            self._last_batch + self._steps_per_execution,
            logs,
            self._carrier.batch_key,
        )
        self._contributed = logs

    def on_train_batch_begin(self, batch, logs=None):
        # Replaces the base class's no-op chain: one attribute check.
        if self._spikes is not None:
            self._spikes.before_batch(self.model)

    def on_train_batch_end(self, batch, logs=None):
        contributed = self._contributed
        if contributed is None:
            # No carrier (the train function was replaced after
            # on_train_begin): read here; only later callbacks see the keys.
            self._after_batch(batch, logs, (id(logs), batch))
            return
        self._contributed = None
        if contributed is not logs:
            # Keras handed the callbacks a copy; the dict the train function
            # returned becomes the epoch logs if this was the epoch's last
            # batch: it carries the epoch's values from here on.
            _put(contributed, PEAK_LOG_KEY, self._epoch_peak_mib)
            _put(contributed, USAGE_LOG_KEY, self._epoch_usage)
            _put(contributed, HOST_RSS_LOG_KEY, self._epoch_rss_mib)

    def _after_batch(self, batch, logs, key):
        # With steps_per_execution > 1 Keras reports once per execution.
        steps = batch - self._last_batch
        self._last_batch = batch
        self._step += steps
        self._open_interval = True
        since = self._since_sample + steps
        if self.update_freq != "epoch" and since >= self._every:
            self._since_sample = 0
            self._sample(logs, key, True)
            return
        self._since_sample = since
        # Close the interval at the epoch's last batch, before Keras sets up
        # validation (which allocates, e.g. the validation set as tensors).
        epoch_steps = self._epoch_steps
        if epoch_steps is not None and batch + 1 >= epoch_steps:
            self._sample(None, key, self.update_freq == "epoch")

    def on_test_begin(self, logs=None):
        # Fallback when the epoch's length is unknown: close the training
        # interval so that validation memory is not counted in it.
        if self._in_fit and self._open_interval:
            self._sample(None, key=None, write=self.update_freq == "epoch")

    def on_test_end(self, logs=None):
        if self._in_fit:
            self._reader.reset()

    def on_epoch_end(self, epoch, logs=None):
        if self._open_interval:
            # The batches since the last sample; in "epoch" mode, the epoch.
            self._sample(None, key=None, write=self.update_freq == "epoch")
        if logs is not None:
            _put(logs, HOST_RSS_LOG_KEY, self._epoch_rss_mib)
        peaks = self._epoch_peaks
        if peaks is None:
            return
        scalars = []
        peak_mib = usage = None
        for device, peak, limit in zip(self._devices, peaks, self._limits):
            scalars.append((self._tags_of(device)["epoch_peak"], tb.to_mib(peak)))
            peak_mib = _max(peak_mib, tb.to_mib(peak))
            if peak is not None and limit:
                usage = _max(usage, peak / limit)
        if logs is not None:
            _put(logs, PEAK_LOG_KEY, peak_mib)
            _put(logs, USAGE_LOG_KEY, usage)
        if self._writer is not None:
            self._writer.write(self._step, scalars)
            self._writer.flush()

    def _tags_of(self, device):
        tags = self._tags.get(device)
        if tags is None:
            tags = self._tags[device] = tb.device_tags(device)
        return tags

    def _start_fit_rows(self, samples):
        """Names the devices and their batch tags from the fit's first sample."""
        self._devices = tuple(sample.device for sample in samples)
        tags = []
        for device in self._devices:
            names = self._tags_of(device)
            tags += (names["current"], names["peak"], names["limit"], names["usage"])
        tags.append(tb.HOST_RSS_MIB)  # last, after every device's values
        self._batch_tags = tuple(tags)

    def _sample(self, logs, key, write):
        """Reads the probes; with `write`, writes one point per device.

        The per-batch path: one (shared) allocator reading, one read of the
        host's RSS, a few comparisons, and one row queued for the writer.
        """
        self._open_interval = False
        samples = self._reader.read(self, key)
        if self._batch_tags is None:
            self._start_fit_rows(samples)
        peaks = self._epoch_peaks
        if peaks is None:
            peaks = self._epoch_peaks = [None] * len(samples)
        limits = self._limits
        limits_mib = self._limits_mib
        values = []
        peak_mib = usage = None
        for i, sample in enumerate(samples):
            current = sample.current_bytes
            current = None if current is None else current / _MIB
            peak = sample.peak_bytes
            if peak is None:
                values += (current, None, limits_mib[i], None)
                continue
            sample_peak_mib = peak / _MIB
            limit = limits[i]
            sample_usage = peak / limit if limit else None
            values += (current, sample_peak_mib, limits_mib[i], sample_usage)
            if peak_mib is None or sample_peak_mib > peak_mib:
                peak_mib = sample_peak_mib
            if sample_usage is not None and (usage is None or sample_usage > usage):
                usage = sample_usage
            old = peaks[i]
            if old is None or peak > old:
                peaks[i] = peak
        rss = self._host_probe.rss_bytes()
        if rss is None:
            values.append(None)
        else:
            rss_mib = rss / _MIB
            values.append(rss_mib)
            if self._epoch_rss_mib is None or rss_mib > self._epoch_rss_mib:
                self._epoch_rss_mib = rss_mib
            if logs is not None:
                logs[HOST_RSS_LOG_KEY] = rss_mib
        if peak_mib is not None:
            if self._epoch_peak_mib is None or peak_mib > self._epoch_peak_mib:
                self._epoch_peak_mib = peak_mib
            if logs is not None:
                logs[PEAK_LOG_KEY] = peak_mib
        if usage is not None:
            if self._epoch_usage is None or usage > self._epoch_usage:
                self._epoch_usage = usage
            if logs is not None:
                logs[USAGE_LOG_KEY] = usage
        if write and self._writer is not None:
            self._writer.write_values(self._step, self._batch_tags, values)
            if self._nvml_on:
                self._writer.write(self._step, self._nvml_scalars())
        if self._spikes is not None:
            self._spikes.after_sample(peak_mib, self._step)

    def _nvml_scalars(self):
        scalars = []
        for reading in self._nvml_probe.sample():
            tags = self._tags_of(reading.device)
            scalars += (
                (tags["nvml_used"], tb.to_mib(reading.used_bytes)),
                (tags["nvml_process"], tb.to_mib(reading.process_bytes)),
                (tags["gpu_percent"], reading.gpu_utilization_percent),
            )
        return scalars


def _max(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


def _put(logs, key, value):
    if value is not None:
        logs[key] = value
