"""Performance of MemoryGuard: throughput, peak memory, OOM recovery, batch size.

Run from the repository root (10 to 12 minutes on 2 shared CPU cores):

    python3 bench/bench_guard.py                  # all four parts
    python3 bench/bench_guard.py --parts 1 --rounds 11
    python3 bench/bench_guard.py --parts 2 --peak-models unet
    python3 bench/bench_guard.py --json /tmp/bench_guard.json

Every figure is measured on the real path a user gets: `MemoryGuard` in
`model.fit` on a plain Sequential model. Where a fixed number of
micro-batches `k` is wanted, the guard is given `memory_limit=2**40` (so the
measured usage never reaches the threshold), `cooldown=10**9` (so it never
halves `k`) and starts at `k` (`plan=False, micro_batches=k`); the
script checks after every fit that `k` did not move and no batch was
replayed.

1. Throughput, one process (BFC CPU allocator with an 8 GiB cap, oneDNN
   off, as `bench_monitor.py`). For a small CNN and an MLP, at data batch
   `B`: the guard at `k` micro-batches of `B`, Keras' own
   `Adam(gradient_accumulation_steps=k)` fed batches of `B / k`, plain
   training at `B / k` and plain training at `B` (plus the guard at
   `k = 1`). Every variant trains on the same numpy data, the same number of
   samples per fit, and (except plain `B / k`) makes the same number of
   optimizer updates. Variants are interleaved, the order rotated each
   round, one warm-up fit each; medians and the median of per-round ratios.
2. Per-step allocator peak (two child processes, 8 GiB cap, one inter-op
   thread, the variants in forward then reversed order): the guard at `k`
   micro-batches of `B` against plain training at `B / k` (and the guard at
   `k = 1` fed `B / k`), for two CNNs at `B = 256`, `k` in {1, 2, 4, 8}, and
   a large-output model (a narrow U-Net with 64x64x8 per-pixel logits and
   an accuracy metric) at `B = 64`, `k` in {1, 4}; `reset_memory_stats` at
   batch begin, `get_memory_info("CPU:0")["peak"]` right after the train
   function (where the guard reads it), after one warm-up fit. Input
   batches are generated inside a `tf.data` pipeline (no prefetch), so the
   allocator holds one input batch at a time and no dataset copy.
3. One out-of-memory recovery (child processes under a real 600 MiB cap):
   a guarded epoch whose first batch runs out of memory at `k = 1` and is
   replayed at `k = 2`, against the same epoch started at `k = 2`. Both step
   functions are traced before `fit` (trace time reported apart).
4. Largest batch (child processes under a 600 MiB cap): a grid scan, one
   process per candidate, for the largest batch `B*` that plain training
   completes, and the micro-batch size the guard settles on for several
   data batches `B`.

Prints Markdown tables; `--json` also writes every raw measurement.
"""

import json
import os
import sys

CHILD = len(sys.argv) > 2 and sys.argv[1] == "--child"
if not CHILD:
    # Before TensorFlow is imported: read once per process. Children get
    # their cap from the parent (keras_memguard.testing.memory_cap_env).
    os.environ.update(
        {
            "TF_CPU_ALLOCATOR_USE_BFC": "true",
            "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8192",
            "TF_ENABLE_ONEDNN_OPTS": "0",
            "TF_CPP_MIN_LOG_LEVEL": "2",
        }
    )
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import argparse  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

MIB = 2**20
CAP_MIB = 600
CLASSES = 10

# The model the project's memory facts were measured on (DESIGN.md).
DESIGN_CNN_SHAPE = (64, 64, 3)
SMALL_CNN_SHAPE = (32, 32, 3)
MLP_FEATURES = 512
# A large-output model: a narrow U-Net whose per-pixel logits (64x64x8)
# outweigh its activations.
UNET_SHAPE = (64, 64, 3)
UNET_CLASSES = 8


# --------------------------------------------------------------------------
# Models, data, callbacks (TensorFlow imported lazily: children set the cap).


def _tf():
    import tensorflow as tf

    return tf


def build_unet():
    """The narrow U-Net: 64x64x3 in, 64x64x8 per-pixel logits out."""
    import keras

    layers = keras.layers
    inputs = keras.Input(UNET_SHAPE)
    c1 = layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    p1 = layers.MaxPooling2D()(c1)
    c2 = layers.Conv2D(8, 3, padding="same", activation="relu")(p1)
    u1 = layers.Concatenate()([layers.UpSampling2D()(c2), c1])
    c3 = layers.Conv2D(4, 3, padding="same", activation="relu")(u1)
    outputs = layers.Conv2D(UNET_CLASSES, 1)(c3)  # per-pixel logits
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_model(kind, gradient_accumulation_steps=None):
    """Builds and compiles one of the benchmark models, seeded alike."""
    import keras

    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "unet":
        assert not gradient_accumulation_steps
        return build_unet()
    if kind == "design_cnn":
        body = [
            keras.Input(DESIGN_CNN_SHAPE),
            layers.Conv2D(64, 3, activation="relu"),
            layers.Conv2D(64, 3, activation="relu"),
            layers.GlobalAveragePooling2D(),
        ]
    elif kind == "small_cnn":
        body = [
            keras.Input(SMALL_CNN_SHAPE),
            layers.Conv2D(16, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(32, 3, activation="relu"),
            layers.GlobalAveragePooling2D(),
        ]
    elif kind == "mlp":
        body = [keras.Input((MLP_FEATURES,)), layers.Dense(512, activation="relu")]
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model = keras.Sequential(body + [layers.Dense(CLASSES)])
    if gradient_accumulation_steps:
        optimizer = keras.optimizers.Adam(
            gradient_accumulation_steps=gradient_accumulation_steps
        )
    else:
        optimizer = keras.optimizers.Adam()
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def input_shape(kind):
    return {
        "design_cnn": DESIGN_CNN_SHAPE,
        "small_cnn": SMALL_CNN_SHAPE,
        "mlp": (MLP_FEATURES,),
        "unet": UNET_SHAPE,
    }[kind]


def label_shape(kind):
    """A sample's label shape and class count."""
    if kind == "unet":
        return UNET_SHAPE[:2], UNET_CLASSES
    return (), CLASSES


def generated_dataset(kind, batch, batches):
    """`batches` batches of `batch` samples, generated inside tf.data.

    The allocator then holds one input batch at a time (no copy of a whole
    dataset, no prefetched batch), the same for every variant.
    """
    tf = _tf()
    shape = input_shape(kind)
    y_shape, classes = label_shape(kind)

    def make(i):
        seed = tf.stack([tf.cast(i, tf.int32), 0])
        x = tf.random.stateless_uniform((batch,) + shape, seed=seed)
        y = tf.random.stateless_uniform(
            (batch,) + y_shape, seed=seed + 1, minval=0, maxval=classes,
            dtype=tf.int32,
        )
        return x, y

    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return tf.data.Dataset.range(batches).map(make).with_options(options)


def fixed_guard(k):
    """A MemoryGuard pinned at `k` micro-batches (see the module docstring)."""
    from keras_memguard import MemoryGuard

    return MemoryGuard(memory_limit=2**40, cooldown=10**9, plan=False, micro_batches=k)


def step_peak_callback(guard=None):
    """Records, per batch, the allocator peak and `current` at batch begin.

    Put it before the guard in the callback list. The guard reads (and
    resets) the allocator peak inside the train function, through the
    model's logs carrier, before any `on_train_batch_end`; so this callback
    reads the peak there too, as the carrier's first contributor, right
    after the train function: the same point for guarded and plain
    training. `ks` is the `k` the batch completed at.
    """
    import keras

    from keras_memguard.callbacks import logs_carrier

    tf = _tf()

    class StepPeaks(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.peaks, self.currents, self.ks = [], [], []
            self._read = False

        def on_train_begin(self, logs=None):
            logs_carrier.attach(self.model, self, self._contribute, self.params)

        def on_train_end(self, logs=None):
            logs_carrier.detach(self.model, self)

        def _contribute(self, logs):
            self.peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            self._read = True

        def on_train_batch_begin(self, batch, logs=None):
            self._current = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            self._read = False

        def on_train_batch_end(self, batch, logs=None):
            assert self._read, "the peak was not read after the train function"
            self.currents.append(self._current)
            run = guard._run if guard is not None else None
            if run is not None and run.function is not None:
                self.ks.append(run.function.micro_batches)

    return StepPeaks()


def batch_timer_callback():
    import keras

    class BatchTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.begin, self.end = [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.begin.append(time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            self.end.append(time.perf_counter())

    return BatchTimer()


# --------------------------------------------------------------------------
# Child processes.


def run_child(task, cap_mib, timeout=300):
    """Runs `task` in a new process under a `cap_mib` MiB allocator cap."""
    from keras_memguard.testing import run_script_with_memory_cap

    start = time.perf_counter()
    completed = run_script_with_memory_cap(
        [os.path.abspath(__file__), "--child", json.dumps(task)],
        cap_mib, timeout=timeout, check=False,
    )
    wall = time.perf_counter() - start
    result = completed.result
    if result is None:
        raise RuntimeError(
            f"child {task} exited with {completed.returncode} and no result:\n"
            f"{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}"
        )
    result["process_wall_s"] = wall
    return result


def child_main(task):
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    tf = _tf()
    import keras  # noqa: F401

    import_s = time.perf_counter() - start
    handler = {
        "peaks": child_peaks,
        "recovery": child_recovery,
        "plain_fits": child_plain_fits,
        "guard_settles": child_guard_settles,
    }[task["part"]]
    result = handler(task, tf)
    result["import_s"] = import_s
    from keras_memguard.testing import emit_result

    emit_result(result)


def child_peaks(task, tf):
    """Part 2: per-step peaks of guard at k (batch B) and plain at B / k."""
    import keras

    if task.get("inter_op_threads"):
        # One inter-op thread: the same op schedule, so the same peak, in
        # every step and process (with more, independent ops overlap in
        # varying order and a step's peak moves by whole tensors).
        tf.config.threading.set_inter_op_parallelism_threads(task["inter_op_threads"])
    plan = [
        (kind, batch, k, variant)
        for kind, batch, ks in task["models"]
        for k in ks
        # "guard1": the guard at k = 1 fed B / k, the same input as plain:
        # what the guard's path costs apart from micro-batching.
        for variant in (("guard", "plain") if k == 1 else ("guard", "guard1", "plain"))
    ]
    if task["reverse"]:
        plan.reverse()
    rows = []
    for kind, batch, k, variant in plan:
        fed = batch if variant == "guard" else batch // k
        model = build_model(kind)
        callbacks = []
        guard = None
        if variant.startswith("guard"):
            guard_k = k if variant == "guard" else 1
            guard = fixed_guard(guard_k)
            callbacks = [guard]
        model.fit(
            generated_dataset(kind, fed, 1), verbose=0, callbacks=callbacks
        )  # warm-up: traces the step
        peaks = step_peak_callback(guard)
        model.fit(
            generated_dataset(kind, fed, task["steps"]),
            verbose=0,
            callbacks=[peaks] + callbacks,
        )
        if guard is not None:
            assert guard.micro_batches == guard_k and guard.oom_recoveries == 0
            assert set(peaks.ks) == {guard_k}, peaks.ks
        rows.append(
            {
                "kind": kind,
                "batch": batch,
                "k": k,
                "variant": variant,
                "batch_fed": fed,
                "peaks": peaks.peaks,
                "currents": peaks.currents,
            }
        )
        del model, guard, peaks, callbacks
        gc.collect()
        keras.backend.clear_session()
        gc.collect()

    return {"rows": rows}


def child_recovery(task, tf):
    """Part 3: one guarded epoch under the cap, starting at `start_k`."""
    from keras_memguard import MemoryGuard
    from keras_memguard.backends.tensorflow.run import TfTrainingRun
    from keras_memguard.backends.tensorflow.step import step_function

    kind, batch = "design_cnn", task["batch"]
    model = build_model(kind)
    dataset = generated_dataset(kind, batch, task["batches"])
    spec = dataset.element_spec
    trace_s = {}
    functions = {}
    for k in task["trace_ks"]:
        # `make_step_function` wraps the tf.function with functools.wraps
        # (Keras' `_autoconvert_optionals`).
        function = step_function(model, k, "accumulate").__wrapped__
        start = time.perf_counter()
        function.get_concrete_function(spec)
        trace_s[k] = time.perf_counter() - start
        functions[k] = function
    traces_before = {k: f.experimental_get_tracing_count() for k, f in functions.items()}

    # Limit from the cap (TF_CPU_BFC_MEM_LIMIT_IN_MB); reacting from start_k.
    guard = MemoryGuard(plan=False, micro_batches=task["start_k"])
    events = []
    # The run made at train begin hands its bound method to the train
    # function then: timed on the class, for this fit only.
    original = TfTrainingRun.on_out_of_memory

    def timed_on_out_of_memory(run, batch_size, micro_batches, error):
        entered = time.perf_counter()
        new_k = original(run, batch_size, micro_batches, error)
        events.append([entered, time.perf_counter(), micro_batches, new_k])
        return new_k

    TfTrainingRun.on_out_of_memory = timed_on_out_of_memory
    timer = batch_timer_callback()
    peaks = step_peak_callback(guard)
    start = time.perf_counter()
    try:
        model.fit(dataset, verbose=0, callbacks=[timer, peaks, guard])
    finally:
        TfTrainingRun.on_out_of_memory = original
    fit_s = time.perf_counter() - start
    traces_after = {k: f.experimental_get_tracing_count() for k, f in functions.items()}
    return {
        "start_k": task["start_k"],
        "fit_s": fit_s,
        "fit_start": start,
        "batch_begin": timer.begin,
        "batch_end": timer.end,
        "oom_events": events,
        "trace_s": trace_s,
        "retraced": {k: traces_after[k] - traces_before[k] for k in functions},
        "final_k": guard.micro_batches,
        "oom_recoveries": guard.oom_recoveries,
        "ks": peaks.ks,
        "peaks": peaks.peaks,
    }


def child_plain_fits(task, tf):
    """Part 4: does plain training at `batch` complete under the cap?"""
    kind, batch = "design_cnn", task["batch"]
    model = build_model(kind)
    peaks = step_peak_callback()
    try:
        model.fit(
            generated_dataset(kind, batch, task["batches"]),
            verbose=0,
            callbacks=[peaks],
        )
    except tf.errors.ResourceExhaustedError as error:
        return {"batch": batch, "ok": False, "error": str(error).splitlines()[0][:200]}
    return {"batch": batch, "ok": True, "peaks": peaks.peaks}


def child_guard_settles(task, tf):
    """Part 4: the micro-batch size the guard settles on at data batch B."""
    from keras_memguard import MemoryGuard

    kind, batch = "design_cnn", task["batch"]
    model = build_model(kind)
    # Default threshold 0.9, limit from the cap; reacting from start_k.
    guard = MemoryGuard(plan=False, micro_batches=task["start_k"])
    peaks = step_peak_callback(guard)
    error = None
    try:
        model.fit(
            generated_dataset(kind, batch, task["batches"]),
            verbose=0,
            callbacks=[peaks, guard],
        )
    except Exception as e:  # reported, not hidden
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return {
        "batch": batch,
        "start_k": task["start_k"],
        "ks": peaks.ks,
        "peaks": peaks.peaks,
        "final_k": guard.micro_batches,
        "oom_recoveries": guard.oom_recoveries,
        "error": error,
    }


# --------------------------------------------------------------------------
# Part 1: throughput.


def part_throughput(kind, batch, ks, samples, rounds, report):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((samples,) + input_shape(kind), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(samples,))

    variants = {}  # name -> (model, batch fed, callbacks factory, guard k)
    variants[f"plain B={batch}"] = (build_model(kind), batch, None, None)
    for k in [1] + list(ks):
        variants[f"guard k={k}, B={batch}"] = (build_model(kind), batch, fixed_guard(k), k)
        if k == 1:
            continue
        variants[f"keras GA k={k}, B={batch // k}"] = (
            build_model(kind, gradient_accumulation_steps=k), batch // k, None, None,
        )
        variants[f"plain B={batch // k}"] = (build_model(kind), batch // k, None, None)
    names = list(variants)
    walls = {name: [] for name in names}
    cpus = {name: [] for name in names}
    updates = {}

    def fit(name):
        model, fed, guard, k = variants[name]
        before = int(model.optimizer.iterations.numpy())
        start, start_cpu = time.perf_counter(), time.process_time()
        model.fit(
            x, y, batch_size=fed, epochs=1, verbose=0, shuffle=False,
            callbacks=[guard] if guard is not None else [],
        )
        wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        if guard is not None:
            assert guard.micro_batches == k and guard.oom_recoveries == 0, name
        updates[name] = int(model.optimizer.iterations.numpy()) - before
        return wall, cpu

    for name in names:  # warm-up: tracing
        fit(name)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            wall, cpu = fit(name)
            walls[name].append(wall)
            cpus[name].append(cpu)

    # The guard's compiled steps: one per k, none other.
    from keras_memguard.backends.tensorflow.step import _CACHE_ATTR

    for name, (model, _, guard, k) in variants.items():
        if guard is not None:
            functions = model.__dict__[_CACHE_ATTR][1]
            steps = {key[:3] for key in functions if key[0] == "train"}
            assert steps == {("train", k, "accumulate")}, (name, sorted(functions))

    med = {n: statistics.median(v) for n, v in walls.items()}
    cpu_med = {n: statistics.median(v) for n, v in cpus.items()}
    rows = []
    for name in names:
        _, fed, _, _ = variants[name]
        rows.append(
            {
                "variant": name,
                "batch_fed": fed,
                "steps": samples // fed,
                "updates": updates[name],
                "median_s": med[name],
                "min_s": min(walls[name]),
                "max_s": max(walls[name]),
                "cpu_s": cpu_med[name],
            }
        )
    comparisons = []
    for k in ks:
        guard = f"guard k={k}, B={batch}"
        for other in (
            f"keras GA k={k}, B={batch // k}",
            f"plain B={batch // k}",
            f"plain B={batch}",
        ):
            paired = statistics.median(g / o for g, o in zip(walls[guard], walls[other]))
            comparisons.append(
                {
                    "k": k,
                    "against": other,
                    "ratio_of_medians": med[guard] / med[other],
                    "ratio_of_minimums": min(walls[guard]) / min(walls[other]),
                    "median_paired_ratio": paired,
                    "cpu_ratio": cpu_med[guard] / cpu_med[other],
                }
            )
    guard1 = f"guard k=1, B={batch}"
    plain = f"plain B={batch}"
    comparisons.append(
        {
            "k": 1,
            "against": plain,
            "ratio_of_medians": med[guard1] / med[plain],
            "ratio_of_minimums": min(walls[guard1]) / min(walls[plain]),
            "median_paired_ratio": statistics.median(
                g / o for g, o in zip(walls[guard1], walls[plain])
            ),
            "cpu_ratio": cpu_med[guard1] / cpu_med[plain],
        }
    )
    result = {
        "kind": kind,
        "batch": batch,
        "samples": samples,
        "rounds": rounds,
        "rows": rows,
        "comparisons": comparisons,
        "walls": walls,
        "cpus": cpus,
    }
    report.append(result)
    del variants
    gc.collect()
    return result


def print_throughput(result):
    kind, batch = result["kind"], result["batch"]
    print(f"\n#### Throughput: {kind}, B={batch}, {result['samples']} samples "
          f"per fit, {result['rounds']} rounds\n")
    print("| Variant | batch fed | steps/fit | updates/fit | median fit (s) "
          "| per update (ms) | min..max (s) | median CPU (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        print(f"| {row['variant']} | {row['batch_fed']} | {row['steps']} "
              f"| {row['updates']} | {row['median_s']:.3f} "
              f"| {row['median_s'] / row['updates'] * 1e3:.1f} "
              f"| {row['min_s']:.3f}..{row['max_s']:.3f} | {row['cpu_s']:.3f} |")
    print()
    print("| guard at k, B | against | wall: ratio of medians | wall: median "
          "per-round ratio | wall: ratio of fastest fits | CPU: ratio of medians |")
    print("|---|---|---:|---:|---:|---:|")
    for c in result["comparisons"]:
        print(f"| k={c['k']}, B={batch} | {c['against']} "
              f"| {c['ratio_of_medians']:.3f}x | {c['median_paired_ratio']:.3f}x "
              f"| {c['ratio_of_minimums']:.3f}x | {c['cpu_ratio']:.3f}x |")


# --------------------------------------------------------------------------
# Part 2: peaks.


def part_peaks(models, steps, inter_op_threads, report):
    """`models`: `(kind, B, ks)` triples, all measured in each child."""
    runs = [
        run_child(
            {"part": "peaks", "models": models, "steps": steps,
             "inter_op_threads": inter_op_threads, "reverse": reverse},
            cap_mib=8192,
            timeout=500,
        )
        for reverse in (False, True)
    ]
    report.append({"part": "peaks", "inter_op_threads": inter_op_threads,
                   "runs": runs})

    def peak(kind, batch, k, variant):
        # Per child: the median over its measured steps; then over children.
        values = [
            statistics.median(r["peaks"]) / MIB
            for run in runs
            for r in run["rows"]
            if (r["kind"], r["batch"], r["k"], r["variant"])
            == (kind, batch, k, variant)
        ]
        return statistics.median(values), min(values), max(values)

    threads = inter_op_threads or "TensorFlow's default"
    print(f"\n#### Per-step allocator peak: {len(runs)} child processes (variant "
          f"order forward, then reversed), each the median of {steps} steps "
          f"after a warm-up fit; inter-op threads: {threads}\n")
    print("| model | B | k | guard: k micro-batches of B (MiB) | plain at B/k (MiB) "
          "| guard / plain | guard at k=1 fed B/k (MiB) | input batch B - B/k, "
          "x and y (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, batch, ks in models:
        y_shape, _ = label_shape(kind)
        sample_mib = 4 * (math.prod(input_shape(kind)) + math.prod(y_shape)) / MIB
        for k in ks:
            g, g_lo, g_hi = peak(kind, batch, k, "guard")
            p, p_lo, p_hi = peak(kind, batch, k, "plain")
            g1 = "-"
            if k > 1:
                g1 = "{:.1f} ({:.1f}..{:.1f})".format(*peak(kind, batch, k, "guard1"))
            print(f"| {kind} | {batch} | {k} | {g:.1f} ({g_lo:.1f}..{g_hi:.1f}) "
                  f"| {p:.1f} ({p_lo:.1f}..{p_hi:.1f}) at {batch // k} "
                  f"| {g / p:.3f}x | {g1} "
                  f"| {(batch - batch // k) * sample_mib:.1f} |")
    return runs


# --------------------------------------------------------------------------
# Part 3: one OOM recovery.


def part_recovery(batch, batches, repeats, report):
    runs = []
    for r in range(repeats):
        for start_k, trace_ks in ((1, [1, 2]), (2, [2])):
            run = run_child(
                {
                    "part": "recovery",
                    "batch": batch,
                    "batches": batches,
                    "start_k": start_k,
                    "trace_ks": trace_ks,
                },
                cap_mib=CAP_MIB,
                timeout=300,
            )
            run["repeat"] = r
            runs.append(run)
    report.append({"part": "recovery", "runs": runs})
    print(f"\n#### One OOM recovery: design_cnn, B={batch}, {batches} batches per "
          f"epoch, {CAP_MIB} MiB cap, steps traced before fit\n")
    print("| start k | run | fit (s) | batch 1 (s) | failed k=1 attempt (s) "
          "| handler (ms) | replay of batch 1 at k=2 (s) | later batches (s) "
          "| k per batch | OOMs | retraces in fit | trace k=1 / k=2 (s) "
          "| batch peaks (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|---|")
    for run in runs:
        begin, end = run["batch_begin"], run["batch_end"]
        failed = handler = replay = None
        if run["oom_events"]:
            entered, left, _, _ = run["oom_events"][0]
            failed = entered - begin[0]
            handler = (left - entered) * 1e3
            replay = end[0] - left
        later = ", ".join(f"{e - b:.2f}" for b, e in zip(begin[1:], end[1:]))
        trace = " / ".join(
            f"{run['trace_s'][str(k)]:.2f}" if str(k) in run["trace_s"] else "-"
            for k in (1, 2)
        )
        print(f"| {run['start_k']} | {run['repeat'] + 1} | {run['fit_s']:.2f} "
              f"| {end[0] - begin[0]:.2f} "
              f"| {'-' if failed is None else f'{failed:.2f}'} "
              f"| {'-' if handler is None else f'{handler:.1f}'} "
              f"| {'-' if replay is None else f'{replay:.2f}'} | {later} "
              f"| {run['ks']} | {run['oom_recoveries']} | {run['retraced']} "
              f"| {trace} | {', '.join(f'{p / MIB:.0f}' for p in run['peaks'])} |")
    def med(start_k, value):
        return statistics.median(value(r) for r in runs if r["start_k"] == start_k)

    def first(r):
        return r["batch_end"][0] - r["batch_begin"][0]

    def later(r):
        return statistics.median(
            e - b for b, e in zip(r["batch_begin"][1:], r["batch_end"][1:])
        )

    failed = statistics.median(
        r["oom_events"][0][0] - r["batch_begin"][0] for r in runs if r["oom_events"]
    )
    print(f"\nmedians over {repeats} runs each: fit {med(1, lambda r: r['fit_s']):.2f} s "
          f"(start k=1) vs {med(2, lambda r: r['fit_s']):.2f} s (start k=2); "
          f"batch 1 {med(1, first):.2f} s vs {med(2, first):.2f} s, difference "
          f"{med(1, first) - med(2, first):.2f} s; failed k=1 attempt {failed:.2f} s; "
          f"later batches {med(1, later):.2f} s vs {med(2, later):.2f} s")
    return runs


# --------------------------------------------------------------------------
# Part 4: largest batch.


def part_largest_batch(batches, report):
    scan = {}

    def plain(b):
        if b not in scan:
            run = run_child(
                {"part": "plain_fits", "batch": b, "batches": batches},
                cap_mib=CAP_MIB,
                timeout=300,
            )
            scan[b] = run
            peak = f"{max(run['peaks']) / MIB:.1f} MiB" if run["ok"] else "OOM"
            print(f"  plain batch {b}: {peak} ({run['process_wall_s']:.1f} s)", flush=True)
        return scan[b]

    threshold_bytes = 0.9 * CAP_MIB * MIB

    def below_threshold(b):
        run = plain(b)
        return run["ok"] and max(run["peaks"]) < threshold_bytes

    # Coarse: step 32 up to the first failure.
    b = 32
    while plain(b)["ok"] and b < 1024:
        b += 32
    first_fail = b
    # Every point of the bracket on a grid of 8, then of 2.
    for step in (8, 2):
        last_ok = max(c for c, r in scan.items() if r["ok"] and c < first_fail)
        for c in range(last_ok + step, first_fail, step):
            plain(c)
        first_fail = min(c for c, r in scan.items() if not r["ok"])
    # Where the plain peak crosses the guard's threshold (0.9 x cap): grid of
    # 8 between the coarse points around it (no OOM there, cheap).
    under = max(c for c in scan if below_threshold(c))
    above = min(c for c in scan if c > under and not below_threshold(c))
    for c in range(under + 8, above, 8):
        plain(c)
    oks = sorted(c for c, r in scan.items() if r["ok"])
    fails = sorted(c for c, r in scan.items() if not r["ok"])
    b_star = max(oks)
    b_09 = max(c for c in scan if below_threshold(c))
    monotone = all(c < min(fails) for c in oks) if fails else True

    print(f"\n#### Largest batch under a {CAP_MIB} MiB cap: design_cnn, plain "
          f"training, {batches} steps, one process per candidate\n")
    print("| batch | completes | per-step peak (max, MiB) | peak / cap |")
    print("|---:|---|---:|---:|")
    for c in sorted(scan):
        r = scan[c]
        if r["ok"]:
            p = max(r["peaks"]) / MIB
            print(f"| {c} | yes | {p:.1f} | {p / CAP_MIB:.1%} |")
        else:
            print(f"| {c} | OOM | - | - |")
    print(f"\nB* (largest completing) = {b_star}; largest with peak < 90% of the "
          f"cap = {b_09}; monotone: {monotone}")

    guarded = []
    plans = [(1024, 1), (2 * b_09, 1), (3 * b_09, 1), (3 * b_09, 3)]
    for big, start_k in plans:
        run = run_child(
            {"part": "guard_settles", "batch": big, "batches": batches,
             "start_k": start_k},
            cap_mib=CAP_MIB,
            timeout=400,
        )
        guarded.append(run)
        print(f"  guard B={big} from k={start_k}: ks {run['ks']} "
              f"({run['process_wall_s']:.1f} s)", flush=True)
    print(f"\n#### Micro-batch the guard settles on ({CAP_MIB} MiB cap, threshold "
          f"0.9, {batches} batches)\n")
    print("| data batch B | start k | k per batch | OOM recoveries | settled "
          "micro-batch ceil(B/k) | peak at settled k (MiB) | / B* | / largest "
          "below 90% | error |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for run in guarded:
        if run["ks"]:
            micro = -(-run["batch"] // run["ks"][-1])
            peak = f"{run['peaks'][-1] / MIB:.1f}"
            frac = f"{micro / b_star:.3f}"
            frac09 = f"{micro / b_09:.3f}"
        else:
            micro, peak, frac, frac09 = "-", "-", "-", "-"
        print(f"| {run['batch']} | {run['start_k']} | {run['ks']} "
              f"| {run['oom_recoveries']} | {micro} | {peak} | {frac} | {frac09} "
              f"| {run['error'] or ''} |")
    report.append(
        {"part": "largest_batch", "scan": scan, "b_star": b_star, "b_09": b_09,
         "monotone": monotone, "guarded": guarded}
    )


# --------------------------------------------------------------------------


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def code_version():
    """The commit measured, and whether the package had uncommitted edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root,
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "keras_memguard"], cwd=root,
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' with uncommitted changes in keras_memguard/' if dirty else ''}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1,2,3,4")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--ks", default="2,4,8", help="k values of part 1")
    parser.add_argument("--peak-steps", type=int, default=3,
                        help="measured steps per variant in part 2")
    parser.add_argument("--peak-threads", type=int, default=1,
                        help="inter-op threads of part 2's children "
                        "(0: TensorFlow's default)")
    parser.add_argument("--peak-models", default="design_cnn,small_cnn,unet",
                        help="models of part 2")
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    ks = [int(k) for k in args.ks.split(",")]
    warnings.simplefilter("ignore")  # NVML is absent without a GPU driver

    import keras
    import tensorflow as tf

    started = time.time()
    print(f"Python {platform.python_version()}, TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}; {os.cpu_count()} CPU cores ({cpu_model()}); "
          f"no GPU: {not tf.config.list_physical_devices('GPU')}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"code: {code_version()}", flush=True)
    report = []
    if 1 in parts:
        for kind, samples in (("small_cnn", 256 * 8), ("mlp", 256 * 40)):
            print_throughput(part_throughput(kind, 256, ks, samples, args.rounds, report))
            sys.stdout.flush()
    if 2 in parts:
        configs = {
            "design_cnn": ("design_cnn", 256, [1, 2, 4, 8]),
            "small_cnn": ("small_cnn", 256, [1, 2, 4, 8]),
            # The large-output model: k=4 of batch 64 against plain at 16.
            "unet": ("unet", 64, [1, 4]),
        }
        models = [configs[m] for m in args.peak_models.split(",")]
        part_peaks(models, args.peak_steps, args.peak_threads, report)
        sys.stdout.flush()
    if 3 in parts:
        part_recovery(256, 3, 3, report)
        sys.stdout.flush()
    if 4 in parts:
        part_largest_batch(2, report)
    print(f"\ntotal {time.time() - started:.0f} s; load average "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    if CHILD:
        child_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
