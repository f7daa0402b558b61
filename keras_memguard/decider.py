"""How many micro-batches each batch runs with: the one pure decider.

Every decision the guard makes about the micro-batch count `k` comes from
here: planning a batch before it runs, reacting to a batch's peak after it
ran, sizing the replay of a batch that ran out of memory, and slicing a
validation batch that did. The module imports neither TensorFlow nor Keras
nor numpy: pure functions over immutable `NamedTuple` state, in the style of
optax (`init`, `observe`, `fail`, `plan`), so it can be tested with scripted
numbers and run identically on every replica and worker fed agreed numbers.

**The memory model.** A micro-batch's *work* is its samples times the
batch's *sample size* (elements of one sample's inputs, so a sequence twice
as long counts twice). The step's own *demand* is its peak minus the memory
in use right before it started (weights, optimizer slots, the input batch,
buffers an input pipeline prefetched, other models: everything outside the
step). The decider models `demand = fixed + slope * work`, fitted to the
demands of batches that ran. Planning puts that demand into the memory free
*now*: `in_use + demand(work) < threshold * limit`. Because the model never
holds the memory in use before a step, a baseline that moves (an input
pipeline that prefetches more or less from batch to batch) changes the plan
of the batch it moves under, never the model.

`fixed` is at least the step's own memory that does not shrink with the
micro-batch (`fixed_bytes` given to `init`: the gradients, one per trainable
weight); with a single reading, every byte above it is taken to grow with
the work.

**Failures.** An out-of-memory error at a work is one record: the demand it
proved (at least the memory that was free before the step, what the error
says was in use plus the allocation that failed, and the micro-batch's
layer outputs). Plans stay under
the line through that record. The replay's micro-batch is strictly smaller
than the one that failed, sized from the error: the demand it proved, and,
when the failed allocation grows with the micro-batch (its shape holds the
micro-batch size), the largest free block. A second failure of the same
allocation at a smaller micro-batch proves that no count helps, and so does
a failure at one sample per micro-batch: `fail` says so (`cannot_split`)
instead of trying again.

**Steady counts.** Per batch shape (size and sample size) the decider
remembers the count it ran with. It raises `k` at once when the batch is
predicted not to fit; it lowers `k` only to a count predicted to fit with
`HYSTERESIS` of the limit to spare, or one count down where that count's
own peak backs it (a count never run here is tried on one batch where it
is predicted `TRIAL_BAND` under the target, and kept while its highest
peak stays under the target), so a usage hovering near the threshold
cannot make `k` flap, and batches of other sizes do not re-plan the shape.
It does not raise `k` above the count the shape ran with while the batches
measured at that count peaked under the target, and under the midpoint of
the target and the limit with whatever more memory is in use now than
before them: the model adds the highest demand to the highest memory in
use, which never came together where an input pipeline's buffers fill
before one step and during the next, and where the step's demand hardly
shrinks with the micro-batch that sum swings around the target from batch
to batch and would ratchet `k` up by noise alone (one more prefetched
batch, where the count ran just under the target).

**Reacting** (`predictive=False`, or several workers that agree on each
batch's numbers after it ran) is a configuration: `plan` keeps the count,
`observe` raises `k` at once when a batch's peak reached `threshold` and
lowers it when the usage predicted at half the count stayed below `release`
for `cooldown` batches. The same memory model predicts, the same failure
records bound.

Example:

>>> config = make_config(threshold=0.9)
>>> state = init(config)
>>> batch = Batch(batch_size=408, sample_size=1.0, in_use_bytes=100.0,
...               limit_bytes=1000.0)
>>> decided, state = plan(config, state, batch)
>>> decided.micro_batches, decided.reason
(8, 'nothing measured yet: a cautious first split')
>>> state = observe(config, state, Reading(408, 8, 1.0, 100.0, 300.0, 1000.0))[1]
>>> decided, state = plan(config, state, batch)
>>> decided.micro_batches
4
"""

import math
import numbers
from typing import NamedTuple, Optional, Tuple

__all__ = [
    "Batch",
    "CANNOT_SPLIT_ALLOCATION",
    "CANNOT_SPLIT_BATCH_SIZE",
    "CANNOT_SPLIT_CAP",
    "DeciderConfig",
    "DeciderState",
    "Failure",
    "Plan",
    "Reading",
    "accumulation_fits",
    "fail",
    "fail_evaluation",
    "fail_without_figures",
    "from_dict",
    "in_use_beside_replay",
    "in_use_planned_for",
    "inherit",
    "init",
    "make_config",
    "micro_batches_text",
    "observe",
    "one_sample_fits",
    "plan",
    "predict_demand",
    "to_dict",
]

# Readings kept: the highest demand per work, at most this many works.
MAX_READINGS = 8
# Failure records kept (the smallest works).
MAX_FAILURES = 4
# Batch shapes whose count is remembered for hysteresis.
MAX_SHAPES = 16
# A plan that lowers `k` aims this share of the limit under the target.
HYSTERESIS = 0.04
# A lower count never measured is tried where it is predicted this share
# of the limit under the target (`_lower_measured`).
TRIAL_BAND = 0.02
# A held count whose batches peaked at most this share of the limit past
# the target stays held where more micro-batches would save under
# `HYSTERESIS`: a batch a little above the others, not a step that grew.
HELD_OVERSHOOT = 0.01
# Before any reading, a micro-batch is taken to need this many times its
# layer outputs (kept for the backward pass, their gradients, temporaries).
FIRST_SPLIT_ACTIVATIONS = 4.0
# The first batch's split when nothing is known and nobody chose one. The
# batch runs whole instead where the memory free holds this many times what
# `FIRST_SPLIT_ACTIVATIONS` asks of it: a split the memory does not call for
# would still change the step (BatchNormalization's statistics, an
# embedding's rows under Adam) and, on XLA, compile a second program.
CAUTIOUS_FIRST_SPLIT = 8
# The recent high of the memory held outside the step falls by this share
# of the limit per batch observed while the memory in use before a batch
# stays below it by more than that.
OUTSIDE_DECAY = 0.01
# The replay after an out-of-memory error is sized at this share of what
# the error says would have fitted.
FAILURE_MARGIN = 0.9
# Version of the dictionary written by `to_dict`.
STATE_VERSION = 2

# Why a batch cannot be split further (`Plan.cannot_split`).
CANNOT_SPLIT_BATCH_SIZE = "batch_size"
CANNOT_SPLIT_CAP = "max_micro_batches"
CANNOT_SPLIT_ALLOCATION = "allocation"

FIRST_SPLIT = "nothing measured yet: a cautious first split"
FIRST_WHOLE = (
    "nothing measured yet: the layer outputs leave room for the whole batch "
    "many times over"
)
SMALLER = (
    "a smaller micro-batch, to tell memory that grows with it from memory "
    "that does not"
)
HELD = "held"

_MIB = 1024 * 1024


class DeciderConfig(NamedTuple):
    """Settings of the decider; build it with `make_config`.

    Attributes:
        threshold: Usage (peak / limit) never planned at or above; in
            reacting mode, the peak usage at which `k` goes up.
        release: Reacting mode: predicted usage at half the count below
            which `k` may halve.
        cooldown: Reacting mode: batches the prediction must stay below
            `release`, and the least number of batches between two changes,
            before `k` halves.
        growth: A plan's work is at most this many times the largest work
            that ran (when the prediction is above half the target).
        first_split: Micro-batches of the first batch, before any reading,
            or `None`: `CAUTIOUS_FIRST_SPLIT`, or the whole batch where
            its layer outputs leave room many times over.
        min_micro_batches: The smallest `k` decided.
        max_micro_batches: The largest `k` decided, or `None`.
        predictive: Plan each batch before it runs (`True`) or react to
            each batch's peak after it ran (`False`).
    """

    threshold: float = 0.9
    release: float = 0.7
    cooldown: int = 20
    growth: float = 2.0
    first_split: Optional[int] = None
    min_micro_batches: int = 1
    max_micro_batches: Optional[int] = None
    predictive: bool = True


class Batch(NamedTuple):
    """A batch about to run, as `plan` needs it.

    Attributes:
        batch_size: Samples in the batch (of one replica).
        sample_size: Elements of one sample's inputs (> 0).
        in_use_bytes: Memory in use right before the batch, or `None`.
        limit_bytes: The device memory limit in bytes.
    """

    batch_size: int
    sample_size: float
    in_use_bytes: Optional[float]
    limit_bytes: float


class Reading(NamedTuple):
    """A batch that ran, as `observe` needs it.

    Attributes:
        batch_size: Samples in the batch (of one replica).
        micro_batches: The count it ran with.
        sample_size: Elements of one sample's inputs.
        before_bytes: Memory in use right before the batch, or `None`
            (then the step's demand is its whole peak).
        peak_bytes: The batch's measured peak, or `None` when unknown.
        limit_bytes: The device memory limit in bytes.
        after_bytes: Memory in use right after the batch, or `None`: what
            came into use while the step ran and stayed (an input
            pipeline's buffer filled during it) was there for its peak
            most likely.
    """

    batch_size: int
    micro_batches: int
    sample_size: float
    before_bytes: Optional[float]
    peak_bytes: Optional[float]
    limit_bytes: float
    after_bytes: Optional[float] = None

    @property
    def work(self):
        """The micro-batch's samples times the sample size."""
        return -(-self.batch_size // self.micro_batches) * self.sample_size


class Failure(NamedTuple):
    """A batch that ran out of memory, as `fail` needs it.

    What the error says is `None` where unknown.

    Attributes:
        batch_size: Samples in the batch (of one replica).
        micro_batches: The count that failed.
        sample_size: Elements of one sample's inputs.
        before_bytes: Memory in use right before the batch, or `None`.
        limit_bytes: The device memory limit in bytes.
        in_use_bytes: Memory in use when the allocation failed.
        allocation_bytes: The size of the allocation that failed.
        allocation_shape: Its shape, a tuple of ints.
        largest_free_bytes: The largest free block when it failed.
    """

    batch_size: int
    micro_batches: int
    sample_size: float
    before_bytes: Optional[float]
    limit_bytes: float
    in_use_bytes: Optional[float] = None
    allocation_bytes: Optional[float] = None
    allocation_shape: Optional[Tuple[int, ...]] = None
    largest_free_bytes: Optional[float] = None

    @property
    def micro_batch_size(self):
        """Samples in the micro-batch that failed."""
        return -(-self.batch_size // self.micro_batches)


class Plan(NamedTuple):
    """The decider's answer for a batch.

    Attributes:
        micro_batches: The count to run the batch with.
        previous_micro_batches: The count in force before.
        predicted_usage: The predicted peak usage (in use plus the step's
            demand, over the limit) at that count, or `None`.
        reason: Why, in words (`"predicted peak 88% of 600 MiB under
            target 90%"`).
        cannot_split: Set by `fail` and `fail_evaluation` when the batch
            cannot be split further (the caller raises or climbs a rung):
            `CANNOT_SPLIT_BATCH_SIZE` (one sample per micro-batch failed),
            `CANNOT_SPLIT_CAP` (`max_micro_batches` is reached) or
            `CANNOT_SPLIT_ALLOCATION` (the failed allocation does not
            shrink with the micro-batch). `None` otherwise.
    """

    micro_batches: int
    previous_micro_batches: int
    predicted_usage: Optional[float]
    reason: str
    cannot_split: Optional[str] = None

    @property
    def changed(self):
        """Whether the plan changes the micro-batch count."""
        return self.micro_batches != self.previous_micro_batches


class DeciderState(NamedTuple):
    """What the decider has learned; start it with `init`.

    Attributes:
        micro_batches: The count in force (the last one planned or decided).
        readings: `(work, demand_bytes)` of batches that ran, the highest
            demand per work, sorted by work (at most `MAX_READINGS`).
        failures: `(work, demand_bytes)` of micro-batches that ran out of
            memory: the demand each proved, at least (at most
            `MAX_FAILURES`, sorted by work).
        fixed_bytes: The step's own memory that does not shrink with the
            micro-batch (a floor for the model's `fixed`).
        sample_bytes: The bytes of one sample's layer outputs (from the
            model's static shapes; 0 when unknown): before any reading, the
            first split keeps `FIRST_SPLIT_ACTIVATIONS` times that per
            sample within the memory free.
        outside_bytes: The recent high of the memory in use before a batch,
            falling by `OUTSIDE_DECAY` of the limit per batch observed with
            less than that in use before it (within that band it holds, so
            the bytes the memory in use moves by from batch to batch do not
            change the state).
        failed_allocation: `(shape, micro_batch_size)` of the last failed
            allocation, or `None`.
        shapes: `((batch_size, sample_size), k)` the count each recent
            batch shape ran with (at most `MAX_SHAPES`).
        batches_since_change: Reacting mode: batches since `k` changed.
        calm_batches: Reacting mode: consecutive batches predicted below
            `release` at half the count.
        oom_count: Training batches replayed after an out-of-memory error.
        eval_micro_batches: The count validation batches are sliced into.
        eval_oom_count: Validation batches that ran out of memory.
        peaks: `(work, peak_bytes, before_bytes, after_bytes)` of batches
            that ran: the highest peak measured at each work of `readings`,
            the most memory in use before a batch of that work, or recently
            held outside the step (`outside_bytes`) then, and the most in
            use right after one (at least `before_bytes`): the evidence
            that a count fits.
        inherited: The works of `readings` measured by an earlier process
            (`inherit`), until this process measures one of them.
        outside_inherited: Whether `outside_bytes` is an earlier process's
            (`inherit`), until this process observes its first batch.
    """

    micro_batches: int
    readings: Tuple[Tuple[float, float], ...]
    failures: Tuple[Tuple[float, float], ...]
    fixed_bytes: float
    sample_bytes: float
    outside_bytes: float
    failed_allocation: Optional[Tuple[Tuple[int, ...], int]]
    shapes: Tuple[Tuple[Tuple[int, float], int], ...]
    batches_since_change: int
    calm_batches: int
    oom_count: int
    eval_micro_batches: int
    eval_oom_count: int
    peaks: Tuple[Tuple[float, float, float, float], ...] = ()
    inherited: Tuple[float, ...] = ()
    outside_inherited: bool = False


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def validate_micro_batches(micro_batches):
    """Checks a micro-batch count and returns it.

    Shared by every backend's training core and by the callbacks.

    Args:
        micro_batches: The number of micro-batches, an `int` >= 1.

    Returns:
        `micro_batches` as a Python `int` (a count is a trace-time
        constant and a cache key).

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    >>> validate_micro_batches(4)
    4
    """
    if not _is_int(micro_batches) or micro_batches < 1:
        raise ValueError(
            "`micro_batches` must be an integer >= 1. "
            f"Received: micro_batches={micro_batches!r}"
        )
    return int(micro_batches)


def make_config(
    threshold=0.9,
    release=None,
    cooldown=20,
    growth=2.0,
    first_split=None,
    min_micro_batches=1,
    max_micro_batches=None,
    predictive=True,
):
    """Validates the decider's settings and returns a `DeciderConfig`.

    Args:
        threshold: Usage (peak / limit) never planned at or above, in
            (0, 1]. Defaults to `0.9`.
        release: Reacting mode: predicted usage at half the count below
            which the count may halve, in (0, 1] and below `threshold`.
            Defaults to `None`, meaning `threshold - 0.2` but never less
            than `threshold / 2`.
        cooldown: Reacting mode: batches below `release` before the count
            halves, an integer >= 0. Defaults to `20`.
        growth: The most a plan's work may exceed the largest work that
            ran, a number > 1. Defaults to `2.0`.
        first_split: Micro-batches of the first batch when nothing is
            known, an integer >= 1, or `None`: a cautious 8
            (`CAUTIOUS_FIRST_SPLIT`), or 1 where the memory free holds the
            whole batch's layer outputs 32 times over (8 times the 4 a
            micro-batch is taken to need). Defaults to `None`.
        min_micro_batches: The smallest count, an integer >= 1. Defaults
            to `1`.
        max_micro_batches: The largest count, an integer >=
            `min_micro_batches`, or `None`. Defaults to `None`.
        predictive: Plan before each batch (`True`) or react after it
            (`False`). Defaults to `True`.

    Returns:
        A `DeciderConfig`.

    Raises:
        ValueError: If an argument is out of range or of the wrong type
            (booleans are not numbers here).

    Example:

    >>> config = make_config(threshold=0.8)
    >>> config.threshold, config.release
    (0.8, 0.6)
    """
    if not _is_real(threshold) or not 0 < threshold <= 1:
        raise ValueError(
            f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}"
        )
    threshold = float(threshold)
    if release is None:
        release = round(max(threshold - 0.2, threshold / 2), 12)
    elif not _is_real(release) or not 0 < release <= 1:
        raise ValueError(f"`release` must be in (0, 1]. Received: release={release!r}")
    elif not release < threshold:
        raise ValueError(
            "`release` must be smaller than `threshold`. "
            f"Received: release={release!r}, threshold={threshold!r}"
        )
    if not _is_int(cooldown) or cooldown < 0:
        raise ValueError(
            f"`cooldown` must be an integer >= 0. Received: cooldown={cooldown!r}"
        )
    if not _is_real(growth) or not growth > 1:
        raise ValueError(f"`growth` must be a number > 1. Received: growth={growth!r}")
    for name, value in (
        ("first_split", first_split),
        ("min_micro_batches", min_micro_batches),
    ):
        if name == "first_split" and value is None:
            continue
        if not _is_int(value) or value < 1:
            allowed = " or None" if name == "first_split" else ""
            raise ValueError(
                f"`{name}` must be an integer >= 1{allowed}. Received: {name}={value!r}"
            )
    if max_micro_batches is not None and (
        not _is_int(max_micro_batches) or max_micro_batches < 1
    ):
        raise ValueError(
            "`max_micro_batches` must be None or an integer >= 1. "
            f"Received: max_micro_batches={max_micro_batches!r}"
        )
    if max_micro_batches is not None and min_micro_batches > max_micro_batches:
        raise ValueError(
            "`min_micro_batches` must not exceed `max_micro_batches`. "
            f"Received: min_micro_batches={min_micro_batches!r}, "
            f"max_micro_batches={max_micro_batches!r}"
        )
    if not isinstance(predictive, bool):
        raise ValueError(
            f"`predictive` must be True or False. Received: predictive={predictive!r}"
        )
    return DeciderConfig(
        threshold=threshold,
        release=float(release),
        cooldown=int(cooldown),
        growth=float(growth),
        first_split=None if first_split is None else int(first_split),
        min_micro_batches=int(min_micro_batches),
        max_micro_batches=None if max_micro_batches is None else int(max_micro_batches),
        predictive=predictive,
    )


def init(config, micro_batches=None, fixed_bytes=0, sample_bytes=0):
    """Returns a decider state that knows nothing yet.

    Args:
        config: A `DeciderConfig`.
        micro_batches: The count to start with, an integer >= 1. Defaults
            to `None`: `config.first_split` (or `CAUTIOUS_FIRST_SPLIT`)
            when planning, else `1`.
        fixed_bytes: The step's own memory that does not shrink with the
            micro-batch (the gradients' bytes), >= 0. Defaults to `0`.
        sample_bytes: The bytes of one sample's layer outputs, >= 0 (0:
            unknown). Defaults to `0`.

    Returns:
        A `DeciderState`.

    Raises:
        ValueError: If an argument is out of range.

    Example:

    >>> init(make_config(predictive=False)).micro_batches
    1
    """
    if micro_batches is None:
        micro_batches = (
            (config.first_split or CAUTIOUS_FIRST_SPLIT) if config.predictive else 1
        )
    if not _is_int(micro_batches) or micro_batches < 1:
        raise ValueError(
            "`micro_batches` must be an integer >= 1. "
            f"Received: micro_batches={micro_batches!r}"
        )
    for name, value in (("fixed_bytes", fixed_bytes), ("sample_bytes", sample_bytes)):
        if not _is_real(value) or not value >= 0:
            raise ValueError(f"`{name}` must be a number >= 0. Received: {name}={value!r}")
    return DeciderState(
        micro_batches=int(micro_batches),
        readings=(),
        failures=(),
        fixed_bytes=float(fixed_bytes),
        sample_bytes=float(sample_bytes),
        outside_bytes=0.0,
        failed_allocation=None,
        shapes=(),
        batches_since_change=0,
        calm_batches=0,
        oom_count=0,
        eval_micro_batches=1,
        eval_oom_count=0,
    )


# The memory model.


def _fit(state):
    """`(fixed, slope)` of `demand = fixed + slope * work`, or `None`.

    The slope from the largest work measured to the largest one at most
    half of it (a demand that grows faster with larger micro-batches is
    then not under-predicted above them), raised to lie on or above every
    reading; with one reading (or readings that do not rise),
    everything above `fixed_bytes` grows with the work. With failures only,
    `fixed_bytes` (at most the smallest demand a failure proved) and no
    slope: the failures' lines (`predict_demand`) do the bounding. `None`
    when nothing is known.
    """
    readings = state.readings
    if not readings:
        if not state.failures:
            return None
        return min(state.fixed_bytes, min(d for _, d in state.failures)), 0.0
    floor = state.fixed_bytes
    largest_work, largest_demand = readings[-1]
    slope = None
    if len(readings) >= 2:
        # The slope near the top, where plans extrapolate: from the largest
        # work to the largest one at most half of it (far enough apart
        # that the allocator's rounding does not swing it), else the
        # smallest.
        partner_work, partner_demand = readings[0]
        for work, demand in readings[:-1]:
            if work <= largest_work / 2:
                partner_work, partner_demand = work, demand
        rise = (largest_demand - partner_demand) / (largest_work - partner_work)
        if rise > 0 and largest_demand - rise * largest_work >= 0:
            slope = rise
    if slope is None:
        fixed = min(floor, largest_demand)
        slope = (largest_demand - fixed) / largest_work
    fixed = max(demand - slope * work for work, demand in readings)
    return max(fixed, 0.0), slope


def predict_demand(state, work):
    """Predicts the step's own peak demand, in bytes, at a micro-batch work.

    The model's line, and no lower than any failure record proves: for a
    work at or above a failed one, the line from the model's `fixed`
    through that failure.

    Args:
        state: A `DeciderState`.
        work: Micro-batch samples times the sample size.

    Returns:
        The predicted demand in bytes, or `None` before any reading or
        failure.

    Example:

    >>> state = init(make_config())._replace(readings=((10.0, 300.0),))
    >>> predict_demand(state, 20.0)
    600.0
    """
    fitted = _fit(state)
    if fitted is None:
        return None
    fixed, slope = fitted
    demand = min(fixed + slope * work, _between_readings(state.readings, work))
    for failed_work, proved in state.failures:
        demand = max(demand, fixed + (proved - fixed) * work / failed_work)
    return demand


def _between_readings(readings, work):
    """The demand at a work between two measured ones, or `math.inf`.

    The chord between the readings on either side, and no less than the
    highest reading at a smaller work. The line lies on or above every
    reading, so a small micro-batch whose demand is high for its size (a
    workspace, a block the allocator rounds up) lifts it over the whole
    range; between two readings near the top the chord is what they show.
    Above the largest work measured, or below the smallest, `math.inf`:
    there the line, which bounds every reading, predicts alone.
    """
    if len(readings) < 2 or not readings[0][0] <= work <= readings[-1][0]:
        return math.inf
    for low, low_demand, high, high_demand, floor in _chords(readings):
        if work <= high:
            chord = low_demand + (high_demand - low_demand) * (work - low) / (high - low)
            return max(chord, floor)
    return math.inf  # not reached: `work` is within the readings


def _largest_work_between_readings(readings, budget):
    """The largest measured-range work whose demand `_between_readings`
    puts under `budget` bytes, or 0 when none is."""
    if len(readings) < 2 or readings[0][1] > budget:
        return 0.0
    allowed = readings[0][0]
    for low, low_demand, high, high_demand, floor in _chords(readings):
        if floor > budget:
            break
        if high_demand <= budget:
            allowed = high
            continue
        # The chord crosses the budget inside this interval.
        allowed = low + (high - low) * (budget - low_demand) / (high_demand - low_demand)
        allowed = max(allowed, low)
        break
    return allowed


def _chords(readings):
    """`(low, low_demand, high, high_demand, floor)` for each pair of
    neighbouring readings, `floor` the highest demand measured at or below
    `low`: the pieces `_between_readings` predicts from."""
    floor = 0.0
    for (low, low_demand), (high, high_demand) in zip(readings, readings[1:]):
        floor = max(floor, low_demand)
        yield low, low_demand, high, high_demand, floor


def _largest_work(config, state, budget):
    """The largest work whose predicted demand stays under `budget` bytes.

    Also not beyond `config.growth` times the largest work measured unless
    the prediction is far under the budget. `math.inf` when nothing bounds
    it, 0 when nothing fits.
    """
    if budget <= 0:
        return 0.0
    fixed, slope = _fit(state) or (state.fixed_bytes, 0.0)
    room = budget - fixed
    if room <= 0:
        # The line fits nothing; between two readings the chord may.
        room = 0.0
        allowed = 0.0
    else:
        allowed = room / slope if slope > 0 else math.inf
    if state.readings and allowed < state.readings[-1][0]:
        # Between two readings the chord may allow more than the line.
        allowed = max(allowed, _largest_work_between_readings(state.readings, budget))
    if allowed <= 0:
        return 0.0
    for failed_work, proved in state.failures:
        failure_slope = (proved - fixed) / failed_work
        if failure_slope > 0:
            allowed = min(allowed, room / failure_slope)
    if state.readings:
        measured = state.readings[-1][0]
        grown = config.growth * measured
        if allowed > grown and fixed + slope * grown > 0.5 * budget:
            allowed = grown
    return allowed


def _bounds(config, batch_size):
    cap = config.max_micro_batches
    high = batch_size if cap is None else min(cap, batch_size)
    return min(config.min_micro_batches, high), high


def _count_for(config, state, batch_size, sample_size, budget):
    """The smallest count whose micro-batch fits `budget`, and whether any does."""
    low, high = _bounds(config, batch_size)
    allowed = _largest_work(config, state, budget)
    largest_micro = min(batch_size, int(allowed / sample_size)) if allowed < math.inf else batch_size
    if largest_micro < 1:
        return high, False
    return max(low, min(high, -(-batch_size // largest_micro))), True


def _count_near_floor(config, state, batch, in_use_bytes):
    """The count for a batch that no count fits under the target.

    The smallest count whose predicted demand is within `HYSTERESIS` of
    the limit of the lowest (one sample per micro-batch) and whose peak is
    predicted under the midpoint of the target and the limit: where the
    demand hardly falls with the micro-batch (memory that does not shrink
    with it), one sample per micro-batch would slow every step for what it
    cannot save.
    """
    batch_size, sample_size, limit = batch.batch_size, batch.sample_size, batch.limit_bytes
    _, high = _bounds(config, batch_size)
    lowest = predict_demand(state, -(-batch_size // high) * sample_size)
    if lowest is None:
        return high
    budget = min(
        lowest + HYSTERESIS * limit,
        _ceiling(config) * limit - in_use_bytes,
    )
    return _count_for(config, state, batch_size, sample_size, budget)[0]


def _remembered(state, shape):
    for known, k in state.shapes:
        if known == shape:
            return k
    return None


def _remember(state, shape, k):
    if _remembered(state, shape) == k and state.micro_batches == k:
        return state
    shapes = tuple(entry for entry in state.shapes if entry[0] != shape)
    shapes = ((shape, k),) + shapes[: MAX_SHAPES - 1]
    return state._replace(micro_batches=k, shapes=shapes)


def in_use_planned_for(state, in_use_bytes):
    """The memory in use a plan is made for, in bytes, or `None`.

    The memory in use right before the batch or the recent high held
    outside the step (`state.outside_bytes`: an input pipeline's buffers
    that came and went can come back while the step runs), whichever is
    higher. `plan` depends on the batch's `in_use_bytes` only through this
    value, so a caller may reuse a plan for the same state and batch shape
    while it is unchanged: the bytes the memory in use moves by from batch
    to batch under that high then cost no planning.

    Args:
        state: A `DeciderState`.
        in_use_bytes: Memory in use right before the batch, or `None`.

    Returns:
        A float, or `None` when `in_use_bytes` is `None`.

    Example:

    >>> state = init(make_config())._replace(outside_bytes=300.0)
    >>> in_use_planned_for(state, 250.0), in_use_planned_for(state, 320.0)
    (300.0, 320.0)
    """
    if in_use_bytes is None:
        return None
    return max(float(in_use_bytes), state.outside_bytes)


def in_use_beside_replay(before_bytes, after_bytes):
    """The memory in use a replay runs beside, in bytes, or `None`.

    The higher of the reading before the failed batch and the reading right
    after its error (the failed attempt's tensors freed): an input
    pipeline's prefetch thread may have filled a buffer while the batch ran,
    which the reading before it missed.

    Args:
        before_bytes: Memory in use before the batch, or `None`.
        after_bytes: Memory in use right after the error, or `None`.

    Returns:
        A float, or `None` when both are `None`.

    Example:

    >>> in_use_beside_replay(96.0, 128.0), in_use_beside_replay(128.0, None)
    (128.0, 128.0)
    """
    if after_bytes is None:
        return before_bytes
    if before_bytes is None:
        return float(after_bytes)
    return float(max(before_bytes, after_bytes))


def _usage(state, batch, k):
    demand = predict_demand(state, -(-batch.batch_size // k) * batch.sample_size)
    if demand is None:
        return None
    return ((batch.in_use_bytes or 0.0) + demand) / batch.limit_bytes


def plan(config, state, batch):
    """Plans the micro-batch count of a batch about to run.

    Planning: the smallest count whose predicted demand fits the memory
    free now under `threshold`; a count lower than the one this batch shape
    ran with only when it fits with `HYSTERESIS` to spare. Reacting: the
    count in force. Cheap enough for every batch.

    Args:
        config: A `DeciderConfig`.
        state: The current `DeciderState`.
        batch: A `Batch`.

    Returns:
        A `(Plan, DeciderState)` pair; the state is `state` itself when
        nothing changed.

    Example:

    >>> config = make_config()
    >>> state = init(config)._replace(readings=((50.0, 300.0), (100.0, 500.0)))
    >>> batch = Batch(408, 1.0, in_use_bytes=40.0, limit_bytes=1000.0)
    >>> plan(config, state, batch)[0].micro_batches
    3
    """
    batch_size = batch.batch_size
    previous = state.micro_batches
    low, high = _bounds(config, batch_size)
    if not config.predictive:
        k = max(low, min(high, previous))
        return Plan(k, previous, None, HELD), state
    shape = (batch_size, batch.sample_size)
    planned_in_use = in_use_planned_for(state, batch.in_use_bytes)
    if not state.readings and not state.failures:
        remembered = _remembered(state, shape)
        k = remembered or config.first_split or CAUTIOUS_FIRST_SPLIT
        reason = FIRST_SPLIT
        if state.sample_bytes and planned_in_use is not None:
            # The layer outputs of a micro-batch, several times over, in
            # the memory free now.
            budget = (
                config.threshold * batch.limit_bytes
                - planned_in_use
                - state.fixed_bytes
            )
            per_sample = FIRST_SPLIT_ACTIVATIONS * state.sample_bytes
            largest = int(budget / per_sample) if budget > 0 else 0
            if (
                not remembered
                and config.first_split is None
                and largest >= CAUTIOUS_FIRST_SPLIT * batch_size
            ):
                k, reason = 1, FIRST_WHOLE
            k = max(k, -(-batch_size // max(largest, 1)))
        k = max(low, min(high, k))
        return Plan(k, previous, None, reason), _remember(state, shape, k)
    # Unknown memory in use: at least what was held outside the step.
    in_use = state.outside_bytes if planned_in_use is None else planned_in_use
    target = config.threshold * batch.limit_bytes
    k, fits = _count_for(config, state, batch_size, batch.sample_size, target - in_use)
    if not fits:
        k = _count_near_floor(config, state, batch, in_use)
    ran_with = _remembered(state, shape)
    if len(state.readings) == 1 and not state.failures:
        # One reading cannot tell memory that grows with the micro-batch
        # from memory that does not; when the bound it gives allows no
        # growth, measure a micro-batch half as large (safe) to find out.
        measured = int(state.readings[0][0] / batch.sample_size)
        probe = max(low, min(high, -(-batch_size // max(1, measured // 2))))
        # Not where the whole batch's step took at most half the room above
        # the memory in use: a step twice as large would still fit, so
        # splitting it only to measure would change the step for nothing it
        # needs. The room, not the target, because what a batch can add is
        # the step's; weights and a frozen base held beside it do not grow.
        roomy = (
            k == 1
            and measured >= batch_size
            and state.readings[0][1] <= 0.5 * (target - in_use)
        )
        if -(-batch_size // k) <= measured and probe > k and not roomy:
            usage = _usage(state, batch._replace(in_use_bytes=in_use), probe)
            return Plan(probe, previous, usage, SMALLER), _remember(state, shape, probe)
    if ran_with is not None and k < ran_with:
        # Lower only to a count that fits with the band to spare, or one
        # count down that its own peak decides (`_lower_measured`).
        calm, _ = _count_for(
            config,
            state,
            batch_size,
            batch.sample_size,
            target - HYSTERESIS * batch.limit_bytes - in_use,
        )
        lowered = min(ran_with, max(k, calm))
        step_down = max(k, ran_with - 1)
        if step_down < lowered and _lower_measured(
            config, state, batch._replace(in_use_bytes=in_use), step_down
        ):
            lowered = step_down
        k = lowered
    measured = None
    if ran_with is not None and k > ran_with:
        measured = _measured_usage(
            config, state, batch._replace(in_use_bytes=planned_in_use), ran_with, k
        )
        if measured is not None:
            k = ran_with
    predicted = measured or _usage(state, batch._replace(in_use_bytes=in_use), k)
    if measured is not None:
        why = HELD if k == previous else (
            f"measured peak {_percent(measured)} of {_mib(batch.limit_bytes)} "
            f"at this count, with the memory in use now: under "
            f"{_percent(_ceiling(config))}"
        )
    elif not fits and k == high:
        why = "one sample per micro-batch: still over the target"
    elif not fits:
        why = (
            f"over the target at any count; more than {micro_batches_text(k)} "
            f"would save under {_percent(HYSTERESIS)} of {_mib(batch.limit_bytes)}"
        )
    elif k == previous:
        why = HELD  # the words only for a change: this runs every batch
    else:
        why = (
            f"predicted peak {_percent(predicted)} of {_mib(batch.limit_bytes)} "
            f"under target {_percent(config.threshold)}"
        )
    return Plan(k, previous, predicted, why), _remember(state, shape, k)


def _lower_measured(config, state, batch, k):
    """Whether the lower count `k` may be taken with `TRIAL_BAND` to spare.

    Where `k`'s micro-batch never ran here (no peak, no failure at or below
    its work) and is predicted to peak `TRIAL_BAND` of the limit under the
    target, one batch tries it, and its peak decides from then on: taken
    again only while its highest peak, with however much more memory is in
    use now than before it, stays under the target. A count whose batches
    once peaked past the target needs the whole band again, so a usage
    that hovers at the target cannot make the count flap.
    """
    entry, failed = _peak_at(state, batch, k)
    if failed:
        return False
    limit = batch.limit_bytes
    target = config.threshold * limit
    if entry is None:
        usage = _usage(state, batch, k)
        return usage is not None and usage * limit < target - TRIAL_BAND * limit
    _, peak, before, _ = entry
    return peak + max(0.0, batch.in_use_bytes - before) < target


def _peak_at(state, batch, k):
    """`(entry, failed)` for `k` micro-batches of this batch: the entry of
    `state.peaks` measured at that micro-batch's work (or `None`), and
    whether a micro-batch of at most that work ran out of memory."""
    work = -(-batch.batch_size // k) * batch.sample_size
    entry = next((entry for entry in state.peaks if entry[0] == work), None)
    return entry, any(failed <= work for failed, _ in state.failures)


def _measured_usage(config, state, batch, k, raised_to):
    """The usage measured at `k` for this batch, when it says `k` fits; else `None`.

    The highest peak of the batches that ran at the same work, plus however
    much more memory is in use now than before any of them, when that peak
    was under the target, the sum stays under the midpoint of the target
    and the limit, and no failure happened at or below the work. The sum
    overstates: a pipeline's buffer that is full before this batch filled
    during the measured one, so its peak already held most of it; a count
    that ran just under the target is not raised for a buffer more.

    A peak past the target by under `HELD_OVERSHOOT` of the limit counts
    too where raising `k` to `raised_to` is predicted to save under
    `HYSTERESIS` of it: where the demand hardly shrinks with the
    micro-batch, a batch that peaked a little higher than the others would
    otherwise split every later one further for next to nothing. Further
    past it the count is raised: where a step's peak moves by a tenth of
    the limit from batch to batch, the target's margin is what keeps it
    under the limit.

    Where the sum passes the midpoint but stays under the limit, the memory
    in use right after the measured batches counts as held by their peak:
    the usage is the peak plus however much more is in use now than after
    them, under the midpoint. Memory that came into use during a step and
    stayed was most likely there at its peak; were it not, the step would
    still peak at the sum, under the limit.
    """
    if batch.in_use_bytes is None:
        return None
    entry, failed = _peak_at(state, batch, k)
    if entry is None or failed:
        return None
    _, peak, before, after = entry
    limit = batch.limit_bytes
    target = config.threshold * limit
    if peak >= target and (
        peak >= target + HELD_OVERSHOOT * limit
        or not _raise_saves_little(state, batch, k, raised_to)
    ):
        return None
    ceiling = _ceiling(config)
    usage = (peak + max(0.0, batch.in_use_bytes - before)) / limit
    if usage < ceiling:
        return usage
    if usage >= 1.0:
        return None
    held = (peak + max(0.0, batch.in_use_bytes - after)) / limit
    return held if held < ceiling else None


def _raise_saves_little(state, batch, k, raised_to):
    """Whether `raised_to` micro-batches instead of `k` are predicted to
    save under `HYSTERESIS` of the limit."""
    at_k, raised = _usage(state, batch, k), _usage(state, batch, raised_to)
    return at_k is not None and raised is not None and at_k - raised < HYSTERESIS


def _ceiling(config):
    """The midpoint of the target and the limit: the most a held count, or
    a count where none fits the target, is let reach."""
    return (1.0 + config.threshold) / 2


def _splitting_can_make_room(failure, before):
    """Whether a smaller micro-batch could make room for an allocation
    that does not itself shrink with it.

    A smaller micro-batch frees what the step held when the allocation
    failed (the memory in use then, less what was in use before the step).
    When that and the largest free block together are not as large as the
    allocation, no count helps; where the error does not say, neither is
    assumed.
    """
    if failure.in_use_bytes is None or failure.largest_free_bytes is None:
        return False
    held = failure.in_use_bytes - before
    return held + failure.largest_free_bytes >= (failure.allocation_bytes or math.inf)


def _record_peak(state, readings, work, peak, before, after):
    """`state.peaks` with this batch's peak and memory in use around it."""
    peaks = state.peaks
    old = next((entry for entry in peaks if entry[0] == work), None)
    after = max(before, after)
    if old is not None and old[1] >= peak and old[2] >= before and old[3] >= after:
        return peaks
    if old is not None:
        peak, before, after = max(peak, old[1]), max(before, old[2]), max(after, old[3])
    works = {w for w, _ in readings}
    kept = [entry for entry in peaks if entry[0] != work and entry[0] in works]
    return tuple(sorted(kept + [(work, peak, before, after)]))


def accumulation_fits(in_use_bytes, accumulator_bytes, limit_bytes):
    """Whether a step that accumulates gradients can fit at any micro-batch.

    The accumulators hold one buffer per trainable weight beside what is in
    use, and a micro-batch's own gradients take as much again, however few
    its samples: where the limit leaves less than that, no split helps.

    Args:
        in_use_bytes: Memory in use before the step (weights, optimizer
            state, inputs), or `None` when unknown.
        accumulator_bytes: The accumulators' bytes (the trainable weights').
        limit_bytes: The memory limit.

    Returns:
        A bool; `True` while a figure is unknown.

    Example:

    >>> accumulation_fits(97.0, 32.0, 150.0), accumulation_fits(50.0, 32.0, 150.0)
    (False, True)
    """
    if in_use_bytes is None or not accumulator_bytes or not limit_bytes:
        return True
    return limit_bytes - in_use_bytes - accumulator_bytes >= accumulator_bytes


def one_sample_fits(config, state, batch):
    """Whether a micro-batch of one sample may fit the memory free now.

    Args:
        config: A `DeciderConfig`.
        state: A `DeciderState`.
        batch: The `Batch` about to run.

    Returns:
        A bool; `True` while nothing says otherwise.

    Example:

    >>> state = init(make_config())._replace(failures=((4.0, 900.0),))
    >>> one_sample_fits(make_config(), state, Batch(8, 4.0, 0.0, 1000.0))
    False
    """
    demand = predict_demand(state, batch.sample_size)
    if demand is None:
        return True
    budget = config.threshold * batch.limit_bytes - (batch.in_use_bytes or 0.0)
    return demand < budget


def _record(entries, work, demand, keep):
    """`entries` with the higher of `demand` and the old one at `work`."""
    table = dict(entries)
    table[work] = max(demand, table.get(work, 0.0))
    while len(table) > keep:
        works = sorted(table)
        # Keep the extremes (they fix the slope best).
        middle = works[1:-1] or works
        del table[min(middle, key=lambda w: abs(w - work) or math.inf)]
    return tuple(sorted(table.items()))


def observe(config, state, reading):
    """Records the peak of a batch that ran; in reacting mode, decides.

    Args:
        config: A `DeciderConfig`.
        state: The current `DeciderState`.
        reading: A `Reading` of the batch.

    Returns:
        A `(Plan, DeciderState)` pair: the count for the next batch (in
        planning mode the count in force) and the new state, `state`
        itself when the reading teaches nothing new.

    Example:

    >>> config = make_config(predictive=False, cooldown=1)
    >>> state = init(config, micro_batches=2)
    >>> decided, state = observe(config, state, Reading(64, 2, 1.0, 0.0, 950.0, 1000.0))
    >>> decided.micro_batches, decided.reason
    (4, 'peak 95% of 0 MiB >= threshold 90%')
    """
    k = state.micro_batches
    peak = reading.peak_bytes
    if peak is None or not reading.limit_bytes:
        if config.predictive:
            return Plan(k, k, None, "usage unknown"), state
        return Plan(k, k, None, "usage unknown"), state._replace(
            batches_since_change=state.batches_since_change + 1, calm_batches=0
        )
    before = reading.before_bytes or 0.0
    work = reading.work
    demand = max(float(peak) - before, 1.0)
    if state.outside_inherited:
        # What the earlier process held outside its steps, this one need not.
        state = state._replace(outside_bytes=before, outside_inherited=False)
    if work in state.inherited:
        state = _recalibrated(state, work, demand)
    readings = state.readings
    if next((d for w, d in readings if w == work), -1.0) < demand:
        readings = _record(readings, work, demand, MAX_READINGS)
    # The memory outside the step that came and went in recent batches was
    # there around this one too (a pipeline's buffer fills before one step
    # or during it): the peak was measured with that much in use.
    peaks = _record_peak(
        state,
        readings,
        work,
        float(peak),
        max(before, state.outside_bytes),
        float(reading.after_bytes or 0.0),
    )
    outside = state.outside_bytes
    decay = OUTSIDE_DECAY * reading.limit_bytes
    if before > outside:
        outside = before
    elif before < outside - decay:
        outside = max(outside - decay, 0.0)
    if (
        readings is state.readings
        and peaks is state.peaks
        and outside == state.outside_bytes
    ):
        updated = state
    else:
        updated = state._replace(readings=readings, peaks=peaks, outside_bytes=outside)
    if config.predictive:
        return Plan(k, k, None, HELD), updated
    return _react(config, updated, reading)


def _recalibrated(state, work, demand):
    """`state` with the readings an earlier process measured moved by what
    this process measured at one of their works.

    `demand` replaces the earlier reading at `work`, and every other
    earlier reading, and the peak beside it, moves by the same difference:
    a process that explored several counts before it settled leaves more
    memory in use and its steps take more (the allocator's blocks, compiled
    steps of every count tried) than a process that starts at the settled
    count, and planning the next run from its readings alone would hold
    that run to what the exploration allowed. Once: after it the readings
    are this process's, each the highest measured at its work.
    """
    earlier = dict(state.readings).get(work)
    if earlier is None:  # no longer kept: this process's readings took its place
        return state._replace(inherited=tuple(w for w in state.inherited if w != work))
    shift = demand - earlier
    inherited = state.inherited
    readings = tuple(
        (w, demand if w == work else max(d + shift, 1.0) if w in inherited else d)
        for w, d in state.readings
    )
    peaks = tuple(
        (w, max(peak + shift, before), before, after) if w in inherited else (w, peak, before, after)
        for w, peak, before, after in state.peaks
        if w != work
    )
    return state._replace(readings=readings, peaks=peaks, inherited=())


def _react(config, state, reading):
    """Reacting mode: the next batch's count from this batch's peak."""
    k = state.micro_batches
    since = state.batches_since_change + 1
    usage = reading.peak_bytes / reading.limit_bytes
    limit = reading.limit_bytes
    low, high = _bounds(config, reading.batch_size)
    peak = f"peak {_percent(usage)} of {_mib(limit)}"
    if usage >= config.threshold:
        above = f"{peak} >= threshold {_percent(config.threshold)}"
        target = max(k, min(high, 2 * k))
        if target == k:
            return (
                Plan(k, k, usage, f"{above}, but no more micro-batches are possible"),
                state._replace(batches_since_change=since, calm_batches=0),
            )
        return (
            Plan(target, k, usage, above),
            state._replace(micro_batches=target, batches_since_change=0, calm_batches=0),
        )
    below = f"{peak} < threshold {_percent(config.threshold)}"
    target = max(low, min(k // 2, high))
    if k <= low or target >= k:
        return Plan(k, k, usage, below), state._replace(
            batches_since_change=since, calm_batches=0
        )
    half = reading._replace(micro_batches=target)
    demand = predict_demand(state, half.work)
    predicted = None if demand is None else ((reading.before_bytes or 0.0) + demand) / limit
    if predicted is None or not predicted < config.release:
        why = (
            f"usage at {micro_batches_text(target)} cannot be predicted"
            if predicted is None
            else f"predicted {_percent(predicted)} at {micro_batches_text(target)} "
            f">= release {_percent(config.release)}"
        )
        return Plan(k, k, usage, f"{below}; {why}"), state._replace(
            batches_since_change=since, calm_batches=0
        )
    calm = state.calm_batches + 1
    calm_text = (
        f"predicted {_percent(predicted)} at {micro_batches_text(target)} "
        f"< release {_percent(config.release)}"
    )
    if calm >= config.cooldown and since >= config.cooldown:
        return (
            Plan(target, k, usage, f"{calm_text} for {_batches(calm)}"),
            state._replace(micro_batches=target, batches_since_change=0, calm_batches=0),
        )
    return Plan(k, k, usage, f"{calm_text} for {calm} of {_batches(config.cooldown)}"), state._replace(
        batches_since_change=since, calm_batches=calm
    )


def _scales_with(shape, micro_batch_size):
    """Whether an allocation of `shape` holds the micro-batch in a dimension."""
    return bool(shape) and micro_batch_size in shape


def fail(config, state, failure):
    """Sizes the replay of a batch that ran out of memory.

    The failure is recorded (plans stay under the demand it proved) and
    the batch's micro-batch shrinks strictly: to what the proved demand
    and, for an allocation that grows with the micro-batch, the largest
    free block say fits, with `FAILURE_MARGIN` to spare, and at most the
    failed micro-batch less one sample.

    Args:
        config: A `DeciderConfig`.
        state: The `DeciderState` in force when the error happened.
        failure: A `Failure`.

    Returns:
        A `(Plan, DeciderState)` pair. When the batch cannot be split
        further, the plan's `cannot_split` says why and its count is the
        failed one; the state records the failure all the same (a next run
        knows from it that one sample does not fit), without counting a
        replay.

    Example:

    >>> config = make_config()
    >>> failure = Failure(1024, 8, 1.0, before_bytes=500.0, limit_bytes=600.0)
    >>> decided, state = fail(config, init(config), failure)
    >>> decided.micro_batches > 8, state.oom_count
    (True, 1)
    """
    batch_size = failure.batch_size
    k = failure.micro_batches
    micro = failure.micro_batch_size
    limit = failure.limit_bytes
    counted = micro_batches_text(k)
    before = failure.before_bytes or 0.0
    proved = limit - before
    if failure.in_use_bytes is not None and failure.allocation_bytes:
        proved = max(proved, failure.in_use_bytes + failure.allocation_bytes - before)
    # The failed allocation is one of many: the micro-batch's layer outputs
    # (static shapes) bound the demand from below too.
    proved = max(proved, micro * state.sample_bytes)
    work = micro * failure.sample_size
    failures = _record(state.failures, work, max(proved, 1.0), MAX_FAILURES)
    shape = tuple(failure.allocation_shape) if failure.allocation_shape else None
    previous_allocation = state.failed_allocation
    recorded = state._replace(
        failures=failures,
        outside_bytes=max(state.outside_bytes, before),
        readings=tuple((w, d) for w, d in state.readings if w < work),
        peaks=tuple(entry for entry in state.peaks if entry[0] < work),
        failed_allocation=None if shape is None else (shape, micro),
        batches_since_change=0,
        calm_batches=0,
    )
    if micro <= 1:
        why = f"out of memory at {counted} of a batch of {_samples(batch_size)}"
        return Plan(k, k, None, why, CANNOT_SPLIT_BATCH_SIZE), recorded
    if (
        shape is not None
        and previous_allocation is not None
        and previous_allocation[0] == shape
        and previous_allocation[1] > micro
        and not _splitting_can_make_room(failure, before)
    ):
        why = (
            f"out of memory again allocating {list(shape)} at {micro} samples per "
            f"micro-batch, as at {previous_allocation[1]}: the allocation does not "
            "shrink with the micro-batch"
        )
        return Plan(k, k, None, why, CANNOT_SPLIT_ALLOCATION), recorded
    low, high = _bounds(config, batch_size)
    if k >= high:
        return (
            Plan(k, k, None, f"out of memory at the cap of {micro_batches_text(high)}", CANNOT_SPLIT_CAP),
            recorded,
        )
    # What the proved demand leaves, from the model's fixed part.
    budget = config.threshold * limit - before
    fixed = min(_fit(recorded)[0], proved)  # the failure was just recorded
    fraction = 0.5
    if proved > fixed:
        fraction = max(0.0, (budget - fixed) / (proved - fixed))
    if (
        failure.allocation_bytes
        and failure.largest_free_bytes is not None
        and failure.largest_free_bytes < failure.allocation_bytes
        and failure.in_use_bytes is not None
        and failure.in_use_bytes + failure.allocation_bytes <= limit
        and _scales_with(shape, micro)
    ):
        # The memory was there but not in one piece: the allocation, which
        # grows with the micro-batch, must fit the largest free block.
        fraction = min(fraction, failure.largest_free_bytes / failure.allocation_bytes)
    sized = int(micro * fraction * FAILURE_MARGIN)
    replay_micro = max(1, min(micro - 1, sized))
    new_k = max(k + 1, -(-batch_size // replay_micro))
    # The smallest count giving that micro-batch (fewer empty slots).
    new_k = max(low, min(high, -(-batch_size // -(-batch_size // new_k))))
    if -(-batch_size // new_k) >= micro:
        new_k = min(high, new_k + 1)
    return (
        Plan(new_k, k, None, f"out of memory at {counted} ({micro} per micro-batch)"),
        recorded._replace(micro_batches=new_k, oom_count=state.oom_count + 1),
    )


def fail_without_figures(config, state, batch_size, micro_batches):
    """Sizes a replay where nothing says how much memory the batch needed.

    A `MemGuardMixin` model trained without `MemoryGuard` has no limit, no
    reading and, on JAX and PyTorch, an error that names no usable figure:
    each replay halves the micro-batch (at least one more micro-batch), as
    `fail` does when the demand it proved leaves nothing to reason from.

    Args:
        config: A `DeciderConfig` (its `max_micro_batches` applies).
        state: The `DeciderState`.
        batch_size: Samples of the batch that failed.
        micro_batches: The count it failed at.

    Returns:
        A `(Plan, DeciderState)` pair; when no count helps, the plan's
        `cannot_split` says why and the state is unchanged.

    Example:

    >>> config = make_config()
    >>> decided, state = fail_without_figures(config, init(config), 16, 2)
    >>> decided.micro_batches, state.oom_count
    (4, 1)
    """
    k = micro_batches
    micro = -(-batch_size // k)
    low, high = _bounds(config, batch_size)
    counted = micro_batches_text(k)
    if micro <= 1:
        why = f"out of memory at {counted} of a batch of {_samples(batch_size)}"
        return Plan(k, k, None, why, CANNOT_SPLIT_BATCH_SIZE), state
    if k >= high:
        why = f"out of memory at the cap of {micro_batches_text(high)}"
        return Plan(k, k, None, why, CANNOT_SPLIT_CAP), state
    new_k = max(low, min(high, max(k + 1, -(-batch_size // (micro // 2)))))
    return (
        Plan(new_k, k, None, f"out of memory at {counted} ({micro} per micro-batch)"),
        state._replace(micro_batches=new_k, oom_count=state.oom_count + 1),
    )


def fail_evaluation(config, state, batch_size, micro_batches):
    """The slice count to go on evaluating a batch that ran out of memory.

    Validation keeps its own count (`eval_micro_batches`): an evaluation
    batch says nothing about a training step's memory. Each slice becomes
    at most half as large; the count stays for the next validations.

    Args:
        config: A `DeciderConfig` (its `max_micro_batches` applies).
        state: The `DeciderState`.
        batch_size: Samples of the validation batch that failed.
        micro_batches: The count it failed at.

    Returns:
        A `(Plan, DeciderState)` pair; when no slice count helps, the
        plan's `cannot_split` says why and the state is unchanged.

    Example:

    >>> decided, state = fail_evaluation(make_config(), init(make_config()), 6, 1)
    >>> decided.micro_batches, state.eval_oom_count
    (2, 1)
    """
    k = micro_batches
    micro = -(-batch_size // k)
    low, high = _bounds(config, batch_size)
    counted = micro_batches_text(k)
    if micro <= 1:
        return Plan(k, k, None, f"out of memory evaluating at {counted} of a batch of {_samples(batch_size)}", CANNOT_SPLIT_BATCH_SIZE), state
    if k >= high:
        return Plan(k, k, None, f"out of memory evaluating at the cap of {micro_batches_text(high)}", CANNOT_SPLIT_CAP), state
    new_k = min(high, -(-batch_size // (micro // 2)))
    return (
        Plan(new_k, k, None, f"out of memory evaluating at {counted}"),
        state._replace(eval_micro_batches=new_k, eval_oom_count=state.eval_oom_count + 1),
    )


# Words.


def micro_batches_text(count):
    """`count` micro-batches in words, for log lines and error messages.

    Example:

    >>> micro_batches_text(1), micro_batches_text(4)
    ('1 micro-batch', '4 micro-batches')
    """
    return f"{count} micro-batch" if count == 1 else f"{count} micro-batches"


def _batches(count):
    return f"{count} batch" if count == 1 else f"{count} batches"


def _samples(count):
    return f"{count} sample" if count == 1 else f"{count} samples"


def _percent(value):
    return f"{value:.0%}"


def _mib(value):
    return f"{value / _MIB:.0f} MiB"


# Persistence: one schema for the plan cache and `backup_dir`.


def to_dict(state):
    """A JSON-safe dictionary of `state`, readable by `from_dict`.

    Example:

    >>> to_dict(init(make_config()))["version"]
    2
    """
    allocation = state.failed_allocation
    return {
        "version": STATE_VERSION,
        "micro_batches": state.micro_batches,
        "readings": [list(entry) for entry in state.readings],
        "failures": [list(entry) for entry in state.failures],
        "fixed_bytes": state.fixed_bytes,
        "sample_bytes": state.sample_bytes,
        "outside_bytes": state.outside_bytes,
        "failed_allocation": None if allocation is None else [list(allocation[0]), allocation[1]],
        "shapes": [[list(shape), k] for shape, k in state.shapes],
        "batches_since_change": state.batches_since_change,
        "calm_batches": state.calm_batches,
        "oom_count": state.oom_count,
        "eval_micro_batches": state.eval_micro_batches,
        "eval_oom_count": state.eval_oom_count,
        "peaks": [list(entry) for entry in state.peaks],
    }


def inherit(state):
    """Marks the readings of a state an earlier process measured.

    A state read back from a plan cache or `backup_dir` holds another
    process's readings. This process's first reading at one of their works
    replaces that reading, and moves every other one it inherited by the
    same difference: what an earlier process left in use while it explored
    is not in use here. For the same reason the memory in use before this
    process's first batch replaces the recent high the earlier one held
    outside its steps (`outside_bytes`); until then plans keep it.

    Args:
        state: A `DeciderState`, from `from_dict`.

    Returns:
        The `DeciderState`, its readings marked as inherited.

    Example:

    >>> config = make_config()
    >>> state = init(config)._replace(readings=((10.0, 300.0), (20.0, 500.0)))
    >>> state = observe(config, inherit(state), Reading(10, 1, 1.0, 0.0, 260.0, 1000.0))[1]
    >>> state.readings
    ((10.0, 260.0), (20.0, 460.0))
    """
    return state._replace(
        inherited=tuple(w for w, _ in state.readings), outside_inherited=True
    )


def _pairs(data, name, limit):
    raw = data.get(name)
    if not isinstance(raw, list) or len(raw) > limit:
        raise ValueError(f"`{name}` must be a list of at most {limit}. Received: {name}={raw!r}")
    pairs = []
    for entry in raw:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not all(_is_real(v) and 0 < v < math.inf for v in entry)
        ):
            raise ValueError(
                f"Each entry of `{name}` must be a [work, bytes] pair of numbers > 0. "
                f"Received: {entry!r}"
            )
        pairs.append((float(entry[0]), float(entry[1])))
    return tuple(sorted(dict(pairs).items()))


def from_dict(data):
    """Rebuilds a `DeciderState` written by `to_dict`.

    Args:
        data: The dictionary (after a JSON round trip).

    Returns:
        A `DeciderState`.

    Raises:
        ValueError: If `data` is not such a dictionary.

    Example:

    >>> state = init(make_config(), fixed_bytes=5)
    >>> from_dict(to_dict(state)) == state
    True
    """
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise ValueError(
            f"Expected a decider state of version {STATE_VERSION}. Received: {data!r}"
        )
    counts = {}
    for name, low in (
        ("micro_batches", 1),
        ("batches_since_change", 0),
        ("calm_batches", 0),
        ("oom_count", 0),
        ("eval_micro_batches", 1),
        ("eval_oom_count", 0),
    ):
        value = data.get(name)
        if not _is_int(value) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
        counts[name] = int(value)
    sizes = {}
    for name in ("fixed_bytes", "sample_bytes", "outside_bytes"):
        value = data.get(name)
        if not _is_real(value) or not 0 <= value < math.inf:
            raise ValueError(f"`{name}` must be a number >= 0. Received: {name}={value!r}")
        sizes[name] = float(value)
    allocation = data.get("failed_allocation")
    if allocation is not None:
        if (
            not isinstance(allocation, list)
            or len(allocation) != 2
            or not isinstance(allocation[0], list)
            or not all(_is_int(d) for d in allocation[0])
            or not _is_int(allocation[1])
        ):
            raise ValueError(
                "`failed_allocation` must be None or [shape, micro_batch_size]. "
                f"Received: failed_allocation={allocation!r}"
            )
        allocation = (tuple(int(d) for d in allocation[0]), int(allocation[1]))
    shapes = data.get("shapes")
    if not isinstance(shapes, list) or len(shapes) > MAX_SHAPES:
        raise ValueError(f"`shapes` must be a list. Received: shapes={shapes!r}")
    remembered = []
    for entry in shapes:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], list)
            or len(entry[0]) != 2
            or not _is_int(entry[0][0])
            or not _is_real(entry[0][1])
            or not _is_int(entry[1])
            or entry[1] < 1
        ):
            raise ValueError(
                "Each entry of `shapes` must be [[batch_size, sample_size], k]. "
                f"Received: {entry!r}"
            )
        remembered.append(((int(entry[0][0]), float(entry[0][1])), int(entry[1])))
    peaks = data.get("peaks", [])  # absent from files written before it
    if not isinstance(peaks, list) or len(peaks) > MAX_READINGS or not all(
        isinstance(entry, list)
        and len(entry) in (3, 4)  # files written before `after` hold three
        and all(_is_real(v) and 0 <= v < math.inf for v in entry)
        for entry in peaks
    ):
        raise ValueError(
            f"`peaks` must be a list of at most {MAX_READINGS} [work, peak, before, "
            f"after] entries of numbers >= 0. Received: peaks={peaks!r}"
        )
    return DeciderState(
        # An entry without `after` counts as much in use after as before.
        peaks=tuple(
            sorted(
                tuple(float(v) for v in (entry if len(entry) == 4 else entry + entry[2:]))
                for entry in peaks
            )
        ),
        readings=_pairs(data, "readings", MAX_READINGS),
        failures=_pairs(data, "failures", MAX_FAILURES),
        failed_allocation=allocation,
        shapes=tuple(remembered),
        **sizes,
        **counts,
    )
