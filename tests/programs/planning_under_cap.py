"""The planner under a real 600 MiB cap: one guarded run of a set-up.

The 64x64x3 CNN of the benchmarks, at the batch size and for the steps
given as arguments (default: batch 272, 4 steps), fed a tf.data pipeline
that prefetches nothing or, with a third argument `numpy`, numpy arrays. Under this cap plain
training fits 160 samples but not 170 with the rest of the cap reserved in
one allocator region, 136 without (tests/test_guard.py shows 256 failing).
Run twice by tests/test_planning.py, in two processes sharing one
`$KERAS_HOME`, as a user runs a script twice; reports through `emit_result`.
"""

import sys

import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts
from programs.common import SampleCount, collect_package_messages, design_cnn

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 272
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
# "dataset" (no prefetch) or "numpy": arrays through Keras' own pipeline,
# which holds them and prefetches batches in the same capped allocator.
INPUT = sys.argv[3] if len(sys.argv) > 3 else "dataset"


def make_model():
    return design_cnn(metrics=[SampleCount()])


def dataset():
    def make(i):
        seed = tf.stack([tf.cast(i, tf.int32), 0])
        x = tf.random.stateless_uniform((BATCH, 64, 64, 3), seed=seed)
        y = tf.random.stateless_uniform((BATCH,), seed=seed + 1, maxval=10, dtype=tf.int32)
        return x, y

    # As in the benchmarks: no batch prefetched beside the step. On the CPU
    # stand-in a prefetched batch lives in the same capped allocator (on a
    # GPU it stays in host memory).
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return tf.data.Dataset.range(STEPS).map(make).with_options(options)


def guarded_run():
    messages = collect_package_messages()
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard()
    if INPUT == "numpy":
        import numpy as np

        rng = np.random.default_rng(0)
        x = rng.random((BATCH * STEPS, 64, 64, 3), dtype=np.float32)
        y = rng.integers(0, 10, BATCH * STEPS)
        data = {"x": x, "y": y, "batch_size": BATCH, "shuffle": False}
    else:
        data = {"x": dataset()}
    callbacks = [ks, guard]
    if INPUT == "numpy":
        # Each batch's peak usage, read with the guard's own reading.
        callbacks.append(keras_memguard.MemoryMonitor())
    history = make_model().fit(**data, epochs=1, verbose=0, callbacks=callbacks)
    return {
        "samples": history.history["samples"],
        "oom_recoveries": guard.oom_recoveries,
        "ks": ks.ks,
        "usages": ks.usages,
        "messages": list(messages),
    }


def main():
    emit_result(guarded_run())


if __name__ == "__main__":
    main()
