"""Subprocess programs of `tests/test_user_models.py`.

    python tests/programs/user_models_oom.py replay|peak

`replay` (under a real allocator cap, `CAP_MIB`): a multi-output model whose
batch runs out of memory and is replayed; it returns, through `emit_result`,
the guarded run's History, the count of every loss tracker and metric, and
whether plain training ran out of memory under the same cap. The test builds
the same model (importing this module) and trains it without a cap, to
compare.

`peak` (any cap; one inter-op thread, so the op schedule, and with it the
allocator peak, is the same every run): the step peak of a narrow U-Net
(64x64x8 per-pixel logits), plain at batch 16 and guarded at k=4 of batch 64.
"""

import gc
import sys

import numpy as np

import keras
import tensorflow as tf

from programs.common import SampleCount  # noqa: E402

CAP_MIB = 600
FIT_KWARGS = dict(batch_size=256, epochs=1, shuffle=False, verbose=0)


def make_model():
    """Two 64-filter convolutions on 64x64x3: about 870 MiB at batch 256."""
    inputs = keras.Input((64, 64, 3))
    h = keras.layers.Conv2D(64, 3, activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    cls = keras.layers.Dense(10, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(2, name="reg")(h)
    model = keras.Model(inputs, {"cls": cls, "reg": reg})
    model.compile(
        optimizer="adam",
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy", SampleCount()], "reg": ["mae"]},
    )
    return model


def make_data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 64, 64, 3)).astype("float32")
    y = {
        "cls": rng.integers(0, 10, size=(n,)),
        "reg": rng.normal(size=(n, 2)).astype("float32"),
    }
    return x, y


def tracker_counts(model):
    """Samples (or updates) counted by every `Mean`-like metric of the model."""
    counts = {}
    for metric in model.metrics:
        for variable in metric.variables:
            if variable.name == "count":
                counts[f"{metric.name}/{variable.name}"] = float(np.asarray(variable))
    return dict(sorted(counts.items()))


def make_unet():
    """A narrow U-Net: per-pixel logits (64x64x8) outweigh the activations."""
    inputs = keras.Input((64, 64, 3))
    c1 = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    p1 = keras.layers.MaxPooling2D()(c1)
    c2 = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(p1)
    u1 = keras.layers.Concatenate()([keras.layers.UpSampling2D()(c2), c1])
    c3 = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(u1)
    outputs = keras.layers.Conv2D(8, 1)(c3)  # per-pixel logits
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class StepPeak(keras.callbacks.Callback):
    """Each step's allocator peak above `baseline` (first in the callback list)."""

    def __init__(self, baseline):
        super().__init__()
        self.baseline = baseline
        self.peaks = []

    def on_train_batch_begin(self, batch, logs=None):
        tf.config.experimental.reset_memory_stats("CPU:0")

    def on_train_batch_end(self, batch, logs=None):
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        self.peaks.append(peak - self.baseline)


def unet_step_peak(batch_size, callbacks, n=192):
    """The largest step peak after the first (tracing) step, in bytes."""
    keras.utils.set_random_seed(0)
    model = make_unet()
    rng = np.random.default_rng(6)
    x = rng.normal(size=(n, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 8, size=(n, 64, 64)).astype("int32")
    gc.collect()
    probe = StepPeak(tf.config.experimental.get_memory_info("CPU:0")["current"])
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[probe] + callbacks)
    return max(probe.peaks[1:])


def peak():
    import keras_memguard
    from keras_memguard.testing import emit_result

    # The first fit of a process allocates lazily created runtime state
    # inside its steps: warm up first.
    unet_step_peak(16, [], n=48)
    plain = unet_step_peak(16, [])
    guard = keras_memguard.MemoryGuard(micro_batches=4, memory_limit=8 * 2**30, plan=False)
    guarded = unet_step_peak(64, [guard])
    emit_result({"plain": plain, "guarded": guarded})


def replay():
    import keras_memguard
    from keras_memguard.testing import emit_result

    x, y = make_data()
    out = {}
    keras.utils.set_random_seed(0)
    try:
        make_model().fit(x, y, **FIT_KWARGS)
        out["plain_under_cap"] = "completed"
    except tf.errors.ResourceExhaustedError:
        out["plain_under_cap"] = "oom"

    keras.utils.set_random_seed(0)
    model = make_model()
    guard = keras_memguard.MemoryGuard(threshold=0.9, plan=False)
    history = model.fit(x, y, callbacks=[guard], **FIT_KWARGS)
    out["history"] = history.history
    out["oom_recoveries"] = guard.oom_recoveries
    out["micro_batches"] = guard.micro_batches
    out["tracker_counts"] = tracker_counts(model)
    emit_result(out)


if __name__ == "__main__":
    tf.config.threading.set_inter_op_parallelism_threads(1)
    {"replay": replay, "peak": peak}[sys.argv[1]]()
