"""A step that runs out of memory in its second micro-batch leaves no trace.

Micro-batch 0 is light; micro-batch 1 allocates ~2.6 GB under a 512 MiB cap:
a real out-of-memory error inside the micro-batch loop, after micro-batch
0's gradients exist. Run by tests/test_micro_batch.py.
"""

import numpy as np
import keras
import tensorflow as tf

from keras_memguard.testing import emit_result


class Hog(keras.layers.Layer):
    # Allocates in proportion to max(x[:, 0]); passes x on.
    def call(self, x):
        reps = tf.cast(tf.reduce_max(x[:, 0]), tf.int32)
        big = tf.tile(x, [reps, 1])
        return x + 0.0 * tf.reduce_mean(tf.sin(big))


def main():
    from keras_memguard.backends.tensorflow import make_step_function

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)), Hog(),
        keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1),
    ])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    step = make_step_function(model, 2)
    x = np.ones((64, 1024), "float32")
    y = np.ones((64, 1), "float32")
    step((x, y))  # Builds the optimizer and metrics, traces.
    state = model.weights + model.optimizer.variables
    state += model.metrics_variables
    before = [v.numpy().copy() for v in state]
    heavy = x.copy()
    heavy[32:, 0] = 20000.0
    try:
        step((heavy, y))
        oom = False
    except tf.errors.ResourceExhaustedError:
        oom = True
    changed = [
        v.path for v, old in zip(state, before)
        if not np.array_equal(v.numpy(), old)
    ]
    iterations = int(model.optimizer.iterations)
    step((x, y))  # The same step still works afterwards.
    emit_result({
        "oom": oom,
        "changed": changed,
        "iterations": [iterations, int(model.optimizer.iterations)],
    })


if __name__ == "__main__":
    main()
