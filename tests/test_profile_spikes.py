"""MemoryMonitor(profile_spikes=True) in real `fit` calls.

The pytest process runs under the BFC CPU allocator (conftest.py), which
counts every allocation and records allocation events in profiler traces,
as GPU allocators do. The data is a tf.data pipeline with no background
thread whose batch size changes from batch to batch (`SIZES`), so the peak
of each batch follows its size: a batch of 512 after batches of 8 is a real
jump in the allocator's peak, tens of MiB (512 x 8192 floats per
activation), so that it stands out over whatever earlier tests in the same
process still hold (about 11 MiB in the whole suite).

One model serves every fit (its train function is traced once). One fit
carries three monitors, on, off and with a fraction above the jump, so
that they see the same readings.
"""

import glob
import importlib
import json
import logging
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from keras_memguard.callbacks.monitor import MemoryMonitor

DIM = 32
UNITS = 8192
# Batch sizes, one per batch: spikes at batches 3 and 7 (8 -> 512). Batch 4,
# the one after the first spike, has 256 rows: its hidden activation (256 x
# 256 floats) tells its trace apart from the 512-row batches around it.
SIZES = (8, 8, 8, 512, 256, 8, 8, 512, 8)
TRACED_BATCH_BYTES = 256 * UNITS * 4
SPIKE_BATCH_BYTES = 512 * UNITS * 4


def _dataset(sizes):
    """One batch of `n` rows per entry of `sizes`, made in the train step."""
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(sizes)).map(
        lambda n: (tf.ones((n, DIM)), tf.ones((n, 1)))
    )
    return dataset.with_options(options)


class _Records(logging.Handler):
    """Collects the keras_memguard log records at INFO and above."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("keras_memguard")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logger = logging.getLogger("keras_memguard")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _traces(log_dir):
    pattern = os.path.join(str(log_dir), "plugins", "profile", "*", "*.xplane.pb")
    return sorted(glob.glob(pattern))


def _memory_allocations(path):
    """The `MemoryAllocation` events of a trace, as `{stat name: value}`.

    Read with TensorFlow's own XSpace proto: these events are what
    TensorBoard's Memory Profile tool draws.
    """
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                if plane.event_metadata[event.metadata_id].name != "MemoryAllocation":
                    continue
                stats = {}
                for stat in event.stats:
                    name = plane.stat_metadata[stat.metadata_id].name
                    kind = stat.WhichOneof("value")
                    value = getattr(stat, kind)
                    if kind == "ref_value":
                        value = plane.stat_metadata[value].name
                    stats[name] = value
                events.append(stats)
    return events


def _profiler_running():
    """Whether a TensorFlow profiler session is running (stops none)."""
    try:
        tf.profiler.experimental.start(os.devnull)
    except tf.errors.AlreadyExistsError:
        return True
    tf.profiler.experimental.stop(save=False)
    return False


@pytest.fixture(scope="module")
def model():
    model = keras.Sequential(
        [
            keras.Input((DIM,)),
            keras.layers.Dense(UNITS, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.fixture(scope="module")
def spiky_fit(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("spikes")
    monitors = {
        "on": MemoryMonitor(log_dir=root / "on", profile_spikes=True),
        "off": MemoryMonitor(log_dir=root / "off"),
        # The jumps here are a few times the peak before; this asks for +5000%.
        "high": MemoryMonitor(
            log_dir=root / "high", profile_spikes=True, spike_fraction=50.0
        ),
    }
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            peaks.append(logs["memory_peak_mib"])

    with _Records() as records:
        model.fit(
            _dataset(SIZES),
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[*monitors.values(), Peaks()],
        )
    return root, monitors, records.messages, peaks


def test_the_data_makes_real_spikes(spiky_fit):
    _, _, _, peaks = spiky_fit
    assert len(peaks) == len(SIZES)
    assert peaks[3] > 1.25 * peaks[2]
    assert peaks[7] > 1.25 * peaks[6]
    # ... and none between: 512 -> 256 -> 8 -> 8 only fall or stay level.
    assert peaks[4] < peaks[3] and peaks[6] <= 1.25 * peaks[5]


def test_one_trace_of_the_batch_after_the_first_spike(spiky_fit):
    root, monitors, _, _ = spiky_fit
    traces = _traces(root / "on")
    # Two spikes, one trace: max_profiles defaults to 1 per fit.
    assert len(traces) == 1
    assert monitors["on"].profiles == traces
    assert os.path.getsize(traces[0]) > 0
    allocations = _memory_allocations(traces[0])
    assert allocations, "the trace has no memory events"
    assert {event.get("allocator_name") for event in allocations} == {
        "bfc_cpu_allocator_for_gpu"
    }
    sizes = {event.get("requested_bytes") for event in allocations}
    # Batch 4 (256 rows), not the spike's batch 3 nor batch 7 (512 rows).
    assert TRACED_BATCH_BYTES in sizes
    assert SPIKE_BATCH_BYTES not in sizes
    assert not _profiler_running()


def test_tensorboard_memory_profile_tool_reads_the_trace(spiky_fit):
    # Only where TensorBoard's profile plugin is installed (it is not a
    # dependency): its own converter, as the Memory Profile tool calls it.
    convert = None
    for name in (
        "xprof.convert.raw_to_tool_data",
        "tensorboard_plugin_profile.convert.raw_to_tool_data",
    ):
        try:
            convert = importlib.import_module(name)
            break
        except ImportError:
            pass
    if convert is None:
        pytest.skip("TensorBoard's profile plugin (xprof) is not installed")
    _, monitors, _, _ = spiky_fit
    data, _ = convert.xspace_to_tool_data(
        monitors["on"].profiles, "memory_profile", {}
    )
    profile = json.loads(data)
    allocator = profile["memoryProfilePerAllocator"]["bfc_cpu_allocator_for_gpu"]
    peak = int(allocator["profileSummary"]["peakStats"]["peakBytesInUse"])
    assert peak >= TRACED_BATCH_BYTES


def test_no_trace_when_off(spiky_fit):
    root, monitors, _, _ = spiky_fit
    assert os.path.isdir(root / "off" / "memguard")
    assert not os.path.exists(root / "off" / "plugins")
    assert monitors["off"].profiles == []


def test_no_trace_when_the_jump_is_below_the_fraction(spiky_fit):
    root, monitors, _, _ = spiky_fit
    assert not os.path.exists(root / "high" / "plugins")
    assert monitors["high"].profiles == []


def test_one_info_line_when_the_trace_starts_and_one_when_it_is_written(spiky_fit):
    root, monitors, messages, _ = spiky_fit
    started = [m for m in messages if "tracing the next batch" in m]
    written = [m for m in messages if "written to" in m]
    assert len(started) == 1 and len(written) == 1
    assert re.search(r"at step 4: ", started[0]), started[0]
    assert os.path.join(str(root / "on"), "plugins", "profile") in started[0]
    assert monitors["on"].profiles[0] in written[0]


def test_a_running_profiler_session_is_left_alone(model, tmp_path):
    # keras.callbacks.TensorBoard profiles the 5th batch (batch 4), the one
    # the monitor wants after the first spike: the monitor says so once and
    # traces after the second spike (batch 8) instead.
    tensorboard = keras.callbacks.TensorBoard(log_dir=tmp_path, profile_batch=5)
    monitor = MemoryMonitor(log_dir=tmp_path, profile_spikes=True)
    with _Records() as records:
        model.fit(
            _dataset(SIZES),
            shuffle=False,
            verbose=0,
            callbacks=[tensorboard, monitor],
        )
    skipped = [m for m in records.messages if "not traced" in m]
    assert len(skipped) == 1 and "at step 4" in skipped[0], records.messages
    assert len(_traces(tmp_path / "train")) == 1  # TensorBoard's own
    assert monitor.profiles == _traces(tmp_path)
    assert len(monitor.profiles) == 1
    allocations = _memory_allocations(monitor.profiles[0])
    sizes = {event.get("requested_bytes") for event in allocations}
    assert SPIKE_BATCH_BYTES not in sizes and TRACED_BATCH_BYTES not in sizes
    assert not _profiler_running()


# A few seconds: out of the fast loop.
@pytest.mark.slow
def test_max_profiles_and_an_error_in_the_traced_batch(model, tmp_path):
    # Two spikes, two traces; the batch after the second spike fails inside
    # the train function: its trace is written all the same and the
    # profiler is stopped.
    sizes = SIZES[:8] + (-1,)  # tf.ones with -1 rows fails in the step
    monitor = MemoryMonitor(log_dir=tmp_path, profile_spikes=True, max_profiles=2)
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.fit(_dataset(sizes), shuffle=False, verbose=0, callbacks=[monitor])
    assert not _profiler_running()
    # Traces written within one second would share a directory name: the
    # monitor waits for the next second instead.
    assert monitor.profiles == _traces(tmp_path)
    assert len(monitor.profiles) == 2
    assert _memory_allocations(monitor.profiles[1])

    # The next fit with the same monitor runs as usual and traces again.
    model.fit(_dataset(SIZES), shuffle=False, verbose=0, callbacks=[monitor])
    assert len(monitor.profiles) == 4
    assert monitor.profiles == _traces(tmp_path)
    assert not _profiler_running()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"profile_spikes": "yes"},
            "`profile_spikes` must be True or False. "
            "Received: profile_spikes='yes'",
        ),
        ({"profile_spikes": 1}, "Received: profile_spikes=1"),
        (
            {"spike_fraction": 0},
            "`spike_fraction` must be a finite number greater than 0",
        ),
        ({"spike_fraction": -0.5}, "Received: spike_fraction=-0.5"),
        ({"spike_fraction": float("nan")}, "Received: spike_fraction=nan"),
        ({"spike_fraction": float("inf")}, "Received: spike_fraction=inf"),
        ({"spike_fraction": True}, "Received: spike_fraction=True"),
        ({"spike_fraction": "0.25"}, "Received: spike_fraction='0.25'"),
        (
            {"max_profiles": 0},
            "`max_profiles` must be a positive integer. Received: max_profiles=0",
        ),
        ({"max_profiles": 1.5}, "Received: max_profiles=1.5"),
        ({"max_profiles": True}, "Received: max_profiles=True"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_value(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        MemoryMonitor(log_dir=tmp_path, **kwargs)


def test_profile_spikes_needs_a_log_dir():
    with pytest.raises(
        ValueError,
        match=r"`profile_spikes=True` needs a `log_dir`.*Received: log_dir=None",
    ):
        MemoryMonitor(profile_spikes=True)
    MemoryMonitor(spike_fraction=0.5)  # off: no log_dir needed


def test_numpy_numbers_are_valid_arguments(tmp_path):
    monitor = MemoryMonitor(
        log_dir=tmp_path, profile_spikes=True, spike_fraction=np.float32(0.5)
    )
    assert monitor.spike_fraction == 0.5
