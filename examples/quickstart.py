"""Quickstart: a fit that runs out of memory without the guard, and with it finishes.

Runs on the CPU in well under two minutes, on Keras' TensorFlow, PyTorch or
JAX backend (`--backend`, else `KERAS_BACKEND`, else TensorFlow). The same
small CNN, on the same synthetic images, is trained twice: plain `fit` at
batch 256 runs out of memory; with `MemoryGuard` (and `MemoryMonitor`
writing TensorBoard logs) every batch is planned into micro-batches that
fit, and every sample is trained on, with the same update as the whole
batch. Then the commands to look at the run are printed.

The stand-in for a GPU's memory on the CPU:
- TensorFlow: its CPU allocator capped at `--cap-mib` (set before TensorFlow
  is imported);
- PyTorch: on a CUDA device, the caching allocator's per-process memory
  fraction; on the CPU, the process's address space capped at `--cap-mib`
  beyond what it maps once Keras and torch are loaded (`RLIMIT_AS`), and
  the guard is given the memory resident then plus `--cap-mib` as its
  limit;
- JAX: its CPU backend has no cap and keeps no memory statistics, so plain
  `fit` cannot run out of memory here; the guard plans under
  `memory_limit=--cap-mib` from XLA's analysis of the compiled step, as it
  does against a GPU's memory.

    python examples/quickstart.py [--backend torch] [--log-dir logs/quickstart] [--cap-mib 600]
"""

import argparse
import os
import sys


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default=os.path.join("logs", "quickstart"))
    # JAX trains smaller images (see `main`), under a cap scaled to them.
    parser.add_argument("--cap-mib", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--backend",
        choices=("tensorflow", "jax", "torch"),
        default=os.environ.get("KERAS_BACKEND", "tensorflow"),
    )
    args = parser.parse_args()
    if args.cap_mib is None:
        args.cap_mib = 150 if args.backend == "jax" else 600
    return args


def make_model(keras, size=64):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((size, size, 3)),
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


def _status_bytes(key):
    """A `/proc/self/status` figure (`VmSize`, `VmRSS`) in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def cap_memory(args):
    """Puts the backend's stand-in cap in force; returns the guard's `memory_limit`.

    TensorFlow reads its allocator's cap from the environment, so this runs
    before Keras is imported; torch's cap is set once Keras and torch are
    loaded (`cap_torch_address_space`).
    """
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "tensorflow":
        from keras_memguard.testing import memory_cap_env

        os.environ.update(memory_cap_env(args.cap_mib, base_env={}))
        return None  # the guard reads the allocator's cap
    if args.backend == "jax":
        return args.cap_mib * 2**20
    return None  # torch: set after the warm-up


def cap_torch_memory(args, keras, x, y):
    """Caps torch's memory at `--cap-mib`; returns the guard's `memory_limit`.

    On a CUDA device, the caching allocator's per-process fraction (the
    guard reads it); on the CPU, the address space `--cap-mib` beyond what
    a warmed-up process maps.
    """
    import resource

    import torch

    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(args.cap_mib * 2**20 / total)
        return None
    # One small step first: what Keras and torch map for any step is part
    # of the process, not of the batch.
    make_model(keras, x.shape[1]).fit(x[:8], y[:8], batch_size=8, verbose=0)
    headroom = args.cap_mib * 2**20
    cap = _status_bytes("VmSize") + headroom
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return _status_bytes("VmRSS") + headroom


def out_of_memory_errors(backend):
    """The exception types plain `fit` raises when memory runs out."""
    if backend == "tensorflow":
        import tensorflow as tf

        return (tf.errors.ResourceExhaustedError,)
    if backend == "torch":
        # On the CPU torch's allocator raises a RuntimeError; on CUDA,
        # torch.OutOfMemoryError (a RuntimeError too).
        return (RuntimeError,)
    import jax

    return (jax.errors.JaxRuntimeError,)


def main():
    args = parse_args()
    memory_limit = cap_memory(args)

    import logging

    import numpy as np
    import keras

    import keras_memguard

    # The guard says what it plans and why, one line per change.
    logging.basicConfig(format="keras_memguard: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)

    rng = np.random.default_rng(0)
    samples = 3 * args.batch_size
    # XLA's convolutions on a CPU are slow to train: JAX gets smaller images.
    size = 32 if args.backend == "jax" else 64
    x = rng.normal(size=(samples, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=(samples,))
    if args.backend == "torch":
        memory_limit = cap_torch_memory(args, keras, x, y)

    print(
        f"1. Plain fit at batch {args.batch_size} under a {args.cap_mib} MiB cap "
        f"({args.backend})"
    )
    if args.backend == "jax":
        # JAX's allocator takes its size once, when the process starts (on
        # a GPU: XLA_PYTHON_CLIENT_MEM_FRACTION); the guard plans against
        # `memory_limit` instead.
        print(
            "   skipped: JAX's allocator cannot be capped once it started; "
            f"the guard plans against memory_limit={args.cap_mib} MiB"
        )
    else:
        try:
            make_model(keras, size).fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
            print("   finished (raise the batch size to see it run out of memory)")
        except out_of_memory_errors(args.backend) as error:
            print(f"   ran out of memory ({type(error).__name__})")

    print("2. The same fit with MemoryGuard and MemoryMonitor")
    monitor = keras_memguard.MemoryMonitor(
        log_dir=args.log_dir, memory_limit=memory_limit, growth=True
    )
    guard = keras_memguard.MemoryGuard(log_dir=args.log_dir, memory_limit=memory_limit)
    history = make_model(keras, size).fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[monitor, guard],
        verbose=2,
    )

    print()
    peaks = history.history.get("memory_peak_mib")
    for epoch, k in enumerate(history.history["micro_batches"]):
        peak = f"peak {peaks[epoch]:.1f} MiB, " if peaks else ""
        print(f"epoch {epoch + 1}: {peak}{int(k)} micro-batches")
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
