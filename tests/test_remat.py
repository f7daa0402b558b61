"""The "remat" rung: which models it can segment, and that it trains alike.

Under a real cap (a model that does not fit one sample without it) it is
tested in `tests/test_planning.py`.
"""

import numpy as np
import pytest

import keras

import keras_memguard
from keras_memguard.backends.tensorflow import remat
from keras_memguard.backends.tensorflow import step


def convs(count=7, **kwargs):
    return [keras.layers.Conv2D(4, 3, padding="same", activation="relu", **kwargs)
            for _ in range(count)]


def sequential(extra=()):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 3))] + convs() + list(extra)
        + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]
    )
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def functional_chain():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = inputs
    for layer in convs():
        h = layer(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    return keras.Model(inputs, outputs)


def test_sequential_and_functional_chains_are_cut_into_segments_of_three():
    for model in (sequential(), functional_chain()):
        layers, reason = remat.chain_layers(model)
        assert reason is None
        assert len(layers) == 9
        assert remat.can_remat(model) is None


def test_models_the_rung_cannot_segment_say_why():
    inputs = keras.Input((8, 8, 3))
    a = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    b = keras.layers.Conv2D(4, 3, padding="same")(a)
    c = keras.layers.Conv2D(4, 3, padding="same")(keras.layers.Add()([a, b]))
    branching = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(c)))
    assert "previous layer's output" in remat.can_remat(branching)
    assert "random numbers" in remat.can_remat(
        sequential(extra=[keras.layers.Dropout(0.5)])
    )
    assert "moving statistics" in remat.can_remat(
        sequential(extra=[keras.layers.BatchNormalization()])
    )

    class Own(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((4,))
    own = Own(inputs, keras.layers.Dense(1)(inputs))
    assert "`train_step` of its own" in remat.can_remat(own)
    with pytest.raises(ValueError, match="cannot be used"):
        remat.switch_on(own)


# A few seconds: out of the fast loop.
@pytest.mark.slow
def test_with_the_rung_the_step_gives_the_weights_of_plain_training():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, size=(6,))
    trained = []
    for rung in ((), ("remat",)):
        model = sequential()
        guard = keras_memguard.MemoryGuard(
            memory_limit=1 << 40, plan=False, micro_batches=2, escalate=rung
        )
        if rung:
            remat.switch_on(model)
        model.fit(x, y, batch_size=6, epochs=2, verbose=0, callbacks=[guard])
        assert remat.is_on(model) == bool(rung)
        # The step that trained was the one compiled with the rung (or without).
        keys = set(model.__dict__[step._CACHE_ATTR][1])
        assert ("train", 2, "accumulate", bool(rung)) in keys
        assert ("train", 2, "accumulate", not rung) not in keys
        trained.append(model.get_weights())
    for plain, recomputed in zip(*trained):
        np.testing.assert_allclose(recomputed, plain, rtol=1e-5, atol=1e-6)
    remat.switch_off(model)
    assert not remat.is_on(model)


@pytest.mark.parametrize("value", ["remat", ("jit",), None, ["remat", 3]])
def test_escalate_must_be_a_tuple_of_known_rungs(value):
    with pytest.raises(ValueError) as info:
        keras_memguard.MemoryGuard(escalate=value)
    message = str(info.value)
    assert "`escalate` must be a tuple of rung names from ('remat',)" in message
    assert repr(value) in message


def test_the_error_past_the_last_rung_says_what_was_tried():
    from keras_memguard.callbacks.messages import too_large

    message = too_large(4, 4, 300 * 2**20, 280 * 2**20, ("remat",), ("remat",))
    assert "Tried: 4 micro-batches of one sample, then the rungs: remat." in message
    assert "300.0 MiB" in message and "280.0 MiB" in message
    refused = ("remat (not possible: layer 'dropout' draws random numbers)",)
    message = too_large(1, 1, None, None, ("remat",), refused)
    assert "then the rungs: remat (not possible: layer 'dropout'" in message


def test_the_remat_rung_is_offered_only_where_it_could_be_used():
    from keras_memguard.callbacks.messages import too_large

    offered = too_large(4, 4, None, None, remat_refusal=None)
    assert 'HINT: `MemoryGuard(escalate=("remat",))`' in offered
    refused = too_large(
        4, 4, None, None, remat_refusal="layer 'add' does not take the previous layer's output"
    )
    assert "escalate=" not in refused
    assert "the remat rung cannot be used on this model: layer 'add'" in refused
    # Evaluation, prediction and the JAX backend have no rungs to offer.
    plain = too_large(4, 4, None, None)
    assert "Tried: 4 micro-batches of one sample. HINT: use mixed precision" in plain
    assert "rung" not in plain


@pytest.mark.slow
def test_keras_applications_vgg16_trains_alike_with_the_rung_and_others_say_why_not():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 32, 32, 3)).astype("float32")
    y = np.arange(4) % 10
    trained = []
    for rung in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.applications.VGG16(
            weights=None, input_shape=(32, 32, 3), classes=10,
            classifier_activation=None,
        )
        model.compile(
            keras.optimizers.SGD(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        assert remat.can_remat(model) is None
        if rung:
            assert remat.switch_on(model) == 8  # 23 layers in segments of 3
        guard = keras_memguard.MemoryGuard(
            memory_limit=1 << 40, plan=False, micro_batches=2
        )
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[guard])
        trained.append(model.get_weights())
    for plain, recomputed in zip(*trained):
        np.testing.assert_allclose(recomputed, plain, rtol=1e-5, atol=1e-6)
    # Residual and densely connected networks are no chain.
    resnet = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    assert "does not take the previous layer's output" in remat.can_remat(resnet)


def test_a_rung_the_model_cannot_use_is_tried_once_and_training_goes_on():
    # A limit far below any batch: every batch is planned at one sample per
    # micro-batch, still predicted over, so the guard tries to climb; the
    # model has dropout, so the rung is refused, once.
    model = sequential(extra=[keras.layers.Dropout(0.5)])
    guard = keras_memguard.MemoryGuard(
        memory_limit=4096, escalate=("remat",), plan_cache=False
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, size=(24,))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[guard])
    assert guard.micro_batches == 4
    assert guard.rungs_on == ()
    assert list(guard.controller.rungs_refused) == ["remat"]
    assert "random numbers" in guard.controller.rungs_refused["remat"]
    assert not remat.is_on(model)
