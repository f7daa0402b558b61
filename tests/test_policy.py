"""Tests of keras_memguard.policy: scripted usage sequences, no TensorFlow.

The module is loaded from its file, not through the package, because the
package's `__init__` may import TensorFlow; the policy must not need it.
"""

import doctest
import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

POLICY_PATH = (
    pathlib.Path(__file__).resolve().parents[1] / "keras_memguard" / "policy.py"
)


def _load_policy():
    name = "_keras_memguard_policy_under_test"
    spec = importlib.util.spec_from_file_location(name, POLICY_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


policy = _load_policy()


def run(config, state, usages, largest_batch_size=None):
    """Feeds usages to `decide`; returns the decisions and the final state."""
    decisions = []
    for usage in usages:
        decision, state = policy.decide(
            config, state, usage, largest_batch_size=largest_batch_size
        )
        decisions.append(decision)
    return decisions, state


def with_observations(micro_batches, *observations):
    return policy.init_state(micro_batches)._replace(
        observations=tuple(observations)
    )


# --- Import hygiene and module surface ----------------------------------


@pytest.mark.slow
def test_module_file_imports_no_tensorflow_keras_or_numpy():
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location(\n"
        f"    'p', {str(POLICY_PATH)!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "sys.modules['p'] = m\n"
        "spec.loader.exec_module(m)\n"
        "m.decide(m.make_config(), m.init_state(), 0.95)\n"
        "heavy = sorted(\n"
        "    n for n in sys.modules\n"
        "    if n.split('.')[0] in ('tensorflow', 'keras', 'numpy'))\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "HEAVY="


def test_all_is_sorted_and_complete():
    assert policy.__all__ == sorted(policy.__all__)
    for name in policy.__all__:
        assert hasattr(policy, name), name


def test_docstring_examples_pass():
    results = doctest.testmod(policy, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 15
    assert results.failed == 0


# --- Going up ------------------------------------------------------------


def test_rise_doubles_at_that_batch_then_again_then_holds_at_cap():
    config = policy.make_config(threshold=0.9, cooldown=3, max_micro_batches=4)
    decisions, state = run(
        config, policy.init_state(), [0.5, 0.6, 0.93, 0.95, 0.97, 0.99]
    )
    assert [d.action for d in decisions] == [
        "hold", "hold", "increase", "increase", "hold", "hold",
    ]
    assert [d.micro_batches for d in decisions] == [1, 1, 2, 4, 4, 4]
    assert [d.previous_micro_batches for d in decisions] == [1, 1, 1, 2, 4, 4]
    assert decisions[2].reason == "peak 93% >= threshold 90%"
    assert decisions[2].usage == 0.93
    assert decisions[2].changed and not decisions[1].changed
    assert decisions[4].reason == (
        "peak 97% >= threshold 90%, but the cap of 4 micro-batches is reached"
    )
    assert not decisions[4].changed
    assert state.micro_batches == 4


def test_increase_ignores_cooldown():
    config = policy.make_config(cooldown=50)
    decisions, state = run(config, policy.init_state(), [0.95, 0.95, 0.95])
    assert [d.micro_batches for d in decisions] == [2, 4, 8]
    assert state.batches_since_change == 0


def test_usage_at_exactly_threshold_increases_and_above_one_is_accepted():
    config = policy.make_config(threshold=0.9)
    decision, _ = policy.decide(config, policy.init_state(), 0.9)
    assert decision.action == "increase"
    decision, _ = policy.decide(config, policy.init_state(), 1.7)
    assert decision.action == "increase"
    assert decision.reason == "peak 170% >= threshold 90%"


def test_cap_that_is_not_a_power_of_two_is_respected():
    config = policy.make_config(max_micro_batches=6)
    decisions, _ = run(config, policy.init_state(4), [0.95, 0.95])
    assert [d.micro_batches for d in decisions] == [6, 6]
    assert [d.action for d in decisions] == ["increase", "hold"]


def test_state_above_a_lowered_cap_holds_instead_of_shrinking_on_pressure():
    config = policy.make_config(max_micro_batches=4)
    decision, state = policy.decide(config, policy.init_state(8), 0.95)
    assert decision.action == "hold" and decision.micro_batches == 8
    assert decision.reason == (
        "peak 95% >= threshold 90%, but the cap of 4 micro-batches is reached"
    )
    decision, _ = policy.on_out_of_memory(config, state)
    assert decision.action == "hold" and decision.micro_batches == 8
    assert decision.reason == (
        "out of memory at 8 micro-batches, above the cap of 4"
    )


# --- Going down ----------------------------------------------------------


def test_drop_waits_exactly_cooldown_batches_before_halving():
    config = policy.make_config(threshold=0.9, release=0.7, cooldown=5)
    # At k=4 with no other reading, usage(2) is predicted as 2 * usage(4).
    high = [0.5] * 7  # predicted 100% at 2: no decrease
    low = [0.3] * 5  # predicted 60% at 2
    decisions, state = run(config, policy.init_state(4), high + low)
    assert all(d.action == "hold" for d in decisions[:-1])
    assert decisions[-1].action == "decrease"
    assert decisions[-1].micro_batches == 2
    assert decisions[-1].previous_micro_batches == 4
    assert decisions[-1].reason == (
        "predicted 60% at 2 micro-batches < release 70% for 5 batches"
    )
    assert decisions[-2].reason == (
        "predicted 60% at 2 micro-batches < release 70% for 4 of 5 batches"
    )
    assert decisions[0].reason == (
        "peak 50% < threshold 90%; predicted 100% at 2 micro-batches "
        ">= release 70%"
    )
    assert state.micro_batches == 2
    assert state.calm_batches == 0 and state.batches_since_change == 0


def test_one_high_prediction_restarts_the_calm_streak():
    config = policy.make_config(cooldown=3)
    usages = [0.3, 0.3, 0.5, 0.3, 0.3, 0.3]
    decisions, _ = run(config, policy.init_state(4), usages)
    assert [d.action for d in decisions] == ["hold"] * 5 + ["decrease"]


def test_halves_repeatedly_with_cooldown_between_changes():
    config = policy.make_config(cooldown=2)
    decisions, state = run(config, policy.init_state(8), [0.1] * 6)
    assert [d.micro_batches for d in decisions] == [8, 4, 4, 2, 2, 1]
    assert state.micro_batches == 1
    decisions, _ = run(config, state, [0.1] * 3)
    assert [d.reason for d in decisions] == ["peak 10% < threshold 90%"] * 3


def test_changes_wait_for_cooldown_batches_since_the_last_change():
    config = policy.make_config(cooldown=5)
    # A restored state can carry a long calm streak but a recent change.
    state = policy.init_state(4)._replace(
        batches_since_change=1, calm_batches=10
    )
    decisions, _ = run(config, state, [0.1] * 4)
    assert [d.action for d in decisions] == ["hold", "hold", "hold", "decrease"]
    assert decisions[0].reason == (
        "predicted 20% at 2 micro-batches < release 70% for 11 batches, "
        "2 of 5 batches since the last change"
    )


def test_cooldown_zero_halves_at_first_calm_batch_only():
    config = policy.make_config(cooldown=0)
    decision, _ = policy.decide(config, policy.init_state(4), 0.5)
    assert decision.action == "hold"  # predicted 100% at 2
    decision, _ = policy.decide(config, policy.init_state(4), 0.3)
    assert decision.action == "decrease"
    assert decision.reason.endswith("for 1 batch")


def test_never_halves_below_min_micro_batches():
    config = policy.make_config(cooldown=1, min_micro_batches=2)
    decisions, state = run(config, policy.init_state(8), [0.05] * 5)
    assert [d.micro_batches for d in decisions] == [4, 2, 2, 2, 2]
    assert decisions[-1].reason == "peak 5% < threshold 90%"
    assert state.micro_batches == 2


def test_prediction_oscillating_around_release_never_flaps():
    config = policy.make_config(threshold=0.9, release=0.7, cooldown=4)
    # Predicted usage at 2 alternates 68% / 72% around release.
    usages = [0.34, 0.36] * 100
    state = policy.init_state(4)
    streaks = []
    for usage in usages:
        decision, state = policy.decide(config, state, usage)
        assert decision.action == "hold"
        streaks.append(state.calm_batches)
    assert state.micro_batches == 4
    assert max(streaks) == 1  # each calm batch is followed by a high one


def test_usage_oscillating_between_release_and_threshold_never_flaps():
    config = policy.make_config(threshold=0.9, release=0.7, cooldown=2)
    usages = [0.65, 0.75, 0.85, 0.72, 0.68] * 40
    decisions, state = run(config, policy.init_state(1), usages)
    assert all(d.action == "hold" for d in decisions)
    assert state.micro_batches == 1


def test_after_going_up_a_high_reading_at_half_vetoes_going_back():
    # Documented behaviour: the most recent reading at k/2 is a floor for the
    # prediction, so a k/2 that read above threshold is not returned to.
    config = policy.make_config(cooldown=3)
    decisions, state = run(
        config, policy.init_state(), [0.95] + [0.5] * 25
    )
    assert decisions[0].action == "increase"
    assert all(d.action == "hold" for d in decisions[1:])
    assert decisions[-1].reason == (
        "peak 50% < threshold 90%; predicted 95% at 1 micro-batch "
        ">= release 70%"
    )
    assert state.micro_batches == 2


def test_readings_at_other_counts_expire_so_a_passing_spike_does_not_split_for_good():
    config = policy.make_config(cooldown=3)
    lifetime = config.cooldown * policy.READING_LIFETIME_COOLDOWNS
    decisions, state = run(config, policy.init_state(), [0.95] + [0.3] * 60)
    actions = [d.action for d in decisions]
    # The spike's reading at k=1 vetoes the decrease while it lasts ...
    assert actions[1:lifetime] == ["hold"] * (lifetime - 1)
    # ... then the one-reading rule (2 x 30% = 60% < release 70%) brings k
    # back down after a full cooldown of calm batches.
    assert "decrease" in actions
    assert actions.index("decrease") == lifetime + config.cooldown - 1
    assert state.micro_batches == 1


def test_out_of_memory_marks_never_expire():
    config = policy.make_config(cooldown=1)
    _, state = policy.on_out_of_memory(config, policy.init_state(1))
    decisions, state = run(config, state, [0.1] * 100)
    assert all(d.action == "hold" for d in decisions)
    assert state.micro_batches == 2


def test_two_point_model_allows_a_decrease_the_conservative_rule_forbids():
    config = policy.make_config(cooldown=3)
    # Came down from 8 (read 30% there); at 4 the batches read 38%.
    # Fixed 22% + activations 64%/k: 54% at 2. Everything-scales: 76% at 2.
    fitted = with_observations(4, (8, 0.3))
    decisions, _ = run(config, fitted, [0.38] * 3)
    assert decisions[-1].action == "decrease"
    assert decisions[-1].reason == (
        "predicted 54% at 2 micro-batches < release 70% for 3 batches"
    )
    decisions, _ = run(config, policy.init_state(4), [0.38] * 30)
    assert all(d.action == "hold" for d in decisions)
    assert "predicted 76% at 2 micro-batches >= release 70%" in (
        decisions[-1].reason
    )


# --- Prediction ----------------------------------------------------------


def test_predict_without_readings_is_none():
    assert policy.predict_usage(policy.init_state(2), 1) is None


def test_predict_with_one_reading_is_conservative():
    state = with_observations(2, (2, 0.4))
    assert policy.predict_usage(state, 1) == pytest.approx(0.8)
    assert policy.predict_usage(state, 2) == pytest.approx(0.4)
    # Toward more micro-batches the bound is "nothing shrinks".
    assert policy.predict_usage(state, 4) == pytest.approx(0.4)


def test_predict_with_two_readings_solves_fixed_and_activations():
    # usage(k) = 0.1 + 0.8 / k: 30% at 4, 20% at 8.
    state = with_observations(4, (4, 0.3), (8, 0.2))
    assert policy.predict_usage(state, 2) == pytest.approx(0.5)
    assert policy.predict_usage(state, 1) == pytest.approx(0.9)
    assert policy.predict_usage(state, 16) == pytest.approx(0.15)


def test_predict_uses_current_and_nearest_other_reading():
    # Current 4; 8 is nearer than 32 (which would give another fit).
    state = with_observations(4, (4, 0.3), (8, 0.2), (32, 0.01))
    assert policy.predict_usage(state, 2) == pytest.approx(0.5)


def test_predict_reading_at_target_is_a_floor():
    # Model from 8 and 16 gives 50% at 2, but 2 read 90% directly.
    state = with_observations(8, (2, 0.9), (8, 0.2), (16, 0.15))
    assert policy.predict_usage(state, 2) == pytest.approx(0.9)
    without = with_observations(8, (8, 0.2), (16, 0.15))
    assert policy.predict_usage(without, 2) == pytest.approx(0.5)


def test_predict_falls_back_when_readings_do_not_fall_with_k():
    state = with_observations(4, (2, 0.3), (4, 0.35))
    # A higher reading at more micro-batches fits no model: 2 * 35% at 2,
    # floored by the direct reading of 30% there.
    assert policy.predict_usage(state, 2) == pytest.approx(0.7)


def test_predict_without_reading_at_current_k_anchors_nearest_target():
    state = with_observations(8, (4, 0.3))
    assert policy.predict_usage(state, 2) == pytest.approx(0.6)


def test_predict_is_infinite_at_or_below_an_oom():
    state = with_observations(8, (2, math.inf), (8, 0.2))
    assert policy.predict_usage(state, 2) == math.inf
    assert policy.predict_usage(state, 1) == math.inf
    assert policy.predict_usage(state, 4) == pytest.approx(0.4)


# --- Out of memory -------------------------------------------------------


def test_out_of_memory_doubles_and_is_never_returned_to():
    config = policy.make_config(cooldown=2)
    _, state = run(config, policy.init_state(2), [0.5, 0.6])
    state = state._replace(calm_batches=1, batches_since_change=5)
    decision, state = policy.on_out_of_memory(config, state)
    assert decision.action == "increase"
    assert (decision.previous_micro_batches, decision.micro_batches) == (2, 4)
    assert decision.reason == "out of memory at 2 micro-batches"
    assert decision.usage is None and decision.changed
    assert state.micro_batches == 4
    assert state.oom_count == 1
    assert state.calm_batches == 0 and state.batches_since_change == 0
    assert state.observations == ((2, math.inf),)
    decisions, state = run(config, state, [0.05] * 30)
    assert all(d.action == "hold" for d in decisions)
    assert decisions[-1].reason == (
        "peak 5% < threshold 90%; 2 micro-batches ran out of memory before"
    )
    assert state.micro_batches == 4


def test_out_of_memory_forgets_readings_below_it():
    state = with_observations(4, (1, 0.5), (2, 0.4), (4, 0.3), (8, 0.2))
    _, state = policy.on_out_of_memory(policy.make_config(), state)
    assert state.observations == ((4, math.inf), (8, 0.2))
    assert state.micro_batches == 8


def test_out_of_memory_at_cap_holds_with_clear_reason():
    config = policy.make_config(max_micro_batches=4)
    decision, state = policy.on_out_of_memory(config, policy.init_state(4))
    assert decision.action == "hold"
    assert not decision.changed
    assert decision.reason == "out of memory at the cap of 4 micro-batches"
    assert state.oom_count == 1
    assert state.micro_batches == 4
    # A later successful reading at the same k keeps the out-of-memory mark.
    _, state = policy.decide(config, state, 0.5)
    assert state.observations == ((4, math.inf),)


def test_repeated_out_of_memory_keeps_doubling():
    config = policy.make_config()
    state = policy.init_state()
    for expected in (2, 4, 8):
        decision, state = policy.on_out_of_memory(config, state)
        assert decision.micro_batches == expected
    assert state.oom_count == 3
    assert state.observations == ((4, math.inf),)


# --- Unknown and invalid usage -------------------------------------------


def test_unknown_usage_holds_and_breaks_the_calm_streak():
    config = policy.make_config(cooldown=3)
    _, state = run(config, policy.init_state(4), [0.1, 0.1])
    assert state.calm_batches == 2
    decision, new_state = policy.decide(config, state, None)
    assert decision == policy.Decision(4, 4, "hold", None, "usage unknown")
    assert new_state.calm_batches == 0
    assert new_state.batches_since_change == state.batches_since_change + 1
    assert new_state.observations == state.observations
    decisions, _ = run(config, new_state, [0.1, 0.1, 0.1])
    assert [d.action for d in decisions] == ["hold", "hold", "decrease"]


def test_all_unknown_usage_never_changes_anything():
    decisions, state = run(policy.make_config(cooldown=0), policy.init_state(4),
                           [None] * 10)
    assert all(d.action == "hold" and d.usage is None for d in decisions)
    assert state.micro_batches == 4
    assert state.observations == ()


@pytest.mark.parametrize("usage", [-0.1, float("nan"), True, "0.5"])
def test_invalid_usage_raises(usage):
    with pytest.raises(ValueError, match="`usage` must be None or a number"):
        policy.decide(policy.make_config(), policy.init_state(), usage)


def test_decide_does_not_change_its_input_state():
    state = policy.init_state(2)
    before = tuple(state)
    policy.decide(policy.make_config(), state, 0.95)
    assert tuple(state) == before


def test_observations_replace_same_k_and_stay_small():
    config = policy.make_config(cooldown=1000)
    _, state = run(config, policy.init_state(2), [0.5, 0.4, 0.3])
    assert state.observations == ((2, 0.3),)
    state = policy.init_state()
    for _ in range(12):
        _, state = policy.decide(config, state, 0.95)
    assert state.micro_batches == 4096
    assert len(state.observations) == policy.MAX_OBSERVATIONS
    # The farthest readings went first; the newest is kept.
    assert state.observations[-1] == (2048, 0.95)
    assert state.observations[0][0] == 2048 // 2 ** 7


# --- Configuration -------------------------------------------------------


def test_make_config_defaults():
    config = policy.make_config()
    assert config == policy.PolicyConfig(0.9, 0.7, 20, None, 1)
    assert config == policy.PolicyConfig()


@pytest.mark.parametrize(
    "threshold, release",
    [(0.9, 0.7), (0.8, 0.6), (1, 0.8), (0.4, 0.2), (0.3, 0.15), (0.1, 0.05)],
)
def test_default_release(threshold, release):
    config = policy.make_config(threshold=threshold)
    assert config.release == pytest.approx(release, abs=1e-12)
    assert 0 < config.release < config.threshold


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 1.5},
         "`threshold` must be in (0, 1]. Received: threshold=1.5"),
        ({"threshold": 0},
         "`threshold` must be in (0, 1]. Received: threshold=0"),
        ({"threshold": True},
         "`threshold` must be in (0, 1]. Received: threshold=True"),
        ({"threshold": "0.9"},
         "`threshold` must be in (0, 1]. Received: threshold='0.9'"),
        ({"threshold": float("nan")},
         "`threshold` must be in (0, 1]. Received: threshold=nan"),
        ({"release": 0},
         "`release` must be in (0, 1]. Received: release=0"),
        ({"release": 1.2},
         "`release` must be in (0, 1]. Received: release=1.2"),
        ({"release": False},
         "`release` must be in (0, 1]. Received: release=False"),
        ({"threshold": 0.8, "release": 0.8},
         "`release` must be smaller than `threshold`. "
         "Received: release=0.8, threshold=0.8"),
        ({"threshold": 0.8, "release": 0.95},
         "`release` must be smaller than `threshold`. "
         "Received: release=0.95, threshold=0.8"),
        ({"cooldown": -1},
         "`cooldown` must be an integer >= 0. Received: cooldown=-1"),
        ({"cooldown": 2.0},
         "`cooldown` must be an integer >= 0. Received: cooldown=2.0"),
        ({"cooldown": True},
         "`cooldown` must be an integer >= 0. Received: cooldown=True"),
        ({"max_micro_batches": 0},
         "`max_micro_batches` must be None or an integer >= 1. "
         "Received: max_micro_batches=0"),
        ({"max_micro_batches": 4.0},
         "`max_micro_batches` must be None or an integer >= 1. "
         "Received: max_micro_batches=4.0"),
        ({"max_micro_batches": True},
         "`max_micro_batches` must be None or an integer >= 1. "
         "Received: max_micro_batches=True"),
        ({"min_micro_batches": 0},
         "`min_micro_batches` must be an integer >= 1. "
         "Received: min_micro_batches=0"),
        ({"min_micro_batches": 8, "max_micro_batches": 4},
         "`min_micro_batches` must not exceed `max_micro_batches`. "
         "Received: min_micro_batches=8, max_micro_batches=4"),
    ],
)
def test_make_config_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        policy.make_config(**kwargs)
    assert str(info.value) == message


def test_make_config_accepts_edges():
    config = policy.make_config(
        threshold=1, release=0.999, cooldown=0, max_micro_batches=1
    )
    assert config == policy.PolicyConfig(1.0, 0.999, 0, 1, 1)
    assert isinstance(config.threshold, float)


@pytest.mark.parametrize("micro_batches", [0, -2, 1.0, True, None])
def test_init_state_rejects_bad_micro_batches(micro_batches):
    with pytest.raises(ValueError) as info:
        policy.init_state(micro_batches)
    assert str(info.value) == (
        "`micro_batches` must be an integer >= 1. "
        f"Received: micro_batches={micro_batches!r}"
    )


def test_init_state():
    state = policy.init_state(4)
    assert state == policy.PolicyState(4, 0, 0, (), 0)


# --- Saving and restoring ------------------------------------------------


def test_state_round_trip_through_strict_json_keeps_oom():
    config = policy.make_config(cooldown=5)
    _, state = run(config, policy.init_state(2), [0.4, 0.5])
    _, state = policy.on_out_of_memory(config, state)
    _, state = run(config, state, [0.3, 0.2, 0.25])
    assert state.observations == ((2, math.inf), (4, 0.25))
    text = json.dumps(policy.state_to_dict(state), allow_nan=False)
    restored = policy.state_from_dict(json.loads(text))
    assert restored == state
    assert restored.observations[0][1] == math.inf
    assert restored.oom_count == 1
    assert restored.calm_batches == state.calm_batches == 0
    # The restored state decides exactly like the original.
    assert run(config, restored, [0.1] * 8) == run(config, state, [0.1] * 8)


def test_state_round_trip_mid_streak():
    config = policy.make_config(cooldown=4)
    _, state = run(config, policy.init_state(8), [0.1, 0.1])
    restored = policy.state_from_dict(
        json.loads(json.dumps(policy.state_to_dict(state)))
    )
    assert restored == state and restored.calm_batches == 2
    assert isinstance(restored.observations, tuple)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": 99}, "Unsupported policy state version"),
        ({"micro_batches": 0}, "`micro_batches` must be an integer >= 1"),
        ({"calm_batches": -1}, "`calm_batches` must be an integer >= 0"),
        ({"oom_count": "1"}, "`oom_count` must be an integer >= 0"),
        ({"observations": "x"}, "`observations` must be a list"),
        ({"observations": [[1]]}, "Each observation must be a"),
        ({"observations": [[1, -0.5]]}, "Each observation must be a"),
        ({"observations": [[0, 0.5]]}, "Each observation must be a"),
        ({"observations": [[1, "Infinity"]]}, "Each observation must be a"),
    ],
)
def test_state_from_dict_rejects_bad_data(change, message):
    data = policy.state_to_dict(policy.init_state(2))
    data.update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        policy.state_from_dict(data)


def test_state_from_dict_rejects_non_dict():
    with pytest.raises(ValueError, match="Expected a dictionary"):
        policy.state_from_dict([1, 2])


# --- Clamping ------------------------------------------------------------


@pytest.mark.parametrize(
    "micro_batches, batch_size, expected",
    [(16, 6, 6), (4, 32, 4), (0, 8, 1), (-3, 8, 1), (8, 8, 8), (64, None, 64),
     (1, 1, 1)],
)
def test_clamp_micro_batches(micro_batches, batch_size, expected):
    result = policy.clamp_micro_batches(micro_batches, batch_size)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "micro_batches, batch_size, message",
    [
        (2.0, 8, "`micro_batches` must be an integer. "
                 "Received: micro_batches=2.0"),
        (2, 0, "`batch_size` must be None or an integer >= 1. "
               "Received: batch_size=0"),
        (2, True, "`batch_size` must be None or an integer >= 1. "
                  "Received: batch_size=True"),
    ],
)
def test_clamp_micro_batches_rejects_bad_arguments(
    micro_batches, batch_size, message
):
    with pytest.raises(ValueError) as info:
        policy.clamp_micro_batches(micro_batches, batch_size)
    assert str(info.value) == message


# --- Batch size, out-of-memory limits and evaluation (pure rules) --------


def test_increase_stops_at_the_largest_batch_size_with_a_reason():
    config = policy.make_config()
    decisions, state = run(
        config, policy.init_state(2), [0.95, 0.95, 0.95], largest_batch_size=6
    )
    assert [d.action for d in decisions] == ["increase", "increase", "hold"]
    assert [d.micro_batches for d in decisions] == [4, 6, 6]
    assert decisions[-1].reason == (
        "peak 95% >= threshold 90%, but micro-batches of one sample are "
        "reached (batches of 6 samples)"
    )
    assert state.micro_batches == 6 and state.batches_since_change == 1


def test_cap_below_the_batch_size_is_named_as_the_cap():
    config = policy.make_config(max_micro_batches=2)
    decision, _ = policy.decide(config, policy.init_state(2), 0.95, largest_batch_size=8)
    assert decision.reason.endswith("the cap of 2 micro-batches is reached")


def test_decrease_never_lands_above_the_largest_batch_size():
    config = policy.make_config(cooldown=1)
    decision, state = policy.decide(config, policy.init_state(16), 0.01, largest_batch_size=5)
    assert decision.action == "decrease" and decision.micro_batches == 5
    assert state.micro_batches == 5


def test_largest_batch_size_is_validated():
    with pytest.raises(ValueError, match="Received: largest_batch_size=0"):
        policy.decide(policy.make_config(), policy.init_state(), 0.5, largest_batch_size=0)


def test_out_of_memory_is_capped_by_the_batch_size():
    decision, state = policy.on_out_of_memory(
        policy.make_config(), policy.init_state(4), batch_size=6
    )
    assert decision.action == "increase" and decision.micro_batches == 6
    assert decision.cannot_split is None
    assert state.micro_batches == 6 and state.oom_count == 1


def test_out_of_memory_at_single_samples_cannot_split_and_changes_nothing():
    state = policy.init_state(6)
    decision, after = policy.on_out_of_memory(policy.make_config(), state, batch_size=6)
    assert decision.cannot_split == policy.CANNOT_SPLIT_BATCH_SIZE
    assert decision.action == "hold" and not decision.changed
    assert decision.reason == "out of memory at 6 micro-batches of a batch of 6 samples"
    assert after == state


def test_out_of_memory_at_the_cap_says_cannot_split():
    config = policy.make_config(max_micro_batches=4)
    decision, _ = policy.on_out_of_memory(config, policy.init_state(4), batch_size=64)
    assert decision.cannot_split == policy.CANNOT_SPLIT_CAP


def test_a_replay_sequence_doubles_until_single_samples():
    config = policy.make_config()
    state = policy.init_state()
    seen = []
    while True:
        decision, state = policy.on_out_of_memory(config, state, batch_size=5)
        if decision.cannot_split:
            break
        seen.append(decision.micro_batches)
    assert seen == [2, 4, 5]
    assert decision.cannot_split == policy.CANNOT_SPLIT_BATCH_SIZE
    assert state.oom_count == 3


def test_eval_out_of_memory_doubles_its_own_count_up_to_the_batch():
    config = policy.make_config()
    state = policy.init_eval_state()
    counts = []
    while True:
        decision, new_state = policy.on_eval_out_of_memory(config, state, batch_size=6)
        if decision.cannot_split:
            assert new_state == state
            break
        state = new_state
        counts.append(state.micro_batches)
    assert counts == [2, 4, 6]
    assert state.oom_count == 3
    assert decision.cannot_split == policy.CANNOT_SPLIT_BATCH_SIZE
    assert decision.reason == (
        "out of memory evaluating at 6 micro-batches of a batch of 6 samples"
    )


def test_eval_out_of_memory_respects_the_cap():
    config = policy.make_config(max_micro_batches=3)
    decision, state = policy.on_eval_out_of_memory(
        config, policy.init_eval_state(2), batch_size=100
    )
    assert decision.micro_batches == 3 and state == policy.EvalState(3, 1)
    decision, after = policy.on_eval_out_of_memory(config, state, batch_size=100)
    assert decision.cannot_split == policy.CANNOT_SPLIT_CAP
    assert decision.reason == "out of memory evaluating at the cap of 3 micro-batches"
    assert after == state


@pytest.mark.parametrize(
    "kwargs, echo",
    [({"micro_batches": 0}, "micro_batches=0"), ({"oom_count": -1}, "oom_count=-1")],
)
def test_init_eval_state_rejects_bad_values(kwargs, echo):
    with pytest.raises(ValueError, match=f"Received: {echo}"):
        policy.init_eval_state(**kwargs)


def test_policy_module_imports_neither_tensorflow_nor_keras():
    import ast

    tree = ast.parse(open(policy.__file__).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert not imported & {"tensorflow", "keras", "numpy"}
