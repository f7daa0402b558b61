"""Planning the micro-batch count of a batch from its compiled steps.

XLA assigns every buffer of a compiled step before it runs, so what a step
needs is known before it first runs: JAX's `memory_analysis()`, TensorFlow's
buffer assignment (`backends/tensorflow/xla_memory.py`), both read into a
`StepMemory`. Before a batch of a new shape runs, `plan_micro_batches` has
the step compiled for a few candidate counts and reads what XLA says each
needs. A count fits when the memory in use before the step (at least the
step's arguments) plus what the step allocates, plus a margin, stays under
`threshold * limit`. The search starts at the smallest count and
picks each next candidate from the pure decider's memory model
(`keras_memguard.decider.predict_demand`) fed the analysed counts as
readings, then checks it by compiling it: usually two or three compilations
find the smallest count that fits.
"""

import math
from typing import NamedTuple
from typing import Optional
from typing import Tuple

from keras_memguard import decider

_MIB = 1024 * 1024


class SplitDoesNotTrace(Exception):
    """Tracing a step of `micro_batches` micro-batches raised `error`.

    `ValueError` or `TypeError` while a split step is traced means the
    model's code fails on a micro-batch (code that assumes the batch size),
    not that the device's memory is short: the caller trains the batches
    whole, as plain `fit` does.

    Attributes:
        micro_batches: The count whose step failed to trace, above one.
        error: The model's error.
    """

    def __init__(self, micro_batches, error):
        super().__init__(micro_batches, error)
        self.micro_batches = micro_batches
        self.error = error


class StepMemory(NamedTuple):
    """What XLA says a compiled step needs, in bytes.

    Read from JAX's `memory_analysis()` or from TensorFlow's buffer
    assignment; the same fields on both.

    Attributes:
        micro_batches: The count the step was compiled for.
        argument_bytes: The step's inputs: the state and the batch.
        output_bytes: Its outputs: the new state and the logs.
        temp_bytes: Its temporaries (activations, gradients, workspace).
        alias_bytes: Outputs written into an input's buffer (0 when nothing
            is donated).
        generated_code_bytes: The executable's code.
        largest_allocation_bytes: The largest buffer the step allocates in
            one piece (it needs a free block that large), or `0` when
            unknown.
    """

    micro_batches: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int = 0
    largest_allocation_bytes: int = 0

    @property
    def need_bytes(self):
        """Arguments + outputs + temporaries - aliased: the step's total."""
        return (
            self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes
        )

    @property
    def demand_bytes(self):
        """What the step allocates beyond its arguments (already resident)."""
        return self.output_bytes + self.temp_bytes - self.alias_bytes


class CompiledPlan(NamedTuple):
    """The count a batch runs with, from its compiled steps.

    Attributes:
        micro_batches: The count to run the batch with: the smallest that
            fits, or, when none does, the largest tried.
        fits: Whether that count fits the target.
        memory: The `StepMemory` of the step at that count, or `None` when
            it could not be compiled within the device's memory.
        predicted_usage: In use before the step plus its demand plus the
            margin, over the limit; `None` without a `memory`.
        reason: Why, in words.
        analysed: The `StepMemory` of every count tried, in the order
            tried (`None` for one that could not be compiled).
    """

    micro_batches: int
    fits: bool
    memory: Optional[StepMemory]
    predicted_usage: Optional[float]
    reason: str
    analysed: Tuple[StepMemory, ...]


def _validate(batch_size, limit_bytes, threshold, margin_bytes, min_micro_batches,
              max_micro_batches, max_compiles):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}"
        )
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, (int, float)) or not limit_bytes > 0:
        raise ValueError(
            "`limit_bytes` must be a positive number of bytes. "
            f"Received: limit_bytes={limit_bytes!r}"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ValueError(f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}")
    if isinstance(margin_bytes, bool) or not isinstance(margin_bytes, (int, float)) or margin_bytes < 0:
        raise ValueError(
            f"`margin_bytes` must be a number >= 0. Received: margin_bytes={margin_bytes!r}"
        )
    for name, value in (("min_micro_batches", min_micro_batches), ("max_compiles", max_compiles)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if max_micro_batches is not None and (
        isinstance(max_micro_batches, bool)
        or not isinstance(max_micro_batches, int)
        or max_micro_batches < min_micro_batches
    ):
        raise ValueError(
            "`max_micro_batches` must be None or an integer >= `min_micro_batches`. "
            f"Received: max_micro_batches={max_micro_batches!r}, "
            f"min_micro_batches={min_micro_batches!r}"
        )


def plan_micro_batches(
    analyse,
    batch_size,
    limit_bytes,
    threshold=0.9,
    in_use_bytes=None,
    margin_bytes=0,
    min_micro_batches=1,
    max_micro_batches=None,
    max_compiles=8,
):
    """The smallest micro-batch count whose compiled step fits the limit.

    Args:
        analyse: A function from a count to its `StepMemory` (such as
            `lambda k: cache.memory(k, state, batch)` of a `StepCache`),
            called once per candidate; or to `None` when the step could
            not be compiled at that count for lack of device memory (XLA's
            autotuner tries kernels in device memory): that count does not
            fit.
        batch_size: Samples in the batch, an `int` >= 1.
        limit_bytes: The device memory limit in bytes (`bytes_limit` of
            `jax.Device.memory_stats()`, or the user's `memory_limit`).
        threshold: The share of `limit_bytes` a step must stay under, in
            (0, 1]. Defaults to `0.9`.
        in_use_bytes: Memory in use on the device before the step (its
            `bytes_in_use`), or `None` when unknown: then the step's
            arguments are taken to be all that is in use. Defaults to
            `None`.
        margin_bytes: Bytes kept free beyond the analysis (learned from
            measured peaks, `excess_bytes`), >= 0. Defaults to `0`.
        min_micro_batches: The smallest count, an `int` >= 1. Defaults to
            `1`.
        max_micro_batches: The largest count, or `None` for one sample per
            micro-batch. Defaults to `None`.
        max_compiles: The most candidates whose compile gives an analysis,
            an `int` >= 1; as many more may fail to compile for lack of
            memory. Defaults to `8`.

    Returns:
        A `CompiledPlan`.

    Raises:
        ValueError: If an argument is out of range.

    Example:

    ```python
    cache = StepCache(model)  # keras_memguard.backends.jax
    decided = plan_micro_batches(
        lambda k: cache.memory(k, state, batch), batch_size=256,
        limit_bytes=16 * 2**30)
    print(decided.micro_batches, decided.reason)
    ```
    """
    _validate(batch_size, limit_bytes, threshold, margin_bytes, min_micro_batches,
              max_micro_batches, max_compiles)
    upper = min(batch_size, max_micro_batches or batch_size)
    lowest = min(min_micro_batches, upper)
    target = threshold * limit_bytes
    analysed = {}
    config = decider.make_config(threshold=threshold)
    state = None

    def total(memory):
        base = max(in_use_bytes or 0, memory.argument_bytes)
        return base + memory.demand_bytes + margin_bytes

    def fits(memory):
        return memory is not None and total(memory) < target

    def work(k):
        return float(-(-batch_size // k))

    def predicted_fit(k, memory):
        demand = decider.predict_demand(state, work(k))
        return demand is not None and (
            max(in_use_bytes or 0, memory.argument_bytes) + demand + margin_bytes < target
        )

    k = lowest
    while True:
        analysed[k] = analyse(k)
        if analysed[k] is not None:
            memory = analysed[k]
            if state is None:
                # The new state and the logs do not shrink with the micro-batch.
                state = decider.init(config, fixed_bytes=memory.output_bytes)
            reading = decider.Reading(batch_size, k, 1.0, 0.0, float(memory.demand_bytes), float(limit_bytes))
            _, state = decider.observe(config, state, reading)
        fitting = [c for c, m in analysed.items() if fits(m)]
        hi = min(fitting) if fitting else None
        lo = max(
            [c for c, m in analysed.items() if not fits(m) and (hi is None or c < hi)],
            default=lowest - 1,
        )
        if (hi is not None and hi - lo <= 1) or lo >= upper:
            break
        compiled = sum(m is not None for m in analysed.values())
        if compiled >= max_compiles or len(analysed) - compiled >= max_compiles:
            break
        low, high = lo + 1, (hi - 1 if hi is not None else upper)
        if state is None:
            # Nothing compiled yet to model: twice the count.
            candidate = min(high, 2 * k)
        # The smallest count in [low, high] the memory model says fits.
        elif predicted_fit(high, memory):
            a, b = low, high
            while a < b:
                middle = (a + b) // 2
                if predicted_fit(middle, memory):
                    b = middle
                else:
                    a = middle + 1
            candidate = a
        elif hi is None:
            candidate = high  # check that one sample per micro-batch fails too
        elif not predicted_fit(hi, analysed[hi]):
            # The model is wrong where a step compiled: a GPU's autotuner
            # picks kernels whose workspace differs from count to count, so
            # the analyses need not fall with the micro-batch. Halve the gap
            # (geometrically) instead of settling for `hi`.
            candidate = max(low, min(high, math.isqrt(max(lo, 1) * hi)))
        else:
            break  # the model says nothing below `hi` fits
        if candidate in analysed:
            candidate = (low + high) // 2
            if candidate in analysed:
                break
        k = candidate

    fitting = [c for c, m in analysed.items() if fits(m)]
    chosen = min(fitting) if fitting else max(analysed)
    memory = analysed[chosen]
    if memory is None:
        usage = None
        where = (
            "the step could not be compiled within the device's memory at "
            f"{decider.micro_batches_text(chosen)}"
        )
    else:
        usage = total(memory) / limit_bytes
        where = (
            f"compiled step needs {total(memory) / _MIB:.1f} MiB "
            f"({usage:.0%} of {limit_bytes / _MIB:.0f} MiB) at "
            f"{decider.micro_batches_text(chosen)}"
        )
    if fitting:
        reason = f"{where}, under target {threshold:.0%}"
    else:
        reason = f"{where}: no count tried fits under target {threshold:.0%}"
    ordered = tuple(analysed.values())
    return CompiledPlan(chosen, bool(fitting), memory, usage, reason, ordered)


def count_after_no_free_block(plan):
    """The smallest count to try after `plan`'s buffers found no free block.

    The step fits in total but the allocator has no free block for its
    buffers (it is fragmented): a count that halves the largest buffer, at
    least, or a larger count `plan` already analysed whose largest buffer
    is smaller, which costs no compile.

    Args:
        plan: The `CompiledPlan` whose count failed (it has a `memory`).

    Returns:
        An `int`: the lowest count the search goes on from.

    Example:

    >>> tried = (StepMemory(6, 0, 1, 74, 0, largest_allocation_bytes=74),
    ...          StepMemory(9, 0, 1, 28, 0, largest_allocation_bytes=28))
    >>> count_after_no_free_block(CompiledPlan(6, True, tried[0], 0.5, "", tried))
    9
    """
    largest = plan.memory.largest_allocation_bytes
    return min(
        [2 * plan.micro_batches]
        + [
            memory.micro_batches
            for memory in plan.analysed
            if memory is not None
            and memory.micro_batches > plan.micro_batches
            and memory.largest_allocation_bytes < largest
        ]
    )


def excess_bytes(memory, before_bytes, peak_bytes):
    """How far a measured peak went past what the analysis predicted.

    Args:
        memory: The `StepMemory` of the step that ran.
        before_bytes: Bytes in use on the device right before it.
        peak_bytes: The device's peak during it (where the device reports
            one that covers the step only; see `JaxMemoryProbe`).

    Returns:
        Bytes >= 0 to pass as `margin_bytes` (keep the largest seen), or
        `None` when a reading is missing.

    Example:

    >>> m = StepMemory(2, 100, 40, 60, 0)
    >>> excess_bytes(m, before_bytes=100, peak_bytes=230)
    30
    """
    if memory is None or before_bytes is None or peak_bytes is None:
        return None
    return max(0, int(peak_bytes - before_bytes - memory.demand_bytes))

