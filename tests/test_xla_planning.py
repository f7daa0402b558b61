"""What an XLA step needs, read from its compiled program; outputs kept only when read."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_memguard.compiled_plan import CompiledPlan
from keras_memguard.compiled_plan import StepMemory
from keras_memguard.compiled_plan import count_after_no_free_block
from keras_memguard.backends.tensorflow.accumulation import accumulate_gradients
from keras_memguard.backends.tensorflow.step import build_training_state
from keras_memguard.backends.tensorflow.step import step_function
from keras_memguard.backends.tensorflow.xla_memory import FailedBlock
from keras_memguard.backends.tensorflow.xla_memory import still_fails
from keras_memguard.backends.tensorflow.xla_memory import step_memory
from keras_memguard.backends.tensorflow.xla_memory import uses_xla


def _mlp(jit_compile, metrics=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile("adam", "sparse_categorical_crossentropy", metrics=metrics, jit_compile=jit_compile)
    return model


def _batch(size):
    rng = np.random.default_rng(0)
    return (
        tf.constant(rng.random((size, 64), dtype="float32")),
        tf.constant(rng.integers(0, 10, size)),
    )


@pytest.mark.slow(floor=True)
def test_the_buffer_assignment_of_an_xla_step_is_read_per_count():
    model = _mlp(jit_compile=True)
    assert uses_xla(model)
    data = _batch(512)
    build_training_state(model, data)
    whole = step_memory(step_function(model, 1, "accumulate"), data, 1)
    split = step_memory(step_function(model, 8, "accumulate"), data, 8)
    assert isinstance(whole, StepMemory) and whole.micro_batches == 1
    # The weights, Adam's slots and the batch are parameters: resident.
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    assert whole.argument_bytes >= 3 * weights + 512 * 64 * 4
    # The activations of 512 samples against those of 64, and one buffer
    # at least as large as any other.
    assert whole.demand_bytes > split.demand_bytes > 0
    assert 0 < whole.largest_allocation_bytes <= whole.demand_bytes


def test_the_micro_batch_loop_holds_no_padded_copy_of_the_batch():
    # Images straight to a Dense layer: the activations are small beside the
    # batch (3 MiB). XLA lowered the loop's slice of a 4-d batch by padding
    # it by its whole size in every dimension, 16 times the batch (48 MiB),
    # which no count could remove (a loop of one micro-batch is simplified
    # away, so 8 micro-batches).
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    rng = np.random.default_rng(0)
    data = (
        tf.constant(rng.random((256, 32, 32, 3), dtype="float32")),
        tf.constant(rng.integers(0, 10, 256)),
    )
    build_training_state(model, data)
    batch_bytes = 256 * 32 * 32 * 3 * 4
    split = step_memory(step_function(model, 8, "accumulate"), data, 8)
    # 0.6 MB; 51 MB with the padded copy.
    assert split.demand_bytes < batch_bytes / 2, split


@pytest.mark.slow(floor=True)
def test_more_micro_batches_never_need_more_memory_on_xla():
    # Activations beside small weights. XLA inlines a loop it can count to
    # one iteration and runs that micro-batch beside the first, both alive:
    # 2 micro-batches read 22.1 MiB against 20.1 at one, and 5 (1024 is
    # 5 x 204 + 4: a loop of one 204-sample micro-batch) 15.6 against 12.2
    # at 4. With the loops' bounds hidden from XLA: 16.2 and 11.4.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=True)
    rng = np.random.default_rng(0)
    data = (
        tf.constant(rng.random((1024, 32), dtype="float32")),
        tf.constant(rng.integers(0, 10, 1024)),
    )
    build_training_state(model, data)
    demands = {
        k: step_memory(step_function(model, k, "accumulate"), data, k).demand_bytes
        for k in (1, 2, 3, 4, 5)
    }
    for k in (2, 3, 4, 5):
        assert demands[k] < demands[k - 1], demands
    # Half the batch's activations at 2: at most the weights' share above half.
    assert demands[2] < 0.85 * demands[1], demands


def test_a_step_without_xla_has_no_compiled_program_to_read():
    model = _mlp(jit_compile=False)
    assert not uses_xla(model)
    data = _batch(32)
    build_training_state(model, data)
    assert step_memory(step_function(model, 2, "accumulate"), data, 2) is None


class _OwnMetric(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(keras.ops.max(y_pred, axis=-1))


@pytest.mark.parametrize(
    "metrics,kept",
    [
        pytest.param(None, False, marks=pytest.mark.slow(floor=True)),
        (["accuracy"], False),
        ([_OwnMetric()], True),
    ],
    ids=["none", "keras", "own"],
)
def test_the_whole_batchs_outputs_are_kept_only_where_a_metric_reads_them(metrics, kept):
    model = _mlp(jit_compile=False, metrics=metrics)
    data = _batch(32)
    build_training_state(model, data)

    @tf.function
    def outputs_kept():
        result = accumulate_gradients(model, data, 4, update_metrics=True)
        return result.y_pred is not None

    assert bool(outputs_kept()) is kept


def _memory(largest_bytes):
    return StepMemory(
        micro_batches=1,
        argument_bytes=0,
        output_bytes=0,
        temp_bytes=largest_bytes,
        alias_bytes=0,
        generated_code_bytes=0,
        largest_allocation_bytes=largest_bytes,
    )


def test_a_block_that_found_no_room_is_not_tried_again_until_memory_is_freed():
    # A failed allocation waits 10 s in TensorFlow's allocator: the probe of
    # a buffer at least as large is answered without trying it.
    failed = FailedBlock(size_bytes=32 * 2**20, in_use_bytes=96 * 2**20)
    assert still_fails(_memory(32 * 2**20), failed, 96 * 2**20)
    assert still_fails(_memory(40 * 2**20), failed, 97 * 2**20)
    # A buffer a few KiB smaller (the same accumulators at another count)
    # is answered too; one an eighth smaller or more may fit, and memory
    # freed since may have made room.
    assert still_fails(_memory(32 * 2**20 - 40 * 2**10), failed, 96 * 2**20)
    assert still_fails(_memory(29 * 2**20), failed, 96 * 2**20)
    assert not still_fails(_memory(27 * 2**20), failed, 96 * 2**20)
    assert not still_fails(_memory(40 * 2**20), failed, 95 * 2**20)
    # Nothing failed, or the memory in use is unknown: try it.
    assert not still_fails(_memory(40 * 2**20), None, 96 * 2**20)
    assert not still_fails(_memory(40 * 2**20), failed, None)


def test_after_no_free_block_a_count_already_read_is_tried_before_a_new_compile():
    mib = 2**20
    # The decoder language model's reads (as on a GPU): 6 micro-batches fit
    # in total, but no free block held its 74.5 MiB buffer.
    read = {1: 194, 3: 193.6, 5: 86.6, 6: 74.5, 9: 28.5, 32: 10.6}
    analysed = tuple(
        StepMemory(k, 0, 0, int(size * mib), 0, largest_allocation_bytes=int(size * mib))
        for k, size in read.items()
    )
    failed = CompiledPlan(6, True, analysed[3], 0.5, "", analysed)
    # 9 was read already (no compile) and its largest buffer is smaller:
    # before, the search compiled 12 first.
    assert count_after_no_free_block(failed) == 9
    # Nothing larger read with a smaller buffer: twice the count.
    alone = CompiledPlan(6, True, analysed[3], 0.5, "", analysed[:4])
    assert count_after_no_free_block(alone) == 12


def test_a_count_that_fits_but_finds_no_place_in_the_free_memory_is_refused_with_that_cause():
    # keras.io's bidirectional LSTM compiled with XLA under 296 MiB: its
    # step keeps a buffer of 185 MiB or more at every count (bench/
    # RESULTS.md), which fits the target in total and takes the whole free
    # block, where the step's other buffers then found no place.
    # The refusal said only that the step needs 218.4 MiB, 74% of the
    # limit, under the 90% target: a step that reads as one that fits.
    from types import SimpleNamespace

    from keras_memguard.callbacks.oom_report import compiled_step_too_large
    from keras_memguard.compiled_plan import plan_micro_batches

    mib = 2**20
    limit, in_use = 296 * mib, int(32.6 * mib)

    def analyse(k):
        temp = int((185 + 311 / k) * mib)
        return StepMemory(k, in_use, 0, temp, 0, largest_allocation_bytes=temp)

    planned = plan_micro_batches(
        analyse, 128, limit, threshold=0.9, in_use_bytes=in_use, min_micro_batches=128
    )
    assert planned.fits and planned.micro_batches == 128, planned
    session = SimpleNamespace(controller=SimpleNamespace(limit_bytes=limit))
    error = compiled_step_too_large(session, planned, 128, in_use, no_free_block=True)
    assert (
        "its buffers at that count (the largest 187.4 MiB, allocated in one piece) "
        "found no place in the free memory" in str(error)
    ), error
    assert "counting the 32.6 MiB in use" in str(error), error
    # Where no probe failed (the count does not fit in total), it says so alone.
    plain = compiled_step_too_large(session, planned._replace(fits=False), 128, in_use)
    assert "found no place" not in str(plain)


def test_a_refusal_offers_only_what_could_change_it():
    # A two-headed MLP compiled with XLA under 46 MiB (bench/RESULTS.md):
    # with `mode="shrink"` no count fits even at one sample a micro-batch,
    # and the refusal's hint offered `mode="shrink"`.
    from types import SimpleNamespace

    from keras_memguard.callbacks.oom_report import compiled_step_too_large
    from keras_memguard.compiled_plan import plan_micro_batches

    mib = 2**20
    limit, in_use = 46 * mib, int(37.4 * mib)

    def analyse(k):
        temp = int((8.8 + 30 / k) * mib)
        return StepMemory(k, in_use, 0, temp, 0, largest_allocation_bytes=temp // 2)

    planned = plan_micro_batches(analyse, 1024, limit, threshold=0.9, in_use_bytes=in_use)
    assert not planned.fits, planned
    session = SimpleNamespace(controller=SimpleNamespace(limit_bytes=limit))
    shrinking = str(compiled_step_too_large(session, planned, 1024, in_use, shrinking=True))
    assert 'mode="shrink"' not in shrinking and "a smaller batch" not in shrinking, shrinking
    assert "threshold" not in shrinking, shrinking  # over the limit at any count
    assert "HINT: less memory held beside the step" in shrinking, shrinking
    accumulating = str(compiled_step_too_large(session, planned, 1024, in_use))
    assert 'HINT: a smaller batch, `mode="shrink"` (no accumulators), ' in accumulating
    # Over the target, under the limit: a higher threshold would run it.
    roomy = 51 * mib
    planned = plan_micro_batches(analyse, 1024, roomy, threshold=0.9, in_use_bytes=in_use)
    session = SimpleNamespace(controller=SimpleNamespace(limit_bytes=roomy))
    assert not planned.fits, planned
    message = str(compiled_step_too_large(session, planned, 1024, in_use, shrinking=True))
    assert "`threshold=0.91` or more (the step needs 91% of the limit)" in message, message


def test_the_planners_examples_run():
    import doctest

    from keras_memguard import compiled_plan

    assert doctest.testmod(compiled_plan).failed == 0


@pytest.mark.slow(floor=True)
def test_the_slices_of_an_xla_test_step_are_planned_from_its_compiled_program():
    from keras_memguard.backends.tensorflow.compiled_slices import CompiledSlicePlanner
    from keras_memguard.backends.tensorflow.eval_replay import test_step_function
    from keras_memguard.backends.tensorflow.slice_replay import slice_batch

    model = _mlp(jit_compile=True)
    step = test_step_function(model)
    data = _batch(4096)
    whole = step.memory(data)
    assert whole is not None and whole.demand_bytes > 0
    # A limit where the whole batch's step needs about three times the target.
    limit = whole.demand_bytes / 0.9 / 3
    planner = CompiledSlicePlanner(limit, 0.9, lambda: 0.0, "evaluate")
    count = planner(step, data, 4096, 1)
    assert 3 <= count < 64
    size = -(-4096 // count)
    assert step.memory(slice_batch(data, 0, size)).demand_bytes < 0.9 * limit
    # One fewer slice would not fit.
    larger = -(-4096 // (count - 1))
    assert step.memory(slice_batch(data, 0, larger)).demand_bytes >= 0.9 * limit
    # The plan holds for the next batch of that shape, and never goes under
    # the count the caller asks for.
    assert planner(step, data, 4096, 1) == count
    assert planner(step, data, 4096, 2 * count) == 2 * count
    # A step without XLA has no program to read: the caller's count stands.
    plain = test_step_function(_mlp(jit_compile=False))
    assert CompiledSlicePlanner(limit, 0.9, lambda: 0.0, "evaluate")(plain, data, 4096, 2) == 2
