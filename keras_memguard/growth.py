"""Is memory growing? The trend test, the growth rate and the projection.

Memory that keeps growing (device memory or the host's resident memory
rising every epoch, across repeated `fit` calls, with models built in a
loop or `predict` called in a loop) is told from memory that merely moves
by one pure test over *floors*: the memory in use between steps (at the
start of a batch, or after a call), one number per sample. The module
imports neither TensorFlow nor Keras nor numpy: pure functions over
immutable `NamedTuple`s, in the style of `keras_memguard.decider`, so it is
tested with scripted numbers and used alike by `MemoryMonitor` (per epoch
and per call) and `keras_memguard.check_growth` (per call of a function).

**The floor.** A sample's floor is what is in use when no step runs:
weights, optimizer slots, whatever an input pipeline or a callback holds.
What a step allocates and frees never shows in it. Per block of
consecutive samples only the lowest is kept (`block_floors`): buffers that
fill and drain (prefetching, a validation pass) lift single samples, never
the lowest of a block, and the test sees a bounded number of points.

**The test.** The Mann-Kendall test: the sign of every pairwise difference
of later minus earlier floors, summed, against its distribution when the
order of the floors is random (ties accounted for, a normal approximation
with continuity correction). It is rank-based, so it asks only whether
later floors tend to be higher, not whether they lie on a line: a floor
rising by allocator-sized steps, at an uneven pace, or with a few samples
far off (a reading during a garbage collection, a buffer that did not
drain) is judged as well as a smooth one, and its one-sided false-alarm
rate on a steady floor is the chosen `alpha` whatever the distribution of
the noise. Its rate is the Theil-Sen slope, the median of the pairwise
slopes: up to nearly a third of the points can be anything without moving
it, where a least-squares slope follows a single outlier.

A rank test alone says "growing" for any consistent rise, however small,
and for a single step up (a second traced function, a buffer allocated
once in the second epoch): every pair across the step is positive. So
growth also needs a rate worth telling (`min_rate_bytes` per unit), a rise
over the window worth telling (`min_rise_bytes`), enough points
(`min_points`) spanning enough units (`min_span`), and a rise in both
halves of the window (each half's Theil-Sen slope at least `HALF_SHARE`
of the whole window's, and at least half the rate worth telling): a leak
keeps rising, a step rises once, and the resident memory's slow creep
after a step (allocator arenas settling) is not a second rise.

**Warm-up.** What happens once is not growth: the first epoch of a `fit`
(the first step's allocations, an input pipeline filling its buffers,
the first validation pass) gives no floors to the in-fit series; across
calls, the floor *after* the first call is the first point, so the first
call's own set-up (traces, a model's weights) is its baseline, and
growth in the next calls shows from the next point on.

**The projection.** At the Theil-Sen rate, from the last floor, the unit
(epoch or call) at which the floor reaches the limit (`assess`'s
`limit_bytes`); `None` when the limit is unknown.

Example:

>>> config = make_config()
>>> xs = (1.0, 2.0, 3.0, 4.0)
>>> mib = 1024 * 1024
>>> ys = (100 * mib, 102 * mib, 104 * mib, 106 * mib)
>>> result = assess(config, "cpu0", "epoch", xs, ys, limit_bytes=120 * mib)
>>> result.growing, result.slope_bytes / mib, result.reaches_limit_at
(True, 2.0, 11)
"""

import math
from typing import NamedTuple, Optional, Tuple

__all__ = [
    "Evidence",
    "GrowthConfig",
    "GrowthResult",
    "Series",
    "Trend",
    "add_points",
    "assess",
    "block_floors",
    "evidence_text",
    "host_config",
    "make_config",
    "new_series",
    "trend",
    "warning_text",
]

_MIB = 1024 * 1024

# Blocks per epoch the in-fit floors are reduced to (`block_floors`).
BLOCKS_PER_UNIT = 8
# Each half of the window must rise at least this share of the whole
# window's rate (and at least half of `min_rate_bytes`): a leak rises alike
# in both, a single step in one, with at most a creep in the other.
HALF_SHARE = 0.1


class GrowthConfig(NamedTuple):
    """Settings of the growth test; build it with `make_config`.

    Attributes:
        alpha: The one-sided significance level of the Mann-Kendall test.
        min_points: Fewest floors tested.
        min_span: Fewest units (epochs or calls) the floors must span.
        min_rate_bytes: Smallest growth per unit called growth.
        min_rise_bytes: Smallest rise over the tested window called growth.
        max_points: Most floors kept per series; beyond, neighbours merge
            (the lower floor kept), so the test's cost stays bounded.
        min_rate_fraction: Smallest growth per unit that counts, as a
            share of the last floor (`0`: none asked).
    """

    alpha: float
    min_points: int
    min_span: float
    min_rate_bytes: float
    min_rise_bytes: float
    max_points: int
    min_rate_fraction: float = 0.0


def host_config(strict=True):
    """The settings for a process's resident memory (RSS), stricter than a device's.

    Resident memory creeps while a process settles over its first `fit`,
    `evaluate` and `predict` calls (allocator arenas of new threads,
    Python's heaps, caches filled once), and jumps at times: so a rate of
    1 MiB per unit and a rise of 3 MiB are asked of it, and with `strict` a
    significance of 0.01 and a rate of 0.25% of the resident memory per
    unit (a larger process creeps by more while it settles: a steady
    keras.applications fit's resident memory rose by more than 1 MiB an
    epoch, about 0.1% of it).

    Args:
        strict: Whether to ask the 0.01 significance (for `MemoryMonitor`,
            which watches every call of a long process); `check_growth`
            collects garbage before each reading and runs a handful of
            calls, so it keeps 0.05. Defaults to `True`.

    Returns:
        A `GrowthConfig`.

    Example:

    >>> host_config().min_rate_bytes / _MIB
    1.0
    """
    return make_config(
        alpha=0.01 if strict else 0.05,
        min_rate_bytes=1.0 * _MIB,
        min_rise_bytes=3.0 * _MIB,
        min_rate_fraction=0.0025 if strict else 0.0,
    )


def make_config(
    alpha=0.05,
    min_points=4,
    min_span=2.0,
    min_rate_bytes=0.5 * _MIB,
    min_rise_bytes=1.0 * _MIB,
    max_points=96,
    min_rate_fraction=0.0,
):
    """Returns a `GrowthConfig`, checked.

    Args:
        alpha: One-sided significance level of the trend test, in (0, 1).
            Defaults to `0.05`.
        min_points: Fewest floors tested, at least 3. Defaults to `4`.
        min_span: Fewest units (epochs or calls) between the first and the
            last floor tested. Defaults to `2.0`.
        min_rate_bytes: Smallest growth per unit that counts, in bytes.
            Defaults to 0.5 MiB.
        min_rise_bytes: Smallest rise over the window that counts, in bytes.
            Defaults to 1 MiB.
        max_points: Most floors kept per series, at least 8. Defaults to
            `96`.
        min_rate_fraction: Smallest growth per unit that counts, as a share
            of the last floor, in [0, 1). Defaults to `0.0`.

    Returns:
        A `GrowthConfig`.

    Raises:
        ValueError: If a value is out of range (the message names it).

    Example:

    >>> make_config(alpha=0.01).alpha
    0.01
    """
    if not 0 < alpha < 1:
        raise ValueError(f"`alpha` must be in (0, 1). Received: alpha={alpha!r}")
    if int(min_points) != min_points or min_points < 3:
        raise ValueError(
            f"`min_points` must be an integer of at least 3. Received: min_points={min_points!r}"
        )
    if int(max_points) != max_points or max_points < 8:
        raise ValueError(
            f"`max_points` must be an integer of at least 8. Received: max_points={max_points!r}"
        )
    for name, value in (
        ("min_span", min_span),
        ("min_rate_bytes", min_rate_bytes),
        ("min_rise_bytes", min_rise_bytes),
        ("min_rate_fraction", min_rate_fraction),
    ):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(
                f"`{name}` must be a finite number of at least 0. Received: {name}={value!r}"
            )
    if min_rate_fraction >= 1:
        raise ValueError(
            "`min_rate_fraction` must be below 1. "
            f"Received: min_rate_fraction={min_rate_fraction!r}"
        )
    return GrowthConfig(
        float(alpha),
        int(min_points),
        float(min_span),
        float(min_rate_bytes),
        float(min_rise_bytes),
        int(max_points),
        float(min_rate_fraction),
    )


class Trend(NamedTuple):
    """The trend of one series of floors.

    Attributes:
        points: Number of floors tested.
        span: Units between the first and the last.
        score: The Mann-Kendall statistic S (positive: rising).
        p_value: One-sided p-value of S against no trend.
        slope: Theil-Sen slope, bytes per unit.
        first_half_slope: Theil-Sen slope of the earlier half of the floors.
        second_half_slope: Theil-Sen slope of the later half.
        last_floor: The fitted floor at the last point (Theil-Sen line
            through the median), bytes.
    """

    points: int
    span: float
    score: int
    p_value: float
    slope: float
    first_half_slope: float
    second_half_slope: float
    last_floor: float


def _sign(value):
    return (value > 0) - (value < 0)


def _median(values):
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return 0.0
    middle = n // 2
    if n % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2.0


def _theil_sen(xs, ys):
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return _median(slopes)


def trend(xs, ys):
    """Tests floors for a rising trend (Mann-Kendall, Theil-Sen).

    Args:
        xs: Positions in units (epochs or calls), increasing.
        ys: The floors in bytes, one per position.

    Returns:
        A `Trend`, or `None` with fewer than 3 floors.

    Example:

    >>> t = trend((0, 1, 2, 3), (5, 6, 7, 8))
    >>> t.score, t.slope, round(t.p_value, 3)
    (6, 1.0, 0.045)
    """
    n = len(ys)
    if n < 3 or len(xs) != n:
        return None
    score = 0
    for i in range(n - 1):
        yi = ys[i]
        for j in range(i + 1, n):
            score += _sign(ys[j] - yi)
    ties = {}
    for y in ys:
        ties[y] = ties.get(y, 0) + 1
    variance = (
        n * (n - 1) * (2 * n + 5)
        - sum(t * (t - 1) * (2 * t + 5) for t in ties.values() if t > 1)
    ) / 18.0
    if variance <= 0 or score <= 0:
        p_value = 1.0 if score <= 0 else 0.0
    else:
        z = (score - 1) / math.sqrt(variance)
        p_value = 0.5 * math.erfc(z / math.sqrt(2.0))
    slope = _theil_sen(xs, ys)
    half = n // 2
    first = _theil_sen(xs[: n - half], ys[: n - half])
    second = _theil_sen(xs[half:], ys[half:])
    intercept = _median([y - slope * x for x, y in zip(xs, ys)])
    return Trend(
        n,
        float(xs[-1] - xs[0]),
        score,
        p_value,
        slope,
        first,
        second,
        intercept + slope * xs[-1],
    )


class Evidence(NamedTuple):
    """One fact gathered when growth was found, with its figure.

    Attributes:
        key: What was measured (`"keras_models"`, `"keras_variables"`,
            `"traced_functions"`, `"callback_outputs"`, `"cached_datasets"`,
            `"outside_step"`, ...).
        now: The figure now (a count, or MiB).
        before: The same figure at the start, or `None` when not taken.
        text: The fact in words, with its figures.
    """

    key: str
    now: Optional[float]
    before: Optional[float]
    text: str


class GrowthResult(NamedTuple):
    """Whether one memory series grows, how fast, and until when.

    Returned by `keras_memguard.check_growth` (one per device and one for
    the host) and kept by `MemoryMonitor` (`MemoryMonitor.growth`).

    Attributes:
        name: The series: a device (`"gpu0"`, `"cpu0"`) or `"host"` (the
            process's resident memory).
        unit: What one step of the series is: `"epoch"` or `"call"`.
        growing: Whether the floor keeps rising (see the module's test).
        slope_bytes: Growth per unit (Theil-Sen), bytes; `None` when not
            tested.
        p_value: The trend test's one-sided p-value; `None` when not tested.
        points: Floors tested.
        floor_bytes: The latest fitted floor, bytes, or `None`.
        limit_bytes: The memory limit projected to, or `None`.
        reaches_limit_at: The unit (epoch or call index, 0-based, as the
            series counts them) at which the floor reaches the limit at
            this rate, or `None` (no growth, no limit).
        evidence: A tuple of `Evidence`, gathered when growth was found.

    Example:

    ```python
    result = keras_memguard.check_growth(lambda: model.predict(x), repeats=6)
    for series in result:
        print(series.name, series.growing, series.slope_bytes)
    ```
    """

    name: str
    unit: str
    growing: bool
    slope_bytes: Optional[float]
    p_value: Optional[float]
    points: int
    floor_bytes: Optional[float]
    limit_bytes: Optional[float]
    reaches_limit_at: Optional[int]
    evidence: Tuple[Evidence, ...] = ()

    @property
    def slope_mib(self):
        """Growth per unit in MiB, or `None`."""
        return None if self.slope_bytes is None else self.slope_bytes / _MIB


def assess(config, name, unit, xs, ys, limit_bytes=None, evidence=()):
    """Decides whether one series of floors grows, and projects it.

    Args:
        config: A `GrowthConfig`.
        name: The series' name (`"gpu0"`, `"host"`).
        unit: `"epoch"` or `"call"`.
        xs: Positions in units, increasing.
        ys: Floors in bytes (`None` entries are dropped).
        limit_bytes: The limit the floor is projected to, or `None`.
            Defaults to `None`.
        evidence: `Evidence` to carry. Defaults to `()`.

    Returns:
        A `GrowthResult`.
    """
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    xs = tuple(x for x, _ in pairs)
    ys = tuple(y for _, y in pairs)
    result = trend(xs, ys)
    if result is None:
        return GrowthResult(
            name, unit, False, None, None, len(ys), None, limit_bytes, None, tuple(evidence)
        )
    growing = (
        result.points >= config.min_points
        and result.span >= config.min_span
        and result.p_value < config.alpha
        and result.slope >= config.min_rate_bytes
        and result.slope >= config.min_rate_fraction * result.last_floor
        and result.slope * result.span >= config.min_rise_bytes
        and min(result.first_half_slope, result.second_half_slope)
        >= max(0.5 * config.min_rate_bytes, HALF_SHARE * result.slope)
    )
    reaches = None
    if growing and limit_bytes:
        remaining = limit_bytes - result.last_floor
        reaches = int(xs[-1] + max(0.0, math.ceil(remaining / result.slope)))
    return GrowthResult(
        name,
        unit,
        growing,
        result.slope,
        result.p_value,
        result.points,
        result.last_floor,
        limit_bytes,
        reaches,
        tuple(evidence),
    )


def block_floors(values, start, blocks=BLOCKS_PER_UNIT):
    """Reduces one unit's samples to the lowest of each block.

    Args:
        values: The unit's floors in sample order (`None` entries skipped).
        start: The unit's position (epoch index).
        blocks: Blocks the unit is cut into. Defaults to `BLOCKS_PER_UNIT`.

    Returns:
        `(xs, ys)`: each block's position (`start` plus the block's middle
        as a fraction of the unit) and lowest floor; empty blocks give none.

    Example:

    >>> block_floors([5, 3, 4, 9, 8, 7, 6, 6], 1, blocks=2)
    ((1.25, 1.75), (3, 6))
    """
    n = len(values)
    xs, ys = [], []
    if n == 0:
        return (), ()
    blocks = max(1, min(blocks, n))
    for b in range(blocks):
        lo, hi = b * n // blocks, (b + 1) * n // blocks
        low = None
        for value in values[lo:hi]:
            if value is not None and (low is None or value < low):
                low = value
        if low is not None:
            xs.append(start + (b + 0.5) / blocks)
            ys.append(low)
    return tuple(xs), tuple(ys)


class Series(NamedTuple):
    """The floors of one series so far; build it with `new_series`.

    Attributes:
        xs: Positions in units.
        ys: Floors in bytes.
        said: Whether growth of this series was already reported.
    """

    xs: Tuple[float, ...]
    ys: Tuple[float, ...]
    said: bool = False


def new_series():
    """Returns an empty `Series`."""
    return Series((), ())


def add_points(config, series, xs, ys):
    """Appends floors; beyond `max_points`, neighbours merge pairwise.

    Merging keeps the lower floor of each pair at the earlier position, so
    the series keeps its whole history at half the resolution.

    Args:
        config: A `GrowthConfig`.
        series: A `Series`.
        xs: New positions.
        ys: New floors (`None` entries dropped).

    Returns:
        The new `Series`.
    """
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    all_xs = series.xs + tuple(x for x, _ in pairs)
    all_ys = series.ys + tuple(y for _, y in pairs)
    while len(all_ys) > config.max_points:
        merged_x, merged_y = [], []
        for i in range(0, len(all_ys) - 1, 2):
            merged_x.append(all_xs[i])
            merged_y.append(min(all_ys[i], all_ys[i + 1]))
        if len(all_ys) % 2:
            merged_x.append(all_xs[-1])
            merged_y.append(all_ys[-1])
        all_xs, all_ys = tuple(merged_x), tuple(merged_y)
    return series._replace(xs=all_xs, ys=all_ys)


def _mib(value):
    return f"{value / _MIB:.1f}"


def evidence_text(evidence):
    """The facts as one text: each `Evidence.text`, separated by "; "."""
    return "; ".join(item.text for item in evidence)


def warning_text(result, where=""):
    """The one warning told when a series grows.

    Args:
        result: A growing `GrowthResult`.
        where: What is growing across, e.g. `"fit"` or `"predict calls"`.
            Defaults to `""`.

    Returns:
        The message: the rate, the projection and the evidence.

    Example:

    >>> r = GrowthResult("cpu0", "epoch", True, 2 * _MIB, 0.01, 24,
    ...                  100 * _MIB, 120 * _MIB, 11)
    >>> warning_text(r, "fit")
    'Memory keeps growing: cpu0 floor (memory in use between steps) rises 2.0 MiB per epoch over 24 samples in fit (p=0.010), now 100.0 MiB; at this rate it reaches the limit of 120.0 MiB at epoch 11.'
    """
    what = (
        "host resident memory (RSS)"
        if result.name == "host"
        else f"{result.name} floor (memory in use between steps)"
    )
    text = (
        f"Memory keeps growing: {what} rises {_mib(result.slope_bytes)} MiB "
        f"per {result.unit} over {result.points} samples"
        + (f" in {where}" if where else "")
        + f" (p={result.p_value:.3f}), now {_mib(result.floor_bytes)} MiB"
    )
    if result.reaches_limit_at is not None:
        text += (
            f"; at this rate it reaches the limit of {_mib(result.limit_bytes)} "
            f"MiB at {result.unit} {result.reaches_limit_at}."
        )
    elif result.limit_bytes:
        text += "."
    else:
        text += "; the limit is unknown, so no projection."
    if result.evidence:
        text += " Evidence: " + evidence_text(result.evidence) + "."
    return text
