"""Quickstart: watch memory while a small CNN trains under a real memory cap.

Runs on the CPU in well under two minutes. TensorFlow's CPU allocator is
capped (the stand-in for a GPU's memory) before TensorFlow is imported, a
small CNN trains on synthetic images with `MemoryMonitor` and Keras' own
`TensorBoard` callback writing to the same log directory, and a summary and
the command to view the logs are printed.

    python examples/quickstart.py [--log-dir logs/quickstart] [--cap-mib 1024]
"""

import argparse
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "quickstart"))
    parser.add_argument("--cap-mib", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args()


def main():
    args = parse_args()
    # The cap must be in the environment before TensorFlow is imported.
    from keras_memguard.testing import memory_cap_env

    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import numpy as np
    import keras

    import keras_memguard

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(1024,))

    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
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
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir)
    history = model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[monitor, keras.callbacks.TensorBoard(log_dir=args.log_dir)],
        verbose=2,
    )

    peaks = history.history["memory_peak_mib"]
    usages = history.history.get("memory_usage", [])
    print()
    print(f"Memory cap: {args.cap_mib} MiB (CPU allocator, standing in for a GPU)")
    for epoch, peak in enumerate(peaks):
        usage = f" ({usages[epoch]:.0%} of the cap)" if usages else ""
        print(f"epoch {epoch + 1}: peak {peak:.1f} MiB{usage}")
    print()
    print("View the memory curves beside the training curves with:")
    print(f"    tensorboard --logdir {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
