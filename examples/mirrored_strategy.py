"""MemoryGuard under MirroredStrategy: two replicas, one memory cap, no crash.

Two logical CPU devices stand in for two GPUs, under a real 350 MiB allocator
cap. A mirrored step at batch 256 (128 samples per replica) runs out of
memory; `MemoryGuard` replays that batch with each replica's part split into
2 micro-batches, and training goes on with the same updates a bigger device
would give. `MemoryMonitor` logs every replica's device (`memory/cpu0/...`,
`memory/cpu1/...`; on GPUs `memory/gpu0/...`, `memory/gpu1/...`).

Logical CPU devices share one CPU allocator, so `cpu0` and `cpu1` read the
same numbers: the memory of both replicas together. On GPUs each device has
its own allocator and its own readings; the guard decides on the highest.

    python examples/mirrored_strategy.py [--log-dir logs/mirrored]
"""

import argparse
import logging
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "mirrored"))
    parser.add_argument("--cap-mib", type=int, default=350)
    args = parser.parse_args()

    # The cap must be in the environment before TensorFlow is imported.
    from keras_memguard.testing import memory_cap_env

    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import numpy as np
    import tensorflow as tf

    # Logical devices must be configured before TensorFlow's runtime starts.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )

    import keras

    import keras_memguard

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)
    tf.get_logger().setLevel(logging.WARNING)  # tf.distribute's INFO lines

    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    print(f"replicas: {strategy.num_replicas_in_sync}")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(768, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(768,))

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((64, 64, 3)),
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
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir, growth=True)
    guard = keras_memguard.MemoryGuard(threshold=0.9, log_dir=args.log_dir)
    # batch_size is the global batch: 128 samples per replica.
    history = model.fit(
        x, y, batch_size=256, epochs=2, callbacks=[monitor, guard], verbose=2
    )

    print()
    print(f"trained {2 * len(x)} samples on {strategy.num_replicas_in_sync} "
          f"replicas; optimizer steps: {int(model.optimizer.iterations.numpy())}")
    print(f"micro-batches now: {guard.micro_batches} per replica batch; "
          f"batches replayed after running out of memory: {guard.oom_recoveries}")
    peaks = ", ".join(f"{p:.0f}" for p in history.history["memory_peak_mib"])
    print(f"epoch peaks (MiB, of a {args.cap_mib} MiB cap): {peaks}")
    print(f"tensorboard --logdir {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
