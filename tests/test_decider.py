"""Tests of keras_memguard.decider: scripted numbers in, counts out (pure, fast).

The scenarios replay, with numbers, the set-ups the guard used to get wrong:
an input pipeline holding memory beside the step, a failure the replay
crept away from one sample at a time, an allocation no count could shrink,
a usage hovering at the threshold.
"""

import ast
import doctest
import json
import math
import random

import pytest

from keras_memguard import decider
from keras_memguard.decider import Batch, Failure, Reading

MIB = 1024.0 * 1024.0
LIMIT = 600 * MIB


def demand(micro, fixed=20 * MIB, per_sample=3 * MIB):
    """The step's own demand: a linear memory."""
    return fixed + per_sample * micro


def run(config, state, batch_size, in_use, batches=8, fits=None, sample_size=1.0):
    """Plans and 'runs' batches; `in_use` is a number or a callable of i."""
    ks = []
    for i in range(batches):
        before = in_use(i) if callable(in_use) else in_use
        decided, state = decider.plan(
            config, state, Batch(batch_size, sample_size, before, LIMIT)
        )
        k = decided.micro_batches
        micro = -(-batch_size // k)
        peak = before + demand(micro)
        if peak > LIMIT or (fits is not None and not fits(micro)):
            ks.append(("oom", k))
            decided, state = decider.fail(
                config, state, Failure(batch_size, k, sample_size, before, LIMIT)
            )
            continue
        state = decider.observe(
            config, state, Reading(batch_size, k, sample_size, before, peak, LIMIT)
        )[1]
        ks.append(k)
    return ks, state


def test_doctests():
    assert doctest.testmod(decider).failed == 0


def test_imports_neither_tensorflow_nor_keras_nor_numpy():
    tree = ast.parse(open(decider.__file__).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert not imported & {"tensorflow", "keras", "numpy", "jax"}


def test_first_batch_is_split_cautiously_then_grows_to_the_target():
    config = decider.make_config()
    ks, _ = run(config, decider.init(config), 408, in_use=10 * MIB)
    assert ks[0] == 8
    # 90% of 600 MiB less 10 MiB in use = 530 MiB -> (530 - 20) / 3 = 170
    # samples: k=3 (136 each); never over.
    assert ks[-1] == 3
    assert all(k != "oom" and k >= 3 for k in ks), ks


@pytest.mark.parametrize(
    "first_split, limit, expected",
    [
        (None, LIMIT, 1),  # room for its layer outputs 32 times over
        (4, LIMIT, 4),  # a split the user chose
        (None, 100 * MIB, decider.CAUTIOUS_FIRST_SPLIT),  # room for 15 times
    ],
)
def test_a_first_batch_runs_whole_only_where_its_layer_outputs_leave_room_many_times(
    first_split, limit, expected
):
    config = decider.make_config(first_split=first_split)
    # 64 samples of 64 KiB of layer outputs, 4 MiB, beside 10 MiB in use
    # and 20 MiB of gradients.
    state = decider.init(config, fixed_bytes=20 * MIB, sample_bytes=64 * 1024)
    decided, _ = decider.plan(config, state, Batch(64, 1.0, 10 * MIB, limit))
    assert decided.micro_batches == expected
    assert decided.reason == (decider.FIRST_WHOLE if expected == 1 else decider.FIRST_SPLIT)


@pytest.mark.parametrize("batch_size, probed", [(64, False), (100, True)])
def test_a_whole_batch_is_split_to_measure_only_past_half_the_target(batch_size, probed):
    # 64 samples peak at 222 MiB, under half the 540 MiB target: nothing
    # to learn that these batches need. 100 peak at 330 MiB: one batch at 2
    # tells the step's fixed part from its samples'.
    config = decider.make_config()
    state = decider.init(config, fixed_bytes=20 * MIB, sample_bytes=64 * 1024)
    ks, _ = run(config, state, batch_size, in_use=10 * MIB)
    assert ks == [1, 2 if probed else 1] + [1] * 6


@pytest.mark.parametrize("in_use", [10 * MIB, 200 * MIB, 400 * MIB])
def test_planning_again_from_the_state_a_plan_returned_gives_the_same_count(in_use):
    config = decider.make_config()
    state = decider.init(config)
    batch = Batch(64, 1.0, in_use, LIMIT)
    for _ in range(3):
        decided, state = decider.plan(config, state, batch)
        again, _ = decider.plan(config, state, batch)
        assert again.micro_batches == decided.micro_batches
        k = decided.micro_batches
        peak = in_use + demand(-(-64 // k), fixed=2 * MIB, per_sample=MIB)
        state = decider.observe(config, state, Reading(64, k, 1.0, in_use, peak, LIMIT))[1]


def test_the_model_holds_the_steps_demand_not_the_memory_in_use_before():
    config = decider.make_config()
    state = decider.init(config)
    for before in (10 * MIB, 300 * MIB):
        state = decider.observe(
            config, state, Reading(64, 1, 1.0, before, before + 200 * MIB, LIMIT)
        )[1]
    assert state.readings == ((64.0, 200 * MIB),)


def test_memory_held_outside_the_step_is_planned_around_batch_by_batch():
    """Keras' numpy pipeline prefetching into the same allocator."""
    config = decider.make_config()
    state = decider.init(config)
    _, state = run(config, state, 408, in_use=10 * MIB)
    quiet = decider.plan(config, state, Batch(408, 1.0, 10 * MIB, LIMIT))[0]
    busy = decider.plan(config, state, Batch(408, 1.0, 400 * MIB, LIMIT))[0]
    assert quiet.micro_batches == 3
    # (540 - 400 - 20) / 3 = 40 samples: 11 micro-batches of 38.
    assert busy.micro_batches == 11
    assert busy.predicted_usage < 0.9


def test_a_plan_depends_on_the_memory_in_use_only_through_what_it_is_planned_for():
    """What lets the guard reuse a plan while the memory in use moves by
    some bytes under the recent high held outside the step."""
    config = decider.make_config()
    rng = random.Random(1)
    checked = 0
    for seed in range(6):
        in_use = lambda i, seed=seed: (seed * 40 + rng.choice([50, 250, 400])) * MIB
        _, state = run(config, decider.init(config), 1024, in_use=in_use, batches=seed + 2)
        outside = state.outside_bytes
        assert outside > 0
        for in_use_now in (0.0, outside / 2, outside - 1.0, outside):
            assert decider.in_use_planned_for(state, in_use_now) == outside
            assert decider.plan(config, state, Batch(1024, 1.0, in_use_now, LIMIT)) == (
                decider.plan(config, state, Batch(1024, 1.0, outside, LIMIT))
            )
            checked += 1
        above = decider.plan(config, state, Batch(1024, 1.0, outside + 100 * MIB, LIMIT))[0]
        assert above.micro_batches >= decider.plan(
            config, state, Batch(1024, 1.0, outside, LIMIT)
        )[0].micro_batches
    assert checked == 24


def test_memory_in_use_moving_by_some_bytes_teaches_nothing_new():
    config = decider.make_config()
    state = decider.init(config)
    state = decider.observe(
        config, state, Reading(64, 2, 1.0, 100 * MIB, 300 * MIB, LIMIT)
    )[1]
    for before in (100 * MIB - 4096, 100 * MIB - 1.0, 100 * MIB - 2 * MIB):
        assert decider.observe(
            config, state, Reading(64, 2, 1.0, before, 300 * MIB - 2 * MIB, LIMIT)
        )[1] is state
    # Well under the recent high (more than 1% of the limit): it falls.
    lower = decider.observe(
        config, state, Reading(64, 2, 1.0, 50 * MIB, 250 * MIB, LIMIT)
    )[1]
    assert lower.outside_bytes == 100 * MIB - decider.OUTSIDE_DECAY * LIMIT
    # Above it: the new high at once.
    higher = decider.observe(
        config, state, Reading(64, 2, 1.0, 120 * MIB, 320 * MIB, LIMIT)
    )[1]
    assert higher.outside_bytes == 120 * MIB


def test_a_moving_baseline_never_causes_an_error_and_the_count_settles():
    config = decider.make_config()
    rng = random.Random(0)
    ks, state = run(
        config, decider.init(config), 1024,
        in_use=lambda i: rng.choice([50, 250, 400]) * MIB, batches=40,
    )
    assert "oom" not in [k if k == "oom" else None for k in ks], ks
    # Raised at once when a busier batch needs it, lowered only with room to
    # spare: the last batches run at one count.
    assert len(set(ks[-10:])) == 1, ks


def test_a_usage_hovering_at_the_threshold_does_not_make_the_count_flap():
    config = decider.make_config()
    state = decider.init(config)
    _, state = run(config, state, 408, in_use=10 * MIB)
    ks = []
    for i in range(30):
        # +-2% of the limit of noise around the level where k=3 just fits.
        noise = (i % 3 - 1) * 0.02 * LIMIT
        decided, state = decider.plan(config, state, Batch(408, 1.0, 20 * MIB + noise, LIMIT))
        ks.append(decided.micro_batches)
    assert len(set(ks[1:])) == 1, ks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_same_run_twice_from_an_empty_state_settles_within_ten_percent(seed):
    config = decider.make_config()
    settled = []
    for run_index in range(2):
        rng = random.Random(seed * 10 + run_index)
        ks, _ = run(
            config, decider.init(config), 1024,
            in_use=lambda i: (100 + rng.random() * 80) * MIB, batches=30,
        )
        settled.append(-(-1024 // ks[-1]))
    assert min(settled) >= 0.9 * max(settled), settled


def test_after_an_error_the_replay_jumps_to_what_the_error_says_fits():
    """Batch 1024 failing at 128 per micro-batch with 513 MiB held outside."""
    config = decider.make_config()
    before = 513 * MIB
    failure = Failure(
        1024, 8, 1.0, before, LIMIT,
        in_use_bytes=before + 80 * MIB, allocation_bytes=48 * MIB,
        allocation_shape=(128, 64, 64, 24), largest_free_bytes=7 * MIB,
    )
    decided, state = decider.fail(config, decider.init(config), failure)
    micro = -(-1024 // decided.micro_batches)
    # Strictly smaller, and sized from the error: not 114, 103, 94, ...
    assert micro <= 64, decided
    assert state.oom_count == 1 and decided.cannot_split is None
    # The failure bounds the plans after it under the same memory in use.
    again = decider.plan(config, state, Batch(1024, 1.0, before, LIMIT))[0]
    assert -(-1024 // again.micro_batches) < 128


def test_a_replay_never_keeps_the_micro_batch_that_failed():
    """ResNet50, batch 16 at 8 micro-batches (2 samples each)."""
    config = decider.make_config()
    state = decider.init(config)
    decided, state = decider.fail(config, state, Failure(16, 8, 1.0, 100 * MIB, LIMIT))
    assert decided.micro_batches == 16  # one sample each, not 9, 10, 11, 12
    decided, state = decider.fail(config, state, Failure(16, 16, 1.0, 100 * MIB, LIMIT))
    assert decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE
    assert not decider.one_sample_fits(config, state, Batch(16, 1.0, 100 * MIB, LIMIT))


def test_an_allocation_of_the_same_shape_is_split_past_where_the_step_s_memory_makes_room():
    # As under a real 600 MiB cap: the bench CNN at batch 1024 fed numpy
    # arrays (513 MiB in use before the step). A convolution's 32 MiB
    # workspace of 4 samples failed at 25, then at 22 samples per
    # micro-batch, with 553 MiB in use and a 27 MiB largest free block: the
    # step held 40 MiB then, which a smaller micro-batch frees.
    config = decider.make_config()
    state = decider.init(config)
    first = Failure(
        1024, 42, 12288.0, 512.8 * MIB, 600 * MIB, in_use_bytes=552.9 * MIB,
        allocation_bytes=31.6 * MIB, allocation_shape=(4, 3600, 576),
        largest_free_bytes=26.7 * MIB,
    )
    decided, state = decider.fail(config, state, first)
    assert decided.cannot_split is None and decided.micro_batches > 42
    second = first._replace(micro_batches=decided.micro_batches)
    again, state = decider.fail(config, state, second)
    assert again.cannot_split is None, again
    assert again.micro_batches > decided.micro_batches


def test_an_allocation_that_does_not_shrink_is_reported_at_the_second_error():
    """A 27 MiB workspace [31, 784, 288] failing at 17, then 16, ... samples."""
    config = decider.make_config()
    state = decider.init(config)
    limit = 50 * MIB
    shape = (31, 784, 288)
    first = Failure(
        64, 4, 1.0, 10 * MIB, limit, in_use_bytes=10 * MIB,
        allocation_bytes=27 * MIB, allocation_shape=shape, largest_free_bytes=20 * MIB,
    )
    decided, state = decider.fail(config, state, first)
    assert decided.cannot_split is None
    second = first._replace(micro_batches=decided.micro_batches)
    decided, state = decider.fail(config, state, second)
    assert decided.cannot_split == decider.CANNOT_SPLIT_ALLOCATION
    assert "does not shrink with the micro-batch" in decided.reason


def test_an_allocation_that_grows_with_the_micro_batch_is_sized_to_the_largest_free_block():
    config = decider.make_config()
    failure = Failure(
        256, 1, 1.0, 10 * MIB, LIMIT, in_use_bytes=300 * MIB,
        allocation_bytes=256 * MIB, allocation_shape=(256, 1024, 256),
        largest_free_bytes=64 * MIB,
    )
    decided, _ = decider.fail(config, decider.init(config), failure)
    assert -(-256 // decided.micro_batches) <= 256 * 64 / 256 * decider.FAILURE_MARGIN


def test_the_cap_stops_the_replay_with_the_reason():
    config = decider.make_config(max_micro_batches=4)
    decided, _ = decider.fail(config, decider.init(config), Failure(64, 4, 1.0, 0.0, LIMIT))
    assert decided.cannot_split == decider.CANNOT_SPLIT_CAP


def test_no_reading_fits_nothing_one_sample_over_is_said():
    config = decider.make_config()
    state = decider.init(config)._replace(readings=((1.0, 700 * MIB),))
    decided, _ = decider.plan(config, state, Batch(8, 1.0, 0.0, LIMIT))
    assert decided.micro_batches == 8
    assert decided.reason.startswith("one sample per micro-batch")


def test_variable_batch_sizes_keep_the_micro_batch_and_few_counts():
    config = decider.make_config()
    state = decider.init(config)
    _, state = run(config, state, 256, in_use=10 * MIB)
    rng = random.Random(3)
    counts, micros = set(), set()
    for _ in range(50):
        size = rng.randint(1, 256)
        decided, state = decider.plan(config, state, Batch(size, 1.0, 10 * MIB, LIMIT))
        counts.add(decided.micro_batches)
        micros.add(-(-size // decided.micro_batches))
        assert decided.predicted_usage is None or decided.predicted_usage < 0.9
    assert max(micros) <= 170 and len(counts) <= 2, (counts, micros)


def test_reacting_doubles_at_the_threshold_at_once():
    config = decider.make_config(predictive=False, cooldown=2)
    state = decider.init(config)
    decided, state = decider.observe(config, state, Reading(64, 1, 1.0, 0.0, 0.95 * LIMIT, LIMIT))
    assert (decided.micro_batches, decided.changed) == (2, True)
    assert decided.reason == "peak 95% of 600 MiB >= threshold 90%"


def test_reacting_halves_after_the_cooldown():
    config = decider.make_config(predictive=False, cooldown=2)
    state = decider.init(config, micro_batches=2)
    # Half the count is predicted at 2 x 30% = 60% < release 70%, twice.
    ks = []
    for _ in range(3):
        k = state.micro_batches
        decided, state = decider.observe(config, state, Reading(64, k, 1.0, 0.0, 0.3 * LIMIT, LIMIT))
        ks.append(decided.micro_batches)
    assert ks == [2, 1, 1], ks
    # Planning in reacting mode keeps the count.
    assert decider.plan(config, state, Batch(64, 1.0, 0.0, LIMIT))[0].micro_batches == 1


def test_reacting_never_lowers_to_a_count_that_failed():
    config = decider.make_config(predictive=False, cooldown=0)
    state = decider.init(config, micro_batches=2)
    decided, state = decider.fail(config, state, Failure(64, 2, 1.0, 0.0, LIMIT))
    k = decided.micro_batches
    for _ in range(5):
        decided, state = decider.observe(
            config, state, Reading(64, state.micro_batches, 1.0, 0.0, 0.2 * LIMIT, LIMIT)
        )
    assert state.micro_batches > 2 or state.micro_batches == k


def test_evaluation_slices_halve_and_keep_trainings_count():
    config = decider.make_config()
    state = decider.init(config)
    decided, state = decider.fail_evaluation(config, state, 64, 1)
    assert decided.micro_batches == 2 and state.eval_oom_count == 1
    assert state.micro_batches == decider.CAUTIOUS_FIRST_SPLIT and state.oom_count == 0
    decided, _ = decider.fail_evaluation(config, state, 2, 2)
    assert decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE


def test_the_state_survives_a_json_round_trip():
    config = decider.make_config()
    _, state = run(config, decider.init(config, fixed_bytes=123.0), 408, in_use=10 * MIB)
    _, state = decider.fail(config, state, Failure(
        408, 3, 1.0, 10 * MIB, LIMIT, allocation_bytes=5.0, allocation_shape=(136, 9),
        in_use_bytes=10 * MIB, largest_free_bytes=1.0,
    ))
    assert decider.from_dict(json.loads(json.dumps(decider.to_dict(state)))) == state


@pytest.mark.parametrize(
    "data, match",
    [
        ([], "Expected a decider state"),
        ({"version": 1}, "Expected a decider state of version 2"),
        (dict(decider.to_dict(decider.init(decider.make_config())), readings=[[1, -2]]),
         "Each entry of `readings`"),
        (dict(decider.to_dict(decider.init(decider.make_config())), micro_batches=0),
         "`micro_batches` must be an integer >= 1. Received: micro_batches=0"),
    ],
)
def test_a_foreign_state_is_refused_with_what_was_received(data, match):
    with pytest.raises(ValueError, match=match):
        decider.from_dict(data)


@pytest.mark.parametrize(
    "kwargs, echo",
    [
        ({"threshold": 1.5}, "threshold=1.5"),
        ({"threshold": True}, "threshold=True"),
        ({"release": 0.95}, "release=0.95, threshold=0.9"),
        ({"cooldown": -1}, "cooldown=-1"),
        ({"growth": 1}, "growth=1"),
        ({"first_split": 0}, "first_split=0"),
        ({"max_micro_batches": 0}, "max_micro_batches=0"),
        ({"min_micro_batches": 4, "max_micro_batches": 2}, "min_micro_batches=4"),
        ({"predictive": "yes"}, "predictive='yes'"),
    ],
)
def test_bad_settings_name_the_argument_and_echo_the_value(kwargs, echo):
    with pytest.raises(ValueError, match=f"Received: {echo}"):
        decider.make_config(**kwargs)


def test_plan_is_cheap_enough_for_every_batch():
    """Not a timing assertion: the plan touches a handful of numbers."""
    config = decider.make_config()
    _, state = run(config, decider.init(config), 408, in_use=10 * MIB)
    assert len(state.readings) <= decider.MAX_READINGS
    assert math.isfinite(decider.predict_demand(state, 100.0))


def _prefetching_run(seed, batches=12):
    """A small CNN fed a shuffled, prefetched pipeline under an 89 MiB cap.

    The step's own memory hardly shrinks with the micro-batch, and the
    pipeline's buffer is fuller before one step and fills during another:
    the memory in use before a batch and the batch's demand move in
    opposite directions (as measured under the real cap: before 19.8 MiB,
    or 18.3 about one batch in three, and peaks 78.3 to 79.3 MiB at 8
    samples per micro-batch).
    """
    limit = 89 * MIB
    config = decider.make_config()
    state = decider.init(config)
    rng = random.Random(seed)
    ks = []
    for i in range(batches):
        before = (18.3 if rng.random() < 0.3 else 19.8) * MIB
        decided, state = decider.plan(config, state, Batch(128, 1.0, before, limit))
        k = decided.micro_batches
        micro = -(-128 // k)
        refill = 19.8 * MIB - before + rng.random() * 0.8 * MIB
        peak = before + refill + (56.0 + 0.35 * micro) * MIB
        assert peak < limit, (i, k, peak / MIB)
        state = decider.observe(config, state, Reading(128, k, 1.0, before, peak, limit))[1]
        ks.append(k)
    return ks, state


def test_a_count_measured_under_the_target_is_not_raised_by_noise():
    settled = set()
    for seed in range(6):
        ks, state = _prefetching_run(seed)
        # Once the count has run under the target with as much memory in
        # use before it as now, the sum of the highest demand and the
        # highest memory in use before (which never came together) does not
        # raise it.
        assert ks[:2] == [8, 16] and len(set(ks[4:])) == 1, ks
        settled.add(-(-128 // ks[-1]))
        assert state.peaks and all(p < 89 * MIB for _, p, *_ in state.peaks)
    assert min(settled) >= 0.9 * max(settled), settled


def test_a_count_is_still_raised_when_more_memory_is_in_use_than_it_was_measured_with():
    ks, state = _prefetching_run(0)
    k = ks[-1]
    # 6 MiB more in use than before any measured batch: the measured peak
    # plus that is over the target, so the model decides again.
    decided, _ = decider.plan(decider.make_config(), state, Batch(128, 1.0, 26 * MIB, 89 * MIB))
    assert decided.micro_batches > k and decided.reason != decider.HELD, (ks, decided)


def _held_after(peaks):
    """The prefetched pipeline's state after batches at 8, then 16, micro-batches.

    Its readings under the real 89 MiB cap, the last three batches' peaks
    at 16 micro-batches from `peaks` (MiB).
    """
    config, limit = decider.make_config(), 89 * MIB
    state = decider.init(config)
    befores = (19.8, 18.4, 19.8, 19.8)
    for k, before, peak in zip((8, 16, 16, 16), befores, (84.6,) + tuple(peaks)):
        decided, state = decider.plan(config, state, Batch(128, 1.0, before * MIB, limit))
        assert decided.micro_batches == k, decided
        state = decider.observe(config, state, Reading(128, k, 1.0, before * MIB, peak * MIB, limit))[1]
    return config, limit, state


def test_a_count_run_just_under_the_target_is_held_beside_one_more_prefetched_batch():
    # The prefetched pipeline under its real 89 MiB cap: 16 micro-batches
    # peaked at 79.3 MiB, under the 80.1 MiB target. One more 1.5 MiB batch
    # buffered before a step put the measured peak plus the memory in use
    # 0.8 MiB over the target, and the count went to 43 (22 on a slower
    # machine) for the rest of the run, for a demand that hardly shrinks.
    config, limit, state = _held_after((79.3, 79.2, 79.3))
    for in_use in (21.3, 24.0):
        decided, _ = decider.plan(config, state, Batch(128, 1.0, in_use * MIB, limit))
        assert (decided.micro_batches, decided.reason) == (16, decider.HELD), (in_use, decided)
    # Past the midpoint of the target and the limit (95%), the model decides.
    decided, _ = decider.plan(config, state, Batch(128, 1.0, 26 * MIB, limit))
    assert decided.micro_batches > 16, decided


def test_a_peak_a_little_past_the_target_holds_a_count_that_a_raise_would_not_relieve():
    # The prefetched pipeline under its real 89 MiB cap: its batches at 16
    # micro-batches peak at 77-79.3 MiB; one past the 80.1 MiB target (here
    # 80.3) sent the count to 22 or 26 for the rest of the run, for a demand
    # 1-3 MiB lower (one run of 18, three at a time).
    config, limit, state = _held_after((79.3, 79.2, 80.3))
    for in_use in (18.3, 19.8, 21.3):
        decided, _ = decider.plan(config, state, Batch(128, 1.0, in_use * MIB, limit))
        assert (decided.micro_batches, decided.reason) == (16, decider.HELD), (in_use, decided)
    # Past the midpoint of the target and the limit (95%), the model decides.
    decided, _ = decider.plan(config, state, Batch(128, 1.0, 26 * MIB, limit))
    assert decided.micro_batches > 16, decided
    # A batch 1.1 MiB past the target (over 1% of the limit): raised.
    reading = Reading(128, 16, 1.0, 19.8 * MIB, 81.2 * MIB, limit)
    further = decider.observe(config, state, reading)[1]
    decided, _ = decider.plan(config, further, Batch(128, 1.0, 19.8 * MIB, limit))
    assert decided.micro_batches > 16, decided


def test_a_peak_past_the_target_raises_a_count_where_a_raise_saves_memory():
    # The residual CNN's demand grows with the micro-batch: one more micro-
    # batch (43 to 32 samples) saves over 100 MiB of 641, so a peak at 3
    # micro-batches past the target raises the count, under the midpoint too.
    config, limit, sample = decider.make_config(), 641 * MIB, 12288.0
    state = decider.init(config)
    for k, before, peak in [(8, 50.0, 182.7), (4, 44.1, 341.2), (3, 44.1, 580.0)]:
        decided, state = decider.plan(config, state, Batch(128, sample, before * MIB, limit))
        assert decided.micro_batches == k, decided
        reading = Reading(128, k, sample, before * MIB, peak * MIB, limit, before * MIB)
        state = decider.observe(config, state, reading)[1]
    decided, _ = decider.plan(config, state, Batch(128, sample, 44.1 * MIB, limit))
    assert decided.micro_batches == 4, decided


def test_a_count_is_held_for_memory_that_came_into_use_during_its_measured_step():
    # The grid's mixed-precision residual CNN (batch 128 of 64x64x3) under
    # 641 MiB, readings of two logged first runs: after the third batch
    # Keras' pipeline over the numpy arrays holds 79 MiB more, in use from
    # then on, and the batches at 3 micro-batches peak no higher with it.
    # Before, one run's 532.8 MiB peak plus those 79 MiB came to 95.5% of
    # the limit, and the count went to 4 for good (32 samples, not 43).
    config, limit, sample = decider.make_config(), 641 * MIB, 12288.0
    state = decider.init(config)
    for k, before, peak, after in [
        (8, 50.0, 182.7, 44.1),
        (4, 44.1, 341.2, 70.2),
        (3, 70.2, 532.8, 149.3),
    ]:
        decided, state = decider.plan(config, state, Batch(128, sample, before * MIB, limit))
        assert decided.micro_batches == k, decided
        reading = Reading(128, k, sample, before * MIB, peak * MIB, limit, after * MIB)
        state = decider.observe(config, state, reading)[1]
    decided, _ = decider.plan(config, state, Batch(128, sample, 149.3 * MIB, limit))
    assert (decided.micro_batches, decided.reason) == (3, decider.HELD), decided
    assert decided.predicted_usage == pytest.approx(532.8 / 641)
    # Without the reading after the step, the sum passes 95%: raised.
    unknown = decider.init(config)
    for k, before, peak in [(8, 50.0, 182.7), (4, 44.1, 341.2), (3, 70.2, 532.8)]:
        unknown = decider.plan(config, unknown, Batch(128, sample, before * MIB, limit))[1]
        reading = Reading(128, k, sample, before * MIB, peak * MIB, limit)
        unknown = decider.observe(config, unknown, reading)[1]
    assert decider.plan(config, unknown, Batch(128, sample, 149.3 * MIB, limit))[0].micro_batches == 4
    # Were the memory in use after the step not there at its peak, the step
    # would peak at the sum: past the limit, the count is raised.
    decided, _ = decider.plan(config, state, Batch(128, sample, 188 * MIB, limit))
    assert decided.micro_batches > 3, decided


def test_peaks_round_trip_and_older_files_without_them_load():
    ks, state = _prefetching_run(1)
    data = json.loads(json.dumps(decider.to_dict(state)))
    assert decider.from_dict(data) == state
    del data["peaks"]
    assert decider.from_dict(data) == state._replace(peaks=())
    data["peaks"] = [[1.0, 2.0, 3.0]]  # written before the memory in use after
    assert decider.from_dict(data).peaks == ((1.0, 2.0, 3.0, 3.0),)
    data["peaks"] = [[1.0, 2.0]]
    with pytest.raises(ValueError, match="`peaks` must be a list"):
        decider.from_dict(data)


def test_a_replay_without_figures_halves_the_micro_batch_and_stops_at_one_sample():
    config = decider.make_config()
    state = decider.init(config)
    decided, state = decider.fail_without_figures(config, state, 16, 2)
    assert (decided.micro_batches, decided.cannot_split, state.oom_count) == (4, None, 1)
    # An odd batch: the micro-batch halves (5 samples to 2), the count follows.
    decided, _ = decider.fail_without_figures(config, state, 10, 2)
    assert decided.micro_batches == 5
    decided, unchanged = decider.fail_without_figures(config, state, 6, 6)
    assert decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE
    assert unchanged is state
    capped = decider.make_config(max_micro_batches=4)
    decided, _ = decider.fail_without_figures(capped, decider.init(capped), 64, 4)
    assert decided.cannot_split == decider.CANNOT_SPLIT_CAP


def test_where_no_count_fits_it_splits_only_while_the_demand_still_falls():
    # A step whose demand hardly shrinks with the micro-batch (60 MiB at 8
    # samples, 60.5 at 16), with 485 MiB in use before it: no count meets
    # the 90% target, and one sample per micro-batch would save 4 MiB at
    # 128 times the steps.
    config = decider.make_config()
    state = decider.init(config)._replace(readings=((8.0, 60 * MIB), (16.0, 60.5 * MIB)))
    decided, _ = decider.plan(config, state, Batch(128, 1.0, 485 * MIB, LIMIT))
    # 4: micro-batches of 32, twice the largest measured.
    assert decided.micro_batches == 4, decided
    assert decided.reason.startswith("over the target at any count"), decided.reason
    # Where the demand falls with the micro-batch (5 MiB a sample), it
    # splits until the step is predicted under 95% of the limit...
    state = decider.init(config)._replace(readings=((8.0, 60 * MIB), (16.0, 100 * MIB)))
    decided, _ = decider.plan(config, state, Batch(128, 1.0, 521 * MIB, LIMIT))
    assert decided.micro_batches == 26, decided
    assert decided.predicted_usage < 0.95, decided
    # ... down to one sample where nothing more is under it.
    decided, _ = decider.plan(config, state, Batch(128, 1.0, 542 * MIB, LIMIT))
    assert decided.micro_batches == 128, decided
    assert decided.reason.startswith("one sample per micro-batch"), decided.reason


def test_a_count_between_two_readings_is_planned_from_them_not_a_lifted_line():
    # EfficientNetB0 (64x64, batch 32) under 176 MiB, a logged first run:
    # the 2-sample reading lies 14 MiB above the line through 4 and 8
    # samples, and the line raised over it predicted 7 samples 14 MiB too
    # high, so the run settled at 5 where 7 trains clean.
    config = decider.make_config()
    readings = ((2.0, 49.7 * MIB), (4.0, 59.7 * MIB), (8.0, 107.1 * MIB))
    state = decider.init(config)._replace(readings=readings)
    # Between 4 and 8 samples: the chord between the two readings.
    assert decider.predict_demand(state, 6.0) == pytest.approx((59.7 + 107.1) / 2 * MIB)
    assert decider.predict_demand(state, 8.0) == pytest.approx(107.1 * MIB)
    # Above the largest reading, the line raised over every reading (14
    # MiB over the top chord's extension).
    above = 107.1 * MIB + (107.1 - 59.7) / 4 * MIB
    assert decider.predict_demand(state, 9.0) == pytest.approx(above + 13.7 * MIB, rel=1e-3)
    limit = 176 * MIB
    decided, _ = decider.plan(config, state, Batch(32, 1.0, 63.5 * MIB, limit))
    assert decided.micro_batches == 6, decided  # 6 samples each; 7 before
    assert decided.predicted_usage == pytest.approx((63.5 + 83.4) / 176, abs=1e-3)


def test_between_readings_the_prediction_is_never_below_a_smaller_reading():
    # Peaks move from batch to batch: a larger micro-batch may read lower.
    config = decider.make_config()
    readings = ((4.0, 100 * MIB), (8.0, 90 * MIB), (16.0, 150 * MIB))
    state = decider.init(config)._replace(readings=readings)
    assert decider.predict_demand(state, 6.0) == pytest.approx(100 * MIB)
    assert decider.predict_demand(state, 12.0) == pytest.approx(120 * MIB)
    # A budget of 99 MiB fits only the line's share below the first reading:
    # no work between 4 and 8 is planned under it.
    for budget in (99 * MIB, 100 * MIB, 120 * MIB, 150 * MIB):
        largest = decider._largest_work(config, state, budget)
        assert decider.predict_demand(state, largest) <= budget + 1.0
        assert decider.predict_demand(state, largest + 0.5) > budget or largest >= 16.0


# DenseNet121 (64x64, batch 32, Adam) under 250 MiB: the first run's
# readings, per samples a micro-batch (1, 2, 4, 6, 7), as its plan cache
# kept them. It explored four counts before it settled at 6 samples, and
# its steps took more than a process that starts at 6 (114.7 MiB at 6
# samples, where the cached run measured 103.8-105.5), and its recent high
# of the memory in use was 104.6 MiB, which the cached run starts from.
DENSENET_CACHED = ((1.0, 61.7), (2.0, 66.8), (4.0, 84.1), (6.0, 114.7), (7.0, 128.5))
DENSENET_LIMIT = 250 * MIB


def densenet_cached_state(config):
    return decider.init(config, micro_batches=6)._replace(
        readings=tuple((w, d * MIB) for w, d in DENSENET_CACHED),
        shapes=(((32, 1.0), 6),),
        outside_bytes=104.6 * MIB,
        peaks=((6.0, 226.8 * MIB, 104.4 * MIB, 104.4 * MIB), (7.0, 230.4 * MIB, 102.1 * MIB, 102.1 * MIB)),
    )


def run_cached(config, state, batches):
    """Plans and observes `(in_use, demand_at_6, demand_at_7)` MiB batches."""
    counts = []
    for in_use, at_6, at_7 in batches:
        decided, state = decider.plan(config, state, Batch(32, 1.0, in_use * MIB, DENSENET_LIMIT))
        k = decided.micro_batches
        counts.append(k)
        demand = {6: at_6, 5: at_7}[k]
        reading = Reading(32, k, 1.0, in_use * MIB, (in_use + demand) * MIB, DENSENET_LIMIT)
        state = decider.observe(config, state, reading)[1]
    return counts, state


# The cached run's memory in use before each batch and the step's demand
# at 6 samples (logged), and at 7 (a fixed 7-sample run, logged).
DENSENET_BATCHES = [
    (95.3, 103.8, 116.3), (96.2, 103.5, 114.0), (94.7, 104.2, 116.8), (93.2, 104.3, 113.5),
    (97.7, 105.5, 116.2), (96.2, 103.1, 114.0), (94.7, 105.6, 116.8), (93.2, 105.1, 113.5),
]


def test_a_cached_run_plans_from_its_own_readings_not_the_earlier_process():
    config = decider.make_config()
    # Planned from the earlier process's readings as they are, 7 samples
    # are predicted past the band a lower count needs, and the run holds 6
    # (a fixed 7 runs clean under the threshold, at 83-86%).
    counts, _ = run_cached(config, densenet_cached_state(config), DENSENET_BATCHES)
    assert set(counts) == {6}, counts
    # Its own first reading at 6 samples, 10.9 MiB under the earlier one,
    # moves the earlier readings by as much, and the memory in use before
    # it replaces the 104.6 MiB the earlier process held outside its steps:
    # 7 samples fit from the second batch on, and hold.
    state = decider.inherit(densenet_cached_state(config))
    counts, state = run_cached(config, state, DENSENET_BATCHES)
    assert counts == [6] + [5] * 7, counts
    assert state.inherited == () and not state.outside_inherited
    assert state.outside_bytes <= max(in_use for in_use, _, _ in DENSENET_BATCHES) * MIB
    assert dict(state.readings)[1.0] == pytest.approx((61.7 - 10.9) * MIB)
    assert dict(state.readings)[7.0] >= 113.5 * MIB
    for _, peak, before, _ in state.peaks:
        assert peak - before < 120 * MIB  # the earlier peaks moved too


def test_an_inherited_reading_is_replaced_once_then_kept_as_the_highest():
    config = decider.make_config()
    state = decider.inherit(
        decider.init(config)._replace(readings=((10.0, 300.0), (20.0, 500.0)))
    )
    assert state.inherited == (10.0, 20.0)
    # A work the earlier process did not measure recalibrates nothing.
    state = decider.observe(config, state, Reading(15, 1, 1.0, 0.0, 350.0, 1000.0))[1]
    assert state.readings == ((10.0, 300.0), (15.0, 350.0), (20.0, 500.0))
    assert state.inherited == (10.0, 20.0)
    # A higher reading at an inherited work moves the others up as much.
    state = decider.observe(config, state, Reading(10, 1, 1.0, 0.0, 330.0, 1000.0))[1]
    assert state.readings == ((10.0, 330.0), (15.0, 350.0), (20.0, 530.0))
    assert state.inherited == ()
    # After it, the highest reading per work, as in any run.
    state = decider.observe(config, state, Reading(10, 1, 1.0, 0.0, 310.0, 1000.0))[1]
    assert dict(state.readings)[10.0] == 330.0
    assert decider.from_dict(decider.to_dict(state)) == state


def test_the_plan_cache_marks_what_it_loads_as_inherited(tmp_path, monkeypatch):
    from keras_memguard import plan_cache

    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    config = decider.make_config()
    state = decider.init(config)._replace(readings=((10.0, 300.0), (20.0, 500.0)))
    fields = {"model": "m"}
    key = plan_cache.setup_key(fields)
    plan_cache.save(key, fields, state)
    assert plan_cache.load(key, fields).inherited == (10.0, 20.0)


def test_an_inherited_work_no_longer_kept_recalibrates_nothing():
    config = decider.make_config()
    earlier = tuple((float(w), 100.0 + 10.0 * w) for w in range(1, decider.MAX_READINGS + 1))
    state = decider.inherit(decider.init(config)._replace(readings=earlier))
    # This process's readings between the earlier ones push one of them out.
    state = decider.observe(config, state, Reading(1, 1, 4.5, 0.0, 160.0, 1000.0))[1]
    state = decider.observe(config, state, Reading(1, 1, 5.5, 0.0, 170.0, 1000.0))[1]
    dropped = next(w for w in state.inherited if w not in dict(state.readings))
    state = decider.observe(config, state, Reading(1, 1, dropped, 0.0, 50.0, 1000.0))[1]
    assert dropped not in state.inherited
    assert dict(state.readings)[dropped] == 50.0
    kept = [(w, d) for w, d in state.readings if w != dropped and w in dict(earlier)]
    assert kept and all(d == 100.0 + 10.0 * w for w, d in kept)


def test_a_state_restored_from_backup_dir_is_inherited(tmp_path):
    from keras_memguard.callbacks.controller import GuardController

    config = decider.make_config()
    saved = GuardController(config, backup_dir=str(tmp_path))
    saved.state = saved.state._replace(readings=((10.0, 300.0), (20.0, 500.0)))
    saved.save_state(step=3)
    restored = GuardController(config, backup_dir=str(tmp_path))
    assert restored.load_state() == 3
    assert restored.state.inherited == (10.0, 20.0)


def _settle_at_the_edge(demand_at, batches=10):
    """Batch 128 under a 1000 MiB limit, 100 MiB in use before each batch;
    `demand_at(micro)` the step's demand in MiB. Returns the counts run and
    each batch's peak as a share of the limit."""
    limit = 1000 * MIB
    config = decider.make_config()
    state = decider.init(config)
    counts, usages = [], []
    for _ in range(batches):
        decided, state = decider.plan(config, state, Batch(128, 1.0, 100 * MIB, limit))
        k = decided.micro_batches
        peak = (100 + demand_at(-(-128 // k))) * MIB
        assert peak < limit
        state = decider.observe(config, state, Reading(128, k, 1.0, 100 * MIB, peak, limit))[1]
        counts.append(k)
        usages.append(peak / limit)
    return counts, usages


def test_a_lower_count_predicted_under_the_target_is_tried_once_and_kept_where_it_fits():
    # 22 samples a micro-batch peak at 79%, 26 at 87%: under the 90% target,
    # not under the 86% the band asks of a lower count on a prediction
    # alone. The count held at 6 (22 samples) where 5 runs clean; one batch
    # now tries 5, and its peak keeps it.
    counts, usages = _settle_at_the_edge(lambda micro: 250 + 20 * micro)
    assert counts[-1] == 5 and len(set(counts[-5:])) == 1, counts
    assert max(usages) < 0.9, usages
    # Where the tried count peaks past the target (the line under-predicted
    # it), the count goes back and is not tried again.
    counts, usages = _settle_at_the_edge(
        lambda micro: 250 + 20 * micro + (70 if micro >= 26 else 0)
    )
    assert counts.count(5) == 1 and counts[-1] == 6 and len(set(counts[-5:])) == 1, counts
