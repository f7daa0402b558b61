"""Real faults under a capped allocator, and what the guard makes of them.

A `MemoryHog` layer allocates, in its forward pass, as many MiB as the batch's
markers (column 0 of the input) add up to, so a chosen batch, or a chosen part
of a batch, needs far more memory than the others. Under a 400 MiB cap:

- 16 samples marked 30 MiB (480 MiB) run out of memory whole and fit in halves;
- 16 samples marked 60 MiB (960 MiB) need quarters.

Every real out-of-memory error costs about 10 s (the BFC allocator retries),
so the scenarios share two capped processes that run side by side: one for
the out-of-memory scenarios (seven errors, tests/programs/faults_oom.py),
one for a run killed with SIGKILL and resumed through
`keras.callbacks.BackupAndRestore` (tests/programs/faults_kill.py). The
unconstrained reference runs happen here, under the suite's 8 GiB cap.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import keras

import keras_memguard
from keras_memguard.testing import RESULT_MARKER
from keras_memguard.testing import memory_cap_env
from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
from programs import faults_model
import programs

MIB = 1024 * 1024
CAP_MIB = 400
BATCH = 16
FIT_MIB = 30  # per marked sample: 480 MiB a batch, 240 MiB a half
QUARTER_MIB = 60  # per marked sample: 960 MiB a batch, 240 MiB a quarter


# The plan of the out-of-memory process, fixed here so the references agree.
RANDOM_SEEDS = (11, 22, 33)
RANDOM_BATCHES = 12


def random_plan():
    plan = []
    for seed in RANDOM_SEEDS:
        step = int(np.random.default_rng(seed).integers(1, RANDOM_BATCHES))
        plan.append({"seed": seed, "step": step})
    return plan


TWICE_STEP = 3
TWICE_BATCHES = 8
VAL_SAMPLES = 64
VAL_BATCH = 32



def _script(name, *args, **constants):
    """Source that runs tests/programs/NAME.py with the constants (JSON) and args."""
    return programs.source(name, json.dumps(constants), *args)


def _start(code, *args):
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=memory_cap_env(CAP_MIB),
    )


def _finish(process, timeout=400):
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    result = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    return process.returncode, stdout, stderr, result


def _check(run):
    returncode, stdout, stderr, result = run
    assert returncode == 0 and result is not None, (
        f"status {returncode}\n--- stdout ---\n{stdout[-3000:]}\n"
        f"--- stderr ---\n{stderr[-6000:]}"
    )
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both capped processes, started together (their errors mostly wait)."""
    constants = dict(
        BATCH=BATCH, FIT_MIB=FIT_MIB, QUARTER_MIB=QUARTER_MIB,
        RANDOM_BATCHES=RANDOM_BATCHES, TWICE_STEP=TWICE_STEP,
        TWICE_BATCHES=TWICE_BATCHES, VAL_SAMPLES=VAL_SAMPLES,
        VAL_BATCH=VAL_BATCH, PLAN=random_plan(),
    )
    backup = str(tmp_path_factory.mktemp("faults") / "backup")
    oom = _start(_script("faults_oom", **constants))
    kill_constants = dict(BATCH=BATCH, FIT_MIB=FIT_MIB)
    killed = _finish(_start(_script("faults_kill", backup, "kill", **kill_constants)))
    state_after_kill = None
    state_path = os.path.join(backup, "memguard_state.json")
    if os.path.exists(state_path):
        with open(state_path) as f:
            state_after_kill = json.load(f)
    resumed = _finish(_start(_script("faults_kill", backup, "resume", **kill_constants)))
    return {
        "oom": _finish(oom),
        "killed": killed,
        "state_after_kill": state_after_kill,
        "resumed": resumed,
    }


@pytest.fixture(scope="module")
def common():
    """The capped programs' model and data, for the reference runs here."""
    return vars(faults_model)


def _reference_weights(common, x, y, fits=1):
    """Plain, unguarded training of the same data (8 GiB is plenty)."""
    model = common["make_model"](allocate=False)
    for _ in range(fits):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model, model.get_weights()


def _assert_weights_match(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.array(g), e, rtol=0, atol=1e-5)


# --- (1) An out-of-memory error at a random step, three seeds. ---


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RANDOM_SEEDS)))
def test_oom_at_a_random_step_is_replayed_without_changing_the_result(runs, common, index):
    result = _check(runs["oom"])["random"][index]
    plan = random_plan()[index]
    step = plan["step"]
    # The error struck at the chosen step, and only there.
    oom_counts = [seen[0] for seen in result["seen"]]
    assert oom_counts == [0] * step + [1] * (RANDOM_BATCHES - step)
    assert result["seen"][step][1] == 2
    assert result["samples"] == [RANDOM_BATCHES * BATCH]
    # One optimizer update per batch: the failed attempt applied nothing.
    assert result["iterations"] == RANDOM_BATCHES
    start = step * BATCH
    x, y = common["make_data"](
        RANDOM_BATCHES, [((start, start + BATCH), FIT_MIB)], seed=plan["seed"]
    )
    _, expected = _reference_weights(common, x, y)
    _assert_weights_match(result["weights"], expected)


# --- (2) Twice in a row on the same batch; (5) repeated fits. ---


@pytest.mark.slow
def test_a_batch_that_fits_only_in_quarters_is_replayed_once_straight_to_quarters(runs):
    result = _check(runs["oom"])
    first = result["twice"]["fits"][0]
    # One error, and the replay jumps from what the error says (the memory
    # free against what the step needed): not halves first, then quarters.
    assert [seen for seen in first["seen"][TWICE_STEP - 1 : TWICE_STEP + 1]] == [[0, 1], [1, 4]]
    assert first["samples"] == [TWICE_BATCHES * BATCH]
    messages = result["twice_messages"]
    assert any(m.startswith("out of memory at 1 micro-batch of a batch of 16: "
                            "replaying it with 4 micro-batches (micro-batch 4)")
               for m in messages), messages


@pytest.mark.slow
def test_repeated_fits_keep_micro_batches_and_restore_the_train_function(runs, common):
    twice = _check(runs["oom"])["twice"]
    for fit in twice["fits"]:
        assert fit["samples"] == [TWICE_BATCHES * BATCH]
        assert fit["restored"] and fit["same_function"]
    for fit in twice["fits"][1:]:
        # Every batch of the later fits ran at the k the error taught, and
        # the heavy batch did not run out of memory again.
        assert fit["seen"] == [[1, 4]] * TWICE_BATCHES
        assert fit["micro_batches_log"] == [4]
    assert twice["iterations"] == 3 * TWICE_BATCHES
    start = TWICE_STEP * BATCH
    x, y = common["make_data"](
        TWICE_BATCHES, [((start, start + BATCH), QUARTER_MIB)], seed=5
    )
    _, expected = _reference_weights(common, x, y, fits=3)
    _assert_weights_match(twice["weights"], expected)


# --- (3) Out of memory during validation. ---


@pytest.mark.slow
def test_validation_oom_is_evaluated_in_slices_and_leaves_training_alone(runs):
    validation = _check(runs["oom"])["validation"]
    history = validation["history"]
    # Training: never split, never replayed.
    assert validation["micro_batches"] == 1
    assert validation["oom_recoveries"] == 0
    assert history["micro_batches"] == [1, 1]
    assert history["samples"] == [6 * BATCH, 6 * BATCH]
    # Validation: 1 -> 2 (the first half completes, the second fails) -> 4.
    assert validation["eval_oom_recoveries"] == 2
    assert validation["eval_micro_batches"] == 4
    # Every validation sample counted once, in both epochs.
    assert history["val_samples"] == [VAL_SAMPLES, VAL_SAMPLES]
    assert validation["test_function_restored"]
    messages = validation["messages"]
    assert any("validation batch of 32 at 1 micro-batch: going on from sample 0 "
               "with 2 micro-batches" in m for m in messages), messages
    assert any("validation batch of 32 at 2 micro-batches: going on from sample 16 "
               "with 4 micro-batches (micro-batch 8); training keeps 1 micro-batch" in m
               for m in messages), messages


@pytest.mark.slow
def test_validation_metrics_after_an_oom_equal_an_unconstrained_evaluate(runs, common):
    validation = _check(runs["oom"])["validation"]
    model = common["make_model"](allocate=False)
    model.set_weights([np.array(w, dtype="float32") for w in validation["weights"]])
    val_x, val_y = common["make_data"](
        VAL_SAMPLES // BATCH, [((16, 32), FIT_MIB)], seed=8
    )
    expected = model.evaluate(val_x, val_y, batch_size=VAL_BATCH, verbose=0, return_dict=True)
    history = validation["history"]
    assert history["val_samples"][-1] == expected["samples"] == VAL_SAMPLES
    assert history["val_loss"][-1] == pytest.approx(expected["loss"], rel=1e-6)


@pytest.mark.slow
def test_a_new_evaluation_after_an_oom_starts_from_its_own_metrics(runs, common):
    reuse = _check(runs["oom"])["reuse"]
    assert reuse["micro_batches"] == 2  # the heavy batch ran out of memory whole
    model = common["make_model"](allocate=False)
    heavy_x, heavy_y = common["make_data"](
        VAL_SAMPLES // BATCH, [((0, VAL_BATCH), FIT_MIB / 2)], seed=8
    )
    expected = model.evaluate(heavy_x, heavy_y, batch_size=VAL_BATCH, verbose=0,
                              return_dict=True)
    assert reuse["first"]["samples"] == reuse["second"]["samples"] == VAL_SAMPLES
    assert reuse["second"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)


# --- (4) SIGKILL mid-run, resumed by BackupAndRestore. ---


@pytest.mark.slow
def test_killed_run_resumes_micro_batches_and_counters_from_the_backup(runs, common):
    returncode, stdout, _, _ = runs["killed"]
    assert returncode == -signal.SIGKILL, stdout[-2000:]
    # Killed in epoch 1, after the replay of epoch 0 taught k = 2.
    assert "killed at 1 6 2 1" in stdout
    state = runs["state_after_kill"]
    decided = state["decider"]
    assert decided["micro_batches"] == 2 and decided["oom_count"] == 1
    resumed = _check(runs["resumed"])
    # The new process starts where the state file says.
    assert resumed["seen"] == [[2, 1]]
    # BackupAndRestore resumes at the interrupted epoch: epochs 1 and 2.
    assert resumed["epochs"] == [1, 2]
    assert resumed["samples"] == [10 * BATCH, 10 * BATCH]
    # The heavy batch ran at the restored k: no new out-of-memory error.
    assert resumed["micro_batches"] == 2 and resumed["oom_recoveries"] == 1
    assert all(np.isfinite(np.array(w)).all() for w in resumed["weights"])


# --- Validation memory in process (no error): never drives training. ---


def _peak_of_one_fit(model, x, y, **kwargs):
    monitor = keras_memguard.MemoryMonitor()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    history = model.fit(x, y, verbose=0, callbacks=[monitor, guard], **kwargs)
    return int(history.history["memory_peak_mib"][-1] * MIB)


# The MLP peaks at a few dozen KiB to a few MiB (what earlier tests left in
# memory counts too); a limit under 1 MiB is on purpose.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`memory_limit` of .* is under 1 MiB")
@pytest.mark.parametrize("with_monitor", [False, True])
def test_validation_peaks_do_not_raise_training_micro_batches(common, with_monitor):
    x, y = common["make_data"](4, [], seed=1)
    model = common["make_model"]()
    train_peak = _peak_of_one_fit(model, x, y, batch_size=BATCH, epochs=2)
    limit = 2 * train_peak
    # Validation needs twice the limit on top, training nothing extra. (No
    # more: a large allocation would change how the allocator serves the
    # tests after this one.)
    per_sample_mib = 2 * limit / MIB / VAL_BATCH
    val_x, val_y = common["make_data"](2, [((0, VAL_BATCH), per_sample_mib)], seed=2)
    probe = keras_memguard.AllocatorProbe()
    probe.reset()
    model.evaluate(val_x, val_y, batch_size=VAL_BATCH, verbose=0)
    # Were validation's peak counted as training's, k would double.
    assert probe.sample()[0].peak_bytes > limit
    guard = keras_memguard.MemoryGuard(memory_limit=limit)
    functions = []
    record = keras.callbacks.LambdaCallback(
        on_test_batch_begin=lambda batch, logs: functions.append(type(model.test_function))
    )
    callbacks = [guard, record] + ([keras_memguard.MemoryMonitor()] if with_monitor else [])
    history = model.fit(
        x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=callbacks,
        validation_data=(val_x, val_y), validation_batch_size=VAL_BATCH,
    )
    assert history.history["micro_batches"] == [1, 1, 1]
    assert history.history["val_samples"] == [32.0, 32.0, 32.0]
    # Validation ran through the guard's function, then Keras' came back.
    assert functions == [ReplayTestFunction] * 3
    assert not isinstance(model.test_function, ReplayTestFunction)
    assert guard.micro_batches == 1
    assert guard.eval_micro_batches == 1


# --- ReplayTestFunction on its own (slices without an error). ---


def _dict_model():
    keras.utils.set_random_seed(0)
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
    model = keras.Model(
        {"a": a, "b": b},
        {"out": keras.layers.Dense(1, name="out")(hidden),
         "aux": keras.layers.Dense(2, name="aux")(hidden)},
    )
    model.compile(
        "adam",
        loss={"out": "mse", "aux": "mse"},
        metrics={"out": ["mae"], "aux": [keras.metrics.RootMeanSquaredError()]},
    )
    return model


def test_sliced_evaluation_equals_whole_batch_evaluation_with_weights():
    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(37, 4)).astype("float32"),
         "b": rng.normal(size=(37, 3)).astype("float32")}
    y = {"out": rng.normal(size=(37, 1)).astype("float32"),
         "aux": rng.normal(size=(37, 2)).astype("float32")}
    weights = rng.uniform(0.5, 2.0, size=(37,)).astype("float32")
    model = _dict_model()
    expected = model.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0,
                              return_dict=True)
    function = ReplayTestFunction(model, micro_batches=5)
    keras_function = model.test_function
    function.install()
    assert model.test_function is function
    got = model.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0,
                         return_dict=True)
    assert function.last_batch_size == 37 - 32
    function.restore()
    function.restore()  # twice is harmless
    assert model.test_function is keras_function
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-5), name


def test_an_error_while_evaluating_puts_the_original_test_function_back():
    model = _dict_model()
    x = {"a": np.zeros((8, 4), "float32"), "b": np.zeros((8, 3), "float32")}
    y = {"out": np.zeros((8, 1), "float32"), "aux": np.zeros((8, 2), "float32")}
    model.evaluate(x, y, verbose=0)
    keras_function = model.test_function
    ReplayTestFunction(model, micro_batches=2).install()
    bad_x = {"a": np.zeros((8, 5), "float32"), "b": np.zeros((8, 3), "float32")}
    with pytest.raises(ValueError) as plain:
        _dict_model().evaluate(bad_x, y, verbose=0)
    with pytest.raises(type(plain.value)):
        model.evaluate(bad_x, y, verbose=0)
    assert model.test_function is keras_function
    # And the model evaluates as before.
    assert model.evaluate(x, y, verbose=0, return_dict=True).keys()


def test_replay_test_function_refuses_a_bad_micro_batch_count():
    with pytest.raises(ValueError, match="Received: micro_batches=0"):
        ReplayTestFunction(_dict_model(), micro_batches=0)
