"""`copy.deepcopy` of a callback: a new callback with the same settings.

Hyperparameter searches copy the callbacks they are handed once per trial:
KerasTuner deep-copies the `callbacks` list before each trial's `fit` and
stops the whole search when a callback cannot be copied. A callback's run
state does not copy and should not: an event file's writer and an NVML
handle hold locks and library objects, and the model it was set to, the
readings and the plan belong to a trial that is over. So a deep copy is
the callback its arguments make, as if the user had written the
constructor call again; what earlier runs learned still reaches it through
the plan cache on disk. Attributes a subclass added are deep-copied as
usual.
"""

import copy
import warnings


def fresh_copy(callback, base, arguments, memo):
    """A new `type(callback)` made by `base.__init__(**arguments)`.

    Args:
        callback: The callback being deep-copied.
        base: The class whose `__init__` took `arguments` (a subclass's
            `__init__` is not called: its signature is its own).
        arguments: The keyword arguments `base.__init__` was called with.
        memo: `copy.deepcopy`'s memo dictionary.

    Returns:
        The copy, registered in `memo`.
    """
    clone = type(callback).__new__(type(callback))
    memo[id(callback)] = clone
    with warnings.catch_warnings():
        # The user was warned about these settings when the original was made.
        warnings.simplefilter("ignore")
        base.__init__(clone, **copy.deepcopy(arguments, memo))
    made = set(vars(clone))
    for name, value in vars(callback).items():
        if name not in made:
            setattr(clone, name, copy.deepcopy(value, memo))
    return clone
