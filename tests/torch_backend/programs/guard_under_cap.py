"""`MemoryGuard` on Keras' PyTorch backend under a real address-space cap.

Run by `test_torch_guard.py` as `python guard_under_cap.py WEIGHTS_PATH
[HEADROOM_MIB]`. After importing and warming up (a `fit` of a tiny batch,
plain and guarded), it caps its own address space with `RLIMIT_AS` at the
address space in use plus `HEADROOM_MIB`, and gives the guard
`memory_limit = resident memory + HEADROOM_MIB` (the CPU probe reads
resident memory; the address space beyond it is a roughly constant offset).
Then, in this order:

1. `plain`: Keras' own `fit` of one batch, which must fail in torch's CPU
   allocator (`RuntimeError: ... DefaultCPUAllocator: can't allocate memory`).
2. `planned`: `MemoryGuard()` trains every batch of two epochs.
3. `reacting`: `MemoryGuard(plan=False, micro_batches=1)` trains one epoch
   of one batch, which runs out of memory at one micro-batch and is
   replayed; its weights go to `WEIGHTS_PATH` (`.npz`).
4. With the cap lifted (the soft limit only was lowered): a `MemGuardMixin`
   model from the same initial weights at the count the replay ended on,
   and Keras' plain `fit`, on the same batch: their weights go to
   `WEIGHTS_PATH` too, as `mixin_*` and `plain_*`.

Everything else goes to `emit_result`; a step that raises records its error
instead, so the tests say which step failed.
"""

import gc
import logging
import os
import re
import resource
import sys
import traceback

os.environ["KERAS_BACKEND"] = "torch"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_memguard  # noqa: E402
from keras_memguard.backends.torch.mixin import MemGuardMixin  # noqa: E402
from keras_memguard.backends.torch.replay import is_out_of_memory  # noqa: E402
from keras_memguard.testing import emit_result  # noqa: E402

MIB = 2**20
SAMPLES, BATCH = 128, 64
SIDE = 128
BIG = 64 * 2**30
REPLAY_RE = re.compile(r"replaying it with (\d+) micro-batch")


class GuardedSequential(MemGuardMixin, keras.Sequential):
    pass


class SampleCount(keras.metrics.Metric):
    """The samples the metrics saw this epoch (a replay must not count twice)."""

    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self):
        return self.count


def build(model_class=keras.Sequential):
    """Activations, not weights or arithmetic, dominate: 1x1 convolutions."""
    keras.utils.set_random_seed(0)
    model = model_class(
        [
            keras.Input((SIDE, SIDE, 3)),
            keras.layers.Conv2D(32, 1, activation="relu"),
            keras.layers.Conv2D(32, 1, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[SampleCount()],
    )
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, SIDE, SIDE, 3)).astype("float32")
    return x, rng.integers(0, 10, size=(SAMPLES,))


def status(key):
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class Batches(keras.callbacks.Callback):
    """Each batch's `micro_batches` and loss, as `fit`'s logs give them."""

    def __init__(self):
        super().__init__()
        self.counts, self.losses = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append((logs or {}).get("micro_batches"))
        self.losses.append(float((logs or {}).get("loss", float("nan"))))


def history_of(history):
    return {key: [float(v) for v in values] for key, values in history.history.items()}


def step(result, name, function):
    """Runs one step; records its error (and goes on) where it raises."""
    try:
        result[name] = function()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result[name] = {"error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc()[-3000:]}
    gc.collect()


def main(weights_path, headroom_mib="300"):
    headroom = int(headroom_mib) * MIB
    x, y = data()
    handler = Messages()
    logger = logging.getLogger("keras_memguard")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    # Warm up: every module, kernel and allocator pool a step needs.
    build().fit(x[:8], y[:8], batch_size=8, verbose=0)
    warm = build(GuardedSequential)
    warm.micro_batches = 2
    warm.fit(x[:8], y[:8], batch_size=8, verbose=0, callbacks=[
        keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)])
    del warm
    gc.collect()
    address_space, resident = status("VmSize"), status("VmRSS")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_space + headroom, hard))
    limit = resident + headroom
    handler.messages.clear()
    result = {"address_space_mib": address_space / MIB, "resident_mib": resident / MIB,
              "memory_limit": limit}

    def plain():
        model = build()
        try:
            model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
        except RuntimeError as error:
            return {"error": str(error)[-600:], "is_out_of_memory": is_out_of_memory(error)}
        return {"error": None}

    def planned():
        model = build()
        guard = keras_memguard.MemoryGuard(memory_limit=limit)
        batches = Batches()
        handler.messages.clear()
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0, callbacks=[guard, batches])
        return {
            "messages": list(handler.messages),
            "history": history_of(history),
            "counts": batches.counts,
            "losses": batches.losses,
            "oom_recoveries": guard.oom_recoveries,
            "micro_batches": guard.micro_batches,
            "iterations": int(model.optimizer.iterations.numpy()),
            "finite_weights": all(bool(np.isfinite(w).all()) for w in model.get_weights()),
        }

    def reacting():
        model = build()
        guard = keras_memguard.MemoryGuard(plan=False, micro_batches=1, memory_limit=limit)
        handler.messages.clear()
        history = model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1,
                            shuffle=False, verbose=0, callbacks=[guard])
        replays = [m for m in handler.messages if REPLAY_RE.search(m)]
        np.savez(weights_path, *model.get_weights())
        return {
            "history": history_of(history),
            "replay_messages": replays,
            "ran_at": int(REPLAY_RE.search(replays[-1]).group(1)) if replays else 1,
            "oom_recoveries": guard.oom_recoveries,
            "micro_batches": guard.micro_batches,
            "iterations": int(model.optimizer.iterations.numpy()),
        }

    step(result, "planned", planned)
    step(result, "reacting", reacting)
    # Last: memory a failed attempt leaves resident (the C allocator keeps
    # it) would count as in use for the guards after it.
    step(result, "plain", plain)

    # The references, without the cap.
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    def references():
        ran_at = result["reacting"]["ran_at"]
        mixin = build(GuardedSequential)
        mixin.micro_batches = ran_at
        mixin_history = mixin.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1,
                                  shuffle=False, verbose=0)
        plain_model = build()
        plain_model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1,
                        shuffle=False, verbose=0)
        reacted = np.load(weights_path)
        reacted = [reacted[f"arr_{i}"] for i in range(len(reacted.files))]
        np.savez(weights_path, *reacted,
                 **{f"mixin_{i}": w for i, w in enumerate(mixin.get_weights())},
                 **{f"plain_{i}": w for i, w in enumerate(plain_model.get_weights())})
        return {"mixin_history": history_of(mixin_history),
                "mixin_micro_batches": mixin.micro_batches}

    if "error" not in result["reacting"]:
        step(result, "references", references)
    emit_result(result)


if __name__ == "__main__":
    main(*sys.argv[1:])
