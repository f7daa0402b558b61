"""The one-region reservation of the CPU BFC allocator's limit.

Its effect (a micro-batch that fits from a fresh process keeps fitting
after smaller ones ran) is tested under a real cap in
`tests/test_planning.py`; here: the size it asks for, once per device, and
its argument.
"""

import pytest

import keras_memguard
from keras_memguard.backends.tensorflow import region

MIB = 1024 * 1024


def test_the_region_leaves_room_for_what_the_allocator_may_hold_already():
    # 600 MiB limit, 1 MiB in use: 600 - 1 - 4 * 1 - 16 = 579 MiB.
    assert region.region_bytes(600 * MIB, MIB, MIB) == 579 * MIB
    # The peak so far, not only what is in use now, sizes the headroom.
    assert region.region_bytes(600 * MIB, MIB, 50 * MIB) == 383 * MIB
    # Whole MiB only.
    assert region.region_bytes(600 * MIB + 12345, MIB, MIB) == 579 * MIB


def test_no_region_when_too_little_would_be_left_to_reserve():
    assert region.region_bytes(200 * MIB, 10 * MIB, 25 * MIB) == 74 * MIB
    assert region.region_bytes(200 * MIB, 10 * MIB, 30 * MIB) == 0
    assert region.region_bytes(100 * MIB, 90 * MIB, 90 * MIB) == 0


def test_each_device_is_reserved_at_most_once_per_process(monkeypatch):
    monkeypatch.setattr(region, "_attempted", {"CPU:0": 0})
    assert region.reserve_region("CPU:0", 600 * MIB) == 0
    assert region._attempted == {"CPU:0": 0}


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_reserve_memory_must_be_a_bool(value):
    with pytest.raises(ValueError) as info:
        keras_memguard.MemoryGuard(reserve_memory=value)
    assert "`reserve_memory` must be True or False" in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.slow
def test_a_region_the_allocator_cannot_give_is_logged_and_not_tried_again(
    monkeypatch, caplog
):
    # A region twice the process's cap: the allocator refuses (after its
    # retries). The limit adds the headroom the sizing keeps for the
    # highest peak read so far in this process.
    import tensorflow as tf

    from keras_memguard.backends.tensorflow.probe import highest_peak_bytes

    monkeypatch.setattr(region, "_attempted", {})
    info = tf.config.experimental.get_memory_info("CPU:0")
    peak = max(info["peak"], info["current"], highest_peak_bytes("CPU:0"))
    limit = (
        2 * 8192 * MIB
        + info["current"]
        + region.HEADROOM_PEAK_FACTOR * peak
        + region.HEADROOM_BYTES
    )
    with caplog.at_level("INFO", logger="keras_memguard"):
        assert region.reserve_region("CPU:0", limit) == 0
    assert region._attempted == {"CPU:0": 0}
    assert any("could not reserve" in r.getMessage() for r in caplog.records)
    assert region.reserve_region("CPU:0", limit) == 0


def test_the_probes_remember_the_highest_peak_they_reset():
    import tensorflow as tf

    from keras_memguard.backends.tensorflow.probe import AllocatorProbe
    from keras_memguard.backends.tensorflow.probe import highest_peak_bytes

    probe = AllocatorProbe(devices=["CPU:0"])
    probe.reset()
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tensor = tf.zeros([16 * MIB // 4])
    del tensor
    probe.sample()
    assert tf.config.experimental.get_memory_info("CPU:0")["peak"] < base + 16 * MIB
    assert highest_peak_bytes("CPU:0") >= base + 16 * MIB
    # A reset reads the peak before it drops it.
    tensor = tf.zeros([32 * MIB // 4])
    del tensor
    probe.reset()
    assert highest_peak_bytes("CPU:0") >= base + 32 * MIB


@pytest.mark.slow
def test_a_region_after_a_probe_reset_the_peak_is_sized_from_the_highest_peak():
    # 60 MiB grown and freed, the peak reset by a probe's sample: sized from
    # the reset peak, the region asked for 584 MiB of a 600 MiB cap and
    # failed after 10 s of the allocator's retries.
    import programs
    from keras_memguard.testing import run_with_memory_cap

    result = run_with_memory_cap(
        programs.source("region_after_reset"), memory_limit_mib=600, timeout=120
    ).result
    assert result["peak_after_sample_mib"] < 60, result
    assert not any("could not reserve" in line for line in result["lines"]), result
    # 600 - 4 x 60 - 16 MiB: the rest, reserved.
    assert 300 <= result["reserved_mib"] <= 344, result
