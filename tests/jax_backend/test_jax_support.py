"""What the JAX core cannot guard is refused before `fit`, naming it; what it can, passes."""

import keras
import pytest

from jax_models import make_mlp
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends.jax import check_supported
from keras_memguard.backends.jax.support import distribution_text
from keras_memguard.backends.jax.support import eager_reason


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


def test_a_step_keras_runs_without_xla_is_supported_and_its_cause_named():
    class Own(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    model = Own([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    # Its batches train whole (`JaxTrainingRun`); evaluate and predict slice.
    assert check_supported(model) is None and eager_reason(model) is None
    # Each of these trains whole batches through Keras' own step, as plain
    # `fit` does (tests/jax_backend/test_jax_callbacks.py).
    for compile_kwargs, cause in [
        ({"run_eagerly": True}, "`run_eagerly=True`"),
        ({"jit_compile": False}, "`jit_compile=False`"),
    ]:
        model = make_mlp()
        model.compile(optimizer="sgd", loss="mse", **compile_kwargs)
        assert check_supported(model) is None and eager_reason(model) == cause
    model = keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.RandomZoom(0.1, name="zoom"), keras.layers.Flatten(),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert eager_reason(model) == "its layer 'zoom' (RandomZoom) does not support XLA"


def test_another_backend_is_refused():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keras.backend, "backend", lambda: "torch")
        with pytest.raises(UnsupportedTrainingSetupError, match="Received: backend='torch'"):
            check_supported(make_mlp())
