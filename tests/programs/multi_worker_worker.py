"""One worker of a MultiWorkerMirroredStrategy cluster, guarded.

The cluster comes through `TF_CONFIG`, the scenario (a JSON dict: `side`,
`n`, `batch`, `guard` (MemoryGuard arguments per task), `custom_step`,
`fixed_batch`: a model whose code needs batches of that many samples)
through `MEMGUARD_SCENARIO`. Run by tests/test_multi_worker.py; reports
through `emit_result`.
"""

import json
import os
import time

import numpy as np
import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from keras_memguard.backends.tensorflow import multi_worker


class Record(keras.callbacks.Callback):
    def __init__(self, start):
        super().__init__()
        self.start = start
        self.k = []
        self.times = []

    def on_train_begin(self, logs=None):
        self.times.append(round(time.monotonic() - self.start, 2))

    def on_train_batch_end(self, batch, logs=None):
        self.k.append(int(logs["micro_batches"]))
        self.times.append(round(time.monotonic() - self.start, 2))


class ClippedNet(keras_memguard.MemGuardMixin, keras.Model):
    # A `train_step` override: keras_memguard cannot split it in two.

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(32, 3, activation="relu")
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(self.pool(self.conv(x)))

    def train_step(self, data):
        from keras_memguard.backends.tensorflow import accumulate_gradients
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        result = accumulate_gradients(self, data, self.micro_batches)
        gradients = [tf.clip_by_norm(g, 1.0) for g in result.gradients]
        with tf.control_dependencies(result.control_inputs()):
            self._loss_tracker.update_state(
                result.loss, sample_weight=result.batch_size)
            self.optimizer.apply(gradients, self.trainable_weights)
            return self.compute_metrics(
                x, y, result.y_pred, sample_weight=sample_weight)


class FixedBatchReshape(keras.layers.Layer):
    """Reshapes to a batch of `batch` samples, as code written for one batch
    size does (`None`: the input's own batch)."""

    def __init__(self, batch=None, **kwargs):
        super().__init__(**kwargs)
        self.batch = batch

    def call(self, inputs):
        return keras.ops.reshape(inputs, (self.batch or -1, 4, 4))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 4, 4)


def fixed_batch_model(side, batch):
    """A regressor whose code needs batches of `batch` samples."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((side, side, 3))
    hidden = keras.layers.GlobalAveragePooling2D()(
        keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    )
    hidden = FixedBatchReshape(batch)(keras.layers.Dense(16, activation="relu")(hidden))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(hidden)))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def make_model(strategy, scenario):
    keras.utils.set_random_seed(0)
    if scenario.get("fixed_batch"):
        with strategy.scope():
            return fixed_batch_model(scenario["side"], scenario["fixed_batch"])
    if scenario.get("custom_step"):
        with strategy.scope():
            model = ClippedNet()
            model.build((None, scenario["side"], scenario["side"], 3))
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        return model
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((scenario["side"], scenario["side"], 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def main():
    scenario = json.loads(os.environ["MEMGUARD_SCENARIO"])
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    rng = np.random.default_rng(1)
    n, side = scenario["n"], scenario["side"]
    x = rng.normal(size=(n, side, side, 3)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(scenario["batch"])

    model = multi_worker.prepare_multi_worker(make_model(strategy, scenario))
    guard = keras_memguard.MemoryGuard(**scenario["guard"][task])
    start = time.monotonic()
    record = Record(start)
    result = {"task": task}
    try:
        history = model.fit(dataset, epochs=1, verbose=0, callbacks=[guard, record])
        result["loss"] = history.history["loss"]
        result["weights"] = [w.tolist() for w in model.get_weights()]
    except Exception as error:
        result["error"] = type(error).__name__
        result["message"] = str(error)
        result["worker"] = getattr(error, "worker", None)
    result.update(
        k=record.k, times=record.times, micro_batches=guard.micro_batches,
        oom_recoveries=guard.oom_recoveries, seconds=time.monotonic() - start,
        readings=[list(r) for r in guard.state.readings],
        limit=guard.controller.limit_bytes)
    emit_result(result)


if __name__ == "__main__":
    main()
