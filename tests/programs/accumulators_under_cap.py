"""A model whose weights leave no room for gradient accumulators, under a real cap.

A wide MLP (two 2048x2048 `Dense` layers: 32 MiB of weights, 64 MiB of
Adam slots) on numpy inputs, `fit(batch_size=16)` under `MemoryGuard`.
Plain training at that batch holds one copy of the gradients beside them;
accumulating holds a second (the accumulators), which this cap does not
leave room for at any micro-batch count. Arguments: the guard's `mode`,
and `xla` to compile the step with XLA. Reports through `emit_result`: the
error raised, if any, the batches that ended, the recoveries and the
package's log lines.
"""

import sys

import keras
import numpy as np

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import collect_package_messages


def wide_mlp(jit_compile=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((2048,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def main():
    mode = sys.argv[1]
    messages = collect_package_messages()
    rng = np.random.default_rng(0)
    x = rng.random((64, 2048), dtype="float32")
    y = rng.integers(0, 10, 64)
    model = wide_mlp(jit_compile=sys.argv[2:] == ["xla"])
    guard = keras_memguard.MemoryGuard(mode=mode, plan_cache=False)
    error = None
    batches = []
    ends = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[guard, ends])
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
