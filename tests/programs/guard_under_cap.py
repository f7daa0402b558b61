"""MemoryGuard under a 600 MiB cap: plain fit runs out of memory, guarded fit
replays (three out-of-memory errors), and two models too large for one
sample (a chain of layers, and one with a skip connection).

    guard_under_cap.py [PART]

PART: `fit` (plain and guarded fit), `too_large` (the two models) or
nothing for both. Run by tests/test_guard.py, one process per part side by
side (their errors mostly wait); reports through `emit_result`.
"""

import sys

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import SampleCount, collect_package_messages, design_cnn


def make_model():
    return design_cnn(metrics=[SampleCount()])


def main(part=None):
    out = {}
    if part in (None, "fit"):
        out.update(fits())
    if part in (None, "too_large"):
        out.update(too_large())
    emit_result(out)


def fits():
    """Plain `fit` at 256, then guarded `fit`: what each did."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(320,))
    out = {}

    try:
        make_model().fit(x, y, batch_size=256, epochs=1, shuffle=False, verbose=0)
        out["plain"] = "completed"
    except tf.errors.ResourceExhaustedError:
        out["plain"] = "oom"

    messages = collect_package_messages()

    model = make_model()
    guard = keras_memguard.MemoryGuard(threshold=0.9, plan=False)
    history = model.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0,
                        callbacks=[guard])
    out["samples"] = history.history["samples"]
    out["micro_batches"] = guard.micro_batches
    out["oom_recoveries"] = guard.oom_recoveries
    out["messages"] = messages
    out["weights"] = [w.tolist() for w in model.get_weights()[-2:]]
    out["iterations"] = int(model.optimizer.iterations.numpy())
    return out


def too_large():
    """Two models of which one sample does not fit: the guard's errors.

    A chain of layers (the remat rung could serve it) and a model with a
    skip connection (it could not).
    """
    out = {}
    big = keras.Sequential([keras.Input((512, 512, 3)), keras.layers.Conv2D(512, 3),
                            keras.layers.Activation("relu"),
                            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1)])
    inputs = keras.Input((512, 512, 3))
    wide = keras.layers.Conv2D(512, 3, padding="same")(inputs)
    skip = keras.layers.Add()([inputs, keras.layers.Conv2D(3, 1)(wide)])
    branched = keras.Model(
        inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(skip))
    )
    for name, model in (("too_large", big), ("too_large_branched", branched)):
        model.compile("sgd", "mse")
        try:
            model.fit(np.zeros((1, 512, 512, 3), "float32"), np.zeros((1, 1), "float32"),
                      batch_size=1, verbose=0, callbacks=[keras_memguard.MemoryGuard()])
            out[name] = None
        except keras_memguard.MicroBatchTooLargeError as error:
            out[name] = [str(error), error.limit_bytes, error.peak_bytes]
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
