"""What MemoryGuard (and MemoryMonitor) cost per batch on Keras' JAX backend.

A small MLP trained for a number of steps at one batch shape, so the plan is
made once and every later batch only looks its count up: plain `fit`, `fit`
with `MemoryGuard` (a limit the whole batch fits: k=1, the same compute),
and with `MemoryGuard` + `MemoryMonitor`. The variants run interleaved in
one process, each `--repeats` times after a warm-up fit (compiles), and the
script prints one JSON line per timed fit, then the medians, their ratios to
plain `fit` and the extra microseconds per batch.

Run: KERAS_BACKEND=jax python bench/jax_backend/bench_jax_guard.py [--smoke]
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_memguard  # noqa: E402

VARIANTS = ("plain", "guard", "guard+monitor")


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def callbacks(variant):
    if variant == "plain":
        return []
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40)
    if variant == "guard":
        return [guard]
    return [keras_memguard.MemoryMonitor(nvml=False), guard]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="one short run")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 20, 1
    rng = np.random.default_rng(0)
    n = args.steps * args.batch_size
    x = rng.normal(size=(n, 32)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    print(json.dumps({"jax": jax.__version__, "keras": keras.__version__,
                      "device": str(jax.devices()[0]), "steps": args.steps}))
    models = {variant: make_model() for variant in VARIANTS}
    fit = dict(batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0)
    for variant, model in models.items():  # warm-up: compiles and plans
        model.fit(x, y, callbacks=callbacks(variant), **fit)
    seconds = {variant: [] for variant in VARIANTS}
    for repeat in range(args.repeats):
        for variant, model in models.items():
            hooks = callbacks(variant)
            start = time.perf_counter()
            model.fit(x, y, callbacks=hooks, **fit)
            elapsed = time.perf_counter() - start
            seconds[variant].append(elapsed)
            print(json.dumps({"repeat": repeat, "variant": variant, "seconds": round(elapsed, 4)}))
    plain = statistics.median(seconds["plain"])
    for variant in VARIANTS:
        median = statistics.median(seconds[variant])
        print(json.dumps({
            "variant": variant,
            "median_s": round(median, 4),
            "ratio_to_plain": round(median / plain, 3),
            "extra_us_per_batch": round(1e6 * (median - plain) / args.steps, 1),
        }))


if __name__ == "__main__":
    main()
