"""Replaying a batch after XLA's out-of-memory error, on an untouched state.

JAX's CPU backend does not run out of memory at a training step's sizes, so
the compiled step is made to raise JAX's own error type with XLA's
`RESOURCE_EXHAUSTED` code: the only mock, at the narrowest seam.
"""

import jax
import numpy as np
import pytest

import keras

from jax_models import make_mlp
from jax_models import max_weight_difference
from jax_models import mlp_data
from jax_models import twins
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.backends.jax import ReplayingTrainFunction
from keras_memguard.backends.jax import StepCache
from keras_memguard.backends.jax import is_out_of_memory
from keras_memguard.backends.compat import jax_state
from keras_memguard.backends.jax.replay import failed_allocation_bytes
from xla_errors import autotuner_out_of_memory

RESOURCE_EXHAUSTED = 8


def out_of_memory():
    return jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 123456 bytes.", RESOURCE_EXHAUSTED
    )


class FailingAt(StepCache):
    """A cache whose compiled steps at the counts given raise XLA's OOM."""

    def __init__(self, model, failing, calls):
        super().__init__(model)
        self.failing = failing
        self.calls = calls

    def compiled(self, micro_batches, state, data):
        compiled = super().compiled(micro_batches, state, data)

        def run(state, data):
            self.calls.append((micro_batches, jax.tree_util.tree_map(np.array, state)))
            if micro_batches in self.failing:
                raise out_of_memory()
            return compiled(state, data)

        return run


def twins_one_trained_at_two_micro_batches():
    """Twin MLPs and their data; the first trained an epoch at k=2 (the
    count a replay after one failure at k=1 runs with)."""
    plain, model = twins(make_mlp)
    x, y = mlp_data()
    fit = dict(batch_size=32, epochs=1, shuffle=False, verbose=0)
    plain.train_function = ReplayingTrainFunction(plain, micro_batches=2)
    plain.fit(x, y, **fit)
    return plain, model, x, y, fit


def test_out_of_memory_is_told_by_type_and_status_code():
    assert is_out_of_memory(out_of_memory())
    # The same words under another status, or another type: not OOM.
    assert not is_out_of_memory(
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: looks like it", 13)
    )
    assert not is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert failed_allocation_bytes(out_of_memory()) == 123456


def test_a_gpu_out_of_memory_error_and_the_autotuner_s_are_recognized():
    # An H100's allocator names the allocation in its own units.
    runtime = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 408.00MiB with "
        "allocator GPU_0_bfc on device 0.", RESOURCE_EXHAUSTED
    )
    assert is_out_of_memory(runtime)
    assert failed_allocation_bytes(runtime) == 408 * 2**20
    # Compiling fails with another status when XLA's autotuner could not
    # allocate the buffers to try a kernel in; the step needs that memory too.
    autotuner = autotuner_out_of_memory()
    assert is_out_of_memory(autotuner)
    assert failed_allocation_bytes(autotuner) == 466 * 2**20
    assert not is_out_of_memory(
        jax.errors.JaxRuntimeError("NOT_FOUND: Failed to get configs for: 1 instruction", 5)
    )


def test_a_real_xla_out_of_memory_error_is_recognized():
    # XLA's CPU client refuses an allocation larger than the address space.
    with pytest.raises(jax.errors.JaxRuntimeError) as raised:
        jax.numpy.zeros((2**62,), "int8").block_until_ready()
    assert is_out_of_memory(raised.value)


def test_a_failed_step_is_replayed_at_a_larger_count_on_the_untouched_state():
    plain, model, x, y, fit = twins_one_trained_at_two_micro_batches()

    calls = []
    failures = []

    def on_out_of_memory(failure):
        failures.append(failure)
        return 2 * failure.micro_batches

    function = ReplayingTrainFunction(
        model, cache=FailingAt(model, {1}, calls), on_out_of_memory=on_out_of_memory
    )
    model.train_function = function
    history = model.fit(x, y, **fit)

    # The first batch failed at 1 and ran at 2; the rest ran at 2.
    assert [k for k, _ in calls[:3]] == [1, 2, 2]
    assert len(failures) == 1 and failures[0].micro_batches == 1
    assert failures[0].batch_size == 32 and failures[0].allocation_bytes == 123456
    assert function.replays == 1 and function.micro_batches == 2
    # The replay got the very state the failed call got: weights, optimizer
    # variables (iterations 0) and metrics (all zero) untouched.
    failed_state, replayed_state = calls[0][1], calls[1][1]
    for failed, replayed in zip(
        jax.tree_util.tree_leaves(failed_state), jax.tree_util.tree_leaves(replayed_state)
    ):
        np.testing.assert_array_equal(failed, replayed)
    # And training went on as at 2 micro-batches from the start.
    assert max_weight_difference(plain, model) < 1e-6
    assert model.optimizer.iterations.numpy() == 4
    assert len(history.history["loss"]) == 1


def test_the_state_survives_a_failed_call_and_metrics_stay_unchanged():
    keras.utils.set_random_seed(0)
    model = make_mlp()
    x, y = mlp_data()
    model.fit(x[:32], y[:32], batch_size=32, epochs=1, verbose=0)
    state = jax_state(model)
    before = jax.tree_util.tree_map(np.array, state)
    calls = []
    function = ReplayingTrainFunction(
        model,
        cache=FailingAt(model, {1, 2}, calls),
        on_out_of_memory=lambda failure: failure.micro_batches + 1,
    )
    logs, new_state = function.run(state, (x[:32], y[:32]))

    assert [k for k, _ in calls] == [1, 2, 3]
    # Nothing donated: the arrays passed in are alive and unchanged.
    for old, now in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(old, np.asarray(now))
    trainable, _, _, metrics = new_state
    assert not np.allclose(np.asarray(trainable[0]), before[0][0])
    # Only the step that completed counted the batch, once, in the loss
    # tracker: 32 samples more than after the first fit's one batch.
    paths = [v.path for v in model.metrics_variables]
    count = next(i for i, p in enumerate(paths) if "loss" in p and p.endswith("count"))
    assert float(before[3][count]) == 32
    assert float(metrics[count]) == 64


class FailsWhenRead:
    """A step's result as a GPU returns it when the step ran out of memory:
    the call returned, and reading the result raises XLA's error."""

    def block_until_ready(self):
        raise out_of_memory()


def test_a_step_that_fails_after_returning_is_replayed_before_the_state_moves_on():
    # On a GPU XLA runs the step asynchronously: the call returns, and the
    # out-of-memory error comes when a result is read.
    plain, model, x, y, fit = twins_one_trained_at_two_micro_batches()

    class FailingWhenReadAt(StepCache):
        def compiled(self, micro_batches, state, data):
            compiled = super().compiled(micro_batches, state, data)
            if micro_batches != 1:
                return compiled
            return lambda state, data: (compiled(state, data)[0], FailsWhenRead())

    function = ReplayingTrainFunction(model, cache=FailingWhenReadAt(model))
    model.train_function = function
    model.fit(x, y, **fit)

    assert function.replays == 1 and function.micro_batches == 2
    assert max_weight_difference(plain, model) < 1e-6


def test_one_sample_per_micro_batch_out_of_memory_raises():
    keras.utils.set_random_seed(0)
    model = make_mlp()
    x, y = mlp_data()
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)
    function = ReplayingTrainFunction(model, cache=FailingAt(model, {1, 2, 4}, []))
    with pytest.raises(MicroBatchTooLargeError, match="one sample"):
        function.run(jax_state(model), (x[:4], y[:4]))


def test_other_errors_pass_through_untouched():
    keras.utils.set_random_seed(0)
    model = make_mlp()
    x, y = mlp_data()
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)

    class Broken(StepCache):
        def compiled(self, micro_batches, state, data):
            def run(state, data):
                raise jax.errors.JaxRuntimeError("INTERNAL: something else", 13)

            return run

    function = ReplayingTrainFunction(model, cache=Broken(model))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        function.run(jax_state(model), (x[:4], y[:4]))
    assert function.replays == 0
