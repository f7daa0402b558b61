"""AllocatorProbe against TensorFlow's real allocator.

The pytest process runs under the BFC CPU allocator with an 8 GiB cap
(conftest.py). Other allocator modes need their own processes: two tests
start them, concurrently where they can, as each costs seconds.
"""

import json
import os
import re
import subprocess
import warnings

import pytest
import tensorflow as tf

import keras_memguard.probes as probes_module
from keras_memguard import AllocatorProbe
from keras_memguard.probes import AllocatorSample
from keras_memguard.probes.base import MIB
from keras_memguard.backends.tensorflow.probe import cpu_bfc_limit_bytes
from keras_memguard.backends.tensorflow.probe import logical_device_limits
from keras_memguard.testing import RESULT_MARKER
from keras_memguard.testing import run_with_memory_cap
import programs

FLOATS_16_MIB = 4 * MIB  # float32 elements in 16 MiB
# Set by conftest.py before TensorFlow was imported.
SUITE_MEMORY_LIMIT_MIB = int(os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"])


def _memory_info():
    return tf.config.experimental.get_memory_info("CPU:0")


def test_probes_all_is_sorted_and_complete():
    assert probes_module.__all__ == sorted(probes_module.__all__)
    # Framework-free: each backend's own probe is in its backend's folder.
    assert set(probes_module.__all__) == {
        "AllocatorSample",
        "NvmlProbe",
        "NvmlSample",
    }


def test_sample_agrees_with_get_memory_info_and_peak_is_per_interval():
    probe = AllocatorProbe()
    assert probe.devices == ("CPU:0",)
    probe.reset()
    base = _memory_info()["current"]

    x = tf.zeros([FLOATS_16_MIB])
    (s,) = probe.sample()
    assert isinstance(s, AllocatorSample)
    assert (s.device, s.tf_device, s.source) == ("cpu0", "CPU:0", "allocator")
    assert isinstance(s.current_bytes, int) and isinstance(s.peak_bytes, int)
    assert s.current_bytes - base >= 16 * MIB
    assert s.peak_bytes >= s.current_bytes
    # The sample reset the peak: TensorFlow now reports the same current,
    # with the peak back at it.
    assert _memory_info() == {"current": s.current_bytes, "peak": s.current_bytes}

    del x
    (s,) = probe.sample()
    assert s.current_bytes < base + 16 * MIB
    # The interval began with the tensor still alive.
    assert s.peak_bytes >= base + 16 * MIB
    (s,) = probe.sample()
    assert s.peak_bytes < base + 16 * MIB


def test_peak_catches_a_temporary_the_current_misses():
    # What a training step does: a large intermediate freed before it returns.
    # A runtime input keeps grappler from folding the 32 MiB away.
    @tf.function
    def step(value):
        return tf.reduce_sum(tf.fill([2 * FLOATS_16_MIB], value))

    value = tf.constant(1.0)
    step(value)  # Trace outside the measured interval.
    probe = AllocatorProbe(devices=["CPU:0"])
    probe.reset()
    base = _memory_info()["current"]
    step(value)
    (s,) = probe.sample()
    assert s.peak_bytes - base >= 32 * MIB
    assert s.current_bytes - base < MIB


def test_reset_drops_the_earlier_peak():
    probe = AllocatorProbe()
    base = _memory_info()["current"]
    x = tf.zeros([FLOATS_16_MIB])
    del x
    assert probe.reset() is None
    (s,) = probe.sample()
    assert s.peak_bytes < base + 16 * MIB


class _Consumer:
    """A callback's stand-in: anything weak-referenceable registers."""


def test_a_reading_aside_keeps_its_blocks_out_of_every_consumers_peak():
    from keras_memguard.callbacks.sampling import SharedAllocatorReader

    reader = SharedAllocatorReader(AllocatorProbe())
    guard, monitor = _Consumer(), _Consumer()
    reader.register(guard)
    reader.register(monitor)
    reader.reset()
    base = _memory_info()["current"]
    x = tf.zeros([FLOATS_16_MIB])  # the batch's data, before the guard plans
    del x
    reader.read(guard)  # the guard's reading before the batch
    # Blocks the guard takes and frees itself (a compiled step's tries).
    tried = tf.zeros([4 * FLOATS_16_MIB])
    del tried
    reader.read_aside()
    guard_peak, = (s.peak_bytes for s in reader.read(guard, key=1))
    monitor_peak, = (s.peak_bytes for s in reader.read(monitor, key=1))
    assert guard_peak < base + 16 * MIB
    # The monitor keeps what it had pending before the guard's reading,
    # and not the blocks read aside.
    assert base + 16 * MIB <= monitor_peak < base + 64 * MIB


def test_limit_from_the_suite_bfc_env():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = AllocatorProbe()
        (s,) = probe.sample()
    assert caught == []
    assert probe.mode == "bfc"
    assert probe.device_mode("CPU:0") == "bfc"
    assert probe.limit_bytes("CPU:0") == SUITE_MEMORY_LIMIT_MIB * MIB
    assert probe.limit_source("cpu0") == "cpu_bfc_env"
    assert s.limit_bytes == SUITE_MEMORY_LIMIT_MIB * MIB
    assert s.usage == s.peak_bytes / (SUITE_MEMORY_LIMIT_MIB * MIB)


@pytest.mark.parametrize(
    "memory_limit",
    [64 * MIB, 64.0 * MIB, {"CPU:0": 64 * MIB}, {"/device:CPU:0": 64 * MIB}],
)
def test_explicit_memory_limit_wins(memory_limit):
    probe = AllocatorProbe(memory_limit=memory_limit)
    x = tf.zeros([FLOATS_16_MIB])
    (s,) = probe.sample()
    del x
    assert probe.limit_bytes("CPU:0") == 64 * MIB
    assert isinstance(probe.limit_bytes("CPU:0"), int)
    assert probe.limit_source("CPU:0") == "user"
    assert s.limit_bytes == 64 * MIB
    assert s.usage == s.peak_bytes / (64 * MIB)
    assert s.usage >= 0.25


def test_devices_accept_full_names_of_shared_logical_cpus():
    # Names as `strategy.extended.worker_devices` gives them.
    probe = AllocatorProbe(
        devices=["/job:localhost/replica:0/task:0/device:CPU:0", "cpu:0"]
    )
    assert probe.devices == ("CPU:0",)
    assert [s.device for s in probe.sample()] == ["cpu0"]


def test_device_tensorflow_lacks_reads_none_and_warns_once():
    probe = AllocatorProbe(devices=["CPU:0", "GPU:0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = probe.sample()
        second = probe.sample()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "GPU:0" in message and "HINT" in message
    # The warning points at the caller, not into the probe.
    assert caught[0].filename == __file__
    cpu, gpu = second
    assert cpu.current_bytes is not None and first[0].peak_bytes is not None
    assert (gpu.device, gpu.current_bytes, gpu.peak_bytes) == ("gpu0", None, None)
    assert gpu.limit_bytes is None and gpu.usage is None
    assert probe.device_mode("GPU:0") == "unavailable"
    assert probe.mode == "unavailable"
    assert probe.limit_source("GPU:0") == "unknown"


def test_limit_of_a_device_the_probe_does_not_read_raises():
    probe = AllocatorProbe()
    with pytest.raises(ValueError, match=re.escape("'GPU:3'")):
        probe.limit_bytes("GPU:3")


@pytest.mark.parametrize(
    "kwargs, echoed",
    [
        ({"memory_limit": -3}, "Received: memory_limit=-3"),
        ({"memory_limit": 0}, "Received: memory_limit=0"),
        ({"memory_limit": 1.5}, "Received: memory_limit=1.5"),
        ({"memory_limit": True}, "Received: memory_limit=True"),
        ({"memory_limit": "8GB"}, "Received: memory_limit='8GB'"),
        (
            {"memory_limit": {"CPU:0": -1}},
            "Received: memory_limit['CPU:0']=-1",
        ),
        ({"memory_limit": {"TPU:0": 5}}, "Received: memory_limit={'TPU:0': 5}"),
        (
            {"devices": ["CPU:0"], "memory_limit": {"GPU:0": 2**30}},
            "Received: memory_limit={'GPU:0': 1073741824}",
        ),
        ({"devices": []}, "Received: devices=[]"),
        ({"devices": "TPU:0"}, "Received: devices='TPU:0'"),
        ({"devices": ["GPU:x"]}, "Received: devices=['GPU:x']"),
        ({"devices": 0}, "Received: devices=0"),
    ],
)
def test_bad_arguments_raise_and_echo_the_value(kwargs, echoed):
    with pytest.raises(ValueError, match=re.escape(echoed)):
        AllocatorProbe(**kwargs)


def test_memory_limit_under_one_mib_warns_it_is_bytes():
    with pytest.warns(UserWarning, match="not MiB"):
        AllocatorProbe(memory_limit=8192)


@pytest.mark.parametrize(
    "use_bfc, limit_mib, expected",
    [
        ("true", "300", 300 * MIB),
        ("TRUE", "300", 300 * MIB),
        ("1", None, 65536 * MIB),  # TensorFlow's default cap.
        ("true", "abc", 65536 * MIB),
        ("false", "300", None),
        (None, "300", None),
    ],
)
def test_cpu_bfc_limit_follows_tensorflow_env_rules(
    monkeypatch, use_bfc, limit_mib, expected
):
    for name, value in [
        ("TF_CPU_ALLOCATOR_USE_BFC", use_bfc),
        ("TF_CPU_BFC_MEM_LIMIT_IN_MB", limit_mib),
    ]:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cpu_bfc_limit_bytes() == expected


def test_logical_device_limits_number_virtual_devices_across_physical():
    config = tf.config.LogicalDeviceConfiguration
    limits = logical_device_limits(
        [
            ("/physical_device:GPU:0", [config(memory_limit=1024), config(2048)]),
            ("/physical_device:GPU:1", None),
            ("/physical_device:CPU:0", [config(), config()]),
        ]
    )
    assert limits == {
        "GPU:0": (0, 1024 * MIB),
        "GPU:1": (0, 2048 * MIB),
        "GPU:2": (1, None),
        "CPU:0": (0, None),
        "CPU:1": (0, None),
    }



@pytest.mark.slow
def test_limit_under_a_real_300_mib_cap():
    run = run_with_memory_cap(
        programs.source("allocator_limit_under_cap"), memory_limit_mib=300, timeout=120
    )
    result = run.result
    assert result["mode"] == "bfc"
    assert result["limit"] == 300 * MIB
    assert result["source"] == "cpu_bfc_env"
    assert result["peak"] >= 200 * MIB
    assert result["usage"] == pytest.approx(result["peak"] / (300 * MIB))
    assert 0.66 < result["usage"] <= 1.0
    assert result["user_limit"] == 2**30
    assert result["warnings"] == []



def _start_mode_process(onednn):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB")
    }
    env["TF_ENABLE_ONEDNN_OPTS"] = onednn
    return subprocess.Popen(
        programs.command("allocator_modes"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result_of(process):
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-4000:]
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(f"No result.\n{stdout[-2000:]}\n{stderr[-4000:]}")


@pytest.mark.slow
def test_default_and_unavailable_modes_without_bfc():
    # Each mode is fixed at TensorFlow import: one process each, run together.
    default_process = _start_mode_process(onednn="1")
    unavailable_process = _start_mode_process(onednn="0")
    default = _result_of(default_process)
    unavailable = _result_of(unavailable_process)

    assert default["mode"] == "default"
    assert (default["source"], default["limit"]) == ("unknown", None)
    # Warned exactly once over four samples, pointing at the caller.
    assert len(default["warnings"]) == 1
    message, filename = default["warnings"][0]
    assert "small allocations" in message
    assert "no memory limit is known" in message
    assert "HINT" in message and "TF_CPU_ALLOCATOR_USE_BFC=true" in message
    assert filename == str(programs.path("allocator_modes"))
    for current, peak, usage in default["samples"]:
        assert isinstance(current, int) and isinstance(peak, int)
        assert usage is None
    # Small allocations are invisible; a 16 MiB tensor is counted.
    assert default["samples"][0][0] == 0
    assert default["samples"][-1][0] >= 16 * MIB

    assert unavailable["mode"] == "unavailable"
    assert unavailable["source"] == "unknown"
    assert len(unavailable["warnings"]) == 1
    message, _ = unavailable["warnings"][0]
    assert "no allocator statistics" in message
    assert "HINT: set TF_CPU_ALLOCATOR_USE_BFC=true" in message
    assert unavailable["samples"] == [[None, None, None]] * 4
    # find_batch_size on such readings: a clear refusal, the weights kept
    # (it tried 8.8e12 samples and raised numpy's MemoryError).
    # A default guard on a model that fits trains as plain `fit` does on
    # both. With no reading at all it used to hold its cautious first
    # split of 8 for the whole run, 0.26 from plain `fit`'s weights
    # (BatchNormalization's statistics per micro-batch); now it says it
    # cannot plan and trains whole batches.
    guarded = unavailable["guarded"]
    assert guarded["micro_batches"] == [1, 1], guarded
    assert guarded["difference"] <= 1e-6, guarded
    told = [m for m in guarded["messages"] if "cannot plan micro-batches" in m]
    # Once per guard: the MLP's and the own step's.
    assert len(told) == 2 and "CPU:0 keeps no memory statistics" in told[0], guarded
    # `evaluate` after a `fit` of a model with its own `train_step`: one
    # pass a batch (3 batches), not the cautious 8 slices held each batch.
    assert guarded["own_step_evaluate_passes"] == 3, guarded
    assert default["guarded"]["micro_batches"] == [1, 1], default["guarded"]
    assert default["guarded"]["difference"] <= 1e-6, default["guarded"]
    assert not [m for m in default["guarded"]["messages"] if "cannot plan" in m]
    for result in (default, unavailable):
        kind, message = result["search"]
        assert kind == "UnsupportedTrainingSetupError", result["search"]
        assert "cannot measure the training step on CPU:0: batch 4" in message
        assert "HINT: set TF_CPU_ALLOCATOR_USE_BFC=true" in message
        assert result["weights_kept"]
