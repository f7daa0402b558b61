"""A decoder language model compiled by XLA, as on a GPU, trained under MemoryGuard.

On a GPU, Keras 3 compiles the train step with XLA (`jit_compile="auto"`
resolves to XLA there), and an out-of-memory error inside an XLA program
can end the process. This trains a small GPT-style decoder (token and
position embeddings, two causal self-attention blocks, 2000 logits a token)
on padded token ids whose padding the loss skips (`ignore_class=0`), with
TensorFlow's CPU allocator capped at `--cap-mib` and acting as a GPU's
(`keras_memguard.testing.act_as_gpu`: the step compiled as on a GPU):

1. plain `fit` at batch 32, in a process of its own: it runs out of memory;
2. the same `fit` with `MemoryGuard`: before the first step runs, the
   guard reads the buffer assignment XLA made for the micro-batched step
   and picks how many micro-batches fit; every batch trains, with the same
   update as the whole batch (each micro-batch weighted by the tokens its
   loss averages over), and no out-of-memory error.

`--xla off` compiles the step without XLA (`jit_compile=False`), as Keras
does on a CPU-only machine; the guard then plans from measured steps.

    python examples/language_model.py [--xla off] [--cap-mib 110] [--epochs 2]
"""

import argparse
import os
import subprocess
import sys

VOCABULARY, TOKENS, WIDTH = 2000, 128, 128
# Printed by the plain run's own process, read by the parent.
PLAIN_MARKER = "plain fit: "


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xla", choices=("on", "off"), default="on")
    parser.add_argument("--cap-mib", type=int, default=110)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-dir", default=os.path.join("logs", "language_model"))
    # The plain run, in a process of its own (an error inside an XLA
    # program can end the process it happens in).
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def make_model(keras, xla):
    """The decoder, seeded and compiled as `fit` on a GPU would compile it."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TOKENS,), dtype="int32")
    x = layers.Embedding(VOCABULARY, WIDTH)(tokens)
    x = x + layers.Embedding(TOKENS, WIDTH)(keras.ops.arange(TOKENS))
    for _ in range(2):
        attended = layers.MultiHeadAttention(4, WIDTH // 4)(x, x, use_causal_mask=True)
        x = layers.LayerNormalization()(x + attended)
        hidden = layers.Dense(WIDTH)(layers.Dense(4 * WIDTH, activation="gelu")(x))
        x = layers.LayerNormalization()(x + hidden)
    model = keras.Model(tokens, layers.Dense(VOCABULARY)(x))
    model.compile(
        optimizer="adam",
        # The mean over the tokens that are not padding.
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
        # "auto": XLA, as on a GPU (act_as_gpu); False: as on a CPU-only machine.
        jit_compile="auto" if xla else False,
    )
    return model


def make_data(np, batch_size):
    """Four batches of padded sequences: next-token targets, zeros after each end."""
    rng = np.random.default_rng(0)
    samples = 4 * batch_size
    x = rng.integers(1, VOCABULARY, size=(samples, TOKENS)).astype("int32")
    y = np.roll(x, -1, axis=1)
    lengths = rng.integers(TOKENS // 4, TOKENS + 1, samples)
    padding = np.arange(TOKENS)[None, :] >= lengths[:, None]
    x[padding], y[padding] = 0, 0
    return x, y


def plain_fit_in_a_child(args):
    """Runs the plain `fit` in a process of its own; returns what became of it."""
    run = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--plain", "--xla", args.xla,
         "--cap-mib", str(args.cap_mib), "--batch-size", str(args.batch_size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in run.stdout.splitlines():
        if line.startswith(PLAIN_MARKER):
            return line[len(PLAIN_MARKER):]
    if run.returncode < 0:
        return f"the process was killed by signal {-run.returncode}"
    return f"the process exited with status {run.returncode}"


def main():
    args = parse_args()
    from keras_memguard.testing import memory_cap_env

    # Before TensorFlow is imported: the allocator reads these once.
    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))
    if not args.plain:
        print(
            f"1. Plain fit at batch {args.batch_size} under a {args.cap_mib} MiB cap "
            f"(XLA {args.xla}), in a process of its own"
        )
        print(f"   {plain_fit_in_a_child(args)}", flush=True)

    import logging

    import numpy as np
    import keras
    import tensorflow as tf

    import keras_memguard
    from keras_memguard.testing import act_as_gpu

    act_as_gpu()
    x, y = make_data(np, args.batch_size)
    model = make_model(keras, args.xla == "on")
    if args.plain:
        try:
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
            print(PLAIN_MARKER + "finished (raise the batch size to see it run out of memory)")
        except tf.errors.ResourceExhaustedError:
            print(PLAIN_MARKER + "ran out of memory (ResourceExhaustedError)", flush=True)
        # TensorFlow can abort at exit after an error inside an XLA program.
        os._exit(0)

    # The guard says what it plans and why, one line per change.
    logging.basicConfig(format="keras_memguard: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)
    print("2. The same fit with MemoryGuard and MemoryMonitor")
    monitor = keras_memguard.MemoryMonitor(log_dir=args.log_dir)
    guard = keras_memguard.MemoryGuard(log_dir=args.log_dir)
    history = model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=[monitor, guard],
        verbose=2,
    )
    print()
    print(f"the step compiled with XLA: {bool(model.jit_compile)}")
    peaks = history.history.get("memory_peak_mib")
    for epoch, k in enumerate(history.history["micro_batches"]):
        peak = f"peak {peaks[epoch]:.1f} MiB, " if peaks else ""
        print(f"epoch {epoch + 1}: {peak}{int(k)} micro-batches")
    print(
        f"every batch trained ({len(x)} sequences per epoch); out-of-memory "
        f"recoveries: {guard.oom_recoveries}"
    )
    print(f"    tensorboard --logdir {args.log_dir}    # Custom Scalars tab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
