"""MemGuardMixin: micro-batching inside your own model class, driven by MemoryGuard.

`MemGuardMixin` gives a `keras.Model` subclass a micro-batched `train_step`.
Here the model also overrides `train_step` to clip gradients, using the same
machinery (`accumulate_gradients`), and `MemoryGuard` switches the number of
micro-batches while it trains under a real 600 MiB allocator cap.

    python examples/guard_mixin_model.py [--log-dir logs/guard_mixin]
"""

import argparse
import logging
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "guard_mixin"))
    parser.add_argument("--cap-mib", type=int, default=600)
    args = parser.parse_args()

    from keras_memguard.testing import memory_cap_env

    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import numpy as np
    import keras
    import tensorflow as tf

    import keras_memguard
    from keras_memguard.backends.tensorflow import accumulate_gradients

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    class ClippedCNN(keras_memguard.MemGuardMixin, keras.Model):
        """A CNN whose train_step clips gradients, micro-batched by the mixin."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = keras.layers.Conv2D(64, 3, activation="relu")
            self.conv2 = keras.layers.Conv2D(64, 3, activation="relu")
            self.pool = keras.layers.GlobalAveragePooling2D()
            self.head = keras.layers.Dense(10)

        def call(self, x):
            return self.head(self.pool(self.conv2(self.conv1(x))))

        def train_step(self, data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            result = accumulate_gradients(self, data, self.micro_batches)
            gradients = [
                None if g is None else tf.clip_by_norm(g, 1.0) for g in result.gradients
            ]
            # State changes only once every micro-batch has succeeded.
            with tf.control_dependencies(result.control_inputs()):
                self._loss_tracker.update_state(result.loss, sample_weight=result.batch_size)
                self.optimizer.apply(gradients, self.trainable_weights)
                return self.compute_metrics(x, y, result.y_pred, sample_weight=sample_weight)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(768, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(768,))

    model = ClippedCNN()
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model(x[:1])
    guard = keras_memguard.MemoryGuard(threshold=0.9, log_dir=args.log_dir)
    model.fit(x, y, batch_size=256, epochs=2, callbacks=[guard], verbose=2)
    print()
    print(f"model.micro_batches = {model.micro_batches}; "
          f"batches replayed after running out of memory: {guard.oom_recoveries}")
    print(f"tensorboard --logdir {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
