"""Bad or unusual input: a clear refusal, or training that still comes out right.

Each refusal must name the argument and echo the value, and leave the model
as it was: its weights, its train function, and its ability to train.
Each unusual set-up the guard accepts must train with every sample seen
once and, in accumulate mode, the weights of plain training.
"""

import gc
import logging
import sys
import types

import numpy as np
import pynvml
import pytest

import keras
import tensorflow as tf

import keras_memguard
from helpers import SampleCount
from split_cases import InBatchNegatives
from split_cases import PerSampleLoss
from split_cases import CODE_BATCH
from split_cases import fixed_batch_model
from split_cases import own_loss_model
from split_cases import test_find_batch_size_refuses_code_of_a_fixed_batch  # noqa: F401
from split_cases import test_a_plain_fit_after_a_guarded_fit_that_raised_is_plain  # noqa: F401
from split_cases import test_a_plain_fit_after_a_guarded_fit_another_callback_ended_is_plain  # noqa: F401
from split_cases import test_a_split_the_code_refuses_is_named_and_nothing_trained  # noqa: F401
from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
from tensorboard.backend.event_processing import event_accumulator

MIB = 1024 * 1024



def make_model(seed=0, **compile_kwargs):
    """A small MLP, compiled with `compile_kwargs` on top of the defaults."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer="adam", loss="mse", metrics=[SampleCount()], **compile_kwargs
    )
    return model


def make_data(n=200, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 12)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2] + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


# The small MLP peaks under 1 MiB, so the limits that make it micro-batch are
# that small too; the guard's "bytes, not MiB?" warning is expected there.
tiny_limit = pytest.mark.filterwarnings("ignore:`memory_limit` of .* is under 1 MiB")


def forcing_limit(model, x, y, batch_size):
    """A memory limit at which `model`'s steady whole-batch peak reads 100%.

    The guard (threshold 90%) then splits every batch: the micro-batched
    path is exercised. The peak is measured at one micro-batch (planning
    off), with earlier tests' garbage collected first, and the limit is the
    peak itself: the run under test may read up to 10% lower (memory
    another test left in use and freed since) and still split.
    """
    gc.collect()
    monitor = keras_memguard.MemoryMonitor(nvml=False)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan=False)
    history = model.fit(
        x[: 2 * batch_size], y[: 2 * batch_size], batch_size=batch_size,
        epochs=2, verbose=0, callbacks=[monitor, guard],
    )
    return int(history.history["memory_peak_mib"][-1] * MIB)


def assert_weights_equal(model, expected, atol=1e-5):
    for got, want in zip(model.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


# --- Arguments out of range: named, echoed, nothing changed. ---

BAD_ARGUMENTS = [
    ({"threshold": 0}, "`threshold` must be in (0, 1]. Received: threshold=0"),
    ({"threshold": -0.1}, "Received: threshold=-0.1"),
    ({"threshold": 1.5}, "Received: threshold=1.5"),
    ({"threshold": float("nan")}, "Received: threshold=nan"),
    ({"threshold": True}, "Received: threshold=True"),
    ({"threshold": "0.9"}, "Received: threshold='0.9'"),
    ({"release": 0}, "`release` must be in (0, 1]. Received: release=0"),
    ({"release": 1.2}, "Received: release=1.2"),
    ({"release": 0.9}, "`release` must be smaller than `threshold`. "
                       "Received: release=0.9, threshold=0.9"),
    ({"threshold": 0.5, "release": 0.6}, "Received: release=0.6, threshold=0.5"),
    ({"max_micro_batches": 0}, "Received: max_micro_batches=0"),
    ({"max_micro_batches": -1}, "Received: max_micro_batches=-1"),
    ({"max_micro_batches": 2.5}, "Received: max_micro_batches=2.5"),
    ({"max_micro_batches": True}, "Received: max_micro_batches=True"),
    ({"mode": "halve"}, "Received: mode='halve'"),
    ({"mode": "Accumulate"}, "Received: mode='Accumulate'"),
    ({"mode": None}, "Received: mode=None"),
]


@pytest.mark.parametrize(
    "kwargs, message", BAD_ARGUMENTS, ids=[repr(k) for k, _ in BAD_ARGUMENTS]
)
def test_bad_argument_is_refused_naming_it_and_echoing_the_value(kwargs, message):
    with pytest.raises(ValueError) as info:
        keras_memguard.MemoryGuard(**kwargs)
    assert message in str(info.value)
    name = next(iter(kwargs)) if len(kwargs) == 1 else "release"
    assert f"`{name}`" in str(info.value)


@pytest.mark.slow
def test_refused_arguments_leave_a_trained_model_training_on():
    x, y = make_data()
    model = make_model()
    twin = make_model()
    model.fit(x, y, batch_size=50, verbose=0)
    twin.fit(x, y, batch_size=50, verbose=0)
    weights = model.get_weights()
    train_function = model.train_function
    for kwargs, _ in BAD_ARGUMENTS:
        with pytest.raises(ValueError):
            model.fit(x, y, batch_size=50, verbose=0,
                      callbacks=[keras_memguard.MemoryGuard(**kwargs)])
    assert_weights_equal(model, weights, atol=0)
    assert model.train_function is train_function
    # It trains on exactly as a model that never saw the refusals.
    history = model.fit(x, y, batch_size=50, verbose=0)
    twin.fit(x, y, batch_size=50, verbose=0)
    assert history.history["samples"] == [200.0]
    assert_weights_equal(model, twin.get_weights(), atol=0)


# --- steps_per_execution > 1: the replay loops in Python. ---


@pytest.mark.slow
@tiny_limit
def test_steps_per_execution_three_with_a_batch_count_not_divisible_by_three():
    x, y = make_data(200)  # 10 batches of 20: executions of 3, 3, 3 and 1
    val_x, val_y = make_data(100, seed=2)  # 5 batches: executions of 3 and 2
    limit = forcing_limit(make_model(steps_per_execution=3), x, y, batch_size=20)
    model = make_model(steps_per_execution=3)
    plain = make_model(steps_per_execution=3)
    ends = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: ends.append(batch)
    )
    guard = keras_memguard.MemoryGuard(memory_limit=limit, cooldown=1000, plan=False)
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0,
                        validation_data=(val_x, val_y), callbacks=[guard, record])
    expected = plain.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0,
                         validation_data=(val_x, val_y))
    assert guard.micro_batches >= 2
    assert history.history["samples"] == [200.0, 200.0]
    assert history.history["val_samples"] == [100.0, 100.0]
    assert int(model.optimizer.iterations.numpy()) == 20
    # Keras reports once per execution.
    assert len(ends) == 2 * 4
    assert_weights_equal(model, plain.get_weights())
    np.testing.assert_allclose(
        history.history["val_loss"], expected.history["val_loss"], rtol=1e-5
    )


# --- XLA (jit_compile=True). ---


@pytest.mark.slow
@tiny_limit
def test_jit_compiled_model_trains_and_evaluates_like_plain_xla_training():
    x, y = make_data(160)
    val_x, val_y = make_data(50, seed=2)
    model = make_model(jit_compile=True)
    assert model.jit_compile is True
    plain = make_model(jit_compile=True)
    # An XLA step is planned from its compiled program, which a limit forced
    # below the measured peak leaves no count to fit: a fixed count that
    # the program fits (without planning, counts below it are not tried).
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, micro_batches=4, plan=False)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        validation_data=(val_x, val_y), callbacks=[guard])
    expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                         validation_data=(val_x, val_y))
    assert guard.micro_batches >= 2
    assert history.history["samples"] == [160.0, 160.0]
    assert history.history["val_samples"] == [50.0, 50.0]
    assert_weights_equal(model, plain.get_weights())
    np.testing.assert_allclose(
        history.history["val_loss"], expected.history["val_loss"], rtol=1e-5
    )
    # Evaluation in slices (as after an out-of-memory error) under XLA too.
    whole = model.evaluate(val_x, val_y, batch_size=32, verbose=0, return_dict=True)
    sliced = ReplayTestFunction(model, micro_batches=3)
    sliced.install()
    try:
        got = model.evaluate(val_x, val_y, batch_size=32, verbose=0, return_dict=True)
    finally:
        sliced.restore()
    assert got["samples"] == whole["samples"] == 50.0
    assert got["loss"] == pytest.approx(whole["loss"], rel=1e-5)


# --- Refusals at fit start: named, explained, nothing changed. ---


def test_micro_batches_asked_of_an_own_train_step_are_refused_and_the_model_trains_on():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,))
    model = Custom(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", metrics=[SampleCount()])
    x, y = make_data()
    model.fit(x, y, batch_size=50, verbose=0)
    weights = model.get_weights()
    train_function = model.train_function
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError) as info:
        model.fit(x, y, verbose=0, callbacks=[guard])
    message = str(info.value)
    assert "MemoryGuard cannot micro-batch Custom" in message
    assert "Received: micro_batches=4" in message, message
    assert "HINT" in message and "class Custom(MemGuardMixin, ...)" in message
    assert_weights_equal(model, weights, atol=0)
    assert model.train_function is train_function
    history = model.fit(x, y, batch_size=50, verbose=0)
    assert history.history["samples"] == [200.0]


def stateful_lstm(seed=0):
    """An LSTM built with `stateful=True`: its state holds a row per sample of 16."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(batch_shape=(16, 6, 3))
    hidden = keras.layers.LSTM(8, stateful=True, name="lstm")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("adam", "mse")
    x = np.random.default_rng(0).normal(size=(64, 6, 3)).astype("float32")
    return model, x, x[:, -1, :1]


@pytest.mark.slow
def test_a_stateful_rnn_trains_evaluates_and_predicts_whole_batches_as_plain_keras(caplog):
    # A guard that plans splits the first batch it knows nothing about: a
    # stateful layer then refused the micro-batch (ValueError) where plain
    # `fit` trains. Its batches now run whole, and the guard says why.
    plain, x, y = stateful_lstm()
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = (plain.evaluate(x, y, batch_size=16, verbose=0), plain.predict(x, batch_size=16, verbose=0))
    model, _, _ = stateful_lstm()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[guard])
        got = (
            model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[guard]),
            model.predict(x, batch_size=16, verbose=0, callbacks=[guard]),
        )
    assert history.history["micro_batches"] == [1.0, 1.0]
    assert_weights_equal(model, plain.get_weights(), atol=1e-6)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-6)
    told = [r.getMessage() for r in caplog.records if "stateful layers ('lstm')" in r.getMessage()]
    assert len(told) == 1 and "trains the batches of Functional whole" in told[0], told


def test_a_batch_the_models_code_cannot_split_trains_whole_as_plain_keras(caplog):
    # A guard that plans splits a first batch where the memory free is short
    # of many times its layer outputs. Code written for one batch size then
    # failed on the micro-batch (ValueError) and ended `fit`, where plain
    # `fit` trains. Its batches now run whole, and the guard says why.
    plain, x, y = fixed_batch_model()
    plain.fit(x, y, batch_size=CODE_BATCH, epochs=2, shuffle=False, verbose=0)
    model, _, _ = fixed_batch_model()
    gc.collect()
    in_use = tf.config.experimental.get_memory_info("CPU:0")["current"]
    # Room for the step, far short of what runs a first batch whole.
    guard = keras_memguard.MemoryGuard(memory_limit=int(in_use / 0.9) + (64 << 10), plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(
            x, y, batch_size=CODE_BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        )
    assert history.history["micro_batches"] == [1.0, 1.0]
    assert_weights_equal(model, plain.get_weights(), atol=1e-6)
    told = [r.getMessage() for r in caplog.records if "fails on a micro-batch" in r.getMessage()]
    assert len(told) == 1, told
    assert "trains the batches of Functional whole" in told[0], told
    assert "in FixedBatchReshape: Cannot reshape" in told[0], told


def test_on_xla_a_batch_the_models_code_cannot_split_is_not_blamed_on_memory():
    # The compiled program of a split that fails to trace read as one that
    # could not be compiled "within the device's memory".
    model, x, y = fixed_batch_model()
    model.jit_compile = True
    weights = model.get_weights()
    gc.collect()
    in_use = tf.config.experimental.get_memory_info("CPU:0")["current"]
    guard = keras_memguard.MemoryGuard(memory_limit=in_use + (1 << 10), plan_cache=False)
    with pytest.raises(keras_memguard.MicroBatchTooLargeError) as info:
        model.fit(x, y, batch_size=CODE_BATCH, verbose=0, callbacks=[guard])
    message = str(info.value)
    assert "within the device's memory" not in message, message
    assert "MemoryGuard cannot split it: the step of Functional (its code assumes the batch size)" in message, message
    assert "Nothing ran." in message and "keras.ops.shape(x)[0]" in message, message
    assert_weights_equal(model, weights, atol=0)


def test_micro_batches_asked_of_a_stateful_rnn_are_refused_and_the_model_trains_on():
    model, x, y = stateful_lstm()
    weights = model.get_weights()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError) as info:
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[guard])
    message = str(info.value)
    assert "stateful layers ('lstm')" in message, message
    assert "Received: micro_batches=4" in message and "HINT" in message, message
    assert_weights_equal(model, weights, atol=0)
    history = model.fit(x, y, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_find_batch_size_refuses_a_batch_size_that_stateful_layers_fix():
    model, x, y = stateful_lstm()
    weights = model.get_weights()
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError) as info:
        keras_memguard.find_batch_size(model, x, y, memory_limit=1 << 30, verbose=0)
    assert "stateful layers ('lstm')" in str(info.value)
    assert "`batch_shape`" in str(info.value)
    assert_weights_equal(model, weights, atol=0)


@pytest.mark.slow
def test_no_resolvable_memory_limit_is_refused_and_the_model_trains_on(monkeypatch):
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB")
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC")
    model = make_model()
    x, y = make_data()
    model.fit(x, y, batch_size=50, verbose=0)
    weights = model.get_weights()
    train_function = model.train_function
    with pytest.warns(UserWarning):
        with pytest.raises(keras_memguard.MemoryLimitUnknownError) as info:
            model.fit(x, y, verbose=0, callbacks=[keras_memguard.MemoryGuard()])
    message = str(info.value)
    assert "no memory limit is known for CPU:0" in message
    assert "HINT: pass `memory_limit=<bytes>`" in message
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB" in message
    assert_weights_equal(model, weights, atol=0)
    assert model.train_function is train_function
    history = model.fit(x, y, batch_size=50, verbose=0)
    assert history.history["samples"] == [200.0]
    # A limit given by hand is enough.
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    history = model.fit(x, y, batch_size=50, verbose=0, callbacks=[guard])
    assert history.history["samples"] == [200.0]


# --- Datasets of unknown length. ---


@pytest.mark.slow
@tiny_limit
@pytest.mark.parametrize("source", ["filter", "generator"])
def test_dataset_of_unknown_length_trains_every_sample_once_per_epoch(source):
    x, y = make_data(210)  # 10 batches of 20 and one of 10

    def dataset(known_length=False):
        data = tf.data.Dataset.from_tensor_slices((x, y))
        if known_length:
            return data.batch(20)
        if source == "filter":
            data = data.filter(lambda a, b: True)
        else:
            data = tf.data.Dataset.from_generator(
                lambda: iter(zip(x, y)),
                output_signature=(
                    tf.TensorSpec((12,), tf.float32),
                    tf.TensorSpec((1,), tf.float32),
                ),
            )
        return data.batch(20)

    assert dataset().cardinality() == tf.data.UNKNOWN_CARDINALITY
    limit = forcing_limit(make_model(), x, y, batch_size=20)
    model = make_model()
    guard = keras_memguard.MemoryGuard(memory_limit=limit, cooldown=1000, plan=False)
    history = model.fit(dataset(), epochs=2, verbose=0, callbacks=[guard],
                        validation_data=dataset())
    assert guard.micro_batches >= 2
    assert history.history["samples"] == [210.0, 210.0]
    assert history.history["val_samples"] == [210.0, 210.0]
    # One update per batch. (Keras' own train function, at the end of data
    # of unknown length, counts one optimizer iteration more per epoch:
    # 24 here, and different Adam steps.)
    assert int(model.optimizer.iterations.numpy()) == 2 * 11
    # The reference: the same batches with a known length.
    plain = make_model()
    plain.fit(dataset(known_length=True), epochs=2, verbose=0)
    assert int(plain.optimizer.iterations.numpy()) == 2 * 11
    assert_weights_equal(model, plain.get_weights())


# --- Batches that cannot be split. ---


@pytest.mark.slow
def test_batches_of_one_sample_are_never_split_however_high_the_usage(caplog):
    x, y = make_data(12)
    model = make_model()
    plain = make_model()
    # Every batch reads far above the threshold at this limit.
    with pytest.warns(UserWarning, match="under 1 MiB"):
        guard = keras_memguard.MemoryGuard(memory_limit=1024, cooldown=1, plan=False)
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(logs.get("micro_batches"))
    )
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        history = model.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0,
                            callbacks=[guard, record])
    plain.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0)
    assert seen == [1] * 24
    assert guard.micro_batches == 1
    assert history.history["samples"] == [12.0, 12.0]
    assert not [r for r in caplog.records if "micro-batches 1 -> 2" in r.getMessage()]
    assert_weights_equal(model, plain.get_weights())


# --- NVML that fails in the middle of a run. ---


def fake_pynvml(fail_after):
    """A `pynvml` with one GPU whose memory query fails after `fail_after` calls.

    Errors are real `pynvml.NVMLError`s, as NVML raises them.
    """
    fake = types.ModuleType("pynvml")
    fake.NVMLError = pynvml.NVMLError
    fake.memory_calls = 0
    fake.nvmlInit = lambda: None
    fake.nvmlShutdown = lambda: None
    fake.nvmlDeviceGetCount = lambda: 1

    def handle_by_index(index):
        if index != 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ("gpu", 0)

    def memory_info(handle):
        fake.memory_calls += 1
        if fake.memory_calls > fail_after:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return types.SimpleNamespace(total=16 * 2**30, used=6 * 2**30, free=10 * 2**30)

    fake.nvmlDeviceGetHandleByIndex = handle_by_index
    fake.nvmlDeviceGetMemoryInfo = memory_info
    fake.nvmlDeviceGetComputeRunningProcesses = lambda handle: []
    fake.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=37, memory=5)
    return fake


def test_nvml_query_failing_mid_run_is_logged_once_and_training_goes_on(
    monkeypatch, caplog, tmp_path
):
    fake = fake_pynvml(fail_after=3)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    x, y = make_data(200)
    model = make_model()
    monitor = keras_memguard.MemoryMonitor(log_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(x, y, batch_size=50, epochs=2, verbose=0, callbacks=[monitor])
    assert history.history["samples"] == [200.0, 200.0]
    assert fake.memory_calls > 3  # it was asked again after failing
    failures = [r.getMessage() for r in caplog.records if "NVML could not read" in r.getMessage()]
    assert len(failures) == 1, failures
    assert "memory info of gpu0" in failures[0] and "HINT" in failures[0]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "memguard"))
    acc.Reload()
    steps = list(range(1, 9))
    # The allocator's scalars, every batch, before and after the failure.
    assert [p.step for p in acc.Scalars("memory/cpu0/peak_mib")] == steps
    assert [p.step for p in acc.Scalars("memory/cpu0/current_mib")] == steps
    # NVML: memory until it failed, utilization throughout.
    assert [p.step for p in acc.Scalars("memory/gpu0/nvml_used_mib")] == [1, 2, 3]
    assert [p.step for p in acc.Scalars("utilization/gpu0/gpu_percent")] == steps
    assert history.history["memory_peak_mib"][-1] > 0


def test_an_own_loss_that_couples_the_batchs_samples_is_warned_about_once():
    # Split into micro-batches, in-batch negatives are a quarter as many:
    # another objective, with nothing to show it but the loss curve.
    x, y = make_data(n=128)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    with pytest.warns(UserWarning, match="not what its micro-batches' losses add up to") as caught:
        own_loss_model(InBatchNegatives).fit(
            x, y, batch_size=64, epochs=2, verbose=0, callbacks=[guard]
        )
    told = [str(w.message) for w in caught if "add up to" in str(w.message)]
    assert len(told) == 1 and "16 samples give" in told[0], told
    assert "micro_batches=4" in told[0] and "HINT" in told[0], told


@pytest.mark.slow
def test_an_own_loss_that_is_a_mean_over_samples_trains_as_plain_fit_unwarned(recwarn):
    x, y = make_data(n=128)
    plain = own_loss_model(PerSampleLoss)
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    model = own_loss_model(PerSampleLoss)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[guard])
    assert not [w for w in recwarn if "add up to" in str(w.message)]
    assert_weights_equal(model, plain.get_weights(), atol=1e-6)


@pytest.mark.slow
def test_the_own_loss_check_leaves_random_state_and_metrics_as_it_found_them(monkeypatch):
    # With dropout the weights depend on every random draw: the check's
    # forward pass (inference mode) must draw none, and change no metric.
    from keras_memguard import split_loss

    x, y = make_data(n=128)
    runs = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(split_loss, "check_once", lambda *args, **kwargs: None)
        model = own_loss_model(PerSampleLoss, dropout=0.5)
        guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
        history = model.fit(
            x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        )
        runs.append((model.get_weights(), history.history["loss"]))
    (checked, checked_loss), (unchecked, unchecked_loss) = runs
    assert checked_loss == unchecked_loss
    for got, want in zip(checked, unchecked):
        np.testing.assert_array_equal(got, want)


def segmentation_model(loss):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    hidden = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Conv2D(1, 1, activation="sigmoid")(hidden))
    model.compile(keras.optimizers.SGD(0.1), loss)
    return model


@pytest.mark.slow
def test_keras_dice_loss_over_the_whole_batch_is_warned_about_and_per_sample_is_exact(recwarn):
    # keras.losses.Dice() takes one ratio over every pixel of the batch: a
    # micro-batch's Dice is another loss. With `axis` it is per sample.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16, 16, 3)).astype("float32")
    # Masks as segmentation data has them: from empty to mostly foreground.
    density = rng.random((64, 1, 1, 1)) ** 2
    y = (rng.random((64, 16, 16, 1)) < density).astype("float32")

    def fit(loss, guarded):
        model = segmentation_model(loss)
        callbacks = [
            keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
        ] if guarded else []
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        return model

    fit(keras.losses.Dice(), guarded=True)
    told = [str(w.message) for w in recwarn if "add up to" in str(w.message)]
    assert len(told) == 1 and "`keras.losses.Dice`" in told[0] and "8 samples give" in told[0], told
    recwarn.clear()
    per_sample = keras.losses.Dice(axis=(1, 2, 3))
    model = fit(per_sample, guarded=True)
    assert not [w for w in recwarn if "add up to" in str(w.message)]
    assert_weights_equal(model, fit(per_sample, guarded=False).get_weights(), atol=1e-6)



def test_a_stateful_mixin_model_refuses_micro_batches_and_trains_whole():
    class Guarded(keras_memguard.MemGuardMixin, keras.Model):
        pass

    keras.utils.set_random_seed(0)
    inputs = keras.Input(batch_shape=(16, 6, 3))
    hidden = keras.layers.LSTM(8, stateful=True, name="lstm")(inputs)
    model = Guarded(inputs, keras.layers.Dense(1)(hidden))
    model.compile("adam", "mse")
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        model.micro_batches = 4
    assert model.micro_batches == 1
    x = np.random.default_rng(0).normal(size=(64, 6, 3)).astype("float32")
    history = model.fit(x, x[:, -1, :1], batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_an_object_that_is_no_keras_model_is_refused_by_name():
    layer = keras.layers.Dense(1)
    for callback in (keras_memguard.MemoryGuard(), keras_memguard.MemoryMonitor()):
        with pytest.raises(
            keras_memguard.UnsupportedTrainingSetupError,
            match=rf"{type(callback).__name__} works with Keras 3 models\. Received: "
            r"`keras\.src\.layers\.core\.dense\.Dense`, which is not a `keras\.Model`",
        ):
            callback.set_model(layer)
    x, y = make_data(16)
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError, match="find_batch_size works"):
        keras_memguard.find_batch_size(layer, x, y, memory_limit=64 * MIB)


# A Keras 2 model (`tf_keras`) in every entry point, in a process of its own:
# importing Keras 2 beside Keras 3 is left out of the suite's processes.
KERAS_2_MODEL = """
import json
import numpy as np
import tf_keras
import keras_memguard

model = tf_keras.Sequential(
    [tf_keras.layers.Dense(8, activation="relu", input_shape=(4,)), tf_keras.layers.Dense(1)]
)
model.compile("sgd", "mse")
x = np.ones((32, 4), "float32")
y = np.ones((32, 1), "float32")
before = [w.copy() for w in model.get_weights()]
said = {}

def refusal(run):
    try:
        run()
    except keras_memguard.UnsupportedTrainingSetupError as error:
        return str(error)
    return None

for name in ("MemoryGuard", "MemoryMonitor"):
    callback = getattr(keras_memguard, name)()
    said[name] = refusal(
        lambda: model.fit(x, y, batch_size=8, verbose=0, callbacks=[callback])
    )
said["find_batch_size"] = refusal(
    lambda: keras_memguard.find_batch_size(model, x, y, memory_limit=1 << 26)
)

def make_class():
    class Model(keras_memguard.MemGuardMixin, tf_keras.Model):
        pass

said["MemGuardMixin"] = refusal(make_class)
unchanged = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
loss = model.fit(x, y, batch_size=8, verbose=0).history["loss"]
print("RESULT " + json.dumps({"said": said, "unchanged": unchanged, "trained": len(loss)}))
"""


@pytest.mark.slow
def test_a_keras_2_model_is_refused_by_name_everywhere_and_still_trains_plain():
    pytest.importorskip("tf_keras", reason="Keras 2 (tf-keras) is not installed")
    import json
    import subprocess

    completed = subprocess.run(
        [sys.executable, "-c", KERAS_2_MODEL], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(l for l in completed.stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    for user, message in result["said"].items():
        assert message is not None, user
        assert message.startswith(f"{user} works with Keras 3 models. Received: "), message
        assert "Keras 2 model (`tf_keras." in message, message
        assert "HINT: build the model with Keras 3: `import keras`" in message, message
    assert "the class `Model`, made on a Keras 2 model" in result["said"]["MemGuardMixin"]
    # Refused before anything ran: the weights as built, and plain `fit` trains.
    assert result["unchanged"]
    assert result["trained"] == 1


def test_an_epoch_no_batch_ran_in_logs_no_micro_batch_count():
    # An empty dataset's epoch logged `micro_batches: 8`, the first plan,
    # which no batch ran with; plain `fit` logs nothing there.
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")  # no metric: Keras logs `{}`
    x, y = make_data(16)
    empty = tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(8)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    assert model.fit(empty, verbose=0, callbacks=[guard]).history == {}
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[guard]).history
    assert history["micro_batches"] == [1]


def test_a_plan_cache_folder_that_cannot_be_written_is_warned_about_once(monkeypatch, tmp_path):
    # A read-only home: every save failed at INFO level, and each run
    # planned from scratch with nothing said.
    home = tmp_path / "home"
    home.write_text("a file where the folder would be")
    monkeypatch.setenv("KERAS_HOME", str(home))
    model = make_model()
    x, y = make_data(32)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    with pytest.warns(UserWarning, match="cannot write its plan cache under") as record:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[guard])
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[guard])
    said = [w for w in record if "plan cache" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert "HINT: set KERAS_HOME to a writable folder" in str(said[0].message)
