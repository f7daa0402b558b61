"""The micro-batched torch step against plain Keras torch `fit`.

Twins from the same initial weights train on the same data in the same
order (`shuffle=False`), one with Keras' own step, one with the
micro-batched step; 60 samples in batches of 16 end with a batch of 12, so
most counts cut uneven micro-batches (and k=8 on 12 samples cuts eight of
one and one of four).
"""

import numpy as np
import pytest
import torch

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
from split_cases import test_a_split_the_code_refuses_is_named_and_nothing_trained  # noqa: F401

from torch_models import USER_MODELS
from torch_models import fit_arguments
from torch_models import image_data
from torch_models import make_batch_norm
from torch_models import make_mlp
from torch_models import max_relative_difference
from torch_models import mlp_data
from torch_models import twins
from keras_memguard.backends import compat
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.backends.torch.step import micro_batch_rows
from keras_memguard.backends.torch.step import micro_batch_segments
from keras_memguard.backends.torch.step import micro_batch_train_step

FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
# float32 sums in another order, through Adam.
TOLERANCE = 1e-5
# BatchNormalization normalizes each micro-batch by its own moments: its
# trainable weights stay close to the whole batch's, not equal.
BATCH_NORM_TOLERANCE = 0.5
FAST_COUNTS = (1, 3, 8)
SLOW_COUNTS = (2, 4, 5, 6, 7)
COUNTS = [*FAST_COUNTS, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_COUNTS)]


def test_segments_are_k_equal_parts_and_a_smaller_last_one():
    assert micro_batch_segments(10, 4) == ((0, 4, 2), (8, 1, 2))
    assert micro_batch_segments(12, 8) == ((0, 8, 1), (8, 1, 4))
    assert micro_batch_segments(3, 8) == ((0, 3, 1),)
    assert micro_batch_rows(5, 2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="micro_batches"):
        micro_batch_segments(8, 0)


@pytest.fixture(scope="module")
def plain_runs():
    """Plain Keras torch `fit` of every user model, from its initial weights."""
    runs = {}
    for name, (build, data) in USER_MODELS.items():
        plain, _ = twins(build)
        initial = plain.get_weights()
        args, kwargs = fit_arguments(data())
        history = plain.fit(*args, **kwargs, **FIT)
        runs[name] = (initial, plain, history)
    return runs


@pytest.mark.parametrize("k", COUNTS)
@pytest.mark.parametrize("name", sorted(USER_MODELS))
def test_micro_batched_fit_matches_plain_fit(plain_runs, name, k):
    build, data = USER_MODELS[name]
    initial, plain, plain_history = plain_runs[name]
    keras.utils.set_random_seed(0)
    model = build()
    model.set_weights(initial)
    model.train_function = ReplayingTrainFunction(model, micro_batches=k)
    args, kwargs = fit_arguments(data())
    history = model.fit(*args, **kwargs, **FIT)

    exact = name != "batch_norm" or k == 1
    assert sorted(history.history) == sorted(plain_history.history)
    if exact:
        assert max_relative_difference(plain, model) < TOLERANCE
        for key, values in plain_history.history.items():
            np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)
    else:
        difference = max_relative_difference(plain, model, trainable_only=True)
        assert difference < BATCH_NORM_TOLERANCE, difference
        assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())


@pytest.mark.parametrize("k", [1, 3])
def test_step_as_train_step_of_a_model_class(k):
    class Stepped(keras.Sequential):
        def train_step(self, data):
            return micro_batch_train_step(self, data, k)

    keras.utils.set_random_seed(0)
    plain = make_mlp()
    keras.utils.set_random_seed(0)
    model = Stepped([keras.Input((8,))] + [
        keras.layers.Dense.from_config(layer.get_config()) for layer in plain.layers
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.set_weights(plain.get_weights())
    x, y = mlp_data()
    plain_history = plain.fit(x, y, **FIT)
    history = model.fit(x, y, **FIT)
    assert max_relative_difference(plain, model) < TOLERANCE
    np.testing.assert_allclose(history.history["loss"], plain_history.history["loss"], rtol=1e-5)


def test_batch_norm_moving_statistics_are_updated_once_per_micro_batch():
    """What BatchNormalization does under k micro-batches: each micro-batch
    is normalized by its own moments and moves the moving statistics once,
    as k calls of the layer in training would."""
    keras.utils.set_random_seed(0)
    model, reference = twins(make_batch_norm)
    x, y = image_data(12)
    model.train_function = ReplayingTrainFunction(model, micro_batches=3)
    model.train_on_batch(x, y)

    batch_norm = reference.layers[1]
    features = reference.layers[0]
    for start, stop in micro_batch_rows(12, 3):
        batch_norm(features(torch.as_tensor(x[start:stop])), training=True)
    trained = model.layers[1]
    np.testing.assert_allclose(trained.moving_mean.numpy(), batch_norm.moving_mean.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(trained.moving_variance.numpy(), batch_norm.moving_variance.numpy(), rtol=1e-5, atol=1e-7)


def test_shrink_mode_makes_one_update_per_micro_batch():
    """Shrink at k=2 on batches of 16 is plain training on batches of 8."""
    plain, model = twins(make_mlp)
    x, y = mlp_data(64)
    plain_history = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.train_function = ReplayingTrainFunction(model, micro_batches=2, mode="shrink")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert max_relative_difference(plain, model) < TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    for key, values in plain_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_bad_micro_batches_name_the_argument_and_value(value):
    model = make_mlp()
    x, y = mlp_data(4)
    with pytest.raises(ValueError, match=r"`micro_batches` must be an integer >= 1\. Received: micro_batches="):
        micro_batch_train_step(model, (x, y), value)
    with pytest.raises(ValueError, match=f"Received: micro_batches={value!r}"):
        ReplayingTrainFunction(model, micro_batches=value)


def test_bad_mode_names_the_argument_and_value():
    model = make_mlp()
    with pytest.raises(ValueError, match=r"`micro_batch_mode` must be one of .*Received: micro_batch_mode='split'"):
        ReplayingTrainFunction(model, mode="split")


def test_every_private_name_resolves():
    import importlib

    model = make_mlp()
    x, y = mlp_data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for owner, name in compat.TORCH_PRIVATE_NAMES:
        if owner == "CompileLoss":
            assert hasattr(model._compile_loss, name), name
        elif owner == "keras.Model":
            assert hasattr(model, name), name
        else:
            assert hasattr(importlib.import_module(owner), name), (owner, name)


# Over the weights' sum, each micro-batch divided by its own.
REDUCTIONS = ("sum", "mean_with_sample_weight")

@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_a_loss_reduced_otherwise_than_by_the_mean_trains_as_plain_fit(reduction):
    # Summed, a micro-batch's loss used to count a third of itself (k=3).
    assert_reduction_trains_as_plain_fit(reduction, fixed_split(3))
