"""A guarded fit under a 600 MiB cap that recovers from out-of-memory errors,
with MemoryMonitor and MemoryGuard writing to the log directory argv[1].

Each epoch's batches are 64, 64, 256 and 64 samples: the batch of 256 runs
out of memory at one micro-batch (its peak is about 870 MiB) and is replayed
split, the others fit. Run by tests/test_report.py; reports the guard's own
counts after each batch through `emit_result`.
"""

import inspect
import sys

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import design_cnn

BATCHES = (64, 64, 256, 64)


def main():
    log_dir = sys.argv[1]
    model = design_cnn()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(max(BATCHES), 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(max(BATCHES),))

    def batches():
        for size in BATCHES:
            yield x[:size], y[:size]

    dataset = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec((None, 64, 64, 3), tf.float32),
            tf.TensorSpec((None,), tf.int64),
        ),
    ).apply(tf.data.experimental.assert_cardinality(len(BATCHES)))
    monitor = keras_memguard.MemoryMonitor(log_dir=log_dir)
    options = {}
    if "plan" in inspect.signature(keras_memguard.MemoryGuard).parameters:
        # A guard that plans k ahead would split the batch of 256 before it
        # runs out of memory: this run needs the recovery.
        options["plan"] = False
    guard = keras_memguard.MemoryGuard(threshold=0.9, log_dir=log_dir, **options)
    # The guard's own figures after each batch, for the report to match.
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            [guard.micro_batches, guard.oom_recoveries]
        )
    )
    model.fit(dataset, epochs=2, verbose=0, callbacks=[monitor, guard, record])
    emit_result(
        {
            "micro_batches": guard.micro_batches,
            "oom_recoveries": guard.oom_recoveries,
            "per_step": seen,
        }
    )


if __name__ == "__main__":
    main()
