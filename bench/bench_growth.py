"""False alarms of `MemoryMonitor(growth=True)` on steady runs, and its cost.

Each steady run is a training script of its own (a fresh process under the
CPU stand-in's capped allocator, as a user's script is): one model and one
input pipeline, `fit` for some epochs with `validation_data`, then
`evaluate` and `predict` a few times, with the growth detector on. Nothing
in them keeps memory from epoch to epoch, so every growth warning is a
false alarm. The models and pipelines are the kinds users bring: an MLP on
numpy arrays, a CNN with BatchNormalization on `tf.data` (shuffled,
prefetched), a small Transformer encoder on token ids through a
`keras.utils.PyDataset`, an LSTM with masking, a multi-output model, a
keras.applications MobileNetV2 (`weights=None`), each with and without
`MemoryGuard`, and the CNN under XLA.

With `--cost`, whole fits of a small model are also timed in this process,
interleaved: plain, with `MemoryMonitor()` and with
`MemoryMonitor(growth=True)`; per batch, medians.

    python bench/bench_growth.py                  # every run, 3 repeats
    python bench/bench_growth.py --runs mlp --repeats 1   # the smoke run

Prints a Markdown table: per run, the repeats, the warnings and the epochs.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CAP_MIB = 1500
EPOCHS = 8

# name -> (model, input pipeline, guarded, jit_compile)
RUNS = {
    "mlp": ("mlp", "numpy", False, False),
    "mlp_guarded": ("mlp", "numpy", True, False),
    "cnn_bn": ("cnn_bn", "tf_data", False, False),
    "cnn_bn_guarded": ("cnn_bn", "tf_data", True, False),
    "cnn_bn_xla": ("cnn_bn", "tf_data", True, True),
    "transformer": ("transformer", "py_dataset", False, False),
    "transformer_guarded": ("transformer", "py_dataset", True, False),
    "lstm_masked": ("lstm", "numpy", False, False),
    "two_outputs": ("two_outputs", "numpy", True, False),
    "mobilenet_v2": ("mobilenet_v2", "tf_data", True, False),
}

CHILD = r'''
import json, logging, sys
import numpy as np
import keras
import tensorflow as tf
import keras_memguard
from keras_memguard.testing import emit_result

model_name, pipeline, guarded, jit, epochs = json.loads(sys.argv[1])
warnings_seen = []


class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings_seen.append(record.getMessage())


logging.getLogger("keras_memguard").addHandler(Collect())
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
n = 512


def build():
    if model_name == "mlp":
        x = rng.normal(size=(n, 64)).astype("float32")
        y = rng.integers(0, 10, n)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if model_name == "cnn_bn":
        x = rng.normal(size=(n, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 10, n)
        layers = [keras.Input((32, 32, 3))]
        for width in (16, 32):
            layers += [keras.layers.Conv2D(width, 3, padding="same"),
                       keras.layers.BatchNormalization(), keras.layers.ReLU(),
                       keras.layers.MaxPooling2D()]
        layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
        return keras.Sequential(layers), x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if model_name == "mobilenet_v2":
        x = rng.normal(size=(n // 4, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 10, n // 4)
        model = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), weights=None, classes=10, alpha=0.35)
        return model, x, y, "sparse_categorical_crossentropy"
    if model_name == "transformer":
        x = rng.integers(1, 1000, size=(n, 32))
        y = rng.integers(0, 2, n)
        tokens = keras.Input((32,), dtype="int32")
        h = keras.layers.Embedding(1000, 32)(tokens)
        a = keras.layers.MultiHeadAttention(4, 8)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(64, activation="relu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(32)(f))
        out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(tokens, out), x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if model_name == "lstm":
        x = rng.integers(0, 500, size=(n, 24))
        x[:, 16:] = 0  # padding, masked
        y = rng.normal(size=(n, 1)).astype("float32")
        model = keras.Sequential([keras.Input((24,), dtype="int32"),
                                  keras.layers.Embedding(500, 16, mask_zero=True),
                                  keras.layers.LSTM(32), keras.layers.Dense(1)])
        return model, x, y, "mse"
    if model_name == "two_outputs":
        x = rng.normal(size=(n, 32)).astype("float32")
        y = {"a": rng.normal(size=(n, 1)).astype("float32"), "b": rng.integers(0, 3, n)}
        inputs = keras.Input((32,))
        h = keras.layers.Dense(64, activation="relu")(inputs)
        model = keras.Model(inputs, {"a": keras.layers.Dense(1, name="a")(h),
                                     "b": keras.layers.Dense(3, name="b")(h)})
        loss = {"a": "mse", "b": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
        return model, x, y, loss
    raise ValueError(model_name)


model, x, y, loss = build()
model.compile(optimizer="adam", loss=loss, jit_compile=jit)
split = len(x) * 3 // 4


def take(data, start, stop):
    if isinstance(data, dict):
        return {k: v[start:stop] for k, v in data.items()}
    return data[start:stop]


train = (take(x, 0, split), take(y, 0, split))
valid = (take(x, split, None), take(y, split, None))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


batch = 32
if pipeline == "tf_data":
    data = tf.data.Dataset.from_tensor_slices(train).shuffle(split).batch(batch).prefetch(2)
    fit_args = dict(x=data)
    valid_data = tf.data.Dataset.from_tensor_slices(valid).batch(batch)
elif pipeline == "py_dataset":
    fit_args = dict(x=Batches(*train, batch))
    valid_data = Batches(*valid, batch)
else:
    fit_args = dict(x=train[0], y=train[1], batch_size=batch)
    valid_data = valid
monitor = keras_memguard.MemoryMonitor(growth=True)
callbacks = [monitor]
if guarded:
    callbacks.append(keras_memguard.MemoryGuard())
model.fit(**fit_args, epochs=epochs, validation_data=valid_data, verbose=0, callbacks=callbacks)
for _ in range(3):
    model.evaluate(valid[0], valid[1], batch_size=batch, verbose=0, callbacks=[monitor])
    model.predict(valid[0], batch_size=batch, verbose=0, callbacks=[monitor])
emit_result({
    "warnings": [w for w in warnings_seen if w.startswith("Memory keeps growing")],
    "all_warnings": warnings_seen,
    "tested": sorted(monitor.growth),
})
'''


def run_child(name, epochs):
    from keras_memguard.testing import run_with_memory_cap

    model_name, pipeline, guarded, jit = RUNS[name]
    start = time.perf_counter()
    run = run_with_memory_cap(
        CHILD.replace("sys.argv[1]", repr(json.dumps([model_name, pipeline, guarded, jit, epochs]))),
        CAP_MIB, timeout=600, check=False,
    )
    seconds = time.perf_counter() - start
    if run.returncode != 0 or run.result is None:
        return {"failed": True, "stderr": run.stderr[-2000:], "seconds": seconds}
    return dict(run.result, failed=False, seconds=seconds)


def measure_cost(rounds, batches=200, epochs=2):
    """Median wall time per batch of whole fits, detector on and off.

    The monitor reads memory inside the train function (its logs carrier),
    so its cost is timed in whole fits of a small model: `epochs` epochs of
    `batches` batches, the detector's per-batch bookkeeping and its test at
    each epoch end included; interleaved, median of `rounds`.
    """
    from keras_memguard.testing import memory_cap_env

    # TensorFlow's capped BFC allocator, read each batch as on a GPU.
    os.environ.update(memory_cap_env(CAP_MIB))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import keras_memguard

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.zeros((32 * batches, 8), "float32")
    y = x[:, :1]

    def fit(callbacks):
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks)
        return (time.perf_counter() - start) / (batches * epochs) * 1e6

    fit([keras_memguard.MemoryMonitor()])  # traces the step once
    times = {"plain": [], False: [], True: []}
    for _ in range(rounds):
        times["plain"].append(fit([]))
        for growth in (False, True):  # interleaved
            times[growth].append(fit([keras_memguard.MemoryMonitor(growth=growth)]))
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--cost", action="store_true", help="also time the batch hooks")
    parser.add_argument("--cost-rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every run's result here")
    args = parser.parse_args(argv)
    names = [name for name in args.runs.split(",") if name]
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; known: {sorted(RUNS)}")
    results = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:  # interleaved repeats
            results[name].append(run_child(name, args.epochs))
    print("| run | model | input | guard | XLA | runs | failed | false alarms | median s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    total_runs = total_alarms = 0
    for name in names:
        model_name, pipeline, guarded, jit = RUNS[name]
        done = [r for r in results[name] if not r["failed"]]
        alarms = sum(len(r["warnings"]) > 0 for r in done)
        total_runs += len(done)
        total_alarms += alarms
        seconds = statistics.median(r["seconds"] for r in results[name])
        print(
            f"| {name} | {model_name} | {pipeline} | {'yes' if guarded else 'no'} | "
            f"{'on' if jit else 'off'} | {len(results[name])} | "
            f"{len(results[name]) - len(done)} | {alarms} | {seconds:.1f} |"
        )
    print(f"\nsteady runs: {total_runs}, runs with a growth warning: {total_alarms}")
    for name in names:
        for result in results[name]:
            if result["failed"]:
                print(f"\n{name} failed:\n{result['stderr']}")
            elif result["warnings"]:
                print(f"\n{name} warned: {result['warnings']}")
    if args.cost:
        cost = measure_cost(args.cost_rounds)
        print(
            f"\nwhole fits, median of {args.cost_rounds} interleaved rounds, per batch: "
            f"plain {cost['plain']:.1f} us; MemoryMonitor growth off {cost[False]:.1f} us, "
            f"growth on {cost[True]:.1f} us ({cost[True] - cost[False]:+.1f} us)"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)
    return 1 if any(r["failed"] for rs in results.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
