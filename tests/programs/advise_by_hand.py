"""The CNN trained by hand at one batch, float32 then mixed_float16.

What `advise` reports is checked against this: the mixed precision model
is built fresh under the global policy (not rebuilt from a saved one, as
`advise` does), and each is trained with `train_on_batch`, the peak read
with `reset_memory_stats` / `get_memory_info` over the steps after two
warm-up steps. Run by tests/test_advise.py under the same cap as the
`advise` run; reports `{policy: peak_bytes}` through `emit_result`.

Arguments: BATCH_SIZE.
"""

import gc
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_memguard.testing import emit_result
from programs import advise_models


def peak_bytes(policy, batch_size, steps=3):
    keras.mixed_precision.set_global_policy(policy)
    model = advise_models.cnn()
    rng = np.random.default_rng(0)
    x = rng.random((batch_size, 48, 48, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch_size)
    for _ in range(2):
        model.train_on_batch(x, y)
    peaks = []
    for _ in range(steps):
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    del model
    keras.backend.clear_session()
    gc.collect()
    return max(peaks)


def main():
    batch_size = int(sys.argv[1])
    emit_result(
        {policy: peak_bytes(policy, batch_size) for policy in ("float32", "mixed_float16")}
    )


if __name__ == "__main__":
    main()
