"""What the JAX core cannot guard is refused before `fit`, naming it; what it can, passes."""

import keras
import pytest

from jax_models import make_mlp
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends.jax import check_supported
from keras_memguard.backends.jax.support import distribution_text


def test_a_plain_model_is_supported():
    check_supported(make_mlp())


def test_data_parallel_is_supported_and_named():
    devices = keras.distribution.list_devices()
    assert len(devices) == 2  # tests/jax_backend/conftest.py
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    try:
        # Its batches train whole (tests/jax_backend/test_jax_distribution.py).
        assert check_supported(make_mlp()) is None
        assert distribution_text() == "DataParallel over 2 devices"
    finally:
        keras.distribution.set_distribution(None)
    assert distribution_text() is None


def test_eager_runs_are_refused_and_an_own_train_step_is_not():
    class Own(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    model = Own([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    # Its batches train whole (`JaxTrainingRun`); evaluate and predict slice.
    assert check_supported(model) is None
    model = make_mlp()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    with pytest.raises(UnsupportedTrainingSetupError, match="run_eagerly=True"):
        check_supported(model)


def test_a_step_compiled_without_xla_is_refused_with_the_compile_arguments_that_train():
    model = make_mlp()
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    with pytest.raises(UnsupportedTrainingSetupError) as info:
        check_supported(model)
    assert "Received: run_eagerly=False, jit_compile=False" in str(info.value), info.value
    assert "HINT: compile with Keras' defaults on JAX" in str(info.value), info.value
