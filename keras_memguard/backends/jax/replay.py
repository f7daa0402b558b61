"""A train function for Keras' JAX `fit` that replays a batch out of memory.

Keras' JAX `fit` calls `logs, state = model.train_function(state,
iterator)` once per step. `ReplayingTrainFunction` is such a function: it
pulls the batch itself, runs the compiled micro-batched step on it (which
does not donate the state), and when that raises XLA's out-of-memory error
it asks a handler for a larger count and runs the same batch on the same,
untouched state again. Only out-of-memory errors are caught; everything
else is raised as it came. Each step is waited for before the function
returns: on a GPU XLA runs a step asynchronously and reports an allocation
that failed only when a result is read, which would be after the state had
moved on. A split step whose tracing fails (`ValueError` or `TypeError`:
the model's code assumes the batch size) goes to its own handler, which
runs the batch whole from then on, as plain `fit` does, or raises.
"""

import re
from typing import Callable
from typing import NamedTuple
from typing import Optional

import jax

from keras_memguard.backends import shared
from keras_memguard.backends.shared import double_micro_batches
from keras_memguard.decider import validate_micro_batches
from keras_memguard.backends.jax.compiled import StepCache
from keras_memguard.compiled_plan import StepMemory
from keras_memguard.backends.jax.step import batch_size_of
from keras_memguard.backends import compat

# absl::StatusCode::kResourceExhausted, the status XLA gives out-of-memory
# errors.
RESOURCE_EXHAUSTED = 8

# XLA names the failed allocation in bytes ("allocating 123456 bytes") on the
# host and in its allocator's human-readable units ("allocate 466.00MiB") on
# a GPU.
_ALLOCATION_RE = re.compile(
    r"allocat\w*\s+(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)\b", re.IGNORECASE
)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# What XLA's GPU compiler reports when its autotuner could not allocate the
# buffers to try a kernel in: the compile fails (status NOT_FOUND, "Failed to
# get configs") and the out-of-memory status is only inside the message.
_AUTOTUNER_OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory"


def _runtime_error_types():
    types = [jax.errors.JaxRuntimeError]
    try:  # jaxlib before `jax.errors.JaxRuntimeError` was its own class
        from jax._src.lib import xla_client

        types.append(xla_client.XlaRuntimeError)
    except (ImportError, AttributeError):
        pass
    return tuple(types)


_RUNTIME_ERRORS = _runtime_error_types()


def is_out_of_memory(error):
    """Whether an error is XLA's out-of-memory error.

    By type (`jax.errors.JaxRuntimeError`) and status code
    (`RESOURCE_EXHAUSTED`). A jaxlib that keeps no code on the error (before
    `error_code`) is read by the status name XLA puts first in the message.
    One case is told by the message alone: compiling a step for a GPU fails
    when XLA's autotuner cannot allocate the buffers to try a kernel in; the
    status is then another (`NOT_FOUND`) and each failed try's
    `RESOURCE_EXHAUSTED: Out of memory` is in the message. The step would
    have needed that memory too, so it is out of memory all the same.

    Args:
        error: An exception.

    Returns:
        A bool.

    Example:

    >>> is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: ...", 8))
    True
    """
    if not isinstance(error, _RUNTIME_ERRORS):
        return False
    message = str(error.args[0]) if error.args else ""
    if message.startswith("NOT_FOUND") and _AUTOTUNER_OUT_OF_MEMORY in message:
        return True
    code = getattr(error, "error_code", None)
    if isinstance(code, int) and code not in (0, 2):  # 2: UNKNOWN
        return code == RESOURCE_EXHAUSTED
    return message.startswith("RESOURCE_EXHAUSTED")


def failed_allocation_bytes(error):
    """The size of the allocation an out-of-memory error names, or `None`.

    Information for the decider's `Failure`; the error is recognized by
    `is_out_of_memory`, never by this.
    """
    match = _ALLOCATION_RE.search(str(error))
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class StepOutOfMemory(NamedTuple):
    """A step that ran out of memory, as the handler gets it.

    Attributes:
        batch_size: Samples in the batch.
        micro_batches: The count that failed.
        error: The `jax.errors.JaxRuntimeError`.
        allocation_bytes: The allocation that failed, where the error says.
        memory: The failed step's `StepMemory` (its compiled analysis), or
            `None` where it did not compile.
        analyse: A function from another count to the `StepMemory` of the
            step compiled for it on this batch's shapes (compiles), or
            `None`.
    """

    batch_size: int
    micro_batches: int
    error: Exception
    allocation_bytes: Optional[int]
    memory: Optional[StepMemory] = None
    analyse: Optional[Callable[[int], Optional[StepMemory]]] = None


class ReplayingTrainFunction:
    """`model.train_function` for JAX `fit`: micro-batched, replays on OOM.

    Called by `fit` as `train_function(state, iterator)`. For each batch it
    pulls (`steps_per_execution` of them), it takes the count from `plan`
    (when given) or keeps `micro_batches`, runs the compiled step of
    `cache`, and on an out-of-memory error calls `on_out_of_memory` for a
    larger count and runs the batch again. The failed attempt leaves the
    weights, optimizer variables and metrics as they were: the step does not
    donate the state, and the metrics are updated only by a step that
    completes.

    Args:
        model: A compiled Keras model on the JAX backend.
        micro_batches: The count to start with, an `int` >= 1. Defaults to
            `1`.
        cache: The `StepCache` to compile steps into. Defaults to `None`:
            a new one for `model`.
        plan: A function `(state, data) -> int or None` called before each
            batch; an int sets the count for it. Defaults to `None`.
        on_out_of_memory: A function `StepOutOfMemory -> int` returning a
            count larger than the one that failed, or raising. Defaults to
            `None`: `double_micro_batches`.
        on_split_error: A function `(batch_size, micro_batches, error) ->
            int` called when tracing a step of more than one micro-batch
            raises `ValueError` or `TypeError` (nothing ran), returning the
            count to run the batch with, or raising. Defaults to `None`:
            the error is raised.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    functions.set_train_function(model, ReplayingTrainFunction(model, micro_batches=2))
    model.fit(x, y, batch_size=256)
    ```
    """

    def __init__(self, model, micro_batches=1, cache=None, plan=None,
                 on_out_of_memory=None, on_split_error=None):
        self.model = model
        self.micro_batches = validate_micro_batches(micro_batches)
        self.cache = cache if cache is not None else StepCache(model)
        self.plan = plan
        self.on_out_of_memory = on_out_of_memory or double_micro_batches
        self.on_split_error = on_split_error
        # Batches replayed after an out-of-memory error, and the failures.
        self.replays = 0
        self.failures = []
        # Samples in the batch that ran last, or None before the first.
        self.last_batch_size = None
        # Batches the last call ran (up to `steps_per_execution`).
        self.last_call_batches = 0

    def __call__(self, state, iterator):
        logs, state = self.run(state, next(iterator))
        self.last_call_batches = 1
        for _ in range(getattr(self.model, "steps_per_execution", 1) - 1):
            try:
                data = next(iterator)
            except StopIteration:
                break
            logs, state = self.run(state, data)
            self.last_call_batches += 1
        return logs, state

    def run(self, state, data):
        """Runs one batch, replaying it with more micro-batches on OOM.

        Args:
            state: The state tuple, as `fit` passes it.
            data: The batch.

        Returns:
            `(logs, state)`.

        Raises:
            MicroBatchTooLargeError: From the default handler, when one
                sample per micro-batch runs out of memory.
            ValueError: If the handler returns a count not larger than the
                one that failed.
        """
        try:
            return self._run(state, data)
        except BaseException:
            # Whatever ends `fit` here, the state the batch started from
            # (never donated) goes back into the model's variables.
            compat.keep_jax_state(self.model, state)
            raise

    def _run(self, state, data):
        batch_size = self.last_batch_size = batch_size_of(data)
        if self.plan is not None:
            planned = self.plan(state, data)
            if planned is not None:
                self.micro_batches = validate_micro_batches(planned)
        while True:
            k = min(self.micro_batches, batch_size)
            try:
                result = self.cache.compiled(k, state, data)(state, data)
                # On a GPU XLA runs the step asynchronously: an allocation
                # that fails shows only when a result is read. Wait here,
                # where the batch can still run again on the untouched state.
                return jax.block_until_ready(result)
            except (ValueError, TypeError) as error:
                if k <= 1 or self.on_split_error is None:
                    raise
                self.micro_batches = self.on_split_error(batch_size, k, error)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                failure = StepOutOfMemory(
                    batch_size, k, error, failed_allocation_bytes(error),
                    self.cache.compiled_memory(k, data),
                    lambda count: self.cache.memory(count, state, data),
                )
                larger = self.on_out_of_memory(failure)
                # Kept without what would hold device memory: the error's
                # traceback holds this frame (the batch, the state and the
                # failed step's outputs), the analysis holds the batch.
                error.__traceback__ = None
                self.failures.append(failure._replace(analyse=None))
                result = failure = None
                self.micro_batches = shared.checked_larger_count(
                    larger, k, batch_size, error
                )
                self.replays += 1


def _deleted(leaf):
    """Whether a state array was donated to a step and deleted."""
    is_deleted = getattr(leaf, "is_deleted", None)
    return bool(is_deleted()) if is_deleted is not None else False


class _CountingIterator:
    """Passes an iterator's batches on, keeping the last and counting them."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.last = None
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.iterator)
        self.count += 1
        return self.last


class WholeTrainFunction:
    """`model.train_function` for a model whose own `train_step` runs whole.

    Nothing inside another `train_step` can be split, so each batch runs
    through `inner`, Keras' own train function (the model's `train_step`,
    compiled as plain `fit` compiles it, donating the state as it does).
    `before_call` runs before each call (the guard's memory reading), and
    XLA's out-of-memory error goes to `on_out_of_memory`, which raises the
    error to end `fit` with; the original error is raised where it returns.
    Where a call raises before the state was donated (while the step is
    traced or compiled), that state goes back into the model's variables.
    Every step is waited for, so that an allocation that failed on a GPU
    shows here.

    Args:
        model: A compiled Keras model on the JAX backend.
        on_out_of_memory: A function `StepOutOfMemory -> None` that raises.
        before_call: A function `() -> None`, or `None`. Defaults to `None`.

    Attributes:
        inner: The function to call as `inner(state, iterator)`; set it
            before the first call.
    """

    def __init__(self, model, on_out_of_memory, before_call=None):
        self.model = model
        self.inner = None
        self.on_out_of_memory = on_out_of_memory
        self.before_call = before_call
        self.last_batch_size = None
        self.last_call_batches = 0

    def __call__(self, state, iterator):
        if self.before_call is not None:
            self.before_call()
        counting = _CountingIterator(iterator)
        try:
            result = jax.block_until_ready(self.inner(state, counting))
        except BaseException as error:
            if not any(_deleted(leaf) for leaf in jax.tree_util.tree_leaves(state)):
                # Nothing ran yet (tracing, compiling): the state the batch
                # started from goes back into the model's variables, which
                # `fit` took out. Donated to a step that ran, it is gone, as
                # in plain `fit`.
                compat.keep_jax_state(self.model, state)
            if counting.last is None or not is_out_of_memory(error):
                raise
            batch_size = self.last_batch_size = batch_size_of(counting.last)
            counting = None
            self.on_out_of_memory(
                StepOutOfMemory(batch_size, 1, error, failed_allocation_bytes(error))
            )
            raise
        self.last_batch_size = batch_size_of(counting.last)
        self.last_call_batches = counting.count
        return result
