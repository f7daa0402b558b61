"""MirroredStrategy over two logical CPU devices, one scenario per process.

    mirrored uncapped LOG_DIR   monitor and guard at k = 1 and 2 against
                                plain mirrored training, no out-of-memory
                                error; also the capped scenario's plain
                                reference and a replica without samples
    mirrored capped             the guard replays a mirrored step that ran
                                out of memory (run under a 350 MiB cap)

Run by tests/test_mirrored.py; reports through `emit_result`.
"""

import sys

import tensorflow as tf


def configure_two_logical_cpus():
    # Before TensorFlow's runtime starts, so before Keras is imported.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


def run_uncapped(strategy, log_dir):
    import keras
    import keras_memguard
    from keras_memguard.callbacks.sampling import shared_reader
    from keras_memguard.testing import emit_result
    from programs.common import weights
    from programs.mirrored_model import CAPPED, make_data, make_model

    out = {}
    x, y = make_data(160, 32)  # batches of 64, 64, 32: 32, 32, 16 per replica

    reference = make_model(strategy, 32, 32)
    reference_history = reference.fit(
        x, y, batch_size=64, epochs=2, shuffle=False, verbose=0
    )
    out["reference"] = weights(reference)
    out["reference_samples"] = reference_history.history.get("samples")

    for k in (1, 2):
        model = make_model(strategy, 32, 32)
        monitor = keras_memguard.MemoryMonitor(log_dir=f"{log_dir}/k{k}")
        guard = keras_memguard.MemoryGuard(cooldown=1000, plan=False, micro_batches=k)
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(logs["micro_batches"]))
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                            callbacks=[monitor, guard, record])
        out[f"k{k}"] = {
            "weights": weights(model),
            "samples": history.history["samples"],
            "micro_batches": seen,
            "traced_sizes": model.layers[0].sizes,
            "devices": list(shared_reader(model).probe.devices),
        }

    # The capped scenario's model, trained as plain Keras does it, for comparison.
    cx, cy = make_data(CAPPED["n"], CAPPED["size"])
    model = make_model(strategy, CAPPED["size"], CAPPED["filters"])
    model.fit(cx, cy, batch_size=CAPPED["batch_size"], epochs=1, shuffle=False, verbose=0)
    out["capped_reference"] = weights(model)[-2:]

    # 101 samples at batch 20: the last batch has one sample, so replica 1 gets
    # none; plain Keras trains through it.
    x, y = make_data(101, 8)
    model = make_model(strategy, 8, 4)
    try:
        history = model.fit(x, y, batch_size=20, epochs=1, verbose=0,
                            callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 40)])
        out["empty_replica"] = history.history["samples"]
    except Exception as error:
        out["empty_replica"] = f"{type(error).__name__}: {str(error)[:300]}"
    out["logs"] = logged_values(strategy)
    emit_result(out)


def logged_values(strategy):
    """What plain Keras and the guard log under the strategy, side by side.

    A compiled metric whose `result()` is a copy of its sum (the metric's
    variable holds the sum over both replicas), and a `MemGuardMixin` model
    whose own `train_step` logs `accumulate_gradients(...).loss` beside the
    same value passed through `extras` and a plain `GradientTape` loss.
    """
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_memguard

    class Count(keras.metrics.Metric):
        def __init__(self, name="count", **kwargs):
            super().__init__(name=name, **kwargs)
            self.total = self.add_variable(shape=(), initializer="zeros", name="total")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.total.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

        def result(self):
            return self.total * 1.0

    class OwnStep(keras_memguard.MemGuardMixin, keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data

            def compute_loss(x, y, sample_weight):
                loss = keras.ops.mean(keras.ops.square(self(x) - y))
                return loss, {"same": loss}

            result = self.accumulate_gradients(data, compute_loss=compute_loss)
            with tf.GradientTape() as tape:
                tape_loss = keras.ops.mean(keras.ops.square(self(x) - y))
            with tf.control_dependencies(result.control_inputs()):
                self.optimizer.apply(result.gradients, self.trainable_weights)
                return {"loss": result.loss, "same": result.extras["same"],
                        "tape": tape_loss}

    rng = np.random.default_rng(2)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = rng.normal(size=(512, 1)).astype("float32")
    out = {}
    for name, callbacks in (
        ("plain", []),
        ("guard", [keras_memguard.MemoryGuard(
            plan=False, micro_batches=2, cooldown=1000, memory_limit=1 << 40)]),
    ):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse", metrics=[Count()])
        history = model.fit(x, y, batch_size=512, epochs=1, verbose=0, callbacks=callbacks)
        out[name] = history.history["count"]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = OwnStep()
        model.build((None, 8))
        model.compile("sgd")
    model.micro_batches = 2
    history = model.fit(x, y, batch_size=512, epochs=1, verbose=0)
    out["own_step"] = {key: history.history[key][0] for key in ("loss", "same", "tape")}
    return out


def run_capped(strategy):
    import keras_memguard
    from keras_memguard.testing import emit_result
    from programs.common import collect_package_messages, weights
    from programs.mirrored_model import CAPPED, make_data, make_model

    messages = collect_package_messages()
    x, y = make_data(CAPPED["n"], CAPPED["size"])
    model = make_model(strategy, CAPPED["size"], CAPPED["filters"])
    guard = keras_memguard.MemoryGuard(threshold=0.9, plan=False)
    history = model.fit(x, y, batch_size=CAPPED["batch_size"], epochs=1, shuffle=False,
                        verbose=0, callbacks=[keras_memguard.MemoryMonitor(), guard])
    emit_result({
        "samples": history.history["samples"],
        "oom_recoveries": guard.oom_recoveries,
        "micro_batches": guard.micro_batches,
        "iterations": int(model.optimizer.iterations.numpy()),
        "messages": messages,
        "weights": weights(model)[-2:],
    })


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    strategy = configure_two_logical_cpus()
    if argv[0] == "uncapped":
        run_uncapped(strategy, argv[1])
    elif argv[0] == "capped":
        run_capped(strategy)
    else:
        raise SystemExit(f"usage: mirrored uncapped LOG_DIR | mirrored capped; got {argv}")


if __name__ == "__main__":
    main()
