"""MemoryGuard on Keras' JAX backend: the micro-batch count read from the compiled step.

Runs with `pip install -e ".[jax]"` (no TensorFlow), on the CPU in one to
two minutes, or on a GPU. A CNN is trained at batch 512 (one batch an
epoch, two epochs) under a memory limit its whole-batch step does not fit
(on a CPU, where JAX keeps no memory statistics, the limit is
`--limit-mib`; on a GPU the device's own limit when `--limit-mib 0`). Before the first batch runs, the guard compiles the
micro-batched step for a few counts and reads XLA's memory analysis of each;
the batch runs with the smallest count that fits. Then the same model is
trained with plain `fit` and the weights are compared.

    KERAS_BACKEND=jax python examples/jax_guard.py [--limit-mib 48] [--log-dir logs/jax]
"""

import argparse
import logging
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mib", type=float, default=48.0)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--log-dir", default=os.path.join("logs", "jax"))
    return parser.parse_args()


def make_model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    args = parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)
    import keras
    import numpy as np

    import keras_memguard

    if keras.backend.backend() != "jax":
        sys.exit(f"run with KERAS_BACKEND=jax (this is {keras.backend.backend()})")
    rng = np.random.default_rng(0)
    # One batch an epoch: on a CPU, XLA runs the micro-batch loop's
    # convolutions slowly (bench/RESULTS.md), so each batch takes seconds.
    x = rng.normal(size=(args.batch_size, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch_size,))
    fit = dict(batch_size=args.batch_size, epochs=2, shuffle=False, verbose=0)

    limit = int(args.limit_mib * 2**20) or None
    guard = keras_memguard.MemoryGuard(memory_limit=limit, log_dir=args.log_dir)
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir, growth=True)
    model = make_model(keras)
    history = model.fit(x, y, callbacks=[monitor, guard], **fit)
    plain = make_model(keras)
    expected = plain.fit(x, y, **fit)
    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), plain.get_weights())
    )
    import jax

    print(f"backend: {keras.backend.backend()}, device: {jax.devices()[0]}")
    print(f"micro-batches per batch: {history.history['micro_batches']}, "
          f"replays after an out-of-memory error: {guard.oom_recoveries}")
    print(f"loss with the guard: {[round(v, 4) for v in history.history['loss']]}")
    print(f"loss of plain fit:   {[round(v, 4) for v in expected.history['loss']]}")
    print(f"largest weight difference from plain fit: {difference:.1e}")
    print(f"TensorBoard: tensorboard --logdir {args.log_dir}")


if __name__ == "__main__":
    main()
