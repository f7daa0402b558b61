"""Models the guard was never tuned for, under a real cap, in their own process.

`decoder [metric]`: a GPT-style decoder language model (token and position
embeddings, two causal self-attention blocks, 2000 logits per token) on
numpy token ids, `fit(batch_size=32)` under `MemoryGuard`. With `metric`
it is compiled with a metric of its own (`programs.common.SampleCount`),
so the whole batch's logits are kept across micro-batches. Replaying a
batch here used to crash the process in TensorFlow's constant folding.

`xla_cnn`: a mixed-precision CNN compiled with `jit_compile=True` (as
Keras 3 compiles it on a GPU) on numpy images, `fit(batch_size=128)` under
`MemoryGuard`: one out-of-memory error inside an XLA program can abort the
process, so none may happen.

`xla_mlp`: an MLP compiled with `jit_compile=True` whose step is one
buffer over half the free memory: the allocator hands it the whole free
block, and the step's peak reads that block's remainder beyond its
program on every batch, as plain `fit`'s does.

`fine_tune`: keras.io's transfer-learning recipe on a small Transformer
text classifier: its base model frozen for a first `fit`, then trainable,
the model compiled again with a lower learning rate and fitted again, the
same `MemoryGuard` passed to both. The second `fit`'s step holds the base's
gradients and Adam's updates for it, which the first never measured.

`validation [off]`: the same classifier compiled as Keras compiles it on
a GPU (`jit_compile="auto"`, XLA; with `off`, without), `fit(batch_size=64)`
with validation batches of 512 (`validation_batch_size`), then
`predict(batch_size=512)`, under one `MemoryGuard`: a validation or
prediction batch that does not fit must be cut in slices before it runs.

`xla_evaluate`: an XLA-compiled MLP's `evaluate(batch_size=8192)` (a
hidden layer of 4096 units: 128 MiB of activations) under a guard whose
slices are not planned (`plan=False`, and the compiled step's plan made to
miss), so the cap is hit inside the XLA program: it must end with `CompiledStepOutOfMemoryError`, not a replay
in slices. The process then leaves with `os._exit`, as
TensorFlow can abort at exit after such an error.

`stateful [off]`: two stacked LSTMs built with `stateful=True` (their
state one row per sample of a batch of 32), compiled as Keras compiles
them on a GPU (`jit_compile="auto"`, XLA; with `off`, without),
`fit(batch_size=32, shuffle=False)` under `MemoryGuard`, then `evaluate`
and `predict` at 32: the batches run whole, as in plain `fit`, or the
guard says before a step runs that one cannot fit.

`gan [off] [plain]`: keras.io's DCGAN (its own `compile` with two
optimizers and its own `train_step`, which keras_memguard cannot split) on
numpy images, compiled as Keras compiles it on a GPU (XLA; with `off`,
without), `fit(batch_size=64)` under `MemoryGuard`, or with `plain`
without it: the batches train whole, as in plain `fit`, or the guard says
before an XLA step runs that it cannot fit.

`large_embedding`: a bag-of-words classifier whose `Embedding` holds
60000 rows of 64 (14.6 MiB; Adam's slots twice that), `fit(batch_size=512)`
under `MemoryGuard` where Adam's update of the embedding cannot fit beside
the weights and slots at any batch size: the guard must say so after the
first error, not split further.

`ragged [off]`: a bag-of-embeddings text classifier fed `tf.RaggedTensor`
token ids (20 to 80 tokens a sample) from `tf.data`, compiled with XLA
(with `off`, without), `fit` under `MemoryGuard`: XLA cannot split a
ragged batch, so its batches run whole, and one that cannot fit is named
before it runs; without XLA they are split.

Training runs with a `MemoryMonitor` beside the guard. Reports through
`emit_result`: the batches that ended, the counts, the peak usage the
monitor logged for each batch, the out-of-memory recoveries, the loss, and the error raised, if any.
"""

import os
import sys

import keras
import numpy as np

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts
from programs.common import SampleCount
from programs.common import collect_package_messages

VOCABULARY, TOKENS, WIDTH = 2000, 128, 128


class PositionEmbedding(keras.layers.Layer):
    def build(self, input_shape):
        self.positions = self.add_weight(shape=(TOKENS, WIDTH), initializer="uniform")

    def call(self, x):
        return x + self.positions


def decoder(metrics=None):
    """The decoder of the module docstring, seeded and compiled."""
    layers = keras.layers
    keras.utils.set_random_seed(0)
    tokens = keras.Input((TOKENS,), dtype="int32")
    x = PositionEmbedding()(layers.Embedding(VOCABULARY, WIDTH)(tokens))
    for _ in range(2):
        attended = layers.MultiHeadAttention(4, WIDTH // 4)(x, x, use_causal_mask=True)
        x = layers.LayerNormalization()(x + attended)
        hidden = layers.Dense(WIDTH, activation="gelu")(
            layers.Dense(4 * WIDTH, activation="gelu")(x)
        )
        x = layers.LayerNormalization()(x + hidden)
    model = keras.Model(tokens, layers.Dense(VOCABULARY)(x))
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=metrics,
    )
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCABULARY, size=(128, TOKENS)).astype("int32")
    y = rng.integers(1, VOCABULARY, size=(128, TOKENS)).astype("int32")
    return model, x, y, 32


def xla_cnn():
    """The mixed-precision XLA CNN of the module docstring, seeded and compiled."""
    layers = keras.layers
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(48, 3, activation="relu"),
        layers.Conv2D(48, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(96, 3, activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(10, dtype="float32"),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    rng = np.random.default_rng(0)
    # Two batches: an XLA step with float16 convolutions is slow on a CPU.
    x = rng.random((256, 32, 32, 3), dtype="float32")
    y = rng.integers(0, 10, 256)
    return model, x, y, 128


def xla_mlp():
    """The XLA MLP of the module docstring, seeded and compiled."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    rng = np.random.default_rng(0)
    x = rng.random((4096, 1024), dtype="float32")
    y = rng.integers(0, 10, 4096)
    return model, x, y, 1024


def evaluate_beyond_the_cap():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)),
        keras.layers.Dense(4096, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile("adam", "mse", jit_compile=True)
    rng = np.random.default_rng(0)
    x = rng.random((8192, 1024), dtype="float32")
    y = rng.random((8192, 10), dtype="float32")
    # A plan that misses (on a GPU, memory another process took between the
    # plan and the step): the batch runs whole, and the error path is what
    # is tested. The decider does not plan (`plan=False`).
    from keras_memguard.backends.tensorflow import compiled_slices

    compiled_slices.CompiledSlicePlanner.__call__ = lambda self, step, data, size, k: k
    guard = keras_memguard.MemoryGuard(plan=False, plan_cache=False)
    try:
        model.evaluate(x, y, batch_size=8192, verbose=0, callbacks=[guard])
        error = None
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        error = f"{type(raised).__name__}: {raised}"
    emit_result({"error": error, "eval_oom_recoveries": guard.eval_oom_recoveries})
    sys.stdout.flush()
    os._exit(0)


def text_classifier():
    """A small Transformer text classifier: `(model, base, x, y)`, not compiled."""
    keras.utils.set_random_seed(0)
    vocabulary, tokens, width = 3000, 96, 128
    ids = keras.Input((tokens,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, width)(ids)
    h = keras.layers.LayerNormalization()(
        h + keras.layers.MultiHeadAttention(4, width // 4)(h, h)
    )
    wide = keras.layers.Dense(4 * width, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(wide))
    base = keras.Model(ids, h)
    pooled = keras.layers.GlobalAveragePooling1D()(base(ids))
    outputs = keras.layers.Dense(4)(keras.layers.Dense(256, activation="relu")(pooled))
    model = keras.Model(ids, outputs)
    rng = np.random.default_rng(0)
    x = rng.integers(1, vocabulary, size=(512, tokens))
    y = rng.integers(0, 4, size=(512,))
    return model, base, x, y


def fine_tune():
    """The two fits of the `fine_tune` recipe in the module docstring."""
    model, base, x, y = text_classifier()
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    ks = MicroBatchCounts()
    fits = []
    for trainable, learning_rate in ((False, 1e-3), (True, 1e-5)):
        base.trainable = trainable
        model.compile(
            keras.optimizers.Adam(learning_rate),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        before = guard.oom_recoveries
        history = model.fit(x, y, batch_size=128, verbose=0, callbacks=[guard, ks])
        fits.append({
            "oom_recoveries": guard.oom_recoveries - before,
            "loss": history.history["loss"],
        })
    emit_result({"fits": fits, "ks": ks.ks, "batches": len(ks.ks)})


def validation(xla):
    """`validation` of the module docstring: validation and `predict` at 512."""
    messages = collect_package_messages()
    model, _, x, y = text_classifier()
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], jit_compile="auto" if xla else False,
    )
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    result = {"error": None}
    try:
        history = model.fit(
            x[:256], y[:256], batch_size=64, verbose=0, callbacks=[guard],
            validation_data=(x, y), validation_batch_size=512,
        )
        result["val_loss"] = history.history["val_loss"]
        result["predicted"] = list(
            model.predict(x, batch_size=512, verbose=0, callbacks=[guard]).shape
        )
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        result["error"] = f"{type(raised).__name__}: {raised}"
    result.update(
        jit_compile=bool(model.jit_compile),
        eval_oom_recoveries=guard.eval_oom_recoveries,
        predict_oom_recoveries=guard.predict_oom_recoveries,
        messages=list(messages),
    )
    emit_result(result)


def stateful(xla):
    """`stateful` of the module docstring."""
    messages = collect_package_messages()
    keras.utils.set_random_seed(0)
    inputs = keras.Input(batch_shape=(32, 50, 8))
    hidden = keras.layers.LSTM(128, stateful=True, return_sequences=True)(inputs)
    hidden = keras.layers.LSTM(128, stateful=True)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("adam", "mse", jit_compile="auto" if xla else False)
    x = np.random.default_rng(0).normal(size=(128, 50, 8)).astype("float32")
    y = x[:, -1, :1]
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    result = {"error": None, "loss": None, "evaluated": None, "predicted": None}
    try:
        history = model.fit(
            x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[guard, ks]
        )
        result["loss"] = history.history["loss"]
        result["evaluated"] = model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[guard])
        result["predicted"] = list(
            model.predict(x, batch_size=32, verbose=0, callbacks=[guard]).shape
        )
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        result["error"] = f"{type(raised).__name__}: {raised}"
    result.update(
        jit_compile=bool(model.jit_compile),
        batches=len(ks.ks),
        expected_batches=2 * len(x) // 32,
        ks=ks.ks,
        oom_recoveries=guard.oom_recoveries,
        messages=list(messages),
    )
    emit_result(result)


class GAN(keras.Model):
    """keras.io's DCGAN: its own `compile` and `train_step`, two optimizers."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        import tensorflow as tf

        ops = keras.ops
        batch_size = ops.shape(real_images)[0]
        z = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = ops.concatenate([self.generator(z), real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        z = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fooled = self.discriminator(self.generator(z))
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), fooled)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def tf_peak_mib():
    """The allocator's peak so far, in MiB."""
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20


def gan(xla, guarded):
    """`gan` of the module docstring."""
    layers = keras.layers
    messages = collect_package_messages()
    keras.utils.set_random_seed(0)
    latent = 64
    discriminator = keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2D(64, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.GlobalMaxPooling2D(),
        layers.Dense(1),
    ])
    generator = keras.Sequential([
        keras.Input((latent,)),
        layers.Dense(8 * 8 * 64),
        layers.LeakyReLU(0.2),
        layers.Reshape((8, 8, 64)),
        layers.Conv2DTranspose(64, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2DTranspose(64, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2D(3, 5, padding="same", activation="sigmoid"),
    ])
    model = GAN(discriminator, generator, latent)
    model.compile(
        keras.optimizers.Adam(3e-4),
        keras.optimizers.Adam(3e-4),
        keras.losses.BinaryCrossentropy(from_logits=True),
        jit_compile="auto" if xla else False,
    )
    x = np.random.default_rng(0).random((256, 32, 32, 3), dtype=np.float32)
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard(plan_cache=False) if guarded else None
    result = {"error": None, "d_loss": None}
    try:
        history = model.fit(
            x, batch_size=64, epochs=2, verbose=0,
            callbacks=[guard, keras_memguard.MemoryMonitor(), ks] if guarded else [],
        )
        result["d_loss"] = history.history["d_loss"]
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        result["error"] = f"{type(raised).__name__}: {raised}"
    result.update(
        jit_compile=bool(model.jit_compile),
        batches=len(ks.ks),
        expected_batches=2 * len(x) // 64,
        ks=ks.ks,
        usages=ks.usages,
        peak_mib=tf_peak_mib(),
        oom_recoveries=guard.oom_recoveries if guard else 0,
        messages=list(messages),
    )
    emit_result(result)


def large_embedding():
    """`large_embedding` of the module docstring."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(60000, 64)(inputs))
    hidden = keras.layers.Dense(256, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(20)(hidden))
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 60000, size=(2048, 64)).astype("int32")
    return model, x, rng.integers(0, 20, 2048), 512


def ragged(xla):
    """`ragged [off]` of the module docstring."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 2000, size=rng.integers(20, 80)) for _ in range(512)]
    x = tf.ragged.constant(ids, dtype=tf.int64)
    y = rng.integers(0, 2, size=(512, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(128)
    tokens = keras.Input((None,), dtype="int64")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(2000, 1024)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(1)(hidden))
    model.compile(
        "adam", keras.losses.BinaryCrossentropy(from_logits=True), jit_compile=xla
    )
    return model, data, None, None


def main():
    name, options = sys.argv[1], sys.argv[2:]
    if name == "stateful":
        return stateful(xla="off" not in options)
    if name == "gan":
        return gan(xla="off" not in options, guarded="plain" not in options)
    if name == "xla_evaluate":
        evaluate_beyond_the_cap()
    if name == "fine_tune":
        return fine_tune()
    if name == "validation":
        return validation(xla="off" not in options)
    messages = collect_package_messages()
    if name == "decoder":
        model, x, y, batch = decoder([SampleCount()] if "metric" in options else None)
    elif name == "xla_mlp":
        model, x, y, batch = xla_mlp()
    elif name == "large_embedding":
        model, x, y, batch = large_embedding()
    elif name == "ragged":
        model, x, y, batch = ragged(xla="off" not in options)
    else:
        model, x, y, batch = xla_cnn()
    ks = MicroBatchCounts()
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    error = None
    history = None
    try:
        history = model.fit(
            x, y, batch_size=batch, epochs=1, verbose=0,
            callbacks=[guard, keras_memguard.MemoryMonitor(), ks],
        )
    except Exception as raised:  # noqa: BLE001 - reported to the test.
        error = f"{type(raised).__name__}: {raised}"
    emit_result({
        "batches": len(ks.ks),
        "expected_batches": len(x) if batch is None else -(-len(x) // batch),
        "ks": ks.ks,
        "usages": ks.usages,
        "jit_compile": bool(model.jit_compile),
        "oom_recoveries": guard.oom_recoveries,
        "loss": None if history is None else history.history["loss"],
        "samples": None if history is None else history.history.get("samples"),
        "error": error,
        "messages": list(messages),
    })


if __name__ == "__main__":
    main()
