"""The PyTorch memory probe: the host's resident memory here, CUDA faked.

This machine has no GPU, so the CUDA path runs against `torch.cuda`'s own
functions replaced one by one (`is_available`, `device_count`,
`current_device`, `memory_stats_as_nested_dict`, `reset_peak_memory_stats`,
`mem_get_info`, `get_per_process_memory_fraction`): the seam the probe reads
through. The host path reads this process's real `/proc/self/status`, and
fake status files where exact numbers are needed.
"""

import logging
import os
import sys
import types
import warnings

import pytest
import torch

from keras_memguard.backends.torch import probe as torch_probe
from keras_memguard.backends.torch.probe import TorchMemoryProbe
from keras_memguard.backends.torch.probe import normalize_device
from keras_memguard.probes import nvml as nvml_module
from keras_memguard.probes.base import AllocatorSample

MIB = 2**20
GIB = 2**30
ON_LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/self/status")
# Read before the fixture below hides CUDA from every other test.
REAL_CUDA = torch.cuda.is_available()
_real_is_available = torch.cuda.is_available


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """No Keras device override, no CUDA, and every INFO line said afresh."""
    monkeypatch.delenv("KERAS_TORCH_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch_probe._told.clear()




# --- Host (CPU) ---------------------------------------------------------


@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_host_reads_resident_memory_and_the_peak_of_each_interval(freed_peaks_in_vmhwm):
    probe = TorchMemoryProbe(memory_limit=64 * GIB)
    probe.reset()
    (before,) = probe.sample()
    held = torch.ones(64 * MIB // 4)  # 64 MiB, touched
    del held
    (during,) = probe.sample()
    (after,) = probe.sample()

    assert probe.devices == ("CPU:0",) and probe.cuda_indices == (None,)
    assert probe.mode == "host" and probe.device_mode("cpu0") == "host"
    assert probe.peak_resets is True
    assert isinstance(before, AllocatorSample)
    assert (before.device, before.tf_device, before.source) == ("cpu0", "CPU:0", "host_rss")
    assert before.current_bytes > 0 and before.peak_bytes >= before.current_bytes
    # The freed tensor is gone from the current reading but not from the
    # interval's peak; the next interval's peak no longer holds it.
    assert during.peak_bytes - during.current_bytes >= 48 * MIB
    assert after.peak_bytes - after.current_bytes < 48 * MIB
    assert probe.interval_peaks() == (after.peak_bytes,)
    assert after.limit_bytes == 64 * GIB and probe.limit_source("CPU:0") == "user"
    assert probe.reserved_bytes("CPU:0") is None
    assert probe.largest_free_bytes("CPU:0") is None


def _status_file(path, rss_kib, hwm_kib, groups=0):
    lines = ["Name:\tpython", "Groups:\t" + " ".join(["1000"] * groups)]
    lines += ["VmPeak:\t 9999 kB", f"VmHWM:\t{hwm_kib:8d} kB", f"VmRSS:\t{rss_kib:8d} kB"]
    path.write_text("\n".join(lines) + "\nThreads:\t1\n")


def test_host_numbers_come_from_vmrss_and_vmhwm(tmp_path, monkeypatch):
    status, clear = tmp_path / "status", tmp_path / "clear_refs"
    # A long Groups line pushes the Vm lines past the first read.
    _status_file(status, rss_kib=200, hwm_kib=300, groups=2000)
    clear.write_bytes(b"")
    monkeypatch.setattr(torch_probe, "STATUS_PATH", str(status))
    monkeypatch.setattr(torch_probe, "CLEAR_REFS_PATH", str(clear))
    probe = TorchMemoryProbe(devices="cpu", memory_limit=GIB)
    probe.reset()
    (sample,) = probe.sample()
    assert (sample.current_bytes, sample.peak_bytes) == (200 * 1024, 300 * 1024)
    assert probe.mode == "host"
    # open, reset, sample: each reset wrote "5" (and nothing else).
    assert clear.read_bytes() == b"555"


def test_host_peak_without_clear_refs_is_the_rise_of_vmhwm(tmp_path, monkeypatch, caplog):
    status = tmp_path / "status"
    _status_file(status, rss_kib=200, hwm_kib=500)
    monkeypatch.setattr(torch_probe, "STATUS_PATH", str(status))
    monkeypatch.setattr(torch_probe, "CLEAR_REFS_PATH", str(tmp_path / "none" / "clear_refs"))
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        probe = TorchMemoryProbe(memory_limit=GIB)
        probe.reset()
        TorchMemoryProbe(memory_limit=GIB).devices  # said once per process
    assert probe.mode == "host_sampled" and probe.peak_resets is False
    lines = [r for r in caplog.records if "cannot be reset" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO

    # VmHWM did not rise: the interval's peak is the higher reading.
    _status_file(status, rss_kib=250, hwm_kib=500)
    assert probe.sample()[0].peak_bytes == 250 * 1024
    _status_file(status, rss_kib=220, hwm_kib=500)
    assert probe.sample()[0].peak_bytes == 250 * 1024
    # It rose: it was reached in the interval.
    _status_file(status, rss_kib=230, hwm_kib=700)
    assert probe.sample()[0].peak_bytes == 700 * 1024
    _status_file(status, rss_kib=210, hwm_kib=700)
    assert probe.sample()[0].peak_bytes == 230 * 1024


def test_no_proc_reads_none_and_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(torch_probe, "STATUS_PATH", str(tmp_path / "no_status"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="keras_memguard"):
            probe = TorchMemoryProbe(memory_limit=GIB)
            probe.reset()
            samples = probe.sample() + probe.sample()
    assert caught == []
    assert probe.mode == "unavailable" and probe.peak_resets is False
    assert all(s.current_bytes is None and s.peak_bytes is None for s in samples)
    assert all(s.limit_bytes == GIB for s in samples)
    lines = [r for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_a_failing_read_mid_run_gives_none_and_logs_once(caplog):
    probe = TorchMemoryProbe(memory_limit=GIB)
    probe.reset()
    assert probe.sample()[0].current_bytes > 0

    def broken():
        raise OSError("gone")

    probe._host.read = broken
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        first, second = probe.sample(), probe.sample()
    assert first[0].current_bytes is None and second[0].peak_bytes is None
    assert len([r for r in caplog.records if "gone" in r.getMessage()]) == 1


@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_host_limit_is_the_smaller_of_cgroup_and_rlimit_as(monkeypatch):
    monkeypatch.setattr(torch_probe, "_cgroup_limit_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(torch_probe, "_rlimit_as_bytes", lambda: 3 * GIB)
    probe = TorchMemoryProbe()
    assert (probe.limit_bytes("CPU:0"), probe.limit_source("CPU:0")) == (3 * GIB, "rlimit_as")
    monkeypatch.setattr(torch_probe, "_rlimit_as_bytes", lambda: None)
    probe = TorchMemoryProbe()
    assert (probe.limit_bytes("cpu0"), probe.limit_source("cpu0")) == (8 * GIB, "cgroup")
    assert probe.sample()[0].limit_bytes == 8 * GIB


@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_unknown_limit_warns_once_unless_given_elsewhere(monkeypatch):
    monkeypatch.setattr(torch_probe, "_cgroup_limit_bytes", lambda: None)
    monkeypatch.setattr(torch_probe, "_rlimit_as_bytes", lambda: None)
    probe = TorchMemoryProbe()
    with pytest.warns(UserWarning, match="CPU:0: no memory limit is known") as record:
        assert probe.limit_source("CPU:0") == "unknown"
    assert "HINT" in str(record[0].message) and record[0].filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samples = probe.sample()
        quiet = TorchMemoryProbe()
        quiet.limits_given_elsewhere(GIB)
        quiet.sample()
    assert caught == [] and samples[0].limit_bytes is None


def test_real_limit_helpers_never_raise():
    for value in (torch_probe._cgroup_limit_bytes(), torch_probe._rlimit_as_bytes()):
        assert value is None or (isinstance(value, int) and value > 0)


def _status_kib(key):
    """A `/proc/self/status` field in KiB, read directly."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


@pytest.mark.slow
@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_a_forked_child_reads_and_resets_its_own_memory(freed_peaks_in_vmhwm):
    probe = TorchMemoryProbe(memory_limit=GIB)
    probe.reset()
    probe.sample()
    pid = os.fork()
    if pid == 0:  # the child: every check here, its exit code says which failed
        code = 1
        try:
            host = probe._host
            links = {os.readlink(f"/proc/self/fd/{fd}") for fd in (host._status, host._clear)}
            own = links == {f"/proc/{os.getpid()}/status", f"/proc/{os.getpid()}/clear_refs"}
            held = bytearray(64 * MIB)
            held[:: 4096] = b"x" * len(held[:: 4096])  # touch every page
            del held
            kernel = _status_kib("VmHWM") - _status_kib("VmRSS")  # read without resetting
            (sample,) = probe.sample()
            if own and sample.peak_bytes - sample.current_bytes >= 48 * MIB:
                code = 0
            else:
                # 3: the kernel's own VmHWM missed the block (as the fixture
                # checks in the parent), so no probe could see it.
                code = 2 if not own or kernel * 1024 >= 48 * MIB else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    (parent,) = probe.sample()
    if os.waitstatus_to_exitcode(status) == 3:
        pytest.skip("The kernel's VmHWM did not keep a 64 MiB block made and freed in the child.")
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.peak_bytes - parent.current_bytes < 48 * MIB


# --- CUDA, faked --------------------------------------------------------


class FakeCuda:
    """Per-device allocator statistics in torch's nested form."""

    def __init__(self, count=2, total=80 * GIB, fraction=1.0, current=0):
        self.count = count
        self.total = total
        self.fraction = fraction
        self.current_index = current
        self.allocated = {i: [100 * MIB, 300 * MIB] for i in range(count)}
        self.reserved = {i: 512 * MIB for i in range(count)}
        self.calls = []
        self.fail = set()

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current_index)
        monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", self.memory_stats)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak)
        monkeypatch.setattr(cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda i: self.fraction)
        return self

    def memory_stats(self, index):
        self.calls.append(("stats", index))
        if "stats" in self.fail:
            raise RuntimeError("CUDA error: an illegal memory access")
        current, peak = self.allocated[index]
        return {
            "allocated_bytes": {"all": {"current": current, "peak": peak}},
            "reserved_bytes": {"all": {"current": self.reserved[index], "peak": 0}},
            "num_ooms": 0,
        }

    def reset_peak(self, index):
        self.calls.append(("reset", index))
        self.allocated[index][1] = self.allocated[index][0]

    def mem_get_info(self, index):
        return (self.total // 2, self.total)


def test_cuda_reads_allocated_bytes_and_resets_the_peak_after_reading(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    probe = TorchMemoryProbe()
    probe.reset()
    fake.allocated[0] = [120 * MIB, 900 * MIB]
    fake.calls.clear()
    (sample,) = probe.sample()
    assert probe.devices == ("GPU:0",) and probe.cuda_indices == (0,)
    assert probe.mode == "cuda" and probe.peak_resets is True
    assert sample == AllocatorSample("gpu0", "GPU:0", 120 * MIB, 900 * MIB, 80 * GIB, "torch_cuda")
    assert fake.calls == [("stats", 0), ("reset", 0)]
    assert probe.reserved_bytes("gpu0") == 512 * MIB
    assert probe.limit_source("GPU:0") == "device"
    (sample,) = probe.sample()
    assert sample.peak_bytes == 120 * MIB  # the next interval starts afresh


def test_cuda_reads_every_device_before_resetting_any(monkeypatch):
    fake = FakeCuda(count=3).install(monkeypatch)
    probe = TorchMemoryProbe(devices=["cuda:2", "GPU:0", "cuda:2"])
    probe.sample()
    fake.calls.clear()
    samples = probe.sample()
    assert probe.devices == ("GPU:2", "GPU:0") and probe.cuda_indices == (2, 0)
    assert [s.device for s in samples] == ["gpu2", "gpu0"]
    assert fake.calls == [("stats", 2), ("stats", 0), ("reset", 2), ("reset", 0)]


def test_cuda_default_is_the_current_device_or_keras_torch_device(monkeypatch):
    FakeCuda(count=2, current=1).install(monkeypatch)
    assert TorchMemoryProbe().devices == ("GPU:1",)
    assert TorchMemoryProbe(devices="cuda").devices == ("GPU:1",)
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cuda:0")
    assert TorchMemoryProbe().devices == ("GPU:0",)
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cpu")
    assert TorchMemoryProbe(memory_limit=GIB).devices == ("CPU:0",)


def test_another_keras_device_reads_the_host_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "mps")
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        probe = TorchMemoryProbe(memory_limit=GIB)
        assert probe.devices == ("CPU:0",)
    assert any("KERAS_TORCH_DEVICE=mps" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "fraction, user, expected",
    [
        (1.0, None, (80 * GIB, "device")),
        (0.25, None, (20 * GIB, "memory_fraction")),
        (0.25, 6 * GIB, (6 * GIB, "user")),
        (1.0, {"GPU:0": 5 * GIB, "cuda:1": 7 * GIB}, (5 * GIB, "user")),
    ],
)
def test_cuda_limit_resolution(monkeypatch, fraction, user, expected):
    FakeCuda(fraction=fraction).install(monkeypatch)
    probe = TorchMemoryProbe(devices=["GPU:0", "GPU:1"], memory_limit=user)
    assert (probe.limit_bytes("GPU:0"), probe.limit_source("gpu0")) == expected
    assert probe.sample()[0].limit_bytes == expected[0]
    if isinstance(user, dict):  # "cuda:1" keys GPU:1
        assert probe.limit_bytes("GPU:1") == 7 * GIB


def test_cuda_not_initialized_or_failing_reads_none(monkeypatch, caplog):
    fake = FakeCuda().install(monkeypatch)
    probe = TorchMemoryProbe()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda i: {})
    probe = TorchMemoryProbe()
    (sample,) = probe.sample()
    assert sample.current_bytes is None and sample.peak_bytes is None
    assert probe.reserved_bytes("GPU:0") is None

    fake.install(monkeypatch)
    fake.fail.add("stats")
    probe = TorchMemoryProbe()
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        first, second = probe.sample(), probe.sample()
    assert first[0].current_bytes is None and second[0].peak_bytes is None
    assert first[0].limit_bytes == 80 * GIB
    assert len([r for r in caplog.records if "illegal memory access" in r.getMessage()]) == 1


def test_a_missing_cuda_device_warns_and_reads_none(monkeypatch):
    fake = FakeCuda(count=1).install(monkeypatch)
    probe = TorchMemoryProbe(devices=["GPU:0", "GPU:3"], memory_limit=GIB)
    with pytest.warns(UserWarning, match="no CUDA device GPU:3"):
        samples = probe.sample()
    assert probe.device_mode("GPU:3") == "unavailable" and probe.mode == "unavailable"
    assert samples[1].current_bytes is None and samples[1].limit_bytes == GIB
    assert samples[0].current_bytes == 100 * MIB
    assert ("stats", 3) not in fake.calls and ("reset", 3) not in fake.calls


def test_cuda_devices_without_cuda_are_unavailable():
    probe = TorchMemoryProbe(devices="GPU:0", memory_limit=GIB)
    with pytest.warns(UserWarning, match="no CUDA device GPU:0"):
        (sample,) = probe.sample()
    assert sample.current_bytes is None and probe.mode == "unavailable"


def test_a_failing_setup_reads_nothing_and_warns(monkeypatch):
    def broken():
        raise RuntimeError("driver too old")

    FakeCuda().install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    probe = TorchMemoryProbe()
    with pytest.warns(UserWarning, match="could not start"):
        assert probe.sample() == ()
    assert probe.devices == ()


@pytest.mark.skipif(not REAL_CUDA, reason="Needs a CUDA device.")
def test_real_cuda_allocations_show_in_the_probe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", _real_is_available)
    probe = TorchMemoryProbe(devices="cuda")
    probe.reset()
    held = torch.ones(64 * MIB // 4, device="cuda")
    transient = torch.ones(128 * MIB // 4, device="cuda")
    del transient
    (sample,) = probe.sample()
    assert sample.current_bytes == torch.cuda.memory_allocated()
    assert sample.peak_bytes - sample.current_bytes >= 128 * MIB
    assert probe.reserved_bytes("GPU:0") >= sample.current_bytes >= held.numel() * 4
    assert probe.limit_source("GPU:0") in ("device", "memory_fraction")
    (after,) = probe.sample()
    assert after.peak_bytes == after.current_bytes


# --- Arguments ----------------------------------------------------------


@pytest.mark.parametrize(
    "device, expected",
    [
        ("GPU:0", "GPU:0"),
        ("gpu1", "GPU:1"),
        ("cuda:2", "GPU:2"),
        ("/device:GPU:3", "GPU:3"),
        ("cpu", "CPU:0"),
        ("CPU:0", "CPU:0"),
        (torch.device("cuda", 1), "GPU:1"),
        (torch.device("cpu"), "CPU:0"),
        ("cuda", None),
        ("mps", None),
        (3, None),
    ],
)
def test_normalize_device(device, expected):
    assert normalize_device(device) == expected


@pytest.mark.parametrize("devices", [[], "tpu:0", ["GPU:0", "mps"], "CPU:1", [7]])
def test_bad_devices_raise_and_echo(devices):
    with pytest.raises(ValueError, match="Received: devices="):
        TorchMemoryProbe(devices=devices)


@pytest.mark.parametrize(
    "memory_limit", [0, -1, 1.5, "8G", True, {"tpu:0": GIB}, {"GPU:0": 0}, {"cuda": GIB}]
)
def test_bad_memory_limit_raises_and_echoes(memory_limit):
    with pytest.raises(ValueError, match="Received: memory_limit"):
        TorchMemoryProbe(memory_limit=memory_limit)


@pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")
def test_unknown_device_in_a_query_raises():
    probe = TorchMemoryProbe(memory_limit=GIB)
    with pytest.raises(ValueError, match="does not read device 'GPU:0'"):
        probe.limit_bytes("GPU:0")


def test_stray_memory_limit_keys_are_warned_about(monkeypatch):
    FakeCuda().install(monkeypatch)
    probe = TorchMemoryProbe(memory_limit={"GPU:0": GIB, "GPU:1": GIB})
    with pytest.warns(UserWarning, match=r"names devices the probe does not read: \['GPU:1'\]"):
        assert probe.devices == ("GPU:0",)


# --- Wiring -------------------------------------------------------------


def test_backend_probe_is_the_torch_probe():
    import keras

    from keras_memguard.callbacks.sampling import backend_probe

    assert keras.backend.backend() == "torch"
    probe = backend_probe(memory_limit=GIB)
    assert isinstance(probe, TorchMemoryProbe)
    assert probe.limit_bytes("CPU:0") == GIB


def test_nvml_asks_torch_whether_a_gpu_is_there(monkeypatch):
    assert nvml_module._backend_sees_gpu() is False
    FakeCuda(count=1).install(monkeypatch)
    assert nvml_module._backend_sees_gpu() is True
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert nvml_module._backend_sees_gpu() is False


def _fake_pynvml(count):
    """The part of pynvml that `NvmlProbe` needs to map and read GPUs."""
    fake = types.ModuleType("pynvml")
    memory = types.SimpleNamespace(total=80 * GIB, used=GIB, free=79 * GIB)
    fake.nvmlInit = fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: count
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    fake.nvmlDeviceGetIndex = lambda handle: handle[1]
    fake.nvmlDeviceGetMemoryInfo = lambda handle: memory
    fake.nvmlDeviceGetComputeRunningProcesses = lambda handle: []
    fake.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=7)
    return fake


@pytest.mark.parametrize(
    "cuda_visible_devices, expected", [(None, {0: 0, 1: 1}), ("3,1", {0: 3, 1: 1})]
)
def test_torch_cuda_devices_map_to_nvml_indices(monkeypatch, cuda_visible_devices, expected):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(4))
    if cuda_visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
    FakeCuda(count=2).install(monkeypatch)
    probe = TorchMemoryProbe(devices=["cuda:0", "cuda:1"])
    nvml = nvml_module.NvmlProbe(tf_gpu_ordinals=probe.cuda_indices)
    assert nvml.nvml_indices == expected
    samples = nvml.sample()
    # The NVML rows carry the torch probe's device names: one tag per GPU.
    assert [s.device for s in samples] == [s.device for s in probe.sample()]
    assert [s.nvml_index for s in samples] == list(expected.values())
    nvml.close()
