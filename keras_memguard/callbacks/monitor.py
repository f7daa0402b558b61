"""MemoryMonitor: log device memory every batch to TensorBoard and the logs."""

import keras

from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.probes.tf_allocator import AllocatorProbe
from keras_memguard.probes.nvml import NvmlProbe
from keras_memguard.sinks import tensorboard as tb

PEAK_LOG_KEY = "memory_peak_mib"
_MIB = float(1024 * 1024)
USAGE_LOG_KEY = "memory_usage"


class MemoryMonitor(keras.callbacks.Callback):
    """Logs device memory to TensorBoard and to the Keras logs.

    Every sampled batch, the TensorFlow allocator of each device in use
    (the devices of the model's `tf.distribute` strategy;
    otherwise `GPU:i`, or `CPU:0` without a GPU) is read: the bytes in use and the
    highest bytes in use since the previous sample (the per-batch peak, which
    is what predicts the next out-of-memory error). On NVIDIA GPUs, NVML's
    device-wide readings are logged beside them.

    TensorBoard scalars are written to the run `<log_dir>/memguard`, next to
    the runs of `keras.callbacks.TensorBoard` (`{dev}` is `gpu0`, `gpu1`, ...,
    or `cpu0`):

    - `memory/{dev}/current_mib`, `memory/{dev}/peak_mib`,
      `memory/{dev}/limit_mib` (when the limit is known) and
      `memory/{dev}/usage` (peak / limit, 0..1);
    - with NVML: `memory/{dev}/nvml_used_mib`,
      `memory/{dev}/nvml_process_mib`, `utilization/{dev}/gpu_percent`;
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
    sample covers every step of the execution.

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

    Example:

    ```python
    monitor = keras_memguard.MemoryMonitor(log_dir="logs")
    model.fit(x, y, epochs=2, callbacks=[monitor])
    # tensorboard --logdir logs
    ```
    """

    def __init__(self, log_dir=None, update_freq="batch", memory_limit=None, nvml=True):
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
        self.log_dir = log_dir
        self.update_freq = update_freq
        self.memory_limit = memory_limit
        self.nvml = nvml
        self._every = 1 if update_freq == "batch" else update_freq
        self._writer = tb.writer_for(log_dir) if log_dir is not None else None
        self._nvml_probe = NvmlProbe() if nvml else None
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
        # The logs dict the train function returned last, once this monitor
        # added its values to it; None when on_train_batch_end must.
        self._contributed = None
        self._carrier = None
        if memory_limit is not None:
            AllocatorProbe(memory_limit=memory_limit)  # validates it

    def set_model(self, model):
        super().set_model(model)
        self._reader = shared_reader(model)
        self._reader.register(self, self.memory_limit)

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
        if self._writer is not None:
            self._writer.acquire(self)
        self._contributed = None
        self._carrier = logs_carrier.attach(
            self.model, self, self._contribute, self.params
        )

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._contributed = None
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
        self._batch_tags = tuple(tags)

    def _sample(self, logs, key, write):
        """Reads the probes; with `write`, writes one point per device.

        The per-batch path: one (shared) probe reading, a few comparisons,
        and one row queued for the writer.
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
