"""How many micro-batches a batch needs, decided before it runs: a pure planner.

The guard pulls each batch before running it, so it knows the batch's size
`B` and its shapes. The planner predicts the batch's peak memory at each
micro-batch count `k` and returns the smallest `k` predicted to stay under
its target, so that memory does not run out in the first place. Like
`keras_memguard.policy` it imports neither TensorFlow nor Keras: pure
functions over immutable `NamedTuple` state, unit-tested with scripted
readings.

**The memory model.** A micro-batch's *work* is its samples times the
batch's *sample size* (elements of one sample's inputs, so a sequence twice
as long or an image twice as large counts twice):
`work = ceil(B / k) * sample_size`. The peak is `fixed + slope * work`:
weights, optimizer slots, gradients and the input batch do not shrink with
smaller micro-batches, activations do. `fixed` and `slope` are fitted to
the readings of batches that ran (two or more different works), or, with
one reading, bounded from it and the memory in use before training
(`base_bytes`): every byte above `base_bytes` is taken to grow with the
work, the prediction that allows the least.

**The target.** The planner aims under `threshold` of the limit. The
allocator's real capacity can be lower: a single large allocation fails
when no free chunk is big enough (on TensorFlow's BFC allocator a CNN that
peaked at 71% of a 600 MiB cap ran out of memory two samples later). Two
things keep the plan clear of that. The readings themselves carry the
allocator's rounding (a 77 MiB tensor held in a 128 MiB chunk counts 128
MiB), so a line through them rises faster than the tensors do and its
prediction errs on the safe side. And after an out-of-memory error the
target stays below the usage predicted for the work that failed, and that
work, or any larger one, is never planned again.

**Growing.** A plan never goes past `growth` times the largest work that
ran, so the model is refined by measurements before it is trusted far from
them; with no reading at all the first batch runs at `first_split`
micro-batches, and when that one reading allows no growth, the next runs
at half its micro-batch, so that two readings separate `fixed` from
`slope`. In accumulate mode every `k` gives the same update, so a
conservative start costs only a little speed.

Any `k` can come out, not only powers of two: a batch of 408 whose best
micro-batch is 136 is planned at `k = 3`.

Example:

>>> config = make_planner_config(threshold=0.9)
>>> state = init_planner_state()
>>> state = observe(config, state, work=50, limit_bytes=1000, peak_bytes=300)
>>> state = observe(config, state, work=100, limit_bytes=1000, peak_bytes=500)
>>> decided = plan(config, state, batch_size=408, sample_size=1.0,
...                limit_bytes=1000)
>>> decided.micro_batches, decided.reason
(3, 'predicted peak 64% of 0 MiB under target 90%')
"""

import math
import numbers
from typing import NamedTuple, Optional, Tuple

__all__ = [
    "Plan",
    "PlannerConfig",
    "PlannerState",
    "init_planner_state",
    "make_planner_config",
    "observe",
    "observe_out_of_memory",
    "one_sample_fits",
    "plan",
    "planned_micro_batches",
    "planner_state_from_dict",
    "planner_state_to_dict",
    "predict_peak",
]

# Readings kept: the most recent per work, at most this many works.
MAX_READINGS = 8
# Version of the dictionary written by `planner_state_to_dict`.
PLANNER_STATE_VERSION = 1
# Below the usage predicted for a work that ran out of memory, the target
# keeps this margin (the prediction itself was too optimistic there).
FAILURE_MARGIN = 0.97


class PlannerConfig(NamedTuple):
    """Settings of the planner; build it with `make_planner_config`.

    Attributes:
        threshold: Usage (peak / limit) the planner never aims at or above.
        growth: A plan's work is at most this many times the largest work
            that ran.
        first_split: Micro-batches of the first batch, before any reading.
        min_micro_batches: The smallest `k` planned.
        max_micro_batches: The largest `k` planned, or `None`.
    """

    threshold: float = 0.9
    growth: float = 2.0
    first_split: int = 8
    min_micro_batches: int = 1
    max_micro_batches: Optional[int] = None


class PlannerState(NamedTuple):
    """What the planner has learned; start it with `init_planner_state`.

    Attributes:
        readings: `(work, peak_bytes)` pairs of batches that ran, the most
            recent per work, sorted by work (at most `MAX_READINGS`).
        base_bytes: Memory in use before training (weights, optimizer
            slots), or `None` when unknown.
        failed_work: The smallest work that ran out of memory, or
            `math.inf`.
        capacity_usage: The usage the allocator has proven unable to reach
            (from out-of-memory errors), or `math.inf`.
        limit_bytes: The device limit the readings were taken under, or
            `None`.
    """

    readings: Tuple[Tuple[float, float], ...]
    base_bytes: Optional[float]
    failed_work: float
    capacity_usage: float
    limit_bytes: Optional[float]


class Plan(NamedTuple):
    """The planner's answer for one batch.

    Attributes:
        micro_batches: The micro-batch count to run the batch with.
        predicted_usage: The predicted peak usage (peak / limit) at that
            count, or `None` when it cannot be predicted yet.
        target_usage: The usage the plan aimed under.
        reason: Why this count, e.g.
            `"predicted peak 88% of 600 MiB < target 90%"`.
    """

    micro_batches: int
    predicted_usage: Optional[float]
    target_usage: float
    reason: str


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def make_planner_config(
    threshold=0.9,
    growth=2.0,
    first_split=8,
    min_micro_batches=1,
    max_micro_batches=None,
):
    """Validates the planner's settings and returns a `PlannerConfig`.

    Args:
        threshold: Usage (peak / limit) never aimed at, in (0, 1].
            Defaults to `0.9`.
        growth: The most a plan's work may exceed the largest work that ran,
            as a factor > 1. Defaults to `2.0`.
        first_split: Micro-batches of the first batch when nothing is known,
            an integer >= 1. Defaults to `8`.
        min_micro_batches: The smallest count planned, an integer >= 1.
            Defaults to `1`.
        max_micro_batches: The largest count planned, an integer >=
            `min_micro_batches`, or `None`. Defaults to `None`.

    Returns:
        A `PlannerConfig`.

    Raises:
        ValueError: If an argument is out of range or of the wrong type.

    Example:

    >>> make_planner_config(threshold=0.8).growth
    2.0
    """
    if not _is_real(threshold) or not 0 < threshold <= 1:
        raise ValueError(
            f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}"
        )
    if not _is_real(growth) or not growth > 1:
        raise ValueError(f"`growth` must be a number > 1. Received: growth={growth!r}")
    for name, value in (
        ("first_split", first_split),
        ("min_micro_batches", min_micro_batches),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(
                f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
            )
    if max_micro_batches is not None and (
        not _is_int(max_micro_batches) or max_micro_batches < min_micro_batches
    ):
        raise ValueError(
            "`max_micro_batches` must be None or an integer >= "
            f"min_micro_batches ({min_micro_batches}). "
            f"Received: max_micro_batches={max_micro_batches!r}"
        )
    return PlannerConfig(
        threshold=float(threshold),
        growth=float(growth),
        first_split=int(first_split),
        min_micro_batches=int(min_micro_batches),
        max_micro_batches=None if max_micro_batches is None else int(max_micro_batches),
    )


def init_planner_state(base_bytes=None, limit_bytes=None):
    """Returns a planner state that knows nothing yet.

    Args:
        base_bytes: Memory in use before training (weights and optimizer
            slots), in bytes, or `None`. Defaults to `None`.
        limit_bytes: The device limit in bytes, or `None`. Defaults to
            `None`.

    Returns:
        A `PlannerState`.

    Example:

    >>> init_planner_state().readings
    ()
    """
    return PlannerState(
        readings=(),
        base_bytes=None if base_bytes is None else float(base_bytes),
        failed_work=math.inf,
        capacity_usage=math.inf,
        limit_bytes=None if limit_bytes is None else float(limit_bytes),
    )


def _fit(state):
    """`(fixed, slope)` of `peak = fixed + slope * work`, or `None`."""
    readings = state.readings
    if not readings:
        return None
    base = state.base_bytes
    largest_work, largest_peak = readings[-1]
    if len(readings) >= 2:
        smallest_work, smallest_peak = readings[0]
        slope = (largest_peak - smallest_peak) / (largest_work - smallest_work)
        fixed = largest_peak - slope * largest_work
        if slope > 0 and (base is None or fixed >= base):
            return fixed, slope
    # One reading, or readings that do not fit the model: the slope is
    # bounded as if every byte above the memory in use before training grew
    # with the work, and the line of that slope is laid on or above every
    # reading (a smaller micro-batch that peaked as high shows memory that
    # does not grow).
    slope = (largest_peak - min(base or 0.0, largest_peak)) / largest_work
    fixed = max(peak - slope * work for work, peak in readings)
    return fixed, slope


def predict_peak(state, work):
    """Predicts the peak bytes of a micro-batch of `work`.

    Args:
        state: A `PlannerState`.
        work: Micro-batch samples times the sample size.

    Returns:
        The predicted peak in bytes, or `None` before any reading.

    Example:

    >>> state = init_planner_state(base_bytes=100)._replace(
    ...     readings=((10.0, 300.0),))
    >>> predict_peak(state, 20.0)
    500.0
    """
    fitted = _fit(state)
    if fitted is None:
        return None
    fixed, slope = fitted
    return fixed + slope * work


def _target_usage(config, state):
    return min(config.threshold, state.capacity_usage)


def _percent(value):
    return f"{value:.0%}"


def _mib(value):
    return f"{value / (1024 * 1024):.0f} MiB"


def plan(config, state, batch_size, sample_size, limit_bytes):
    """Plans the micro-batch count for one batch.

    Cheap enough for every batch: a handful of arithmetic operations.
    `planned_micro_batches` gives the count alone, without the reason's
    text.

    Args:
        config: A `PlannerConfig`.
        state: The current `PlannerState`.
        batch_size: Samples in the batch (of one replica), an integer >= 1.
        sample_size: Elements of one sample's inputs (> 0).
        limit_bytes: The device memory limit in bytes (> 0).

    Returns:
        A `Plan`.

    Example:

    >>> config = make_planner_config()
    >>> plan(config, init_planner_state(), 64, 1.0, 1000).micro_batches
    8
    """
    k, predicted, target, why = _plan(config, state, batch_size, sample_size, limit_bytes)
    if why in (_UNDER, _STILL_OVER):
        why = (
            f"predicted peak {_percent(predicted)} of {_mib(limit_bytes)} "
            f"{why} target {_percent(target)}"
        )
    return Plan(k, predicted, target, why)


def planned_micro_batches(config, state, batch_size, sample_size, limit_bytes):
    """`plan(...).micro_batches`, without building the reason's text.

    For a caller that plans every batch and needs the reason only when the
    count changes.

    Args:
        config: A `PlannerConfig`.
        state: The current `PlannerState`.
        batch_size: Samples in the batch (of one replica), an integer >= 1.
        sample_size: Elements of one sample's inputs (> 0).
        limit_bytes: The device memory limit in bytes (> 0).

    Returns:
        The micro-batch count, an int.

    Example:

    >>> planned_micro_batches(make_planner_config(), init_planner_state(),
    ...                       64, 1.0, 1000)
    8
    """
    return _plan(config, state, batch_size, sample_size, limit_bytes)[0]


_FIRST_SPLIT = "nothing measured yet: a cautious first split"
_SMALLER = (
    "a smaller micro-batch, to tell memory that grows with it from memory "
    "that does not"
)
# Completed by `plan` into "predicted peak 64% of 600 MiB under target 90%".
_UNDER = "under"
_STILL_OVER = "one sample per micro-batch: still over"


def _plan(config, state, batch_size, sample_size, limit_bytes):
    """`plan`'s numbers: `(k, predicted usage, target usage, why)`."""
    cap = config.max_micro_batches
    high = batch_size if cap is None else min(cap, batch_size)
    low = min(config.min_micro_batches, high)
    target = _target_usage(config, state)
    fitted = _fit(state)
    if fitted is None:
        k = max(low, min(high, config.first_split))
        return k, None, target, _FIRST_SPLIT
    fixed, slope = fitted
    # The largest work allowed: under the target, below any work that
    # failed, and not far beyond the works measured.
    room = target * limit_bytes - fixed
    if slope > 0:
        allowed = room / slope
    else:  # Nothing measured grows with the work: all or nothing.
        allowed = math.inf if room > 0 else 0.0
    failed = state.failed_work
    if failed < math.inf:
        allowed = min(allowed, failed * (1 - 1e-9))
    # Far below the target the model's error cannot matter: no bound.
    candidate = min(allowed, batch_size * sample_size)
    if fixed + slope * candidate > 0.5 * target * limit_bytes:
        allowed = min(allowed, config.growth * state.readings[-1][0])
    allowed = min(allowed, batch_size * sample_size)  # the whole batch at most
    largest_micro = int(allowed / sample_size) if allowed > 0 else 0
    if largest_micro >= 1:
        k = -(-batch_size // largest_micro)
        why = _UNDER
    else:
        k = batch_size
        why = _STILL_OVER
    k = max(low, min(high, k))
    work = -(-batch_size // k) * sample_size
    measured = state.readings[-1][0]
    if len(state.readings) == 1 and work <= measured and k < high:
        # One reading cannot tell memory that grows with the micro-batch
        # from memory that does not, and the bound it gives allows no
        # growth: measure a second, smaller micro-batch (safe) to find out.
        probe = max(1, int(measured / sample_size / 2))
        k = max(low, min(high, -(-batch_size // probe)))
        work = -(-batch_size // k) * sample_size
        return k, (fixed + slope * work) / limit_bytes, target, _SMALLER
    return k, (fixed + slope * work) / limit_bytes, target, why


def one_sample_fits(config, state, sample_size, limit_bytes):
    """Whether a micro-batch of one sample may fit, as far as `state` knows.

    `False` when one sample's work ran out of memory before (or a smaller
    one did), or when its predicted peak is at or above the target: no
    micro-batch count helps then.

    Args:
        config: A `PlannerConfig`.
        state: A `PlannerState`.
        sample_size: Elements of one sample's inputs (> 0).
        limit_bytes: The device memory limit in bytes (> 0).

    Returns:
        A bool; `True` while nothing says otherwise.

    Example:

    >>> state = observe_out_of_memory(
    ...     make_planner_config(), init_planner_state(), 8.0, 100)
    >>> one_sample_fits(make_planner_config(), state, 8.0, 100)
    False
    """
    if state.failed_work <= sample_size:
        return False
    predicted = predict_peak(state, sample_size)
    return predicted is None or predicted < _target_usage(config, state) * limit_bytes


def _record(readings, work, peak):
    for i, (recorded, _) in enumerate(readings):
        if recorded == work:  # the same works, still sorted
            return readings[:i] + ((work, peak),) + readings[i + 1 :]
    entries = dict(readings)
    entries[work] = peak
    while len(entries) > MAX_READINGS:
        # Keep the extremes (they fix the slope best); drop the middle one
        # nearest its neighbours.
        works = sorted(entries)
        middle = works[1:-1]
        del entries[min(middle, key=lambda w: abs(w - work) or math.inf)]
    return tuple(sorted(entries.items()))


def observe(config, state, work, limit_bytes, peak_bytes, current_bytes=None):
    """Records the peak of a batch that ran.

    Args:
        config: A `PlannerConfig`.
        state: The current `PlannerState`.
        work: The batch's micro-batch work (samples times sample size).
        limit_bytes: The device limit in bytes.
        peak_bytes: The batch's measured peak in bytes.
        current_bytes: Memory in use after the batch (weights, optimizer
            slots), or `None`. The lowest seen is `base_bytes`.

    Returns:
        The new `PlannerState`; `state` itself when the reading teaches
        nothing new (the same peak at a work already recorded, no lower
        `current_bytes`, the same limit), so a caller can tell by identity
        that nothing changed (and keep what it derived from `state`).

    Example:

    >>> state = observe(make_planner_config(), init_planner_state(), 4, 100, 50)
    >>> state.readings
    ((4.0, 50.0),)
    >>> observe(make_planner_config(), state, 4, 100, 50) is state
    True
    """
    del config  # same signature as the other steps
    base = state.base_bytes
    if current_bytes is not None:
        base = float(current_bytes) if base is None else min(base, current_bytes)
    reading = (float(work), float(peak_bytes))
    limit = float(limit_bytes)
    if (
        base == state.base_bytes
        and limit == state.limit_bytes
        and reading in state.readings
    ):
        return state
    return PlannerState(
        readings=_record(state.readings, *reading),
        base_bytes=base,
        failed_work=state.failed_work,
        capacity_usage=state.capacity_usage,
        limit_bytes=limit,
    )


def observe_out_of_memory(config, state, work, limit_bytes, largest_fitting_work=None):
    """Records that a micro-batch of `work` ran out of memory.

    Args:
        config: A `PlannerConfig`.
        state: The current `PlannerState`.
        work: The failed micro-batch's work.
        limit_bytes: The device limit in bytes.
        largest_fitting_work: When the allocation failed with enough
            memory free but not in one piece, the work whose allocation of
            that kind would have fitted the largest free block (allocations
            of a step grow with its micro-batch); `None` otherwise. Works
            above it are not planned either.

    Returns:
        The new `PlannerState`: `work` and above are never planned again,
        and the target stays below the usage predicted there.

    Example:

    >>> state = observe_out_of_memory(
    ...     make_planner_config(), init_planner_state(), 8, 100)
    >>> state.failed_work
    8.0
    """
    del config
    predicted = predict_peak(state, work)
    capacity = state.capacity_usage
    if predicted is not None and predicted < limit_bytes:
        capacity = min(capacity, FAILURE_MARGIN * predicted / limit_bytes)
    failed = min(state.failed_work, float(work))
    if largest_fitting_work is not None and 0 < largest_fitting_work < work:
        failed = min(failed, float(largest_fitting_work) * (1 + 1e-6))
    # Readings at or above a failed work no longer hold.
    return state._replace(
        readings=tuple((w, p) for w, p in state.readings if w < work),
        failed_work=failed,
        capacity_usage=capacity,
    )


def planner_state_to_dict(state):
    """A JSON-safe dictionary of `state`, readable by `planner_state_from_dict`.

    Example:

    >>> planner_state_to_dict(init_planner_state())["failed_work"]
    'inf'
    """

    def number(value):
        return "inf" if value == math.inf else value

    return {
        "version": PLANNER_STATE_VERSION,
        "readings": [list(r) for r in state.readings],
        "base_bytes": state.base_bytes,
        "failed_work": number(state.failed_work),
        "capacity_usage": number(state.capacity_usage),
        "limit_bytes": state.limit_bytes,
    }


def planner_state_from_dict(data):
    """Rebuilds a `PlannerState` written by `planner_state_to_dict`.

    Args:
        data: The dictionary (after a JSON round trip).

    Returns:
        A `PlannerState`.

    Raises:
        ValueError: If `data` is not such a dictionary.

    Example:

    >>> state = init_planner_state(base_bytes=5)
    >>> planner_state_from_dict(planner_state_to_dict(state)) == state
    True
    """
    if not isinstance(data, dict) or data.get("version") != PLANNER_STATE_VERSION:
        raise ValueError(
            "Expected a planner state of version "
            f"{PLANNER_STATE_VERSION}. Received: {data!r}"
        )

    def number(name, allow_none=False, allow_inf=False):
        value = data.get(name)
        if allow_none and value is None:
            return None
        if allow_inf and value == "inf":
            return math.inf
        if not _is_real(value) or not value >= 0 or math.isinf(value):
            raise ValueError(
                f"`{name}` must be a number >= 0. Received: {name}={value!r}"
            )
        return float(value)

    raw = data.get("readings")
    if not isinstance(raw, list) or len(raw) > MAX_READINGS:
        raise ValueError(f"`readings` must be a list. Received: readings={raw!r}")
    readings = []
    for entry in raw:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not all(_is_real(v) and 0 < v < math.inf for v in entry)
        ):
            raise ValueError(
                "Each reading must be a [work, peak_bytes] pair of numbers > 0. "
                f"Received: {entry!r}"
            )
        readings.append((float(entry[0]), float(entry[1])))
    return PlannerState(
        readings=tuple(sorted(dict(readings).items())),
        base_bytes=number("base_bytes", allow_none=True),
        failed_work=number("failed_work", allow_inf=True),
        capacity_usage=number("capacity_usage", allow_inf=True),
        limit_bytes=number("limit_bytes", allow_none=True),
    )
