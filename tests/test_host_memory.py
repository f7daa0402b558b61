"""The process's resident memory: the probe, the monitor's scalar, the report.

The fit's input pipeline is a `keras.utils.PyDataset` that allocates a
numpy array per batch and keeps it (as a pipeline holding its data in
memory would), so the host's RSS rises by a known amount per batch. The
event file is read back with TensorBoard's own `EventAccumulator`.
"""

import logging
import os
import re
import warnings

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import keras_memguard
from keras_memguard.callbacks.monitor import HOST_RSS_LOG_KEY
from keras_memguard.probes import host as host_memory
from keras_memguard.probes.host import HostMemoryProbe
from keras_memguard.report import events
from keras_memguard.report import summary as summary_lib
from keras_memguard.sinks import tensorboard as tb

MIB = 1024 * 1024
CHUNK_MIB = 24
BATCHES = 10
BATCH_SIZE = 8


def _vm_rss_bytes():
    """VmRSS from /proc/self/status: the kernel's own figure, another file."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


linux_only = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)"
)


# --------------------------------------------------------------------------
# The probe


@linux_only
def test_probe_reads_the_kernel_s_rss_and_follows_an_allocation():
    probe = HostMemoryProbe()
    before = probe.rss_bytes()
    assert isinstance(before, int) and before > 0
    assert abs(before - _vm_rss_bytes()) < 8 * MIB
    held = np.ones(64 * MIB // 8)  # touched: resident
    after = probe.rss_bytes()
    assert after - before >= 60 * MIB
    assert abs(after - _vm_rss_bytes()) < 8 * MIB
    del held
    probe.close()
    assert probe.rss_bytes() > 0  # opened again


def test_without_proc_the_value_is_none_said_once_at_info(tmp_path, caplog):
    probe = HostMemoryProbe(path=str(tmp_path / "no_proc" / "statm"))
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        assert probe.rss_bytes() is None
        assert probe.rss_bytes() is None
        assert probe.available is False
    said = [r for r in caplog.records if "host memory (RSS) is not logged" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "no_proc" in said[0].getMessage()


@linux_only
def test_a_forked_child_reads_its_own_rss():
    probe = HostMemoryProbe()
    probe.rss_bytes()  # the file is open before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: allocate, then report what the probe reads
        try:
            held = np.ones(96 * MIB // 8)
            os.write(write, f"{probe.rss_bytes()} {_vm_rss_bytes()}".encode())
            del held
        finally:
            os._exit(0)
    os.close(write)
    child_probe, child_kernel = map(int, os.read(read, 128).split())
    os.close(read)
    os.waitpid(pid, 0)
    # The parent's descriptor would read the parent, which never held the
    # child's 96 MiB.
    assert abs(child_probe - child_kernel) < 8 * MIB
    assert abs(probe.rss_bytes() - _vm_rss_bytes()) < 8 * MIB


# --------------------------------------------------------------------------
# A fit whose input pipeline keeps what it loads


class KeepingDataset(keras.utils.PyDataset):
    """Batches of random inputs; with `keep`, also a touched array of
    `CHUNK_MIB` per batch, kept for good."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep
        self.kept = []
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return BATCHES

    def __getitem__(self, index):
        chunk = np.full(CHUNK_MIB * MIB // 8, float(index))
        if self.keep:
            self.kept.append(chunk)
        x = self.rng.normal(size=(BATCH_SIZE, 8)).astype("float32")
        return x, x[:, :1]


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    return model


class _Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch.append(logs.get(HOST_RSS_LOG_KEY))


def _fit(log_dir, keep):
    seen = _Logs()
    monitor = keras_memguard.MemoryMonitor(log_dir=log_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = _model().fit(
            KeepingDataset(keep), epochs=1, verbose=0, callbacks=[monitor, seen]
        )
    return seen.batch, history.history


def _rss_points(log_dir):
    acc = event_accumulator.EventAccumulator(
        os.path.join(str(log_dir), tb.RUN_NAME),
        size_guidance={event_accumulator.SCALARS: 0},
    )
    acc.Reload()
    assert tb.HOST_RSS_MIB in acc.Tags()["scalars"]
    return [(e.step, e.value) for e in acc.Scalars(tb.HOST_RSS_MIB)]


@pytest.fixture(scope="module")
def growing_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("host_growing")
    batch_logs, history = _fit(log_dir, keep=True)
    return log_dir, batch_logs, history


@linux_only
def test_a_pipeline_that_keeps_its_data_shows_a_rising_rss(growing_run):
    log_dir, batch_logs, history = growing_run
    points = _rss_points(log_dir)
    steps = [step for step, _ in points]
    values = [value for _, value in points]
    assert steps == list(range(1, BATCHES + 1))
    # The batch logs had the same values (stored as float32).
    assert values == [float(np.float32(v)) for v in batch_logs]
    # Every batch keeps CHUNK_MIB more; Keras may load a few batches ahead,
    # so the first point already holds some.
    assert values[-1] - values[0] >= (BATCHES - 4) * CHUNK_MIB
    for previous, value in zip(values, values[1:]):
        assert value > previous - 4, values
    # The epoch logs get the epoch's highest sample.
    assert history[HOST_RSS_LOG_KEY] == [pytest.approx(max(batch_logs), rel=1e-6)]


@linux_only
def test_a_pipeline_that_frees_its_data_shows_a_flat_rss(tmp_path):
    _fit(tmp_path, keep=False)
    values = [value for _, value in _rss_points(tmp_path)]
    assert max(values) - values[0] < 3 * CHUNK_MIB


@linux_only
def test_the_report_lists_host_rss_and_draws_it(growing_run, tmp_path):
    log_dir, batch_logs, _ = growing_run
    (run,) = events.load_runs(log_dir)
    summary = summary_lib.summarize(run)
    host = summary.host
    f32 = [float(np.float32(v)) for v in batch_logs]
    assert (host.first_step, host.last_step) == (1, BATCHES)
    assert (host.first_mib, host.last_mib) == (f32[0], f32[-1])
    assert host.peak_mib == max(f32)
    assert host.peak_step == 1 + f32.index(max(f32))
    text = summary_lib.format_summary(summary)
    line = re.search(r"host memory \(RSS\): (.*)", text).group(1)
    assert line == (
        f"{f32[0]:.1f} MiB at step 1, {f32[-1]:.1f} MiB at step {BATCHES} "
        f"({f32[-1] - f32[0]:+.1f} MiB); highest {max(f32):.1f} MiB at step "
        f"{host.peak_step}"
    )
    assert f32[-1] - f32[0] >= (BATCHES - 4) * CHUNK_MIB

    from keras_memguard.report import plot

    figure = plot.draw([run], [summary])
    (axes,) = [a for a in figure.axes if a.get_ylabel() == "host RSS, MiB"]
    (line,) = [l for l in axes.get_lines() if l.get_label() == "host RSS (this process)"]
    assert list(line.get_xdata()) == list(range(1, BATCHES + 1))
    assert list(line.get_ydata()) == f32


def test_without_proc_the_monitor_trains_and_writes_no_host_scalar(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(
        host_memory, "_shared", HostMemoryProbe(path=str(tmp_path / "no_statm"))
    )
    monitor = keras_memguard.MemoryMonitor(log_dir=tmp_path)
    x = np.zeros((32, 8), "float32")
    with caplog.at_level(logging.INFO, logger="keras_memguard"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = _model().fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0,
                               callbacks=[monitor])
    assert len(history.history["loss"]) == 2
    assert HOST_RSS_LOG_KEY not in history.history
    said = [r for r in caplog.records if "host memory (RSS) is not logged" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    acc = event_accumulator.EventAccumulator(str(tmp_path / tb.RUN_NAME))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "memory/cpu0/peak_mib" in tags and tb.HOST_RSS_MIB not in tags
    text = summary_lib.format_summary(summary_lib.summarize(events.load_runs(tmp_path)[0]))
    assert "host memory (RSS): not logged" in text
