"""Shared test helpers (in-process tests; subprocess scripts carry their own copy)."""

import keras
import tensorflow as tf


class SampleCount(keras.metrics.Metric):
    """Counts the samples a metric update sees: none lost, none twice."""

    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

    def result(self):
        # A copy: the variable itself would change under `fit`'s epoch logs
        # when validation reuses the metric.
        return self.count * 1.0
