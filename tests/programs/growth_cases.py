"""Runs one case of real memory growth (or a steady run) under `MemoryMonitor`.

`python tests/programs/growth_cases.py CASE` (under the CPU stand-in:
`keras_memguard.testing.run_script_with_memory_cap`) emits the monitor's
growth results and every keras_memguard warning:

- `outputs`: a callback keeps a reference to each batch's outputs;
- `models`: models built (and kept) in a loop without `clear_session`;
- `retrace`: a predict loop on inputs of new shapes through a serving
  `tf.function` of the user's own, traced anew per shape (checked with
  `keras_memguard.check_growth`);
- `cache`: a `.cache()`d `tf.data` pipeline, `repeat()`ed with
  `steps_per_epoch` shorter than one pass: it fills over the epochs;
- `steady`: none of these.
"""

import logging
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result

messages = []


class _Collect(logging.Handler):
    def emit(self, record):
        messages.append((record.levelname, record.getMessage()))


logging.getLogger("keras_memguard").addHandler(_Collect())
logging.getLogger("keras_memguard").setLevel(logging.INFO)


def mlp(width=32, features=16):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(8)]
    )
    model.compile("adam", "mse")
    return model


class Table(keras.layers.Layer):
    """Adds the mean of an 8 MiB table: a constant in every graph traced."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = np.random.rand(2 * 1048576).astype("float32")

    def call(self, inputs):
        return inputs + keras.ops.mean(keras.ops.convert_to_tensor(self.table))


class KeepOutputs(keras.callbacks.Callback):
    """Keeps each batch's outputs (here a 256 KiB tensor per batch)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def on_train_batch_end(self, batch, logs=None):
        self.outputs.append(tf.ones((64, 1024)) * float(batch))


def run(case):
    monitor = keras_memguard.MemoryMonitor(growth=True)
    x = np.random.rand(512, 16).astype("float32")
    y = np.random.rand(512, 8).astype("float32")
    if case in ("outputs", "steady"):
        model = mlp()
        callbacks = [monitor] + ([KeepOutputs()] if case == "outputs" else [])
        history = model.fit(x, y, batch_size=64, epochs=6, verbose=0, callbacks=callbacks)
        rates = history.history.get("memory_growth_mib_per_epoch")
        if case == "steady":
            # Steady across calls too: the same model fitted, evaluated and
            # asked to predict again and again.
            for _ in range(6):
                model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=callbacks)
                model.evaluate(x, y, batch_size=64, verbose=0, callbacks=callbacks)
                model.predict(x, batch_size=64, verbose=0, callbacks=callbacks)
    elif case == "models":
        kept = []
        for call in range(6):
            model = mlp(width=512, features=512)  # 1.1 MiB of weights (and 2.2 of slots)
            model.fit(np.random.rand(64, 512).astype("float32"), y[:64], batch_size=32,
                      epochs=1, verbose=0, callbacks=[monitor])
            kept.append(model)
        rates = None
    elif case == "retrace":
        # Keras' own `predict` relaxes the shapes it traces for after the
        # second one; a serving function of the user's own, traced per
        # shape, embeds the layer's 8 MiB table in each new graph (larger than
        # the resident memory's jumps on a busy machine). Eight calls: the
        # first ones can reuse what the first trace freed, and each half of
        # the trend test needs growth in it.
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((None, 8)), Table(), keras.layers.Conv1D(16, 3),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])
        serve = tf.function(lambda inputs: model(inputs, training=False))
        lengths = iter(range(20, 100))

        def predict_next_shape():
            return serve(tf.ones((8, next(lengths), 8))).numpy()

        checked = keras_memguard.check_growth(predict_next_shape, repeats=8, raise_on_growth=False)
        results = {
            "check:" + r.name: {"growing": r.growing, "slope_mib": r.slope_mib, "points": r.points,
                                "reaches": r.reaches_limit_at, "evidence": [e.key for e in r.evidence],
                                "texts": [e.text for e in r.evidence]}
            for r in checked
        }
        emit_result({"results": results, "messages": messages, "rates": None})
        return
    elif case == "cache":
        model = mlp()
        big = np.random.rand(40960, 16).astype("float32")  # 2.5 MiB, 40 steps of 1024
        ds = tf.data.Dataset.from_tensor_slices((big, np.zeros((40960, 8), "float32")))
        ds = ds.map(lambda a, b: (a * 2.0, b)).cache().repeat().batch(256)
        history = model.fit(ds, steps_per_epoch=20, epochs=8, verbose=0, callbacks=[monitor])
        rates = history.history.get("memory_growth_mib_per_epoch")
    results = {
        key: {"growing": r.growing, "slope_mib": r.slope_mib, "points": r.points,
              "reaches": r.reaches_limit_at, "evidence": [e.key for e in r.evidence]}
        for key, r in monitor.growth.items()
    }
    emit_result({"results": results, "messages": messages, "rates": rates})


if __name__ == "__main__":
    run(sys.argv[1])
