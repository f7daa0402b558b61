"""`find_batch_size` on JAX: a search over compiled steps' memory analyses."""

import keras
import numpy as np
import pytest

import keras_memguard
from keras_memguard.backends.jax.finder import step_analyser

LIMIT = 24 << 20


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 16, 16, 3), dtype=np.float32), rng.integers(0, 4, n)


def state_of(model):
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    return [np.array(v.numpy()) for v in variables]


def test_the_answer_is_the_edge_of_the_analysed_steps_and_trains():
    model = small_cnn()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = state_of(model)
    result = keras_memguard.find_batch_size(
        model, x, y, batch_size=4096, memory_limit=LIMIT, verbose=0
    )
    for a, b in zip(before, state_of(model)):
        np.testing.assert_array_equal(a, b)
    answer = result.largest_batch_size
    target = 0.95 * LIMIT
    # The answer's compiled step fits beside its arguments; one more does not.
    analyse = step_analyser(model, (x[:1], y[:1], None))
    for size, fits in ((answer, True), (answer + 1, False)):
        memory = analyse(size)
        assert (memory.argument_bytes + memory.demand_bytes < target) == fits, size
    assert result.measured_peak_bytes < target <= result.limit_bytes == LIMIT
    # Every analysis is a trial; none ran, so none ran out of memory.
    assert result.out_of_memory_errors == 0
    assert {t.batch_size for t in result.trials} >= {answer, answer + 1}
    assert all(
        (t.peak_bytes is not None) == (t.predicted_peak_bytes < target)
        for t in result.trials
    )
    # A line through the analyses finds the edge in a few compiles.
    assert len(result.trials) <= 8, [t.batch_size for t in result.trials]
    assert result.micro_batches >= -(-4096 // answer)
    assert result.bytes_per_sample > 0
    # Plain fit at the answer runs.
    rows = np.arange(answer) % len(x)
    model.fit(x[rows], y[rows], batch_size=answer, epochs=1, verbose=0)


def test_a_cpu_without_memory_limit_is_refused_by_name():
    model = small_cnn()
    x, y = data(8)
    with pytest.raises(keras_memguard.MemoryLimitUnknownError) as error:
        keras_memguard.find_batch_size(model, x, y, verbose=0)
    assert "JAX reports none on this device" in str(error.value)
    assert "memory_limit=<bytes>" in str(error.value)


def test_one_sample_that_does_not_fit_is_refused():
    model = small_cnn()
    x, y = data(8)
    with pytest.raises(keras_memguard.MicroBatchTooLargeError):
        keras_memguard.find_batch_size(model, x, y, memory_limit=1 << 10, verbose=0)


def test_max_batch_size_bounds_the_answer():
    model = small_cnn()
    x, y = data(8)
    result = keras_memguard.find_batch_size(
        model, x, y, memory_limit=LIMIT, max_batch_size=50, verbose=0
    )
    assert result.largest_batch_size == 50
