"""The mirrored programs' model and data (import after the logical devices
are configured: this module imports Keras)."""

import numpy as np
import keras

from programs.common import SampleCount

# The capped scenario (a 350 MiB cap): the mirrored step at batch 256 needs
# about 550 MiB with both replicas' 128 samples in flight at once (they share
# the one CPU allocator) and cannot fit even when the allocator's retry lets
# one replica finish first; at 2 micro-batches it peaks near 290 MiB.
CAPPED = dict(size=64, filters=64, n=320, batch_size=256)


class BatchSizes(keras.layers.Layer):
    # Identity; records the static batch size of every traced call.
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sizes = []

    def call(self, x):
        self.sizes.append(x.shape[0])
        return x


def make_model(strategy, size, filters):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((size, size, 3)),
            BatchSizes(),
            keras.layers.Conv2D(filters, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[SampleCount()])
    return model


def make_data(n, size):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, size, size, 3)).astype("float32"),
            rng.integers(0, 10, size=(n,)))
