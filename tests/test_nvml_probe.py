"""NvmlProbe: the real no-driver path here, and a fake `pynvml` for GPUs.

This machine has no NVIDIA driver, so the GPU paths run against a fake
`pynvml` module put in `sys.modules`: the one seam the probe imports through.
Whether the backend sees a GPU (which decides between a warning and a quiet
INFO log when NVML is missing) is asked through `nvml._backend_sees_gpu`;
tests of a GPU machine set it to True.
"""

import logging
import os
import sys
import types
import warnings

import pynvml
import pytest

from keras_memguard.probes import NvmlProbe
from keras_memguard.probes import NvmlSample
from keras_memguard.probes import nvml as nvml_module

GIB = 2**30


class FakeGpu:
    def __init__(self, uuid, total_gib=80, used_gib=6, util=42, processes=(),
                 reserved_gib=0.0):
        self.uuid = uuid
        self.total = total_gib * GIB
        self.used = used_gib * GIB
        # Memory the driver keeps for itself: "used" in NVML's memory info
        # version 1, apart in version 2.
        self.reserved = int(reserved_gib * GIB)
        self.util = util
        # Pairs (pid, usedGpuMemory).
        self.processes = list(processes)
        self.fail = set()  # Query names that raise.


def make_fake_pynvml(gpus, migs=None, memory_v2=False):
    """A module-like object with the part of pynvml the probe uses.

    Handles are `("gpu", index)` or `("mig", uuid)`; errors are real
    `pynvml.NVMLError`s, as NVML raises them. With `memory_v2`, the memory
    info's version 2 is there (a driver from R510 on): bindings that have
    `nvmlMemory_v2` on a driver without it raise NVML's "function not
    found".
    """
    migs = migs or {}  # MIG uuid -> (parent index, FakeGpu of the slice)
    fake = types.ModuleType("pynvml")
    fake.NVMLError = pynvml.NVMLError
    fake.nvmlMemory_v2 = pynvml.nvmlMemory_v2
    fake.init_calls = 0
    fake.shutdown_calls = 0

    def gpu_of(handle):
        kind, key = handle
        return gpus[key] if kind == "gpu" else migs[key][1]

    def check(handle, query):
        if query in gpu_of(handle).fail:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlInit():
        fake.init_calls += 1

    def nvmlShutdown():
        fake.shutdown_calls += 1

    def nvmlDeviceGetHandleByIndex(index):
        if not 0 <= index < len(gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("gpu", index)

    def nvmlDeviceGetHandleByUUID(uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(gpus):
            if gpu.uuid == uuid:
                return ("gpu", i)
        if uuid in migs:
            return ("mig", uuid)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(handle):
        kind, key = handle
        return gpus[key].uuid if kind == "gpu" else key

    def nvmlDeviceGetIndex(handle):
        kind, key = handle
        if kind != "gpu":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return key

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
        return ("gpu", migs[handle[1]][0])

    def nvmlDeviceGetMemoryInfo(handle, version=None):
        check(handle, "memory")
        gpu = gpu_of(handle)
        free = gpu.total - gpu.used - gpu.reserved
        if version is None:
            return types.SimpleNamespace(total=gpu.total, used=gpu.used + gpu.reserved, free=free)
        if version != pynvml.nvmlMemory_v2 or not memory_v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return types.SimpleNamespace(
            total=gpu.total, reserved=gpu.reserved, used=gpu.used, free=free
        )

    def nvmlDeviceGetComputeRunningProcesses(handle):
        check(handle, "processes")
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in gpu_of(handle).processes
        ]

    def nvmlDeviceGetUtilizationRates(handle):
        check(handle, "utilization")
        return types.SimpleNamespace(gpu=gpu_of(handle).util, memory=10)

    for function in [
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetHandleByUUID,
        nvmlDeviceGetUUID,
        nvmlDeviceGetIndex,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
        nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetComputeRunningProcesses,
        nvmlDeviceGetUtilizationRates,
    ]:
        setattr(fake, function.__name__, function)
    fake.nvmlDeviceGetCount = lambda: len(gpus)
    return fake


UUIDS = [
    "GPU-aaaa1111-0000-0000-0000-000000000000",
    "GPU-bbbb2222-0000-0000-0000-000000000000",
    "GPU-bbbb3333-0000-0000-0000-000000000000",
    "GPU-cccc4444-0000-0000-0000-000000000000",
]
MIG_UUID = "MIG-dddd5555-0000-0000-0000-000000000000"


@pytest.fixture
def tf_sees_gpu(monkeypatch):
    """TensorFlow sees a GPU, as on a GPU machine."""
    monkeypatch.setattr(nvml_module, "_backend_sees_gpu", lambda: True)


@pytest.fixture
def fake_nvml(monkeypatch, tf_sees_gpu):
    """Installs a fake pynvml with four GPUs and one MIG slice on GPU 3."""
    gpus = [FakeGpu(uuid, total_gib=10 * (i + 1)) for i, uuid in enumerate(UUIDS)]
    migs = {MIG_UUID: (3, FakeGpu(MIG_UUID, total_gib=10, used_gib=2))}
    fake = make_fake_pynvml(gpus, migs)
    fake.gpus = gpus
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return fake


def _no_driver():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return True
    pynvml.nvmlShutdown()
    return False


@pytest.mark.skipif(not _no_driver(), reason="An NVIDIA driver is present.")
def test_no_driver_and_no_gpu_is_silent_with_one_info_log(caplog):
    assert nvml_module._backend_sees_gpu() is False
    probe = NvmlProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="keras_memguard"):
            assert probe.available is False
            assert probe.sample() == ()
            assert probe.total_bytes(0) is None
    assert caught == []
    records = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "nvmlInit() failed" in records[0].getMessage()
    probe.close()


def test_missing_pynvml_without_a_gpu_is_silent(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(nvml_module, "_backend_sees_gpu", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="keras_memguard"):
            assert NvmlProbe().available is False
    assert caught == []
    assert any("pip install nvidia-ml-py" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not _no_driver(), reason="An NVIDIA driver is present.")
def test_unavailable_without_a_driver_warns_once_and_samples_nothing(tf_sees_gpu):
    probe = NvmlProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = probe.available
        samples = probe.sample()
        total = probe.total_bytes(0)
        probe.sample()
    assert available is False
    assert samples == ()
    assert total is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "nvmlInit() failed" in message and "HINT" in message
    assert caught[0].filename == __file__
    probe.close()


def test_missing_pynvml_warns_with_install_hint(monkeypatch, tf_sees_gpu):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    probe = NvmlProbe()
    with pytest.warns(UserWarning, match="pip install nvidia-ml-py"):
        assert probe.available is False
    assert probe.sample() == ()


def test_no_gpu_is_unavailable(monkeypatch, tf_sees_gpu):
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml([]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.warns(UserWarning, match="no visible GPU"):
        assert NvmlProbe().sample() == ()


@pytest.mark.parametrize(
    "cuda_visible_devices, expected",
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        (" 3 , 1 ", [3, 1]),
        (UUIDS[1], [1]),
        (f"1,{UUIDS[0]}", [1, 0]),
        ("GPU-cccc", [3]),  # A unique UUID prefix, as CUDA accepts.
        ("GPU-bbbb,0", []),  # An ambiguous prefix ends the list.
        (MIG_UUID, [3]),  # A MIG slice reports its parent's index.
        ("0,-1,1", [0]),  # CUDA stops at the first invalid entry.
        ("1,7,2", [1]),
        ("0,0,1", [0]),
        ("-1", []),
        ("", []),
    ],
)
def test_cuda_visible_devices_maps_tf_ordinals_to_nvml_indices(
    fake_nvml, monkeypatch, cuda_visible_devices, expected
):
    if cuda_visible_devices is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
    probe = NvmlProbe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        indices = probe.nvml_indices
        samples = probe.sample()
    assert indices == dict(enumerate(expected))
    assert [s.nvml_index for s in samples] == expected
    assert [s.device for s in samples] == [f"gpu{i}" for i in range(len(expected))]
    assert probe.available is bool(expected)
    assert len(caught) == (0 if expected else 1)


def test_sample_values_come_from_nvml(fake_nvml, monkeypatch):
    pid = os.getpid()
    fake_nvml.gpus[0].processes = [(pid, 3 * GIB), (pid + 1, 5 * GIB), (pid, GIB)]
    fake_nvml.gpus[1].processes = [(pid, None)]  # NVML: "not available".
    fake_nvml.gpus[2].processes = [(pid + 1, GIB)]  # PID not seen (container).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second, third = NvmlProbe().sample()
    assert first == NvmlSample(
        device="gpu0",
        nvml_index=0,
        total_bytes=10 * GIB,
        used_bytes=6 * GIB,
        free_bytes=4 * GIB,
        process_bytes=4 * GIB,
        gpu_utilization_percent=42,
    )
    assert first.source == "nvml"
    assert second.process_bytes is None
    assert third.process_bytes is None
    assert (second.total_bytes, third.total_bytes) == (20 * GIB, 30 * GIB)


@pytest.mark.parametrize("memory_v2, used_gib", [(True, 6), (False, 6.5)])
def test_used_memory_leaves_out_the_driver_s_reserve_where_the_driver_can(
    monkeypatch, tf_sees_gpu, caplog, memory_v2, used_gib
):
    # As on an H100 (driver 580): NVML's version 1 "used" was 480 MiB above
    # nvidia-smi's, the driver's reserve; version 2 agreed with nvidia-smi.
    gpu = FakeGpu(UUIDS[0], total_gib=80, used_gib=6, reserved_gib=0.5)
    monkeypatch.setitem(sys.modules, "pynvml", make_fake_pynvml([gpu], memory_v2=memory_v2))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = NvmlProbe()
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        for _ in range(2):
            (reading,) = probe.sample()
            assert reading.used_bytes == used_gib * GIB
            assert reading.free_bytes == 73.5 * GIB
            assert reading.total_bytes == 80 * GIB
    # A driver without version 2 is no fault: nothing is logged.
    assert not caplog.records


def test_tf_gpu_ordinals_select_and_unknown_ones_warn(fake_nvml, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    probe = NvmlProbe(tf_gpu_ordinals=[1, 5])
    with pytest.warns(UserWarning, match=r"ordinal\(s\) \[5\]"):
        (sample,) = probe.sample()
    assert (sample.device, sample.nvml_index) == ("gpu1", 3)
    assert probe.total_bytes(1) == 40 * GIB
    assert probe.total_bytes(0) is None  # Not requested.
    assert probe.total_bytes(5) is None


def test_failing_query_mid_run_gives_none_and_logs_once(fake_nvml, caplog):
    probe = NvmlProbe()
    assert probe.sample()[1].total_bytes == 20 * GIB
    fake_nvml.gpus[1].fail = {"memory", "utilization"}
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        for _ in range(3):
            samples = probe.sample()
    gpu1 = samples[1]
    assert (gpu1.total_bytes, gpu1.used_bytes, gpu1.free_bytes) == (None,) * 3
    assert gpu1.gpu_utilization_percent is None
    assert gpu1.process_bytes is None  # No process of ours listed.
    assert samples[0].total_bytes == 10 * GIB  # Other GPUs unaffected.
    records = [r for r in caplog.records if r.name == "keras_memguard"]
    assert len(records) == 2  # Once per failing query, not per sample.
    assert all(r.levelno == logging.WARNING for r in records)
    assert all("gpu1" in r.getMessage() for r in records)
    assert all("HINT" in r.getMessage() for r in records)
    fake_nvml.gpus[1].fail = set()
    assert probe.sample()[1].total_bytes == 20 * GIB


def test_nvml_starts_once_and_close_shuts_it_down(fake_nvml):
    probe = NvmlProbe()
    probe.available
    probe.sample()
    probe.total_bytes(0)
    assert fake_nvml.init_calls == 1
    probe.close()
    probe.close()
    assert fake_nvml.shutdown_calls == 1
    assert probe.sample() == ()


def test_failing_nvml_init_is_unavailable(fake_nvml):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    fake_nvml.nvmlInit = fail
    with pytest.warns(UserWarning, match="HINT"):
        assert NvmlProbe().available is False


@pytest.mark.parametrize("ordinals", [-1, [0, -1], ["0"], [True], "01", 1.0])
def test_bad_tf_gpu_ordinals_raise_and_echo(ordinals):
    with pytest.raises(ValueError, match="Received: tf_gpu_ordinals="):
        NvmlProbe(tf_gpu_ordinals=ordinals)
