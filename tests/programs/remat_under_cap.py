"""The "remat" rung under a real cap: a model that does not fit one sample.

Ten `Conv2D(64)` layers on 256x256x3 inputs, batch size 1: under a 300 MiB
cap plain training runs out of memory at one sample (it needs 331 MiB with
the cap reserved in one region, `bench/RESULTS.md`), and the guard with
`escalate=("remat",)` trains it. Run twice by `tests/test_planning.py`
sharing one `$KERAS_HOME`: the first run climbs after the out-of-memory
error, the second before its first batch, from the plan cache. With the
argument `past`, run under a cap below what the rung needs (256 MiB): the
guard raises `MicroBatchTooLargeError` naming what it tried, and the
weights are those from before `fit`. Reports through `emit_result`.
"""

import sys

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import SampleCount, collect_package_messages

STEPS = 2


def model():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((256, 256, 3))]
    layers += [
        keras.layers.Conv2D(64, 3, padding="same", activation="relu")
        for _ in range(10)
    ]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    net = keras.Sequential(layers)
    net.compile(
        keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[SampleCount()],
    )
    return net


def dataset():
    def make(i):
        seed = tf.stack([tf.cast(i, tf.int32), 0])
        x = tf.random.stateless_uniform((1, 256, 256, 3), seed=seed)
        y = tf.random.stateless_uniform((1,), seed=seed + 1, maxval=10, dtype=tf.int32)
        return x, y

    return tf.data.Dataset.range(STEPS).map(make)


def past_the_last_rung(messages):
    guard = keras_memguard.MemoryGuard(escalate=("remat",))
    net = model()
    before = net.get_weights()
    try:
        net.fit(dataset(), epochs=1, verbose=0, callbacks=[guard])
        error = None
    except keras_memguard.MicroBatchTooLargeError as raised:
        error = str(raised)
    emit_result({
        "error": error,
        "oom_recoveries": guard.oom_recoveries,
        "rungs_on": list(guard.rungs_on),
        "weights_unchanged": all(
            np.array_equal(a, b) for a, b in zip(before, net.get_weights())
        ),
        "messages": list(messages),
    })


def main():
    messages = collect_package_messages()
    if sys.argv[1:] == ["past"]:
        return past_the_last_rung(messages)
    guard = keras_memguard.MemoryGuard(escalate=("remat",))
    net = model()
    history = net.fit(dataset(), epochs=1, verbose=0, callbacks=[guard])
    emit_result({
        "samples": history.history["samples"],
        "oom_recoveries": guard.oom_recoveries,
        "rungs_on": list(guard.rungs_on),
        "finite": bool(all(np.isfinite(w).all() for w in net.get_weights())),
        "messages": list(messages),
    })


if __name__ == "__main__":
    main()
