"""The NVML probe and the JAX guard against a real NVIDIA GPU.

Needs a GPU that JAX sees (exits with a message otherwise). Each part runs
in a process of its own, since XLA reads its allocator settings once:

- `probe`: with 1 GiB held by this process, `NvmlProbe` and
  `JaxMemoryProbe` against `nvidia-smi` (device total, used, this process).
- `analysis`: the compiled step's `memory_analysis()` against the device's
  measured peak, per batch and micro-batch count (CNN on 64x64x3), each in
  a fresh process: JAX cannot reset its peak, and compiling for a GPU
  (XLA's autotuner) sets one of its own. A step's measurement counts only
  where it raised the high-water mark past compiling's.
- `guard`: a 32x32 CNN at batch 4096 under the device's own limit, made
  small with `XLA_PYTHON_CLIENT_MEM_FRACTION` (`--limit-mib`): the count
  planned from the compiled step, out-of-memory errors, measured peak.
- `oom`: the same with `plan=False`: the whole batch runs out of memory on
  the device (XLA's `RESOURCE_EXHAUSTED`) and is replayed with more
  micro-batches; its weights against the `guard` part's.
- `own_step`: the 32x32 CNN as a class with a `train_step` of its own
  (keras.io's JAX pattern) under the same limit, at the batch that does not
  fit: what plain `fit` raises and whether the model still has its weights
  afterwards, the same under `MemoryGuard`, then the guarded model at a
  sixteenth of the batch.
- `whole`: what whole-batch training under `MemoryGuard` costs (the guard
  waits for each step, so that an allocation failing on the device shows
  where the batch is known): the own-step CNN, and the plain CNN under
  `keras.distribution.DataParallel` over every device, each against plain
  `fit` from the same weights, rounds interleaved in one process; per-step
  medians and the largest weight difference after the same steps.

Prints one JSON line per reading.

Run: python bench/jax_backend/bench_jax_gpu.py [--parts probe,analysis,guard,oom,own_step,whole]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

PARTS = ("probe", "analysis", "guard", "oom", "own_step", "whole")
ANALYSIS_BATCHES = (64, 256, 1024)
_MIB = 2**20


def emit(**row):
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)


def nvidia_smi():
    """Device total and used, and this process's use, as nvidia-smi says (MiB)."""
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")[0]
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    total, used = (float(v) for v in gpu.split(","))
    mine = [float(line.split(",")[1]) for line in apps.splitlines()
            if line.strip() and int(line.split(",")[0]) == os.getpid()]
    return dict(total_mib=total, used_mib=used, process_mib=mine[0] if mine else None)


def part_probe():
    import jax
    import keras

    emit(jax=jax.__version__, keras=keras.__version__, device=jax.devices()[0].device_kind)
    import jax.numpy as jnp

    from keras_memguard import NvmlProbe
    from keras_memguard.backends.jax.probe import JaxMemoryProbe

    held = jnp.ones((256, _MIB), dtype=jnp.float32)  # 1 GiB
    held.block_until_ready()
    (nvml,) = NvmlProbe().sample()
    (jax_sample,) = JaxMemoryProbe().sample()
    smi = nvidia_smi()
    emit(part="probe", device=str(jax.devices()[0]), held_mib=1024.0,
         nvml_total_mib=nvml.total_bytes / _MIB, nvml_used_mib=nvml.used_bytes / _MIB,
         nvml_process_mib=None if nvml.process_bytes is None else nvml.process_bytes / _MIB,
         nvml_utilization=nvml.gpu_utilization_percent,
         smi_total_mib=smi["total_mib"], smi_used_mib=smi["used_mib"],
         smi_process_mib=smi["process_mib"],
         jax_in_use_mib=jax_sample.current_bytes / _MIB,
         jax_limit_mib=jax_sample.limit_bytes / _MIB)


def _small_cnn(keras):
    """The CNN of `examples/jax_guard.py`: 2x Conv2D(32) on 32x32x3."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def part_analysis(batch, k):
    import jax
    import keras
    import numpy as np

    from keras_memguard.backends.jax import StepCache
    from keras_memguard.backends.compat import jax_state
    from keras_memguard.backends.compat import symbolic_build

    # The CNN of the analysis table measured on the CPU (bench_jax_plan.py).
    from bench_jax_plan import cnn

    device = jax.devices()[0]
    keras.utils.set_random_seed(0)
    model = cnn()[0]
    rng = np.random.default_rng(0)
    data = (jax.device_put(rng.normal(size=(batch, 64, 64, 3)).astype("float32")),
            jax.device_put(rng.integers(0, 10, size=(batch,)).astype("int32")))
    symbolic_build(model, data)
    state = jax.device_put(jax_state(model))
    cache = StepCache(model)
    memory = cache.memory(k, state, data)  # compiles (and autotunes) here
    stats = device.memory_stats()
    before, mark = stats["bytes_in_use"], stats["peak_bytes_in_use"]
    jax.block_until_ready(cache.compiled(k, state, data)(state, data))
    peak = device.memory_stats()["peak_bytes_in_use"]
    raised = peak > mark  # else compiling's autotuner set the high-water mark
    emit(part="analysis", batch=batch, k=k, demand_mib=memory.demand_bytes / _MIB,
         before_mib=before / _MIB, compile_mark_mib=(mark - before) / _MIB,
         measured_demand_mib=(peak - before) / _MIB if raised else None,
         measured_over_analysis=(peak - before) / memory.demand_bytes if raised else None)


def _train(plan, batch, log_dir):
    import logging

    import jax
    import keras
    import numpy as np

    import keras_memguard

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("keras_memguard").setLevel(logging.INFO)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(2 * batch,))
    model = _small_cnn(keras)
    guard = keras_memguard.MemoryGuard(plan=plan, plan_cache=False, log_dir=log_dir)
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                        callbacks=[keras_memguard.MemoryMonitor(log_dir=log_dir), guard])
    stats = jax.devices()[0].memory_stats()
    return model, guard, history, stats


def part_guard(batch, weights_path):
    import numpy as np

    with tempfile.TemporaryDirectory() as log_dir:
        model, guard, history, stats = _train(True, batch, log_dir)
    np.savez(weights_path, *model.get_weights())
    emit(part="guard", batch=batch, limit_mib=stats["bytes_limit"] / _MIB,
         peak_mib=stats["peak_bytes_in_use"] / _MIB,
         micro_batches=history.history["micro_batches"],
         oom_recoveries=guard.oom_recoveries,
         loss=[round(v, 5) for v in history.history["loss"]])


def part_oom(batch, weights_path):
    import numpy as np

    with tempfile.TemporaryDirectory() as log_dir:
        model, guard, history, stats = _train(False, batch, log_dir)
    planned = np.load(weights_path) if os.path.exists(weights_path) else None
    difference = None
    if planned is not None:
        difference = max(float(np.max(np.abs(a - planned[f"arr_{i}"])))
                         for i, a in enumerate(model.get_weights()))
    emit(part="oom", batch=batch, limit_mib=stats["bytes_limit"] / _MIB,
         peak_mib=stats["peak_bytes_in_use"] / _MIB,
         micro_batches=history.history["micro_batches"],
         oom_recoveries=guard.oom_recoveries,
         loss=[round(v, 5) for v in history.history["loss"]],
         largest_weight_difference_from_guard=difference)


def _own_step_cnn(keras):
    """`_small_cnn`'s layers in a class whose `train_step` is its own."""
    import jax

    class OwnStepCNN(keras.Sequential):
        def _loss(self, trainable, non_trainable, x, y):
            logits, non_trainable = self.stateless_call(trainable, non_trainable, x,
                                                        training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            return keras.ops.mean(loss), non_trainable

        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            grad_fn = jax.value_and_grad(self._loss, has_aux=True)
            (loss, non_trainable), grads = grad_fn(trainable, non_trainable, data[0], data[1])
            trainable, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable)
            return ({"own_loss": loss},
                    (trainable, non_trainable, optimizer_variables, metrics_variables))

    layers = _small_cnn(keras).layers
    keras.utils.set_random_seed(0)
    model = OwnStepCNN([keras.Input((32, 32, 3))] + [
        type(layer).from_config(layer.get_config()) for layer in layers])
    model.compile(optimizer="adam")
    return model


def _fit_outcome(model, x, y, batch, callbacks):
    """What `fit` raised (its first line) and whether the weights are still there."""
    import numpy as np

    before = [np.array(w) for w in model.get_weights()]
    error = None
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=callbacks)
    except Exception as e:  # The figure to report: what `fit` raised.
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"
    try:
        after = model.get_weights()
        kept = "equal" if all(np.array_equal(a, b) for a, b in zip(before, after)) else "changed"
    except Exception as e:  # The model lost its weights.
        kept = f"lost ({type(e).__name__})"
    return error, kept


def part_own_step(batch, memory_limit=None):
    """`memory_limit`: the guard's, where the device reports none (a smoke run on the CPU)."""
    import keras
    import numpy as np

    import keras_memguard

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(batch,))
    error, kept = _fit_outcome(_own_step_cnn(keras), x, y, batch, [])
    emit(part="own_step", run="plain", batch=batch, error=error, weights=kept)
    model = _own_step_cnn(keras)
    error, kept = _fit_outcome(model, x, y, batch, [
        keras_memguard.MemoryGuard(memory_limit=memory_limit, plan_cache=False)])
    emit(part="own_step", run="guard", batch=batch, error=error, weights=kept)
    small = batch // 16
    error, kept = _fit_outcome(model, x, y, small, [
        keras_memguard.MemoryGuard(memory_limit=memory_limit, plan_cache=False)])
    emit(part="own_step", run="guard, then a smaller batch", batch=small, error=error,
         weights=kept)


def part_whole(batch, rounds=5, steps=20, memory_limit=None):
    """`memory_limit`: the guard's, where the device reports none (a smoke run on the CPU)."""
    import statistics
    import time

    import jax
    import keras
    import numpy as np

    import keras_memguard

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(steps * batch,))
    for setup, build in (("own_step", _own_step_cnn), ("data_parallel", _small_cnn)):
        if setup == "data_parallel":
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(devices=jax.devices()))
        try:
            models = {"plain": build(keras), "guard": build(keras)}
            models["guard"].set_weights(models["plain"].get_weights())
            guard = keras_memguard.MemoryGuard(memory_limit=memory_limit, plan_cache=False)
            callbacks = {"plain": [], "guard": [guard]}
            seconds = {name: [] for name in models}
            for _ in range(rounds + 1):  # the first round compiles: not counted
                for name, model in models.items():
                    start = time.perf_counter()
                    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                              callbacks=callbacks[name])
                    jax.block_until_ready(model.trainable_variables[0].value)
                    seconds[name].append((time.perf_counter() - start) / steps)
            difference = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(models["plain"].get_weights(), models["guard"].get_weights()))
            medians = {name: statistics.median(values[1:]) for name, values in seconds.items()}
            emit(part="whole", setup=setup, devices=len(jax.devices()), batch=batch,
                 plain_step_ms=medians["plain"] * 1e3, guard_step_ms=medians["guard"] * 1e3,
                 guard_over_plain=medians["guard"] / medians["plain"],
                 largest_weight_difference=difference)
        finally:
            keras.distribution.set_distribution(None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--limit-mib", type=float, default=256.0,
                        help="the device limit of parts guard and oom")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--in-process", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--micro-batches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--weights", default=os.path.join(tempfile.gettempdir(),
                                                          "bench_jax_gpu_weights.npz"))
    args = parser.parse_args()
    if args.in_process:
        {"probe": part_probe,
         "analysis": lambda: part_analysis(args.batch_size, args.micro_batches),
         "guard": lambda: part_guard(args.batch_size, args.weights),
         "oom": lambda: part_oom(args.batch_size, args.weights),
         "own_step": lambda: part_own_step(args.batch_size),
         "whole": lambda: part_whole(args.batch_size)}[args.in_process]()
        return
    try:
        total = nvidia_smi()["total_mib"] * _MIB
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"bench_jax_gpu needs an NVIDIA GPU (nvidia-smi: {error})")
    for part in args.parts.split(","):
        env = dict(os.environ, KERAS_BACKEND="jax")
        if part in ("guard", "oom", "own_step"):
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.limit_mib * _MIB / total:.6f}"
        else:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        runs = [(args.batch_size, 1)]
        if part == "analysis":
            runs = [(b, k) for b in ANALYSIS_BATCHES for k in (1, 2, 4, 8)]
        for batch, k in runs:
            subprocess.run([sys.executable, __file__, "--in-process", part,
                            "--batch-size", str(batch), "--micro-batches", str(k),
                            "--weights", args.weights], env=env, check=False)


if __name__ == "__main__":
    main()
