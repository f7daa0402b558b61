"""Helpers shared by the test programs."""

import logging

import keras
import tensorflow as tf


def cnn(input_shape, make_body, metrics=()):
    """A seeded, compiled classifier: `make_body()`'s layers, global pooling, 10 logits.

    The layers are made after the seed is set: an initializer draws its
    seed when it is made.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input(input_shape),
        *make_body(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def design_cnn(metrics=()):
    """The 64x64x3 CNN of the design notes and benchmarks, seeded, compiled.

    Two 3x3 convolutions of 64 filters: under a 600 MiB cap plain training
    fits batches of 136 at most.
    """
    return cnn(
        (64, 64, 3),
        lambda: [keras.layers.Conv2D(64, 3, activation="relu") for _ in range(2)],
        metrics,
    )


class SampleCount(keras.metrics.Metric):
    """Counts the samples a metric update sees: none lost, none twice."""

    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

    def result(self):
        if tf.distribute.has_strategy():
            # Inside a replica: the variable itself, read (summed over the
            # replicas) after the step; a copy would hold this replica's count.
            return self.count
        # A copy: the variable itself would change under `fit`'s epoch logs
        # when validation reuses the metric.
        return self.count * 1.0


class MicroBatchCounts(keras.callbacks.Callback):
    """Records the micro-batch count each batch ran with (`ks`), and its
    peak usage (`usages`) where a `MemoryMonitor` logs it."""

    def __init__(self):
        super().__init__()
        self.ks = []
        self.usages = []

    def on_train_batch_end(self, batch, logs=None):
        self.ks.append(int(logs["micro_batches"]))
        if "memory_usage" in logs:
            self.usages.append(float(logs["memory_usage"]))


def attention_classifier(samples):
    """A one-block Transformer classifier (not compiled) and `samples` sequences.

    Token and attention layers over 256 tokens of a 2000-word vocabulary,
    two classes; `(model, x, y)` with numpy token ids, seeded.
    """
    import numpy as np

    keras.utils.set_random_seed(0)
    tokens = keras.Input((256,), dtype="int32")
    hidden = keras.layers.Embedding(2000, 64)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(hidden, hidden)
    hidden = keras.layers.LayerNormalization()(hidden + attended)
    feed = keras.layers.Dense(128, activation="relu")(hidden)
    hidden = keras.layers.LayerNormalization()(hidden + keras.layers.Dense(64)(feed))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2000, (samples, 256)).astype("int32")
    return keras.Model(tokens, outputs), x, rng.integers(0, 2, samples)


def row_mlp(samples):
    """An MLP over 1024 rows of 256 features a sample (not compiled) and `samples` of them.

    Four `Dense(256)` layers applied to every row, pooled, `Dense(10)`:
    about a MiB of layer outputs a sample per layer, little weight, so a
    few samples more or less decide whether a step fits. `(model, x, y)`,
    seeded.
    """
    import numpy as np

    keras.utils.set_random_seed(0)
    rows = keras.Input((1024, 256))
    hidden = rows
    for _ in range(4):
        hidden = keras.layers.Dense(256, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(hidden))
    rng = np.random.default_rng(0)
    x = rng.random((samples, 1024, 256), dtype=np.float32)
    return keras.Model(rows, outputs), x, rng.integers(0, 10, samples)


def collect_package_messages():
    """Returns a list that receives every keras_memguard log message (INFO up)."""
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger("keras_memguard")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    return messages


def weights(model):
    """The model's weights as nested lists (JSON)."""
    return [w.tolist() for w in model.get_weights()]


# Length-bucketed text: six bucket lengths up to 8x the shortest.
TEXT_LENGTHS = (64, 128, 192, 256, 384, 512)
TEXT_BATCH = 256
TEXT_VOCABULARY = 8000


def text_classifier(metrics=()):
    """A convolutional text classifier over sequences of any length, seeded.

    Plain training at batch 256 peaks at 57 MiB for 64 tokens and 273 MiB
    for 512 (measured on the CPU BFC allocator): under a 200 MiB cap the
    two longest buckets do not fit whole.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(TEXT_VOCABULARY, 64)(inputs)
    h = keras.layers.Conv1D(128, 5, padding="same", activation="relu")(h)
    h = keras.layers.Conv1D(128, 5, padding="same", activation="relu")(h)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalMaxPooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def bucketed_text(repeats=2, batch=TEXT_BATCH, lengths=TEXT_LENGTHS, seed=0):
    """Batches of `batch` token sequences, one bucket length per batch, in
    shuffled order (each length `repeats` times), generated inside tf.data.

    Returns:
        `(dataset, order)`: the dataset and the lengths in batch order.
    """
    import numpy as np

    order = [length for length in lengths for _ in range(repeats)]
    np.random.default_rng(seed).shuffle(order)

    def make(i, length):
        seeds = tf.stack([tf.cast(i, tf.int32), seed])
        x = tf.random.stateless_uniform(
            (batch, length), seeds, maxval=TEXT_VOCABULARY, dtype=tf.int32
        )
        y = tf.random.stateless_uniform((batch,), seeds + 1, maxval=2, dtype=tf.int32)
        return x, y

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.range(len(order)), tf.constant(order))
    ).map(make)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return dataset.with_options(options), order
