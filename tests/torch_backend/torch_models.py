"""Models users bring, built for the PyTorch tests (small: two shared CPUs)."""

import numpy as np

import keras

VOCAB, MAXLEN = 20, 6


def _adam():
    return keras.optimizers.Adam(1e-2)


def make_mlp():
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=_adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def mlp_data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 8)).astype("float32"),
        rng.integers(0, 3, size=(n,)),
    )


def weighted_data(n=60, seed=0):
    """The MLP's data with per-sample weights (zeros included)."""
    x, y = mlp_data(n, seed)
    weights = np.random.default_rng(seed + 1).uniform(0, 2, size=(n,))
    weights[::7] = 0.0
    return x, y, weights.astype("float32")


def make_embedding():
    """Token ids through an `Embedding`, pooled, into a classifier."""
    model = keras.Sequential(
        [
            keras.Input((MAXLEN,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=_adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def token_data(n=60, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, MAXLEN)).astype("int32")
    return x, (x[:, :2].sum(axis=1) % 2).astype("int32")


def make_two_headed():
    """Two inputs, two outputs, two weighted losses, metrics per output."""
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(16, activation="relu")(
        keras.layers.Concatenate()([a, b])
    )
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(2, name="reg")(h)
    model = keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg})
    model.compile(
        optimizer=_adam(),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    return model


def two_headed_data(n=60, seed=4):
    rng = np.random.default_rng(seed)
    x = {
        "a": rng.normal(size=(n, 6)).astype("float32"),
        "b": rng.normal(size=(n, 4)).astype("float32"),
    }
    y = {
        "cls": rng.integers(0, 3, size=(n,)),
        "reg": rng.normal(size=(n, 2)).astype("float32"),
    }
    return x, y


def make_masked():
    """A per-token classifier whose loss ignores class 0 (padding)."""
    model = keras.Sequential(
        [
            keras.Input((MAXLEN,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8),
            keras.layers.Dense(4, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=_adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
        metrics=["accuracy"],
    )
    return model


def masked_data(n=60, seed=5):
    """Targets with a different count of ignored (0) tokens per sample."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, MAXLEN)).astype("int32")
    y = (x % 3 + 1).astype("int32")
    lengths = rng.integers(1, MAXLEN + 1, size=(n,))
    y[np.arange(MAXLEN)[None, :] >= lengths[:, None]] = 0
    return x, y


def make_batch_norm():
    """A small CNN with BatchNormalization (batch statistics per micro-batch)."""
    model = keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=_adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def image_data(n=60, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 6, 6, 1)).astype("float32"),
        rng.integers(0, 2, size=(n,)),
    )


USER_MODELS = {
    "mlp": (make_mlp, mlp_data),
    "sample_weights": (make_mlp, weighted_data),
    "embedding": (make_embedding, token_data),
    "two_headed": (make_two_headed, two_headed_data),
    "masked_loss": (make_masked, masked_data),
    "batch_norm": (make_batch_norm, image_data),
}


def twins(build):
    """Two identically built models with the same initial weights."""
    keras.utils.set_random_seed(0)
    first = build()
    keras.utils.set_random_seed(0)
    second = build()
    second.set_weights(first.get_weights())
    return first, second


def max_relative_difference(a, b, trainable_only=False):
    """The largest `|u - v| / max(1, |u|)` over two models' weights."""
    if trainable_only:
        pairs = [
            (u.numpy(), v.numpy())
            for u, v in zip(a.trainable_weights, b.trainable_weights)
        ]
    else:
        pairs = zip(a.get_weights(), b.get_weights())
    worst = 0.0
    for u, v in pairs:
        u = np.asarray(u, "float64")
        v = np.asarray(v, "float64")
        worst = max(worst, float(np.max(np.abs(u - v) / np.maximum(1.0, np.abs(u)))))
    return worst


def fit_arguments(data):
    """`(args, kwargs)` for `fit` from a data builder's `(x, y[, weights])`."""
    x, y, *weights = data
    return (x, y), ({"sample_weight": weights[0]} if weights else {})


class FailOnCall(keras.layers.Layer):
    """Passes its input through; raises on chosen training calls.

    The `n`-th call in training (counting from 1) raises `error(message)`
    when `n` is in `fail_at`: a real exception of the type torch raises,
    at a point inside the forward pass.
    """

    def __init__(self, fail_at=(), error=None, message=None, **kwargs):
        super().__init__(**kwargs)
        self.fail_at = set(fail_at)
        self.error = error
        self.message = message
        self.calls = 0

    def call(self, x, training=None):
        if training:
            self.calls += 1
            if self.calls in self.fail_at:
                raise self.error(self.message)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def make_failing(fail_at=(), error=None, message=None, model_class=None):
    """An MLP with BatchNormalization and Dropout that fails on chosen calls."""
    model_class = model_class or keras.Sequential
    model = model_class(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            FailOnCall(fail_at, error, message),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=_adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model
