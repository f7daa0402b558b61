"""The package's log values reach every callback, whatever the list order.

`MemoryMonitor` and `MemoryGuard` add their values to the logs the train
function returns (through the model's logs carrier), so `CSVLogger`,
`keras.callbacks.TensorBoard`, `History` and callbacks placed before them
see them. Also: the writers' event files are complete after `fit`, and the
"no memory limit" and NVML warnings appear only where they should.
"""

import csv
import logging
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import keras_memguard
from keras_memguard.callbacks import logs_carrier

BATCHES = 4
EPOCHS = 2
MIB = 2**20
KEYS = ("memory_peak_mib", "memory_usage", "micro_batches")


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("sgd", "mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32 * BATCHES, 16)), rng.normal(size=(32 * BATCHES, 1))


class _Recorder(keras.callbacks.Callback):
    """Records the batch and epoch logs it is handed."""

    def __init__(self):
        super().__init__()
        self.batch_logs = []
        self.epoch_logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


def _tensor_tags(run_dir):
    """`{tag: [(step, value)]}` of what keras TensorBoard wrote to a run."""
    acc = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return {
        tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
        if tag.startswith(("batch_", "epoch_"))
    }


ORDERS = {
    "keras_first": ("csv", "tensorboard", "monitor", "guard", "history"),
    "package_first": ("guard", "monitor", "csv", "history", "tensorboard"),
    "mixed": ("history", "tensorboard", "guard", "csv", "monitor"),
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_values_reach_csv_tensorboard_history_and_earlier_callbacks(order, tmp_path):
    csv_path = tmp_path / "log.csv"
    made = {
        "csv": keras.callbacks.CSVLogger(str(csv_path)),
        "tensorboard": keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq="batch"),
        "monitor": keras_memguard.MemoryMonitor(),
        "guard": keras_memguard.MemoryGuard(micro_batches=8),
        "history": keras.callbacks.History(),
    }
    first = _Recorder()  # before every other callback
    callbacks = [first] + [made[name] for name in ORDERS[order]]
    model = _model()
    x, y = _data()
    before = model.train_function
    model.fit(x, y, batch_size=32, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    # The carrier is gone after fit.
    assert model.train_function is before or before is None
    assert not isinstance(model.train_function, logs_carrier.LogsCarrier)

    # Every batch's logs carry the values, even for the first callback.
    assert len(first.batch_logs) == BATCHES * EPOCHS
    for logs in first.batch_logs:
        assert set(KEYS) <= set(logs)
        assert logs["memory_peak_mib"] > 0
        assert 0 < logs["memory_usage"] < 1
    # The count each batch ran with: the first split asked for, then the
    # plan (memory is plentiful).
    assert [logs["micro_batches"] for logs in first.batch_logs] == [8] + [1] * (
        BATCHES * EPOCHS - 1
    )
    # Epoch logs: the epoch's peak (the highest of its batches).
    for epoch, logs in enumerate(first.epoch_logs):
        batches = first.batch_logs[epoch * BATCHES:(epoch + 1) * BATCHES]
        assert logs["memory_peak_mib"] == max(b["memory_peak_mib"] for b in batches)
        assert logs["memory_usage"] == max(b["memory_usage"] for b in batches)
        assert logs["micro_batches"] == 1  # the last batch's

    history = made["history"].history
    for key in KEYS:
        assert history[key] == [logs[key] for logs in first.epoch_logs], key

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == EPOCHS
    for row, logs in zip(rows, first.epoch_logs):
        for key in KEYS:
            assert float(row[key]) == pytest.approx(logs[key], rel=1e-12), key

    tags = _tensor_tags(tmp_path / "tb" / "train")
    for key in KEYS:
        assert [v for _, v in tags[f"batch_{key}"]] == pytest.approx(
            [logs[key] for logs in first.batch_logs], rel=1e-6
        ), key
        assert [s for s, _ in tags[f"epoch_{key}"]] == list(range(EPOCHS)), key


def test_a_fit_that_raised_leaves_nothing_behind_for_the_next(tmp_path):
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    model = _model()
    x, y = _data()
    monitor = keras_memguard.MemoryMonitor()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=32, verbose=0,
                  callbacks=[monitor, keras_memguard.MemoryGuard(), Boom()])
    # The next fit with one monitor: its registration only, no guard.
    recorder = _Recorder()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[recorder, keras_memguard.MemoryMonitor()])
    assert "memory_peak_mib" in recorder.batch_logs[-1]
    assert "micro_batches" not in recorder.batch_logs[-1]
    assert not isinstance(model.train_function, logs_carrier.LogsCarrier)


def test_event_file_is_complete_after_fit_and_a_second_fit_appends(tmp_path):
    model = _model()
    x, y = _data()
    monitor = keras_memguard.MemoryMonitor(log_dir=tmp_path)
    guard = keras_memguard.MemoryGuard(log_dir=tmp_path)
    run_dir = tmp_path / "memguard"

    def read():
        acc = event_accumulator.EventAccumulator(
            str(run_dir), size_guidance={event_accumulator.SCALARS: 0}
        )
        acc.Reload()
        return {t: [e.step for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor, guard])
    # Read right after fit, without waiting: every point is on disk.
    first = read()
    assert first["memguard/micro_batches"] == list(range(1, BATCHES + 1))
    assert first["memory/cpu0/peak_mib"] == list(range(1, BATCHES + 1))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor, guard])
    second = read()
    assert second["memguard/micro_batches"] == list(range(1, 2 * BATCHES + 1))
    assert second["memory/cpu0/peak_mib"] == list(range(1, 2 * BATCHES + 1))
    assert len(os.listdir(run_dir)) == 1


def test_a_limit_given_to_the_guard_silences_the_unknown_limit_warning(monkeypatch):
    # No BFC cap in the environment: the CPU limit cannot be resolved.
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC")
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(x, y, batch_size=32, verbose=0,
                     callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 30)])
    assert not [w for w in caught if "no memory limit is known" in str(w.message)]
    # Without any limit the warning names the user's `fit` line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(x, y, batch_size=32, verbose=0,
                     callbacks=[keras_memguard.MemoryMonitor()])
    unknown = [w for w in caught if "no memory limit is known" in str(w.message)]
    assert len(unknown) == 1
    assert unknown[0].filename == __file__


def test_no_nvml_warning_during_fit_without_a_gpu(caplog):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees a GPU here")
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="keras_memguard"):
            _model().fit(x, y, batch_size=32, verbose=0,
                         callbacks=[keras_memguard.MemoryMonitor(),
                                    keras_memguard.MemoryGuard()])
    assert not [w for w in caught if "NVML" in str(w.message)]
