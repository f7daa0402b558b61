"""`MemoryGuard` on Keras' PyTorch backend: real `fit`, real out-of-memory errors.

The slow tests share one child process (`programs/guard_under_cap.py`) that
caps its own address space (`RLIMIT_AS`) after warming up, so torch's CPU
allocator fails as a full device does: Keras' plain `fit` raises
`RuntimeError: ... DefaultCPUAllocator: can't allocate memory`, the planning
guard trains every batch, and the reacting guard replays the batch that ran
out of memory, ending with the weights of an uncapped `MemGuardMixin` model
at the count it replayed with. The fast tests run in this process without a
cap: exactness of the micro-batched `fit`, the plan cache, TensorBoard beside
`MemoryMonitor`, refusals, `evaluate`/`predict`, and the mixin.

Without CUDA the probe reads the process's resident memory, so every guard
here gets a `memory_limit`.
"""

import glob
import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import keras

import keras_memguard
from split_cases import assert_a_small_step_beside_much_memory_in_use_trains_as_plain_fit
from split_cases import assert_only_the_coupled_loss_is_warned_about
from split_cases import test_a_sequential_built_from_its_first_batch_has_one_samples_layer_outputs  # noqa: F401
from split_cases import test_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings  # noqa: F401
from split_cases import test_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain  # noqa: F401
from torch_models import make_failing
from torch_models import max_relative_difference
from torch_models import mlp_data
from torch_models import twins
from keras_memguard.backends.torch.mixin import MemGuardMixin
from keras_memguard.backends.torch.replay import CPU_OUT_OF_MEMORY
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.probes.host import rss_bytes
from keras_memguard.testing import RESULT_MARKER, address_space_cap_env

ON_LINUX = os.path.exists("/proc/self/status")
pytestmark = pytest.mark.skipif(not ON_LINUX, reason="Reads /proc/self/status.")

BIG = 64 * 2**30  # a limit no batch here comes near
BATCH = 20
FIT = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "guard_under_cap.py")
# The child's batch and samples (`guard_under_cap.SAMPLES, BATCH`).
CAPPED_SAMPLES, CAPPED_BATCH = 128, 64
GUARD_TAGS = ("memguard/micro_batches", "memguard/micro_batch_size", "memguard/oom_recoveries")


@pytest.fixture(autouse=True)
def _host_only(monkeypatch):
    """The host path (resident memory), also on a machine with a GPU."""
    monkeypatch.setenv("KERAS_TORCH_DEVICE", "cpu")


class BatchSizes(keras.layers.Layer):
    """Passes its input through; records the batch size of each training call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sizes = []

    def call(self, x, training=None):
        if training:
            self.sizes.append(int(x.shape[0]))
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def make_recorded_mlp():
    """The shared MLP (Adam), with a `BatchSizes` layer after the hidden one."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            BatchSizes(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def sizes_of(model):
    return next(layer for layer in model.layers if isinstance(layer, BatchSizes)).sizes


class BatchLogs(keras.callbacks.Callback):
    """Keeps a copy of every training batch's logs."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs or {}))

    def counts(self):
        return [logs.get("micro_batches") for logs in self.logs]


def scalars(log_dir):
    """`{tag: [(step, value), ...]}` of the run `<log_dir>/memguard`."""
    accumulator = event_accumulator.EventAccumulator(
        os.path.join(str(log_dir), "memguard"),
        size_guidance={event_accumulator.SCALARS: 0},
    )
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def assert_same_history(history, expected, rtol=1e-5):
    for key, values in expected.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=rtol, err_msg=key)


# --- Under a real cap: one child process for the slow tests. ---


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """The child's result, its weights (`.npz`) and how it exited."""
    folder = tmp_path_factory.mktemp("guard_under_cap")
    weights = str(folder / "weights.npz")
    env = {
        **address_space_cap_env(),
        "KERAS_BACKEND": "torch",
        "KERAS_TORCH_DEVICE": "cpu",
        # Module-scoped: the per-test `$KERAS_HOME` is not set yet.
        "KERAS_HOME": str(folder / "keras_home"),
        "PYTHONUNBUFFERED": "1",
    }
    completed = subprocess.run(
        [sys.executable, PROGRAM, weights, "300"],
        capture_output=True, text=True, timeout=400, env=env,
    )
    result = None
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    assert result is not None, (
        f"status {completed.returncode}\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}"
    )
    with np.load(weights) as saved:
        arrays = {name: saved[name] for name in saved.files}
    return completed, result, arrays


def _step(result, name):
    """The child's record of one step, failing with its error if it raised."""
    record = result.get(name)
    assert record is not None, f"the child did not run {name!r}: {sorted(result)}"
    assert "error" not in record or name == "plain", record.get("traceback", record)
    return record


@pytest.mark.slow
def test_under_a_real_cap_plain_fit_fails_and_the_planning_guard_trains_every_batch(capped):
    completed, result, _ = capped
    # A clean exit: no step raised, nothing crashed on the way out.
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "Traceback" not in completed.stderr, completed.stderr[-4000:]

    plain = _step(result, "plain")
    assert plain["error"] is not None, "plain fit did not run out of memory under the cap"
    assert CPU_OUT_OF_MEMORY in plain["error"]
    assert plain["is_out_of_memory"]

    planned = _step(result, "planned")
    steps = 2 * CAPPED_SAMPLES // CAPPED_BATCH
    history = planned["history"]
    assert len(history["loss"]) == 2 and all(math.isfinite(v) for v in history["loss"])
    # Every sample of every epoch reached the metrics, none twice.
    assert history["samples"] == [float(CAPPED_SAMPLES)] * 2
    # Each batch split (the whole batch does not fit), each applied once.
    assert len(planned["counts"]) == steps
    assert all(1 < k <= CAPPED_BATCH for k in planned["counts"]), planned["counts"]
    assert planned["iterations"] == steps
    assert all(math.isfinite(v) for v in planned["losses"])
    assert planned["finite_weights"]
    # An epoch's `micro_batches` is the count its last batch ran at.
    per_epoch = steps // 2
    assert history["micro_batches"] == planned["counts"][per_epoch - 1 :: per_epoch]
    assert history["micro_batches"][-1] == planned["micro_batches"]
    assert isinstance(planned["oom_recoveries"], int) and planned["oom_recoveries"] >= 0


@pytest.mark.slow
def test_under_a_real_cap_the_reacting_guard_replays_and_applies_nothing_twice(capped):
    _, result, weights = capped
    reacting = _step(result, "reacting")
    assert reacting["oom_recoveries"] >= 1
    assert reacting["micro_batches"] > 1
    assert reacting["replay_messages"], "no replay was logged"
    assert reacting["replay_messages"][0].startswith(
        f"out of memory at 1 micro-batch of a batch of {CAPPED_BATCH}: replaying it with "
    ), reacting["replay_messages"]
    # One optimizer update, and the metrics saw each sample once.
    assert reacting["iterations"] == 1
    assert reacting["history"]["samples"] == [float(CAPPED_BATCH)]

    references = _step(result, "references")
    ran_at = reacting["ran_at"]
    assert ran_at > 1
    # Uncapped, the mixin ran at that count from the start, without a replay.
    assert references["mixin_micro_batches"] == ran_at
    count = sum(1 for name in weights if name.startswith("arr_"))
    assert count > 0
    for i in range(count):
        np.testing.assert_allclose(
            weights[f"arr_{i}"], weights[f"mixin_{i}"], rtol=1e-6, atol=1e-7,
            err_msg=f"weight {i}: the replayed run differs from the mixin at k={ran_at}",
        )
        # And, to float tolerance, from the whole batch in one step.
        np.testing.assert_allclose(
            weights[f"arr_{i}"], weights[f"plain_{i}"], rtol=1e-4, atol=1e-6
        )
    np.testing.assert_allclose(
        reacting["history"]["loss"], references["mixin_history"]["loss"], rtol=1e-6
    )


@pytest.mark.slow
def test_under_a_real_cap_a_failed_attempt_leaves_room_for_its_replay(capped):
    """The batch fits at a few micro-batches (the planning guard ran it at
    under a dozen): a replay needs no micro-batch of one sample."""
    _, result, _ = capped
    planned = _step(result, "planned")
    reacting = _step(result, "reacting")
    assert max(planned["counts"]) < CAPPED_BATCH // 2, (planned["counts"], planned["messages"])
    assert reacting["ran_at"] < CAPPED_BATCH, reacting["replay_messages"]


# --- Exactness without a cap. ---


def test_accumulate_at_a_fixed_count_equals_plain_fit():
    x, y = mlp_data(80)
    plain, model = twins(make_recorded_mlp)
    guard = keras_memguard.MemoryGuard(micro_batches=4, plan=False, memory_limit=BIG)
    batches = BatchLogs()
    history = model.fit(x, y, callbacks=[guard, batches], **FIT)
    expected = plain.fit(x, y, **FIT)

    # Really split: four forward passes of 5 samples per batch (after the
    # first split's check of what a training pass of two samples writes).
    assert sizes_of(model) == [2] + [BATCH // 4] * 4 * 8
    assert sizes_of(plain) == [BATCH] * 8
    assert batches.counts() == [4] * 8 and history.history["micro_batches"] == [4, 4]
    assert guard.micro_batches == 4 and guard.oom_recoveries == 0
    # One update per batch, the whole batch's.
    assert int(model.optimizer.iterations.numpy()) == 8
    assert max_relative_difference(plain, model) < 1e-5
    assert_same_history(history, expected)
    assert set(history.history) == set(expected.history) | {"micro_batches"}


def test_shrink_mode_equals_plain_fit_at_the_micro_batch_size():
    x, y = mlp_data(80)
    plain, model = twins(make_recorded_mlp)
    guard = keras_memguard.MemoryGuard(
        micro_batches=4, plan=False, memory_limit=BIG, mode="shrink"
    )
    history = model.fit(x, y, callbacks=[guard], **FIT)
    expected = plain.fit(x, y, **dict(FIT, batch_size=BATCH // 4))

    assert sizes_of(model) == [2] + sizes_of(plain)  # the check's pass first
    assert sizes_of(plain) == [BATCH // 4] * 32
    assert int(model.optimizer.iterations.numpy()) == 32  # an update per micro-batch
    assert max_relative_difference(plain, model) < 1e-5
    assert_same_history(history, expected)


# --- The plan cache. ---


def _first_counts(plan_cache, x, y):
    keras.utils.set_random_seed(0)
    model = make_recorded_mlp()
    # A first split asked for: where memory is plentiful the guard's own
    # choice is the whole batch.
    guard = keras_memguard.MemoryGuard(
        memory_limit=BIG, plan_cache=plan_cache, micro_batches=8
    )
    batches = BatchLogs()
    model.fit(x, y, callbacks=[guard, batches], **FIT)
    return batches.counts(), guard.micro_batches, sizes_of(model)


def test_a_second_fit_of_the_same_setup_starts_from_the_learned_count(caplog):
    x, y = mlp_data(80)
    counts, settled, sizes = _first_counts(True, x, y)
    # A set-up never seen: the first split, then what fits.
    assert counts[0] == 8 and len(sizes) > 8
    assert counts[-1] == settled < 8
    plans = glob.glob(os.path.join(os.environ["KERAS_HOME"], "memguard", "plan-*.json"))
    assert len(plans) == 1, plans

    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        again, _, sizes = _first_counts(True, x, y)
    # A new guard and a new model of the same set-up: no first split.
    assert again[0] == settled, again
    assert sizes[0] == -(-BATCH // settled)  # not the first split's 3 samples
    assert any("of an earlier run" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]

    uncached, _, _ = _first_counts(False, x, y)
    assert uncached[0] == 8, uncached


def test_a_guard_that_cannot_read_memory_trains_whole_batches(tmp_path, monkeypatch, caplog):
    # Without `/proc` (macOS, Windows) the host memory cannot be read: the
    # first split of 8 held for the whole run, with nothing to learn from
    # (BatchNormalization's statistics per micro-batch). Now the guard
    # says it cannot plan and trains whole batches, as plain `fit` does.
    from keras_memguard.backends.torch import probe as torch_probe

    monkeypatch.setattr(torch_probe, "STATUS_PATH", str(tmp_path / "no_status"))
    x, y = mlp_data(120)

    def build():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Dense(3, activation="softmax"),
        ])
        model.compile("adam", "sparse_categorical_crossentropy")
        return model

    plain, guarded = twins(build)
    plain.fit(x, y, **FIT)
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = guarded.fit(x, y, callbacks=[guard], **FIT)
    assert history.history["micro_batches"] == [1, 1]
    assert max_relative_difference(plain, guarded) <= 1e-6
    told = [r.getMessage() for r in caplog.records if "cannot plan" in r.getMessage()]
    assert len(told) == 1 and "keeps no memory statistics" in told[0], told


def test_without_a_limit_on_the_host_the_guard_says_what_pytorch_takes(monkeypatch):
    # A host with neither a cgroup memory limit nor RLIMIT_AS: the error
    # named TensorFlow's allocator settings, which PyTorch does not read.
    from keras_memguard.backends.torch import probe as torch_probe

    monkeypatch.setattr(torch_probe, "_cgroup_limit_bytes", lambda: None)
    monkeypatch.setattr(torch_probe, "_rlimit_as_bytes", lambda: None)
    x, y = mlp_data(40)
    model = make_recorded_mlp()
    weights = model.get_weights()
    with pytest.warns(UserWarning, match="no memory limit is known"):
        with pytest.raises(keras_memguard.MemoryLimitUnknownError) as info:
            model.fit(x, y, batch_size=20, verbose=0, callbacks=[keras_memguard.MemoryGuard()])
    text = str(info.value)
    assert "pass `memory_limit=<bytes>`" in text and "RLIMIT_AS" in text, text
    assert "TF_CPU" not in text and "tf.config" not in text, text
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


# --- TensorBoard, beside MemoryMonitor. ---


@pytest.mark.parametrize("guard_first", [True, False], ids=["guard_first", "monitor_first"])
def test_the_guard_writes_its_scalars_per_batch_beside_the_monitor(tmp_path, guard_first):
    x, y = mlp_data(80)
    keras.utils.set_random_seed(0)
    model = make_recorded_mlp()
    guard = keras_memguard.MemoryGuard(
        memory_limit=BIG, log_dir=str(tmp_path), plan_cache=False, micro_batches=8
    )
    monitor = keras_memguard.MemoryMonitor(log_dir=str(tmp_path), memory_limit=BIG)
    batches = BatchLogs()
    callbacks = [guard, monitor] if guard_first else [monitor, guard]
    history = model.fit(x, y, callbacks=callbacks + [batches], **FIT)

    logged = scalars(tmp_path)
    steps = list(range(1, 9))  # 4 batches, 2 epochs
    for tag in GUARD_TAGS:
        assert [s for s, _ in logged.get(tag, [])] == steps, (tag, sorted(logged))
    counts = batches.counts()
    assert counts[0] == 8  # the first split asked for, then fewer
    assert [v for _, v in logged["memguard/micro_batches"]] == counts
    assert [v for _, v in logged["memguard/micro_batch_size"]] == [
        -(-BATCH // k) for k in counts
    ]
    assert [v for _, v in logged["memguard/oom_recoveries"]] == [0.0] * 8
    # The monitor wrote its own, per batch, to the same run.
    assert [s for s, _ in logged["memory/cpu0/peak_mib"]] == steps
    assert all(v > 0 for _, v in logged["memory/cpu0/peak_mib"])
    # Every callback's keys reach the history and the batch logs.
    for key in ("micro_batches", "memory_peak_mib", "loss"):
        assert len(history.history[key]) == 2, sorted(history.history)
        assert all(key in logs for logs in batches.logs), key
    assert history.history["micro_batches"][-1] == guard.micro_batches


# --- Refusals, evaluate and predict. ---


def test_escalate_is_refused_by_name_and_leaves_the_model_as_it_was():
    x, y = mlp_data(80)
    expected, model = twins(make_recorded_mlp)
    before = model.get_weights()
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, escalate=("remat",))
    with pytest.raises(UnsupportedTrainingSetupError) as caught:
        model.fit(x, y, callbacks=[guard], **FIT)
    message = str(caught.value)
    assert "escalate=('remat',)" in message and "PyTorch" in message, message
    assert sizes_of(model) == []
    assert int(model.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Nothing of the guard is left in the model: a plain fit is Keras' own.
    history = model.fit(x, y, **FIT)
    reference = expected.fit(x, y, **FIT)
    assert "micro_batches" not in history.history
    assert sizes_of(model) == [BATCH] * 8
    assert max_relative_difference(expected, model) < 1e-6
    assert_same_history(history, reference)


def test_evaluate_predict_and_validation_with_the_guard_equal_keras_own():
    x, y = mlp_data(80)
    plain, model = twins(make_recorded_mlp)
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)
    validation = mlp_data(30, seed=9)
    history = model.fit(x, y, validation_data=validation, callbacks=[guard], **FIT)
    expected = plain.fit(x, y, validation_data=validation, **FIT)
    assert max_relative_difference(plain, model) < 1e-5
    for key in ("val_loss", "val_accuracy", "loss"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-5)

    for _ in range(2):
        guarded = model.evaluate(x, y, batch_size=7, verbose=0, callbacks=[guard],
                                 return_dict=True)
        predicted = model.predict(x, batch_size=7, verbose=0, callbacks=[guard])
    unguarded = model.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    assert guarded == pytest.approx(unguarded, rel=1e-6)
    np.testing.assert_allclose(predicted, model.predict(x, batch_size=7, verbose=0), rtol=1e-6)
    assert predicted.shape == (80, 3)
    # Neither touched training's state.
    assert guard.eval_oom_recoveries == 0 and guard.predict_oom_recoveries == 0
    assert not isinstance(model.train_function, ReplayingTrainFunction)


# --- MemGuardMixin with the guard. ---


class GuardedSequential(MemGuardMixin, keras.Sequential):
    pass


def _mixin_fit(x, y, micro_batches=1, callbacks=()):
    """A `make_failing` mixin model (BatchNormalization, Dropout), trained."""
    keras.utils.set_random_seed(0)
    model = make_failing(model_class=GuardedSequential)
    model.micro_batches = micro_batches
    # `Dropout()` draws from torch's global generator: the same draws.
    keras.utils.set_random_seed(1)
    history = model.fit(x, y, callbacks=list(callbacks), **FIT)
    return model, history


def test_a_mixin_model_trains_at_the_guards_count():
    """BatchNormalization normalizes each micro-batch by its own moments:
    the weights tell which count a batch really ran at."""
    x, y = mlp_data(80)
    guard = keras_memguard.MemoryGuard(micro_batches=4, plan=False, memory_limit=BIG)
    model, history = _mixin_fit(x, y, callbacks=[guard])
    at_four, expected = _mixin_fit(x, y, micro_batches=4)
    at_one, _ = _mixin_fit(x, y, micro_batches=1)

    assert guard.micro_batches == 4 and guard.oom_recoveries == 0
    assert history.history["micro_batches"] == [4, 4]
    # The mixin keeps the guard's count, as on TensorFlow.
    assert model.micro_batches == guard.micro_batches
    assert max_relative_difference(at_four, model) < 1e-6
    assert max_relative_difference(at_one, model) > 1e-4  # the count matters here
    assert_same_history(history, expected, rtol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 8
    # After `fit` the model has its own micro-batched function back.
    assert isinstance(model.train_function, ReplayingTrainFunction)
    model.fit(x[:BATCH], y[:BATCH], **dict(FIT, epochs=1))
    assert int(model.optimizer.iterations.numpy()) == 9


def test_shrink_mode_scales_a_float_learning_rate_or_refuses_the_option():
    x, y = mlp_data(80)
    keras.utils.set_random_seed(0)
    model = make_recorded_mlp()
    model.optimizer.learning_rate.assign(0.01)
    guard = keras_memguard.MemoryGuard(
        micro_batches=4, plan=False, memory_limit=BIG, mode="shrink",
        scale_learning_rate=True,
    )
    rates = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: rates.append(
            float(model.optimizer.learning_rate.numpy())
        )
    )
    try:
        model.fit(x, y, callbacks=[guard, record], **FIT)
    except UnsupportedTrainingSetupError as error:
        assert "scale_learning_rate" in str(error)
        return
    assert int(model.optimizer.iterations.numpy()) == 32  # shrink: 4 updates a batch
    # While micro-batching, the rate is divided by the count; restored after.
    assert rates and all(rate == pytest.approx(0.01 / 4) for rate in rates), rates
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.01)


def test_micro_batches_of_a_stateful_rnn_are_refused_and_so_is_a_batch_size_search():
    # Its state holds a row per sample of 16, a batch size the model fixes.
    # (Keras' own `fit` of a stateful LSTM fails on this backend with or
    # without the guard: its state is updated in place inside the graph.)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(batch_shape=(16, 6, 3))
    hidden = keras.layers.LSTM(8, stateful=True, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("adam", "mse")
    x = np.random.default_rng(0).normal(size=(64, 6, 3)).astype("float32")
    y = x[:, -1, :1]
    weights = model.get_weights()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    with pytest.raises(UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[guard])
    with pytest.raises(UnsupportedTrainingSetupError, match="stateful layers \\('lstm'\\)"):
        keras_memguard.find_batch_size(model, x, y, memory_limit=1 << 30, verbose=0)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


class OwnStepSequential(keras.Sequential):
    """A `train_step` of its own: Keras' step, its loss halved, one more log."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        loss = 0.5 * self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        self.zero_grad()
        loss.backward()
        weights = self.trainable_weights
        self.optimizer.apply([w.value.grad for w in weights], weights)
        return {"half_loss": loss.detach(), "own": 1.0}


def test_an_own_train_step_trains_whole_batches_as_plain_fit(caplog):
    # The guard used to train such a model with Keras' own step instead,
    # silently (another loss, the step's own logs gone).
    def build():
        keras.utils.set_random_seed(0)
        model = OwnStepSequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3, activation="softmax"),
        ])
        model.compile("adam", "sparse_categorical_crossentropy")
        return model

    x, y = mlp_data()
    plain, model = build(), build()
    # Dropout draws from torch's global generator: the same draws for both.
    keras.utils.set_random_seed(1)
    want = plain.fit(x, y, **FIT).history
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)
    keras.utils.set_random_seed(1)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        got = model.fit(x, y, callbacks=[guard], **FIT).history
    assert got["micro_batches"] == [1, 1] and got["own"] == [1.0, 1.0], got
    assert max_relative_difference(model, plain) < 1e-6
    np.testing.assert_allclose(got["half_loss"], want["half_loss"], rtol=1e-6)
    told = [r.getMessage() for r in caplog.records if "trains the batches of OwnStepSequential whole" in r.getMessage()]
    assert len(told) == 1 and "compute_loss" in told[0], told


def test_an_own_train_step_out_of_memory_is_named_and_micro_batches_are_refused():
    import torch

    x, y = mlp_data()
    model = make_failing({1}, torch.OutOfMemoryError, "CUDA out of memory.", model_class=OwnStepSequential)
    guard = keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)
    with pytest.raises(keras_memguard.MicroBatchTooLargeError) as info:
        model.fit(x, y, callbacks=[guard], **FIT)
    assert f"Out of memory on a batch of {BATCH} samples, which MemoryGuard cannot split: " \
        "the own `train_step` of OwnStepSequential" in str(info.value), info.value
    split = keras_memguard.MemoryGuard(memory_limit=BIG, plan=False, micro_batches=4)
    with pytest.raises(UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        make_failing(model_class=OwnStepSequential).fit(x, y, callbacks=[split], **FIT)


def test_an_own_loss_is_warned_about_only_where_it_couples_the_samples(recwarn):
    assert_only_the_coupled_loss_is_warned_about(
        recwarn,
        lambda: keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4),
    )


def test_a_small_step_beside_much_memory_in_use_trains_as_plain_fit():
    # The process's resident memory is the memory in use on the host: a
    # limit a few hundred MiB above it split every model's second batch.
    assert_a_small_step_beside_much_memory_in_use_trains_as_plain_fit(rss_bytes)


def test_a_step_that_fails_whole_too_ends_fit_as_plain_fit_without_blaming_the_split(caplog):
    # A position embedding computed once, outside the step
    # (`Embedding(T, W)(arange(T))`): its graph is freed by the first
    # backward pass, so plain `fit` raises at its second step. The guard's
    # split raised it at the second micro-batch, warned that the model's
    # code assumes the batch size, then raised it again running the batch
    # whole. Now only the error, as plain `fit`.
    def decoder():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((16,), dtype="int32")
        positions = keras.layers.Embedding(16, 8)(keras.ops.arange(16))
        hidden = keras.layers.Embedding(50, 8)(tokens) + positions
        model = keras.Model(tokens, keras.layers.Dense(50)(hidden))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, size=(64, 16)), rng.integers(0, 50, size=(64, 16))
    with pytest.raises(RuntimeError) as plain:
        decoder().fit(x, y, batch_size=32, verbose=0)
    model = decoder()
    # Room for a sliver of the step: the first batch is split.
    guard = keras_memguard.MemoryGuard(memory_limit=rss_bytes() + (64 << 10), plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        with pytest.raises(RuntimeError) as guarded:
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[guard])
    assert str(guarded.value) == str(plain.value)
    assert "backward through the graph a second time" in str(guarded.value)
    told = [r.getMessage() for r in caplog.records if "fails on a micro-batch" in r.getMessage()]
    assert told == [], told
