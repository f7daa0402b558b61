"""MemoryMonitor: log device and host memory every batch to TensorBoard and the logs."""

import logging
import math
import numbers
import warnings

import keras

from keras_memguard import backends
from keras_memguard import growth as growth_test
from keras_memguard import growth_check
from keras_memguard import keras_models
from keras_memguard.callbacks import copies
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
GROWTH_LOG_KEY = "memory_growth_mib_per_epoch"
# Tag templates of the floor test (they live in `sinks.tensorboard`).
FLOOR_MIB = tb.FLOOR_MIB
GROWTH_MIB_PER_EPOCH = tb.GROWTH_MIB_PER_EPOCH
HOST = tb.HOST
# An epoch's floors kept as rows; at this many, neighbours merge pairwise
# (the lower kept), so a long epoch holds a bounded list.
_MAX_FLOOR_ROWS = 4096

# Across calls, in this process: one `Series` per (kind, series name), the
# calls counted per kind, what was said, and the last call recorded (its
# `params` dict, shared by every callback of one call).
_calls = {
    "series": {},
    "count": {},
    "said": set(),
    "facts": {},
    "last": None,
    "baseline": None,
}


class MemoryMonitor(keras.callbacks.Callback):
    """Logs device memory to TensorBoard and to the Keras logs.

    Every sampled batch, the allocator of each device in use is read: the
    bytes in use and the highest bytes in use since the previous sample
    (the per-batch peak, which is what predicts the next out-of-memory
    error). The process's resident host memory (RSS) is read with it, and
    on NVIDIA GPUs NVML's device-wide readings. The batch and epoch `logs`
    get `memory_peak_mib`, `memory_usage` (peak / limit) and `host_rss_mib`,
    so the progress bar, `History`, `CSVLogger` and
    `keras.callbacks.TensorBoard` show them whatever the callbacks' order;
    with `log_dir`, TensorBoard scalars (`memory/{dev}/peak_mib`, ...) are
    written to the run `<log_dir>/memguard`.

    With `growth=True`, the memory left in use between steps is tested at
    each epoch end, and after each call, for a rising trend
    (`keras_memguard.growth`). A floor that keeps rising is reported in one
    WARNING line with its rate, the epoch or call at which it reaches the
    limit, and the evidence found (live models, traced functions, ...).

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
            although a GPU is there, it is skipped with one warning; without
            a GPU, silently. Defaults to `True`.
        profile_spikes: Whether to trace the batch after a memory spike (a
            peak more than `spike_fraction` above the previous sample's) with
            the TensorFlow profiler, for TensorBoard's Profile tab; `profiles`
            lists the traces. Needs `log_dir`. Defaults to `False`.
        spike_fraction: How far above the previous sample's peak a peak must
            be to count as a spike, as a fraction of the previous peak:
            `0.25` traces after a peak more than 25% higher. Defaults to
            `0.25`.
        max_profiles: The most traces written per `fit`, so that a spiky run
            does not fill the disk. Later spikes are only compared. Defaults
            to `1`.
        growth: Whether to test the memory in use between steps for growth.
            Defaults to `False`.

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
    print(monitor.profiles)  # ["logs/plugins/profile/<timestamp>/<host>.xplane.pb"]
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
        growth=False,
    ):
        super().__init__()
        # What a copy or an unpickled monitor is made from (`copies`).
        self._arguments = dict(
            log_dir=log_dir, update_freq=update_freq, memory_limit=memory_limit,
            nvml=nvml, profile_spikes=profile_spikes,
            spike_fraction=spike_fraction, max_profiles=max_profiles,
            growth=growth,
        )  # fmt: skip
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
        if not isinstance(growth, bool):
            raise ValueError(
                f"`growth` must be True or False. Received: growth={growth!r}"
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
        self.growth_enabled = growth
        # Floors of the epoch: one `(samples, rss)` per sample; None when off.
        self._floors = [] if growth else None
        self._growth_config = growth_test.make_config()
        self._host_config = growth_test.host_config()
        # Per fit: series name -> `growth.Series` over epochs; the fit's
        # epochs seen; the last epoch's floor per series (for the call
        # series); the first tested epoch's (floor, peak) per device.
        self._fit_series = {}
        self._fit_epochs = 0
        self._last_floors = {}
        self._first_demand = {}
        self._said = set()
        self._facts = {}
        self._results = {}
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

    def __reduce__(self):
        # Copied or pickled (a search's trials): a new monitor, same settings.
        return copies.reduced(self, MemoryMonitor, self._arguments)

    def set_model(self, model):
        keras_models.check_model(model, "MemoryMonitor")
        super().set_model(model)
        self._reader = shared_reader(model)
        self._reader.register(self, self.memory_limit)

    @property
    def growth(self):
        """The latest `GrowthResult` of each series, by name.

        Keys are `"epoch:<series>"` for the epochs of the current or last
        `fit` and `"<kind>:<series>"` for the calls of a kind (`"fit"`,
        `"evaluate"`, `"predict"`) in this process; `<series>` is a device
        (`"cpu0"`, `"gpu0"`) or `"host"`.
        """
        return dict(self._results)

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
            self._step = self._writer.acquire(self, self._step)
        if self._spikes is not None:
            self._spikes.begin_fit()
        self._contributed = None
        if self._floors is not None:
            self._begin_growth_call()
            self._fit_series = {}
            self._fit_epochs = 0
            self._first_demand = {}
            self._last_floors = {}
            self._floors = []
        self._carrier = logs_carrier.attach(
            self.model, self, self._contribute, self.params
        )

    def on_train_end(self, logs=None):
        self._in_fit = False
        if self._floors is not None:
            self._end_growth_call("fit", self._last_floors, self._series_limits())
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

    def on_predict_begin(self, logs=None):
        if self._floors is not None:
            self._begin_growth_call()

    def on_predict_end(self, logs=None):
        if self._floors is not None:
            self._end_growth_call("predict", *self._call_floors())

    def on_test_begin(self, logs=None):
        if self._floors is not None and not self._in_fit:
            self._begin_growth_call()
        # Fallback when the epoch's length is unknown: close the training
        # interval so that validation memory is not counted in it.
        if self._in_fit and self._open_interval:
            self._sample(None, key=None, write=self.update_freq == "epoch")

    def on_test_end(self, logs=None):
        if self._in_fit:
            self._reader.reset()
        elif self._floors is not None:
            self._end_growth_call("evaluate", *self._call_floors())

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
        if self._floors is not None:
            scalars += self._growth_epoch_end(logs)
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
        floors = self._floors
        if floors is not None:
            floors.append((samples, rss))
            if len(floors) >= _MAX_FLOOR_ROWS:
                self._compress_floors()

    # Growth of the floor. Every method below is called at an epoch's or a
    # call's end (never per batch) and never raises: a failure is logged
    # at DEBUG and the series goes on without that point.

    def _growth_epoch_end(self, logs):
        """Tests the fit's floors at an epoch end; returns scalars to write."""
        try:
            return self._test_epoch(logs)
        except Exception as error:  # The detector never stops training.
            logger.debug("growth test skipped at this epoch: %s", error)
            return []

    def _compress_floors(self):
        """Halves the epoch's rows: each pair becomes its lower floors."""
        rows = [(_currents(row[0]), row[1]) for row in self._floors]
        merged = []
        for i in range(0, len(rows) - 1, 2):
            (a, rss_a), (b, rss_b) = rows[i], rows[i + 1]
            merged.append(
                (tuple(_min(x, y) for x, y in zip(a, b)), _min(rss_a, rss_b))
            )
        if len(rows) % 2:
            merged.append(rows[-1])
        self._floors = merged

    def _config_of(self, name):
        return self._host_config if name == HOST else self._growth_config

    def _series_limits(self):
        limits = dict(zip(self._devices or (), self._limits))
        limits[HOST] = growth_check.host_limit_bytes()
        return limits

    def _test_epoch(self, logs):
        floors, self._floors = self._floors, []
        if not floors or self._devices is None:
            return []
        epoch = self._fit_epochs
        self._fit_epochs += 1
        rows = [_currents(row[0]) for row in floors]
        values = {
            device: [row[i] for row in rows] for i, device in enumerate(self._devices)
        }
        values[HOST] = [row[1] for row in floors]
        scalars = []
        growing_rate = None
        limits = self._series_limits()
        peaks = dict(zip(self._devices, self._epoch_peaks or ()))
        self._last_floors = {}
        for name, series_values in values.items():
            present = [v for v in series_values if v is not None]
            if not present:
                continue
            floor = min(present)
            self._last_floors[name] = floor
            scalars.append((FLOOR_MIB.format(dev=name), tb.to_mib(floor)))
            if epoch == 0:
                continue  # the warm-up epoch
            if name not in self._first_demand and peaks.get(name) is not None:
                self._first_demand[name] = (floor, peaks[name])
            xs, ys = growth_test.block_floors(series_values, float(epoch))
            series = self._fit_series.get(name) or growth_test.new_series()
            config = self._config_of(name)
            series = self._fit_series[name] = growth_test.add_points(config, series, xs, ys)
            result = growth_test.assess(
                config, name, "epoch", series.xs, series.ys, limits.get(name)
            )
            if result.growing:
                if ("fit", name) not in self._said:
                    self._said.add(("fit", name))
                    self._facts[("fit", name)] = self._evidence(
                        "epoch", name, floor, peaks.get(name)
                    )
                    result = result._replace(evidence=self._facts[("fit", name)])
                    self._warn(result, "this fit")
                result = result._replace(evidence=self._facts.get(("fit", name), ()))
                rate = result.slope_mib
                scalars.append((GROWTH_MIB_PER_EPOCH.format(dev=name), rate))
                growing_rate = rate if growing_rate is None else max(growing_rate, rate)
            self._results["epoch:" + name] = result
        if logs is not None and growing_rate is not None:
            logs[GROWTH_LOG_KEY] = growing_rate
        return scalars

    def _evidence(self, unit, name=None, floor=None, peak=None):
        facts = list(
            growth_check.evidence(_calls["baseline"], growth_check.snapshot(), unit)
        )
        first = self._first_demand.get(name)
        if first is not None and floor is not None and peak is not None:
            facts.append(
                growth_test.Evidence(
                    "outside_step",
                    floor / _MIB,
                    first[0] / _MIB,
                    f"memory held outside the step rose from {first[0] / _MIB:.1f} "
                    f"to {floor / _MIB:.1f} MiB while the step's own demand "
                    f"(peak minus floor) went from {(first[1] - first[0]) / _MIB:.1f} "
                    f"to {(peak - floor) / _MIB:.1f} MiB",
                )
            )
        return tuple(facts)

    def _warn(self, result, where):
        text = growth_test.warning_text(result, where)
        logger.warning(text)

    def _begin_growth_call(self):
        """Takes the process's evidence baseline at the first call (once)."""
        if _calls["baseline"] is None:
            try:
                _calls["baseline"] = growth_check.snapshot()
            except Exception as error:
                _calls["baseline"] = {}
                logger.debug("growth evidence baseline not taken: %s", error)

    def _call_floors(self):
        """The floors after an `evaluate` or `predict` call: one reading."""
        try:
            samples = self._reader.read(self, None)
        except Exception as error:
            logger.debug("no floor after this call: %s", error)
            return {}, {}
        floors = {s.device: s.current_bytes for s in samples if s.current_bytes is not None}
        try:
            limits = dict(
                zip(
                    (s.device for s in samples),
                    resolve_limits(self._reader.probe, self.memory_limit),
                )
            )
        except Exception:  # No limit: no projection.
            limits = {}
        limits[HOST] = growth_check.host_limit_bytes()
        rss = self._host_probe.rss_bytes()
        if rss is not None:
            floors[HOST] = rss
        return floors, limits

    def _end_growth_call(self, kind, floors, limits):
        """Adds a call's floors to the process's series of its kind; tests them."""
        try:
            params = self.params
            if params is not None and params is _calls["last"]:
                return  # another monitor of this call recorded it
            _calls["last"] = params
            if not floors:
                return
            index = _calls["count"].get(kind, 0)
            _calls["count"][kind] = index + 1
            for name, floor in floors.items():
                key = (kind, name)
                series = _calls["series"].get(key) or growth_test.new_series()
                config = self._config_of(name)
                series = _calls["series"][key] = growth_test.add_points(
                    config, series, (float(index),), (floor,)
                )
                result = growth_test.assess(
                    config, name, "call", series.xs, series.ys, limits.get(name)
                )
                if result.growing and key not in _calls["said"]:
                    _calls["said"].add(key)
                    _calls["facts"][key] = self._evidence("call")
                    self._warn(result._replace(evidence=_calls["facts"][key]), f"{kind} calls")
                if result.growing:
                    result = result._replace(evidence=_calls["facts"].get(key, ()))
                self._results[f"{kind}:{name}"] = result
        except Exception as error:  # The detector never stops training.
            logger.debug("growth test skipped after this call: %s", error)

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


def _currents(samples):
    """Each device's bytes in use: from samples, or a compressed row as is."""
    return tuple(
        s if s is None or isinstance(s, int) else s.current_bytes for s in samples
    )


def _min(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if a <= b else b


def _max(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


def _put(logs, key, value):
    if value is not None:
        logs[key] = value
