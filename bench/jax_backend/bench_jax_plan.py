"""How XLA's memory analysis of the micro-batched JAX step scales, and what
compiling a candidate count costs.

For each model and batch size, compiles the step at each count (nothing
runs), prints one JSON line per (model, batch, k) with the analysis
(argument, output, temp, alias, need bytes) and the lowering+compile time,
then, per model, how well a line fitted to two batch sizes at k=1 predicts
the need at the others (the analysis against itself, on CPU).

Run: KERAS_BACKEND=jax python bench/jax_backend/bench_jax_plan.py [--smoke]
"""

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402

from keras_memguard.backends.jax import StepCache  # noqa: E402
from keras_memguard.backends.compat import jax_state  # noqa: E402
from keras_memguard.backends.compat import symbolic_build  # noqa: E402
from keras_memguard.backends.jax.compiled import spec_of  # noqa: E402


def mlp():
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(256, activation="tanh") for _ in range(3)]
        + [keras.layers.Dense(4)]
    )
    model.compile(optimizer="adam", loss="mse")
    return model, lambda b: ((b, 64), "float32"), lambda b: ((b, 4), "float32")


def cnn():
    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, lambda b: ((b, 64, 64, 3), "float32"), lambda b: ((b,), "int32")


MODELS = {"mlp_3x256": mlp, "cnn_2x64_64px": cnn}


def run(model_name, batches, counts):
    keras.utils.set_random_seed(0)
    model, x_spec, y_spec = MODELS[model_name]()
    rows = []
    for batch in batches:
        data = (
            jax.ShapeDtypeStruct(*x_spec(batch)),
            jax.ShapeDtypeStruct(*y_spec(batch)),
        )
        symbolic_build(model, data)
        state = spec_of(jax_state(model))
        cache = StepCache(model)
        for k in counts:
            if k > batch:
                continue
            start = time.perf_counter()
            memory = cache.memory(k, state, data)
            seconds = time.perf_counter() - start
            row = dict(
                model=model_name,
                batch=batch,
                k=k,
                argument_mib=memory.argument_bytes / 2**20,
                output_mib=memory.output_bytes / 2**20,
                temp_mib=memory.temp_bytes / 2**20,
                alias_mib=memory.alias_bytes / 2**20,
                need_mib=memory.need_bytes / 2**20,
                compile_s=seconds,
            )
            rows.append(row)
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                              for key, v in row.items()}), flush=True)
    # The analysis against itself: a line through the two smallest batches
    # at k=1 predicts the need at the larger ones.
    ones = [r for r in rows if r["k"] == 1]
    if len(ones) >= 3:
        (b0, n0), (b1, n1) = [(r["batch"], r["need_mib"]) for r in ones[:2]]
        slope = (n1 - n0) / (b1 - b0)
        for r in ones[2:]:
            predicted = n0 + slope * (r["batch"] - b0)
            print(json.dumps(dict(
                model=model_name, batch=r["batch"], k=1,
                predicted_need_mib=round(predicted, 3),
                need_mib=round(r["need_mib"], 3),
                error_percent=round(100 * (predicted - r["need_mib"]) / r["need_mib"], 2),
            )), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny run")
    args = parser.parse_args()
    print(json.dumps(dict(jax=jax.__version__, keras=keras.__version__,
                          devices=[str(d) for d in jax.devices()])), flush=True)
    if args.smoke:
        run("mlp_3x256", [64, 128, 256], [1, 2])
        return
    run("mlp_3x256", [512, 1024, 2048, 4096], [1, 2, 4, 8, 16])
    run("cnn_2x64_64px", [16, 32, 64, 128], [1, 2, 4, 8])


if __name__ == "__main__":
    main()
