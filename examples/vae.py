"""A variational autoencoder with its own train_step, micro-batched by MemoryGuard.

The keras-io VAE (https://keras.io/examples/generative/vae/): an encoder and a
decoder, a `VAE` model without `call()` whose `train_step` computes its own
loss and updates three `Mean` trackers. Mixing in `MemGuardMixin` and building
the step on `self.accumulate_gradients(data, compute_loss)` is all it takes
for `MemoryGuard` to split its batches. Trained on random binary 28x28 images
(no download) under a real 160 MiB allocator cap, where plain training of a
512-image batch runs out of memory.

    python examples/vae.py [--cap-mib 160] [--batch-size 512]
"""

import argparse
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    from keras_memguard.testing import memory_cap_env

    # Before TensorFlow is imported: the allocator reads these once.
    os.environ.update(memory_cap_env(args.cap_mib, base_env={}))

    import numpy as np
    import keras
    import tensorflow as tf
    from keras import layers
    from keras import ops

    import keras_memguard

    latent_dim = 2

    class Sampling(layers.Layer):
        """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seed_generator = keras.random.SeedGenerator(1337)

        def call(self, inputs):
            z_mean, z_log_var = inputs
            epsilon = keras.random.normal(ops.shape(z_mean), seed=self.seed_generator)
            return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    encoder_inputs = keras.Input(shape=(28, 28, 1))
    x = layers.Conv2D(32, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(7 * 7 * 64, activation="relu")(latent_inputs)
    x = layers.Reshape((7, 7, 64))(x)
    x = layers.Conv2DTranspose(64, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(32, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    class VAE(keras_memguard.MemGuardMixin, keras.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(
                name="reconstruction_loss"
            )
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [
                self.total_loss_tracker,
                self.reconstruction_loss_tracker,
                self.kl_loss_tracker,
            ]

        def compute_vae_loss(self, data, y=None, sample_weight=None):
            """One micro-batch's mean loss, and its parts as extras."""
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            return total_loss, {
                "reconstruction_loss": reconstruction_loss,
                "kl_loss": kl_loss,
            }

        def train_step(self, data):
            # Gradients summed over `self.micro_batches` micro-batches; the
            # losses weighted by each micro-batch's share of the samples.
            result = self.accumulate_gradients(data, self.compute_vae_loss)
            # State changes only once every micro-batch has succeeded, so a
            # batch that runs out of memory can be replayed.
            with tf.control_dependencies(result.control_inputs()):
                self.optimizer.apply(result.gradients, self.trainable_weights)
                self.total_loss_tracker.update_state(result.loss)
                self.reconstruction_loss_tracker.update_state(
                    result.extras["reconstruction_loss"]
                )
                self.kl_loss_tracker.update_state(result.extras["kl_loss"])
                return {m.name: m.result() for m in self.metrics}

    rng = np.random.default_rng(0)
    images = (rng.random((2 * args.batch_size, 28, 28, 1)) < 0.3).astype("float32")

    # Plain keras-io training (the same model, one micro-batch, no guard).
    keras.utils.set_random_seed(0)
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    initial_weights = vae.get_weights()
    try:
        vae.fit(images, epochs=1, batch_size=args.batch_size, verbose=0)
        print(f"plain training at batch {args.batch_size} fitted under "
              f"{args.cap_mib} MiB: raise --batch-size to see the guard act")
    except tf.errors.ResourceExhaustedError:
        print(f"plain training at batch {args.batch_size} ran out of memory "
              f"under the {args.cap_mib} MiB cap")

    # The same model, guarded: a batch that runs out of memory is replayed
    # with more micro-batches; the guard keeps splitting while it must.
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    vae.set_weights(initial_weights)
    guard = keras_memguard.MemoryGuard(threshold=0.9)
    history = vae.fit(
        images, epochs=args.epochs, batch_size=args.batch_size, verbose=2,
        callbacks=[guard],
    )
    print()
    for name in ("total_loss", "reconstruction_loss", "kl_loss"):
        print(f"{name}: " + ", ".join(f"{v:.4f}" for v in history.history[name]))
    print(f"micro-batches per batch: {guard.micro_batches}; "
          f"batches replayed after running out of memory: {guard.oom_recoveries}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
