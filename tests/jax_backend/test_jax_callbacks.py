"""The public API on Keras' JAX backend: MemoryMonitor, MemoryGuard, MemGuardMixin.

Real `fit` on JAX's CPU backend. The CPU device keeps no memory statistics,
so the guard plans against `memory_limit` from the compiled step's memory
analysis; an out-of-memory error is made at the one seam JAX's CPU backend
cannot reach at these sizes (the compiled step raises XLA's own error
type), as in `test_jax_replay.py`.
"""

import logging
import os
import re

import jax
import numpy as np
import pytest

import keras

import keras_memguard
from split_cases import assert_only_the_coupled_loss_is_warned_about
from split_cases import assert_summed_loss_evaluates_as_unsliced
from split_cases import test_a_sequential_built_from_its_first_batch_has_one_samples_layer_outputs  # noqa: F401
from split_cases import test_callbacks_deep_copied_as_a_search_does_are_new_with_the_same_settings  # noqa: F401
from jax_models import assert_guarded_whole_as_plain
from jax_models import assert_weights_kept_a_split_refused_and_it_trains_on
from jax_models import make_mlp
from jax_models import make_wide_mlp
from jax_models import max_weight_difference
from jax_models import mlp_data
from jax_models import mlp_layers
from jax_models import twins
from jax_models import wide_data
from xla_errors import autotuner_out_of_memory
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends.jax import StepCache
from keras_memguard.backends.jax import probe as jax_probe
from keras_memguard.backends.jax.compiled import spec_of
from keras_memguard.backends.jax.compiled import step_memory
from keras_memguard.report.cli import make_report
from keras_memguard.backends.compat import jax_state
from keras_memguard.backends.compat import symbolic_build
from tensorboard.backend.event_processing import event_accumulator

BATCH = 512
FIT = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)


def scalars(run_dir):
    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    return {tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def whole_batch_need(build, x, y):
    """What the compiled step of the whole batch needs (k=1), analysed."""
    model = build()
    batch = spec_of((x[:BATCH], y[:BATCH]))
    symbolic_build(model, batch)
    return StepCache(model).memory(1, spec_of(jax_state(model)), batch)


class FailingStep:
    """A compiled step that raises XLA's out-of-memory error when run.

    Its memory analysis is the real one: only running it fails.
    """

    def __init__(self, compiled, micro_batches, runs, fails):
        self.compiled, self.micro_batches, self.runs, self.fails = (
            compiled, micro_batches, runs, fails
        )

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def __call__(self, state, data, *rest):
        # `rest`: what else the step takes (a slice's summed-loss scale).
        self.runs.append(self.micro_batches)
        if self.fails:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes.", 8
            )
        return self.compiled(state, data, *rest)


def failing_step(compiled, failing_counts, runs):
    """`StepCache.compiled`, whose steps at `failing_counts` fail when run."""

    def patched(self, micro_batches, state, data):
        step = compiled(self, micro_batches, state, data)
        return FailingStep(step, micro_batches, runs, micro_batches in failing_counts)

    return patched


def make_sparse_text_mlp():
    # A bag of words straight from scikit-learn's vectorizers: a
    # `scipy.sparse` matrix, which Keras turns into a `BCOO` on JAX.
    model = keras.Sequential([
        keras.Input((300,), sparse=True),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(4),
    ])
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_a_sparse_input_is_split_by_its_rows_and_trains_as_plain_fit(recwarn):
    # A sparse batch used to be split by its stored elements: the batch
    # size read from them, a split step that failed to reshape them
    # (TypeError), and a false warning that the loss couples the samples.
    import scipy.sparse
    from jax.experimental import sparse as jax_sparse

    # 15 words in each row: every batch stores as many elements, so each
    # batch shape compiles once.
    rng = np.random.default_rng(0)
    columns = np.stack([rng.choice(300, 15, replace=False) for _ in range(2048)])
    x = scipy.sparse.csr_matrix(
        (rng.random(columns.size, dtype=np.float32), columns.ravel(), np.arange(0, columns.size + 1, 15)),
        shape=(2048, 300),
    )
    y = rng.integers(0, 4, 2048)
    batch = 1024
    model = make_sparse_text_mlp()
    first = (jax_sparse.BCOO.from_scipy_sparse(x[:batch]), y[:batch])
    symbolic_build(model, spec_of(first))
    need = StepCache(model).memory(1, spec_of(jax_state(model)), spec_of(first))
    fixed = need.argument_bytes + need.output_bytes
    limit = int((fixed + need.temp_bytes / 3) / 0.9)
    assert need.need_bytes > 0.9 * limit

    fit = dict(batch_size=batch, epochs=1, shuffle=False, verbose=0)
    plain, guarded = twins(make_sparse_text_mlp)
    expected = plain.fit(x, y, **fit).history
    guard = keras_memguard.MemoryGuard(memory_limit=limit, plan_cache=False)
    history = guarded.fit(x, y, callbacks=[guard], **fit).history
    assert 1 < guard.micro_batches < batch and guard.oom_recoveries == 0
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["accuracy"], expected["accuracy"], rtol=1e-6)
    assert max_weight_difference(guarded, plain) < 1e-5
    assert not [w for w in recwarn if "add up to" in str(w.message)]
    # Predicted in slices (as `evaluate` slices), by rows.
    slicing = keras_memguard.MemoryGuard(memory_limit=limit // 4, plan_cache=False)
    predicted = guarded.predict(x, batch_size=2048, verbose=0, callbacks=[slicing])
    np.testing.assert_allclose(predicted, plain.predict(x, batch_size=2048, verbose=0), atol=1e-5)


def test_the_monitor_logs_host_memory_and_says_once_the_device_has_no_statistics(
    tmp_path, caplog, monkeypatch
):
    # Said once per process: as in a process where nothing read the device yet.
    monkeypatch.setattr(jax_probe, "_told", set())
    model = make_mlp()
    x, y = mlp_data()
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        history = model.fit(
            x, y, batch_size=20, epochs=2, verbose=0,
            callbacks=[keras_memguard.MemoryMonitor(log_dir=str(tmp_path), nvml=False)],
        )
    assert len(history.history["host_rss_mib"]) == 2
    assert min(history.history["host_rss_mib"]) > 10
    # The device columns are absent (no statistics on a CPU device), said once.
    assert "memory_peak_mib" not in history.history
    said = [r.getMessage() for r in caplog.records if "memory_stats() is None" in r.getMessage()]
    assert len(said) == 1, said
    logged = scalars(os.path.join(str(tmp_path), "memguard"))
    assert len(logged["memory/host/rss_mib"]) == 10  # 5 batches, 2 epochs
    summary = make_report(str(tmp_path))
    assert "memory: no device readings (the device keeps no memory statistics)" in summary
    assert "host memory (RSS)" in summary


def test_the_guard_plans_from_the_compiled_step_and_trains_as_plain_fit(tmp_path, caplog):
    x, y = wide_data(2 * BATCH)
    need = whole_batch_need(make_wide_mlp, x, y)
    # The whole batch's step needs more than the target; a few
    # micro-batches fit.
    fixed = need.argument_bytes + need.output_bytes
    limit = int((fixed + need.temp_bytes / 3) / 0.9)
    assert need.need_bytes > 0.9 * limit
    plain, model = twins(make_wide_mlp)
    guard = keras_memguard.MemoryGuard(memory_limit=limit, log_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        history = model.fit(x, y, callbacks=[guard], **FIT)
    expected = plain.fit(x, y, **FIT)

    assert 1 < guard.micro_batches < BATCH
    assert guard.oom_recoveries == 0
    assert history.history["micro_batches"] == [guard.micro_batches] * 2
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planned")]
    assert len(planned) == 1, planned  # one shape: planned once
    assert "compiled step needs" in planned[0] and "under target 90%" in planned[0]
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert max_weight_difference(model, plain) < 1e-5
    logged = scalars(os.path.join(str(tmp_path), "memguard"))
    assert logged["memguard/micro_batches"] == [float(guard.micro_batches)] * 4
    # The report reads the run without TensorFlow.
    summary = make_report(str(tmp_path))
    assert f"settled on k={guard.micro_batches}" in summary, summary
    # A second fit of the model plans and compiles nothing again.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        again = model.fit(x, y, callbacks=[keras_memguard.MemoryGuard(memory_limit=limit)], **FIT)
    assert not [r for r in caplog.records if r.getMessage().startswith("planned")]
    assert again.history["micro_batches"] == [guard.micro_batches] * 2
    # The train function Keras made is back after fit.
    assert not isinstance(model.train_function, keras_memguard.MemoryGuard)
    assert type(model.train_function).__name__ != "LogsCarrier"


def test_a_batch_out_of_memory_is_replayed_with_more_micro_batches(monkeypatch, caplog):
    plain, model = twins(make_mlp)
    x, y = mlp_data()
    runs = []
    monkeypatch.setattr(StepCache, "compiled", failing_step(StepCache.compiled, {1}, runs))
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    fit = dict(batch_size=20, epochs=1, shuffle=False, verbose=0)
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        model.fit(x, y, callbacks=[guard], **fit)
    monkeypatch.undo()
    plain.fit(x, y, **fit)

    assert runs[0] == 1 and runs[1] > 1  # the one failure, then the replay
    assert runs.count(1) == 1  # the failed count is not planned again
    assert guard.oom_recoveries == 1
    assert any(r.getMessage().startswith("out of memory at 1 micro-batch") for r in caplog.records)
    # The failed attempt left the state untouched: the same weights as plain.
    assert max_weight_difference(model, plain) < 1e-5


def test_without_planning_a_batch_out_of_memory_is_replayed_in_one_jump(monkeypatch):
    # Each step whose compiled analysis needs more than the limit runs out of
    # memory, as XLA's allocator would; the rest run. The replay is sized
    # from what the failed step needed, not crept up to.
    x, y = wide_data(2 * BATCH)
    need = whole_batch_need(make_wide_mlp, x, y)
    fixed = need.argument_bytes + need.output_bytes
    limit = int((fixed + need.temp_bytes / 6) / 0.9)
    runs = []
    compiled = StepCache.compiled

    def over_the_limit_fails(self, micro_batches, state, data):
        step = compiled(self, micro_batches, state, data)
        over = step_memory(step, micro_batches).need_bytes > limit
        return FailingStep(step, micro_batches, runs, over)

    monkeypatch.setattr(StepCache, "compiled", over_the_limit_fails)
    plain, model = twins(make_wide_mlp)
    guard = keras_memguard.MemoryGuard(memory_limit=limit, plan=False)
    history = model.fit(x, y, callbacks=[guard], **FIT)
    monkeypatch.undo()
    plain.fit(x, y, **FIT)

    assert runs[0] == 1 and guard.oom_recoveries == 1, runs
    assert history.history["micro_batches"] == [runs[1]] * 2
    assert max_weight_difference(model, plain) < 1e-5


def fit_compiling_out_of_memory_below(monkeypatch, smallest, **guard_options):
    """Fits the MLP where counts below `smallest` run out of memory while
    compiling (XLA's autotuner on a GPU), and its plain twin beside it.

    Returns:
        `(history, guard, counts tried, largest weight difference)`.
    """
    plain, model = twins(make_mlp)
    x, y = mlp_data()
    tried = []
    compiled = StepCache.compiled

    def compiling_out_of_memory(self, micro_batches, state, data):
        tried.append(micro_batches)
        if micro_batches < smallest:
            raise autotuner_out_of_memory()
        return compiled(self, micro_batches, state, data)

    monkeypatch.setattr(StepCache, "compiled", compiling_out_of_memory)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, **guard_options)
    fit = dict(batch_size=20, epochs=1, shuffle=False, verbose=0)
    history = model.fit(x, y, callbacks=[guard], **fit)
    monkeypatch.undo()
    plain.fit(x, y, **fit)
    return history, guard, tried, max_weight_difference(model, plain)


def test_a_count_the_gpu_compiler_runs_out_of_memory_compiling_is_planned_past(monkeypatch):
    history, guard, tried, difference = fit_compiling_out_of_memory_below(monkeypatch, 4)

    # Planning tried 1, then twice that, then 4, which compiled and ran:
    # no step ran out of memory, nothing replayed.
    assert tried[:3] == [1, 2, 4], tried
    assert history.history["micro_batches"] == [4]
    assert guard.oom_recoveries == 0
    assert difference < 1e-5


def test_without_planning_counts_that_cannot_compile_are_replayed_past_in_one_jump(monkeypatch):
    # On an H100 under a 256 MiB limit, with `plan=False`, every count below
    # the one that fitted ran out of memory while compiling (XLA's
    # autotuner), and each replay went one decider step further: 1, 4, 6,
    # 8, 11, 15, 20 (6 errors). The replay now compiles larger counts
    # first, as planning does, and runs the first that compiles.
    history, guard, tried, difference = fit_compiling_out_of_memory_below(
        monkeypatch, 8, plan=False
    )

    assert guard.oom_recoveries == 1, tried
    assert history.history["micro_batches"] == [8]
    assert difference < 1e-5


def test_one_sample_per_micro_batch_out_of_memory_raises_the_guard_error(monkeypatch):
    model = make_mlp()
    x, y = mlp_data()
    weights = model.get_weights()

    monkeypatch.setattr(
        StepCache, "compiled", failing_step(StepCache.compiled, set(range(1, 5)), [])
    )
    with pytest.raises(MicroBatchTooLargeError, match="single sample"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0,
                  callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 40)])
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def test_without_a_limit_on_a_cpu_device_the_guard_says_what_to_pass():
    model = make_mlp()
    x, y = mlp_data()
    with pytest.raises(MemoryLimitUnknownError, match="pass `memory_limit=<bytes>`") as info:
        model.fit(x, y, batch_size=20, verbose=0, callbacks=[keras_memguard.MemoryGuard()])
    assert "TF_CPU" not in str(info.value)


@pytest.mark.parametrize(
    "options, named",
    [({"mode": "shrink"}, "mode='shrink'"), ({"escalate": ("remat",)}, "escalate=('remat',)")],
)
def test_options_the_jax_backend_lacks_are_refused_at_fit_start(options, named):
    model = make_mlp()
    x, y = mlp_data()
    weights = model.get_weights()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, **options)
    with pytest.raises(UnsupportedTrainingSetupError, match="JAX backend") as info:
        model.fit(x, y, batch_size=20, verbose=0, callbacks=[guard])
    assert named in str(info.value)
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)


def test_auto_mode_accumulates_on_the_jax_backend():
    # Without "shrink" there is nothing to switch to: "auto" trains as the
    # default does, to the same weights.
    x, y = mlp_data()
    trained = []
    for mode in ("accumulate", "auto"):
        keras.utils.set_random_seed(0)
        model = make_mlp()
        guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, mode=mode, plan_cache=False)
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[guard])
        trained.append(model.get_weights())
    for got, want in zip(*trained):
        np.testing.assert_array_equal(got, want)


def wide_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def cnn_inputs(n=240):
    rng = np.random.default_rng(3)
    return rng.normal(size=(n, 16, 16, 3)).astype("float32"), rng.integers(0, 5, n)


def slice_need(model, x, y, micro_batches, kind):
    """What the compiled slice step needs at a count (nothing runs)."""
    from keras_memguard.backends.jax.inference import SlicedPredictFunction
    from keras_memguard.backends.jax.inference import SlicedTestFunction

    function = (SlicedTestFunction if kind == "evaluate" else SlicedPredictFunction)(model)
    batch = (x, y, None) if kind == "evaluate" else (x,)
    state = jax_state(model)
    state = state[:2] + state[3:] if kind == "evaluate" else state[:2]
    return function.memory(micro_batches, state, batch)


def test_evaluate_and_predict_are_planned_in_slices_and_equal_a_smaller_batch(caplog):
    model = wide_cnn()
    x, y = cnn_inputs()
    model.fit(x[:8], y[:8], verbose=0)  # builds every variable
    expected = model.evaluate(x, y, batch_size=30, verbose=0, return_dict=True)
    expected_outputs = model.predict(x, batch_size=30, verbose=0)
    one = slice_need(model, x, y, 1, "evaluate")
    # A limit the whole batch's step exceeds and a few slices fit.
    limit = int((one.argument_bytes + one.output_bytes + one.temp_bytes / 3) / 0.9)
    assert one.need_bytes > 0.9 * limit
    guard = keras_memguard.MemoryGuard(memory_limit=limit)
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        got = model.evaluate(x, y, batch_size=240, verbose=0, return_dict=True, callbacks=[guard])
        outputs = model.predict(x, batch_size=240, verbose=0, callbacks=[guard])
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planned")]
    assert planned[0].startswith("planned evaluate of batch 240 in ")
    assert "1 micro-batch:" not in planned[0], planned
    assert any(m.startswith("planned predict of batch 240") for m in planned), planned
    assert got["accuracy"] == expected["accuracy"]
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert isinstance(outputs, np.ndarray) and outputs.shape == (240, 5)
    np.testing.assert_allclose(outputs, expected_outputs, rtol=1e-5, atol=1e-6)
    assert guard.eval_oom_recoveries == 0 and guard.predict_oom_recoveries == 0
    # Keras' own functions are back.
    assert type(model.test_function).__name__ != "SlicedTestFunction"


def test_a_slice_out_of_memory_is_run_again_in_smaller_slices(monkeypatch, caplog):
    from keras_memguard.backends.jax import inference

    model = make_mlp()
    x, y = mlp_data()
    expected = model.evaluate(x, y, batch_size=10, verbose=0, return_dict=True)
    expected_outputs = model.predict(x, batch_size=10, verbose=0)
    executable = inference._SlicedFunction._executable
    runs = []

    def failing_whole_batches(self, state, data):
        step = executable(self, state, data)
        size = jax.tree_util.tree_leaves(data)[0].shape[0]
        return FailingStep(step, size, runs, size == 50)

    monkeypatch.setattr(inference._SlicedFunction, "_executable", failing_whole_batches)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        got = model.evaluate(x, y, batch_size=50, verbose=0, return_dict=True, callbacks=[guard])
        outputs = model.predict(x, batch_size=50, verbose=0, callbacks=[guard])
    monkeypatch.undo()
    assert guard.eval_oom_recoveries == 1 and guard.predict_oom_recoveries == 1
    assert runs.count(50) == 2  # once each: the failed size is not run again
    assert any("out of memory in evaluate on a batch of 50" in r.getMessage() for r in caplog.records)
    assert got["accuracy"] == expected["accuracy"]
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    np.testing.assert_allclose(outputs, expected_outputs, rtol=1e-6)


def test_evaluate_that_cannot_be_sliced_further_keeps_the_weights(monkeypatch):
    from keras_memguard.backends.jax import inference

    model = make_mlp()
    x, y = mlp_data()
    weights = model.get_weights()
    executable = inference._SlicedFunction._executable

    def always_failing(self, state, data):
        return FailingStep(executable(self, state, data), 0, [], True)

    monkeypatch.setattr(inference._SlicedFunction, "_executable", always_failing)
    with pytest.raises(MicroBatchTooLargeError, match="slice of one sample"):
        model.evaluate(x, y, batch_size=4, verbose=0,
                       callbacks=[keras_memguard.MemoryGuard(memory_limit=1 << 40)])
    monkeypatch.undo()
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)
    model.evaluate(x, y, verbose=0)  # and the model still evaluates


class MixedMLP(keras_memguard.MemGuardMixin, keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


def make_mixed():
    model = MixedMLP()
    model.compile(optimizer="adam", loss="mse")
    return model


def test_the_mixin_micro_batches_keras_own_step_as_the_whole_batch():
    assert keras_memguard.MemGuardMixin.__module__ == "keras_memguard.backends.jax.mixin"
    x = np.random.default_rng(0).normal(size=(96, 8)).astype("float32")
    y = x[:, :2] * 2.0
    plain, model = twins(make_mixed)
    model.micro_batches = 4
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert max_weight_difference(model, plain) < 1e-5
    assert type(model.train_function).__name__ == "ReplayingTrainFunction"


def test_the_mixin_says_what_the_jax_backend_lacks():
    model = make_mixed()
    with pytest.raises(ValueError, match="Received: micro_batch_mode='shrink'"):
        model.micro_batch_mode = "shrink"
    with pytest.raises(ValueError, match="Received: micro_batches=0"):
        model.micro_batches = 0
    with pytest.raises(UnsupportedTrainingSetupError, match="TensorFlow backend only"):
        model.accumulate_gradients((np.zeros((2, 8)), np.zeros((2, 2))))


class FakeGpu:
    """A device that keeps memory statistics, as a GPU does (none here).

    Its high-water mark rises at every reading, about 1 GB above what is
    in use: each step's measured peak lies far beyond the compiled step's
    analysis.
    """

    platform = "gpu"
    id = 0

    def __init__(self):
        self.readings = 0

    def memory_stats(self):
        self.readings += 1
        return {
            "bytes_in_use": 1000,
            "peak_bytes_in_use": 10**9 + self.readings,
            "bytes_limit": 16 * 2**30,
        }


def test_a_measured_peak_beyond_the_analysis_becomes_a_margin_in_later_plans(caplog):
    from keras_memguard.callbacks import sampling
    from keras_memguard.backends.jax.probe import JaxMemoryProbe

    model = make_mlp()
    x, y = mlp_data(n=30)  # batches of 20, then 10: two shapes
    # The only mock: the device's statistics, which a CPU device lacks.
    sampling._readers[model] = sampling.SharedAllocatorReader(
        probe=JaxMemoryProbe(devices=[FakeGpu()])
    )
    guard = keras_memguard.MemoryGuard()  # the limit: the device's bytes_limit
    with caplog.at_level(logging.INFO, logger="keras_memguard"):
        model.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planned")]
    assert len(planned) == 2, planned
    needs = [float(re.search(r"needs ([0-9.]+) MiB", line).group(1)) for line in planned]
    # The first shape: the analysis alone; the second: plus the margin the
    # first step's measured peak showed (about 1 GB).
    assert needs[0] < 50 and needs[1] > 900, planned
    assert "of 16384 MiB" in planned[0]


def test_steps_per_execution_runs_every_batch_and_counts_each_step(tmp_path):
    x, y = mlp_data(n=100)
    plain, model = twins(make_mlp)
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy", steps_per_execution=3)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, micro_batches=2,
                                       plan=False, log_dir=str(tmp_path))
    fit = dict(batch_size=10, epochs=1, shuffle=False, verbose=0)
    model.fit(x, y, callbacks=[guard], **fit)
    plain.fit(x, y, **fit)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert max_weight_difference(model, plain) < 1e-5
    # One row per execution (3, 3, 3, 1 batches), at the step it ended on.
    accumulator = event_accumulator.EventAccumulator(os.path.join(str(tmp_path), "memguard"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("memguard/micro_batches")] == [3, 6, 9, 10]


def test_backup_dir_keeps_the_count_and_the_step_across_fits(tmp_path):
    x, y = mlp_data()
    model = make_mlp()
    first = keras_memguard.MemoryGuard(memory_limit=1 << 40, micro_batches=4, plan=False,
                                       backup_dir=str(tmp_path))
    model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[first])
    again = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan=False, backup_dir=str(tmp_path))
    history = model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[again])
    assert history.history["micro_batches"] == [4]
    assert again.session.step == 10  # 5 batches in each fit


def test_a_stateful_rnn_trains_whole_batches_as_plain_fit_and_is_not_split(caplog):
    # Its state holds a row per sample of 16: a planned first split used to
    # be refused by the layer. Batches now run whole, evaluate and predict
    # too, and asking for micro-batches is refused before fit runs.
    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(batch_shape=(16, 6, 3))
        hidden = keras.layers.LSTM(8, stateful=True, name="lstm")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile("adam", "mse")
        return model

    x = np.random.default_rng(0).normal(size=(64, 6, 3)).astype("float32")
    y = x[:, -1, :1]
    plain = build()
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = build()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(
            x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        )
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0, callbacks=[guard])
    assert history.history["micro_batches"] == [1.0, 1.0]
    assert max_weight_difference(plain, model) < 1e-6
    assert evaluated == pytest.approx(plain.evaluate(x, y, batch_size=16, verbose=0), rel=1e-6)
    assert any("stateful layers ('lstm')" in r.getMessage() for r in caplog.records)
    with pytest.raises(UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[
            keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
        ])


class OwnStepSequential(keras.Sequential):
    """keras.io's JAX `train_step` of one's own: the loss halved, its own logs.

    `fails`: the step raises XLA's out-of-memory error when traced (the
    seam JAX's CPU backend cannot reach at these sizes).
    """

    fails = False

    def _half_loss(self, trainable, non_trainable, x, y):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
        loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred))
        return 0.5 * loss, non_trainable

    def train_step(self, state, data):
        if self.fails:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes.", 8
            )
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data[0], data[1]
        grad_fn = jax.value_and_grad(self._half_loss, has_aux=True)
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable
        )
        state = (trainable, non_trainable, optimizer_variables, metrics_variables)
        return {"half_loss": loss, "own": 1.0}, state


def make_own_step():
    model = OwnStepSequential(mlp_layers())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def test_an_own_train_step_trains_whole_batches_as_plain_fit(caplog):
    # It used to be refused at fit's start, where plain fit trains it.
    x, y = mlp_data()
    plain, model = twins(make_own_step)
    expected = plain.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(
            x, y, batch_size=20, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
        ).history
        evaluated = model.evaluate(x, y, batch_size=50, verbose=0, callbacks=[guard])
    assert history["micro_batches"] == [1, 1] and history["own"] == [1.0, 1.0], history
    np.testing.assert_allclose(history["half_loss"], expected["half_loss"], rtol=1e-6)
    assert max_weight_difference(model, plain) < 1e-6
    assert evaluated == pytest.approx(plain.evaluate(x, y, batch_size=50, verbose=0), rel=1e-6)
    told = [r.getMessage() for r in caplog.records
            if "trains the batches of OwnStepSequential whole" in r.getMessage()]
    assert len(told) == 1 and "`compute_loss`" in told[0] and "XLA" not in told[0], told


def test_an_own_train_step_out_of_memory_is_named_and_micro_batches_are_refused():
    x, y = mlp_data()
    model = make_own_step()
    model.fails = True
    before = [np.array(w) for w in model.get_weights()]
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with pytest.raises(MicroBatchTooLargeError) as info:
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[guard])
    assert "Out of memory on a batch of 20 samples, which MemoryGuard cannot split: the " \
        "own `train_step` of OwnStepSequential runs the whole batch" in str(info.value), info.value
    # `fit` took the weights out of the model; the step failed before it
    # ran, so they are put back (plain `fit` leaves the model without them).
    assert_weights_kept_a_split_refused_and_it_trains_on(model, before, x, y, guard, "half_loss")


def make_augmented_cnn():
    # keras.io's image classification from scratch: augmentation inside the
    # model. RandomRotation does not support XLA, so Keras resolves
    # `jit_compile` to False and runs the step eagerly.
    inputs = keras.Input((12, 12, 3))
    hidden = keras.layers.RandomFlip("horizontal")(inputs)
    hidden = keras.layers.RandomRotation(0.1, name="rotate")(hidden)
    hidden = keras.layers.Conv2D(4, 3, activation="relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_a_step_keras_runs_without_xla_trains_whole_batches_as_plain_fit(caplog):
    # It used to be refused at fit's start ("must not run eagerly", with a
    # hint to compile with the defaults the user had compiled with), where
    # plain fit trains it.
    rng = np.random.default_rng(0)
    x = rng.random((48, 12, 12, 3)).astype("float32")
    y = rng.integers(0, 3, 48)
    plain, model = twins(make_augmented_cnn)
    assert model.jit_compile is False
    warned = assert_guarded_whole_as_plain(
        plain, model, x, y, caplog, dict(batch_size=16, epochs=2, shuffle=False, verbose=0), 24
    )
    told = [message for message in warned if "whole" in message]
    assert len(told) == 1 and "layer 'rotate' (RandomRotation) does not support XLA" in told[0], told
    assert "input pipeline" in told[0], told
    with pytest.raises(UnsupportedTrainingSetupError, match="Received: micro_batches=4"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[
            keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4)
        ])


@pytest.mark.parametrize(
    "compile_kwargs, named",
    [({"run_eagerly": True}, "`run_eagerly=True`"), ({"jit_compile": False}, "`jit_compile=False`")],
)
def test_a_model_compiled_to_run_eagerly_trains_whole_batches(compile_kwargs, named, caplog):
    x, y = mlp_data()

    def build():
        model = make_mlp()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", **compile_kwargs)
        return model

    plain, model = twins(build)
    plain.fit(x, y, batch_size=20, epochs=1, shuffle=False, verbose=0)
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30, plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="keras_memguard"):
        history = model.fit(
            x, y, batch_size=20, epochs=1, shuffle=False, verbose=0, callbacks=[guard]
        ).history
    assert history["micro_batches"] == [1]
    assert max_weight_difference(model, plain) < 1e-6
    told = [r.getMessage() for r in caplog.records if "whole" in r.getMessage()]
    assert len(told) == 1 and named in told[0] and "jit_compile=\"auto\"" in told[0], told


def test_the_mixin_refuses_an_own_train_step_it_would_have_replaced():
    # At two micro-batches the mixin used to run Keras' step in its place.
    class Own(keras_memguard.MemGuardMixin, OwnStepSequential):
        pass

    model = Own([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.micro_batches = 2
    x, y = mlp_data()
    with pytest.raises(UnsupportedTrainingSetupError, match="has a `train_step` of its own"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0)


def test_an_own_loss_is_warned_about_only_where_it_couples_the_samples(recwarn):
    assert_only_the_coupled_loss_is_warned_about(
        recwarn,
        lambda: keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=4),
    )


def test_a_summed_loss_evaluated_in_slices_is_the_whole_batchs():
    # Keras' loss tracker weighs each call's loss by its samples: a slice's
    # sum used to count its share of itself (a third here).
    from keras_memguard.backends.jax.inference import SlicedTestFunction
    from keras_memguard.step_functions import set_test_function

    assert_summed_loss_evaluates_as_unsliced(
        lambda model: set_test_function(model, SlicedTestFunction(model, micro_batches=3))
    )
