"""Quickstart: a fit that runs out of memory without the guard, and with it finishes.

Runs on the CPU in well under two minutes. TensorFlow's CPU allocator is
capped (the stand-in for a GPU's memory) before TensorFlow is imported. The
same small CNN, on the same synthetic images, is trained twice: plain
`fit` at batch 256 runs out of memory; with `MemoryGuard` (and
`MemoryMonitor` writing TensorBoard logs) every batch is planned into
micro-batches that fit, and every sample is trained on, with the same
update as the whole batch. Then the commands to look at the run are
printed.

    python examples/quickstart.py [--log-dir logs/quickstart] [--cap-mib 600]
"""

import argparse
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "quickstart"))
    parser.add_argument("--cap-mib", type=int, default=600)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    return parser.parse_args()


def make_model(keras):
    keras.utils.set_random_seed(0)
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
    return model


def main():
    args = parse_args()
    # The cap must be in the environment before TensorFlow is imported.
    from keras_memguard.testing import memory_cap_env

    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import logging

    import numpy as np
    import keras
    import tensorflow as tf

    import keras_memguard

    # The guard says what it plans and why, one line per change.
    logging.basicConfig(format="keras_memguard: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)

    rng = np.random.default_rng(0)
    samples = 3 * args.batch_size
    x = rng.normal(size=(samples, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))

    print(f"1. Plain fit at batch {args.batch_size} under a {args.cap_mib} MiB cap")
    try:
        make_model(keras).fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
        print("   finished (raise the batch size to see it run out of memory)")
    except tf.errors.ResourceExhaustedError:
        print("   ran out of memory (tf.errors.ResourceExhaustedError)")

    print("2. The same fit with MemoryGuard and MemoryMonitor")
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir)
    guard = keras_memguard.MemoryGuard(log_dir=args.log_dir)
    history = make_model(keras).fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[monitor, guard],
        verbose=2,
    )

    print()
    for epoch, peak in enumerate(history.history["memory_peak_mib"]):
        print(
            f"epoch {epoch + 1}: peak {peak:.1f} MiB of {args.cap_mib} MiB, "
            f"{int(history.history['micro_batches'][epoch])} micro-batches"
        )
    recoveries = guard.oom_recoveries
    print(
        f"every batch trained ({samples} samples per epoch); out-of-memory "
        f"recoveries: {recoveries}"
    )
    print()
    print("Look at the run:")
    print(f"    tensorboard --logdir {args.log_dir}    # Custom Scalars tab")
    print(f"    keras-memguard report {args.log_dir} --output report.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
