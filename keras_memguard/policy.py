"""When to split batches into more or fewer micro-batches: a pure policy.

The policy turns one number per batch, the batch's peak memory usage (peak
bytes over the device limit, measured while training with `k` micro-batches),
into a decision about `k` for the next batch. It imports neither TensorFlow
nor Keras nor numpy: small pure functions over immutable `NamedTuple` state,
in the style of optax, so it can be unit-tested with scripted sequences and
run identically on every replica.

The rule:

- **Threshold (go up at once).** When a batch's peak reaches `threshold`,
  `k` doubles for the next batch (capped by `max_micro_batches`). No cooldown
  applies on the way up: preventing an out-of-memory error is worth more
  than anything else, since each one costs seconds of allocator retries and
  a replayed batch.
- **Release and hysteresis (go down slowly).** `k` is halved only when the
  usage *predicted* at `k / 2` is below `release`, a level well under
  `threshold`. The gap between the two levels is the hysteresis band: a
  usage hovering around either level cannot make `k` flap.
- **Cooldown.** The prediction must stay below `release` for `cooldown`
  consecutive batches, and at least `cooldown` batches must have passed
  since the last change, before `k` is halved.
- **Out of memory.** An out-of-memory error at `k` doubles `k` (see
  `on_out_of_memory`) and is remembered: the policy never decreases to `k`
  or fewer micro-batches again in this state.

The memory model behind the prediction is `usage(k) = fixed + activations / k`:
weights, optimizer slots and gradients do not shrink with smaller
micro-batches, activations do. The state keeps the most recent reading for
each `k` seen (a handful of entries). With readings at two different `k`
(the current one and the nearest other) the two unknowns are solved for;
with only the current `k` known, the prediction is conservative and assumes
everything scales (`usage(k / 2) = 2 * usage(k)`); a reading taken directly
at the target `k` is a floor for the prediction. A `k / 2` that read
high keeps vetoing the decrease while its reading lasts; readings at other
counts expire after `READING_LIFETIME_COOLDOWNS` cooldowns at the same `k`
(200 batches by default), so a passing spike does not keep the run split
for good. Out-of-memory marks never expire.

Example:

>>> config = make_config(threshold=0.9, cooldown=2)
>>> state = init_state()
>>> decision, state = decide(config, state, 0.95)
>>> decision.action, decision.micro_batches, decision.reason
('increase', 2, 'peak 95% >= threshold 90%')
"""

import math
import numbers
from typing import NamedTuple, Optional, Tuple

__all__ = [
    "CANNOT_SPLIT_BATCH_SIZE",
    "CANNOT_SPLIT_CAP",
    "Decision",
    "EvalState",
    "PolicyConfig",
    "PolicyState",
    "clamp_micro_batches",
    "decide",
    "init_eval_state",
    "init_state",
    "make_config",
    "micro_batches_text",
    "on_eval_out_of_memory",
    "on_out_of_memory",
    "predict_usage",
    "state_from_dict",
    "state_to_dict",
]

# The most (k, usage) readings kept in `PolicyState.observations`. With k
# moving by factors of two, eight entries span k = 1 .. 128.
MAX_OBSERVATIONS = 8
# After this many cooldowns at one count, readings at other counts expire.
READING_LIFETIME_COOLDOWNS = 10

# Version of the dictionary written by `state_to_dict`.
STATE_FORMAT_VERSION = 1

# How an out-of-memory reading (infinite usage) is spelled in JSON.
_INF_JSON = "inf"

_ACTIONS = ("hold", "increase", "decrease")

# Why an out-of-memory decision cannot split further (`Decision.cannot_split`).
CANNOT_SPLIT_BATCH_SIZE = "batch_size"
CANNOT_SPLIT_CAP = "max_micro_batches"
_INF = math.inf


class PolicyConfig(NamedTuple):
    """Settings of the micro-batching policy; build it with `make_config`.

    Attributes:
        threshold: Peak usage (fraction of the device limit) at or above which
            `micro_batches` doubles. In (0, 1].
        release: Predicted usage at half the micro-batches below which `k` may
            be halved. In (0, 1] and smaller than `threshold`.
        cooldown: Batches the prediction must stay below `release` before `k`
            is halved, which is also the minimum number of batches between two
            changes made by usage. Increases never wait.
        max_micro_batches: Upper limit for `k`, or `None` for no limit.
        min_micro_batches: Lower limit for `k` (never halved below it).
    """

    threshold: float = 0.9
    release: float = 0.7
    cooldown: int = 20
    max_micro_batches: Optional[int] = None
    min_micro_batches: int = 1


class PolicyState(NamedTuple):
    """What the policy remembers between batches; start it with `init_state`.

    Attributes:
        micro_batches: The micro-batch count `k` in force.
        batches_since_change: Batches decided since `k` last changed.
        calm_batches: Consecutive batches whose predicted usage at the next
            smaller `k` was below `release`.
        observations: Tuple of `(k, usage)` pairs sorted by `k`, the most
            recent reading for each `k` seen (at most `MAX_OBSERVATIONS`).
            A usage of `math.inf` records an out-of-memory error at that `k`.
        oom_count: Out-of-memory errors seen so far.
    """

    micro_batches: int
    batches_since_change: int
    calm_batches: int
    observations: Tuple[Tuple[int, float], ...]
    oom_count: int


class EvalState(NamedTuple):
    """What the evaluation rule remembers; start it with `init_eval_state`.

    Evaluation has its own count: an evaluation batch says nothing about a
    training step's memory, and the reverse.

    Attributes:
        micro_batches: The number of slices each evaluation batch is
            evaluated in.
        oom_count: Out-of-memory errors seen while evaluating.
    """

    micro_batches: int
    oom_count: int


class Decision(NamedTuple):
    """The outcome of one policy step.

    Attributes:
        micro_batches: `k` to use from the next batch on.
        previous_micro_batches: `k` in force when the decision was made.
        action: `"hold"`, `"increase"` or `"decrease"`.
        usage: The usage the decision was based on, or `None` when unknown
            (and for out-of-memory decisions).
        reason: Human-readable explanation, e.g.
            `"peak 93% >= threshold 90%"`.
        cannot_split: For out-of-memory decisions, why the batch cannot be
            split further (the caller must raise):
            `CANNOT_SPLIT_BATCH_SIZE` when micro-batches are already single
            samples, `CANNOT_SPLIT_CAP` when `max_micro_batches` is reached.
            `None` otherwise.
    """

    micro_batches: int
    previous_micro_batches: int
    action: str
    usage: Optional[float]
    reason: str
    cannot_split: Optional[str] = None

    @property
    def changed(self):
        """Whether the decision changes the micro-batch count."""
        return self.micro_batches != self.previous_micro_batches


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def make_config(
    threshold=0.9,
    release=None,
    cooldown=20,
    max_micro_batches=None,
    min_micro_batches=1,
):
    """Validates the policy settings and returns a `PolicyConfig`.

    Args:
        threshold: Peak usage (fraction of the device limit) at or above which
            the micro-batch count doubles. In (0, 1]. Defaults to `0.9`.
        release: Predicted usage at half the micro-batches below which the
            count may be halved. In (0, 1] and smaller than `threshold`.
            Defaults to `None`, meaning `threshold - 0.2`, but never less than
            `threshold / 2` (so `0.7` for `0.9`, `0.05` for `0.1`).
        cooldown: Batches the prediction must stay below `release` before the
            count is halved; also the minimum number of batches between two
            changes made by usage. An integer >= 0. Defaults to `20`.
        max_micro_batches: Upper limit for the micro-batch count, an integer
            >= 1, or `None` for no limit. Defaults to `None`.
        min_micro_batches: Lower limit for the micro-batch count, an integer
            >= 1 and not above `max_micro_batches`. Defaults to `1`.

    Returns:
        A `PolicyConfig`.

    Raises:
        ValueError: If an argument is out of range or of the wrong type
            (booleans are not numbers here).

    Example:

    >>> config = make_config(threshold=0.8)
    >>> config.threshold, config.release, config.cooldown
    (0.8, 0.6, 20)
    """
    if not _is_real(threshold) or not 0 < threshold <= 1:
        raise ValueError(
            f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}"
        )
    threshold = float(threshold)
    if release is None:
        release = round(max(threshold - 0.2, threshold / 2), 12)
    elif not _is_real(release) or not 0 < release <= 1:
        raise ValueError(
            f"`release` must be in (0, 1]. Received: release={release!r}"
        )
    elif not release < threshold:
        raise ValueError(
            "`release` must be smaller than `threshold`. "
            f"Received: release={release!r}, threshold={threshold!r}"
        )
    if not _is_int(cooldown) or cooldown < 0:
        raise ValueError(
            "`cooldown` must be an integer >= 0. "
            f"Received: cooldown={cooldown!r}"
        )
    if max_micro_batches is not None and (
        not _is_int(max_micro_batches) or max_micro_batches < 1
    ):
        raise ValueError(
            "`max_micro_batches` must be None or an integer >= 1. "
            f"Received: max_micro_batches={max_micro_batches!r}"
        )
    if not _is_int(min_micro_batches) or min_micro_batches < 1:
        raise ValueError(
            "`min_micro_batches` must be an integer >= 1. "
            f"Received: min_micro_batches={min_micro_batches!r}"
        )
    if max_micro_batches is not None and min_micro_batches > max_micro_batches:
        raise ValueError(
            "`min_micro_batches` must not exceed `max_micro_batches`. "
            f"Received: min_micro_batches={min_micro_batches!r}, "
            f"max_micro_batches={max_micro_batches!r}"
        )
    return PolicyConfig(
        threshold=threshold,
        release=float(release),
        cooldown=int(cooldown),
        max_micro_batches=(
            None if max_micro_batches is None else int(max_micro_batches)
        ),
        min_micro_batches=int(min_micro_batches),
    )


def init_state(micro_batches=1):
    """Returns the policy state at the start of training.

    Args:
        micro_batches: The micro-batch count to start with, an integer >= 1.
            Defaults to `1`.

    Returns:
        A `PolicyState` with no readings and no out-of-memory errors.

    Raises:
        ValueError: If `micro_batches` is not an integer >= 1.

    Example:

    >>> state = init_state(4)
    >>> state.micro_batches, state.observations, state.oom_count
    (4, (), 0)
    """
    if not _is_int(micro_batches) or micro_batches < 1:
        raise ValueError(
            "`micro_batches` must be an integer >= 1. "
            f"Received: micro_batches={micro_batches!r}"
        )
    return PolicyState(
        micro_batches=int(micro_batches),
        batches_since_change=0,
        calm_batches=0,
        observations=(),
        oom_count=0,
    )


def init_eval_state(micro_batches=1, oom_count=0):
    """Returns the evaluation rule's state.

    Args:
        micro_batches: The slice count to start with, an integer >= 1.
            Defaults to `1`.
        oom_count: Out-of-memory errors already seen, an integer >= 0
            (when restoring). Defaults to `0`.

    Returns:
        An `EvalState`.

    Raises:
        ValueError: If an argument is out of range.

    Example:

    >>> init_eval_state()
    EvalState(micro_batches=1, oom_count=0)
    """
    if not _is_int(micro_batches) or micro_batches < 1:
        raise ValueError(
            "`micro_batches` must be an integer >= 1. "
            f"Received: micro_batches={micro_batches!r}"
        )
    if not _is_int(oom_count) or oom_count < 0:
        raise ValueError(
            "`oom_count` must be an integer >= 0. "
            f"Received: oom_count={oom_count!r}"
        )
    return EvalState(micro_batches=int(micro_batches), oom_count=int(oom_count))


def _check_batch_size(batch_size, name="batch_size"):
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
        raise ValueError(
            f"`{name}` must be None or an integer >= 1. "
            f"Received: {name}={batch_size!r}"
        )
    return None if batch_size is None else int(batch_size)


def _ratio(a, b):
    """Distance between two micro-batch counts, as a ratio >= 1."""
    return max(a, b) / min(a, b)


def _record(observations, micro_batches, usage):
    """Returns `observations` with `usage` recorded at `micro_batches`.

    Replaces the entry for `micro_batches` (an out-of-memory entry is never
    replaced by a finite reading); an out-of-memory entry drops the entries
    below it, which it makes irrelevant; the entry farthest from
    `micro_batches` goes when there are more than `MAX_OBSERVATIONS`.
    """
    entries = dict(observations)
    if entries.get(micro_batches) == _INF and usage != _INF:
        return observations
    entries[micro_batches] = usage
    if usage == _INF:
        entries = {k: u for k, u in entries.items() if k >= micro_batches}
    while len(entries) > MAX_OBSERVATIONS:
        finite = [k for k, u in entries.items() if u != _INF]
        del entries[max(finite, key=lambda k: _ratio(k, micro_batches))]
    return tuple(sorted(entries.items()))


def predict_usage(state, micro_batches):
    """Predicts the peak usage at another micro-batch count.

    Uses the model `usage(k) = fixed + activations / k`, fitted to the reading
    at the current count and the nearest other reading. With a single usable
    reading the prediction is the conservative bound of the model: the usage
    scales fully with `1 / k` toward fewer micro-batches and stays the same
    toward more. A reading taken directly at `micro_batches` is a floor for
    the prediction. At or below a count that ran out of memory, the
    prediction is `math.inf`.

    Args:
        state: A `PolicyState`.
        micro_batches: The micro-batch count to predict for.

    Returns:
        The predicted usage (a float >= 0, `math.inf` after an out-of-memory
        error at that count or above), or `None` when the state has no
        readings.

    Example:

    >>> state = init_state(2)._replace(observations=((2, 0.4),))
    >>> round(predict_usage(state, 1), 6)
    0.8
    """
    target = micro_batches
    finite = []
    current = None
    for k, usage in state.observations:
        if usage == _INF:
            if target <= k:
                return _INF
            continue
        finite.append((k, usage))
        if k == state.micro_batches:
            current = (k, usage)
    if not finite:
        return None
    anchor = current
    if anchor is None:
        anchor = min(finite, key=lambda o: (_ratio(o[0], target), o[0]))
    other = None
    for o in finite:
        if o[0] == anchor[0]:
            continue
        key = (_ratio(o[0], anchor[0]), _ratio(o[0], target))
        if other is None or key < other[0]:
            other = (key, o)
    k_a, u_a = anchor
    prediction = None
    if other is not None:
        k_o, u_o = other[1]
        activations = (u_a - u_o) / (1 / k_a - 1 / k_o)
        if activations > 0:
            fixed = u_a - activations / k_a
            prediction = max(0.0, fixed + activations / target)
    if prediction is None:
        # One usable reading, or readings that do not fall with k: assume the
        # worst case the model allows.
        prediction = u_a * k_a / target if target < k_a else u_a
    for k, usage in finite:
        if k == target:
            prediction = max(prediction, usage)
    return prediction


def _plural(count, word):
    return f"{count} {word}" if count == 1 else f"{count} {word}es"


def micro_batches_text(count):
    """`count` micro-batches in words, for log lines and error messages.

    Example:

    >>> micro_batches_text(1), micro_batches_text(4)
    ('1 micro-batch', '4 micro-batches')
    """
    return _plural(count, "micro-batch")


def _batches(count):
    return f"{count} batch" if count == 1 else f"{count} batches"


def _percent(value):
    return f"{value:.0%}"


def _doubled(config, micro_batches, batch_size=None):
    """`2 * micro_batches` capped by `config.max_micro_batches` and
    `batch_size`, never less than `micro_batches`."""
    target = 2 * micro_batches
    if config.max_micro_batches is not None:
        target = min(target, config.max_micro_batches)
    if batch_size is not None:
        target = min(target, batch_size)
    return max(target, micro_batches)


def _samples(count):
    return f"{count} sample" if count == 1 else f"{count} samples"


def decide(config, state, usage, largest_batch_size=None):
    """Decides the micro-batch count for the next batch.

    Cheap enough to run after every batch: it touches only the handful of
    readings in `state.observations`.

    Args:
        config: A `PolicyConfig` (from `make_config`).
        state: The `PolicyState` returned by the previous call (or
            `init_state`).
        usage: The batch's peak usage, peak bytes over the device limit (may
            exceed 1), measured at `state.micro_batches`; `None` when unknown,
            which holds and interrupts a calm streak.
        largest_batch_size: The most samples a batch (of one replica) has had
            so far, or `None` when unknown. More micro-batches than samples
            would only add empty ones, so an increase stops there (like
            `max_micro_batches`) and a decrease never lands above it.
            Defaults to `None`.

    Returns:
        A `(Decision, PolicyState)` pair. `Decision.micro_batches` applies
        from the next batch on.

    Raises:
        ValueError: If `usage` is neither `None` nor a number >= 0, or
            `largest_batch_size` is neither `None` nor an integer >= 1.

    Example:

    >>> config = make_config(cooldown=1)
    >>> state = init_state(2)
    >>> decision, state = decide(config, state, 0.3)
    >>> decision.action, decision.micro_batches
    ('decrease', 1)
    >>> decision.reason
    'predicted 60% at 1 micro-batch < release 70% for 1 batch'
    """
    largest_batch_size = _check_batch_size(largest_batch_size, "largest_batch_size")
    k = state.micro_batches
    since = state.batches_since_change + 1
    if usage is None:
        return (
            Decision(k, k, "hold", None, "usage unknown"),
            state._replace(batches_since_change=since, calm_batches=0),
        )
    if not _is_real(usage) or not usage >= 0:
        raise ValueError(
            f"`usage` must be None or a number >= 0. Received: usage={usage!r}"
        )
    usage = float(usage)
    observations = _record(state.observations, k, usage)
    if since >= config.cooldown * READING_LIFETIME_COOLDOWNS:
        # Readings at other counts describe an older workload (a passing
        # spike, say): forget them, but not out-of-memory marks, so that `k`
        # can come down again through the conservative one-reading rule.
        observations = tuple(
            (m, u) for m, u in observations if m == k or u == _INF
        )
    peak = f"peak {_percent(usage)}"

    if usage >= config.threshold:
        above = f"{peak} >= threshold {_percent(config.threshold)}"
        target = _doubled(config, k, largest_batch_size)
        if target == k:
            if config.max_micro_batches is not None and (
                largest_batch_size is None
                or config.max_micro_batches <= largest_batch_size
            ):
                why = f"the cap of {micro_batches_text(config.max_micro_batches)} is reached"
            else:
                why = (
                    f"micro-batches of one sample are reached (batches of "
                    f"{_samples(largest_batch_size)})"
                )
            return (
                Decision(k, k, "hold", usage, f"{above}, but {why}"),
                state._replace(
                    batches_since_change=since,
                    calm_batches=0,
                    observations=observations,
                ),
            )
        return (
            Decision(target, k, "increase", usage, above),
            state._replace(
                micro_batches=target,
                batches_since_change=0,
                calm_batches=0,
                observations=observations,
            ),
        )

    below = f"{peak} < threshold {_percent(config.threshold)}"
    if k <= config.min_micro_batches:
        return (
            Decision(k, k, "hold", usage, below),
            state._replace(
                batches_since_change=since,
                calm_batches=0,
                observations=observations,
            ),
        )

    target = max(config.min_micro_batches, k // 2)
    if largest_batch_size is not None:
        target = min(target, largest_batch_size)
    updated = state._replace(observations=observations)
    predicted = predict_usage(updated, target)
    release = f"release {_percent(config.release)}"
    if predicted is None or not predicted < config.release:
        if predicted is None:
            why = f"usage at {micro_batches_text(target)} cannot be predicted"
        elif predicted == _INF:
            why = f"{micro_batches_text(target)} ran out of memory before"
        else:
            why = (
                f"predicted {_percent(predicted)} at {micro_batches_text(target)} "
                f">= {release}"
            )
        return (
            Decision(k, k, "hold", usage, f"{below}; {why}"),
            updated._replace(batches_since_change=since, calm_batches=0),
        )

    calm = state.calm_batches + 1
    calm_text = (
        f"predicted {_percent(predicted)} at {micro_batches_text(target)} < {release}"
    )
    if calm >= config.cooldown and since >= config.cooldown:
        return (
            Decision(
                target,
                k,
                "decrease",
                usage,
                f"{calm_text} for {_batches(calm)}",
            ),
            updated._replace(
                micro_batches=target, batches_since_change=0, calm_batches=0
            ),
        )
    if calm < config.cooldown:
        wait = f"for {calm} of {_batches(config.cooldown)}"
    else:
        wait = (
            f"for {_batches(calm)}, {since} of {_batches(config.cooldown)} "
            "since the last change"
        )
    return (
        Decision(k, k, "hold", usage, f"{calm_text} {wait}"),
        updated._replace(batches_since_change=since, calm_batches=calm),
    )


def on_out_of_memory(config, state, batch_size=None):
    """Records an out-of-memory error at the current count and raises it.

    The count that failed (and every smaller one) is never returned to by
    `decide` in this state. The counters restart, so a decrease needs a full
    `cooldown` again. The new count is twice the old one, capped by
    `max_micro_batches` and by `batch_size` (micro-batches of one sample).

    When the batch cannot be split further the decision is a `"hold"` whose
    `cannot_split` says why, for the caller to raise a clear error:
    `CANNOT_SPLIT_BATCH_SIZE` when the micro-batches already hold one sample
    each (the state is then returned unchanged: nothing was tried that the
    policy could learn from), `CANNOT_SPLIT_CAP` when `max_micro_batches` is
    reached (the error is recorded in the state).

    Args:
        config: A `PolicyConfig`.
        state: The `PolicyState` in force when the error happened.
        batch_size: The samples of the batch that failed (of one replica,
            under a distribution strategy), or `None` when unknown.
            Defaults to `None`.

    Returns:
        A `(Decision, PolicyState)` pair.

    Raises:
        ValueError: If `batch_size` is neither `None` nor an integer >= 1.

    Example:

    >>> decision, state = on_out_of_memory(make_config(), init_state(2))
    >>> decision.action, decision.micro_batches, decision.reason
    ('increase', 4, 'out of memory at 2 micro-batches')
    >>> state.oom_count
    1
    >>> decision, _ = on_out_of_memory(make_config(), state, batch_size=4)
    >>> decision.cannot_split, decision.reason
    ('batch_size', 'out of memory at 4 micro-batches of a batch of 4 samples')
    """
    batch_size = _check_batch_size(batch_size)
    k = state.micro_batches
    if batch_size is not None and k >= batch_size:
        return (
            Decision(
                k,
                k,
                "hold",
                None,
                f"out of memory at {micro_batches_text(k)} of a batch of "
                f"{_samples(batch_size)}",
                CANNOT_SPLIT_BATCH_SIZE,
            ),
            state,
        )
    new_state = state._replace(
        batches_since_change=0,
        calm_batches=0,
        observations=_record(state.observations, k, _INF),
        oom_count=state.oom_count + 1,
    )
    target = _doubled(config, k, batch_size)
    if target == k:
        cap = config.max_micro_batches
        reason = f"out of memory at the cap of {micro_batches_text(cap)}"
        if k > cap:  # a restored state above a lowered cap
            reason = f"out of memory at {micro_batches_text(k)}, above the cap of {cap}"
        return (
            Decision(k, k, "hold", None, reason, CANNOT_SPLIT_CAP),
            new_state,
        )
    return (
        Decision(target, k, "increase", None, f"out of memory at {micro_batches_text(k)}"),
        new_state._replace(micro_batches=target),
    )


def on_eval_out_of_memory(config, eval_state, batch_size=None):
    """Raises the evaluation slice count after an out-of-memory error.

    Evaluation keeps its own count (`EvalState`): training's `k` and its
    readings are left alone. The count doubles per error, capped by
    `max_micro_batches` and by `batch_size`, and stays for the next
    evaluations.

    Args:
        config: A `PolicyConfig` (its `max_micro_batches` applies).
        eval_state: The `EvalState` in force when the error happened; its
            `micro_batches` is the count the batch ran at.
        batch_size: The samples of the evaluation batch that failed, or
            `None` when unknown. Defaults to `None`.

    Returns:
        A `(Decision, EvalState)` pair. When the batch cannot be split
        further, the decision is a `"hold"` whose `cannot_split` says why,
        and the state is returned unchanged.

    Raises:
        ValueError: If `batch_size` is neither `None` nor an integer >= 1.

    Example:

    >>> decision, state = on_eval_out_of_memory(
    ...     make_config(), init_eval_state(), batch_size=6)
    >>> decision.micro_batches, state.oom_count
    (2, 1)
    """
    batch_size = _check_batch_size(batch_size)
    k = eval_state.micro_batches
    cap = config.max_micro_batches
    if batch_size is not None and k >= batch_size:
        return (
            Decision(
                k,
                k,
                "hold",
                None,
                f"out of memory evaluating at {micro_batches_text(k)} of a batch of "
                f"{_samples(batch_size)}",
                CANNOT_SPLIT_BATCH_SIZE,
            ),
            eval_state,
        )
    if cap is not None and k >= cap:
        return (
            Decision(
                k,
                k,
                "hold",
                None,
                f"out of memory evaluating at the cap of {micro_batches_text(cap)}",
                CANNOT_SPLIT_CAP,
            ),
            eval_state,
        )
    target = _doubled(config, k, batch_size)
    return (
        Decision(
            target,
            k,
            "increase",
            None,
            f"out of memory evaluating at {micro_batches_text(k)}",
        ),
        eval_state._replace(
            micro_batches=target, oom_count=eval_state.oom_count + 1
        ),
    )


def clamp_micro_batches(micro_batches, batch_size):
    """Clamps a micro-batch count to `[1, batch_size]`.

    More micro-batches than samples in the batch would leave some empty.

    Args:
        micro_batches: The wanted micro-batch count, an integer.
        batch_size: Samples in the batch, an integer >= 1, or `None` when
            unknown (then only the lower bound applies).

    Returns:
        The clamped count, an `int`.

    Raises:
        ValueError: If `micro_batches` is not an integer, or `batch_size` is
            neither `None` nor an integer >= 1.

    Example:

    >>> clamp_micro_batches(16, batch_size=6)
    6
    """
    if not _is_int(micro_batches):
        raise ValueError(
            "`micro_batches` must be an integer. "
            f"Received: micro_batches={micro_batches!r}"
        )
    if batch_size is not None and (not _is_int(batch_size) or batch_size < 1):
        raise ValueError(
            "`batch_size` must be None or an integer >= 1. "
            f"Received: batch_size={batch_size!r}"
        )
    micro_batches = max(1, int(micro_batches))
    if batch_size is not None:
        micro_batches = min(micro_batches, int(batch_size))
    return micro_batches


def state_to_dict(state):
    """Converts a `PolicyState` to a JSON-safe dictionary.

    An out-of-memory reading (`math.inf`) is written as the string `"inf"`,
    which strict JSON can hold.

    Args:
        state: A `PolicyState`.

    Returns:
        A dictionary of plain ints, floats, strings and lists, readable by
        `state_from_dict`.

    Example:

    >>> state = init_state(2)._replace(observations=((1, math.inf),))
    >>> state_to_dict(state)["observations"]
    [[1, 'inf']]
    """
    return {
        "version": STATE_FORMAT_VERSION,
        "micro_batches": state.micro_batches,
        "batches_since_change": state.batches_since_change,
        "calm_batches": state.calm_batches,
        "observations": [
            [k, _INF_JSON if u == _INF else u] for k, u in state.observations
        ],
        "oom_count": state.oom_count,
    }


def state_from_dict(data):
    """Rebuilds a `PolicyState` from the output of `state_to_dict`.

    Args:
        data: A dictionary as written by `state_to_dict` (possibly after a
            JSON round trip).

    Returns:
        A `PolicyState`.

    Raises:
        ValueError: If `data` is not a dictionary of that form.

    Example:

    >>> state = init_state(4)
    >>> state_from_dict(state_to_dict(state)) == state
    True
    """
    if not isinstance(data, dict):
        raise ValueError(
            f"Expected a dictionary from `state_to_dict`. Received: {data!r}"
        )
    if data.get("version") != STATE_FORMAT_VERSION:
        raise ValueError(
            f"Unsupported policy state version. Expected "
            f"{STATE_FORMAT_VERSION}. Received: version={data.get('version')!r}"
        )
    fields = {}
    for name, low in (
        ("micro_batches", 1),
        ("batches_since_change", 0),
        ("calm_batches", 0),
        ("oom_count", 0),
    ):
        value = data.get(name)
        if not _is_int(value) or value < low:
            raise ValueError(
                f"`{name}` must be an integer >= {low}. "
                f"Received: {name}={value!r}"
            )
        fields[name] = int(value)
    raw = data.get("observations")
    if not isinstance(raw, (list, tuple)):
        raise ValueError(
            f"`observations` must be a list. Received: observations={raw!r}"
        )
    entries = {}
    for entry in raw:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ValueError(
                "Each observation must be a [micro_batches, usage] pair. "
                f"Received: {entry!r}"
            )
        k, usage = entry
        if usage == _INF_JSON:
            usage = _INF
        if (
            not _is_int(k)
            or k < 1
            or not _is_real(usage)
            or not usage >= 0
        ):
            raise ValueError(
                "Each observation must be a [micro_batches, usage] pair with "
                "an integer >= 1 and a usage >= 0 or 'inf'. "
                f"Received: {entry!r}"
            )
        entries[int(k)] = float(usage)
    return PolicyState(
        observations=tuple(sorted(entries.items())), **fields
    )
