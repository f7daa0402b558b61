"""Trains a CNN whose batch does not fit under an address-space cap.

Run by `test_torch_replay.py` through
`keras_memguard.testing.run_with_address_space_cap`, with arguments
`capped WEIGHTS_PATH` (plain `fit` first, which must run out of memory, then
`MemGuardMixin` from the same initial weights, starting at one
micro-batch) or `reference WEIGHTS_PATH K` (the same model and data at `K`
micro-batches from the start, without the out-of-memory error). The
weights go to `WEIGHTS_PATH` (`.npz`), the rest to `emit_result`.
"""

import gc
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_memguard.backends.torch.mixin import MemGuardMixin  # noqa: E402
from keras_memguard.backends.torch.replay import is_out_of_memory  # noqa: E402
from keras_memguard.testing import emit_result  # noqa: E402

SAMPLES, BATCH = 1024, 512
FIT = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


class GuardedSequential(MemGuardMixin, keras.Sequential):
    pass


def build(model_class):
    keras.utils.set_random_seed(0)
    model = model_class(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 64, 64, 3)).astype("float32")
    return x, rng.integers(0, 10, size=(SAMPLES,))


def main(role, weights_path, *rest):
    x, y = data()
    result = {}
    if role == "capped":
        plain = build(keras.Sequential)
        try:
            plain.fit(x[:BATCH], y[:BATCH], **FIT)
            result["plain_error"] = None
        except RuntimeError as error:
            result["plain_error"] = str(error)
            result["plain_error_is_out_of_memory"] = is_out_of_memory(error)
        del plain
        gc.collect()
        model = build(GuardedSequential)
    else:
        model = build(GuardedSequential)
        model.micro_batches = int(rest[0])
    history = model.fit(x, y, **FIT)
    function = model.train_function
    result.update(
        micro_batches=model.micro_batches,
        replays=function.replays,
        failures=[
            [f.batch_size, f.micro_batches, f.allocation_bytes, is_out_of_memory(f.error)]
            for f in function.failures
        ],
        history={key: [float(v) for v in values] for key, values in history.history.items()},
        iterations=int(model.optimizer.iterations.numpy()),
    )
    np.savez(weights_path, *model.get_weights())
    emit_result(result)


if __name__ == "__main__":
    main(*sys.argv[1:])
