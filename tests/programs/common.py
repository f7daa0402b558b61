"""Helpers shared by the test programs."""

import logging

import keras
import tensorflow as tf


def design_cnn(metrics=()):
    """The 64x64x3 CNN of the design notes and benchmarks, seeded, compiled.

    Two 3x3 convolutions of 64 filters: under a 600 MiB cap plain training
    fits batches of 136 at most.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64, 64, 3)),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


class SampleCount(keras.metrics.Metric):
    """Counts the samples a metric update sees: none lost, none twice."""

    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

    def result(self):
        if tf.distribute.has_strategy():
            # Inside a replica: the variable itself, read (summed over the
            # replicas) after the step; a copy would hold this replica's count.
            return self.count
        # A copy: the variable itself would change under `fit`'s epoch logs
        # when validation reuses the metric.
        return self.count * 1.0


def collect_package_messages():
    """Returns a list that receives every keras_memguard log message (INFO up)."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("keras_memguard")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    return messages


def weights(model):
    """The model's weights as nested lists (JSON)."""
    return [w.tolist() for w in model.get_weights()]
