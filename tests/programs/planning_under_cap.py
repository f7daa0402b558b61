"""The planner under a real 600 MiB cap: one guarded run of a set-up.

The 64x64x3 CNN of the benchmarks at batch 272 (plain training fits 136 at
most under this cap; tests/test_guard.py shows it failing at 256). Run
twice by tests/test_planning.py, in two processes sharing one `$KERAS_HOME`,
as a user runs a script twice; reports through `emit_result`.
"""

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts
from programs.common import SampleCount, collect_package_messages, design_cnn

BATCH = 272
STEPS = 4


def make_model():
    return design_cnn(metrics=[SampleCount()])


def dataset():
    def make(i):
        seed = tf.stack([tf.cast(i, tf.int32), 0])
        x = tf.random.stateless_uniform((BATCH, 64, 64, 3), seed=seed)
        y = tf.random.stateless_uniform((BATCH,), seed=seed + 1, maxval=10, dtype=tf.int32)
        return x, y

    return tf.data.Dataset.range(STEPS).map(make)



def guarded_run():
    messages = collect_package_messages()
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard()
    history = make_model().fit(dataset(), epochs=1, verbose=0, callbacks=[ks, guard])
    return {
        "samples": history.history["samples"],
        "oom_recoveries": guard.oom_recoveries,
        "ks": ks.ks,
        "messages": list(messages),
    }


def main():
    emit_result(guarded_run())


if __name__ == "__main__":
    main()
