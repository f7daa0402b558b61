"""Which models keras_memguard takes: Keras 3 models, on every entry point.

TensorFlow 2.16 and later install Keras 3 as `keras`, and still offer
Keras 2 as the `tf_keras` package, which `tf.keras` is where
`TF_USE_LEGACY_KERAS=1` is set. A Keras 2 model is no `keras.Model`: its
`fit` calls callbacks through hooks Keras 3 callbacks do not have, and its
training state is laid out otherwise. Without a check here, each entry
point failed somewhere inside with words that named neither the cause nor
the fix (an `AttributeError` from Keras 2's callback list, a private Keras
name said to be missing from the installed versions, a `TypeError` from
TensorFlow). `MemoryMonitor`, `MemoryGuard` and `find_batch_size` ask
`check_model` before they touch the model, and `MemGuardMixin` asks
`check_model_class` when a class is made with it.
"""

import keras

from keras_memguard.callbacks import messages
from keras_memguard.errors import UnsupportedTrainingSetupError


def check_model(model, user):
    """Raises unless `model` is a Keras 3 model.

    Args:
        model: What was passed as the model.
        user: The name of the caller, for the message (`"MemoryGuard"`).

    Raises:
        UnsupportedTrainingSetupError: If `model` is not a `keras.Model`,
            saying what it is (a Keras 2 model, by its module) and what
            would work.
    """
    if not isinstance(model, keras.Model):
        kind = type(model)
        raise UnsupportedTrainingSetupError(
            messages.not_a_keras_model(
                user, kind.__name__, kind.__module__, _is_keras_2(kind.__module__)
            )
        )


def check_model_class(cls):
    """Raises if the class `cls` derives from a Keras 2 model class.

    A class with no model class among its bases yet (a mixin of the
    user's own, put before `keras.Model` later) passes.

    Args:
        cls: A class made with `MemGuardMixin` among its bases.

    Raises:
        UnsupportedTrainingSetupError: If a base of `cls` is a Keras 2
            (`tf_keras`) class.
    """
    legacy = next((base for base in cls.__mro__ if _is_keras_2(base.__module__)), None)
    if legacy is not None:
        raise UnsupportedTrainingSetupError(
            messages.not_a_keras_model(
                "MemGuardMixin", legacy.__name__, legacy.__module__, True,
                class_name=cls.__name__,
            )
        )


def _is_keras_2(module):
    return module.partition(".")[0] == "tf_keras"
