"""MirroredStrategy over two logical CPU devices: monitor, guard and replay.

Logical devices must be configured before TensorFlow's runtime starts, which
other test modules have already done in this process, so each scenario runs
in one subprocess: one with a generous cap (no out-of-memory error), one
under a cap where the mirrored step at batch 256 runs out of memory.
"""

import numpy as np
import pytest

from keras_memguard.testing import run_with_memory_cap
from tensorboard.backend.event_processing import event_accumulator

# Every test here starts processes of its own.
pytestmark = pytest.mark.slow

# Shared by both subprocesses: two logical CPUs, a mirrored model factory.
SETUP = """
import logging
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras
import keras_memguard
from keras_memguard.testing import emit_result

strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])

class SampleCount(keras.metrics.Metric):
    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")
    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))
    def result(self):
        return self.count

class BatchSizes(keras.layers.Layer):
    # Identity; records the static batch size of every traced call.
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sizes = []
    def call(self, x):
        self.sizes.append(x.shape[0])
        return x

def make_model(size, filters):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((size, size, 3)),
            BatchSizes(),
            keras.layers.Conv2D(filters, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[SampleCount()])
    return model

def make_data(n, size):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, size, size, 3)).astype("float32"),
            rng.integers(0, 10, size=(n,)))

def weights(model):
    return [w.tolist() for w in model.get_weights()]

# The capped scenario (a 350 MiB cap): the mirrored step at batch 256 needs
# about 550 MiB with both replicas' 128 samples in flight at once (they share
# the one CPU allocator) and cannot fit even when the allocator's retry lets
# one replica finish first; at 2 micro-batches it peaks near 290 MiB.
CAPPED = dict(size=64, filters=64, n=320, batch_size=256)
"""

# Run after `log_dir = <path>`.
UNCAPPED_RUN = SETUP + """
from keras_memguard.callbacks.sampling import shared_reader

out = {}
x, y = make_data(160, 32)  # batches of 64, 64, 32: 32, 32, 16 per replica

reference = make_model(32, 32)
reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
out["reference"] = weights(reference)

for k in (1, 2):
    model = make_model(32, 32)
    monitor = keras_memguard.MemoryMonitor(log_dir=f"{log_dir}/k{k}")
    guard = keras_memguard.MemoryGuard(cooldown=1000)
    guard.state = keras_memguard.policy.init_state(k)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(logs["micro_batches"]))
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                        callbacks=[monitor, guard, record])
    out[f"k{k}"] = {
        "weights": weights(model),
        "samples": history.history["samples"],
        "micro_batches": seen,
        "traced_sizes": model.layers[0].sizes,
        "devices": list(shared_reader(model).probe.devices),
    }

# The capped scenario's model, trained as plain Keras does it, for comparison.
cx, cy = make_data(CAPPED["n"], CAPPED["size"])
model = make_model(CAPPED["size"], CAPPED["filters"])
model.fit(cx, cy, batch_size=CAPPED["batch_size"], epochs=1, shuffle=False, verbose=0)
out["capped_reference"] = weights(model)[-2:]

# 101 samples at batch 20: the last batch has one sample, so replica 1 gets
# none; plain Keras trains through it.
x, y = make_data(101, 8)
model = make_model(8, 4)
try:
    history = model.fit(x, y, batch_size=20, epochs=1, verbose=0,
                        callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 40)])
    out["empty_replica"] = history.history["samples"]
except Exception as error:
    out["empty_replica"] = f"{type(error).__name__}: {str(error)[:300]}"
emit_result(out)
"""

CAPPED_RUN = SETUP + """
messages = []
class Collect(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("keras_memguard").addHandler(Collect())
logging.getLogger("keras_memguard").setLevel(logging.INFO)

x, y = make_data(CAPPED["n"], CAPPED["size"])
model = make_model(CAPPED["size"], CAPPED["filters"])
guard = keras_memguard.MemoryGuard(threshold=0.9)
history = model.fit(x, y, batch_size=CAPPED["batch_size"], epochs=1, shuffle=False,
                    verbose=0, callbacks=[keras_memguard.MemoryMonitor(), guard])
emit_result({
    "samples": history.history["samples"],
    "oom_recoveries": guard.oom_recoveries,
    "micro_batches": guard.micro_batches,
    "iterations": int(model.optimizer.iterations.numpy()),
    "messages": messages,
    "weights": weights(model)[-2:],
})
"""


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("mirrored_logs")
    run = run_with_memory_cap(
        f"log_dir = {str(log_dir)!r}\n" + UNCAPPED_RUN,
        memory_limit_mib=8192,
        timeout=400,
    )
    return run.result, log_dir


@pytest.fixture(scope="module")
def capped():
    return run_with_memory_cap(CAPPED_RUN, memory_limit_mib=350, timeout=400).result


def test_monitor_logs_every_replica_device(uncapped):
    result, log_dir = uncapped
    assert result["k1"]["devices"] == ["CPU:0", "CPU:1"]
    acc = event_accumulator.EventAccumulator(str(log_dir / "k1" / "memguard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for device in ("cpu0", "cpu1"):
        assert f"memory/{device}/peak_mib" in tags
        assert f"memory/{device}/usage" in tags
    cpu0 = [p.value for p in acc.Scalars("memory/cpu0/peak_mib")]
    cpu1 = [p.value for p in acc.Scalars("memory/cpu1/peak_mib")]
    # Six batches; logical CPUs share one allocator, so they read the same.
    assert len(cpu0) == 6 and cpu0 == cpu1 and max(cpu0) > 0


def test_micro_batches_split_each_replica_and_match_plain_mirrored_training(uncapped):
    result, _ = uncapped
    for k in (1, 2):
        run = result[f"k{k}"]
        assert run["samples"] == [160.0, 160.0]
        assert run["micro_batches"] == [k] * 6
        # Each replica gets 32 of a batch of 64 and splits those 32 in k.
        sizes = [size for size in run["traced_sizes"] if size]
        assert max(sizes) == 32 and min(sizes) == 32 // k, sizes
        for expected, got in zip(result["reference"], run["weights"]):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_replica_without_samples_in_the_last_batch_trains_through(uncapped):
    result, _ = uncapped
    assert result["empty_replica"] == [101.0]


def test_out_of_memory_in_a_mirrored_step_is_replayed_with_the_same_update(
    capped, uncapped
):
    assert capped["oom_recoveries"] >= 1
    assert capped["micro_batches"] >= 2
    assert capped["iterations"] == 2  # the failed attempt applied nothing
    # The message counts the global batch, not one replica's part.
    assert any(
        m.startswith("out of memory at 1 micro-batch of a batch of 256: "
                     "replaying it with 2 micro-batches")
        for m in capped["messages"]
    ), capped["messages"]
    for expected, got in zip(uncapped[0]["capped_reference"], capped["weights"]):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_out_of_memory_replay_counts_every_sample_once(capped):
    assert capped["samples"] == [320.0]
