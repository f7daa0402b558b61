"""A model's own `train_step` under micro-batching: the keras-io VAE pattern.

`MemGuardMixin.accumulate_gradients(data, compute_loss=None, variables=None)`
splits the batch into `self.micro_batches` micro-batches and returns the
summed gradients, the share-weighted loss and extras, the predictions (default
loss path only), the batch size and `control_inputs()`. A mixin model that
keeps its own GradientTape step cannot be split and must be refused above one
micro-batch.
"""

import numpy as np
import pytest

import keras
import tensorflow as tf
from keras import ops

import keras_memguard

# Whole models trained against plain Keras: tens of seconds; out of the
# fast loop.
pytestmark = pytest.mark.slow

GUARD_LIMIT = 8 * 2**30
LATENT = 2


class Sampling(keras.layers.Layer):
    """keras-io's reparameterization, with an optional deterministic noise.

    With `fixed_noise`, epsilon is a fixed function of each sample's own
    `z_mean` (no random draw): a sample gets the same noise whatever
    micro-batch it is in, so split and whole-batch training can be compared
    exactly. Random noise is drawn per call, with a shape that depends on the
    split, so it cannot be compared sample by sample.
    """

    def __init__(self, fixed_noise=False, **kwargs):
        super().__init__(**kwargs)
        self.fixed_noise = fixed_noise
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        if self.fixed_noise:
            epsilon = ops.stop_gradient(ops.sin(12.9898 * z_mean + 78.233))
        else:
            epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def make_encoder(fixed_noise):
    """keras-io's encoder, narrower (8 and 16 filters) for speed."""
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    z_mean = keras.layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = keras.layers.Dense(LATENT, name="z_log_var")(x)
    z = Sampling(fixed_noise)([z_mean, z_log_var])
    return keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")


def make_decoder():
    inputs = keras.Input((LATENT,))
    x = keras.layers.Dense(7 * 7 * 16, activation="relu")(inputs)
    x = keras.layers.Reshape((7, 7, 16))(x)
    x = keras.layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    x = keras.layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    outputs = keras.layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    return keras.Model(inputs, outputs, name="decoder")


def vae_losses(encoder, decoder, data):
    """keras-io's VAE losses of one batch: (total, reconstruction, kl)."""
    z_mean, z_log_var, z = encoder(data)
    reconstruction = decoder(z)
    reconstruction_loss = ops.mean(
        ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
    )
    kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
    kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
    return reconstruction_loss + kl_loss, reconstruction_loss, kl_loss


class VAEBase(keras.Model):
    """keras-io's VAE: encoder, decoder, three Mean trackers, no `call()`."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]


class PlainVAE(VAEBase):
    """keras-io's `train_step`, unchanged."""

    def train_step(self, data):
        with tf.GradientTape() as tape:
            total_loss, reconstruction_loss, kl_loss = vae_losses(
                self.encoder, self.decoder, data
            )
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}


class GuardedVAE(keras_memguard.MemGuardMixin, VAEBase):
    """The same VAE, its step built on `accumulate_gradients`."""

    def train_step(self, data):
        def compute_loss(x, y, sample_weight):
            total_loss, reconstruction_loss, kl_loss = vae_losses(
                self.encoder, self.decoder, x
            )
            return total_loss, {
                "reconstruction_loss": reconstruction_loss,
                "kl_loss": kl_loss,
            }

        result = self.accumulate_gradients(data, compute_loss)
        with tf.control_dependencies(result.control_inputs()):
            self.optimizer.apply(result.gradients, self.trainable_weights)
            self.total_loss_tracker.update_state(result.loss)
            self.reconstruction_loss_tracker.update_state(
                result.extras["reconstruction_loss"]
            )
            self.kl_loss_tracker.update_state(result.extras["kl_loss"])
            return {m.name: m.result() for m in self.metrics}


def make_vae(cls, fixed_noise=True, initial=None):
    keras.utils.set_random_seed(0)
    model = cls(make_encoder(fixed_noise), make_decoder())
    model.compile(optimizer=keras.optimizers.Adam())
    if initial is not None:
        model.encoder.set_weights(initial[0])
        model.decoder.set_weights(initial[1])
    return model


def images(n=192, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((n, 28, 28, 1)) < 0.3).astype("float32")


def vae_weights(model):
    return model.encoder.get_weights() + model.decoder.get_weights()


def max_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


TRACKERS = ["total_loss", "reconstruction_loss", "kl_loss"]
# Measured (TF 2.21, Keras 3.15, CPU, float32, Adam, 2 epochs of 3 batches):
# a hand-written dense accumulation of this VAE at k=4 ends 9.7e-8 from the
# keras-io step in weights and 1.1e-7 relative in the trackers; the keras-io
# step with the samples of each batch reordered, 6.3e-8 and 1.1e-7.
HISTORY_RTOL = 1e-5
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def keras_io_run():
    x = images()
    model = make_vae(PlainVAE)
    initial = (model.encoder.get_weights(), model.decoder.get_weights())
    history = model.fit(x, epochs=2, batch_size=64, shuffle=False, verbose=0)
    return x, initial, history, vae_weights(model)


def assert_matches_keras_io(run, history, model):
    _, _, expected_history, expected_weights = run
    for name in TRACKERS:
        np.testing.assert_allclose(
            history.history[name], expected_history.history[name], rtol=HISTORY_RTOL,
            err_msg=name,
        )
    assert max_difference(vae_weights(model), expected_weights) < WEIGHT_TOLERANCE


@pytest.mark.parametrize("k", [1, 4])
def test_vae_with_micro_batches_attribute_matches_keras_io(keras_io_run, k):
    x, initial = keras_io_run[:2]
    model = make_vae(GuardedVAE, initial=initial)
    model.micro_batches = k
    history = model.fit(x, epochs=2, batch_size=64, shuffle=False, verbose=0)
    assert_matches_keras_io(keras_io_run, history, model)


def test_vae_under_memory_guard_matches_keras_io(keras_io_run):
    x, initial = keras_io_run[:2]
    model = make_vae(GuardedVAE, initial=initial)
    guard = keras_memguard.MemoryGuard(micro_batches=4, memory_limit=GUARD_LIMIT, plan=False)
    history = model.fit(x, epochs=2, batch_size=64, shuffle=False, verbose=0,
                        callbacks=[guard])
    assert model.micro_batches == guard.micro_batches == 4
    assert_matches_keras_io(keras_io_run, history, model)


def test_vae_with_random_noise_trains_under_memory_guard():
    x = images()
    model = make_vae(GuardedVAE, fixed_noise=False)
    guard = keras_memguard.MemoryGuard(micro_batches=4, memory_limit=GUARD_LIMIT, plan=False)
    history = model.fit(x, epochs=2, batch_size=64, verbose=0, callbacks=[guard])
    assert np.all(np.isfinite(history.history["total_loss"]))
    assert int(model.optimizer.iterations) == 6  # one update per batch
    assert guard.micro_batches == 4


# --- What `accumulate_gradients` returns. ---


class Probe(keras_memguard.MemGuardMixin, keras.Model):
    """Logs what `accumulate_gradients` returned (one batch per fit)."""

    custom_loss = False

    def train_step(self, data):
        if self.custom_loss:

            def compute_loss(x, y, sample_weight):
                loss = ops.mean(ops.square(self(x) - y))
                return loss, {"x0": ops.mean(x[:, 0])}

            result = self.accumulate_gradients(data, compute_loss)
        else:
            result = self.accumulate_gradients(data)
        with tf.control_dependencies(result.control_inputs()):
            self.optimizer.apply(result.gradients, self.trainable_weights)
            logs = {
                "result_loss": result.loss,
                "batch": ops.cast(result.batch_size, "float32"),
                "rows": -1.0 if result.y_pred is None
                else ops.cast(ops.shape(result.y_pred)[0], "float32"),
            }
            if self.custom_loss:
                logs["x0"] = result.extras["x0"]
            return logs


def make_probe(custom_loss):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = Probe(inputs, keras.layers.Dense(1)(inputs))
    model.custom_loss = custom_loss
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("custom_loss", [False, True])
def test_accumulate_gradients_weights_loss_and_extras_by_each_share(custom_loss):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype("float32")  # k=4: 3+3+2+2 samples
    y = rng.normal(size=(10, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    reference = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    reference.compile(optimizer="sgd", loss="mse")
    full_loss = float(reference.evaluate(x, y, batch_size=10, verbose=0))

    model = make_probe(custom_loss)
    model.set_weights(reference.get_weights())
    model.micro_batches = 4
    history = model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    reference.fit(x, y, batch_size=10, epochs=1, verbose=0)

    assert history.history["result_loss"][0] == pytest.approx(full_loss, rel=1e-6)
    assert history.history["batch"] == [10.0]
    assert history.history["rows"] == ([-1.0] if custom_loss else [10.0])
    if custom_loss:
        assert history.history["x0"][0] == pytest.approx(float(np.mean(x[:, 0])), abs=1e-6)
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-6


# --- A mixin model that keeps its own GradientTape step. ---


class OwnStep(keras_memguard.MemGuardMixin, keras.Model):
    """Mixes in the guard but never calls `accumulate_gradients`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self(x, training=True) - y))
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(gradients, self.trainable_weights)
        return {"loss": loss}


def make_own_step(cls=OwnStep):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd")
    return model


def xy(n=64):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_own_gradient_tape_step_is_refused_with_micro_batches_above_one():
    model = make_own_step()
    model.micro_batches = 2
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError, match="accumulate_gradients"):
        model.fit(*xy(), batch_size=32, verbose=0)


def test_own_gradient_tape_step_is_refused_by_a_guard_starting_split():
    model = make_own_step()
    guard = keras_memguard.MemoryGuard(micro_batches=2, memory_limit=GUARD_LIMIT, plan=False)
    with pytest.raises(keras_memguard.UnsupportedTrainingSetupError, match="accumulate_gradients"):
        model.fit(*xy(), batch_size=32, verbose=0, callbacks=[guard])


def test_own_gradient_tape_step_still_trains_at_one_micro_batch():
    class PlainOwnStep(keras.Model):
        train_step = OwnStep.train_step

    model, plain = make_own_step(), make_own_step(PlainOwnStep)
    plain.set_weights(model.get_weights())
    model.micro_batches = 1
    history = model.fit(*xy(), batch_size=32, epochs=2, shuffle=False, verbose=0)
    plain_history = plain.fit(*xy(), batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert history.history["loss"] == plain_history.history["loss"]
    assert max_difference(model.get_weights(), plain.get_weights()) == 0.0
