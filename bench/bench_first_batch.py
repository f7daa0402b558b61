"""The first batch before anything is measured: a model's layer outputs, static or traced.

`MemoryGuard` plans the first batch of a run (no plan cache yet) from the
bytes of one sample's layer outputs: it runs whole where the memory free
holds many times what they ask, and split otherwise. The model's static
shapes give them for most image models, but not where a dimension other
than the batch is open (tokens of any length), a layer is built of layers
(`MultiHeadAttention`, RNNs, a user's block) or the model is a subclass;
the TensorFlow backend then traces the forward pass at the first batch's
shapes (`keras_memguard.backends.tensorflow.activations`).

Parts:

1. `ratio`: on models whose static shapes tell both, the traced forward
   pass's operation outputs against the layer outputs, per sample, and
   the time to trace. The least ratio is the constant
   `OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE` divides by.
2. `first`: on models whose static shapes tell nothing, plain `fit` and
   `fit` with a default `MemoryGuard` (an empty plan cache, memory
   plentiful), from the same weights: the first batch's micro-batches and
   how far the weights end apart.

One process; on TensorFlow under the BFC CPU allocator with oneDNN off, as
the tests run. With `KERAS_BACKEND=torch` the PyTorch estimate
(`keras_memguard.backends.torch.activations`, a one-sample forward pass)
is measured instead, on the models that do not need TensorFlow.

    python bench/bench_first_batch.py [--parts ratio,first]
        [--ratio-models mlp,...] [--first-models subclassed_batchnorm,...]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPU_BFC_MEM_LIMIT_IN_MB", "8192")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import keras  # noqa: E402

import keras_memguard  # noqa: E402
from keras_memguard import oom_explanation  # noqa: E402

if keras.backend.backend() == "torch":
    from keras_memguard.backends.torch import activations

    ESTIMATE = activations.counted_sample_bytes
else:
    from keras_memguard.backends.tensorflow import activations

    ESTIMATE = activations.traced_sample_bytes


def _mlp():
    return keras.Sequential([
        keras.Input((784,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dropout(0.2),
        keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10),
    ]), (32, 784)


def _cnn():
    return keras.Sequential([
        keras.Input((64, 64, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ]), (32, 64, 64, 3)


def _application(name, size, batch):
    def build():
        model = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=10
        )
        return model, (batch, size, size, 3)
    return build


RATIO_MODELS = {
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet50": _application("ResNet50", 64, 16),
    "mobilenet_v2": _application("MobileNetV2", 96, 16),
    "densenet121": _application("DenseNet121", 64, 8),
    "efficientnet_b0": _application("EfficientNetB0", 64, 8),
}


class SubclassedBatchNormMLP(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(256, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(10)

    def call(self, x, training=False):
        return self.out(self.norm(self.hidden(x), training=training))


def _subclassed(rng):
    model = SubclassedBatchNormMLP()
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model, rng.normal(size=(256, 64)).astype("float32"), rng.integers(0, 10, 256)


def _encoder(rng):
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(2000, 64)(tokens)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(4, 16)(h, h))
    feed_forward = keras.layers.Dense(64)(keras.layers.Dense(256, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + feed_forward)
    model = keras.Model(tokens, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model, rng.integers(1, 2000, (256, 64)).astype("int32"), rng.integers(0, 2, 256)


def _gru(rng):
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(2000, 64, mask_zero=True)(tokens)
    h = keras.layers.GRU(64)(h)
    model = keras.Model(tokens, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    ids = rng.integers(1, 2000, (256, 48)).astype("int32")
    ids[:, 40:] = 0
    return model, ids, rng.integers(0, 2, (256, 1)).astype("float32")


def _strings(rng):
    import tensorflow as tf

    words = np.array(["the cat sat down", "a dog ran far away", "birds fly", "fish swim deep now"])
    text = tf.constant(words[rng.integers(0, 4, 256)])
    vectorize = keras.layers.TextVectorization(max_tokens=100, output_sequence_length=8)
    vectorize.adapt(tf.constant(words))
    raw = keras.Input((), dtype="string")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(100, 16)(vectorize(raw)))
    model = keras.Model(raw, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model, text, rng.integers(0, 2, (256, 1)).astype("float32")


FIRST_MODELS = {
    "subclassed_batchnorm": _subclassed,
    "variable_length_encoder": _encoder,
    "masked_gru": _gru,
    "string_input": _strings,
}


def part_ratio(names):
    print("| model | layer outputs per sample (bytes) | operation outputs | ratio | estimate s |")
    print("| --- | --- | --- | --- | --- |")
    ratios = []
    for name in names:
        model, shape = RATIO_MODELS[name]()
        x = keras.ops.zeros(shape)
        static = oom_explanation.layer_output_bytes(model)
        start = time.perf_counter()
        traced = ESTIMATE(model, (x,))
        seconds = time.perf_counter() - start
        operations = traced * activations.OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE
        ratios.append(operations / static)
        ratio = operations / static
        print(f"| {name} | {static} | {operations:.0f} | {ratio:.2f} | {seconds:.2f} |")
    print(f"least ratio: {min(ratios):.2f}, largest: {max(ratios):.2f}")


def _first_fit(build, guard):
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    model, x, y = build(rng)
    counts = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: counts.append(logs.get("micro_batches", 1))
    )
    callbacks = [record] if guard is None else [guard, record]
    start = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    return model, counts, time.perf_counter() - start


def part_first(names):
    print(
        "| model | static layer outputs | estimate | plain s | guard s | guard's counts "
        "| weights apart |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        build = FIRST_MODELS[name]
        plain, _, plain_s = _first_fit(build, None)
        guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, plan_cache=False)
        guarded, counts, guard_s = _first_fit(build, guard)
        apart = max(
            float(np.max(np.abs(a - b))) for a, b in zip(guarded.get_weights(), plain.get_weights())
        )
        print(
            f"| {name} | {oom_explanation.layer_output_bytes(plain)} | "
            f"{guard.controller.state.sample_bytes:.0f} | {plain_s:.2f} | {guard_s:.2f} | "
            f"{', '.join(str(int(c)) for c in counts)} | {apart:.1e} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ratio,first")
    parser.add_argument("--ratio-models", default=",".join(RATIO_MODELS))
    parser.add_argument("--first-models", default=",".join(FIRST_MODELS))
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "ratio" in parts:
        part_ratio(args.ratio_models.split(","))
    if "first" in parts:
        part_first(args.first_models.split(","))


if __name__ == "__main__":
    main()
