"""Growth on Keras' JAX backend: `check_growth` and `MemoryMonitor`'s detector.

JAX's CPU device has no memory statistics: the device series is missing
(a missing value is a value), the host's resident memory is tested.
"""

import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_memguard


_CHILD = "MEMGUARD_GROWTH_TEST_CHILD"


def _in_a_fresh_process(name):
    """Runs test `name` in a new pytest process; `True` in the parent.

    JAX's CPU device keeps no statistics, so the floor is the process's
    resident memory: in a process that has freed memory before (earlier
    tests), new arrays reuse those pages and the resident memory does not
    rise until they are used up. A leak shows from the start only in a
    fresh process.
    """
    if os.environ.get(_CHILD):
        return False
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{__file__}::{name}"],
        env=dict(os.environ, **{_CHILD: "1"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    return True


@pytest.mark.slow
def test_check_growth_finds_arrays_kept_in_a_list():
    if _in_a_fresh_process("test_check_growth_finds_arrays_kept_in_a_list"):
        return
    kept = []

    def leak():
        kept.append(jnp.ones((2048, 2048)) + len(kept))  # 16 MiB per call

    # Eight calls of 16 MiB each: with 4 MiB, the first calls could reuse
    # memory freed before them, leaving one half of the window flat, short
    # of the rise the test asks of both halves.
    results = keras_memguard.check_growth(leak, repeats=8, raise_on_growth=False)
    host = [r for r in results if r.name == "host"][0]
    assert host.growing and host.slope_mib >= 8.0, results
    assert "live_tensors_mib" in [e.key for e in host.evidence]
    with pytest.raises(AssertionError, match="host resident memory"):
        keras_memguard.check_growth(leak, repeats=8)


def test_check_growth_passes_a_steady_loop():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    x = np.random.rand(64, 8).astype("float32")
    results = keras_memguard.check_growth(lambda: model.predict(x, verbose=0), repeats=5)
    assert results and not any(r.growing for r in results)


class _KeepOutputs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def on_train_batch_end(self, batch, logs=None):
        self.outputs.append(jnp.ones((512, 1024)) + batch)  # 2 MiB per batch


def _fit(callbacks):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
    model.compile("adam", "mse")
    x = np.random.rand(256, 16).astype("float32")
    y = np.random.rand(256, 8).astype("float32")
    return model.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=callbacks)


@pytest.mark.slow
def test_monitor_finds_outputs_kept_by_a_callback_in_host_memory(caplog):
    if _in_a_fresh_process("test_monitor_finds_outputs_kept_by_a_callback_in_host_memory"):
        return
    monitor = keras_memguard.MemoryMonitor(growth=True)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = _fit([monitor, _KeepOutputs()])
    said = [r.getMessage() for r in caplog.records if "keeps growing" in r.getMessage()]
    assert len(said) == 1 and "host resident memory" in said[0], said
    assert "_KeepOutputs.outputs" in said[0]
    assert history.history["memory_growth_mib_per_epoch"]
    assert monitor.growth["epoch:host"].growing


def test_monitor_stays_quiet_on_a_steady_fit(caplog):
    monitor = keras_memguard.MemoryMonitor(growth=True)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = _fit([monitor])
    assert not [r for r in caplog.records if "keeps growing" in r.getMessage()]
    assert "memory_growth_mib_per_epoch" not in history.history
