"""Models whose weights leave little room for gradient accumulators, under a real cap.

MLPs on numpy inputs, under `MemoryGuard`; the first two with 32 MiB of
weights and 64 MiB of Adam slots:

- `wide`: two 2048x2048 `Dense` layers, `fit(batch_size=16)` on 64
  samples. Each layer's gradient is half the weights, and Adam's update of
  one takes as much again, so accumulating peaks within a few MiB of plain
  training: whether it fits a tight cap depends on the order the ops ran.
- `deep`: eight 1024x1024 `Dense` layers, `fit(batch_size=128)` on 256
  samples. A layer's gradient is an eighth of the weights: plain training
  holds little beside the weights and slots, while the accumulators take a
  whole copy of the weights, which the test's cap leaves no room for.
- `long`: sixteen 1024x1024 `Dense` layers over 2304 timesteps, plain
  SGD, `fit(batch_size=2)` on 4 samples. The weights and inputs take 152
  MiB, the accumulators 64 MiB, and one sample's activations more than
  the accumulators leave of a cap near 340 MiB.

Arguments: the guard's `mode`, the model (`wide`, `deep` or `long`), and `xla` to
compile the step with XLA. Reports through `emit_result`: the error raised,
if any, the batches that ended, the recoveries and the package's log lines.
"""

import sys

import keras
import numpy as np

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import collect_package_messages


# model: (width, hidden layers, batch size, samples, timesteps, optimizer)
SHAPES = {
    "wide": (2048, 2, 16, 64, None, "adam"),
    "deep": (1024, 8, 128, 256, None, "adam"),
    "long": (1024, 16, 2, 4, 2304, "sgd"),
}


def mlp(width, depth, timesteps=None, optimizer="adam", jit_compile=False):
    keras.utils.set_random_seed(0)
    inputs = (width,) if timesteps is None else (timesteps, width)
    pool = [] if timesteps is None else [keras.layers.GlobalAveragePooling1D()]
    model = keras.Sequential(
        [keras.Input(inputs)]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + pool
        + [keras.layers.Dense(10)]
    )
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def main():
    mode, shape = sys.argv[1], sys.argv[2]
    width, depth, batch_size, samples, timesteps, optimizer = SHAPES[shape]
    messages = collect_package_messages()
    rng = np.random.default_rng(0)
    sample = (width,) if timesteps is None else (timesteps, width)
    x = rng.random((samples,) + sample, dtype="float32")
    y = rng.integers(0, 10, samples)
    model = mlp(width, depth, timesteps, optimizer, jit_compile=sys.argv[3:] == ["xla"])
    guard = keras_memguard.MemoryGuard(mode=mode, plan_cache=False)
    error = None
    batches = []
    ends = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    try:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, callbacks=[guard, ends])
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        error = f"{type(raised).__name__}: {raised}"
    emit_result({
        "error": error,
        "batches": len(batches),
        "micro_batches": guard.micro_batches,
        "oom_recoveries": guard.oom_recoveries,
        "messages": list(messages),
    })


if __name__ == "__main__":
    main()
