"""Losses that average over a mask are combined exactly across micro-batches.

A loss with `ignore_class`, or one on outputs that carry a Keras mask
(`Embedding(mask_zero=True)`, `Masking`), is a mean over the unmasked
elements of the batch. Padded sequences of different lengths put different
numbers of them in each micro-batch, so weighting micro-batches by their
share of the samples is not the whole batch's loss. Nor is it for the other
reductions Keras has: `"sum"` (the micro-batches' sums add up) and
`"mean_with_sample_weight"` (a mean over the sample weights' sum).
"""

import warnings

import numpy as np
import pytest

import keras

import keras_memguard
from keras_memguard.backends.tensorflow.mixin import MemGuardMixin
from split_cases import assert_added_losses_train_as_plain_fit
from split_cases import assert_metric_functions_read_as_plain_fit
from split_cases import test_masked_losses_train_as_plain_fit  # noqa: F401
from split_cases import test_a_masked_sequence_loss_is_not_called_one_over_the_whole_batch  # noqa: F401
from split_cases import test_variables_the_forward_pass_writes_are_named_at_a_split  # noqa: F401
from split_cases import test_several_masked_loss_terms_are_warned_about_once  # noqa: F401
from split_cases import assert_a_ctc_loss_trains_as_plain_fit
from split_cases import assert_an_output_without_a_batch_dimension_trains_as_plain_fit
from split_cases import test_an_output_without_a_batch_dimension_trains_as_plain_fit  # noqa: F401
from split_cases import test_fit_options_train_as_plain_fit  # noqa: F401
from split_cases import test_a_ctc_loss_trains_as_plain_fit  # noqa: F401

VOCABULARY, TOKENS = 40, 12
BATCH = 24


class GuardedModel(MemGuardMixin, keras.Model):
    pass


def _padded_sequences(count=96, seed=0):
    """Token ids padded with 0 after a length of 2 to 12, and next-token targets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, TOKENS + 1, size=count)
    x = rng.integers(1, VOCABULARY, size=(count, TOKENS)).astype("int32")
    x[np.arange(TOKENS)[None, :] >= lengths[:, None]] = 0
    y = np.roll(x, -1, axis=1)
    y[:, -1] = 0
    return x, y


def _model(cls, kind, jit_compile=False):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TOKENS,), dtype="int32")
    if kind == "ignore_class":
        hidden = keras.layers.Embedding(VOCABULARY, 16)(tokens)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    elif kind == "mask_zero":
        hidden = keras.layers.Embedding(VOCABULARY, 16, mask_zero=True)(tokens)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:  # a Masking layer over one-hot inputs
        one_hot = keras.layers.Lambda(
            lambda t: keras.ops.one_hot(t, VOCABULARY), output_shape=(TOKENS, VOCABULARY)
        )(tokens)
        hidden = keras.layers.Masking(0.0)(
            keras.layers.Lambda(lambda h: h[..., 1:], output_shape=(TOKENS, VOCABULARY - 1))(
                one_hot
            )
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hidden = keras.layers.Dense(32, activation="tanh")(hidden)
    logits = keras.layers.Dense(VOCABULARY)(hidden)
    model = cls(tokens, logits)
    # Plain SGD: an embedding's sparse gradient with repeated rows updates
    # Adam row by row in plain Keras (see training/accumulation.py), which
    # is not what this test is about.
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, jit_compile=jit_compile)
    return model


def _train(model, micro_batches=None):
    if micro_batches is not None:
        model.micro_batches = micro_batches
    x, y = _padded_sequences()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"]


@pytest.mark.parametrize("kind", ["ignore_class", "mask_zero", "masking"])
def test_a_masked_mean_loss_trains_as_the_whole_batch_does(kind):
    weights, losses = _train(_model(GuardedModel, kind), 4)
    reference_weights, reference_losses = _train(_model(keras.Model, kind))
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=2e-6)
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_a_masked_mean_loss_trains_as_the_whole_batch_does_under_xla():
    weights, losses = _train(_model(GuardedModel, "ignore_class", jit_compile=True), 4)
    reference_weights, reference_losses = _train(
        _model(keras.Model, "ignore_class", jit_compile=True)
    )
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=2e-6)
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_padding_puts_different_numbers_of_tokens_in_each_micro_batch():
    # What makes the test above fail where micro-batches are weighted by
    # their share of the samples.
    x, _ = _padded_sequences()
    per_micro_batch = (x[:BATCH] != 0).reshape(4, -1).sum(axis=1)
    assert len(set(per_micro_batch.tolist())) > 1


def _reduced_model(reduction, jit_compile, masked):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCABULARY, 16)(tokens)
    hidden = keras.layers.Dense(32, activation="tanh", kernel_regularizer="l2")(hidden)
    model = keras.Model(tokens, keras.layers.Dense(VOCABULARY)(hidden))
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0 if masked else None, reduction=reduction
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=jit_compile)
    return model


# With XLA (compiles of their own): out of the fast loop.
@pytest.mark.parametrize(
    "jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no_xla", "xla"]
)
@pytest.mark.parametrize(
    "reduction, masked",
    [
        ("sum", False),
        pytest.param("mean_with_sample_weight", False, marks=pytest.mark.slow),
        pytest.param("mean_with_sample_weight", True, marks=pytest.mark.slow),
    ],
)
def test_every_reduction_trains_as_the_whole_batch_does(reduction, masked, jit_compile):
    # Summed, a micro-batch's loss used to count a third of itself (k=3);
    # over the weights' sum, each micro-batch divided by its own. Skewed
    # weights, a batch that 3 does not divide and a last, smaller batch.
    x, y = _padded_sequences(count=100)
    weight = (np.random.default_rng(1).random(x.shape) ** 3).astype("float32")
    runs = []
    for guarded in (True, False):
        model = _reduced_model(reduction, jit_compile, masked)
        callbacks = [
            keras_memguard.MemoryGuard(memory_limit=1 << 30, plan=False, micro_batches=3)
        ] if guarded else []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(
                x, y, sample_weight=weight, batch_size=BATCH + 1, epochs=2, shuffle=False,
                verbose=0, callbacks=callbacks,
            )
        # The guard's check of its own combination finds it exact.
        assert not [w for w in caught if "add up to" in str(w.message)]
        runs.append((model.get_weights(), history.history["loss"]))
    (weights, losses), (reference_weights, reference_losses) = runs
    np.testing.assert_allclose(losses, reference_losses, rtol=2e-6)
    for got, want in zip(weights, reference_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "jit_compile, plan",
    [
        (False, False),
        pytest.param(True, False, marks=pytest.mark.slow),
        pytest.param(True, True, marks=pytest.mark.slow),
    ],
)
def test_losses_the_layers_add_train_as_plain_fit(recwarn, jit_compile, plan):
    # Summed, mean and activity-regularizer losses and a kernel regularizer;
    # with XLA the step is read (traced) before the check measures the
    # losses, and traced again once a sum is marked.
    assert_added_losses_train_as_plain_fit(
        recwarn,
        lambda: keras_memguard.MemoryGuard(
            memory_limit=1 << 30, plan=plan, micro_batches=4
        ),
        jit_compile,
    )


@pytest.mark.slow
def test_metric_functions_of_the_users_read_as_in_plain_fit():
    # A batch statistic read 0.453 against plain fit's 0.552, and a mean
    # per batch 0.996 against 0.986: updated per micro-batch, each counted
    # as one value.
    assert_metric_functions_read_as_plain_fit()


@pytest.mark.slow
def test_an_output_without_a_batch_dimension_trains_as_plain_fit_with_xla():
    assert_an_output_without_a_batch_dimension_trains_as_plain_fit(jit_compile=True)


@pytest.mark.slow
def test_a_ctc_loss_trains_as_plain_fit_with_xla():
    # The alignment's dynamic programme inside the XLA-compiled micro-batch loop.
    assert_a_ctc_loss_trains_as_plain_fit(jit_compile=True)
