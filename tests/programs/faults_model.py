"""The fault programs' model and data, also used in process by
tests/test_faults.py for the unconstrained reference runs."""

import numpy as np
import keras
import tensorflow as tf

from programs.common import SampleCount

MIB_FLOATS = 262144  # float32 values in one MiB


class MemoryHog(keras.layers.Layer):
    """Drops the marker column and allocates sum(markers) MiB meanwhile.

    With `allocate=False` it only drops the column: the same numbers
    without the memory, for reference runs in a process that must stay
    small.
    """

    def __init__(self, allocate=True, **kwargs):
        super().__init__(**kwargs)
        self.allocate = allocate

    def call(self, x):
        if not self.allocate:
            return x[:, 1:]
        count = tf.cast(tf.reduce_sum(x[:, 0]) * MIB_FLOATS, tf.int32)
        # A fill value computed from the input: nothing to fold away.
        hog = tf.fill([count], tf.reduce_mean(x[:, 1]) * 0.0 + 1.0)
        return x[:, 1:] + tf.stop_gradient(tf.reduce_sum(hog)) * 0.0

    def compute_output_shape(self, shape):
        return (shape[0], shape[1] - 1)


def make_model(allocate=True):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((9,)),
        MemoryHog(allocate),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile("adam", "mse", metrics=[SampleCount()])
    return model


def make_data(batches, marks, seed=0, batch=16):
    """`batches` batches; `marks` maps a sample range to MiB per sample."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * batch, 9)).astype("float32")
    y = (x[:, 1:2] - 0.5 * x[:, 2:3]).astype("float32")
    x[:, 0] = 0.0
    for (start, stop), mib in marks:
        x[start:stop, 0] = mib
    return x, y
