"""`evaluate`, `predict` and `fit`'s validation in slices on Keras' PyTorch backend.

A device that holds only so many rows at once is stood in for by a layer
that raises torch's own `torch.OutOfMemoryError` when it is called on more
rows than that (the narrowest seam: no CUDA here); everything else is Keras'
own `evaluate` and `predict` with `MemoryGuard`.
"""

import numpy as np
import pytest
import torch

import keras

import keras_memguard
from split_cases import assert_summed_loss_evaluates_as_unsliced
from keras_memguard.backends.torch.inference import SlicedPredictFunction
from keras_memguard.backends.torch.inference import SlicedTestFunction
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.step_functions import set_predict_function
from keras_memguard.step_functions import set_test_function

BIG = 2**36
ROWS_THAT_FIT = 10


class RowsThatFit(keras.layers.Layer):
    """Passes its input through; more than `rows` rows at once raise OOM."""

    def __init__(self, rows=None, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, x):
        # Keras builds the model on "meta" tensors, which hold no memory.
        if self.rows is not None and x.device.type != "meta" and x.shape[0] > self.rows:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.shape[0]} rows."
            )
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def make_model(rows=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            RowsThatFit(rows),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
    )
    return model


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, size=(n,))
    weights = rng.uniform(0.0, 2.0, size=(n,)).astype("float32")
    return x, y, weights


def test_sliced_functions_give_keras_own_results():
    x, y, weights = data(50)
    model = make_model()
    expected = model.evaluate(x, y, sample_weight=weights, batch_size=25, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=25, verbose=0)

    set_test_function(model, SlicedTestFunction(model, micro_batches=4))
    sliced = model.evaluate(x, y, sample_weight=weights, batch_size=25, verbose=0, return_dict=True)
    set_predict_function(model, SlicedPredictFunction(model, micro_batches=3))
    sliced_predictions = model.predict(x, batch_size=25, verbose=0)

    assert sliced.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(sliced[key], expected[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(sliced_predictions, predicted, rtol=1e-6)


def test_evaluate_and_predict_go_on_in_smaller_slices_where_keras_runs_out_of_memory():
    x, y, weights = data()
    fitting = make_model(ROWS_THAT_FIT)
    with pytest.raises(torch.OutOfMemoryError):
        fitting.evaluate(x, y, batch_size=32, verbose=0)

    reference = make_model()
    expected = reference.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0, return_dict=True)
    predicted = reference.predict(x, batch_size=32, verbose=0)

    guard = keras_memguard.MemoryGuard(memory_limit=BIG)
    got = fitting.evaluate(
        x, y, sample_weight=weights, batch_size=32, verbose=0, return_dict=True,
        callbacks=[guard],
    )
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    # One error, then slices of at most 10 rows for the rest of the call.
    assert guard.eval_oom_recoveries >= 1

    predictions = fitting.predict(x, batch_size=32, verbose=0, callbacks=[guard])
    np.testing.assert_allclose(predictions, predicted, rtol=1e-6)
    assert guard.predict_oom_recoveries >= 1
    # Keras' own functions are back after each call.
    assert not isinstance(fitting.test_function, SlicedTestFunction)
    assert not isinstance(fitting.predict_function, SlicedPredictFunction)


def test_validation_during_fit_goes_on_in_slices_and_matches_keras():
    x, y, _ = data()
    vx, vy, _ = data(40, seed=1)
    reference = make_model()
    expected = reference.fit(
        x, y, batch_size=8, epochs=2, validation_data=(vx, vy), validation_batch_size=40,
        shuffle=False, verbose=0,
    ).history
    fitting = make_model(ROWS_THAT_FIT)
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, micro_batches=1, plan=False)
    got = fitting.fit(
        x, y, batch_size=8, epochs=2, validation_data=(vx, vy), validation_batch_size=40,
        shuffle=False, verbose=0, callbacks=[guard],
    ).history
    for key in ("val_loss", "val_accuracy", "loss"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)
    assert guard.eval_oom_recoveries >= 1
    assert guard.oom_recoveries == 0  # training's count is left alone


def test_a_slice_of_one_row_that_does_not_fit_is_a_clear_error():
    x, y, _ = data(8)
    model = make_model(rows=0)
    guard = keras_memguard.MemoryGuard(memory_limit=BIG)
    with pytest.raises(MicroBatchTooLargeError, match="slice of one sample"):
        model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[guard])


def test_a_summed_loss_evaluated_in_slices_is_the_whole_batchs():
    # Keras' loss tracker weighs each call's loss by its samples: a slice's
    # sum used to count its share of itself (a third here).
    assert_summed_loss_evaluates_as_unsliced(
        lambda model: set_test_function(model, SlicedTestFunction(model, micro_batches=3))
    )
