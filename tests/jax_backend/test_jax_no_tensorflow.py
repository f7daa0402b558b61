"""The JAX path imports no TensorFlow, even where TensorFlow is installed."""

import subprocess
import sys

SCRIPT = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
import keras
import keras_memguard
from keras_memguard.backends.jax import ReplayingTrainFunction, StepCache, plan_micro_batches
from keras_memguard.backends.jax.probe import JaxMemoryProbe
from keras_memguard import decider

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
cache = StepCache(model)
plan = lambda state, data: plan_micro_batches(
    lambda k: cache.memory(k, state, data), 16, 2**30).micro_batches
model.train_function = ReplayingTrainFunction(model, cache=cache, plan=plan)
probe = JaxMemoryProbe()
probe.reset()
x, y = np.ones((64, 4), "float32"), np.ones((64, 2), "float32")
model.fit(x, y, batch_size=16, verbose=0)
probe.sample()

# The public API: monitor, guard (fit, validation, predict), mixin.
import tempfile
logs = tempfile.mkdtemp()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=16, verbose=0, validation_data=(x, y), callbacks=[
    keras_memguard.MemoryMonitor(log_dir=logs),
    keras_memguard.MemoryGuard(memory_limit=2**30, log_dir=logs)])
model.predict(x, verbose=0, callbacks=[keras_memguard.MemoryGuard(memory_limit=2**30)])

class Mixed(keras_memguard.MemGuardMixin, keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

mixed = Mixed()
mixed.compile(optimizer="adam", loss="mse")
mixed.fit(x, y, verbose=0)
# TensorFlow's multi-worker preparation: nothing to do on JAX.
assert keras_memguard.prepare_multi_worker(mixed) is mixed
# (Not the report: TensorBoard's event reader imports TensorFlow where it
# is installed; without it, the report runs without it, tested beside.)
print("tensorflow" in sys.modules)
"""


def test_a_jax_fit_with_the_core_imports_no_tensorflow():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False", result.stdout
