"""configure_devices: GPU settings before TensorFlow starts, clear errors after.

There is no GPU here. The no-GPU behaviour is tested for real; the GPU paths
through the narrowest seam, TensorFlow's own `tf.config` functions replaced
by a stand-in that keeps TensorFlow's rules (an unchanged setting is
accepted, a change after initialization raises the same RuntimeError); and
the "already initialized" error wrapping on TensorFlow's real error, which
CPU logical devices raise too.
"""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import keras_memguard
from keras_memguard import devices
from keras_memguard.backends.tensorflow.probe import AllocatorProbe

MIB = 1024 * 1024
GIB = 1024 * MIB


class FakeGpus:
    """Stands in for TensorFlow's GPU configuration, with TensorFlow's rules.

    Mirrors `tensorflow/python/eager/context.py`: setting an unchanged value
    is accepted at any time; a change after initialization raises
    RuntimeError with TensorFlow's message; memory growth is refused on a
    GPU with a logical device configuration.
    """

    def __init__(self, count):
        self.gpus = [
            tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
            for i in range(count)
        ]
        self.growth = {}
        self.logical = {}
        self.initialized = False

    def install(self, monkeypatch, initialization=True):
        """Replaces the `tf.config` functions; with `initialization`, also
        the package's reading of whether TensorFlow initialized its devices
        (this test process has)."""
        real_visible = tf.config.get_visible_devices
        real_get_logical = tf.config.get_logical_device_configuration

        def get_visible_devices(device_type=None):
            if device_type == "GPU":
                return list(self.gpus)
            return real_visible(device_type)

        def get_logical_device_configuration(device):
            if device in self.gpus:
                return self.logical.get(device)
            return real_get_logical(device)

        monkeypatch.setattr(tf.config, "get_visible_devices", get_visible_devices)
        monkeypatch.setattr(
            tf.config, "get_logical_device_configuration", get_logical_device_configuration
        )
        monkeypatch.setattr(
            tf.config, "set_logical_device_configuration", self.set_logical
        )
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", self.set_growth)
        if initialization:
            monkeypatch.setattr(devices, "_tensorflow_initialized", lambda: self.initialized)
        return self

    def set_growth(self, device, enable):
        assert device in self.gpus
        if device in self.logical:
            raise ValueError(
                "Cannot set memory growth on device when virtual devices configured"
            )
        if self.growth.get(device) == enable:
            return
        if self.initialized:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.growth[device] = enable

    def set_logical(self, device, configurations):
        assert device in self.gpus
        if self.logical.get(device) == configurations:
            return
        if self.initialized:
            raise RuntimeError("Virtual devices cannot be modified after being initialized")
        self.logical[device] = configurations


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(devices, "_configured", {})
    monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)


@pytest.fixture
def two_gpus(monkeypatch):
    return FakeGpus(2).install(monkeypatch)


def test_is_public_and_documented():
    assert keras_memguard.configure_devices is devices.configure_devices
    assert keras_memguard.configured_memory_limits is devices.configured_memory_limits
    assert issubclass(keras_memguard.DevicesAlreadyInitializedError, RuntimeError)


# --- GPUs (stand-in) ---


def test_memory_limit_in_bytes_becomes_a_logical_device_in_mib(two_gpus):
    limits = keras_memguard.configure_devices(memory_limit=3 * GIB)
    for gpu in two_gpus.gpus:
        assert two_gpus.logical[gpu] == [
            tf.config.LogicalDeviceConfiguration(memory_limit=3 * 1024)
        ]
    assert limits == {"GPU:0": 3 * GIB, "GPU:1": 3 * GIB}
    assert keras_memguard.configured_memory_limits() == limits


def test_limit_is_rounded_down_to_whole_mib_and_per_gpu(two_gpus):
    limits = keras_memguard.configure_devices(memory_limit={"gpu1": 8e9})
    assert two_gpus.gpus[0] not in two_gpus.logical
    (config,) = two_gpus.logical[two_gpus.gpus[1]]
    assert config.memory_limit == 7629  # 8e9 bytes = 7629.39 MiB
    assert limits == {"GPU:1": 7629 * MIB}


def test_the_probe_reads_the_limit_that_was_set(two_gpus, monkeypatch):
    """What MemoryGuard divides by: AllocatorProbe's "logical_device" limit."""
    keras_memguard.configure_devices(memory_limit={"GPU:0": 2 * GIB, "GPU:1": 5 * GIB})
    real_logical = tf.config.list_logical_devices
    real_info = tf.config.experimental.get_memory_info
    monkeypatch.setattr(
        tf.config,
        "list_logical_devices",
        lambda kind=None: [
            tf.config.LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(2)
        ]
        if kind == "GPU"
        else real_logical(kind),
    )
    monkeypatch.setattr(
        tf.config.experimental,
        "get_memory_info",
        lambda device: {"current": 0, "peak": 0}
        if device.startswith("GPU")
        else real_info(device),
    )
    probe = AllocatorProbe()
    assert probe.devices == ("GPU:0", "GPU:1")
    for device, expected in keras_memguard.configured_memory_limits().items():
        assert probe.limit_source(device) == "logical_device"
        assert probe.limit_bytes(device) == expected
    assert probe.limit_bytes("GPU:1") == 5 * GIB


def test_memory_growth_on_every_gpu(two_gpus):
    assert keras_memguard.configure_devices(memory_growth=True) == {}
    assert two_gpus.growth == {gpu: True for gpu in two_gpus.gpus}


def test_memory_growth_false_skips_gpus_with_a_limit(two_gpus):
    keras_memguard.configure_devices(memory_growth=False, memory_limit={"GPU:0": GIB})
    assert two_gpus.growth == {two_gpus.gpus[1]: False}
    assert list(two_gpus.logical) == [two_gpus.gpus[0]]


def test_allocator_sets_and_removes_the_variable(two_gpus):
    keras_memguard.configure_devices(allocator="cuda_malloc_async")
    assert os.environ["TF_GPU_ALLOCATOR"] == "cuda_malloc_async"
    two_gpus.initialized = True
    # Unchanged: accepted after initialization.
    keras_memguard.configure_devices(allocator="cuda_malloc_async")
    with pytest.raises(keras_memguard.DevicesAlreadyInitializedError, match="allocator='bfc'"):
        keras_memguard.configure_devices(allocator="bfc")
    two_gpus.initialized = False
    keras_memguard.configure_devices(allocator="bfc")
    assert "TF_GPU_ALLOCATOR" not in os.environ


def test_after_initialization_a_change_raises_a_clear_error(two_gpus):
    keras_memguard.configure_devices(memory_limit=GIB)
    two_gpus.initialized = True
    # The same call again changes nothing and is accepted, as TensorFlow does.
    assert keras_memguard.configure_devices(memory_limit=GIB) == {
        "GPU:0": GIB,
        "GPU:1": GIB,
    }
    with pytest.raises(keras_memguard.DevicesAlreadyInitializedError) as info:
        keras_memguard.configure_devices(memory_limit=2 * GIB)
    message = str(info.value)
    assert "memory_limit=2147483648" in message
    assert "already initialized" in message
    assert "Virtual devices cannot be modified after being initialized" in message
    assert "before any TensorFlow op runs" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    # Nothing changed.
    assert keras_memguard.configured_memory_limits() == {"GPU:0": GIB, "GPU:1": GIB}


def test_memory_growth_after_initialization_names_the_setting(two_gpus):
    two_gpus.initialized = True
    with pytest.raises(keras_memguard.DevicesAlreadyInitializedError, match=r"memory_growth=True"):
        keras_memguard.configure_devices(memory_growth=True)


def test_allocator_after_real_initialization_raises(monkeypatch):
    FakeGpus(1).install(monkeypatch, initialization=False)
    tf.constant(1.0) + 1.0  # TensorFlow (really) initializes its devices.
    assert devices._tensorflow_initialized() is True
    with pytest.raises(
        keras_memguard.DevicesAlreadyInitializedError,
        match=r"allocator='cuda_malloc_async'.*TF_GPU_ALLOCATOR",
    ):
        keras_memguard.configure_devices(allocator="cuda_malloc_async")
    assert "TF_GPU_ALLOCATOR" not in os.environ


def test_a_gpu_that_does_not_exist_is_named(two_gpus):
    with pytest.raises(ValueError, match=r"\['GPU:2'\].*Visible GPUs: \['GPU:0', 'GPU:1'\]"):
        keras_memguard.configure_devices(memory_limit={"GPU:2": GIB})


# --- TensorFlow's real "already initialized" error ---


def test_real_tensorflow_error_is_wrapped():
    tf.constant(1.0) + 1.0
    (cpu,) = tf.config.list_physical_devices("CPU")
    two = [tf.config.LogicalDeviceConfiguration()] * 2
    with pytest.raises(keras_memguard.DevicesAlreadyInitializedError) as info:
        with devices._before_initialization("the CPU split"):
            tf.config.set_logical_device_configuration(cpu, two)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "cannot be modified after being initialized" in str(info.value.__cause__)
    assert "configure_devices cannot apply the CPU split" in str(info.value)


def test_other_runtime_errors_pass_through():
    with pytest.raises(RuntimeError, match="^something else$"):
        with devices._before_initialization("x"):
            raise RuntimeError("something else")


@pytest.mark.slow
def test_before_and_after_initialization_in_a_fresh_process(tmp_path):
    """Real TensorFlow on the CPU, from a process that has not started it."""
    code = textwrap.dedent(
        """
        import logging, warnings
        import tensorflow as tf
        import keras
        import keras_memguard
        from keras_memguard import devices

        logging.basicConfig(level=logging.INFO)
        assert devices._tensorflow_initialized() is False
        # No GPU: growth is a no-op, the allocator variable is set.
        assert keras_memguard.configure_devices(
            memory_growth=True, allocator="cuda_malloc_async") == {}
        # Before initialization TensorFlow's own setters work (two CPUs).
        (cpu,) = tf.config.list_physical_devices("CPU")
        with devices._before_initialization("two CPUs"):
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        assert devices._tensorflow_initialized() is True
        assert len(tf.config.list_logical_devices("CPU")) == 2
        try:
            with devices._before_initialization("three CPUs"):
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * 3)
        except keras_memguard.DevicesAlreadyInitializedError as error:
            print("ERROR", error)
        # Still fine without a GPU: nothing to change.
        keras_memguard.configure_devices(memory_growth=True)
        print("DONE")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERROR configure_devices cannot apply three CPUs" in run.stdout
    assert "DONE" in run.stdout
    assert "TensorFlow sees no GPU; memory_growth=True has nothing to act on" in run.stderr
    assert "TF_GPU_ALLOCATOR=cuda_malloc_async is set" in run.stderr


# --- No GPU (this machine, for real) ---


def test_no_gpu_memory_growth_is_a_no_op_with_an_info_line(caplog):
    assert tf.config.get_visible_devices("GPU") == []
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        assert keras_memguard.configure_devices(memory_growth=True) == {}
    assert "TensorFlow sees no GPU; memory_growth=True has nothing to act on" in caplog.text


def test_no_gpu_memory_limit_warns_with_the_cpu_route():
    with pytest.warns(UserWarning, match=r"memory_limit=1073741824 is not applied") as record:
        assert keras_memguard.configure_devices(memory_limit=GIB) == {}
    message = str(record[0].message)
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB" in message
    assert "memory_cap_env" in message
    assert record[0].filename == __file__


def test_no_gpu_allocator_sets_the_variable(caplog):
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        keras_memguard.configure_devices(allocator="cuda_malloc_async")
    assert os.environ["TF_GPU_ALLOCATOR"] == "cuda_malloc_async"
    assert "only GPUs use it" in caplog.text


def test_nothing_asked_changes_nothing():
    assert keras_memguard.configure_devices() == {}


# --- Bad input ---


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"memory_growth": "yes"}, r"`memory_growth` must be True, False or None. Received: memory_growth='yes'"),
        ({"memory_growth": 1}, r"Received: memory_growth=1$"),
        ({"memory_limit": 4096}, r"at least 1 MiB .*in bytes, not MiB.*Received: memory_limit=4096"),
        ({"memory_limit": -1}, r"Received: memory_limit=-1"),
        ({"memory_limit": 1.5e9 + 0.5}, r"must be a number of bytes"),
        ({"memory_limit": True}, r"must be a number of bytes.*memory_limit=True"),
        ({"memory_limit": "8GB"}, r"Received: memory_limit='8GB'"),
        ({"memory_limit": {}}, r"must not be an empty dict"),
        ({"memory_limit": {"TPU:0": GIB}}, r"keys must be GPU device strings"),
        ({"memory_limit": {"CPU:0": GIB}}, r"GPUs only.*TF_CPU_BFC_MEM_LIMIT_IN_MB"),
        ({"memory_limit": {"GPU:0": GIB, "gpu0": GIB}}, r"names GPU:0 twice"),
        ({"memory_limit": {"GPU:0": 10}}, r"`memory_limit\['GPU:0'\]` must be at least 1 MiB"),
        ({"allocator": "cuda_malloc"}, r"one of 'bfc', 'cuda_malloc_async' or None. Received: allocator='cuda_malloc'"),
        ({"memory_growth": True, "memory_limit": GIB}, r"cannot be combined.*memory_growth=True, memory_limit=1073741824"),
    ],
)
def test_bad_input_names_the_argument_and_echoes_the_value(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        keras_memguard.configure_devices(**kwargs)
