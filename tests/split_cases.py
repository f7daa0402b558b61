"""Models and data for the exactness tests every backend runs (Keras only).

The TensorFlow, JAX and PyTorch test runs import this module alike: it
needs Keras and numpy, nothing of a backend.
"""

import copy
import os
import pickle

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import keras_memguard
from keras_memguard import oom_explanation
from keras_memguard.callbacks import logs_carrier


def fixed_split(micro_batches=4):
    """A `MemoryGuard` that splits every batch in `micro_batches`, unplanned."""
    return keras_memguard.MemoryGuard(
        memory_limit=1 << 30, plan=False, micro_batches=micro_batches
    )


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


def assert_reduction_trains_as_plain_fit(reduction, guard):
    """`weights_and_losses` under `guard` equal plain `fit`'s."""
    weights, losses = weights_and_losses(reduction, [guard])
    reference_weights, reference_losses = weights_and_losses(reduction, [])
    np.testing.assert_allclose(losses, reference_losses, rtol=2e-6)
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def assert_only_the_coupled_loss_is_warned_about(recwarn, make_guard):
    """Per-sample and in-batch-negative losses fitted under `make_guard()`.

    The per-sample one trains as plain `fit` and is not warned about; the
    other is, once.
    """
    x, y, _ = regression_data(n=128)
    plain = own_loss_model(PerSampleLoss)
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    fits = {}
    for cls in (PerSampleLoss, InBatchNegatives):
        fits[cls] = own_loss_model(cls)
        fits[cls].fit(
            x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[make_guard()]
        )
    told = [
        str(w.message) for w in recwarn
        if "not what its micro-batches' losses add up to" in str(w.message)
    ]
    assert len(told) == 1 and "in_batch_negatives" in told[0], told
    for got, want in zip(fits[PerSampleLoss].get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def assert_summed_loss_evaluates_as_unsliced(use_slices):
    """`evaluate` of a summed loss after `use_slices(model)` equals it unsliced.

    `use_slices(model)` installs the backend's function that evaluates a
    batch in 3 slices.
    """
    x, y, weight = regression_data()
    model = reduced_regression_model("sum")
    expected = model.evaluate(
        x, y, sample_weight=weight, batch_size=32, verbose=0, return_dict=True
    )
    use_slices(model)
    sliced = model.evaluate(
        x, y, sample_weight=weight, batch_size=32, verbose=0, return_dict=True
    )
    for key in expected:
        np.testing.assert_allclose(sliced[key], expected[key], rtol=1e-5, err_msg=key)


class SummedActivity(keras.layers.Layer):
    """Keras' own `add_loss` example: a loss summed over the batch's samples."""

    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.square(inputs)))
        return inputs


class PerSampleActivity(keras.layers.Layer):
    """keras.io's CTC layer's way: one added loss per sample, which Keras sums."""

    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(keras.ops.square(inputs), axis=-1, keepdims=True))
        return inputs


class MeanActivity(keras.layers.Layer):
    """A loss added as a mean over the batch."""

    def call(self, inputs):
        self.add_loss(1e-1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def added_loss_model(jit_compile="auto"):
    """An MLP whose layers add losses of every kind; SGD.

    A summed `add_loss`, one of a loss per sample (keras.io's CTC layer
    adds its per-sample losses so), a mean one, Keras' activity regularizer (a sum
    over samples in Keras 3.8, divided by the batch size in later
    releases) and a kernel regularizer.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu", activity_regularizer="l2")(inputs)
    hidden = MeanActivity()(PerSampleActivity()(SummedActivity()(hidden)))
    outputs = keras.layers.Dense(1, kernel_regularizer="l2")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse", jit_compile=jit_compile)
    return model


def assert_added_losses_train_as_plain_fit(recwarn, make_guard=fixed_split, jit_compile="auto"):
    """`added_loss_model` fitted under `make_guard()` (a split) equals plain `fit`.

    Weights, each epoch's loss and `evaluate` afterwards; and nothing is
    said about the losses.
    """
    x, y, _ = regression_data(n=128)
    results = []
    for callbacks in ([], [make_guard()]):
        model = added_loss_model(jit_compile)
        history = model.fit(
            x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        )
        results.append(
            (model.get_weights(), history.history["loss"], model.evaluate(x, y, verbose=0))
        )
    (want, want_losses, want_eval), (got, got_losses, got_eval) = results
    np.testing.assert_allclose(got_losses, want_losses, rtol=2e-6)
    np.testing.assert_allclose(got_eval, want_eval, rtol=2e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)
    told = [str(w.message) for w in recwarn if "loss" in str(w.message)]
    assert not told, told


def batch_std(y_true, y_pred):
    """A metric function of the user's: a statistic of the whole batch."""
    return keras.ops.std(y_pred)


def mean_absolute(y_true, y_pred):
    """A metric function of the user's, reduced to one value per batch."""
    return keras.ops.mean(keras.ops.abs(y_true - y_pred))


def assert_metric_functions_read_as_plain_fit(make_guard=fixed_split):
    """Metric functions of the user's report under `make_guard()` what plain `fit` does.

    Keras counts one value per update of such a function's wrapper: split
    into micro-batches (the last batch of 2 samples into 2), they averaged
    other values with other weights. Keras' own metrics beside them too.
    """
    x, y, _ = regression_data(n=130)
    logs = []
    for callbacks in ([], [make_guard()]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            "sgd", "mse",
            metrics=[batch_std, mean_absolute, "mae", keras.metrics.R2Score()],
        )
        history = model.fit(
            x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        )
        logs.append(history.history)
    want, got = logs
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


class SubclassedBatchNormMLP(keras.Model):
    """A subclassed model: no graph of layers whose output sizes can be read."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16)
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x, training=False):
        return self.out(keras.ops.relu(self.norm(self.hidden(x), training=training)))


def assert_a_model_that_fits_trains_as_plain_fit(recwarn):
    """A default guard, memory plentiful, from an empty plan cache: plain `fit`.

    A BatchNormalization MLP and an `Embedding` with Adam, where a split
    changes the step (micro-batch statistics; an embedding's rows summed
    before Adam squares them). The guard's first run used to split the
    first batch into 8 and the second into 2 to measure: 5.0e-2 and 4.7e-2
    from plain `fit` after 10 steps, and a warning about BatchNormalization.
    The same where the static shapes tell no layer output's size (a
    subclassed model; tokens of any length through attention), whose first
    batch was split into 8 on any memory until its forward pass was read.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 8)).astype("float32")
    tokens = rng.integers(0, 50, size=(203, 5)).astype("int32")
    y = rng.integers(0, 3, size=203)

    def subclassed():
        return SubclassedBatchNormMLP(), x

    def variable_length():
        ids = keras.Input((None,), dtype="int32")
        hidden = keras.layers.Embedding(50, 8)(ids)
        hidden = keras.layers.LayerNormalization()(
            hidden + keras.layers.MultiHeadAttention(2, 4)(hidden, hidden)
        )
        pooled = keras.layers.GlobalAveragePooling1D()(hidden)
        return keras.Model(ids, keras.layers.Dense(3, activation="softmax")(pooled)), tokens

    def normalized():
        return keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Dense(3, activation="softmax"),
        ]), x

    def embedded():
        dense, ids = keras.Input((8,), name="d"), keras.Input((5,), name="t", dtype="int32")
        rows = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(ids))
        hidden = keras.layers.Dense(16, activation="relu", name="h")(
            keras.layers.Concatenate()([dense, rows])
        )
        outputs = keras.layers.Dense(3, activation="softmax", name="p")(hidden)
        return keras.Model({"d": dense, "t": ids}, outputs), {"d": x, "t": tokens}

    for build in (normalized, embedded, subclassed, variable_length):
        weights, counts = [], []
        for guard in (None, keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)):
            keras.utils.set_random_seed(0)
            model, inputs = build()
            model.compile("adam", "sparse_categorical_crossentropy")
            history = model.fit(
                inputs, y, batch_size=50, epochs=2, shuffle=False, verbose=0,
                callbacks=[guard] if guard else [],
            )
            weights.append(model.get_weights())
            counts.append(history.history.get("micro_batches"))
        assert counts[1] == [1, 1], build.__name__
        for want, got in zip(*weights):
            # The bias ahead of BatchNormalization has a gradient of float
            # noise, which Adam scales up to steps of 1e-4.
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-4, err_msg=build.__name__)
    told = [str(w.message) for w in recwarn if "micro" in str(w.message)]
    assert not told, told


def assert_a_small_step_beside_much_memory_in_use_trains_as_plain_fit(in_use_bytes):
    """A default guard whose limit the memory in use mostly fills (weights,
    a frozen base, another model), on a BatchNormalization MLP whose step
    takes a sliver of the room left: plain `fit`.

    The second batch used to be split in two to measure, because its peak
    was above half the target, though the step took a fraction of the room:
    BatchNormalization's statistics of half batches, and a warning.
    `in_use_bytes()` reads the memory in use as the backend's guard does.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype("float32")
    y = rng.integers(0, 3, size=200)
    weights, counts = [], []
    for planned in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Dense(3, activation="softmax"),
        ])  # fmt: skip
        model.compile("sgd", "sparse_categorical_crossentropy")
        callbacks = []
        if planned:
            # 16 MiB held beside the model, as a frozen base's weights are,
            # and the memory in use at 60% of the limit: above half the
            # target, with room for the step many times over.
            held = keras.ops.ones((4 << 20,))  # noqa: F841
            limit = int(in_use_bytes() / 0.6)
            callbacks = [keras_memguard.MemoryGuard(memory_limit=limit, plan_cache=False)]
        history = model.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        weights.append(model.get_weights())
        counts.append(history.history.get("micro_batches"))
    assert counts[1] == [1, 1], counts
    for want, got in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def assert_masked_losses_train_as_plain_fit(make_guard=fixed_split):
    """Losses over unmasked tokens under `make_guard()`: what plain `fit` gives.

    Padded sequences where one micro-batch holds only padding, masked by
    `ignore_class`, by a Keras mask (`mask_zero`, with a metric that reads
    it), and by `ignore_class` beside per-token sample weights. JAX used to
    weigh each micro-batch by its samples (1.9e-3 apart); PyTorch read the
    metric without the mask and, beside sample weights, trained on weights
    Keras' loss had multiplied in place.
    """
    rng = np.random.default_rng(0)
    vocabulary, length, n = 30, 12, 96
    ids = rng.integers(1, vocabulary, size=(n, length)).astype("int32")
    lengths = rng.integers(1, length, size=n)
    lengths[40:48] = 0  # the second micro-batch of the second batch at k=4
    for row, kept in enumerate(lengths):
        ids[row, kept:] = 0
    targets = np.where(ids > 0, (ids * 7) % vocabulary, 0).astype("int32")
    token_weights = (ids > 0) * rng.uniform(0.5, 2.0, size=(n, length))
    cases = {
        "ignore_class": (False, None),
        "mask_zero": (True, None),
        "ignore_class and sample weights": (False, token_weights.astype("float32")),
    }
    for name, (mask_zero, weights) in cases.items():
        results = []
        for callbacks in ([], [make_guard()]):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((length,), dtype="int32")
            hidden = keras.layers.Embedding(vocabulary, 16, mask_zero=mask_zero)(inputs)
            hidden = keras.layers.GRU(16, return_sequences=True)(hidden)
            model = keras.Model(inputs, keras.layers.Dense(vocabulary)(hidden))
            model.compile(
                keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, ignore_class=None if mask_zero else 0
                ),
                weighted_metrics=["accuracy"],
            )
            history = model.fit(
                ids, targets, sample_weight=weights, batch_size=32, epochs=2,
                shuffle=False, verbose=0, callbacks=callbacks,
            )
            results.append((model.get_weights(), history.history))
        (want, want_logs), (got, got_logs) = results
        for key, values in want_logs.items():
            if key == "accuracy" and weights is not None and keras.backend.backend() == "torch":
                # On PyTorch Keras' loss multiplies the weights by its mask
                # in place, so plain `fit`'s weighted metrics weigh each batch
                # by its unmasked share, the guard's each micro-batch (left
                # alone; documented).
                continue
            np.testing.assert_allclose(got_logs[key], values, rtol=1e-5, err_msg=(name, key))
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=name)


def assert_a_masked_sequence_loss_is_not_called_one_over_the_whole_batch(recwarn):
    """A tagger whose Keras mask reaches its loss: no warning, and plain `fit`'s weights.

    Before the first split the guard compares a loss of two samples whole
    with its parts' (`split_loss`); the parts' outputs were sliced from the
    whole's without their mask, so they averaged over the padding too, and
    a loss that micro-batches combine exactly was named as one computed
    over the whole batch, with the advice to stop splitting.
    """
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 30, size=(32, 12)).astype("int32")
    ids[0::2, 1:] = 0  # every other sequence a single token, then padding
    # Tags the untrained tagger (its bias toward tag 0) gets right, and
    # wrong ones under the padding: a loss that counted the padding would
    # be far from the masked one.
    tags = np.where(ids > 0, 0, 3)
    results = []
    for callbacks in ([], [fixed_split(8)]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,), dtype="int32")
        hidden = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
        hidden = keras.layers.LSTM(8, return_sequences=True)(hidden)
        model = keras.Model(
            inputs,
            keras.layers.TimeDistributed(
                keras.layers.Dense(
                    4, bias_initializer=keras.initializers.Constant([4.0, 0.0, 0.0, 0.0])
                )
            )(hidden),
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
        model.fit(
            ids, tags, batch_size=16, epochs=1, shuffle=False, verbose=0,
            callbacks=callbacks,
        )
        results.append(model.get_weights())
    for want, got in zip(*results):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    told = [str(w.message) for w in recwarn if "losses add up to" in str(w.message)]
    assert not told, told


def assert_several_masked_loss_terms_are_warned_about_once(recwarn):
    """Two outputs, each with a loss over unmasked tokens: a warning, once.

    Their micro-batches are weighted by the samples, which is close to
    plain `fit`'s loss but not equal: the warning says so.
    """
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 10, size=(48, 6)).astype("int32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 8)(inputs)
    outputs = {"a": keras.layers.Dense(10, name="a")(hidden), "b": keras.layers.Dense(10, name="b")(hidden)}
    model = keras.Model(inputs, outputs)
    masked = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    model.compile("sgd", loss={"a": masked, "b": masked})
    model.fit(ids, {"a": ids, "b": ids}, batch_size=16, epochs=2, verbose=0, callbacks=[fixed_split(4)])
    told = [str(w.message) for w in recwarn if "some average over a mask" in str(w.message)]
    assert len(told) == 1 and "has 2 loss terms" in told[0], told


class MeanSquare(keras.layers.Layer):
    """A statistic of the whole batch: one number, no batch dimension."""

    def call(self, inputs):
        return keras.ops.mean(keras.ops.square(inputs))


class UnitMeans(keras.layers.Layer):
    """A statistic of the whole batch per unit: 5 numbers, no batch dimension."""

    def call(self, inputs):
        return keras.ops.mean(inputs, axis=0)[:5]


def auxiliary_output_model(jit_compile="auto"):
    """An MLP returning its prediction and two statistics of the batch beside it.

    Only the prediction has a loss, as in models that return an auxiliary
    value (a load-balancing term, an attention statistic) to read.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = [
        keras.layers.Dense(1, name="out")(hidden),
        MeanSquare(name="mean_square")(hidden),
        UnitMeans(name="unit_means")(hidden),
    ]
    model = keras.Model(inputs, outputs)
    model.compile(
        "adam", loss=["mse", None, None], metrics=[["mae", batch_std], None, None],
        jit_compile=jit_compile,
    )  # fmt: skip
    return model


def assert_an_output_without_a_batch_dimension_trains_as_plain_fit(
    make_guard=fixed_split, jit_compile="auto"
):
    """A split step joins only the outputs that have a row per sample."""
    x, y, _ = regression_data(96)
    y = [y, np.zeros(len(y), "float32"), np.zeros(len(y), "float32")]  # unused
    reference = auxiliary_output_model(jit_compile)
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = auxiliary_output_model(jit_compile)
    got = model.fit(
        x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
        callbacks=[make_guard()],
    )  # fmt: skip
    assert got.history["micro_batches"] == [4, 4]
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=2e-6)
    for name in ("out_mae", "out_batch_std"):
        np.testing.assert_allclose(got.history[name], want.history[name], rtol=2e-6)
    for got_weight, want_weight in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got_weight, want_weight, rtol=0, atol=2e-6)


def assert_fit_options_train_as_plain_fit(micro_batches=8):
    """`fit`'s options a split must keep: plain `fit`'s numbers.

    A two-output model with a dict of per-output sample weights and
    `weighted_metrics`, `validation_split` and `initial_epoch`, and a last
    batch smaller than the count (86 samples, 69 of them trained on in
    batches of 32, split in 8: the last batch's micro-batches hold one
    sample or none).
    """
    rng = np.random.default_rng(1)
    n = 86
    x = rng.normal(size=(n, 16)).astype("float32")
    y = {
        "label": rng.integers(0, 3, size=(n,)),
        "score": rng.normal(size=(n, 1)).astype("float32"),
    }
    weights = rng.uniform(0.1, 2.0, size=(2, n)).astype("float32")
    results = []
    for callbacks in ([], [fixed_split(micro_batches)]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,), name="features")
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = keras.Model(
            {"features": inputs},
            {
                "label": keras.layers.Dense(3, name="label")(hidden),
                "score": keras.layers.Dense(1, name="score")(hidden),
            },
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            loss={
                "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "score": "mse",
            },
            metrics={"label": ["accuracy"], "score": ["mae"]},
            weighted_metrics={"label": ["accuracy"], "score": ["mse"]},
        )
        history = model.fit(
            {"features": x}, y, sample_weight={"label": weights[0], "score": weights[1]},
            batch_size=32, epochs=3, initial_epoch=1, validation_split=0.2,
            shuffle=False, verbose=0, callbacks=callbacks,
        )  # fmt: skip
        results.append((model.get_weights(), history.history))
    (want, want_logs), (got, got_logs) = results
    assert got_logs["micro_batches"] == [micro_batches] * 2
    assert set(got_logs) == set(want_logs) | {"micro_batches"}
    for key, values in want_logs.items():
        np.testing.assert_allclose(got_logs[key], values, rtol=1e-5, atol=1e-7, err_msg=key)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def assert_a_ctc_loss_trains_as_plain_fit(make_guard=fixed_split, jit_compile="auto"):
    """keras.io's OCR pattern, `keras.losses.CTC` compiled: plain `fit`'s numbers.

    Each sample's loss is its own alignment's (a mean over samples), and
    some labels are padded with the blank (0).
    """
    rng = np.random.default_rng(2)
    steps, classes = 20, 6
    x = rng.normal(size=(64, steps, 8)).astype("float32")
    labels = rng.integers(1, classes, size=(64, 5)).astype("int32")
    labels[::3, 3:] = 0
    results = []
    for callbacks in ([], [make_guard()]):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((steps, 8)),
            keras.layers.GRU(16, return_sequences=True),
            keras.layers.Dense(classes),
        ])  # fmt: skip
        model.compile(keras.optimizers.SGD(0.05), keras.losses.CTC(), jit_compile=jit_compile)
        history = model.fit(
            x, labels, batch_size=16, epochs=2, shuffle=False, verbose=0,
            callbacks=callbacks,
        )  # fmt: skip
        results.append((model.get_weights(), history.history["loss"]))
    (want, want_loss), (got, got_loss) = results
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


class TrialGuard(keras_memguard.MemoryGuard):
    """A guard subclass with an argument of its own, as users write them."""

    def __init__(self, tags, **kwargs):
        super().__init__(**kwargs)
        self.tags = tags


def assert_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings(tmp_path):
    """The guard and the monitor survive `copy.deepcopy` and `pickle` after a `fit`.

    KerasTuner deep-copies the `callbacks` list before each trial and stops
    the search when it cannot; the copies must train the next trial's new
    model with the original settings and none of the first run's state.
    """
    log_dir = str(tmp_path / "logs")
    settings = dict(
        memory_limit=1 << 30, plan=False, micro_batches=2, log_dir=log_dir,
        backup_dir=str(tmp_path / "backup"),
    )  # fmt: skip
    guard = TrialGuard(["trial"], **settings)
    monitor = keras_memguard.MemoryMonitor(
        log_dir=log_dir, update_freq=2, memory_limit=1 << 30, growth=True
    )
    x, y, _ = regression_data(64)
    first = reduced_regression_model("sum_over_batch_size")
    first.fit(x, y, batch_size=16, verbose=0, callbacks=[guard, monitor])

    guard_copy, monitor_copy = copy.deepcopy([guard, monitor])
    # Trials in other processes get them pickled: the same new callbacks.
    for unpickled, original in zip(pickle.loads(pickle.dumps([guard, monitor])), (guard, monitor)):
        assert type(unpickled) is type(original) and unpickled.model is None
        assert unpickled.log_dir == log_dir
    assert unpickled.growth_enabled and pickle.loads(pickle.dumps(guard)).tags == ["trial"]

    assert type(guard_copy) is TrialGuard and guard_copy is not guard
    assert guard_copy.tags == ["trial"] and guard_copy.tags is not guard.tags
    assert (guard_copy.log_dir, guard_copy.backup_dir) == (guard.log_dir, guard.backup_dir)
    assert guard_copy.config == guard.config
    assert guard.model is first and monitor.model is first
    assert guard_copy.model is None and monitor_copy.model is None
    assert guard_copy.session is not guard.session
    assert guard_copy.state == TrialGuard(["trial"], **settings).state
    assert type(monitor_copy) is keras_memguard.MemoryMonitor
    assert (monitor_copy.log_dir, monitor_copy.update_freq) == (log_dir, 2)
    assert monitor_copy.growth_enabled and monitor_copy.memory_limit == 1 << 30

    # The next trial: a new model trained by the copies, as plain `fit` does.
    reference = reduced_regression_model("sum_over_batch_size")
    reference.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    second = reduced_regression_model("sum_over_batch_size")
    history = second.fit(
        x, y, batch_size=16, verbose=0, shuffle=False,
        callbacks=[guard_copy, monitor_copy],
    )  # fmt: skip
    assert guard_copy.micro_batches == 2 and guard_copy.model is second
    assert history.history["micro_batches"] == [2]
    assert np.isfinite(history.history["host_rss_mib"]).all()
    for got, want in zip(second.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    # The copies' steps follow the first trial's on the same run's axis:
    # they started again at 1, and TensorBoard drew the trials over one
    # another.
    run = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "memguard"), size_guidance={event_accumulator.SCALARS: 0}
    )
    run.Reload()
    steps = {tag: [event.step for event in run.Scalars(tag)] for tag in run.Tags()["scalars"]}
    assert steps["memguard/micro_batches"] == list(range(1, 9)), steps
    host = [tag for tag in steps if tag.startswith("memory/host/rss")]
    assert host and all(steps[tag] == [2, 4, 6, 8] for tag in host), steps


class StepCounter(keras.layers.Layer):
    """Counts the training forward passes it sees, as a user's layer may."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs, training=False):
        if training:
            self.count.assign(self.count + 1.0)
        return inputs


def forward_writing_model(kind):
    """A small regression model whose training forward pass writes `kind`'s variables."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="relu")
    if kind == "spectral":
        hidden = keras.layers.SpectralNormalization(hidden, name="spectral")
    h = hidden(inputs)
    if kind == "counter":
        h = StepCounter(name="counter")(h)
    elif kind == "batch_norm":
        h = keras.layers.BatchNormalization(name="batch_norm")(h)
    elif kind == "dropout":
        h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def assert_forward_writes_are_named_once(recwarn):
    """Each layer that writes its variables in the forward pass is named at a split.

    SpectralNormalization (its kernel and power-iteration vector) and a
    counting layer of the user's are named once, in one warning each
    model; BatchNormalization gets its own warning; a Dropout's seed state
    and a model whose batches run whole are not warned about.
    """
    x, y, _ = regression_data(n=64)
    told = {}
    for kind in ("spectral", "counter", "batch_norm", "dropout"):
        recwarn.clear()
        model = forward_writing_model(kind)
        for _ in range(2):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[fixed_split()])
        told[kind] = [str(w.message) for w in recwarn if "micro_batches=4" in str(w.message)]
    assert len(told["spectral"]) == 1, told
    assert "'spectral/vector_u'" in told["spectral"][0], told
    assert "'spectral/dense" in told["spectral"][0], told
    assert "SpectralNormalization renormalizes" in told["spectral"][0], told
    assert len(told["counter"]) == 1 and "'counter/" in told["counter"][0], told
    assert len(told["batch_norm"]) == 1, told
    assert "has BatchNormalization layers" in told["batch_norm"][0], told
    assert "writes variables" not in told["batch_norm"][0], told
    assert told["dropout"] == [], told
    # Whole batches: nothing written twice, nothing said.
    recwarn.clear()
    model = forward_writing_model("spectral")
    model.fit(
        x, y, batch_size=32, verbose=0,
        callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False)],
    )
    assert not [w for w in recwarn if "writes variables" in str(w.message)]


# The batch size a model's code was written for (`FixedBatchReshape`).
CODE_BATCH = 32


class FixedBatchReshape(keras.layers.Layer):
    """Reshapes to a batch of `CODE_BATCH`, as code written for one batch
    size does: it fails on any other."""

    def call(self, inputs):
        return keras.ops.reshape(inputs, (CODE_BATCH, 4, 4))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 4, 4)


def fixed_batch_model():
    """A classifier whose code assumes batches of `CODE_BATCH`, and its data."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = FixedBatchReshape()(keras.layers.Dense(16, activation="relu")(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3 * CODE_BATCH, 16)).astype("float32")
    return model, x, rng.integers(0, 3, size=3 * CODE_BATCH)


def assert_a_split_the_code_refuses_is_named_and_nothing_trained():
    """Micro-batches asked of a model whose code needs its whole batch: a
    clear error, naming the model's own error, and the weights untouched."""
    model, x, y = fixed_batch_model()
    weights = model.get_weights()
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError) as info:
        model.fit(x, y, batch_size=CODE_BATCH, verbose=0, callbacks=[fixed_split()])
    message = str(info.value)
    assert "cannot micro-batch Functional: its step fails on a micro-batch" in message, message
    assert "in FixedBatchReshape:" in message, message
    assert "Received: micro_batches=4" in message and "keras.ops.shape(x)[0]" in message, message
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    history = model.fit(x, y, batch_size=CODE_BATCH, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def assert_find_batch_size_refuses_code_of_a_fixed_batch():
    """`find_batch_size` on a model whose code fails at other batch sizes:
    a refusal that says so, and the weights as they were."""
    model, x, y = fixed_batch_model()
    weights = model.get_weights()
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError) as info:
        keras_memguard.find_batch_size(model, x, y, memory_limit=1 << 28, verbose=0)
    message = str(info.value)
    assert "find_batch_size cannot try a batch of" in message, message
    assert "Code that assumes the batch size" in message and "keras.ops.shape(x)[0]" in message
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def assert_a_plain_fit_after_a_guarded_fit_that_raised_is_plain():
    """An error that ends a guarded `fit` leaves the model's own train
    function in place, as before the guard.

    On TensorFlow and JAX the train function pulls each batch, so an input
    that fails raises inside it; Keras' PyTorch `fit` pulls batches outside
    it (there a split's error, the refusal test's, is the case).
    """
    x, y, _ = regression_data(n=64)
    model = reduced_regression_model("sum_over_batch_size")

    def failing_input():
        for start in range(0, 64, 16):
            if start == 32:
                raise ValueError("a batch the input could not make")
            yield x[start:start + 16], y[start:start + 16]

    with pytest.raises(Exception, match="a batch the input could not make"):
        model.fit(
            failing_input(), epochs=1, verbose=0,
            callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 30)],
        )  # fmt: skip
    assert logs_carrier.current(model) is None
    history = model.fit(x, y, batch_size=16, verbose=0)
    assert "micro_batches" not in history.history, history.history


def assert_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain():
    """A `fit` that another callback ended, or Ctrl-C between two steps,
    outside the guard's train function and so without `on_train_end`: the
    next `fit` without the guard runs the model's own train function."""
    x, y, _ = regression_data(n=64)
    model = reduced_regression_model("sum_over_batch_size")

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    monitor = keras_memguard.MemoryMonitor(memory_limit=1 << 30)
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            x, y, batch_size=16, epochs=1, verbose=0, callbacks=[guard, monitor, Interrupt()]
        )
    history = model.fit(x, y, batch_size=16, verbose=0)
    assert "micro_batches" not in history.history, history.history
    assert not any(key.startswith("memory") for key in history.history), history.history
    assert logs_carrier.current(model) is None
    # The guard and the monitor go on in the next `fit` they are given.
    history = model.fit(x, y, batch_size=16, verbose=0, callbacks=[guard, monitor])
    assert history.history["micro_batches"] == [4.0], history.history
    assert logs_carrier.current(model) is None


# Tests the JAX and PyTorch test modules import as they are (pytest
# collects them there; this module's name is not a test file's).


def test_several_masked_loss_terms_are_warned_about_once(recwarn):
    assert_several_masked_loss_terms_are_warned_about_once(recwarn)


@pytest.mark.slow
def test_masked_losses_train_as_plain_fit():
    assert_masked_losses_train_as_plain_fit()


@pytest.mark.slow
def test_a_masked_sequence_loss_is_not_called_one_over_the_whole_batch(recwarn):
    assert_a_masked_sequence_loss_is_not_called_one_over_the_whole_batch(recwarn)


def test_a_model_that_fits_trains_as_plain_fit_under_a_default_guard(recwarn):
    assert_a_model_that_fits_trains_as_plain_fit(recwarn)


def test_losses_the_layers_add_train_as_plain_fit(recwarn):
    # A summed add_loss used to count a quarter of itself (k=4), silently.
    assert_added_losses_train_as_plain_fit(recwarn)


def test_metric_functions_of_the_users_read_as_in_plain_fit():
    assert_metric_functions_read_as_plain_fit()


def test_a_sequential_built_from_its_first_batch_has_one_samples_layer_outputs():
    # Without an `Input`, Keras builds the model from the first batch, and
    # every layer's output shape carries that batch's size: it was read as
    # one sample's, and an unbuilt CNN's first batch of 128 was split into
    # single samples, then replayed after an error at 2 micro-batches.
    def cnn(*head):
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [*head, keras.layers.Conv2D(8, 3, activation="relu"),
             keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]
        )  # fmt: skip

    with_input = cnn(keras.Input((16, 16, 3)))
    without = cnn()
    without.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((16, 16, 16, 3), dtype=np.float32)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan_cache=False)
    without.fit(x, rng.integers(0, 3, 16), batch_size=8, verbose=0, callbacks=[guard])
    one_sample = oom_explanation.layer_output_bytes(with_input)
    assert one_sample == (14 * 14 * 8 + 8 + 3) * 4
    assert oom_explanation.layer_output_bytes(without) == one_sample
    if keras.backend.backend() != "jax":  # JAX plans from the compiled step
        assert guard.controller.state.sample_bytes == one_sample


@pytest.mark.slow
def test_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings(tmp_path):
    # KerasTuner stopped the search at its first trial: "All callbacks used
    # during a search should be deep-copyable".
    assert_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings(tmp_path)


@pytest.mark.slow
def test_an_output_without_a_batch_dimension_trains_as_plain_fit():
    # On JAX a split step raised IndexError joining a scalar output's parts;
    # on TensorFlow and PyTorch, where a metric reads the whole batch.
    assert_an_output_without_a_batch_dimension_trains_as_plain_fit()


@pytest.mark.slow
def test_variables_the_forward_pass_writes_are_named_at_a_split(recwarn):
    # SpectralNormalization trained 0.13 (TensorFlow), 0.034 (JAX) and 0.36
    # (PyTorch) from plain `fit` at k=4, with nothing said.
    assert_forward_writes_are_named_once(recwarn)


@pytest.mark.slow
def test_fit_options_train_as_plain_fit():
    # Per-output sample weights, weighted metrics, a last batch smaller
    # than the count, `validation_split` and `initial_epoch`.
    assert_fit_options_train_as_plain_fit()


@pytest.mark.slow
def test_a_ctc_loss_trains_as_plain_fit():
    assert_a_ctc_loss_trains_as_plain_fit()


def test_a_split_the_code_refuses_is_named_and_nothing_trained():
    # The model's own error at the micro-batch (a reshape to the batch its
    # code was written for) ended `fit` with no word of the split.
    assert_a_split_the_code_refuses_is_named_and_nothing_trained()


def test_a_plain_fit_after_a_guarded_fit_that_raised_is_plain():
    # Keras kept the guard's train function after the error: the next plain
    # `fit` still ran it and logged `micro_batches`.
    assert_a_plain_fit_after_a_guarded_fit_that_raised_is_plain()


def test_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain():
    # The guard's train function stayed: the next plain `fit` trained at
    # the guard's count and logged `micro_batches` and the monitor's keys.
    assert_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain()


def test_find_batch_size_refuses_code_of_a_fixed_batch():
    # The model's own error at the search's first batch came out raw.
    assert_find_batch_size_refuses_code_of_a_fixed_batch()
