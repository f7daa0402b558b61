"""Tests of the graph-side micro-batching and `MemGuardMixin`.

Real TensorFlow, real `fit`, tiny models. The reference for every
equivalence test is Keras' own built-in `train_step` on the whole batch.
"""

import contextlib
import re
import warnings

import numpy as np
import pytest

import keras
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import run_with_memory_cap
from keras_memguard.backends.tensorflow import accumulate_gradients
from keras_memguard.backends.tensorflow import has_batch_statistics_layers
from keras_memguard.backends.tensorflow import make_step_function
from keras_memguard.backends.tensorflow import split_micro_batches
from keras_memguard.backends.tensorflow import replay
from keras_memguard.backends.tensorflow.mixin import MemGuardMixin
import programs
from split_cases import assert_a_model_that_fits_trains_as_plain_fit
from split_cases import assert_a_small_step_beside_much_memory_in_use_trains_as_plain_fit

# 203 samples in batches of 50: 4 full batches (50 is divisible by none of
# 3, 4 and 8) and a last batch of 3, smaller than k = 4 and k = 8.
NUM_SAMPLES = 203
BATCH_SIZE = 50
EPOCHS = 2
STEPS = EPOCHS * 5
ATOL = 1e-5

_rng = np.random.default_rng(0)
X = _rng.normal(size=(NUM_SAMPLES, 8)).astype("float32")
TOKENS = _rng.integers(0, 50, size=(NUM_SAMPLES, 5)).astype("int32")
Y = _rng.integers(0, 3, size=(NUM_SAMPLES,)).astype("int32")
SAMPLE_WEIGHT = _rng.uniform(0.1, 2.0, size=(NUM_SAMPLES,)).astype("float32")
CLASS_WEIGHT = {0: 1.0, 1: 3.0, 2: 0.5}


class GuardedSequential(MemGuardMixin, keras.Sequential):
    pass


class GuardedModel(MemGuardMixin, keras.Model):
    pass


TRACED_MICRO_BATCHES = []


class RecipeModel(MemGuardMixin, keras.Sequential):
    """The docstring recipe: a custom `train_step` on `accumulate_gradients`."""

    def train_step(self, data):
        TRACED_MICRO_BATCHES.append(self.micro_batches)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        result = accumulate_gradients(self, data, self.micro_batches)
        with tf.control_dependencies(result.control_inputs()):
            self._loss_tracker.update_state(
                result.loss, sample_weight=result.batch_size
            )
            self.optimizer.apply(result.gradients, self.trainable_weights)
            return self.compute_metrics(
                x, y, result.y_pred, sample_weight=sample_weight
            )


def build_mlp(cls=keras.Sequential, optimizer=None, jit_compile=False):
    keras.utils.set_random_seed(0)
    model = cls(
        [
            keras.Input((8,)),
            keras.layers.Dense(
                16,
                activation="relu",
                kernel_regularizer=keras.regularizers.L2(1e-2),
            ),
            # float32 outputs, as Keras advises under mixed precision.
            keras.layers.Dense(3, activation="softmax", dtype="float32"),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("w_acc")],
        jit_compile=jit_compile,
    )
    return model


class DenseGradientAdam(keras.optimizers.Adam):
    """Adam given dense gradients: duplicate embedding rows summed first.

    The reference for "exact": Keras applies element-wise ops to
    `tf.IndexedSlices` row by row, so a token that appears twice in a batch
    is squared twice by plain Adam, where the whole batch's dense gradient
    squares its sum.
    """

    def apply(self, grads, trainable_variables=None):
        grads = [
            tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in grads
        ]
        return super().apply(grads, trainable_variables)


def build_two_input_model(cls=keras.Model, optimizer_class=keras.optimizers.Adam):
    keras.utils.set_random_seed(0)
    dense_in = keras.Input((8,), name="dense")
    token_in = keras.Input((5,), name="tokens", dtype="int32")
    # Embedding gradients are IndexedSlices: the sparse accumulation path.
    embedded = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(token_in))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(
        keras.layers.Concatenate()([dense_in, embedded])
    )
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(hidden)
    model = cls({"dense": dense_in, "tokens": token_in}, outputs)
    model.compile(
        optimizer=optimizer_class(1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def fit(model, micro_batches=None, x=X, **kwargs):
    if micro_batches is not None:
        model.micro_batches = micro_batches
    history = model.fit(
        x,
        Y,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        **kwargs,
    )
    return model.get_weights(), history.history


def assert_same_training(result, reference, atol=ATOL):
    weights, history = result
    ref_weights, ref_history = reference
    assert len(weights) == len(ref_weights)
    for got, want in zip(weights, ref_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(
            history[key], ref_history[key], rtol=0, atol=atol, err_msg=key
        )


@contextlib.contextmanager
def global_policy(name):
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="module")
def weighted_reference():
    return fit(build_mlp(), sample_weight=SAMPLE_WEIGHT)


@pytest.fixture(scope="module")
def two_input_reference():
    return fit(
        build_two_input_model(optimizer_class=DenseGradientAdam),
        x={"dense": X, "tokens": TOKENS},
    )


def test_split_micro_batches_sizes_and_structure():
    x = {"a": tf.reshape(tf.range(20.0), (10, 2)), "b": tf.range(10)}
    parts = split_micro_batches((x, tf.range(10) * 10), 4)
    assert [int(p.size) for p in parts] == [3, 3, 2, 2]
    np.testing.assert_allclose(
        sum(float(p.fraction) for p in parts), 1.0, rtol=1e-6
    )
    np.testing.assert_array_equal(
        tf.concat([p.x["a"] for p in parts], 0), x["a"]
    )
    np.testing.assert_array_equal(parts[2].y, [60, 70])
    assert all(p.sample_weight is None for p in parts)


def test_split_micro_batches_dynamic_batch_smaller_than_k():
    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def sizes(x):
        return tf.stack([p.size for p in split_micro_batches(x, 5)])

    np.testing.assert_array_equal(sizes(tf.zeros([3, 2])), [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(sizes(tf.zeros([12, 2])), [3, 3, 2, 2, 2])


@pytest.mark.parametrize(
    "micro_batches",
    # k = 2 in the fast loop; every k in the whole suite.
    [*(pytest.param(k, marks=pytest.mark.slow) for k in (1, 3, 4, 8)), 2],
)
def test_accumulate_matches_full_batch(micro_batches, weighted_reference):
    # Sample weights, weighted metrics, L2 regularization counted once, a
    # batch not divisible by k and a last batch smaller than k.
    model = build_mlp(GuardedSequential)
    result = fit(model, micro_batches, sample_weight=SAMPLE_WEIGHT)
    assert_same_training(result, weighted_reference)
    assert int(model.optimizer.iterations) == STEPS


@pytest.mark.slow
def test_a_model_that_fits_trains_as_plain_fit_under_a_default_guard(recwarn):
    assert_a_model_that_fits_trains_as_plain_fit(recwarn)


@pytest.mark.slow
def test_a_step_left_whole_on_xla_trains_an_embedding_with_adam_as_plain_fit():
    # Plain Adam squares each lookup's row of an embedding's gradient on
    # its own; a guard that splits nothing must hand it the same rows
    # (merged, the weights ended 3.6e-3 apart).
    tokens = {"dense": X, "tokens": TOKENS}
    plain = build_two_input_model()
    plain.jit_compile = True
    reference = fit(plain, x=tokens)
    guarded = build_two_input_model()
    guarded.jit_compile = True
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 30)
    weights, history = fit(guarded, x=tokens, callbacks=[guard])
    assert history.pop("micro_batches") == [1] * EPOCHS
    assert_same_training((weights, history), reference, atol=1e-7)


@pytest.mark.slow
def test_accumulate_matches_full_batch_with_class_weight():
    reference = fit(build_mlp(), class_weight=CLASS_WEIGHT)
    result = fit(build_mlp(GuardedSequential), 4, class_weight=CLASS_WEIGHT)
    assert_same_training(result, reference)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [3, 8])
def test_accumulate_matches_full_batch_with_dict_inputs(
    micro_batches, two_input_reference
):
    model = build_two_input_model(GuardedModel)
    result = fit(model, micro_batches, x={"dense": X, "tokens": TOKENS})
    assert_same_training(result, two_input_reference)


@pytest.mark.slow
def test_accumulate_matches_full_batch_under_xla():
    reference = fit(build_mlp(jit_compile=True), sample_weight=SAMPLE_WEIGHT)
    model = build_mlp(GuardedSequential, jit_compile=True)
    result = fit(model, 4, sample_weight=SAMPLE_WEIGHT)
    assert_same_training(result, reference)


@pytest.mark.slow
def test_accumulate_matches_full_batch_run_eagerly(weighted_reference):
    model = build_mlp(GuardedSequential)
    model.run_eagerly = True
    result = fit(model, 3, sample_weight=SAMPLE_WEIGHT)
    assert_same_training(result, weighted_reference)


@pytest.mark.slow
def test_accumulate_matches_full_batch_under_mixed_precision():
    # float16 rounds each micro-batch's matmuls (and their float16 sums
    # over the samples) differently from the whole batch's: gradients differ
    # by about float16's epsilon (1e-3) relative. SGD, not Adam, whose
    # normalization blows such differences up for near-zero gradients.
    # Measured: 2.2e-5 after 10 steps (weights up to 0.56); weighting the
    # micro-batches equally instead of by n_i / n gives 1.3e-3.
    with global_policy("mixed_float16"):
        reference_model = build_mlp(optimizer=keras.optimizers.SGD(0.1))
        reference = fit(reference_model)
        model = build_mlp(GuardedSequential, keras.optimizers.SGD(0.1))
        result = fit(model, 4)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_same_training(result, reference, atol=2e-4)
    assert float(model.optimizer.dynamic_scale) == float(
        reference_model.optimizer.dynamic_scale
    )
    # Keras 3.8's LossScaleOptimizer counts its iterations in the inner
    # optimizer only: compare with plain training on the same version.
    assert int(model.optimizer.iterations) == int(
        reference_model.optimizer.iterations
    )


OPTIMIZER_OPTIONS = {
    # Clipping acts on the whole batch's gradient, as in plain training;
    # clipped per micro-batch and summed, it would not.
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.02),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.005),
    "weight_decay": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.5),
    "ema": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_overwrite_frequency=3
    ),
    "schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.CosineDecay(5e-2, decay_steps=STEPS)
    ),
}


@pytest.mark.parametrize(
    "option",
    # Global clipping in the fast loop; every option in the whole suite.
    [
        "global_clipnorm",
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in OPTIMIZER_OPTIONS
            if name != "global_clipnorm"
        ),
    ],
)
def test_accumulate_matches_full_batch_with_optimizer_options(option):
    # One update per batch from the whole batch's gradient: the optimizer's
    # clipping, weight decay, moving average and schedule see what plain
    # training gives them, once per batch.
    make_optimizer = OPTIMIZER_OPTIONS[option]
    reference = fit(build_mlp(optimizer=make_optimizer()), sample_weight=SAMPLE_WEIGHT)
    model = build_mlp(GuardedSequential, make_optimizer())
    result = fit(model, 4, sample_weight=SAMPLE_WEIGHT)
    assert_same_training(result, reference)
    assert int(model.optimizer.iterations) == STEPS
    if option.startswith("clip"):
        # The clipping is active here: without it training differs.
        unclipped = fit(
            build_mlp(optimizer=keras.optimizers.SGD(0.5)),
            sample_weight=SAMPLE_WEIGHT,
        )
        assert max(
            np.max(np.abs(a - b)) for a, b in zip(reference[0], unclipped[0])
        ) > 100 * ATOL


@pytest.mark.slow
def test_shrink_makes_one_update_per_micro_batch():
    model = build_mlp(GuardedSequential)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss="sparse_categorical_crossentropy",
        steps_per_execution=3,
    )
    model.micro_batch_mode = "shrink"
    _, history = fit(model, 4)
    # Per epoch: 4 batches of 50 in 4 parts, the last batch of 3 in 3.
    assert int(model.optimizer.iterations) == EPOCHS * (4 * 4 + 3)
    assert np.all(np.isfinite(history["loss"]))


@pytest.mark.slow
def test_changing_micro_batches_between_batches(weighted_reference):
    class SwitchAfterFirstBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.model.micro_batches = 4

    TRACED_MICRO_BATCHES.clear()
    model = build_mlp(RecipeModel)
    result = fit(
        model,
        sample_weight=SAMPLE_WEIGHT,
        callbacks=[SwitchAfterFirstBatch()],
    )
    # One trace per k, each reading its own k; the user's train_step ran.
    assert TRACED_MICRO_BATCHES[0] == 1
    assert set(TRACED_MICRO_BATCHES) == {1, 4}
    assert model.micro_batches == 4
    assert_same_training(result, weighted_reference)


@pytest.mark.slow
def test_peak_memory_of_micro_batches_matches_smaller_batch():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((48, 48, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = tf.random.normal((128, 48, 48, 3))
    y = tf.random.uniform((128,), 0, 10, tf.int32)

    def step_peak(micro_batches, batch_size):
        step = make_step_function(model, micro_batches)
        data = (x[:batch_size], y[:batch_size])
        step(data)  # Trace first: measure a steady-state step.
        peaks = []
        # The least of three steps: the order TensorFlow's executor runs
        # independent ops in moves a step's peak by a tensor or so.
        for _ in range(3):
            tf.config.experimental.reset_memory_stats("CPU:0")
            # What the step adds to what is held: the held part includes
            # whatever earlier tests in this worker have not freed yet.
            held = tf.config.experimental.get_memory_info("CPU:0")["current"]
            logs = step(data)
            assert np.isfinite(float(logs["loss"]))
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            peaks.append(peak - held)
        return min(peaks)

    small_batch = step_peak(1, 32)
    micro_batched = step_peak(4, 128)
    full_batch = step_peak(1, 128)
    # Measured alone: peaks of about 81, 81 and 189 MiB; in one worker of
    # the suite 68 and 80 (the 32-sample step's ops ran in a leaner order).
    assert micro_batched - small_batch <= 0.25 * (full_batch - small_batch), (
        micro_batched,
        small_batch,
        full_batch,
    )
    assert full_batch >= 1.5 * micro_batched, (full_batch, micro_batched)


@pytest.mark.slow
def test_failed_step_leaves_no_trace():
    # Micro-batch 0 is light; micro-batch 1 allocates ~2.6 GB under a 512
    # MiB cap: a real out-of-memory error inside the micro-batch loop,
    # after micro-batch 0's gradients exist.
    code = programs.source("micro_batch_failed_step")
    run = run_with_memory_cap(code, memory_limit_mib=512, timeout=180)
    assert run.result["oom"], run.stderr[-2000:]
    assert run.result["changed"] == []
    assert run.result["iterations"] == [1, 2]


@pytest.mark.slow
def test_batch_statistics_warning_once():
    def build(cls):
        keras.utils.set_random_seed(0)
        return cls(
            [
                keras.Input((8,)),
                keras.layers.Dense(4),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )

    assert not has_batch_statistics_layers(build_mlp())
    frozen = build(keras.Sequential)
    frozen.layers[1].trainable = False
    assert not has_batch_statistics_layers(frozen)

    model = build(GuardedSequential)
    assert has_batch_statistics_layers(model)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X[:60], Y[:60], batch_size=30, verbose=0)  # k = 1
        model.micro_batches = 2
        model.fit(X[:60], Y[:60], batch_size=30, verbose=0)
        model.micro_batches = 4
        model.fit(X[:60], Y[:60], batch_size=30, verbose=0)
    messages = [
        str(w.message) for w in caught if "BatchNormalization" in str(w.message)
    ]
    assert len(messages) == 1
    assert "micro_batches=2" in messages[0]


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_mixin_rejects_bad_micro_batches(value):
    model = GuardedSequential([keras.Input((2,)), keras.layers.Dense(1)])
    message = (
        "`micro_batches` must be an integer >= 1. "
        f"Received: micro_batches={value!r}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        model.micro_batches = value
    assert model.micro_batches == 1


def test_mixin_rejects_bad_mode_and_factory_validates():
    model = GuardedSequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(
        ValueError,
        match=re.escape("Received: micro_batch_mode='halve'"),
    ):
        model.micro_batch_mode = "halve"
    assert model.micro_batch_mode == "accumulate"
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="micro_batches=0"):
        make_step_function(model, 0)
    with pytest.raises(ValueError, match="micro_batches=2.0"):
        split_micro_batches(tf.zeros([4, 2]), 2.0)


@pytest.mark.slow
def test_save_and_load_round_trip(tmp_path):
    model = build_mlp(GuardedSequential)
    model.micro_batches = 2
    model.fit(X[:100], Y[:100], batch_size=BATCH_SIZE, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"GuardedSequential": GuardedSequential}
    )
    assert type(loaded) is GuardedSequential
    assert loaded.micro_batches == 1  # Runtime state, not configuration.
    np.testing.assert_allclose(
        loaded.predict(X[:10], verbose=0), model.predict(X[:10], verbose=0)
    )
    assert int(loaded.optimizer.iterations) == 2
    loaded.micro_batches = 2
    loaded.fit(X[:100], Y[:100], batch_size=BATCH_SIZE, verbose=0)
    assert int(loaded.optimizer.iterations) == 4
    logs = loaded.train_on_batch(X[:50], Y[:50], return_dict=True)
    assert np.isfinite(logs["loss"])
    assert int(loaded.optimizer.iterations) == 5

    functional = build_two_input_model(GuardedModel)
    clone = GuardedModel.from_config(functional.get_config())
    assert isinstance(clone, GuardedModel)
    assert clone.micro_batches == 1


@pytest.mark.parametrize(
    "data",
    [
        (tf.zeros([6, 8]), tf.zeros([6])),
        (tf.zeros([6, 8]),),
        tf.zeros([6, 4, 2]),
        [tf.zeros([6, 8]), tf.zeros([6])],
        ({"b": tf.zeros([4, 3, 2]), "a": tf.zeros([4, 5])}, tf.zeros([4])),
        (tf.zeros([0, 3]), tf.zeros([0])),
        (tf.zeros([]), tf.zeros([7, 2])),
        (np.zeros((5, 3, 0)), np.zeros(5)),
        ({"a": None, "b": tf.zeros([3, 2])}, None),
        ((tf.zeros([]),), tf.zeros([]), None),
        ([tf.zeros([2, 4]), tf.zeros([2, 0, 3])], tf.zeros([2]), tf.zeros([2])),
    ],
)
def test_batch_sizes_in_one_pass_match_the_two_functions(data):
    expected = (replay.replica_batch_sizes(data), replay.sample_size_of(data))
    assert replay._batch_sizes(data, None, True) == expected
    assert replay._batch_sizes(data, None, False) == (expected[0], None)


class _PerReplica(tf.distribute.DistributedValues):
    """Per-replica values, as a strategy's distributed dataset yields them."""

    def __init__(self, *values):
        self.values = values


class _LocalResults:
    """The one method of a strategy the batch sizes read."""

    def experimental_local_results(self, value):
        return value.values


@pytest.mark.parametrize("strategy", [None, _LocalResults()])
def test_batch_sizes_in_one_pass_read_per_replica_values(strategy):
    x = _PerReplica(tf.zeros([3, 4, 2]), tf.zeros([5, 4, 2]))
    unknown = _PerReplica(tf.zeros([3, 1]), np.zeros(()))
    for data, expected in (
        ((x, tf.zeros([8])), ((3, 5), 8.0)),
        (({"a": unknown, "b": x}, tf.zeros([8])), ((3, 5), 9.0)),
        (((unknown,), tf.zeros([8])), ((8,), 1.0)),
    ):
        assert replay.replica_batch_sizes(data, strategy) == expected[0]
        assert replay.sample_size_of(data, strategy) == expected[1]
        assert replay._batch_sizes(data, strategy, True) == expected
        assert replay._batch_sizes(data, strategy, False) == (expected[0], None)


class SubclassedNet(keras.Model):
    """A keras-io style subclassed model: layers in `__init__`, no Input."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class GuardedSubclassedNet(MemGuardMixin, SubclassedNet):
    pass


@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_unbuilt_subclassed_model_trains_micro_batched_as_plain_keras(jit_compile):
    # Its variables and the optimizer's do not exist before `fit`: they are
    # created before the first micro-batched step, not inside it.
    def train(cls, **attributes):
        keras.utils.set_random_seed(3)
        model = cls()
        for name, value in attributes.items():
            setattr(model, name, value)
        model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
        x = np.arange(64 * 4, dtype="float32").reshape(64, 4) / 256
        y = x.sum(axis=1, keepdims=True)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return [w.numpy() for w in model.weights]

    reference = train(SubclassedNet)
    micro_batched = train(GuardedSubclassedNet, micro_batches=4)
    for got, want in zip(micro_batched, reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_small_step_beside_much_memory_in_use_trains_as_plain_fit():
    assert_a_small_step_beside_much_memory_in_use_trains_as_plain_fit(
        lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]
    )
