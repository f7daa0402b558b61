"""`evaluate` and `predict` under a real 300 MiB cap, plain and guarded.

The 64x64x3 CNN of the benchmarks on 1024 numpy samples (Keras' own input
pipeline). At batch 512 plain `evaluate` runs out of memory; the guard's
runs are compared with plain runs at batch 32, which fit. A second model
whose outputs (512 KiB a sample, 512 MiB in all) exceed the cap shows that
the guard's `predict` keeps no output on the device. A third model, the
same CNN behind a layer that takes 48 MiB on its first call and holds it,
shows a replay sized beside memory taken while the batch ran (as an input
pipeline's prefetch thread does). Run by tests/test_inference.py; reports
through `emit_result`.
"""

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import SampleCount, cnn, collect_package_messages, design_cnn

SAMPLES = 1024
LARGE = 512
SMALL = 32
TAKEN_MIB = 48
# What `TakesMemoryOnce` took: held until the run is over.
TAKEN = []


class TakesMemoryOnce(keras.layers.Layer):
    """Passes its input on; its first call takes `TAKEN_MIB` and holds it.

    Memory taken beside the step while a batch runs: the reading before the
    batch does not count it, the reading after the batch's error does.
    """

    def call(self, x):
        def take():
            if not TAKEN:
                TAKEN.append(tf.ones((TAKEN_MIB * 2**18,), tf.float32))
            return tf.constant(0.0)

        taken = tf.py_function(take, [], tf.float32)
        taken.set_shape(())
        return x + taken

    def compute_output_shape(self, input_shape):
        return input_shape


def out_of_memory(call):
    try:
        call()
    except tf.errors.ResourceExhaustedError:
        return True
    return False


def main():
    messages = collect_package_messages()
    model = design_cnn(metrics=["accuracy", SampleCount()])
    rng = np.random.default_rng(0)
    x = rng.random((SAMPLES, 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, SAMPLES)
    result = {}

    reference = model.evaluate(x, y, batch_size=SMALL, verbose=0, return_dict=True)
    reference_predictions = model.predict(x, batch_size=SMALL, verbose=0)
    result["reference"] = reference
    result["plain_evaluate_out_of_memory"] = out_of_memory(
        lambda: model.evaluate(x, y, batch_size=LARGE, verbose=0)
    )

    # Not planning: the whole batch first, sliced after the error.
    reacting = keras_memguard.MemoryGuard(plan=False)
    result["replayed"] = model.evaluate(
        x, y, batch_size=LARGE, verbose=0, return_dict=True, callbacks=[reacting]
    )
    result["replayed_oom"] = reacting.eval_oom_recoveries

    # The same weights (the layer draws no seed) behind the layer that
    # takes memory during the first attempt.
    taking = cnn(
        (64, 64, 3),
        lambda: [TakesMemoryOnce()]
        + [keras.layers.Conv2D(64, 3, activation="relu") for _ in range(2)],
        metrics=["accuracy", SampleCount()],
    )
    beside = keras_memguard.MemoryGuard(plan=False)
    result["replayed_beside_taken"] = taking.evaluate(
        x, y, batch_size=LARGE, verbose=0, return_dict=True, callbacks=[beside]
    )
    result["replayed_beside_taken_oom"] = beside.eval_oom_recoveries
    result["taken_mib"] = sum(t.shape[0] for t in TAKEN) * 4 / 2**20
    TAKEN.clear()
    del taking

    guard = keras_memguard.MemoryGuard()
    result["planned"] = model.evaluate(
        x, y, batch_size=LARGE, verbose=0, return_dict=True, callbacks=[guard]
    )
    predictions = model.predict(x, batch_size=LARGE, verbose=0, callbacks=[guard])
    result["planned_oom"] = guard.eval_oom_recoveries
    result["predict_oom"] = guard.predict_oom_recoveries
    result["predict_type"] = type(predictions).__name__
    result["predict_max_difference"] = float(np.abs(predictions - reference_predictions).max())
    result["predict_shape"] = list(predictions.shape)

    # 512 KiB of outputs a sample: the whole run's outputs exceed the cap.
    keras.utils.set_random_seed(0)
    wide = keras.Sequential([keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, padding="same")])
    result["wide_plain_out_of_memory"] = out_of_memory(
        lambda: wide.predict(x, batch_size=64, verbose=0)
    )
    wide_predictions = wide.predict(
        x, batch_size=64, verbose=0, callbacks=[keras_memguard.MemoryGuard()]
    )
    result["wide_output_mib"] = wide_predictions.nbytes / 2**20
    first = wide.predict(x[:64], batch_size=64, verbose=0)
    result["wide_first_batch_equal"] = bool(np.array_equal(wide_predictions[:64], first))
    result["wide_in_use_mib"] = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20
    result["messages"] = messages
    emit_result(result)


if __name__ == "__main__":
    main()
