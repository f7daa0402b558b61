"""Models and data for the exactness tests every backend runs (Keras only).

The TensorFlow, JAX and PyTorch test runs import this module alike: it
needs Keras and numpy, nothing of a backend.
"""

import keras
import numpy as np


class PerSampleLoss(keras.Model):
    """A `compute_loss` of its own that is a mean over samples."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean(keras.ops.square(y_pred[:, :1] - y))


class InBatchNegatives(keras.Model):
    """A contrastive `compute_loss` (SimCLR, CLIP): each sample's negatives
    are the other samples of its batch."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        a = keras.ops.normalize(y_pred[:, :8], axis=1)
        b = keras.ops.normalize(y_pred[:, 8:], axis=1)
        logits = keras.ops.matmul(a, keras.ops.transpose(b)) / 0.1
        labels = keras.ops.arange(keras.ops.shape(logits)[0])
        return keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        )


def own_loss_model(cls, dropout=0.0):
    """A small MLP of class `cls` with 16 outputs, compiled with Adam."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    hidden = keras.layers.Dropout(dropout)(hidden)
    model = cls(inputs, keras.layers.Dense(16)(hidden))
    model.compile("adam")
    return model


def regression_data(n=100, seed=0):
    """`(x, y, weight)`: 12 features, one target, sample weights skewed to 0."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    weight = (rng.random(n) ** 3).astype("float32")
    return x, y, weight


def reduced_regression_model(reduction):
    """An MLP with an `l2` regularizer, its MSE reduced by `reduction`; SGD."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu", kernel_regularizer="l2")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("sgd", keras.losses.MeanSquaredError(reduction=reduction), metrics=["mae"])
    return model


def weights_and_losses(reduction, callbacks):
    """Fits `reduced_regression_model(reduction)` on `regression_data()`.

    Batches of 25 over 100 samples, 2 epochs, in order.

    Returns:
        `(weights, losses)`: the weights after, the loss of each epoch.
    """
    x, y, weight = regression_data()
    model = reduced_regression_model(reduction)
    history = model.fit(
        x, y, sample_weight=weight, batch_size=25, epochs=2, shuffle=False,
        verbose=0, callbacks=callbacks,
    )
    return model.get_weights(), history.history["loss"]
