"""Memory that keeps growing: the pure test, `check_growth`, and `MemoryMonitor`'s detector."""

import logging
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_memguard
from keras_memguard import growth
from keras_memguard.testing import run_script_with_memory_cap

MIB = 1024 * 1024
CONFIG = growth.make_config()


# --- The pure test ----------------------------------------------------------


def test_linear_growth_is_found_with_its_rate_and_projection():
    xs = (0.0, 1.0, 2.0, 3.0)
    ys = tuple((100 + 1.5 * x) * MIB for x in xs)
    result = growth.assess(CONFIG, "gpu0", "call", xs, ys, limit_bytes=110 * MIB)
    assert result.growing
    assert result.slope_mib == pytest.approx(1.5)
    # 104.5 MiB now, 5.5 MiB to go at 1.5 per call: 4 more calls after call 3.
    assert result.reaches_limit_at == 7
    text = growth.warning_text(result, "predict calls")
    assert "1.5 MiB per call" in text and "call 7" in text


def test_three_points_are_not_enough():
    result = growth.assess(CONFIG, "gpu0", "call", (0.0, 1.0, 2.0), (1 * MIB, 5 * MIB, 9 * MIB))
    assert not result.growing


def test_a_steady_noisy_floor_is_not_growth():
    rng = random.Random(0)
    alarms = 0
    for _ in range(200):
        xs = [e + (b + 0.5) / 8 for e in range(1, 6) for b in range(8)]
        ys = [100 * MIB + rng.gauss(0, 2 * MIB) for _ in xs]
        alarms += growth.assess(CONFIG, "cpu0", "epoch", xs, ys).growing
    assert alarms <= 4  # alpha 0.05, then rate, rise and both halves


def test_a_single_step_up_is_not_growth():
    # A buffer allocated once in the second epoch: every pair across the
    # step rises, but the later half is flat.
    xs = [e + (b + 0.5) / 8 for e in range(1, 5) for b in range(8)]
    ys = [(100 if x < 1.6 else 140) * MIB for x in xs]
    result = growth.assess(CONFIG, "cpu0", "epoch", xs, ys)
    assert result.p_value < 0.05
    assert not result.growing


def test_a_step_then_a_creep_is_not_growth():
    # Seen on a steady guarded fit's resident memory (3 batches an epoch):
    # flat, one 30 MiB step in the third epoch, then a creep of 0.1 MiB.
    xs = [e + (b + 0.5) / 3 for e in range(1, 6) for b in range(3)]
    ys = [(1165 + (30 if x > 3 else 0) + 0.03 * x) * MIB for x in xs]
    result = growth.assess(CONFIG, "host", "epoch", xs, ys)
    assert result.p_value < 0.05 and result.slope_mib > 0.5
    assert not result.growing


def test_slow_growth_under_the_rate_is_not_told():
    xs = [e + (b + 0.5) / 8 for e in range(1, 6) for b in range(8)]
    ys = [100 * MIB + 0.1 * MIB * x for x in xs]
    assert not growth.assess(CONFIG, "cpu0", "epoch", xs, ys).growing


def test_outliers_do_not_move_the_slope():
    xs = [float(i) for i in range(12)]
    ys = [(10 + 2 * x) * MIB for x in xs]
    ys[3] = 500 * MIB
    ys[8] = 0.0
    result = growth.assess(CONFIG, "cpu0", "epoch", xs, ys)
    assert result.growing
    assert result.slope_mib == pytest.approx(2.0)


def test_block_floors_keep_the_lowest_of_each_block():
    xs, ys = growth.block_floors([9, 3, None, 8, 7, 1, 4, 4], 2, blocks=4)
    assert xs == (2.125, 2.375, 2.625, 2.875)
    assert ys == (3, 8, 1, 4)
    assert growth.block_floors([], 0) == ((), ())


def test_add_points_merges_beyond_max_points():
    config = growth.make_config(max_points=8)
    series = growth.new_series()
    for i in range(20):
        series = growth.add_points(config, series, (float(i),), (float(i),))
    assert len(series.ys) <= 8
    assert series.xs[0] == 0.0 and list(series.ys) == sorted(series.ys)


def test_make_config_echoes_bad_values():
    with pytest.raises(ValueError, match="alpha=2"):
        growth.make_config(alpha=2)
    with pytest.raises(ValueError, match="min_points=2"):
        growth.make_config(min_points=2)


# --- check_growth (in process, TensorFlow) -------------------------------------


@pytest.mark.slow(floor=True)
def test_check_growth_finds_a_list_that_keeps_tensors():
    kept = []

    def leak():
        kept.append(tf.ones((256, 1024)))  # 1 MiB per call

    with pytest.raises(AssertionError, match=r"cpu0 floor .* rises 1\.\d MiB per call"):
        keras_memguard.check_growth(leak, repeats=5)
    results = keras_memguard.check_growth(leak, repeats=5, raise_on_growth=False)
    device = [r for r in results if r.name == "cpu0"][0]
    assert device.growing and device.unit == "call"
    assert device.slope_mib == pytest.approx(1.0, abs=0.3)
    assert device.reaches_limit_at is not None  # the suite's 8 GiB cap
    assert "live_tensors_mib" in [e.key for e in device.evidence]


def test_check_growth_passes_a_loop_that_does_not_leak():
    x = np.random.rand(64, 8).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])

    results = keras_memguard.check_growth(lambda: model.predict(x, verbose=0), repeats=5)
    assert [r.name for r in results] == ["cpu0", "host"]
    assert not any(r.growing for r in results)


def test_check_growth_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats=3"):
        keras_memguard.check_growth(lambda: None, repeats=3)
    with pytest.raises(ValueError, match="fn="):
        keras_memguard.check_growth(None)


# --- MemoryMonitor's detector (in process) -------------------------------------


class _KeepOutputs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def on_train_batch_end(self, batch, logs=None):
        self.outputs.append(tf.ones((64, 1024)))  # 256 KiB per batch


def _fit(callbacks, epochs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8)])
    model.compile("adam", "mse")
    x = np.random.rand(512, 16).astype("float32")
    y = np.random.rand(512, 8).astype("float32")
    return model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=callbacks)


def test_monitor_says_once_that_outputs_kept_by_a_callback_grow(caplog, tmp_path):
    monitor = keras_memguard.MemoryMonitor(log_dir=str(tmp_path), growth=True)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = _fit([monitor, _KeepOutputs()], epochs=6)
    warnings = [r.getMessage() for r in caplog.records if "keeps growing" in r.getMessage()]
    device = [w for w in warnings if w.startswith("Memory keeps growing: cpu0")]
    assert len(device) == 1, warnings
    assert "MiB per epoch" in device[0] and "reaches the limit" in device[0]
    assert "_KeepOutputs.outputs" in device[0]
    rates = history.history["memory_growth_mib_per_epoch"]
    # Growth from the first epoch on (2 MiB each), said by the fourth
    # (epochs 1-3 after the warm-up epoch 0).
    assert len(rates) >= 3
    result = monitor.growth["epoch:cpu0"]
    assert result.growing and result.slope_mib == pytest.approx(2.0, rel=0.2)
    assert "callback_outputs" in [e.key for e in result.evidence]


def test_monitor_stays_quiet_on_a_steady_fit(caplog):
    monitor = keras_memguard.MemoryMonitor(growth=True)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = _fit([monitor], epochs=6)
    assert not [r for r in caplog.records if "keeps growing" in r.getMessage()]
    assert "memory_growth_mib_per_epoch" not in history.history
    assert not monitor.growth["epoch:cpu0"].growing
    assert monitor.growth["epoch:cpu0"].points >= 4


def test_long_epochs_keep_a_bounded_list_of_floors(monkeypatch):
    from keras_memguard.callbacks import monitor as monitor_module

    monkeypatch.setattr(monitor_module, "_MAX_FLOOR_ROWS", 3)
    monitor = keras_memguard.MemoryMonitor(growth=True)
    kept = _KeepOutputs()
    history = _fit([monitor, kept], epochs=5)
    assert monitor.growth["epoch:cpu0"].growing
    assert len(history.history["memory_growth_mib_per_epoch"]) >= 1


def test_monitor_without_growth_keeps_nothing():
    monitor = keras_memguard.MemoryMonitor(growth=False)
    history = _fit([monitor, _KeepOutputs()], epochs=3)
    assert monitor.growth == {}
    assert "memory_growth_mib_per_epoch" not in history.history
    with pytest.raises(ValueError, match="growth='yes'"):
        keras_memguard.MemoryMonitor(growth="yes")


# --- Real growth, each case in its own process ----------------------------------


def _case(name):
    run = run_script_with_memory_cap(["tests/programs/growth_cases.py", name], 2048, timeout=300)
    return run.result


@pytest.mark.slow
def test_models_built_in_a_loop_are_found_across_fit_calls():
    result = _case("models")
    device = result["results"]["fit:cpu0"]
    assert device["growing"] and device["slope_mib"] >= 1.0
    said = [m for level, m in result["messages"] if level == "WARNING"]
    device_said = [m for m in said if "cpu0" in m]
    assert len(device_said) == 1
    # Found after the fourth call (three calls of growth after the first).
    assert "over 4 samples in fit calls" in device_said[0]
    # The models kept (a Sequential model counts its inner functional model
    # too): 4 when said, against 1 when the first fit began.
    assert "8 live Keras models (2 at the start)" in device_said[0]
    assert "per call" in device_said[0] and "reaches the limit" in device_said[0]


@pytest.mark.slow
def test_retracing_on_new_shapes_is_found_with_the_traces_counted():
    result = _case("retrace")
    host = result["results"]["check:host"]
    assert host["growing"] and host["slope_mib"] >= 1.0 and host["points"] == 8, host
    traced = [t for t in host["texts"] if "traced graphs" in t]
    assert traced and "(1 at the start)" in traced[0], host["texts"]


@pytest.mark.slow
def test_a_cached_pipeline_filling_is_found_within_three_epochs():
    result = _case("cache")
    assert result["results"]["epoch:cpu0"]["growing"]
    said = [m for level, m in result["messages"] if level == "WARNING"]
    assert said and all("1 live tf.data pipeline with a .cache()" in m for m in said)
    # 8 epochs; the warm-up epoch 0, then growth told by the end of epoch 3.
    assert len(result["rates"]) >= 5


@pytest.mark.slow
def test_outputs_kept_in_a_fresh_process_and_a_steady_run():
    outputs = _case("outputs")
    assert outputs["results"]["epoch:cpu0"]["growing"]
    assert len(outputs["rates"]) >= 3
    steady = _case("steady")
    assert not [m for level, m in steady["messages"] if level == "WARNING"]
    assert steady["rates"] is None
    # 7 fits, 6 evaluates, 6 predicts, every series tested, none growing.
    for kind in ("fit", "evaluate", "predict"):
        for name in ("cpu0", "host"):
            result = steady["results"][f"{kind}:{name}"]
            assert result["points"] >= 6 and not result["growing"], (kind, name, result)


def test_the_monitors_host_rate_grows_with_the_resident_memory():
    # A steady MobileNetV2 fit's resident memory, 1.1 to 1.4 GiB, crept
    # 1.2 to 1.6 MiB an epoch (bench/bench_growth.py): under the monitor's
    # 0.25% of the floor per epoch; 5 MiB an epoch is told; `check_growth`'s
    # settings ask no share.
    xs = tuple(float(x) for x in range(1, 9))

    def floors(rate_mib):
        return tuple((1400 + rate_mib * x) * MIB for x in xs)

    strict, loose = growth.host_config(), growth.host_config(strict=False)
    assert not growth.assess(strict, "host", "epoch", xs, floors(1.6)).growing
    assert growth.assess(strict, "host", "epoch", xs, floors(5.0)).growing
    assert growth.assess(loose, "host", "epoch", xs, floors(1.6)).growing
