"""The largest batch: `find_batch_size` against searches that run out of memory.

For each model, in a fresh process under a real capped allocator (the rest
of the cap reserved in one region first, as `find_batch_size` and
`MemoryGuard` do, so every method sees the same allocator):

- `memguard`: `keras_memguard.find_batch_size` (planned trials);
- `bisection`: doubling from 1 until a step runs out of memory, then
  bisection between the last batch that fit and the first that did not,
  down to one sample: the true largest batch, found the way accelerate's
  and Lightning's `binsearch` search;
- `power`: Lightning's default `BatchSizeFinder(mode="power")`: doubling
  from 2 until a step runs out of memory, then the last batch that fit.

One training step per trial (`train_on_batch`; Lightning runs 3 per trial by
default). Reported: the batch found, its share of the true largest, the
trial steps, the out-of-memory errors and the seconds the search took.

    python bench/bench_batch_size.py [--models cnn,transformer,mobilenet]
        [--methods memguard,bisection,power] [--repeats N]
        [--threshold 0.95] [--tolerance 0.05]
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODELS = {
    # name: (cap MiB, samples)
    "cnn": (600, 96),
    "transformer": (400, 64),
    "mobilenet": (300, 64),
}
METHODS = ("memguard", "bisection", "power")


def build(name):
    """A compiled model and `(x, y)` numpy arrays, seeded."""
    import numpy as np
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    samples = MODELS[name][1]
    if name == "cnn":
        model = keras.Sequential([
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        x = rng.random((samples, 64, 64, 3), dtype=np.float32)
        y = rng.integers(0, 10, samples)
    elif name == "transformer":
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from programs.common import attention_classifier

        model, x, y = attention_classifier(samples)
    else:
        model = keras.applications.MobileNetV2(
            weights=None, input_shape=(64, 64, 3), classes=10
        )
        x = rng.random((samples, 64, 64, 3), dtype=np.float32)
        y = rng.integers(0, 10, samples)
    if name == "mobilenet":
        loss = "sparse_categorical_crossentropy"
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("adam", loss)
    return model, x, y


def child(spec):
    import numpy as np
    import tensorflow as tf

    from keras_memguard.batch_size_finder import find_batch_size
    from keras_memguard.backends.tensorflow import region
    from keras_memguard.testing import emit_result

    model, x, y = build(spec["model"])
    cap = spec["cap_mib"] * 2**20
    region.reserve_region("CPU:0", cap)
    steps, errors = [], 0

    def fits(size):
        nonlocal errors
        index = np.arange(size) % len(x)
        try:
            model.train_on_batch(x[index], y[index])
            steps.append((size, True))
            return True
        except tf.errors.ResourceExhaustedError:
            steps.append((size, False))
            errors += 1
            return False

    start = time.perf_counter()
    if spec["method"] == "memguard":
        result = find_batch_size(
            model, x, y, threshold=spec["threshold"], tolerance=spec["tolerance"], verbose=0
        )
        found = result.largest_batch_size
        steps = [(t.batch_size, t.peak_bytes is not None) for t in result.trials]
        errors = result.out_of_memory_errors
    elif spec["method"] == "bisection":
        good, size = 0, 1
        while fits(size):
            good, size = size, size * 2
        bad = size
        while bad - good > 1:
            middle = (good + bad) // 2
            if fits(middle):
                good = middle
            else:
                bad = middle
        found = good
    else:  # Lightning's "power" mode
        good, size = 0, 2
        while fits(size):
            good, size = size, size * 2
        found = good
    emit_result({
        "found": found,
        "steps": steps,
        "errors": errors,
        "seconds": round(time.perf_counter() - start, 1),
    })


def run_child(spec):
    from keras_memguard.testing import run_script_with_memory_cap

    run = run_script_with_memory_cap(
        [__file__, "--child", json.dumps(spec)], spec["cap_mib"], timeout=900, check=False
    )
    return run.result if run.result is not None else {"error": run.stderr[-2000:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threshold", type=float, default=0.95,
                        help="find_batch_size's threshold")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="find_batch_size's tolerance")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each method per model (the table lists each)")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    raw = {}
    print("| model | cap MiB | method | batch found | / true largest | trial steps | OOMs | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        cap = MODELS[name][0]
        results = [
            (method, run_child({"model": name, "method": method, "cap_mib": cap,
                                "threshold": args.threshold, "tolerance": args.tolerance}))
            for method in args.methods.split(",")
            for _ in range(args.repeats)
        ]
        raw[name] = results
        truth = max((r.get("found", 0) for m, r in results if m == "bisection"), default=None)
        for method, r in results:
            if "error" in r:
                print(f"| {name} | {cap} | {method} | error: {r['error'][-300:]!r} | | | | |")
                continue
            share = f"{r['found'] / truth:.3f}" if truth else "-"
            print(
                f"| {name} | {cap} | {method} | {r['found']} | {share} | "
                f"{len(r['steps'])} | {r['errors']} | {r['seconds']} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
