"""MemoryGuard on a plain Sequential model: a run that would run out of memory finishes.

Under a real 600 MiB allocator cap (the CPU standing in for a GPU), plain
training of this CNN at batch 256 raises `ResourceExhaustedError`. With
`MemoryGuard` the out-of-memory batch is replayed at 2 micro-batches and the
run trains on every sample, with the same updates as a bigger device would
give (gradient accumulation).

    python examples/guard_plain_model.py [--log-dir logs/guard_plain]
"""

import argparse
import logging
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "guard_plain"))
    parser.add_argument("--cap-mib", type=int, default=600)
    args = parser.parse_args()

    # The cap must be in the environment before TensorFlow is imported.
    from keras_memguard.testing import memory_cap_env

    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import numpy as np
    import keras

    import keras_memguard

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(768, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(768,))

    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    guard = keras_memguard.MemoryGuard(threshold=0.9, log_dir=args.log_dir)
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir, growth=True)
    model.fit(x, y, batch_size=256, epochs=2, callbacks=[monitor, guard], verbose=2)

    print()
    print(f"micro-batches now: {guard.micro_batches}; "
          f"batches replayed after running out of memory: {guard.oom_recoveries}")
    path = os.path.join(args.log_dir, "model.keras")
    model.save(path)
    print(f"saved as a plain {type(keras.models.load_model(path)).__name__}: {path}")
    print(f"tensorboard --logdir {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
