"""Carries the callbacks' values in the logs the train function returns.

Keras' fit loop runs `logs = model.train_function(iterator)`, then hands the
callbacks, in list order, one copy of those logs: a key a callback adds in
`on_train_batch_end` reaches only the callbacks after it. And the epoch logs
are built from the dict the train function returned last: when it holds keys
other than the model's metrics, `_get_metrics_result_or_logs` returns it
as it is (Keras 3.8 through 3.15) instead of the metrics' results, which
under a distribution strategy are read across replicas. While installed,
the carrier has that choice made without the keys it added
(`compat.choose_metrics_results_beside`), so the epoch logs are the
metrics' results, as in plain Keras, plus those keys.

So the values are put in where every callback, `History`, `CSVLogger`, the
progress bar and `keras.callbacks.TensorBoard` see them whatever the order:
`LogsCarrier` is a thin train function around the model's own. It calls its
inner function, then each registered contributor with the returned logs
dict, and returns it. One carrier per model, shared by every callback of the
package: the first to call `attach` in `on_train_begin` (which Keras calls
after `make_train_function()`) installs it, `detach` in `on_train_end`
restores the original function once no contributor is left.

A callback that trains itself (`MemoryGuard`) does not replace the carrier:
it puts its own train function in `LogsCarrier.inner` (any callable taking
the iterator and returning the logs dict) and puts the previous one back at
train end.

The carrier costs one Python call per contributor per execution.
"""

import weakref

from keras_memguard.backends import compat
from keras_memguard import step_functions as functions

__all__ = ["LogsCarrier", "attach", "current", "detach", "reinstall"]


class LogsCarrier:
    """A `model.train_function` that lets callbacks add keys to its logs.

    Use `attach` rather than this constructor.

    Args:
        original: The train function in place before (Keras' own, or `None`
            when it is still to be made).
        model: The Keras model it is installed on, or `None`: where an
            error ends `fit` from inside the carrier, `original` goes back
            on it. Defaults to `None`.

    Attributes:
        inner: The function called with the iterator; its returned dict is
            given to the contributors. Starts as `original`.
        original: The function restored when the last contributor detaches.
        calls: How many times the carrier has been called.
    """

    def __init__(self, original, model=None):
        self.original = original
        self.inner = original
        self.calls = 0
        # The keys the contributors added to the last logs.
        self.added_keys = ()
        self._contributors = {}
        self._call_list = ()
        self._fit = None
        # The `History` of the `fit` the contributors were added in.
        self._history = None
        # The model it is installed on, weakly.
        self._model = None if model is None else weakref.ref(model)

    def __call__(self, *args):
        # TensorFlow: `logs = f(iterator)`; JAX: `logs, state = f(state, iterator)`.
        if self._history is not None and self._model is not None:
            model = self._model()
            if model is not None and compat.fit_history(model) is not self._history:
                return self._own_function_of_a_later_fit(model)(*args)
        try:
            result = self.inner(*args)
        except BaseException as error:
            if not compat.is_end_of_data(error):
                self._leave_after_error()
            raise
        logs = result[0] if isinstance(result, tuple) else result
        self.calls += 1
        if self._call_list and isinstance(logs, dict):
            size = len(logs)
            for contribute in self._call_list:
                contribute(logs)
            if len(logs) - size != len(self.added_keys):
                # Dicts keep insertion order: the added keys come last.
                self.added_keys = tuple(logs)[size:]
        return result

    def _own_function_of_a_later_fit(self, model):
        """Leaves the model for a `fit` the contributors are not in, and
        returns the model's own train function for it.

        The `fit` they were added in ended without `on_train_end`: another
        callback raised, or the user interrupted it between two steps, out
        of the carrier's reach. A plain `fit` after it must run the
        model's own function, as Keras does, not the guard's at its last
        count.
        """
        self._history = None
        self._leave_after_error()  # the original back on the model
        if model.train_function is None:  # none made before the guard's
            model.make_train_function()
        return model.train_function

    def _leave_after_error(self):
        """Puts the model's own train function back after an error ended `fit`.

        Keras raises it out of `fit`, so no `on_train_end` detaches the
        contributors; a `fit` after it without them (plain Keras, after a
        refusal) would otherwise still run their function.
        """
        model = self._model() if self._model is not None else None
        self._contributors = {}
        self._call_list = ()
        self.inner = self.original
        if model is not None and current(model) is self:
            _put_back(model, self.original)

    @property
    def batch_key(self):
        """Identifies the latest call, for `SharedAllocatorReader.read`."""
        return (id(self), self.calls)

    @property
    def contributors(self):
        """The registered owners, in the order they attached."""
        return tuple(self._contributors)

    def add(self, owner, contribute, fit):
        """Registers `contribute` for `owner` (see `attach`, which calls it).

        Args:
            owner: The registering object; one registration each.
            contribute: Called as `contribute(logs)` after every call.
            fit: What identifies the current `fit`. Registrations and the
                inner function of an earlier `fit` are dropped first.
        """
        if fit is not self._fit:
            # A new `fit`: what a `fit` that raised (and so never ran
            # `on_train_end`) left behind is dropped.
            self._fit = fit
            self._contributors = {}
            self.inner = self.original
            model = self._model() if self._model is not None else None
            if model is not None and fit is not None:
                self._history = compat.fit_history(model)
        self._contributors[owner] = contribute
        self._call_list = tuple(self._contributors.values())

    def remove(self, owner):
        """Unregisters `owner`, if registered (see `detach`, which calls it)."""
        self._contributors.pop(owner, None)
        self._call_list = tuple(self._contributors.values())


def current(model):
    """Returns the carrier installed on `model`, or `None`."""
    function = getattr(model, "train_function", None)
    return function if isinstance(function, LogsCarrier) else None


def attach(model, owner, contribute, fit=None):
    """Registers `contribute` to run after every train function call.

    Installs the model's carrier first if it has none. Call it from
    `on_train_begin`, after Keras made the train function.

    Args:
        model: The Keras model being trained.
        owner: The registering object (a callback); one registration each.
        contribute: Called as `contribute(logs)` with the dict the inner
            train function returned, after every call; it adds its keys.
        fit: An object that identifies the current `fit` (the callbacks'
            shared `params` dict). A carrier attached to in an earlier `fit`
            drops that fit's registrations and inner function first.
            Defaults to `None`.

    Returns:
        The `LogsCarrier` now installed as `model.train_function`.
    """
    carrier = current(model)
    if carrier is None:
        carrier = LogsCarrier(model.train_function, model)
        functions.set_train_function(model, carrier)
        # The epoch logs stay the metrics' results beside the added keys.
        compat.choose_metrics_results_beside(model, lambda: carrier.added_keys)
    carrier.add(owner, contribute, fit)
    return carrier


def train_inside(model, owner, contribute, fit, function):
    """`attach`, then `function` runs inside the carrier in place of its inner one.

    Returns:
        `(carrier, previous)`: the `LogsCarrier` and the inner function
        `leave` puts back.
    """
    carrier = attach(model, owner, contribute, fit)
    previous = carrier.inner
    carrier.inner = function
    return carrier, previous


def leave(model, owner, carrier, function, previous):
    """Undoes `train_inside`: `previous` back inside (where `function` still is), then `detach`."""
    if carrier is not None and carrier.inner is function:
        carrier.inner = previous
    detach(model, owner)


def reinstall(model, carrier, original):
    """Puts `carrier` back after something replaced `model.train_function`.

    Args:
        model: The Keras model.
        carrier: The `LogsCarrier` to reinstall, or `None` (nothing to do).
        original: The function now to call and restore at train end.
    """
    if carrier is None or current(model) is carrier:
        return
    carrier.original = carrier.inner = original
    functions.set_train_function(model, carrier)


def detach(model, owner):
    """Unregisters `owner`; restores the original function after the last.

    Args:
        model: The Keras model.
        owner: The object given to `attach`.
    """
    carrier = current(model)
    if carrier is None:
        return
    carrier.remove(owner)
    if not carrier.contributors:
        _put_back(model, carrier.original)


def _put_back(model, original):
    """Gives `model` its own train function and metrics-results choice again."""
    functions.set_train_function(model, original)
    compat.restore_metrics_results_choice(model)
