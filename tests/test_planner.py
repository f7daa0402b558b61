"""The planner: scripted readings in, micro-batch counts out (pure, fast)."""

import math

import pytest

from keras_memguard import planner

MIB = 1024 * 1024
LIMIT = 600 * MIB


def linear_peak(samples, fixed=20 * MIB, per_sample=3 * MIB):
    return fixed + per_sample * samples


def run_batches(config, state, batch_size, sample_size=1.0, batches=6, fits=None):
    """Plans and 'runs' batches against a linear memory; returns the ks."""
    ks = []
    for _ in range(batches):
        decided = planner.plan(config, state, batch_size, sample_size, LIMIT)
        k = decided.micro_batches
        micro = -(-batch_size // k)
        work = micro * sample_size
        if fits is not None and not fits(micro, sample_size):
            state = planner.observe_out_of_memory(config, state, work, LIMIT)
            ks.append(("oom", k))
            continue
        state = planner.observe(
            config, state, work, LIMIT, linear_peak(micro * sample_size),
            current_bytes=10 * MIB,
        )
        ks.append(k)
    return ks, state


def test_first_batch_is_split_cautiously_then_grows_to_the_target():
    config = planner.make_planner_config(threshold=0.9)
    ks, _ = run_batches(config, planner.init_planner_state(), 408)
    assert ks[0] == 8
    # Target 90% of 600 MiB = 540 MiB -> (540 - 20) / 3 = 173 samples: k=3
    # (136 per micro-batch; 204 would not fit), reached without going over.
    assert ks[-1] == 3
    assert all(k >= 3 for k in ks)


def test_any_count_not_only_powers_of_two():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    for work in (51.0, 102.0):
        state = planner.observe(config, state, work, LIMIT, linear_peak(work))
    assert planner.plan(config, state, 408, 1.0, LIMIT).micro_batches == 3
    assert planner.plan(config, state, 1024, 1.0, LIMIT).micro_batches == 6


def test_shape_aware_prediction_splits_long_sequences_more():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    for work in (50.0, 100.0):
        state = planner.observe(config, state, work, LIMIT, linear_peak(work))
    short = planner.plan(config, state, 64, 1.0, LIMIT).micro_batches
    long = planner.plan(config, state, 64, 8.0, LIMIT).micro_batches
    assert short == 1 and long == 4  # 64 * 8 = 512 units: 173 fit


def test_out_of_memory_is_never_planned_again_and_lowers_the_target():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    for work in (50.0, 100.0):
        state = planner.observe(config, state, work, LIMIT, linear_peak(work))
    # A cliff at 121 samples (fragmentation), below what the model allows.
    ks, state = run_batches(
        config, state, 1024, fits=lambda micro, size: micro <= 120, batches=5
    )
    # Each failure lowers the target below what was predicted there.
    assert ks == [("oom", 6), ("oom", 7), ("oom", 8), 9, 9]
    assert state.failed_work == 128.0
    assert state.capacity_usage < planner.predict_peak(state, 128.0) / LIMIT


def test_no_reading_means_no_prediction_and_bad_state_is_refused():
    assert planner.predict_peak(planner.init_planner_state(), 10) is None
    with pytest.raises(ValueError, match="readings"):
        planner.planner_state_from_dict(
            {"version": 1, "readings": "x", "failed_work": "inf"}
        )
    state = planner.init_planner_state(base_bytes=3)._replace(failed_work=9.0)
    assert planner.planner_state_from_dict(planner.planner_state_to_dict(state)) == state


def test_far_below_the_target_the_whole_batch_runs_at_once():
    config = planner.make_planner_config()
    state = planner.observe(config, planner.init_planner_state(), 8.0, LIMIT, 10 * MIB)
    decided = planner.plan(config, state, 64, 1.0, LIMIT)
    assert decided.micro_batches == 1
    assert decided.predicted_usage < 0.2


def test_one_sample_over_the_target_plans_single_samples():
    config = planner.make_planner_config(max_micro_batches=16)
    state = planner.observe(config, planner.init_planner_state(), 1.0, LIMIT, 590 * MIB)
    decided = planner.plan(config, state, 64, 1.0, LIMIT)
    assert decided.micro_batches == 16
    assert "still over" in decided.reason


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 0}, "threshold"),
        ({"growth": 1}, "growth"),
        ({"first_split": 0}, "first_split"),
        ({"max_micro_batches": 0}, "max_micro_batches"),
    ],
)
def test_bad_settings_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        planner.make_planner_config(**kwargs)


def test_an_allocation_larger_than_the_largest_free_block_bounds_the_work():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    for work in (50.0, 100.0):
        state = planner.observe(config, state, work, LIMIT, linear_peak(work))
    # At work 150 a tensor twice the largest free block was asked for.
    bounded = planner.observe_out_of_memory(
        config, state, 150.0, LIMIT, largest_fitting_work=75.0
    )
    plain = planner.observe_out_of_memory(config, state, 150.0, LIMIT)
    assert plain.failed_work == 150.0
    assert bounded.failed_work == pytest.approx(75.0)
    assert bounded.capacity_usage == plain.capacity_usage
    k = planner.plan(config, bounded, 1024, 1.0, LIMIT).micro_batches
    assert -(-1024 // k) <= 75 < -(-1024 // (k - 1))
    assert planner.plan(config, plain, 1024, 1.0, LIMIT).micro_batches < k


def test_a_reading_that_teaches_nothing_new_keeps_the_state_object():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    for work in (50.0, 100.0):
        state = planner.observe(
            config, state, work, LIMIT, linear_peak(work), current_bytes=10 * MIB
        )
    # The same peak at a work already recorded, a higher current: the same
    # object, so a caller keeps what it derived from it (the guard's plan).
    again = planner.observe(
        config, state, 50, LIMIT, linear_peak(50.0), current_bytes=12 * MIB
    )
    assert again is state
    # Anything new makes a new state, as before.
    moved = planner.observe(config, state, 50.0, LIMIT, linear_peak(50.0) + 1)
    assert moved.readings == (
        (50.0, linear_peak(50.0) + 1.0),
        (100.0, linear_peak(100.0)),
    )
    assert moved._replace(readings=state.readings) == state
    lower = planner.observe(
        config, state, 50.0, LIMIT, linear_peak(50.0), current_bytes=9 * MIB
    )
    assert lower.base_bytes == 9 * MIB and lower.readings == state.readings
    wider = planner.observe(config, state, 50.0, 2 * LIMIT, linear_peak(50.0))
    assert wider.limit_bytes == 2 * LIMIT and wider.readings == state.readings
    added = planner.observe(config, state, 75.0, LIMIT, linear_peak(75.0))
    assert [w for w, _ in added.readings] == [50.0, 75.0, 100.0]


def test_the_count_alone_is_the_plans_count():
    config = planner.make_planner_config(max_micro_batches=64)
    empty = planner.init_planner_state()
    one = planner.observe(config, empty, 40.0, LIMIT, linear_peak(40.0))
    two = planner.observe(config, one, 80.0, LIMIT, linear_peak(80.0))
    failed = planner.observe_out_of_memory(config, two, 160.0, LIMIT)
    over = planner.observe(config, empty, 1.0, LIMIT, 590 * MIB)
    flat = planner.observe(config, one, 20.0, LIMIT, linear_peak(40.0))
    for state in (empty, one, two, failed, over, flat):
        for batch_size in (1, 7, 64, 408, 1024):
            for sample_size in (1.0, 3.0, 100.0):
                args = (config, state, batch_size, sample_size, LIMIT)
                assert planner.planned_micro_batches(*args) == (
                    planner.plan(*args).micro_batches
                ), args


def test_readings_that_do_not_grow_with_the_work_plan_the_whole_batch():
    config = planner.make_planner_config()
    state = planner.init_planner_state()
    # Every peak at the memory in use before the step: nothing grows.
    for work in (8.0, 16.0):
        state = planner.observe(config, state, work, LIMIT, 50 * MIB, current_bytes=50 * MIB)
    assert planner.plan(config, state, 64, 1.0, LIMIT).micro_batches == 1
    # The same, but over the target already: as split as allowed.
    full = planner.init_planner_state()
    for work in (8.0, 16.0):
        full = planner.observe(config, full, work, LIMIT, LIMIT, current_bytes=LIMIT)
    assert planner.plan(config, full, 64, 1.0, LIMIT).micro_batches == 64
