"""A fit with MemoryMonitor and MemoryGuard that an exception ends.

    monitor_crash LOG_DIR callback|data

Eight batches an epoch, two epochs. In the second epoch, a `RuntimeError`
escapes `fit` from a callback after the sixth batch (`callback`), or the
input pipeline fails on the sixth batch (`data`: TensorFlow's
`InvalidArgumentError` from a numerics check); nothing catches it, so the
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
        # A pipeline of TensorFlow ops: a Python generator's pipeline
        # (`from_generator`) can hang the interpreter's exit after an error,
        # which is TensorFlow's, not what is tested here.
        message = f"crash at batch {FAILING_BATCH} of epoch 1"

        def check(index, batch):
            features, targets = batch
            poisoned = features / tf.cast(index != failing, tf.float32)
            return tf.debugging.check_numerics(poisoned, message), targets

        dataset = (
            tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
            .enumerate().map(check)
        )
        model.fit(dataset, steps_per_epoch=BATCHES, epochs=2, verbose=0,
                  callbacks=callbacks)

if __name__ == "__main__":
    main()
