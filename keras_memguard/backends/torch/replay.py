"""A train function for Keras' PyTorch `fit` that replays a batch out of memory.

Keras' torch `fit` calls `logs = model.train_function(data)` once per step,
with `data` a list of batches (one: Keras 3.8-3.15 refuse
`steps_per_execution > 1` on torch). `ReplayingTrainFunction` is such a
function: it runs the micro-batched step on each batch, and when that
raises an out-of-memory error it asks a handler for a larger count and runs
the same batch again, with nothing applied twice. Before each batch it
copies what the step changes before its optimizer update (the metrics'
variables, the non-trainable variables such as BatchNormalization's moving
statistics and the seed generators' states, torch's global random state:
small); a failed attempt puts
them back, drops its gradients, and frees what it held before the replay.
The optimizer update runs last, once every micro-batch has succeeded, so
the weights and the optimizer's variables are untouched by a failure. An
error raised inside the optimizer update itself is not replayed: the update
may have changed some variables, and more micro-batches would not make it
smaller. A split step whose model code fails on its first micro-batch
(`ValueError`, `TypeError` or `RuntimeError`, not out of memory: code that
assumes the batch size) is rolled back the same way and goes to its own
handler, which runs the batch whole from then on, as plain `fit` does, or
raises. Every other error is raised as it came.

`jit_compile`: `compile(jit_compile="auto")` resolves to `False` on torch
(eager) in Keras 3.8 and 3.15 alike. With `jit_compile=True` Keras wraps its
step in `torch.compile`; this function runs its micro-batched step eagerly
(with a warning once). A compiled step would be compiled again for every
count and every micro-batch size it meets (the last, smaller micro-batch
of a batch; each count a replay moves to), which costs more than the step
on a CPU, and the step breaks out of the compiled graph at each
`backward()` and at the optimizer update anyway.
"""

import gc
import re
import warnings
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Optional

import torch

from keras_memguard.backends import compat
from keras_memguard.backends.torch.step import StepProgress
from keras_memguard.backends.torch.step import batch_size_of
from keras_memguard.backends.torch.step import run_step
from keras_memguard.backends.torch.step import validate_mode
from keras_memguard.backends import shared
from keras_memguard.backends.shared import double_micro_batches
from keras_memguard.decider import validate_micro_batches

# What torch's CPU allocator says when `malloc` fails (an `[enforce fail at
# alloc_cpu.cpp]` RuntimeError, not `torch.OutOfMemoryError`).
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"

# The CPU allocator names the size in bytes ("you tried to allocate 123
# bytes"), CUDA's caching allocator in human-readable units ("Tried to
# allocate 2.00 GiB").
_ALLOCATION_RE = re.compile(
    r"tried to allocate\s+(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB)\b",
    re.IGNORECASE,
)
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_JIT_WARNED_ATTR = "_memguard_torch_jit_warned"


def _out_of_memory_types():
    types = []
    for owner, name in ((torch, "OutOfMemoryError"), (torch.cuda, "OutOfMemoryError")):
        error_type = getattr(owner, name, None)
        if isinstance(error_type, type) and error_type not in types:
            types.append(error_type)
    return tuple(types)


_OUT_OF_MEMORY_TYPES = _out_of_memory_types()


def is_out_of_memory(error):
    """Whether an error is torch's out-of-memory error.

    `torch.OutOfMemoryError` (CUDA's caching allocator, and other device
    allocators that raise it), and on the CPU the `RuntimeError` torch's
    default allocator raises when memory cannot be had
    (`"DefaultCPUAllocator: can't allocate memory"`): the CPU has no error
    type of its own, so it is told by that message, here only.

    Args:
        error: An exception.

    Returns:
        A bool.

    Example:

    >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    True
    >>> is_out_of_memory(RuntimeError("shape mismatch"))
    False
    """
    if isinstance(error, _OUT_OF_MEMORY_TYPES):
        return True
    return isinstance(error, RuntimeError) and CPU_OUT_OF_MEMORY in str(error)


def failed_allocation_bytes(error):
    """The size of the allocation an out-of-memory error names, or `None`.

    Information for the decider's `Failure`; the error is recognized by
    `is_out_of_memory`, never by this.

    Args:
        error: An exception.

    Returns:
        An `int` number of bytes, or `None` where the message names none.

    Example:

    >>> failed_allocation_bytes(RuntimeError("... you tried to allocate 1024 bytes."))
    1024
    """
    match = _ALLOCATION_RE.search(str(error))
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class StepOutOfMemory(NamedTuple):
    """A step that ran out of memory, as the handler gets it.

    The fields of the JAX backend's record of the same name, so a handler
    serves both.

    Attributes:
        batch_size: Samples in the batch.
        micro_batches: The count that failed.
        error: The out-of-memory error.
        allocation_bytes: The allocation that failed, where the error says.
        memory: Always `None` on torch (no compiled step to analyse).
        analyse: Always `None` on torch.
    """

    batch_size: int
    micro_batches: int
    error: Exception
    allocation_bytes: Optional[int]
    memory: Optional[Any] = None
    analyse: Optional[Callable[[int], Any]] = None


def _state_variables(model):
    """What a step changes before its optimizer update, each variable once."""
    seen = set()
    variables = []
    for variable in list(model.metrics_variables) + list(model.non_trainable_variables):
        if id(variable) not in seen:
            seen.add(id(variable))
            variables.append(variable)
    return variables


class StateSnapshot:
    """Copies of the metrics' and the non-trainable variables' values.

    Also torch's global random state: a layer without a seed of its own
    (`Dropout()` on torch) draws from it, so a replay draws what the failed
    attempt drew.
    """

    def __init__(self, model):
        self.values = [
            (variable, variable.value.detach().clone())
            for variable in _state_variables(model)
        ]
        self.random_state = torch.get_rng_state()
        self.cuda_random_state = (
            torch.cuda.get_rng_state_all() if _cuda_initialized() else None
        )

    def restore(self):
        with torch.no_grad():
            for variable, value in self.values:
                variable.value.copy_(value)
        torch.set_rng_state(self.random_state)
        if self.cuda_random_state is not None:
            torch.cuda.set_rng_state_all(self.cuda_random_state)


def _cuda_initialized():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def drop_tracebacks(error):
    """Drops the tracebacks of `error` and of every error chained behind it.

    Args:
        error: An exception; its `__cause__` / `__context__` chain is walked.
    """
    seen = set()
    pending = [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        error.__traceback__ = None
        pending += (error.__cause__, error.__context__)


def free_memory():
    """Gives back what a failed attempt held: collected, CUDA's cache emptied."""
    gc.collect()
    if _cuda_initialized():
        torch.cuda.empty_cache()


class ReplayingTrainFunction:
    """`model.train_function` for torch `fit`: micro-batched, replays on OOM.

    Called by `fit` as `train_function(data)` with a list of batches. For
    each batch it takes the count from `plan` (when given) or keeps
    `micro_batches`, runs the micro-batched step, and on an out-of-memory
    error calls `on_out_of_memory` for a larger count and runs the batch
    again. The failed attempt leaves the weights, the optimizer's
    variables, the metrics and the non-trainable variables as they were. In
    `"shrink"` mode the micro-batches applied before the failure stay
    applied, and the replay trains the rest of the batch.

    The interface of the JAX backend's function of the same name, with
    `plan(data)` in place of `plan(state, data)`: `micro_batches` (the
    count the next batch starts from, raised by each replay), `replays`,
    `failures` (`StepOutOfMemory` records, their tracebacks dropped),
    `last_batch_size` and `last_call_batches`.

    Args:
        model: A compiled Keras model on the PyTorch backend.
        micro_batches: The count to start with, an `int` >= 1. Defaults to
            `1`.
        plan: A function `batch -> int or None` called before each batch
            (`(x, y, sample_weight)` as the data adapter yields it); an int
            sets the count for it. Defaults to `None`.
        on_out_of_memory: A function `StepOutOfMemory -> int` returning a
            count larger than the one that failed, or raising. Defaults to
            `None`: `double_micro_batches`.
        mode: `"accumulate"` or `"shrink"` (see `micro_batch_train_step`).
            Defaults to `"accumulate"`.
        whole_step: A model's own `train_step`, run on each whole batch
            instead of the micro-batched step (nothing in it can be split;
            an out-of-memory error goes to `on_out_of_memory` all the
            same), or `None`. Defaults to `None`.

    Raises:
        ValueError: If `micro_batches` or `mode` is invalid.

    Example:

    ```python
    model.compile(optimizer="adam", loss="mse")
    set_train_function(model, ReplayingTrainFunction(model, micro_batches=2))
    model.fit(x, y, batch_size=256)
    ```
    """

    def __init__(self, model, micro_batches=1, plan=None, on_out_of_memory=None,
                 mode="accumulate", whole_step=None, on_split_error=None):
        self.model = model
        self.whole_step = whole_step
        self.micro_batches = validate_micro_batches(micro_batches)
        self.plan = plan
        self.on_out_of_memory = on_out_of_memory or double_micro_batches
        self.on_split_error = on_split_error
        self.mode = validate_mode(mode)
        # Batches replayed after an out-of-memory error, and the failures.
        self.replays = 0
        self.failures = []
        # Samples in the batch that ran last, or None before the first.
        self.last_batch_size = None
        # Batches the last call ran.
        self.last_call_batches = 0

    def __call__(self, data):
        self._warn_jit_once()
        logs = None
        self.last_call_batches = 0
        for batch in compat.batches_of(data):
            logs = self.run(batch)
            self.last_call_batches += 1
        return logs

    def _split_failed(self, error, k, progress):
        """Whether `error` is the model's code failing on a micro-batch
        before anything was applied (not out of memory), with a handler."""
        return (
            self.on_split_error is not None
            and k > 1
            and self.whole_step is None
            and progress.rows_done == 0
            and not progress.applying
            and isinstance(error, (ValueError, TypeError, RuntimeError))
            and not is_out_of_memory(error)
        )

    def _warn_jit_once(self):
        if getattr(self.model, "jit_compile", False) and not getattr(
            self.model, _JIT_WARNED_ATTR, False
        ):
            object.__setattr__(self.model, _JIT_WARNED_ATTR, True)
            warnings.warn(
                f"Model {self.model.name!r} was compiled with "
                "jit_compile=True; its micro-batched train step runs eagerly "
                "(torch.compile would compile it again for every micro-batch "
                "count and size).",
                stacklevel=3,
            )

    def run(self, batch):
        """Runs one batch, replaying it with more micro-batches on OOM.

        Args:
            batch: The batch, as `train_step` receives it.

        Returns:
            The step's logs.

        Raises:
            MicroBatchTooLargeError: From the default handler, when one
                sample per micro-batch runs out of memory.
            ValueError: If the handler returns a count not larger than the
                one that failed.
        """
        batch_size = self.last_batch_size = batch_size_of(batch)
        if self.plan is not None:
            planned = self.plan(batch)
            if planned is not None:
                self.micro_batches = validate_micro_batches(planned)
        snapshot = [StateSnapshot(self.model)]

        def applied():
            # Shrink mode: what is applied stays; roll back to here.
            snapshot[0] = StateSnapshot(self.model)

        progress = StepProgress(on_applied=applied)
        while True:
            remaining = batch_size - progress.rows_done
            k = min(self.micro_batches, batch_size)
            # Shrink mode goes on with the rows not yet applied, in parts
            # of the size `k` gives the whole batch.
            parts = min(remaining, -(-remaining * k // batch_size))
            try:
                if self.whole_step is not None:
                    return self.whole_step(batch)
                return run_step(self.model, batch, parts, self.mode, progress)
            except Exception as error:
                if self._split_failed(error, k, progress):
                    # Nothing applied: as before the batch, then whole.
                    drop_tracebacks(error)
                    self.model.zero_grad()
                    snapshot[0].restore()
                    self.micro_batches = self.on_split_error(batch_size, k, error)
                    continue
                if not is_out_of_memory(error) or progress.applying:
                    raise
                # The tracebacks hold the failed attempt's frames: its
                # micro-batch, outputs and autograd graph. Keras re-raises a
                # layer's error as a new one, so torch's own (and its
                # traceback) is in the chain behind it.
                drop_tracebacks(error)
                self.model.zero_grad()
                snapshot[0].restore()
                free_memory()
                failure = StepOutOfMemory(
                    batch_size, k, error, failed_allocation_bytes(error)
                )
                self.failures.append(failure)
                larger = self.on_out_of_memory(failure)
                failure = None
                self.micro_batches = shared.checked_larger_count(
                    larger, k, batch_size, error
                )
                self.replays += 1
