"""The one place that writes a model's train, test and predict functions.

Keras reads `model.train_function`, `model.test_function` and
`model.predict_function` afresh at every step, so whoever assigns them decides what runs: the logs carrier, the
guard's replaying functions, the mixin's micro-batched step, the monitor's
one-batch profiler trace and the multi-worker preparation all go through
these functions, so that every change of a step function can be found
(and traced, when debugging) in one place.
"""

__all__ = ["set_predict_function", "set_test_function", "set_train_function"]


def set_train_function(model, function):
    """Makes `function` the model's train function (`None`: Keras makes one).

    Args:
        model: The Keras model.
        function: A callable taking the data iterator and returning the
            step's logs, or `None`.

    Returns:
        `function`.
    """
    model.train_function = function
    return function


def set_test_function(model, function):
    """Makes `function` the model's test function (`None`: Keras makes one).

    Args:
        model: The Keras model.
        function: A callable taking the data iterator and returning the
            step's logs, or `None`.

    Returns:
        `function`.
    """
    model.test_function = function
    return function


def set_predict_function(model, function):
    """Makes `function` the model's predict function (`None`: Keras makes one).

    Args:
        model: The Keras model.
        function: A callable taking a list of batches (one per step of the
            execution) and returning their outputs, or `None`.

    Returns:
        `function`.
    """
    model.predict_function = function
    return function
