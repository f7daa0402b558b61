"""Models the tests never use, under 0.55x their plain peak, with and without XLA.

Every run is a child process under a real cap on TensorFlow's CPU BFC
allocator that behaves as on a GPU (`keras_memguard.testing.act_as_gpu`:
the cap reserved as one region; `--xla on` compiles the step with XLA, as
`jit_compile="auto"` does on a GPU). Per model and XLA setting:

1. `plain`: plain `fit` under an 8 GiB cap; the largest step peak sets the
   cap of the rest, `--share` (0.55) of it, or `--cap-mib` sets it: the
   plain peak moves by a few percent from process to process, so two
   invocations that compare a change on one model pass the same cap.
2. `guard`: `fit` with `MemoryGuard()` under that cap for `GUARD_EPOCHS`
   epochs, three runs: from an empty plan cache (a fresh `$KERAS_HOME`),
   again from the cache it left, and from another empty cache with the CPU
   shared by two busy processes. Reported: out-of-memory errors, crashes (the process did not
   end cleanly or `fit` raised), whether every batch of every run ended,
   and the micro-batch size each settled on; `--json` also keeps each
   batch's count, the memory in use before it and its peak.
3. `fixed`: the best fixed count: from the first run's settled count down
   (one count per micro-batch size, the smallest that splits the batch
   so), `MemoryGuard(plan=False, micro_batches=k, cooldown=10**9)` for
   `FIXED_EPOCHS` epochs until a count runs out of memory, a batch peaks
   above the guard's threshold (90%) or (on XLA) the guard had to raise
   the count; a count is clean when it ran clean in each of
   `EDGE_REPEATS` processes (two at a time): a step's peak at one count
   moves from process to process by more than a sample adds near the top;
   and not clean where a guarded run's batch at that micro-batch size
   peaked above the threshold with no more memory in use before it than
   the fixed runs held (a peak that jumps on some batches comes in only
   some processes). The smallest count clean under it is the best. Reported: settled
   micro-batch / best micro-batch, first run and cached.
4. `finder`: `find_batch_size` on the same numpy input, then plain `fit`
   at its answer; where the answer trains, the largest batch plain `fit`
   trains is searched upward from it (11% more, then 25% steps until one
   fails, then bisection; at most `EDGE_RUNS` batches, and no batch above
   the samples the input holds). A batch trains when plain `fit` trains it
   in each of `EDGE_REPEATS` fresh processes (two at a time): near the top
   the same batch can train in one process and run out of memory in the
   next. Reported: the answer, whether it trained, the largest batch that
   trained and the smallest that did not, and answer / largest; a finder
   that stopped with `MicroBatchTooLargeError` as refused.

Goals (issue "never worse than plain Keras"): 0 errors and 0 crashes;
settled / best >= 0.85 first run, >= 0.95 cached; spread <= 10%; the
finder's answer trains and is 0.9-1.0 of the largest batch that does.

    python bench/bench_unseen.py [--models efficientnet,densenet,...]
        [--xla off,on] [--parts plain,guard,fixed,finder] [--share 0.55]
        [--cap-mib ocr=94,siamese=228] [--json results.json]
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MIB = 1 << 20
THRESHOLD = 0.9  # MemoryGuard's default
STEPS = 4  # batches per fit
# Epochs of a fixed-count run: a step's peak varies from batch to batch
# (the executor's op order), and a count is clean only if every batch is.
FIXED_EPOCHS = 4
# Epochs of a guard run: the count it settles on after a few spikes, as a
# real run's many batches would show it.
GUARD_EPOCHS = 3
PARTS = ("plain", "guard", "fixed", "finder")
# A child that runs longer is stopped and reported as timed out.
CHILD_TIMEOUT_S = 1800
# Batches tried to find the largest that trains above the finder's answer.
EDGE_RUNS = 5
# Fresh plain fits per batch tried; a batch trains when every one does.
EDGE_REPEATS = 3
# name: batch size
MODELS = {
    "efficientnet": 32,
    "densenet": 32,
    "mobilenet_v3": 64,
    # At 32x32, where XLA on the CPU runs the guard's loop of depthwise
    # convolutions at about plain `fit`'s speed (RESULTS.md, "TensorFlow
    # XLA on the CPU: convolution gradients inside the guard's loop").
    "mobilenet_v3_32": 64,
    "decoder": 32,
    "decoder_masked": 32,
    "mixed_convnet": 128,
    "mixed_encoder": 64,
    "bilstm": 128,
    "seq2seq": 64,
    "vit": 128,
    "gru_masked": 256,
    "two_heads": 1024,
    "unet": 32,
    "tagger": 128,
    "ocr": 64,
    "siamese": 128,
}


def build(name):
    """A seeded, compiled model and `(x, y)` numpy arrays of `STEPS` batches."""
    import keras
    import numpy as np

    layers = keras.layers
    batch = MODELS[name]
    samples = batch * STEPS
    rng = np.random.default_rng(0)
    if name in ("mixed_convnet", "mixed_encoder"):
        keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if name in ("efficientnet", "densenet", "mobilenet_v3", "mobilenet_v3_32"):
        make = {
            "efficientnet": keras.applications.EfficientNetB0,
            "densenet": keras.applications.DenseNet121,
            "mobilenet_v3": keras.applications.MobileNetV3Small,
            "mobilenet_v3_32": keras.applications.MobileNetV3Small,
        }[name]
        side = 32 if name.endswith("_32") else 64
        model = make(weights=None, input_shape=(side, side, 3), classes=10)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy())
        x = rng.random((samples, side, side, 3), dtype=np.float32)
        return model, x, rng.integers(0, 10, samples), batch
    if name == "mixed_convnet":
        inputs = keras.Input((64, 64, 3))
        h = layers.Conv2D(32, 3, padding="same")(inputs)
        for width in (32, 64, 64):
            shortcut = layers.Conv2D(width, 1, padding="same")(h)
            h = layers.Conv2D(width, 3, padding="same")(h)
            h = layers.BatchNormalization()(h)
            h = layers.Activation("relu")(h)
            h = layers.Conv2D(width, 3, padding="same")(h)
            h = layers.Add()([h, shortcut])
        h = layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inputs, layers.Dense(10, dtype="float32")(h))
        model.compile(
            keras.optimizers.Adam(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        x = rng.random((samples, 64, 64, 3), dtype=np.float32)
        return model, x, rng.integers(0, 10, samples), batch
    if name == "mixed_encoder":
        return _mixed_encoder(rng, samples, batch)
    if name == "bilstm":
        return _bilstm(rng, samples, batch)
    if name == "seq2seq":
        return _seq2seq(rng, samples, batch)
    if name == "vit":
        return _vit(rng, samples, batch)
    if name == "gru_masked":
        return _gru_masked(rng, samples, batch)
    if name == "two_heads":
        return _two_heads(rng, samples, batch)
    if name == "unet":
        return _unet(rng, samples, batch)
    if name == "tagger":
        return _tagger(rng, samples, batch)
    if name == "ocr":
        return _ocr(rng, samples, batch)
    if name == "siamese":
        return _siamese(rng, samples, batch)
    # A pre-norm GPT-style decoder: 3 blocks, width 96, 96 tokens, 3000 logits.
    vocabulary, tokens, width = 3000, 96, 96
    ids = keras.Input((tokens,), dtype="int32")
    masked = name == "decoder_masked"
    h = _tokens_and_positions(ids, vocabulary, tokens, width, mask_zero=masked)
    for _ in range(3):
        n = layers.LayerNormalization()(h)
        h = h + layers.MultiHeadAttention(3, width // 3)(n, n, use_causal_mask=True)
        n = layers.LayerNormalization()(h)
        h = h + layers.Dense(width)(layers.Dense(4 * width, activation="gelu")(n))
    logits = layers.Dense(vocabulary)(layers.LayerNormalization()(h))
    model = keras.Model(ids, logits)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0 if masked else None
    )
    model.compile("adam", loss)
    x = rng.integers(1, vocabulary, size=(samples, tokens)).astype("int32")
    y = np.roll(x, -1, axis=1)
    if masked:
        # Padded sequences: a random length each, zeros after it.
        lengths = rng.integers(tokens // 4, tokens + 1, samples)
        pad = np.arange(tokens)[None, :] >= lengths[:, None]
        x[pad], y[pad] = 0, 0
    return model, x, y, batch


def _tokens_and_positions(ids, vocabulary, tokens, width, mask_zero):
    """Token embeddings plus learned position embeddings, as keras.io's
    Transformer examples build them."""
    import keras

    h = keras.layers.Embedding(vocabulary, width, mask_zero=mask_zero)(ids)
    return h + keras.layers.Embedding(tokens, width)(keras.ops.arange(tokens))


def _mixed_encoder(rng, samples, batch):
    """keras.io's Transformer text classifier, larger, in mixed precision:
    padded token ids masked (`mask_zero`) through attention and pooling,
    4 post-norm blocks, width 128, 128 tokens, 2 classes; no convolutions,
    so XLA on the CPU runs its micro-batch loop at full speed."""
    import keras
    import numpy as np

    layers = keras.layers
    vocabulary, tokens, width = 8000, 128, 128
    ids = keras.Input((tokens,), dtype="int32")
    h = _tokens_and_positions(ids, vocabulary, tokens, width, mask_zero=True)
    for _ in range(4):
        attended = layers.MultiHeadAttention(4, width // 4)(h, h)
        h = layers.LayerNormalization(epsilon=1e-6)(h + layers.Dropout(0.1)(attended))
        fed = layers.Dense(width)(layers.Dense(4 * width, activation="relu")(h))
        h = layers.LayerNormalization(epsilon=1e-6)(h + layers.Dropout(0.1)(fed))
    h = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(h))
    h = layers.Dense(64, activation="relu")(h)
    model = keras.Model(ids, layers.Dense(2, dtype="float32")(h))
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x = rng.integers(1, vocabulary, size=(samples, tokens)).astype("int32")
    lengths = rng.integers(tokens // 4, tokens + 1, samples)
    x[np.arange(tokens)[None, :] >= lengths[:, None]] = 0
    return model, x, rng.integers(0, 2, samples), batch


def _gru_masked(rng, samples, batch):
    """A text classifier on padded token ids: an `Embedding` with
    `mask_zero`, two stacked GRUs (the first returning sequences), both
    skipping the padding through the mask; Adam, binary cross-entropy,
    `accuracy`. The last quarter of every sequence is padding."""
    import keras

    layers = keras.layers
    vocabulary, tokens = 5000, 200
    ids = keras.Input((tokens,), dtype="int32")
    h = layers.Embedding(vocabulary, 64, mask_zero=True)(ids)
    h = layers.GRU(64)(layers.GRU(128, return_sequences=True)(h))
    model = keras.Model(ids, layers.Dense(1, activation="sigmoid")(h))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    x = rng.integers(1, vocabulary, size=(samples, tokens)).astype("int32")
    x[:, 3 * tokens // 4:] = 0
    return model, x, rng.integers(0, 2, samples), batch


def _two_heads(rng, samples, batch):
    """A multi-output MLP as users write one: three Dense-BatchNormalization-
    ReLU-Dropout blocks of 1024, a dict of two heads (100-way logits and a
    regression), a loss and a metric per head, `loss_weights`; Adam."""
    import keras

    layers = keras.layers
    inputs = keras.Input((256,))
    h = inputs
    for _ in range(3):
        h = layers.Dense(1024)(h)
        h = layers.Dropout(0.3)(layers.Activation("relu")(layers.BatchNormalization()(h)))
    model = keras.Model(
        inputs, {"cls": layers.Dense(100, name="cls")(h), "reg": layers.Dense(1, name="reg")(h)}
    )
    model.compile(
        "adam",
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    x = rng.random((samples, 256), dtype="float32")
    y = {"cls": rng.integers(0, 100, samples), "reg": rng.random((samples, 1), dtype="float32")}
    return model, x, y, batch


def _unet(rng, samples, batch):
    """A U-Net for binary segmentation on uint8 images, as keras.io's
    segmentation examples build one: `Rescaling` in the model, two levels
    of convolutions down, `Conv2DTranspose` up with skip connections, a
    per-pixel sigmoid; 128x128x3."""
    import keras
    import numpy as np

    layers = keras.layers
    inputs = keras.Input((128, 128, 3), dtype="uint8")
    h = layers.Rescaling(1 / 255.0)(inputs)
    skips = []
    for width in (16, 32):
        h = layers.Conv2D(width, 3, padding="same", activation="relu")(h)
        h = layers.Conv2D(width, 3, padding="same", activation="relu")(h)
        skips.append(h)
        h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    for width, skip in zip((32, 16), reversed(skips)):
        h = layers.Conv2DTranspose(width, 2, strides=2)(h)
        h = layers.Concatenate()([h, skip])
        h = layers.Conv2D(width, 3, padding="same", activation="relu")(h)
    model = keras.Model(inputs, layers.Conv2D(1, 1, activation="sigmoid")(h))
    model.compile("adam", "binary_crossentropy", metrics=["binary_accuracy"])
    x = rng.integers(0, 256, (samples, 128, 128, 3)).astype("uint8")
    y = (rng.random((samples, 128, 128, 1)) > 0.5).astype("float32")
    return model, x, y, batch


def _tagger(rng, samples, batch):
    """A sequence tagger on padded token ids: `Embedding(mask_zero=True)`,
    a bidirectional LSTM over every token, a `TimeDistributed` softmax of
    20 tags; the loss a mean over the unmasked tokens, accuracy a weighted
    metric (the mask); 160 tokens."""
    import keras
    import numpy as np

    layers = keras.layers
    vocabulary, tokens, tags = 8000, 160, 20
    ids = keras.Input((tokens,), dtype="int32")
    h = layers.Embedding(vocabulary, 128, mask_zero=True)(ids)
    h = layers.Bidirectional(layers.LSTM(128, return_sequences=True))(h)
    model = keras.Model(ids, layers.TimeDistributed(layers.Dense(tags))(h))
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    x = rng.integers(1, vocabulary, (samples, tokens)).astype("int32")
    lengths = rng.integers(tokens // 4, tokens + 1, samples)
    x[np.arange(tokens)[None, :] >= lengths[:, None]] = 0
    y = rng.integers(0, tags, (samples, tokens)).astype("int32")
    return model, x, y, batch


def _ocr(rng, samples, batch):
    """keras.io's captcha OCR with `keras.losses.CTC` compiled: 128x32
    grey images, two convolutions and poolings, a Dense over each column,
    two `Bidirectional(LSTM)` (128, 64), 21 logits a column (20 characters
    and the blank); labels of 6 characters; Adam."""
    import keras
    import numpy as np

    layers = keras.layers
    width, height, characters, length = 128, 32, 20, 6
    images = keras.Input((width, height, 1))
    h = layers.Conv2D(32, 3, activation="relu", padding="same")(images)
    h = layers.MaxPooling2D(2)(h)
    h = layers.Conv2D(64, 3, activation="relu", padding="same")(h)
    h = layers.MaxPooling2D(2)(h)
    h = layers.Reshape((width // 4, (height // 4) * 64))(h)
    h = layers.Dense(64, activation="relu")(h)
    h = layers.Bidirectional(layers.LSTM(128, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(h)
    model = keras.Model(images, layers.Dense(characters + 1)(h))
    model.compile(keras.optimizers.Adam(), loss=keras.losses.CTC())
    x = rng.random((samples, width, height, 1), dtype=np.float32)
    y = rng.integers(1, characters + 1, (samples, length)).astype("int32")
    return model, x, y, batch


def _siamese(rng, samples, batch):
    """keras.io's Siamese network with a contrastive loss: one convolutional
    tower on two 64x64x3 inputs, the Euclidean distance of their embeddings
    (a `Lambda`), BatchNormalization and a sigmoid; RMSprop, `accuracy`."""
    import keras
    import numpy as np

    layers, ops = keras.layers, keras.ops
    tower = keras.Sequential([
        keras.Input((64, 64, 3)),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 3, activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(64),
    ])  # fmt: skip
    left, right = keras.Input((64, 64, 3)), keras.Input((64, 64, 3))

    def distance(pair):
        squared = ops.sum(ops.square(pair[0] - pair[1]), axis=1, keepdims=True)
        return ops.sqrt(ops.maximum(squared, 1e-7))

    d = layers.Lambda(distance)([tower(left), tower(right)])
    out = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(d))
    model = keras.Model([left, right], out)

    def contrastive(y_true, y_pred, margin=1.0):
        return ops.mean(
            (1 - y_true) * ops.square(y_pred)
            + y_true * ops.square(ops.maximum(margin - y_pred, 0))
        )

    model.compile("rmsprop", contrastive, metrics=["accuracy"])
    x = [rng.random((samples, 64, 64, 3), dtype=np.float32) for _ in range(2)]
    return model, x, rng.integers(0, 2, (samples, 1)).astype("float32"), batch


def _bilstm(rng, samples, batch):
    """keras.io's bidirectional LSTM on IMDB: 200 token ids, two stacked
    `Bidirectional(LSTM(64))`, a sigmoid output; Adam, binary
    cross-entropy, `accuracy`. Recurrent, no convolutions: XLA on the CPU
    runs its loop at full speed."""
    import keras

    layers = keras.layers
    vocabulary, tokens = 20000, 200
    ids = keras.Input((tokens,), dtype="int32")
    h = layers.Embedding(vocabulary, 128)(ids)
    h = layers.Bidirectional(layers.LSTM(64, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(64))(h)
    model = keras.Model(ids, layers.Dense(1, activation="sigmoid")(h))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    x = rng.integers(1, vocabulary, size=(samples, tokens)).astype("int32")
    return model, x, rng.integers(0, 2, samples), batch


def _seq2seq(rng, samples, batch):
    """keras.io's English-to-Spanish sequence-to-sequence Transformer,
    smaller: two inputs (source and shifted target token ids, padded and
    masked with `mask_zero`), an encoder block, a decoder block with causal
    self-attention and cross-attention, 8000 logits per token; RMSprop,
    cross-entropy with `ignore_class=0` (a mean over the unpadded tokens),
    `accuracy`."""
    import keras
    import numpy as np

    layers = keras.layers
    vocabulary, tokens, width, heads, latent = 8000, 20, 256, 8, 1024

    def feed_forward(h):
        fed = layers.Dense(width)(layers.Dense(latent, activation="relu")(h))
        return layers.LayerNormalization()(h + fed)

    source = keras.Input((tokens,), dtype="int32", name="encoder_inputs")
    target = keras.Input((tokens,), dtype="int32", name="decoder_inputs")
    h = _tokens_and_positions(source, vocabulary, tokens, width, mask_zero=True)
    h = layers.LayerNormalization()(h + layers.MultiHeadAttention(heads, width)(h, h))
    encoded = feed_forward(h)
    d = _tokens_and_positions(target, vocabulary, tokens, width, mask_zero=True)
    attended = layers.MultiHeadAttention(heads, width)(d, d, use_causal_mask=True)
    d = layers.LayerNormalization()(d + attended)
    attended = layers.MultiHeadAttention(heads, width)(d, encoded, encoded)
    d = feed_forward(layers.LayerNormalization()(d + attended))
    logits = layers.Dense(vocabulary)(layers.Dropout(0.5)(d))
    model = keras.Model([source, target], logits)
    model.compile(
        "rmsprop",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0),
        metrics=["accuracy"],
    )

    def padded(length):
        ids = rng.integers(1, vocabulary, size=(samples, length)).astype("int32")
        ends = rng.integers(4, length + 1, samples)
        ids[np.arange(length)[None, :] >= ends[:, None]] = 0
        return ids

    spanish = padded(tokens + 1)
    return model, [padded(tokens), spanish[:, :-1]], spanish[:, 1:], batch


def _vit(rng, samples, batch):
    """keras.io's Vision Transformer on CIFAR-sized images, smaller: 4x4
    patches embedded by a strided convolution, learned positions, 4
    pre-norm blocks (4 heads, width 96, attention dropout), AdamW, logits
    with `accuracy` and top-5 accuracy. One convolution on the input only,
    so XLA on the CPU runs its micro-batch loop at full speed."""
    import keras

    layers = keras.layers
    patches, width = 64, 96
    images = keras.Input((32, 32, 3))
    h = layers.Reshape((patches, width))(layers.Conv2D(width, 4, strides=4)(images))
    h = h + layers.Embedding(patches, width)(keras.ops.arange(patches))
    for _ in range(4):
        n = layers.LayerNormalization(epsilon=1e-6)(h)
        h = h + layers.MultiHeadAttention(4, width // 4, dropout=0.1)(n, n)
        n = layers.LayerNormalization(epsilon=1e-6)(h)
        fed = layers.Dropout(0.1)(layers.Dense(2 * width, activation="gelu")(n))
        h = h + layers.Dense(width)(fed)
    h = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-6)(h))
    model = keras.Model(images, layers.Dense(10)(h))
    model.compile(
        keras.optimizers.AdamW(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(5)],
    )
    x = rng.random((samples, 32, 32, 3), dtype="float32")
    return model, x, rng.integers(0, 10, samples), batch


# --- children ---------------------------------------------------------------


def child(spec):
    import keras
    import tensorflow as tf

    import keras_memguard

    model, x, y, batch = build(spec["model"])
    model.jit_compile = spec["xla"] == "on"
    run = spec["run"]
    if run == "find":
        try:
            found = keras_memguard.find_batch_size(model, x, y, verbose=0)
        except keras_memguard.MicroBatchTooLargeError as refused:
            return {"refused": str(refused)}
        return {
            "answer": found.largest_batch_size,
            "errors": found.out_of_memory_errors,
            "trials": [
                [t.batch_size, t.peak_bytes and round(t.peak_bytes / MIB, 1)]
                for t in found.trials
            ],
        }
    batch = spec.get("batch", batch)
    counts = []

    class Counts(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            counts.append(guard.micro_batches if guard else 1)

    guard = None
    if run == "guard":
        guard = keras_memguard.MemoryGuard()
    elif run == "fixed":
        guard = keras_memguard.MemoryGuard(
            plan=False, micro_batches=spec["k"], cooldown=10**9
        )
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, step, logs=None):
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] / MIB)

    # Each batch's peak and the memory in use before it, as the monitor
    # read them: which batch passed the threshold, and what was held then.
    batch_log = []

    class BatchLog(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            self.before = tf.config.experimental.get_memory_info("CPU:0")["current"] / MIB

        def on_train_batch_end(self, step, logs=None):
            peak = (logs or {}).get("memory_peak_mib")
            batch_log.append([
                counts[-1] if counts else None,
                round(self.before, 1),
                None if peak is None else round(float(peak), 1),
            ])

    # With a guard, its reader's peaks (MemoryMonitor's): the guard resets
    # the allocator's peak inside the step, before other callbacks run.
    callbacks = [Peaks(), Counts()] + (
        [keras_memguard.MemoryMonitor(), guard, BatchLog()] if guard else []
    )
    start = time.perf_counter()
    try:
        history = model.fit(
            x, y, batch_size=batch, epochs=spec.get("epochs", 1), verbose=0,
            callbacks=callbacks,
        )
    except tf.errors.ResourceExhaustedError:
        return {"trained": False, "seconds": time.perf_counter() - start}
    except Exception as error:  # reported as a user would see it
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    if guard:
        peaks = history.history["memory_peak_mib"]
    return {
        "trained": True,
        "peak_mib": max(peaks) if peaks else None,
        "counts": counts,
        # [count, MiB in use before the batch, the batch's peak MiB]
        "batch_log": batch_log,
        "ooms": guard.oom_recoveries if guard else 0,
        "batches": len(counts),
        "seconds": time.perf_counter() - start,
    }


def run_child(spec, cap_mib, keras_home=None, busy=False):
    """`spec` in a child under `cap_mib`, as on a GPU; `busy`: the CPU shared."""
    from keras_memguard.testing import run_script_with_memory_cap

    home = keras_home or tempfile.mkdtemp(prefix="memguard-unseen-")
    hogs = []
    if busy:
        hogs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2)
        ]
    try:
        run = run_script_with_memory_cap(
            [__file__, "--child", json.dumps(spec)], cap_mib, timeout=CHILD_TIMEOUT_S,
            env={"KERAS_HOME": home}, check=False, as_gpu=True,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": CHILD_TIMEOUT_S}
    finally:
        for hog in hogs:
            hog.kill()
    if run.result is None:
        return {"crash": run.returncode, "stderr": run.stderr[-1500:]}
    return run.result


# --- parts ------------------------------------------------------------------


def settled(result, batch):
    """The micro-batch size of the last batch, or None."""
    if not result.get("trained") or not result.get("counts"):
        return None
    return math.ceil(batch / result["counts"][-1])


def measure(name, xla, parts, share, report, cap_mib=None):
    batch = MODELS[name]
    row = {"model": name, "xla": xla, "batch": batch}
    base = {"model": name, "xla": xla}
    plain = run_child({**base, "run": "plain"}, 8192)
    row["plain_peak_mib"] = plain.get("peak_mib")
    if not plain.get("trained"):
        row["error"] = f"plain fit failed: {plain}"
        report(row)
        return row
    cap = cap_mib or int(share * plain["peak_mib"])
    row["cap_mib"] = cap
    if "guard" in parts:
        home = tempfile.mkdtemp(prefix="memguard-unseen-")
        guarded = {**base, "run": "guard", "epochs": GUARD_EPOCHS}
        runs = [
            run_child(guarded, cap, keras_home=home),
            run_child(guarded, cap, keras_home=home),
            run_child(guarded, cap, busy=True),
        ]
        row["guard"] = runs
        row["errors"] = sum(r.get("ooms", 0) for r in runs)
        # A refusal (the guard's MicroBatchTooLargeError, before a step that
        # would not fit) is a clear Python error, not a crash.
        refused = [r for r in runs if r.get("error", "").startswith("MicroBatchTooLargeError")]
        row["refusals"] = len(refused)
        row["crashes"] = sum(1 for r in runs if "crash" in r or "error" in r) - len(refused)
        row["timeouts"] = sum(1 for r in runs if "timeout" in r)
        row["all_batches"] = all(r.get("batches") == STEPS * GUARD_EPOCHS for r in runs)
        row["settled"] = [settled(r, batch) for r in runs]
        first, _, shared = row["settled"]
        if first and shared:
            row["spread"] = abs(first - shared) / max(first, shared)
    if "fixed" in parts and row.get("settled") and row["settled"][0]:
        k = max(1, math.ceil(batch / row["settled"][0]))
        best = None
        while k >= 1:
            # The smallest count with this micro-batch size: the counts
            # between two sizes split the batch the same way.
            k = math.ceil(batch / math.ceil(batch / k))
            if not clean_every_time(base, cap, k, row.get("guard", ())):
                break
            best, k = k, k - 1
        if best:
            best_micro = math.ceil(batch / best)
            row["best_micro"] = best_micro
            row["ratio"] = [s / best_micro if s else None for s in row["settled"][:2]]
    if "finder" in parts:
        found = run_child({**base, "run": "find"}, cap)
        row["finder"] = found
        answer = found.get("answer")
        if answer:
            row["finder_trains"] = trains_every_time(base, cap, answer)
            if row["finder_trains"]:
                largest, failed = largest_trained(base, cap, answer, batch * STEPS)
                row["largest_trained"], row["smallest_failed"] = largest, failed
                row["finder_ratio"] = answer / largest
    report(row)
    return row


def clean_every_time(base, cap, k, guarded=()):
    """Whether a fixed count `k` runs clean under the threshold in each of
    `EDGE_REPEATS` fresh processes: every batch at `k`, no error, every
    peak at most `THRESHOLD` of `cap`; and no batch of the `guarded` runs
    at `k`'s micro-batch size peaked above it with no more memory in use
    before it than a fixed run had (a step whose peak jumps on some
    batches shows it in only some processes: section "The U-Net's 0.73,
    batch by batch")."""
    spec = {**base, "run": "fixed", "k": k, "epochs": FIXED_EPOCHS}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_child(spec, cap), range(EDGE_REPEATS)))
    clean = all(
        # On XLA the guard raises a count the compiled program shows does
        # not fit, even with plan=False: such a run is not at k.
        run.get("trained") and run.get("ooms") == 0
        and set(run.get("counts") or ()) == {k}
        and run.get("peak_mib") is not None
        and run["peak_mib"] <= THRESHOLD * cap
        for run in runs
    )
    if not clean:
        return False
    batch = MODELS[base["model"]]
    held = max(
        (before for run in runs for _, before, _ in run.get("batch_log") or ()),
        default=None,
    )
    return not any(
        math.ceil(batch / count) == math.ceil(batch / k)
        and peak is not None and peak > THRESHOLD * cap
        and held is not None and before <= held
        for run in guarded
        for count, before, peak in run.get("batch_log") or ()
        if count
    )


def trains_every_time(base, cap, batch):
    """Whether plain `fit` at `batch` trains in each of `EDGE_REPEATS` fresh processes."""
    spec = {**base, "run": "plain", "batch": batch}
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: run_child(spec, cap), range(EDGE_REPEATS)))
    return all(run.get("trained") for run in runs)


def largest_trained(base, cap, trained, samples):
    """`(largest batch that trained, smallest that did not or None)`, from `trained` up.

    11% above `trained` first, then 25% steps until a batch fails, then
    bisection; at most `EDGE_RUNS` batches, none larger than `samples`,
    each tried `EDGE_REPEATS` times (`trains_every_time`).
    """
    low, high = trained, None
    size = -(-trained * 10 // 9)
    for _ in range(EDGE_RUNS):
        size = min(size, samples)
        if size <= low:
            break
        if trains_every_time(base, cap, size):
            low = size
        else:
            high = size
        if high is not None and high - low <= 1:
            break
        size = -(-low * 5 // 4) if high is None else (low + high) // 2
    return low, high


def report_line(row):
    def show(value):
        if isinstance(value, float):
            return f"{value:.2f}"
        if isinstance(value, list):
            return ", ".join(show(v) for v in value)
        return "-" if value is None else str(value)

    answer = (row.get("finder") or {}).get("answer")
    if (row.get("finder") or {}).get("refused"):
        finder = "refused (MicroBatchTooLargeError)"
    elif answer is None:
        finder = "-"
    elif not row.get("finder_trains"):
        finder = f"{answer} (FAILS)"
    else:
        failed = row.get("smallest_failed")
        finder = (
            f"{answer} (trains; largest that trains {row['largest_trained']}, "
            f"{'none tried fails' if failed is None else f'{failed} fails'}: "
            f"{row['finder_ratio']:.2f})"
        )
    print(
        f"| {row['model']} | {row['xla']} | {row['batch']} | {show(row.get('plain_peak_mib'))} "
        f"| {row.get('cap_mib', '-')} | {show(row.get('errors'))} | {show(row.get('crashes'))} "
        f"| {show(row.get('all_batches'))} | {show(row.get('settled'))} "
        f"| {show(row.get('best_micro'))} | {show(row.get('ratio'))} "
        f"| {show(row.get('spread'))} | {finder} |",
        flush=True,
    )
    if row.get("error"):
        print(f"<!-- {row['model']} {row['xla']}: {row['error'][:300]} -->", flush=True)
    if (row.get("finder") or {}).get("refused"):
        print(
            f"<!-- {row['model']} {row['xla']}: the finder refused: "
            f"{row['finder']['refused'][:300]} -->",
            flush=True,
        )
    if row.get("refusals"):
        first = next(r["error"] for r in row["guard"] if "error" in r)
        print(
            f"<!-- {row['model']} {row['xla']}: {row['refusals']} guarded run(s) "
            f"refused: {first[:300]} -->",
            flush=True,
        )
    if row.get("timeouts"):
        print(
            f"<!-- {row['model']} {row['xla']}: {row['timeouts']} guarded run(s) "
            f"stopped after {CHILD_TIMEOUT_S} s -->",
            flush=True,
        )


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        from keras_memguard.testing import emit_result

        emit_result(child(json.loads(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--xla", default="off,on")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--share", type=float, default=0.55)
    parser.add_argument(
        "--cap-mib", default="",
        help="fixed caps instead of --share of the plain peak: model=MiB,...",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; valid: {sorted(MODELS)}")
    caps = {}
    for entry in filter(None, args.cap_mib.split(",")):
        name, _, mib = entry.partition("=")
        if name not in MODELS or not mib.isdigit() or int(mib) < 1:
            parser.error(
                f"--cap-mib: expected model=MiB with a model of {sorted(MODELS)} and "
                f"a positive integer. Received: {entry!r}"
            )
        caps[name] = int(mib)
    parts = set(args.parts.split(","))
    print(
        "| model | XLA | batch | plain peak MiB | cap MiB | errors | crashes "
        "| all batches | settled micro-batch (first, cached, CPU shared) "
        "| best micro-batch | settled / best (first, cached) | spread | finder |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [
        measure(name, xla, parts, args.share, report_line, caps.get(name))
        for name in models
        for xla in args.xla.split(",")
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
