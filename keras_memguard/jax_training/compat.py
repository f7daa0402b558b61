"""Every private name of Keras' JAX trainer that the JAX training core uses.

Read from Keras 3.15 (`keras/src/backend/jax/trainer.py`); when Keras moves
one of them, this is the one module to change.
"""

import keras


def unpack_data(data):
    """`(x, y, sample_weight)` of a batch as Keras' data adapters yield it."""
    return keras.utils.unpack_x_y_sample_weight(data)


def loss_and_updates_function(model):
    """The model's stateless `compute_loss_and_updates` (differentiable)."""
    return model.compute_loss_and_updates


def update_metrics_variables(model, metrics_variables, unscaled_loss, x, y, y_pred,
                             sample_weight):
    """Updates the loss tracker and compiled metrics, statelessly.

    Returns:
        `(logs, metrics_variables)`, as `JAXTrainer.train_step` gets them.
    """
    return model._update_metrics_variables(
        metrics_variables, unscaled_loss, x, y, y_pred, sample_weight
    )


def jax_state(model):
    """The model's state tuple as `fit` passes it to its train function.

    `(trainable, non_trainable, optimizer, metrics variables)`, each a list
    of arrays, read from the model's variables without purging them.
    """
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )


def overrides_train_step(model):
    """Whether the model's class replaces the JAX trainer's `train_step`."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return type(model).train_step is not JAXTrainer.train_step


def distribution():
    """The global `keras.distribution` in force, or `None`."""
    return keras.distribution.distribution()


def symbolic_build(model, data):
    """Builds the model, its compiled loss and metrics and its optimizer.

    What `fit` does before its first step, from a batch's shapes, so that
    the state exists (and steps can be planned) before anything runs.

    Args:
        model: A compiled Keras model.
        data: A batch (`(x, y)` or `(x, y, sample_weight)`) of arrays or
            anything with `shape` and `dtype`.
    """
    model._symbolic_build(data_batch=data)
