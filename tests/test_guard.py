"""MemoryGuard: decisions from real per-batch peaks, OOM replay, state."""

import concurrent.futures
import gc
import logging
import os
import re
import weakref

import numpy as np
import pytest
import tensorflow as tf

import keras

import keras_memguard
from helpers import SampleCount
from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard.backends.tensorflow import run as tf_run
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.testing import run_with_memory_cap
from keras_memguard.backends.tensorflow.replay import ReplayTrainFunction
import programs
from programs.common import design_cnn
from split_cases import test_a_sequential_built_from_its_first_batch_has_one_samples_layer_outputs  # noqa: F401
from split_cases import test_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings  # noqa: F401
from tensorboard.backend.event_processing import event_accumulator

MIB = 1024 * 1024



def make_mlp(seed=0):
    """A small CNN whose activations, not its weights, dominate its peak."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((24, 24, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse", metrics=[SampleCount()])
    return model


def make_data(n=200, seed=1):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 24, 24, 3)).astype("float32"),
        rng.normal(size=(n, 1)).astype("float32"),
    )


def first_batch_peak(model, x, y, batch_size):
    """The steady allocator peak of a guarded batch at one micro-batch."""
    # An earlier test's tensors, still held here and freed before the fit
    # that uses this figure, would put it above that fit's own peak.
    gc.collect()
    monitor = keras_memguard.MemoryMonitor()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    history = model.fit(
        x[: 2 * batch_size], y[: 2 * batch_size], batch_size=batch_size,
        epochs=2, verbose=0, callbacks=[monitor, guard],
    )
    return int(history.history["memory_peak_mib"][-1] * MIB)


# --- Out-of-memory replay under a real cap (one subprocess, three OOMs). ---


@pytest.fixture(scope="module")
def capped_run():
    # Two processes side by side: most of each one's time is the
    # allocator's 10 s wait before each out-of-memory error.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(
                run_with_memory_cap,
                programs.source("guard_under_cap", part),
                memory_limit_mib=600,
                timeout=400,
            )
            for part in ("fit", "too_large")
        ]
        return {**runs[0].result().result, **runs[1].result().result}


@pytest.mark.slow
def test_plain_fit_runs_out_of_memory_under_the_cap(capped_run):
    assert capped_run["plain"] == "oom"


@pytest.mark.slow
def test_guarded_fit_completes_every_epoch_without_losing_a_sample(capped_run):
    assert capped_run["samples"] == [320.0, 320.0]
    assert capped_run["oom_recoveries"] >= 1
    assert capped_run["micro_batches"] >= 2
    # One optimizer update per batch: the failed attempt applied nothing.
    assert capped_run["iterations"] == 2 * 2


@pytest.mark.slow
def test_replay_is_logged_with_what_changed(capped_run):
    assert any(
        message.startswith("out of memory at 1 micro-batch of a batch of 256: "
                           "replaying it with 2 micro-batches (micro-batch 128)")
        for message in capped_run["messages"]
    ), capped_run["messages"]


@pytest.mark.slow
def test_replayed_training_matches_unconstrained_training(capped_run):
    model = design_cnn()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 10, size=(320,))
    model.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0)
    for expected, got in zip(model.get_weights()[-2:], capped_run["weights"]):
        np.testing.assert_allclose(np.array(got), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_single_sample_that_does_not_fit_raises_a_clear_error(capped_run):
    message, limit, peak = capped_run["too_large"]
    assert limit == 600 * MIB
    assert "single sample" in message
    assert "600.0 MiB" in message
    assert "mixed precision" in message
    assert "Tried: 1 micro-batch of one sample; no rung was allowed" in message
    assert 'escalate=("remat",)' in message
    assert peak is None or f"{peak / MIB:.1f} MiB" in message
    # A rung the guard would refuse for this model is not offered: it says why.
    message = capped_run["too_large_branched"][0]
    assert "single sample" in message and "mixed precision" in message
    assert 'escalate=("remat",)' not in message
    assert "the remat rung cannot be used on this model: layer '" in message, message
    assert "does not take the previous layer's output" in message, message


# --- Decisions from measured peaks (in process, no OOM). ---


@pytest.mark.slow
def test_guard_doubles_micro_batches_when_the_peak_reaches_the_threshold(caplog, tmp_path):
    x, y = make_data()
    model = make_mlp()
    peak = first_batch_peak(model, x, y, batch_size=50)
    # A limit that puts the measured k=1 peak at ~95%, far above 2x headroom.
    guard = keras_memguard.MemoryGuard(
        threshold=0.9, memory_limit=int(peak / 0.95), log_dir=str(tmp_path), plan=False
    )
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(logs["micro_batches"])
    )
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard, record])
    assert seen[0] == 2
    assert guard.micro_batches >= 2
    lines = [r.getMessage() for r in caplog.records if "micro-batches 1 -> 2" in r.getMessage()]
    assert lines and re.match(
        r"peak (9\d|1\d\d)% of \d+ MiB >= threshold 90%: micro-batches 1 -> 2 "
        r"\(micro-batch 25\)$",
        lines[0],
    ), lines

    acc = event_accumulator.EventAccumulator(str(tmp_path / "memguard"))
    acc.Reload()
    k_points = acc.Scalars("memguard/micro_batches")
    assert [p.step for p in k_points] == [1, 2, 3, 4]
    assert k_points[0].value == 2
    assert acc.Scalars("memguard/micro_batch_size")[0].value == 25
    assert [p.value for p in acc.Scalars("memguard/oom_recoveries")] == [0, 0, 0, 0]


def test_guard_keeps_one_micro_batch_when_memory_is_plentiful():
    x, y = make_data()
    model = make_mlp()
    guard = keras_memguard.MemoryGuard(threshold=0.9, memory_limit=1 << 40)
    history = model.fit(x, y, batch_size=50, epochs=2, verbose=0, callbacks=[guard])
    assert history.history["micro_batches"] == [1, 1]
    assert history.history["samples"] == [200.0, 200.0]


class _Garbage:
    """A reference cycle holding a tensor: freed only by the cycle collector."""

    def __init__(self):
        self.itself = self
        self.tensor = keras.ops.zeros((16, 1024, 1024))  # 64 MiB


def _first_batch_sees_garbage(call, memory_limit=None):
    """Whether a tensor left in a reference cycle before `call` is alive at its first batch.

    `memory_limit=None`: four times the memory in use with the garbage.
    """
    x, y = make_data()
    model = make_mlp()
    alive_at_first_batch = []

    def record_garbage(batch, logs):
        alive_at_first_batch.append(garbage() is not None)

    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=record_garbage, on_test_batch_begin=record_garbage
    )
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        garbage = weakref.ref(_Garbage())
        assert garbage() is not None
        if memory_limit is None:
            memory_limit = 4 * tf.config.experimental.get_memory_info("CPU:0")["current"]
        guard = keras_memguard.MemoryGuard(memory_limit=memory_limit)
        getattr(model, call)(x, y, batch_size=50, verbose=0, callbacks=[guard, record])
    finally:
        if was_enabled:
            gc.enable()
    return alive_at_first_batch[0]


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_garbage_from_before_the_first_call_is_freed_before_its_first_batch(call):
    # Python's cycle collector runs when allocations say, not when a step
    # starts: garbage left by an earlier `fit` (a failed one's tensors) freed
    # during the first measured step made its demand read low.
    assert _first_batch_sees_garbage(call) is False


def test_garbage_is_left_to_python_where_the_memory_in_use_is_a_sliver_of_the_limit():
    # A full collection takes a while in a large process; garbage within
    # under 2% of the limit cannot move a reading by much.
    assert _first_batch_sees_garbage("fit", memory_limit=1 << 40) is True


def test_guard_can_start_split():
    x, y = make_data()
    model = make_mlp()
    guard = keras_memguard.MemoryGuard(
        micro_batches=4, memory_limit=1 << 40, cooldown=1000, plan=False
    )
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(logs["micro_batches"])
    )
    history = model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard, record])
    assert seen == [4, 4, 4, 4]
    assert history.history["samples"] == [200.0]


@pytest.mark.parametrize("plan", [True, False])
def test_the_decider_knows_the_layer_outputs_with_and_without_planning(plan):
    # They bound a replay's demand from below: without them a replay after
    # an error under plan=False was sized from the failed allocation alone
    # (the design CNN at batch 256 under 300 MiB: 1, 2, 3, 6 micro-batches,
    # three errors, where they give 1, 3, 6).
    model = design_cnn()
    rng = np.random.default_rng(0)
    x = rng.random((16, 64, 64, 3), dtype=np.float32)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan=plan, plan_cache=False)
    model.fit(x, rng.integers(0, 10, 16), batch_size=8, verbose=0, callbacks=[guard])
    sample_bytes = guard.controller.state.sample_bytes
    assert sample_bytes == oom_explanation.layer_output_bytes(model) > 0


@pytest.mark.slow
def test_state_persists_across_fits_and_train_function_is_restored():
    x, y = make_data()
    model = make_mlp()
    peak = first_batch_peak(model, x, y, batch_size=50)
    guard = keras_memguard.MemoryGuard(memory_limit=int(peak / 0.95), cooldown=1000, plan=False)
    model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard])
    k = guard.micro_batches
    assert k >= 2
    # After fit the model trains as before, without the guard's function.
    assert not isinstance(model.train_function, ReplayTrainFunction)
    history = model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard])
    assert history.history["micro_batches"][0] >= k
    history = model.fit(x, y, batch_size=50, epochs=1, verbose=0)
    assert "micro_batches" not in history.history
    assert history.history["samples"] == [200.0]


def test_monitor_and_guard_share_the_allocator_reads_of_each_batch():
    x, y = make_data()
    model = make_mlp()
    reader = shared_reader(model)
    calls = []
    original = reader.probe.sample

    def counting_sample():
        calls.append(1)
        return original()

    reader.probe.sample = counting_sample
    model.fit(
        x, y, batch_size=50, epochs=2, verbose=0,
        callbacks=[keras_memguard.MemoryMonitor(), keras_memguard.MemoryGuard(memory_limit=1 << 40)],
    )
    # Per batch: the memory in use before it (the guard plans from what is
    # free), and its peak after it, which the monitor shares; once at the
    # start, the memory in use beside the limit (whether to collect garbage).
    assert len(calls) == 2 * 4 * 2 + 1



def test_each_batch_runs_at_the_deciders_count_and_an_unchanged_plan_is_reused(
    monkeypatch,
):
    x, y = make_data()
    model = make_mlp()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan_cache=False)
    computed = []
    real_plan = decider.plan
    monkeypatch.setattr(
        decider, "plan", lambda *args: computed.append(args) or real_plan(*args)
    )
    planned = []
    plan_batch = tf_run.TfTrainingRun.plan_batch

    def checked_plan_batch(run, batch_size, sample_size, data):
        k = plan_batch(run, batch_size, sample_size, data)
        batch = decider.Batch(
            batch_size, sample_size, run._before, guard.controller.limit_bytes
        )
        planned.append((k, real_plan(guard.config, guard.state, batch)[0].micro_batches))
        return k

    # The run hands its `plan_batch` to the replaying function.
    monkeypatch.setattr(tf_run.TfTrainingRun, "plan_batch", checked_plan_batch)
    model.fit(x, y, batch_size=50, epochs=2, verbose=0, callbacks=[guard])
    assert len(planned) == 8
    assert all(k == fresh for k, fresh in planned), planned
    # The same state, batch shape and memory in use: not computed again.
    controller = guard.controller
    outside = controller.state.outside_bytes
    assert outside > 0
    computed.clear()
    sample_size = 24.0 * 24 * 3
    k = controller.plan(50, sample_size, outside + 1000.0)
    assert controller.plan(50, sample_size, outside + 1000.0) == k
    assert len(computed) == 1
    # Memory in use that moves under the recent high held outside the step
    # is planned for that high: computed once, then reused.
    below = controller.plan(50, sample_size, outside - 1000.0)
    assert controller.plan(50, sample_size, outside - 2000.0) == below
    assert len(computed) == 2
    fresh = real_plan(
        guard.config,
        guard.state,
        decider.Batch(50, sample_size, outside - 2000.0, controller.limit_bytes),
    )
    assert fresh[0].micro_batches == below
    # A new reading makes a new state: computed afresh.
    controller.observe(decider.Reading(50, k, sample_size, 0.0, float(1 << 35), float(1 << 40)))
    controller.plan(50, sample_size, 1000.0)
    assert len(computed) == 3 and computed[-1][1] is not computed[0][1]


def test_other_errors_pass_through_untouched():
    model = make_mlp()
    boom = RuntimeError("not a memory problem")

    def fail(batch, logs):
        raise boom

    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    x, y = make_data()
    with pytest.raises(RuntimeError) as info:
        model.fit(x, y, batch_size=50, verbose=0,
                  callbacks=[guard, keras.callbacks.LambdaCallback(on_train_batch_end=fail)])
    assert info.value is boom
    bad_x, bad_y = np.zeros((10, 3), "float32"), np.zeros((10, 1), "float32")
    with pytest.raises(Exception) as plain:
        make_mlp().fit(bad_x, bad_y, verbose=0)
    with pytest.raises(type(plain.value)):
        model.fit(bad_x, bad_y, verbose=0,
                  callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 40)])


@pytest.mark.slow
def test_save_and_load_after_guarded_training_give_the_original_class(tmp_path):
    x, y = make_data()
    model = make_mlp()
    peak = first_batch_peak(model, x, y, batch_size=50)
    guard = keras_memguard.MemoryGuard(memory_limit=int(peak / 0.95), plan=False)
    model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard])
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"SampleCount": SampleCount})
    assert type(loaded) is keras.Sequential
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.slow
def test_backup_and_restore_resumes_micro_batches_and_counters(tmp_path):
    x, y = make_data()
    model = make_mlp()
    peak = first_batch_peak(model, x, y, batch_size=50)
    backup = str(tmp_path / "backup")

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise KeyboardInterrupt

    guard = keras_memguard.MemoryGuard(memory_limit=int(peak / 0.95), cooldown=1000, backup_dir=backup, plan=False)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=50, epochs=3, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), guard, Interrupt()])
    k = guard.micro_batches
    assert k >= 2
    assert os.path.exists(os.path.join(backup, "memguard_state.json"))

    resumed = keras_memguard.MemoryGuard(memory_limit=int(peak / 0.95), cooldown=1000, backup_dir=backup, plan=False)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(resumed.micro_batches)
    )
    history = model.fit(x, y, batch_size=50, epochs=3, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup), resumed, record])
    assert seen[0] == k
    assert len(history.history["loss"]) == 2  # resumed at epoch 1


def test_a_backup_of_another_models_training_is_not_gone_on_from(tmp_path, caplog):
    # A search's trials share the guard's `backup_dir` (each trial a deep
    # copy): the next trial's model went on from the last trial's state,
    # its readings and count, as a preempted run of the same model does.
    backup = str(tmp_path / "backup")
    x, y = make_data(n=64)

    def wider():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((24, 24, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1),
        ])  # fmt: skip
        model.compile(optimizer="adam", loss="mse")
        return model

    def fit(model, **options):
        guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, backup_dir=backup, **options)
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda batch, logs: seen.append(guard.micro_batches)
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="keras_memguard"):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[guard, record])
        told = [r.getMessage() for r in caplog.records if "does not go on from" in r.getMessage()]
        return guard.session.has_restored_state, seen, told

    fit(make_mlp(), micro_batches=4)
    # Another model (the next trial): it starts afresh, and says why.
    restored, seen, told = fit(wider())
    assert (restored, seen) == (False, [1, 1]) and len(told) == 1, (restored, seen, told)
    assert "another model or set-up" in told[0]
    # The same model again (a preempted run restarted) goes on as before.
    fit(make_mlp(), micro_batches=4)
    restored, seen, told = fit(make_mlp())
    assert (restored, seen, told) == (True, [4, 4], [])


@pytest.mark.slow
def test_mixin_model_follows_the_guard():
    class Net(keras_memguard.MemGuardMixin, keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.conv = keras.layers.Conv2D(16, 3, activation="relu")
            self.pool = keras.layers.GlobalAveragePooling2D()
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.pool(self.conv(x)))

    keras.utils.set_random_seed(0)
    model = Net()
    model.compile(optimizer="adam", loss="mse", metrics=[SampleCount()])
    x, y = make_data()
    model(x[:1])
    peak = first_batch_peak(model, x, y, batch_size=50)
    guard = keras_memguard.MemoryGuard(memory_limit=int(peak / 0.95), cooldown=1000, plan=False)
    history = model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard])
    assert model.micro_batches == guard.micro_batches >= 2
    assert history.history["samples"] == [200.0]


@pytest.mark.slow
def test_shrink_mode_scales_a_float_learning_rate_and_restores_it():
    x, y = make_data()
    model = make_mlp()
    model.optimizer.learning_rate.assign(0.01)
    peak = first_batch_peak(model, x, y, batch_size=50)
    rates = []
    guard = keras_memguard.MemoryGuard(
        memory_limit=int(peak / 0.95), mode="shrink", scale_learning_rate=True, cooldown=1000, plan=False
    )
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: rates.append(
            (guard.micro_batches, float(model.optimizer.learning_rate.numpy()))
        )
    )
    iterations = int(model.optimizer.iterations.numpy())
    model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard, record])
    k, rate = rates[1]
    assert k >= 2 and rate == pytest.approx(0.01 / k)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.01)
    # Shrink mode: one update per micro-batch.
    assert int(model.optimizer.iterations.numpy()) - iterations > 4


# --- Refusals and bad input. ---


@pytest.mark.parametrize(
    "jit_compile", [False, True], ids=["no_xla", "xla"]
)
@pytest.mark.slow
def test_an_own_train_step_without_the_mixin_trains_whole_as_plain_fit(caplog, jit_compile):
    # It used to be refused at the start of `fit` (UnsupportedTrainingSetupError)
    # where plain `fit` trains: nothing in another `train_step` can be split,
    # so its batches run whole, with one warning that says why.
    class Custom(keras.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            return {**logs, "own": 1.0}

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((24, 24, 3))
        hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(inputs))
        model = Custom(inputs, keras.layers.Dense(1)(hidden))
        model.compile("adam", "mse", jit_compile=jit_compile)
        return model

    x, y = make_data()
    plain = build()
    want = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    model = build()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        got = model.fit(
            x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        ).history
        model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[guard])
    assert got["micro_batches"] == [1.0, 1.0]
    assert got["loss"] == want["loss"] and got["own"] == [1.0, 1.0]
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    told = [r.getMessage() for r in caplog.records if "trains the batches of Custom whole" in r.getMessage()]
    assert len(told) == 1 and "MemGuardMixin" in told[0], told


def test_guard_refuses_to_start_without_a_memory_limit(monkeypatch):
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC")
    model = make_mlp()
    x, y = make_data()
    with pytest.warns(UserWarning):
        with pytest.raises(keras_memguard.MemoryLimitUnknownError, match="memory_limit"):
            model.fit(x, y, verbose=0, callbacks=[keras_memguard.MemoryGuard()])
    # Nothing the user trained is lost: the model still trains normally.
    model.fit(x, y, verbose=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": 1.5}, "threshold=1.5"),
        ({"threshold": 0}, "threshold=0"),
        ({"threshold": 0.8, "release": 0.9}, "release=0.9"),
        ({"max_micro_batches": 0}, "max_micro_batches=0"),
        ({"mode": "halve"}, "mode='halve'"),
        ({"cooldown": -1}, "cooldown=-1"),
        ({"memory_limit": -5}, "memory_limit=-5"),
        ({"scale_learning_rate": "yes"}, "scale_learning_rate='yes'"),
        ({"micro_batches": 0}, "micro_batches=0"),
        ({"micro_batches": 8, "max_micro_batches": 4}, "micro_batches=8"),
        ({"backup_dir": 3}, "backup_dir=3"),
        # A file where the folder would be: `fit` raised FileExistsError
        # after its first epoch.
        ({"backup_dir": __file__}, "backup_dir='.*test_guard.py'"),
    ],
)
def test_bad_arguments_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match="Received: .*" + message.replace("(", r"\(")):
        keras_memguard.MemoryGuard(**kwargs)


# A few seconds: out of the fast loop.
@pytest.mark.slow
def test_a_model_trained_with_the_guard_can_be_freed():
    import gc
    import weakref

    x, y = make_data()
    model = make_mlp()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    model.fit(x, y, batch_size=50, epochs=1, verbose=0, callbacks=[guard])
    ref = weakref.ref(model)
    del model, guard
    gc.collect()
    assert ref() is None


_STATE_BEYOND_THE_CAP = """
import keras
import numpy as np

import keras_memguard
from keras_memguard.testing import emit_result

keras.utils.set_random_seed(0)
# 64 MiB of weights: with Adam's two slots 192 MiB, over the 160 MiB cap.
model = keras.Sequential(
    [keras.Input((2048,)), keras.layers.Dense(4096), keras.layers.Dense(2048)]
)
model.compile(optimizer="adam", loss="mse")
x = np.zeros((64, 2048), "float32")
guard = keras_memguard.MemoryGuard(plan_cache=False)
try:
    model.fit(x, x, batch_size=32, epochs=1, verbose=0, callbacks=[guard])
    error = None
except Exception as raised:  # reported to the test
    error = f"{type(raised).__name__}: {raised}"
emit_result({"error": error, "oom_recoveries": guard.oom_recoveries})
"""


@pytest.mark.slow
def test_training_state_that_does_not_fit_is_refused_with_its_cause():
    # Adam's slots run out of memory as Keras creates them before the first
    # step: no split can help, and TensorFlow's own message names one slot.
    run = run_with_memory_cap(_STATE_BEYOND_THE_CAP, memory_limit_mib=160, as_gpu=True)
    error = run.result["error"]
    assert error.startswith(
        "MicroBatchTooLargeError: The model's training state does not fit"
    ), error
    assert "trainable weights take 64.0 MiB, and the optimizer (Adam) keeps" in error, error
    assert run.result["oom_recoveries"] == 0, run.result
