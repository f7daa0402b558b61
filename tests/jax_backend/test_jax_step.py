"""The micro-batched JAX step against plain Keras JAX `fit`.

Twins from the same initial weights train on the same data in the same order
(`shuffle=False`), one with Keras' own step, one with the micro-batched step
installed as `model.train_function`; 100 samples in batches of 32 end with a
batch of 4, so k=3 cuts uneven micro-batches (and k=3 on 4 samples too).
"""

import numpy as np
import pytest

import keras

import keras_memguard
from split_cases import fixed_split
from split_cases import test_a_model_that_fits_trains_as_plain_fit_under_a_default_guard  # noqa: F401
from split_cases import test_masked_losses_train_as_plain_fit  # noqa: F401
from split_cases import test_a_masked_sequence_loss_is_not_called_one_over_the_whole_batch  # noqa: F401
from split_cases import test_variables_the_forward_pass_writes_are_named_at_a_split  # noqa: F401
from split_cases import test_several_masked_loss_terms_are_warned_about_once  # noqa: F401
from split_cases import test_losses_the_layers_add_train_as_plain_fit  # noqa: F401
from split_cases import test_metric_functions_of_the_users_read_as_in_plain_fit  # noqa: F401
from split_cases import assert_reduction_trains_as_plain_fit
from split_cases import test_an_output_without_a_batch_dimension_trains_as_plain_fit  # noqa: F401
from split_cases import test_fit_options_train_as_plain_fit  # noqa: F401
from split_cases import test_a_ctc_loss_trains_as_plain_fit  # noqa: F401
from split_cases import test_find_batch_size_refuses_code_of_a_fixed_batch  # noqa: F401
from split_cases import test_a_plain_fit_after_a_guarded_fit_that_raised_is_plain  # noqa: F401
from split_cases import test_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain  # noqa: F401
from split_cases import test_a_split_the_code_refuses_is_named_and_nothing_trained  # noqa: F401

from jax_models import USER_MODELS
from jax_models import max_weight_difference
from jax_models import twins
from keras_memguard.backends.jax import ReplayingTrainFunction
from keras_memguard.backends.jax import micro_batch_segments

FIT = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)
# float32 sums in another order; measured up to 5e-7 here.
TOLERANCE = 1e-5
# BatchNormalization normalizes each micro-batch by its own moments and
# updates its moving statistics once per micro-batch: an approximation, not
# the whole batch's update; its trainable weights stay close.
BATCH_NORM_TOLERANCE = 0.05


def test_segments_are_k_equal_parts_and_a_smaller_last_one():
    assert micro_batch_segments(10, 4) == ((0, 4, 2), (8, 1, 2))
    assert micro_batch_segments(32, 3) == ((0, 3, 10), (30, 1, 2))
    assert micro_batch_segments(8, 4) == ((0, 4, 2),)
    assert micro_batch_segments(3, 8) == ((0, 3, 1),)  # one sample each
    with pytest.raises(ValueError, match="micro_batches"):
        micro_batch_segments(8, 0)


@pytest.fixture(scope="module")
def plain_runs():
    """Plain Keras JAX `fit` of every user model, from its initial weights."""
    runs = {}
    for name, (build, data) in USER_MODELS.items():
        plain, _ = twins(build)
        initial = plain.get_weights()
        history = plain.fit(*data(), **FIT)
        runs[name] = (initial, plain, history)
    return runs


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(USER_MODELS))
def test_micro_batched_fit_matches_plain_fit(plain_runs, name, k):
    build, data = USER_MODELS[name]
    initial, plain, plain_history = plain_runs[name]
    keras.utils.set_random_seed(0)
    model = build()
    model.set_weights(initial)
    model.train_function = ReplayingTrainFunction(model, micro_batches=k)
    history = model.fit(*data(), **FIT)

    exact = name != "cnn_batch_norm" or k == 1
    if exact:
        difference = max_weight_difference(plain, model)
        assert difference < TOLERANCE, difference
    else:
        # The moving statistics differ more (k updates per step).
        difference = max_weight_difference(plain, model, trainable_only=True)
        assert difference < BATCH_NORM_TOLERANCE, difference
        assert all(np.isfinite(w).all() for w in model.get_weights())
    assert sorted(history.history) == sorted(plain_history.history)
    if exact:
        for key, values in plain_history.history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
    # The state went back to the model's variables: evaluate runs on it.
    x, y = data()
    model.evaluate(x, y, verbose=0)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_a_loss_reduced_otherwise_than_by_the_mean_trains_as_plain_fit(reduction):
    # Summed, a micro-batch's loss used to count a third of itself (k=3);
    # over the weights' sum, each micro-batch divided by its own.
    assert_reduction_trains_as_plain_fit(reduction, fixed_split(3))
