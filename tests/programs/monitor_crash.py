"""A fit with MemoryMonitor and MemoryGuard that an exception ends.

    monitor_crash LOG_DIR callback|data

Eight batches an epoch, two epochs. In the second epoch, a `RuntimeError`
escapes `fit` from a callback after the sixth batch (`callback`), or the
input pipeline fails on the sixth batch (`data`); nothing catches it, so the
process ends with a traceback. Run by tests/test_tensorboard_sink.py, which
then reads what reached the event file.
"""

import sys
import warnings

BATCH = 16
BATCHES = 8
FAILING_BATCH = 5  # in the second epoch


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    log_dir, where = argv
    warnings.simplefilter("ignore")
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_memguard

    rng = np.random.default_rng(0)
    x = rng.random((BATCH * BATCHES, 8), dtype=np.float32)
    y = rng.random((BATCH * BATCHES, 1), dtype=np.float32)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [
        keras_memguard.MemoryMonitor(log_dir=log_dir),
        keras_memguard.MemoryGuard(log_dir=log_dir, memory_limit=1 << 40),
    ]
    failing = BATCHES + FAILING_BATCH  # batches before the failing one

    if where == "callback":

        class Crash(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.epoch = epoch

            def on_train_batch_end(self, batch, logs=None):
                if self.epoch == 1 and batch == FAILING_BATCH:
                    raise RuntimeError(f"crash at batch {batch} of epoch 1")

        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks + [Crash()])
    else:

        def batches():
            for index in range(10**9):
                if index == failing:
                    print(f"crash at batch {FAILING_BATCH} of epoch 1", file=sys.stderr)
                    raise ValueError(f"crash at batch {FAILING_BATCH} of epoch 1")
                start = (index % BATCHES) * BATCH
                yield x[start:start + BATCH], y[start:start + BATCH]

        dataset = tf.data.Dataset.from_generator(
            batches,
            output_signature=(
                tf.TensorSpec((None, 8), tf.float32),
                tf.TensorSpec((None, 1), tf.float32),
            ),
        )
        model.fit(dataset, steps_per_epoch=BATCHES, epochs=2, verbose=0,
                  callbacks=callbacks)


if __name__ == "__main__":
    main()
