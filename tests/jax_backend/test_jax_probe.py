"""The JAX memory probe: `jax.Device.memory_stats()` behind the probe interface."""

import logging

import jax
import pytest

from keras_memguard.backends.jax import probe as jax_memory
from keras_memguard.probes.base import AllocatorSample
from keras_memguard.backends.jax.probe import JaxMemoryProbe


class FakeDevice:
    """A device with GPU-like statistics (this machine has no GPU)."""

    platform = "gpu"

    def __init__(self, id, stats):
        self.id = id
        self.stats = stats

    def memory_stats(self):
        return dict(self.stats)


def test_cpu_devices_read_none_with_one_info_line(caplog):
    jax_memory._told.clear()
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        probe = JaxMemoryProbe()
        probe.reset()
        samples = probe.sample()
        JaxMemoryProbe().sample()  # a second probe says nothing again
    assert probe.devices == ("CPU:0", "CPU:1")  # tests/jax_backend/conftest.py: two
    assert all(isinstance(s, AllocatorSample) for s in samples)
    assert [s.device for s in samples] == ["cpu0", "cpu1"]
    assert all(s.current_bytes is None and s.peak_bytes is None for s in samples)
    assert probe.mode == "unavailable" and probe.device_mode("cpu0") == "unavailable"
    assert probe.limit_bytes("CPU:0") is None and probe.limit_source("CPU:0") == "unknown"
    lines = [r for r in caplog.records if "memory_stats() is None" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


def test_a_user_limit_applies_on_cpu():
    probe = JaxMemoryProbe(memory_limit={"CPU:1": 2**30})
    assert probe.limit_bytes("CPU:1") == 2**30 and probe.limit_source("cpu1") == "user"
    assert probe.limit_bytes("CPU:0") is None
    assert probe.sample()[1].limit_bytes == 2**30


def test_gpu_statistics_become_samples_and_interval_peaks():
    stats = {
        "bytes_in_use": 100,
        "peak_bytes_in_use": 500,
        "bytes_limit": 1000,
        "largest_free_block_bytes": 400,
    }
    device = FakeDevice(0, stats)
    probe = JaxMemoryProbe(devices=[device])
    probe.reset()
    assert probe.devices == ("GPU:0",) and probe.device_mode("GPU:0") == "gpu"
    assert probe.limit_bytes("GPU:0") == 1000 and probe.limit_source("GPU:0") == "device"

    device.stats.update(bytes_in_use=150, peak_bytes_in_use=700)
    (sample,) = probe.sample()
    assert sample == AllocatorSample("gpu0", "GPU:0", 150, 700, 1000, "jax")
    assert sample.usage == 0.7
    assert probe.interval_peaks() == (700,)  # the mark rose: this interval's
    assert probe.largest_free_bytes("gpu0") == 400

    device.stats.update(bytes_in_use=120)
    (sample,) = probe.sample()
    assert sample.peak_bytes == 700  # the high-water mark since the start
    assert probe.interval_peaks() == (None,)  # stayed under it: unknown


def test_missing_keys_and_failing_reads_are_none():
    class Broken(FakeDevice):
        def memory_stats(self):
            raise RuntimeError("driver gone")

    good = FakeDevice(0, {"bytes_in_use": 1})
    probe = JaxMemoryProbe(devices=[good], memory_limit=2**20)
    (sample,) = probe.sample()
    assert sample.current_bytes == 1 and sample.peak_bytes is None
    assert probe.largest_free_bytes("GPU:0") is None
    broken = Broken(1, {"bytes_in_use": 1})
    probe = JaxMemoryProbe(devices=[broken], memory_limit=2**20)
    assert probe.sample()[0].current_bytes is None  # never raises


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="memory_limit=-1"):
        JaxMemoryProbe(memory_limit=-1)
    with pytest.raises(ValueError, match="memory_limit="):
        JaxMemoryProbe(memory_limit={"nowhere": 1})
    with pytest.raises(ValueError, match="devices"):
        JaxMemoryProbe(devices=[])
    with pytest.raises(ValueError, match="does not read"):
        JaxMemoryProbe().limit_bytes("GPU:7")


def test_a_real_device_reads_through(monkeypatch):
    device = jax.devices()[0]
    probe = JaxMemoryProbe(devices=[device])
    assert probe.jax_devices == (device,)
    assert probe.sample()[0].tf_device == "CPU:0"
