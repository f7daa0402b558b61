"""The JAX trainer's private names live in `training.compat` and resolve here."""

import importlib

import keras
import pytest

from keras_memguard.backends import compat


def _owner(path):
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(_owner(module), name)


@pytest.mark.parametrize("owner,name", compat.JAX_PRIVATE_NAMES)
def test_every_private_jax_trainer_name_resolves_on_this_version(owner, name):
    assert hasattr(_owner(owner), name), f"{owner}.{name} (Keras {keras.__version__})"


def test_the_compat_module_loads_no_tensorflow_until_a_tensorflow_name_is_used():
    import sys

    assert "tensorflow" not in sys.modules
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    assert compat.overrides_train_step(model) is False
    assert compat.distribution() is None
    assert "tensorflow" not in sys.modules
