"""`MemGuardMixin` on Keras' PyTorch backend."""

import numpy as np
import pytest
import torch

import keras

from torch_models import make_failing
from torch_models import max_relative_difference
from torch_models import mlp_data
from keras_memguard.backends.torch.mixin import MemGuardMixin
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.errors import UnsupportedTrainingSetupError

FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)


class Classifier(MemGuardMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))


class GuardedSequential(MemGuardMixin, keras.Sequential):
    pass


def _classifier():
    model = Classifier()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model(np.zeros((1, 8), "float32"))
    return model


@pytest.mark.parametrize("k", [1, 3])
def test_mixin_fit_matches_plain_fit(k):
    """Against a plain Sequential of the same layers and weights."""
    keras.utils.set_random_seed(0)
    model = _classifier()
    reference = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    reference.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    reference.set_weights(model.get_weights())
    model.micro_batches = k
    x, y = mlp_data()
    history = model.fit(x, y, **FIT)
    plain_history = reference.fit(x, y, **FIT)
    assert isinstance(model.train_function, ReplayingTrainFunction)
    assert max_relative_difference(reference, model) < 1e-5
    for key, values in plain_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, atol=1e-6)


def test_mixin_keeps_the_count_a_replay_reached():
    x, y = mlp_data(32)
    model = make_failing({1}, torch.OutOfMemoryError, "CUDA out of memory.",
                         model_class=GuardedSequential)
    model.micro_batches = 2
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.micro_batches == 4
    assert model.train_function.replays == 1
    assert int(model.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("value", [0, -2, 2.0, "4", False])
def test_bad_micro_batches_name_the_argument_and_value(value):
    model = _classifier()
    with pytest.raises(ValueError, match=f"`micro_batches` must be an integer >= 1. Received: micro_batches={value!r}"):
        model.micro_batches = value
    assert model.micro_batches == 1


def test_micro_batch_mode():
    model = _classifier()
    assert model.micro_batch_mode == "accumulate"
    model.micro_batch_mode = "shrink"
    model.make_train_function()
    assert model.train_function.mode == "shrink"
    with pytest.raises(ValueError, match="Received: micro_batch_mode='split'"):
        model.micro_batch_mode = "split"


def test_accumulate_gradients_is_refused_naming_the_backend():
    with pytest.raises(UnsupportedTrainingSetupError, match="TensorFlow backend only.*PyTorch"):
        _classifier().accumulate_gradients(None)


def test_a_train_step_of_the_class_is_refused():
    class Own(Classifier):
        def train_step(self, data):
            return super().train_step(data)

    model = Own()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x, y = mlp_data(8)
    with pytest.raises(UnsupportedTrainingSetupError, match="Own has a `train_step` of its own"):
        model.fit(x, y, verbose=0)


def test_prepare_multi_worker_returns_the_model_unchanged_on_torch():
    # TensorFlow's multi-worker preparation: code calling it runs here too.
    import keras_memguard

    model = GuardedSequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert keras_memguard.prepare_multi_worker(model) is model
