"""MemoryGuard under a 600 MiB cap: plain fit runs out of memory, guarded fit
replays (three out-of-memory errors), and two models too large for one
sample (a chain of layers, and one with a skip connection).

Run by tests/test_guard.py; reports through `emit_result`.
"""

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import SampleCount, collect_package_messages, design_cnn


def make_model():
    return design_cnn(metrics=[SampleCount()])


def main():
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

    # One sample does not fit: a chain of layers (the remat rung could
    # serve it) and a model with a skip connection (it could not).
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
    emit_result(out)


if __name__ == "__main__":
    main()
