"""`model.evaluate` and `model.predict` with `MemoryGuard` in their callbacks."""

import re

import numpy as np
import keras

import pytest

import keras_memguard
from split_cases import assert_summed_loss_evaluates_as_unsliced
from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
from keras_memguard.backends.tensorflow import predict_replay


def two_output_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    score = keras.layers.Dense(1, name="score")(hidden)
    label = keras.layers.Dense(3, activation="softmax", name="label")(hidden)
    model = keras.Model(inputs, {"score": score, "label": label})
    model.compile(
        "adam",
        {"score": "mse", "label": "sparse_categorical_crossentropy"},
        metrics={"label": ["accuracy"]},
    )
    return model


def data(n=100):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = {"score": rng.normal(size=(n, 1)).astype("float32"), "label": rng.integers(0, 3, n)}
    return x, y


def test_guarded_predict_equals_plain_predict_and_returns_numpy():
    model = two_output_model()
    x, _ = data()
    plain = model.predict(x, batch_size=7, verbose=0)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    guarded = model.predict(x, batch_size=32, verbose=0, callbacks=[guard])
    assert set(guarded) == {"score", "label"}
    for name in plain:
        assert isinstance(guarded[name], np.ndarray)
        assert guarded[name].shape == plain[name].shape
        np.testing.assert_allclose(guarded[name], plain[name], rtol=1e-6, atol=1e-6)
    # Keras' own function is back afterwards.
    assert not isinstance(model.predict_function, predict_replay.ReplayPredictFunction)
    again = model.predict(x, batch_size=7, verbose=0)
    np.testing.assert_allclose(again["score"], plain["score"], rtol=1e-6, atol=1e-6)


def test_predict_in_slices_keeps_order_across_executions():
    model = two_output_model()
    model.compile("adam", "mse", steps_per_execution=3)
    x, _ = data(50)
    plain = model.predict(x, batch_size=8, verbose=0)
    function = predict_replay.ReplayPredictFunction(model, micro_batches=3)
    function.install()
    try:
        sliced = model.predict(x, batch_size=8, verbose=0)
    finally:
        function.restore()
    for name in plain:
        np.testing.assert_allclose(sliced[name], plain[name], rtol=1e-6, atol=1e-6)


def test_guarded_evaluate_equals_plain_evaluate():
    model = two_output_model()
    x, y = data()
    plain = model.evaluate(x, y, batch_size=100, verbose=0, return_dict=True)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    guarded = model.evaluate(x, y, batch_size=100, verbose=0, return_dict=True, callbacks=[guard])
    assert guarded.keys() == plain.keys()
    for name in plain:
        assert guarded[name] == pytest.approx(plain[name], rel=1e-5), name
    assert guard.eval_oom_recoveries == 0


def test_an_uncompiled_model_predicts_under_the_guard():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    x = np.arange(40, dtype="float32").reshape(8, 5)
    guarded = model.predict(
        x, batch_size=8, verbose=0, callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 30)]
    )
    np.testing.assert_allclose(guarded, model.predict(x, batch_size=3, verbose=0), rtol=1e-6)


@pytest.mark.slow
def test_under_a_real_cap_evaluate_and_predict_finish_where_plain_keras_runs_out_of_memory():
    from keras_memguard.testing import run_with_memory_cap
    import programs

    result = run_with_memory_cap(
        programs.source("inference_under_cap"), memory_limit_mib=300, timeout=400
    ).result
    reference = result["reference"]
    # Plain Keras runs out of memory at batch 512; the guard finishes.
    assert result["plain_evaluate_out_of_memory"], result
    for run in ("replayed", "planned", "replayed_beside_taken"):
        got = result[run]
        # Every sample counted once, and the metrics of the unsliced run.
        assert got["samples"] == reference["samples"] == 1024.0, (run, got)
        assert got["accuracy"] == reference["accuracy"], (run, got)
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5), (run, got)
    # Reacting: the whole batch fails, the rest goes on in slices sized
    # from the error: the first replay jumps to many slices at once (no
    # creep by one). Which ops TensorFlow's inter-op threads run side by
    # side moves a slice's peak by some MiB, so a slice at the very edge
    # may fail once more: at most one more error.
    messages = "\n".join(result["messages"])
    first_replay = re.search(r"replaying with (\d+) micro-batches", messages)
    assert first_replay and int(first_replay.group(1)) >= 4, messages
    assert result["replayed_oom"] in (1, 2), messages
    # Memory taken beside the step while the batch ran (as a prefetch
    # thread does) is counted when the replay is sized: one error too.
    assert result["taken_mib"] == 48.0
    assert result["replayed_beside_taken_oom"] == 1, result["messages"]
    # Planning: no out-of-memory error at all.
    assert result["planned_oom"] == 0 and result["predict_oom"] == 0, result["messages"]
    assert result["predict_type"] == "ndarray"
    assert result["predict_shape"] == [1024, 10]
    assert result["predict_max_difference"] <= 1e-5
    # The whole run's outputs exceed the cap: plain Keras keeps them on the
    # device and runs out of memory, the guard moves each to the host.
    assert result["wide_plain_out_of_memory"], result
    assert result["wide_output_mib"] == 512.0 > 300
    assert result["wide_first_batch_equal"]


class CountsCalls(keras.Model):
    """A subclassed model (no layer output sizes to read) that counts its forward passes."""

    def __init__(self, make_inputs_layer):
        super().__init__()
        self.inputs_layer = make_inputs_layer()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(3)
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=False):
        self.calls.assign_add(1.0)
        return self.out(self.hidden(self.inputs_layer(x)))


@pytest.mark.slow
def test_a_first_batch_that_fits_is_evaluated_and_predicted_whole_where_shapes_tell_nothing():
    # Before any batch is measured, the slices come from one sample's layer
    # outputs; a subclassed model, or tokens of any length, tell none in
    # their static shapes, and the first batch went in the cautious 8
    # slices on any memory. Now its forward pass, traced, tells them.
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 96)

    def tokens_of_any_length():
        return keras.Sequential([
            keras.layers.Embedding(50, 8), keras.layers.GlobalAveragePooling1D(),
        ])

    cases = {
        "features": (lambda: keras.layers.Identity(), rng.normal(size=(96, 8)).astype("float32")),
        "tokens": (tokens_of_any_length, rng.integers(0, 50, (96, 20)).astype("int32")),
    }
    for name, (make_inputs_layer, x) in cases.items():
        keras.utils.set_random_seed(0)
        model = CountsCalls(make_inputs_layer)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        plain = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        plain_predictions = model.predict(x, batch_size=32, verbose=0)
        guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
        calls = float(model.calls.numpy())
        guarded = model.evaluate(
            x, y, batch_size=32, verbose=0, return_dict=True, callbacks=[guard]
        )
        assert model.calls.numpy() - calls == 3, name  # one pass a batch
        assert guarded["loss"] == pytest.approx(plain["loss"], rel=1e-6), name
        calls = float(model.calls.numpy())
        predictions = model.predict(x, batch_size=32, verbose=0, callbacks=[guard])
        assert model.calls.numpy() - calls == 3, name
        np.testing.assert_allclose(predictions, plain_predictions, rtol=1e-6, atol=1e-6)
        # Validation in `fit` plans its slices the same way: one training
        # batch and three validation batches, each one pass.
        calls = float(model.calls.numpy())
        model.fit(
            x, y, batch_size=96, epochs=1, verbose=0, shuffle=False,
            validation_data=(x, y), validation_batch_size=32,
            callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)],
        )
        assert model.calls.numpy() - calls == 4, name


def test_a_summed_loss_evaluated_in_slices_is_the_whole_batchs():
    # Keras' loss tracker weighs each call's loss by its samples: a slice's
    # sum used to count its share of itself (a third here).
    assert_summed_loss_evaluates_as_unsliced(
        lambda model: ReplayTestFunction(model, micro_batches=3).install()
    )
