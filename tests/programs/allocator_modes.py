"""AllocatorProbe without the BFC allocator: the mode TensorFlow was started
in (oneDNN on: "default"; off: "unavailable"), its samples and its warnings;
what `find_batch_size` makes of those readings on a small MLP; and a
default `MemoryGuard` on a BatchNormalization MLP against plain `fit`: the
micro-batch count of each epoch, the weights' largest difference and the
guard's messages.

Run by tests/test_allocator_probe.py with `TF_ENABLE_ONEDNN_OPTS` set and
no BFC variables; reports through `emit_result`. The warnings must point at
this file, the probe's caller.
"""

import warnings


def main():
    import tensorflow as tf
    from keras_memguard import AllocatorProbe
    from keras_memguard.testing import emit_result

    import keras
    import numpy as np
    from keras_memguard import find_batch_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = AllocatorProbe()
        probe.reset()
        small = tf.zeros([16])  # Below what the default allocator counts.
        samples = [probe.sample() for _ in range(3)]
        big = tf.zeros([4 * 2**20])
        samples.append(probe.sample())
    model = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile("adam", "mse")
    before = [w.copy() for w in model.get_weights()]
    x = np.ones((256, 12), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            found = find_batch_size(model, x, x[:, :1], memory_limit=64 * 2**20)
        except Exception as error:  # What the user gets is what is checked.
            search = [type(error).__name__, str(error)]
        else:
            search = ["answer", found.largest_batch_size]
    guarded = guarded_against_plain()
    emit_result({
        "guarded": guarded,
        "search": search,
        "weights_kept": all(
            np.array_equal(a, b) for a, b in zip(before, model.get_weights())
        ),
        "mode": probe.mode,
        "source": probe.limit_source("CPU:0"),
        "limit": probe.limit_bytes("CPU:0"),
        "samples": [[s.current_bytes, s.peak_bytes, s.usage] for (s,) in samples],
        "warnings": [[str(w.message), w.filename] for w in caught],
    })


def guarded_against_plain():
    import keras
    import numpy as np
    import keras_memguard
    from programs.common import collect_package_messages

    messages = collect_package_messages()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 8)).astype("float32")
    y = rng.integers(0, 3, 192)
    weights, counts = [], []
    for guard in (None, keras_memguard.MemoryGuard(memory_limit=2**30, plan_cache=False)):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Dense(3, activation="softmax"),
        ])
        model.compile("adam", "sparse_categorical_crossentropy")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = model.fit(
                x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                callbacks=[guard] if guard else [],
            )
        weights.append(model.get_weights())
        counts.append(history.history.get("micro_batches"))
    # A model with its own `train_step` (batches trained whole), then
    # evaluated under the same guard: each batch one forward pass.
    class OwnStep(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(3, activation="softmax")
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

        def call(self, inputs, training=False):
            self.calls.assign_add(1.0)
            return self.out(self.hidden(inputs))

        def train_step(self, data):
            return super().train_step(data)

    own = OwnStep()
    own.compile("adam", "sparse_categorical_crossentropy")
    guard = keras_memguard.MemoryGuard(memory_limit=2**30, plan_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[guard])
        before = float(own.calls.numpy())
        own.evaluate(x, y, batch_size=64, verbose=0, callbacks=[guard])
    return {
        "own_step_evaluate_passes": float(own.calls.numpy()) - before,
        "micro_batches": counts[1],
        "difference": max(float(np.max(np.abs(a - b))) for a, b in zip(*weights)),
        "messages": messages,
    }


if __name__ == "__main__":
    main()
