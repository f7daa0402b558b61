"""MemoryMonitor on Keras' PyTorch backend: a real `fit`, read back by TensorBoard.

Without CUDA here, the monitor reads the process's resident memory
(`TorchMemoryProbe`'s host mode) as device `cpu0`. The event file is read
with TensorBoard's own `EventAccumulator`, as TensorBoard would.
"""

import os
import warnings

import keras
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from keras_memguard import MemoryMonitor
from keras_memguard.backends.torch.probe import TorchMemoryProbe
from keras_memguard.callbacks.sampling import shared_reader

MIB = 2**20
LIMIT = 64 * 2**30
ON_LINUX = os.path.exists("/proc/self/status")

pytestmark = pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")


@pytest.fixture(autouse=True)
def _host_only(monkeypatch):
    """The host path, also on a machine with a GPU."""
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cpu")


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _scalars(log_dir):
    """`{tag: [(step, value), ...]}` of the run `<log_dir>/memguard`."""
    acc = event_accumulator.EventAccumulator(
        os.path.join(str(log_dir), "memguard"),
        size_guidance={event_accumulator.SCALARS: 0},
    )
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


class _Recorder(keras.callbacks.Callback):
    """Keeps the batch logs; with `spike_at` (epoch, batch), holds 64 MiB
    for a moment before that batch, inside the interval its sample covers."""

    def __init__(self, spike_at=None):
        super().__init__()
        self.batch_logs = []
        self.spike_at = spike_at
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.spike_at:
            torch.ones(64 * MIB // 4)  # made, touched and freed at once

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs or {}))


def test_fit_on_torch_writes_memory_scalars_and_logs(tmp_path, freed_peaks_in_vmhwm):
    x, y = _data()
    model = _model()
    recorder = _Recorder(spike_at=(0, 2))
    monitor = MemoryMonitor(log_dir=str(tmp_path), memory_limit=LIMIT)
    # The recorder comes first: the keys reach callbacks before the monitor.
    history = model.fit(
        x, y, batch_size=16, epochs=2, verbose=0, callbacks=[recorder, monitor]
    )

    assert isinstance(shared_reader(model).probe, TorchMemoryProbe)
    scalars = _scalars(tmp_path)
    for tag in ("current_mib", "peak_mib", "limit_mib", "usage", "epoch_peak_mib"):
        assert f"memory/cpu0/{tag}" in scalars, sorted(scalars)
    assert "memory/host/rss_mib" in scalars
    current = dict(scalars["memory/cpu0/current_mib"])
    peak = dict(scalars["memory/cpu0/peak_mib"])
    assert sorted(current) == sorted(peak) == list(range(1, 9))  # 2 epochs x 4 batches
    assert all(value > 0 for value in current.values())  # resident memory is never 0
    assert all(peak[step] >= current[step] for step in current)
    # The 64 MiB held before batch 2 of the first epoch is in that batch's
    # peak (step 3), and in no other.
    assert peak[3] - current[3] >= 48
    assert all(peak[s] - current[s] < 48 for s in current if s != 3)
    assert {v for _, v in scalars["memory/cpu0/limit_mib"]} == {LIMIT / MIB}
    assert [s for s, _ in scalars["memory/cpu0/epoch_peak_mib"]] == [4, 8]
    assert dict(scalars["memory/cpu0/epoch_peak_mib"])[4] >= peak[3] - 1e-3

    for key in ("memory_peak_mib", "memory_usage", "host_rss_mib"):
        assert len(history.history[key]) == 2 and all(v > 0 for v in history.history[key])
        assert all(key in logs for logs in recorder.batch_logs)
    assert recorder.batch_logs[2]["memory_peak_mib"] >= peak[3] - 1e-3
    assert history.history["memory_usage"][0] == pytest.approx(
        history.history["memory_peak_mib"][0] * MIB / LIMIT
    )


def test_profile_spikes_is_refused_on_torch_and_memory_is_still_logged(tmp_path):
    with pytest.warns(UserWarning, match="torch backend does not have") as record:
        monitor = MemoryMonitor(
            log_dir=str(tmp_path), memory_limit=LIMIT, profile_spikes=True
        )
    assert record[0].filename == __file__ and "Received: profile_spikes=True" in str(
        record[0].message
    )
    x, y = _data(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    assert not [w for w in caught if "profile" in str(w.message)]
    assert monitor.profiles == []
    assert len(_scalars(tmp_path)["memory/cpu0/peak_mib"]) == 2


def test_an_unknown_limit_warns_once_at_the_fit_line(monkeypatch):
    from keras_memguard.backends.torch import probe as torch_probe

    monkeypatch.setattr(torch_probe, "_cgroup_limit_bytes", lambda: None)
    monkeypatch.setattr(torch_probe, "_rlimit_as_bytes", lambda: None)
    x, y = _data(32)
    with pytest.warns(UserWarning, match="no memory limit is known") as record:
        history = _model().fit(
            x, y, batch_size=16, epochs=2, verbose=0, callbacks=[MemoryMonitor()]
        )
    assert len([w for w in record if "no memory limit" in str(w.message)]) == 1
    assert [w for w in record if "no memory limit" in str(w.message)][0].filename == __file__
    assert "memory_usage" not in history.history
    assert all(v > 0 for v in history.history["memory_peak_mib"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Needs a CUDA device.")
def test_fit_on_cuda_logs_the_gpu_allocator(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_TORCH_DEVICE")  # Keras' own choice: CUDA
    x, y = _data()
    history = _model().fit(
        x, y, batch_size=16, epochs=1, verbose=0,
        callbacks=[MemoryMonitor(log_dir=str(tmp_path))],
    )
    scalars = _scalars(tmp_path)
    current = dict(scalars["memory/gpu0/current_mib"])
    peak = dict(scalars["memory/gpu0/peak_mib"])
    assert sorted(peak) == [1, 2, 3, 4]
    assert all(current[s] > 0 and peak[s] >= current[s] for s in peak)
    limits = {v for _, v in scalars["memory/gpu0/limit_mib"]}
    assert len(limits) == 1 and limits.pop() == pytest.approx(torch.cuda.mem_get_info()[1] / MIB)
    assert 0 < history.history["memory_usage"][0] < 1
