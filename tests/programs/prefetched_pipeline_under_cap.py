"""The planner on a shuffled, prefetched tf.data pipeline under a real cap.

A small 32x32x3 CNN fed `Dataset.from_tensor_slices(arrays).shuffle(...)
.batch(128).prefetch(AUTOTUNE)`, as keras-io examples build their input, 8
batches under an 89 MiB cap (0.6 times plain training's peak; plain training
runs out of memory here). The step's own memory hardly shrinks with the
micro-batch, and the pipeline's buffers fill before one step and during the
next, so the memory in use before a batch and the batch's demand move in
opposite directions. Run by tests/test_planning.py, each run from an empty
plan cache; reports through `emit_result`.
"""

import time

import keras
import numpy as np
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts, SampleCount, cnn, collect_package_messages

BATCH = 128
STEPS = 8
CAP_MIB = 89


def make_model():
    layers = keras.layers
    return cnn(
        (32, 32, 3),
        lambda: [
            layers.Conv2D(32, 3, activation="relu"),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(64, 3, activation="relu"),
        ],
        [SampleCount()],
    )


def dataset():
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * STEPS, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, BATCH * STEPS)
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(BATCH * STEPS)
        .batch(BATCH)
        .prefetch(tf.data.AUTOTUNE)
    )


def guarded_run():
    """One `fit` with `MemoryGuard()`: samples, errors, counts, seconds, log lines."""
    messages = collect_package_messages()
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard()
    model, data = make_model(), dataset()
    start = time.perf_counter()
    history = model.fit(data, epochs=1, verbose=0, callbacks=[ks, guard])
    return {
        "samples": history.history["samples"],
        "oom_recoveries": guard.oom_recoveries,
        "ks": ks.ks,
        "seconds": round(time.perf_counter() - start, 1),
        "messages": list(messages),
    }


def main():
    emit_result(guarded_run())


if __name__ == "__main__":
    main()
