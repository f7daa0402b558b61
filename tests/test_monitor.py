"""MemoryMonitor in real Keras `fit` calls, read back by TensorBoard's own code.

The pytest process runs under the BFC CPU allocator with an 8 GiB cap
(conftest.py), so every allocation is counted and the limit is known. The
fits are tiny; several monitors share a fit where they can (module-scoped
fixtures), because each model costs a trace. One test starts a process with
a 512 MiB cap, for limit and usage under a real cap.

Reference readings come from `tf.config.experimental.get_memory_info`:

- a callback placed *before* the monitors reads the allocator's peak at batch
  end without resetting it: that is exactly the peak the first monitor is
  about to read (and reset);
- a callback placed *after* them reads `current` (nothing allocates between
  the two: those fits take a tf.data pipeline with no background thread) and
  checks that the peak was reset (peak == current).

Tests named in a `BUG` comment fail against the code as it is; the comment
says what is wrong.
"""

import csv
import gc
import math
import os
import re
import subprocess
import time
import warnings
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing import plugin_event_multiplexer

from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks.monitor import MemoryMonitor
from keras_memguard.probes.nvml import NvmlProbe
from keras_memguard.testing import run_with_memory_cap
import programs

MIB = 1024 * 1024
# Set by conftest.py before TensorFlow was imported.
SUITE_MEMORY_LIMIT_MIB = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"])

CURRENT = "memory/cpu0/current_mib"
PEAK = "memory/cpu0/peak_mib"
LIMIT = "memory/cpu0/limit_mib"
USAGE = "memory/cpu0/usage"
EPOCH_PEAK = "memory/cpu0/epoch_peak_mib"
HOST_RSS = "memory/host/rss_mib"
BATCH_TAGS = (CURRENT, PEAK, LIMIT, USAGE, HOST_RSS)
ALL_TAGS = {CURRENT, PEAK, LIMIT, USAGE, EPOCH_PEAK, HOST_RSS}

BATCH_SIZE = 4
BATCHES = 12  # per epoch: divisible by 2, 3 and 4
EPOCHS = 2
FITS = 2
TOTAL = BATCHES * EPOCHS * FITS  # 48 batches in all


# --------------------------------------------------------------------------
# Helpers


def _memory_info():
    return tf.config.experimental.get_memory_info("CPU:0")


def _data(n=BATCH_SIZE * BATCHES, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, dim), dtype=np.float32)
    y = rng.random((n, 1), dtype=np.float32)
    return x, y


def _dataset(n=BATCH_SIZE * BATCHES, dim=8):
    """Batches of `_data` with no background thread in the input pipeline.

    Keras' numpy path (and tf.data's default prefetch injection) prepares
    the next batch on another thread, which allocates at any moment; here
    every allocation happens inside the train step, so a reading taken by a
    callback stays exact until the next step.
    """
    x, y = _data(n, dim)
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)
    return dataset.with_options(options)


def _model(dim=8, units=16, steps_per_execution=1):
    model = keras.Sequential(
        [
            keras.Input((dim,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution
    )
    return model


def _scalars(log_dir):
    """`{tag: [(step, value), ...]}` of the run `<log_dir>/memguard`.

    Loaded by TensorBoard's own `EventAccumulator`, every point kept.
    """
    acc = event_accumulator.EventAccumulator(
        os.path.join(str(log_dir), "memguard"),
        size_guidance={event_accumulator.SCALARS: 0},
    )
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def _steps(points):
    return [step for step, _ in points]


def _values(points):
    return [value for _, value in points]


def _f32(value):
    """What TensorBoard stores for a Python float (`simple_value` is float32)."""
    return float(np.float32(value))


class _Before(keras.callbacks.Callback):
    """Reads the allocator peak before the monitors read and reset it.

    The monitors read right after each train function call, through the
    model's logs carrier; placed first, this callback registers there first.
    """

    def __init__(self):
        super().__init__()
        self.batch_peaks = []
        self.test_peaks = []

    def on_train_begin(self, logs=None):
        logs_carrier.attach(self.model, self, self._read, self.params)

    def on_train_end(self, logs=None):
        logs_carrier.detach(self.model, self)

    def _read(self, logs):
        self.batch_peaks.append(_memory_info()["peak"])

    def on_test_end(self, logs=None):
        self.test_peaks.append(_memory_info()["peak"])


# What the logs' own tensors may move the allocator by between the read in
# the train function and a callback's on_train_batch_end.
LOGS_SLACK_BYTES = 4096

SPIKE_BATCHES = (0, 4, 9)  # in-epoch steps 1, 5 and 10, never a window's last
SPIKE_FLOATS = 256 * 1024  # 1 MiB, far above the tiny model's own peaks


class _Spike(keras.callbacks.Callback):
    """Allocates and frees 1 MiB at some batch begins: a known batch peak."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch in SPIKE_BATCHES:
            tf.fill([SPIKE_FLOATS], 1.0)  # freed at once: only the peak moves


class _After(keras.callbacks.Callback):
    """Reads the allocator and the batch logs after the monitors."""

    def __init__(self):
        super().__init__()
        self.current = []
        self.peak = []
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        info = _memory_info()
        self.current.append(info["current"])
        self.peak.append(info["peak"])
        self.logs.append(dict(logs))


# --------------------------------------------------------------------------
# Argument validation (no fit)


@pytest.mark.parametrize(
    "kwargs, echo",
    [
        ({"update_freq": -3}, "update_freq=-3"),
        ({"update_freq": 0}, "update_freq=0"),
        ({"update_freq": "often"}, "update_freq='often'"),
        ({"update_freq": True}, "update_freq=True"),
        ({"nvml": "yes"}, "nvml='yes'"),
        ({"memory_limit": -1}, "memory_limit=-1"),
    ],
)
def test_bad_arguments_raise_value_error_echoing_the_value(kwargs, echo):
    with pytest.raises(ValueError, match=re.escape(f"Received: {echo}") + "$"):
        MemoryMonitor(**kwargs)


@pytest.mark.parametrize("update_freq", ["batch", "epoch", 1, 3])
def test_good_update_freq_is_accepted(update_freq):
    assert MemoryMonitor(update_freq=update_freq).update_freq == update_freq


# --------------------------------------------------------------------------
# The main run: one model, two fits of two epochs of 12 batches, many
# monitors on the same model (so they share one allocator reader).


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("main_run")
    dirs = {
        name: root / name
        for name in ("batch", "freq3", "freq4", "freq4_first", "epoch", "user", "twin")
    }
    csv_path = root / "log.csv"
    before, after = _Before(), _After()
    monitors = {
        # Reads every 4 batches, placed before the per-batch monitor: at its
        # batches it is the one that reads the allocator afresh.
        "freq4_first": MemoryMonitor(log_dir=dirs["freq4_first"], update_freq=4),
        "batch": MemoryMonitor(log_dir=dirs["batch"]),
        "freq3": MemoryMonitor(log_dir=dirs["freq3"], update_freq=3),
        "freq4": MemoryMonitor(log_dir=dirs["freq4"], update_freq=4),
        "epoch": MemoryMonitor(log_dir=dirs["epoch"], update_freq="epoch"),
        "user": MemoryMonitor(log_dir=dirs["user"], memory_limit=1024 * MIB),
        # Last monitor: its per-batch values are what `after` sees in logs.
        "twin": MemoryMonitor(log_dir=dirs["twin"]),
    }
    callbacks = [_Spike(), before, *monitors.values(), after]
    callbacks.append(keras.callbacks.CSVLogger(str(csv_path), append=True))
    model = _model()
    dataset = _dataset()
    histories = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NVML: one warning per monitor here
        for _ in range(FITS):
            histories.append(
                model.fit(
                    dataset, epochs=EPOCHS, verbose=0, callbacks=callbacks
                ).history
            )
    with open(csv_path, newline="") as f:
        csv_rows = list(csv.DictReader(f))
    return {
        "dirs": dirs,
        "scalars": {name: _scalars(d) for name, d in dirs.items()},
        "before": before,
        "after": after,
        "histories": histories,
        "csv_rows": csv_rows,
    }


def test_tag_names_and_run_directory(main_run):
    for name, log_dir in main_run["dirs"].items():
        assert sorted(os.listdir(log_dir)) == ["memguard"], name
        assert set(main_run["scalars"][name]) == ALL_TAGS, name


def test_batch_mode_writes_one_point_per_batch_across_epochs_and_fits(main_run):
    scalars = main_run["scalars"]["batch"]
    for tag in BATCH_TAGS:
        # 1..48 in order: rising across epochs and across the two fits.
        assert _steps(scalars[tag]) == list(range(1, TOTAL + 1)), tag
    # Epoch points at the step of each epoch's last batch.
    assert _steps(scalars[EPOCH_PEAK]) == list(range(BATCHES, TOTAL + 1, BATCHES))


def test_update_freq_3_writes_every_third_batch(main_run):
    scalars = main_run["scalars"]["freq3"]
    for tag in BATCH_TAGS:
        assert _steps(scalars[tag]) == list(range(3, TOTAL + 1, 3)), tag
    assert _steps(scalars[EPOCH_PEAK]) == list(range(BATCHES, TOTAL + 1, BATCHES))


def test_update_freq_epoch_writes_one_point_per_epoch(main_run):
    scalars = main_run["scalars"]["epoch"]
    epoch_steps = list(range(BATCHES, TOTAL + 1, BATCHES))
    for tag in ALL_TAGS:
        assert _steps(scalars[tag]) == epoch_steps, tag


def test_values_agree_with_the_allocator(main_run):
    scalars = main_run["scalars"]["batch"]
    before, after = main_run["before"], main_run["after"]
    assert len(before.batch_peaks) == len(after.current) == TOTAL
    assert SUITE_MEMORY_LIMIT_MIB == 8192
    peaks = _values(scalars[PEAK])
    currents = _values(scalars[CURRENT])
    for i in range(TOTAL):
        # The logged peak is the allocator's peak since the previous read.
        assert peaks[i] == pytest.approx(before.batch_peaks[i] / MIB, rel=1e-6), i
        # The monitor reads right after the train function; by the time
        # `after` runs, Keras has turned the logs' tensors into floats,
        # which moves `current` (and the new peak) by a few bytes only.
        assert abs(currents[i] * MIB - after.current[i]) <= LOGS_SLACK_BYTES, i
        # The monitor reset the peak.
        assert after.peak[i] - after.current[i] <= LOGS_SLACK_BYTES, i
        # A training step allocates temporaries and frees them by batch end.
        assert peaks[i] > currents[i] > 0, i
    assert _values(scalars[LIMIT]) == [float(SUITE_MEMORY_LIMIT_MIB)] * TOTAL
    for (_, peak), (_, usage) in zip(scalars[PEAK], scalars[USAGE]):
        assert usage == pytest.approx(peak / SUITE_MEMORY_LIMIT_MIB, rel=1e-6)
        assert 0 < usage <= 1


def test_user_memory_limit_sets_limit_and_usage(main_run):
    scalars = main_run["scalars"]["user"]
    assert _values(scalars[LIMIT]) == [1024.0] * TOTAL
    assert _values(scalars[PEAK]) == _values(main_run["scalars"]["batch"][PEAK])
    for (_, peak), (_, usage) in zip(scalars[PEAK], scalars[USAGE]):
        assert usage == pytest.approx(peak / 1024, rel=1e-6)


def test_two_monitors_on_one_model_both_get_each_batch_peak(main_run):
    # The second monitor reads the same batch through the shared reader, not
    # the empty interval left after the first one reset the peak.
    batch, twin = main_run["scalars"]["batch"], main_run["scalars"]["twin"]
    device = lambda scalars: {k: v for k, v in scalars.items() if k != HOST_RSS}
    assert device(twin) == device(batch)
    # Each monitor reads the host's RSS itself, a few microseconds apart.
    assert _steps(twin[HOST_RSS]) == _steps(batch[HOST_RSS])
    for a, b in zip(_values(twin[HOST_RSS]), _values(batch[HOST_RSS])):
        assert abs(a - b) < 1.0
    assert all(p > c for p, c in zip(_values(twin[PEAK]), _values(twin[CURRENT])))


@pytest.mark.parametrize("name, every", [("freq3", 3), ("freq4", 4), ("freq4_first", 4)])
def test_update_freq_n_point_is_the_max_of_its_n_batches(main_run, name, every):
    per_batch = dict(main_run["scalars"]["batch"][PEAK])
    points = main_run["scalars"][name][PEAK]
    assert len(points) == TOTAL // every
    spikes = 0
    for step, value in points:
        window = range(step - every + 1, step + 1)
        assert value == max(per_batch[s] for s in window), step
        # A window with a 1 MiB spike before its last batch reports the
        # spike, not the last batch's own peak.
        if any((s - 1) % BATCHES in SPIKE_BATCHES for s in window):
            spikes += 1
            assert value > per_batch[step] + 0.9, step
    assert spikes >= len(points) // 2


def test_epoch_peaks_are_the_max_of_the_epoch_batch_points(main_run):
    per_batch = main_run["scalars"]["batch"][PEAK]
    expected = [
        max(_values(per_batch[i : i + BATCHES])) for i in range(0, TOTAL, BATCHES)
    ]
    for name in ("batch", "freq3", "freq4", "freq4_first", "epoch", "twin"):
        assert _values(main_run["scalars"][name][EPOCH_PEAK]) == expected, name
    # update_freq="epoch" writes the epoch's batch peak as its one point.
    assert _values(main_run["scalars"]["epoch"][PEAK]) == expected


def test_logs_keys_in_batch_logs_history_and_csv(main_run):
    before, after = main_run["before"], main_run["after"]
    # A callback after the monitor sees the keys in every batch's logs.
    for i, logs in enumerate(after.logs):
        assert logs["memory_peak_mib"] == before.batch_peaks[i] / MIB, i
        assert logs["memory_usage"] == pytest.approx(
            before.batch_peaks[i] / MIB / SUITE_MEMORY_LIMIT_MIB, rel=1e-12
        )
    epoch_peaks = _values(main_run["scalars"]["batch"][EPOCH_PEAK])
    history_peaks = []
    for history in main_run["histories"]:
        assert len(history["memory_peak_mib"]) == EPOCHS
        assert len(history["memory_usage"]) == EPOCHS
        history_peaks += history["memory_peak_mib"]
        for peak, usage in zip(history["memory_peak_mib"], history["memory_usage"]):
            assert usage == pytest.approx(peak / SUITE_MEMORY_LIMIT_MIB, rel=1e-12)
    assert [_f32(p) for p in history_peaks] == epoch_peaks
    rows = main_run["csv_rows"]
    assert len(rows) == EPOCHS * FITS
    assert [float(r["memory_peak_mib"]) for r in rows] == pytest.approx(
        history_peaks, rel=1e-12
    )
    assert all(0 < float(r["memory_usage"]) <= 1 for r in rows)


def test_host_rss_in_the_logs_is_what_the_event_file_has(main_run):
    after = main_run["after"]
    # "twin", the last monitor, read last: its values stay in the logs.
    rss = main_run["scalars"]["twin"][HOST_RSS]
    assert _steps(rss) == list(range(1, TOTAL + 1))
    assert _values(rss) == [_f32(logs["host_rss_mib"]) for logs in after.logs]
    assert all(value > 0 for value in _values(rss))
    epochs = []
    for history in main_run["histories"]:
        epochs += history["host_rss_mib"]
    # The epoch logs get the epoch's highest sample of the last monitor.
    per_batch = [logs["host_rss_mib"] for logs in after.logs]
    assert epochs == [
        max(per_batch[i : i + BATCHES]) for i in range(0, TOTAL, BATCHES)
    ]
    assert [float(r["host_rss_mib"]) for r in main_run["csv_rows"]] == pytest.approx(
        epochs, rel=1e-12
    )


# --------------------------------------------------------------------------
# steps_per_execution=2: one point per execution, at the batch index reached.


def test_steps_per_execution_2_one_point_per_execution(tmp_path):
    model = _model(steps_per_execution=2)
    dataset = _dataset()
    before, monitor, after = _Before(), MemoryMonitor(log_dir=tmp_path), _After()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(FITS):
            model.fit(
                dataset, epochs=EPOCHS, verbose=0, callbacks=[before, monitor, after]
            )
    scalars = _scalars(tmp_path)
    for tag in BATCH_TAGS:
        assert _steps(scalars[tag]) == list(range(2, TOTAL + 1, 2)), tag
    assert _steps(scalars[EPOCH_PEAK]) == list(range(BATCHES, TOTAL + 1, BATCHES))
    # Each point's peak is the allocator's peak since the previous
    # execution's read: it covers both steps of the execution.
    assert len(before.batch_peaks) == TOTAL // 2
    for i, (_, peak) in enumerate(scalars[PEAK]):
        assert peak == pytest.approx(before.batch_peaks[i] / MIB, rel=1e-6), i
        assert after.peak[i] - after.current[i] <= LOGS_SLACK_BYTES, i
    assert [log["memory_peak_mib"] for log in after.logs] == [
        p / MIB for p in before.batch_peaks
    ]


# --------------------------------------------------------------------------
# Validation inside fit: not counted in the training peaks.


class _ValidationSetup(keras.callbacks.Callback):
    """Holds 4 MiB from validation start to end, ahead of the monitors.

    A deterministic stand-in for what Keras itself allocates when it sets
    validation up (in some runs here it copies `validation_data` into a
    tensor between the last training batch and `on_test_begin`).
    """

    held = None

    def on_test_begin(self, logs=None):
        self.held = tf.fill([SPIKE_FLOATS * 4], 1.0)

    def on_test_end(self, logs=None):
        self.held = None


@pytest.fixture(scope="module")
def validation_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation_run")
    names = ("batch", "freq5", "epoch")
    dirs = {name: root / name for name in names}
    dim, units = 64, 1024
    model = _model(dim=dim, units=units)
    x, y = _data(dim=dim)
    # 4 MiB of validation data, in batches of 2048 whose activations (8 MiB
    # each) dwarf the training batches of 4: a leak into a training peak
    # would show.
    x_val, y_val = _data(n=16384, dim=dim, seed=1)
    before = _Before()
    callbacks = [
        _ValidationSetup(),
        before,
        MemoryMonitor(log_dir=dirs["batch"]),
        # 12 batches per epoch: batches 11-12 are still open at validation.
        MemoryMonitor(log_dir=dirs["freq5"], update_freq=5),
        MemoryMonitor(log_dir=dirs["epoch"], update_freq="epoch"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(
            x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0,
            validation_data=(x_val, y_val), validation_batch_size=2048,
            callbacks=callbacks,
        ).history
    return {
        "scalars": {name: _scalars(d) for name, d in dirs.items()},
        "before": before,
        "history": history,
    }


def test_validation_is_not_counted_in_training_peaks(validation_run):
    scalars = validation_run["scalars"]["batch"]
    steps = BATCHES * EPOCHS
    assert _steps(scalars[PEAK]) == list(range(1, steps + 1))
    peaks = _values(scalars[PEAK])
    expected = [max(peaks[i : i + BATCHES]) for i in range(0, steps, BATCHES)]
    assert _values(scalars[EPOCH_PEAK]) == expected
    assert _steps(scalars[EPOCH_PEAK]) == [BATCHES, steps]
    # The validation peak (read before the monitors reset at test end) is
    # above every training point, in particular the first batch after it.
    test_peaks = validation_run["before"].test_peaks
    assert len(test_peaks) == EPOCHS
    assert max(peaks) < min(test_peaks) / MIB
    assert "val_loss" in validation_run["history"]


@pytest.mark.parametrize("name", ["freq5", "epoch"])
def test_validation_setup_is_not_counted_in_epoch_peaks(validation_run, name):
    # BUG (monitor.py): a monitor whose interval is still open when
    # validation starts (update_freq="epoch", or N not dividing the epoch's
    # batches) closes it in on_test_begin, after validation has begun to
    # allocate (Keras copies validation_data into a tensor there; here
    # _ValidationSetup holds 4 MiB): epoch_peak_mib, and the History and
    # CSV values, then include validation memory. The peak points of the
    # batch monitor in the same fit are the reference.
    batch_points = _values(validation_run["scalars"]["batch"][PEAK])
    expected = [
        max(batch_points[i : i + BATCHES])
        for i in range(0, BATCHES * EPOCHS, BATCHES)
    ]
    assert _values(validation_run["scalars"][name][EPOCH_PEAK]) == expected


def test_update_freq_epoch_with_validation_writes_one_point_per_epoch(
    validation_run,
):
    # BUG (monitor.py, on_test_begin): the sample taken there to close the
    # training interval is never written, and on_epoch_end then finds the
    # interval closed, so with validation_data update_freq="epoch" writes
    # no current/peak/limit/usage point at all.
    scalars = validation_run["scalars"]["epoch"]
    expected_steps = [BATCHES, BATCHES * EPOCHS]
    assert _steps(scalars[EPOCH_PEAK]) == expected_steps
    for tag in BATCH_TAGS:
        assert _steps(scalars.get(tag, [])) == expected_steps, tag
    assert _values(scalars[PEAK]) == _values(scalars[EPOCH_PEAK])


# --------------------------------------------------------------------------
# NVML unavailable (no driver, or no pynvml): training works, one warning.


def test_without_nvml_or_a_gpu_training_works_without_an_nvml_warning(caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if NvmlProbe().available or tf.config.list_physical_devices("GPU"):
            pytest.skip("NVML or a GPU is available on this machine")
    model = _model()
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level("INFO", logger="keras_memguard"):
            history = model.fit(
                x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0,
                callbacks=[MemoryMonitor()],
            ).history
    nvml_warnings = [w for w in caught if "NVML" in str(w.message)]
    assert nvml_warnings == [], [str(w.message) for w in caught]
    # Said once, at INFO, for whoever looks.
    nvml_logs = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(nvml_logs) == 1 and nvml_logs[0].levelname == "INFO"
    assert len(history["loss"]) == EPOCHS and all(map(math.isfinite, history["loss"]))
    assert len(history["memory_peak_mib"]) == EPOCHS
    assert all(0 < u <= 1 for u in history["memory_usage"])


# --------------------------------------------------------------------------
# A real TensorBoard, beside keras.callbacks.TensorBoard in the same log_dir.


def _tensorboard_scalars(log_dir):
    """`(runs, {run: {tag: [ScalarDatum]}})` as TensorBoard's scalars plugin
    sees them without the data server: `EventMultiplexer` behind
    `MultiplexerDataProvider` (simple_value scalars are migrated to tensors
    with the scalars plugin's metadata on load)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    data = data_provider.MultiplexerDataProvider(mux, str(log_dir))
    ctx = context.RequestContext()
    runs = {run.run_name for run in data.list_runs(ctx, experiment_id="")}
    scalars = data.read_scalars(
        ctx, experiment_id="", plugin_name="scalars", downsample=10**6,
        run_tag_filter=None,
    )
    return runs, scalars


class _MidFitTensorBoard(keras.callbacks.Callback):
    """At the first epoch end, loads the log_dir as TensorBoard would."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self.seen = None

    def on_epoch_end(self, epoch, logs=None):
        if self.seen is None:
            runs, scalars = _tensorboard_scalars(self.log_dir)
            self.seen = {
                "runs": runs,
                "peak_points": len(scalars.get("memguard", {}).get(PEAK, [])),
                "train_tags": set(scalars.get("train", {})),
            }


TB_BATCHES = 6


@pytest.fixture(scope="module")
def tensorboard_log_dir(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tensorboard_run")
    model = _model()
    x, y = _data(n=BATCH_SIZE * TB_BATCHES)
    monitor = MemoryMonitor(log_dir=log_dir)
    mid_fit = _MidFitTensorBoard(log_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(FITS):
            keras_tb = keras.callbacks.TensorBoard(log_dir=log_dir, update_freq="batch")
            model.fit(
                x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, verbose=0,
                callbacks=[keras_tb, monitor, mid_fit],
            )
    return log_dir, mid_fit.seen


def test_scalars_show_in_tensorboard_beside_keras_tensorboard(tensorboard_log_dir):
    log_dir, mid_fit = tensorboard_log_dir
    total = TB_BATCHES * EPOCHS * FITS
    # During the first fit, after its first epoch, both runs were there.
    assert {"memguard", "train"} <= mid_fit["runs"]
    assert "batch_loss" in mid_fit["train_tags"]
    assert mid_fit["peak_points"] == TB_BATCHES
    # Each fit started a new keras event file in train/.
    train_files = [f for f in os.listdir(log_dir / "train") if "tfevents" in f]
    assert len(train_files) >= FITS
    runs, scalars = _tensorboard_scalars(log_dir)
    assert {"memguard", "train"} <= runs
    assert "batch_loss" in scalars["train"]
    assert set(scalars["memguard"]) == ALL_TAGS
    for tag in BATCH_TAGS:
        # Both fits' points, none lost, none repeated.
        steps = [point.step for point in scalars["memguard"][tag]]
        assert steps == list(range(1, total + 1)), tag
    steps = [point.step for point in scalars["memguard"][EPOCH_PEAK]]
    assert steps == list(range(TB_BATCHES, total + 1, TB_BATCHES))
    # The same values as the plain event loader reads.
    assert [p.value for p in scalars["memguard"][PEAK]] == _values(
        _scalars(log_dir)[PEAK]
    )


@pytest.mark.slow
def test_scalars_show_in_tensorboard_data_server(tensorboard_log_dir):
    # The Rust data server TensorBoard uses by default (--load_fast=auto).
    server = pytest.importorskip("tensorboard_data_server")
    grpc = pytest.importorskip("grpc")
    from tensorboard import context
    from tensorboard.data import grpc_provider
    from tensorboard.data import provider
    from tensorboard.data.proto import data_provider_pb2_grpc

    binary = server.server_binary()
    if binary is None:
        pytest.skip("no tensorboard data server binary")
    log_dir, _ = tensorboard_log_dir
    total = TB_BATCHES * EPOCHS * FITS
    port_file = log_dir.parent / (log_dir.name + ".port")
    process = subprocess.Popen(
        [
            binary, f"--logdir={log_dir}", "--reload=once", "--port=0",
            f"--port-file={port_file}", "--die-after-stdin",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        port = None
        while port is None and time.monotonic() < deadline:
            assert process.poll() is None, "data server exited"
            text = port_file.read_text() if port_file.exists() else ""
            if text.endswith("\n"):
                port = int(text)
            else:
                time.sleep(0.02)
        assert port is not None, "data server did not start"
        address = f"localhost:{port}"
        channel = grpc.insecure_channel(address)
        data = grpc_provider.GrpcDataProvider(
            address, data_provider_pb2_grpc.TensorBoardDataProviderStub(channel)
        )
        ctx = context.RequestContext()
        scalars = {}
        while time.monotonic() < deadline:  # it loads in the background
            scalars = data.read_scalars(
                ctx, experiment_id="", plugin_name="scalars", downsample=10**6,
                run_tag_filter=provider.RunTagFilter(runs=["memguard"]),
            )
            if len(scalars.get("memguard", {}).get(PEAK, [])) >= total:
                break
            time.sleep(0.05)
        runs = {r.run_name for r in data.list_runs(ctx, experiment_id="")}
        channel.close()
    finally:
        process.stdin.close()
        process.wait(timeout=10)
    assert {"memguard", "train"} <= runs
    assert ALL_TAGS <= set(scalars["memguard"])
    for tag in BATCH_TAGS:
        steps = [point.step for point in scalars["memguard"][tag]]
        assert steps == list(range(1, total + 1)), tag


# --------------------------------------------------------------------------
# The model is not kept alive by the monitor's shared reader.


# Slow for its `gc.collect()`, which costs what the worker's heap holds (1-10 s).
@pytest.mark.slow
def test_model_and_monitor_are_freed_after_fit():
    x, y = _data()

    def fit_and_forget(callbacks):
        model = _model()
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, verbose=0, callbacks=callbacks)
        return weakref.ref(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fit_and_forget([])
        monitored = fit_and_forget([MemoryMonitor()])
    gc.collect()
    assert plain() is None  # Keras itself lets a fitted model go
    # BUG (sampling.py): the reader cached per model in a WeakKeyDictionary
    # holds its consumers strongly, and a consumer (the callback) holds the
    # model: the value keeps its own key alive, so the model, its weights
    # and their (GPU) memory are never freed.
    assert monitored() is None


# --------------------------------------------------------------------------
# Limit and usage under a real 512 MiB cap (the one subprocess:
# tests/programs/monitor_under_cap.py).


@pytest.mark.slow
def test_limit_and_usage_under_a_real_512_mib_cap(tmp_path):
    run = run_with_memory_cap(
        programs.source("monitor_under_cap", str(tmp_path)),
        memory_limit_mib=512,
        timeout=300,
    )
    assert run.result is not None, run.stderr[-4000:]
    scalars = run.result["scalars"]
    assert ALL_TAGS <= set(scalars)
    assert [step for step, _ in scalars[PEAK]] == [1, 2]
    assert [value for _, value in scalars[LIMIT]] == [512.0, 512.0]
    for (_, peak), (_, usage) in zip(scalars[PEAK], scalars[USAGE]):
        assert usage == pytest.approx(peak / 512, rel=1e-6)
        # A sizable share of the cap: the batch's activations and gradients.
        assert 0.1 < usage <= 1
    history = run.result["history"]
    (usage,) = history["memory_usage"]
    (peak,) = history["memory_peak_mib"]
    assert usage == pytest.approx(peak / 512, rel=1e-12)
    assert _f32(peak) == max(value for _, value in scalars[PEAK])
