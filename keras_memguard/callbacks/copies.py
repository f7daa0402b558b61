"""Copies of a callback, and pickles: a new callback with the same settings.

Hyperparameter searches copy the callbacks they are handed once per trial:
KerasTuner deep-copies the `callbacks` list before each trial's `fit` and
stops the whole search when a callback cannot be copied; tools that start
trials in other processes pickle them. A callback's run state does not
copy and should not: an event file's writer and an NVML handle hold locks
and library objects, and the model it was set to, the readings and the
plan belong to a trial that is over. So a copy (`copy.copy`,
`copy.deepcopy`) or an unpickled callback is the callback its arguments
make, as if the user had written the constructor call again; what earlier
runs learned still reaches it through the plan cache on disk. Attributes a
subclass added are copied (deep-copied, pickled) as usual.
"""

import warnings


def reduced(callback, base, arguments):
    """`callback.__reduce__()`: rebuilt from the arguments `base.__init__` took.

    Args:
        callback: The callback being copied or pickled.
        base: The class whose `__init__` took `arguments` (a subclass's
            `__init__` is not called: its signature is its own).
        arguments: The keyword arguments `base.__init__` was called with.

    Returns:
        `(rebuilt, (type(callback), base, arguments, own))`, where `own`
        holds the attributes a fresh callback of those arguments lacks.
    """
    fresh = vars(rebuilt(type(callback), base, arguments))
    own = {name: value for name, value in vars(callback).items() if name not in fresh}
    return rebuilt, (type(callback), base, arguments, own)


def rebuilt(cls, base, arguments, own=None):
    """A new `cls` made by `base.__init__(**arguments)`, with `own` attributes set.

    Returns:
        The new callback.
    """
    callback = cls.__new__(cls)
    with warnings.catch_warnings():
        # The user was warned about these settings when the original was made.
        warnings.simplefilter("ignore")
        base.__init__(callback, **arguments)
    if own:
        vars(callback).update(own)
    return callback
