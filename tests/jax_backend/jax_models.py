"""Models users bring (as in tests/test_user_models.py), built for the JAX tests."""

import numpy as np

import keras

VOCAB, MAXLEN, EMBED = 32, 8, 8


def mlp_layers():
    """The MLP's layers, for a `Sequential` class of a test's own."""
    return [
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ]


def make_mlp():
    model = keras.Sequential(mlp_layers())
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def mlp_data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, size=(n,))


def make_cnn():
    """A small CNN with BatchNormalization (batch statistics per micro-batch)."""
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def cnn_data(n=100, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 1)).astype("float32"), rng.integers(0, 2, size=(n,))


def make_two_headed():
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(2, name="reg")(h)
    model = keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg})
    model.compile(
        optimizer="adam",
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    return model


def two_headed_data(n=100, seed=4):
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


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io's embedding: tokens (0 is padding, masked) plus positions."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim, mask_zero=True)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

    def compute_mask(self, x, mask=None):
        return self.token_emb.compute_mask(x)


def make_transformer():
    """An embedding with a padding mask, attention, pooling over the mask."""
    inputs = keras.Input((MAXLEN,), dtype="int32")
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=EMBED)(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + attended)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def text_data(n=100, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, MAXLEN)).astype("int32")
    lengths = rng.integers(3, MAXLEN + 1, size=(n,))
    x[np.arange(MAXLEN)[None, :] >= lengths[:, None]] = 0  # padding
    y = (x[:, :3].sum(axis=1) % 2).astype("int32")
    return x, y


def make_wide_mlp():
    """An MLP whose activations dominate its memory: for planning tests."""
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def wide_data(n=4096, seed=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 64)).astype("float32"), rng.normal(size=(n, 4)).astype("float32")


USER_MODELS = {
    "mlp": (make_mlp, mlp_data),
    "cnn_batch_norm": (make_cnn, cnn_data),
    "two_headed": (make_two_headed, two_headed_data),
    "transformer_masked": (make_transformer, text_data),
}


def twins(build):
    """Two identically built models with the same initial weights."""
    keras.utils.set_random_seed(0)
    first = build()
    keras.utils.set_random_seed(0)
    second = build()
    second.set_weights(first.get_weights())
    return first, second


def max_weight_difference(a, b, trainable_only=False):
    if trainable_only:
        pairs = zip(a.trainable_weights, b.trainable_weights)
        pairs = [(u.numpy(), v.numpy()) for u, v in pairs]
    else:
        pairs = zip(a.get_weights(), b.get_weights())
    return max(
        float(np.max(np.abs(np.asarray(u, "float64") - np.asarray(v, "float64"))))
        for u, v in pairs
    )


def assert_weights_kept_a_split_refused_and_it_trains_on(model, before, x, y, guard, loss_key):
    """After a whole batch ran out of memory: the weights `before`, bit for bit.

    Then `micro_batches=4` is refused at `fit`'s start, and the same model
    trains on once its step no longer fails (`model.fails`).
    """
    import pytest

    import keras_memguard
    from keras_memguard.errors import UnsupportedTrainingSetupError

    for want, got in zip(before, model.get_weights()):
        np.testing.assert_array_equal(got, want)
    split = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    with pytest.raises(UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        model.fit(x, y, batch_size=20, verbose=0, callbacks=[split])
    model.fails = False
    model.make_train_function(force=True)
    history = model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[guard]).history
    assert history["micro_batches"] == [1] and np.isfinite(history[loss_key][0]), history


def assert_guarded_whole_as_plain(plain, model, x, y, caplog, fit_kwargs, eval_batch, **extra):
    """Fits, evaluates and predicts `model` under a default guard beside
    `plain`, fitted the same way first; asserts whole batches and results
    equal to plain Keras'. Returns the guard's WARNING messages.

    `extra`: more `fit` arguments for the guarded fit only (its
    `validation_data`).
    """
    import logging

    import pytest

    import keras_memguard

    keras.utils.set_random_seed(1)
    expected = plain.fit(x, y, **fit_kwargs).history
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    keras.utils.set_random_seed(1)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(x, y, callbacks=[guard], **fit_kwargs, **extra).history
        evaluated = model.evaluate(x, y, batch_size=eval_batch, verbose=0, callbacks=[guard])
        predicted = model.predict(x, batch_size=eval_batch, verbose=0, callbacks=[guard])
    assert history["micro_batches"] == [1] * fit_kwargs["epochs"], history
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-6)
    assert max_weight_difference(plain, model) < 1e-6
    assert evaluated == pytest.approx(plain.evaluate(x, y, batch_size=eval_batch, verbose=0), rel=1e-6)
    np.testing.assert_allclose(predicted, plain.predict(x, batch_size=eval_batch, verbose=0), atol=1e-6)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
