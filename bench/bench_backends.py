"""MemoryGuard on every Keras backend: per-batch cost, accumulation, planning.

One harness for Keras' TensorFlow, JAX and PyTorch backends; the backend is
the one `KERAS_BACKEND` names (read once, at import, as Keras does), so run
it once per backend, each in its own environment, from the repository root:

    python3 bench/bench_backends.py                                 # TensorFlow
    KERAS_BACKEND=jax /tmp/jaxenv/bin/python bench/bench_backends.py
    KERAS_BACKEND=torch /tmp/torchenv/bin/python bench/bench_backends.py
    ... --rounds 9 --models mlp --parts 1,2 --json /tmp/out.json
    ... --smoke                          # a few seconds: the MLP, one round

About 2 to 4 minutes per backend on 2 shared CPU cores with the defaults.
The same two small models on every backend, fed numpy arrays, trained with
Adam (`shuffle=False`, one model per variant, built and seeded alike): an
MLP 512-512-10 and a small CNN (32x32x3, conv 16, max-pool, conv 32, global
average pool, dense 10), at a data batch of B=256.

1. Per-batch cost, and 2. accumulation: one set of variants per model, all
   fed the same samples per fit, interleaved in one process, the order
   rotated each round, one warm-up fit each (compiles, plans) and then
   `--rounds` timed fits; medians, and the median of per-round ratios:
   - `plain B`: `fit` at B, no callback;
   - `no-op batch callback`: a callback that overrides
     `on_train_batch_end` and does nothing (any batch-level callback makes
     Keras hand the step's logs to Python every batch: Keras' own cost);
   - `MemoryMonitor`: `MemoryMonitor(log_dir=tmp, nvml=False,
     memory_limit=2**40)`, every batch written;
   - `guard k=1 (plan)`: `MemoryGuard(memory_limit=2**40,
     plan_cache=False)`, planning each batch as users get it; with that
     limit it settles at k=1 in the warm-up fit;
   - `guard k=1 (fixed)` and `guard k=4`: `MemoryGuard(memory_limit=2**40,
     cooldown=10**9, plan=False, micro_batches=k)`, so k stays where it
     starts (as `bench_guard.py` part 1);
   - `keras GA k=4, B/4`: `Adam(gradient_accumulation_steps=4)` fed B/4;
   - `plain B/4`: `fit` at B/4 (four times the updates).
   After every fit each guard must be at its k with no out-of-memory
   recovery and the optimizer must have stepped once per batch; in the
   warm-up fit and one untimed fit after the rounds, every batch's
   `micro_batches` log must be the expected k (so none was replayed or
   planned elsewhere).
3. The first batch's planning cost: a fresh model with a fresh planning
   guard (`memory_limit=2**40, plan_cache=False`) against a fresh plain
   model, `--first-repeats` pairs, alternating which goes first; the time
   from `on_train_begin` to the end of batch 0 (Keras' own compiling or
   tracing is in both), the median later batch, and the k batch 0 ran at
   and the one the guard ended at. On JAX the guard compiles the step and
   reads its memory analyses; on torch (eager) and TensorFlow without XLA
   it runs the first batch at the cautious split of 8 and plans from it.

On TensorFlow the process runs under the BFC CPU allocator (8 GiB cap) with
oneDNN off, as `bench_guard.py`; on torch the CPU probe reads
`/proc/self/status` each batch. Prints Markdown tables; `--json` also writes
every raw measurement.
"""

import os
import sys

BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")
if BACKEND == "tensorflow":
    # Before TensorFlow is imported: read once per process.
    for key, value in {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8192",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }.items():
        os.environ.setdefault(key, value)

# The checkout this file is in, not another installed copy.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_memguard  # noqa: E402

CLASSES = 10
BIG = 2**40  # a limit no batch here comes near: the guard settles at k=1
SHAPES = {"mlp": (512,), "cnn": (32, 32, 3)}


# --------------------------------------------------------------------------
# Models and callbacks.


def build_model(kind, gradient_accumulation_steps=None):
    """One of the two benchmark models, compiled, seeded alike."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    if kind == "mlp":
        body = [keras.Input(SHAPES[kind]), layers.Dense(512, activation="relu")]
    elif kind == "cnn":
        body = [
            keras.Input(SHAPES[kind]),
            layers.Conv2D(16, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(32, 3, activation="relu"),
            layers.GlobalAveragePooling2D(),
        ]
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    model = keras.Sequential(body + [layers.Dense(CLASSES)])
    optimizer = (
        keras.optimizers.Adam(gradient_accumulation_steps=gradient_accumulation_steps)
        if gradient_accumulation_steps
        else keras.optimizers.Adam()
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fixed_guard(k):
    """A guard pinned at `k` micro-batches (as `bench_guard.fixed_guard`)."""
    return keras_memguard.MemoryGuard(
        memory_limit=BIG, cooldown=10**9, plan=False, micro_batches=k, plan_cache=False
    )


def planning_guard():
    # No plan cache: every run starts from nothing, whatever ran before.
    return keras_memguard.MemoryGuard(memory_limit=BIG, plan_cache=False)


class NoOpBatchCallback(keras.callbacks.Callback):
    """Overrides the batch hook and does nothing: Keras' own per-batch cost."""

    def on_train_batch_end(self, batch, logs=None):
        pass


class BatchLog(keras.callbacks.Callback):
    """Each batch's `micro_batches` log and end time; the fit's start time.

    Put first in the callback list, so its `on_train_begin` runs before
    the guard's.
    """

    def __init__(self):
        super().__init__()
        self.ks, self.ends = [], []
        self.begin = None

    def on_train_begin(self, logs=None):
        self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())
        self.ks.append((logs or {}).get("micro_batches"))


def iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


# --------------------------------------------------------------------------
# Parts 1 and 2: one interleaved set of variants per model.


def make_variants(kind, batch, k, log_dir):
    """name -> dict(model, batch fed, callbacks, guard, expected k)."""
    small = batch // k
    monitor = keras_memguard.MemoryMonitor(log_dir=log_dir, nvml=False, memory_limit=BIG)
    specs = [
        (f"plain B={batch}", build_model(kind), batch, [], None, None),
        ("no-op batch callback", build_model(kind), batch, [NoOpBatchCallback()], None, None),
        ("MemoryMonitor", build_model(kind), batch, [monitor], None, None),
    ]
    guard = planning_guard()
    specs.append(("guard k=1 (plan)", build_model(kind), batch, [guard], guard, 1))
    guard = fixed_guard(1)
    specs.append(("guard k=1 (fixed)", build_model(kind), batch, [guard], guard, 1))
    guard = fixed_guard(k)
    specs.append((f"guard k={k}, B={batch}", build_model(kind), batch, [guard], guard, k))
    specs.append((f"keras GA k={k}, B={small}",
                  build_model(kind, gradient_accumulation_steps=k), small, [], None, None))
    specs.append((f"plain B={small}", build_model(kind), small, [], None, None))
    return {
        name: dict(model=model, fed=fed, callbacks=callbacks, guard=guard, k=expected,
                   update_batch=batch if name.startswith("keras GA") else fed)
        for name, model, fed, callbacks, guard, expected in specs
    }


def fit_once(variant, x, y, check_batches=False):
    """Wall and CPU seconds of one fit; checks k, replays and updates."""
    model, fed, guard = variant["model"], variant["fed"], variant["guard"]
    callbacks = list(variant["callbacks"])
    log = None
    if check_batches:
        log = BatchLog()
        callbacks.insert(0, log)
    before = iterations(model)
    start, start_cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=fed, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    # One update per batch of the data (Keras' accumulation counts updates,
    # one per `k` batches it is fed): no batch skipped or applied twice.
    updates = len(x) // variant["update_batch"]
    assert iterations(model) - before == updates, (iterations(model) - before, updates)
    if guard is not None:
        k = variant["k"]
        assert guard.micro_batches == k, (guard.micro_batches, k)
        assert guard.oom_recoveries == 0, guard.oom_recoveries
        if log is not None and variant.get("settled"):
            assert log.ks == [k] * (len(x) // fed), log.ks
    return wall, cpu


def part_variants(kind, batch, k, samples, rounds, report):
    rng = np.random.default_rng(0)
    x = rng.random((samples,) + SHAPES[kind], dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(samples,))
    with tempfile.TemporaryDirectory() as log_dir:
        variants = make_variants(kind, batch, k, log_dir)
        names = list(variants)
        for name in names:  # warm-up: compiles, traces, plans
            fit_once(variants[name], x, y, check_batches=True)
            variants[name]["settled"] = True
        walls = {name: [] for name in names}
        cpus = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                wall, cpu = fit_once(variants[name], x, y)
                walls[name].append(wall)
                cpus[name].append(cpu)
        for name in names:  # untimed: every batch at its k, none replayed
            fit_once(variants[name], x, y, check_batches=True)
        feds = {name: variants[name]["fed"] for name in names}
        update_batches = {name: variants[name]["update_batch"] for name in names}
        del variants
        gc.collect()
    result = {"kind": kind, "batch": batch, "k": k, "samples": samples,
              "rounds": rounds, "feds": feds,
              "update_batches": update_batches, "walls": walls, "cpus": cpus}
    report.append(result)
    return result


def median_ratio(a, b):
    return statistics.median(x / y for x, y in zip(a, b))


def print_overhead(result):
    kind, batch = result["kind"], result["batch"]
    walls, cpus = result["walls"], result["cpus"]
    steps = result["samples"] // batch
    plain = f"plain B={batch}"
    base, base_cpu = statistics.median(walls[plain]), statistics.median(cpus[plain])
    print(f"\n#### {BACKEND}: per-batch cost, {kind}, B={batch}, {steps} batches a fit, "
          f"{result['rounds']} rounds\n")
    print("| variant | median fit (s) | per batch (ms) | extra per batch (us) "
          "| wall: ratio of medians | wall: median per-round ratio | CPU: ratio of medians |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in (plain, "no-op batch callback", "MemoryMonitor", "guard k=1 (plan)",
                 "guard k=1 (fixed)"):
        med = statistics.median(walls[name])
        print(f"| {name} | {med:.3f} | {med / steps * 1e3:.2f} "
              f"| {(med - base) / steps * 1e6:+.0f} | {med / base:.3f}x "
              f"| {median_ratio(walls[name], walls[plain]):.3f}x "
              f"| {statistics.median(cpus[name]) / base_cpu:.3f}x |")


def print_accumulation(result):
    kind, batch, k = result["kind"], result["batch"], result["k"]
    walls, cpus = result["walls"], result["cpus"]
    small = batch // k
    guard = f"guard k={k}, B={batch}"
    names = [guard, f"keras GA k={k}, B={small}", f"plain B={small}", f"plain B={batch}",
             "guard k=1 (fixed)"]
    print(f"\n#### {BACKEND}: the guard at k={k} against Keras' accumulation, {kind}, "
          f"{result['samples']} samples a fit, {result['rounds']} rounds\n")
    print("| variant | batch fed | steps/fit | updates/fit | median fit (s) | min..max (s) "
          "| guard k / this: ratio of medians | median per-round ratio | CPU ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    g, g_cpu = statistics.median(walls[guard]), statistics.median(cpus[guard])
    for name in names:
        fed = result["feds"][name]
        steps = result["samples"] // fed
        updates = result["samples"] // result["update_batches"][name]
        med = statistics.median(walls[name])
        print(f"| {name} | {fed} | {steps} | {updates} | {med:.3f} "
              f"| {min(walls[name]):.3f}..{max(walls[name]):.3f} "
              f"| {g / med:.3f}x | {median_ratio(walls[guard], walls[name]):.3f}x "
              f"| {g_cpu / statistics.median(cpus[name]):.3f}x |")


# --------------------------------------------------------------------------
# Part 3: the first batch's planning.


def first_fit(kind, batch, steps, guarded, x, y):
    model = build_model(kind)
    log = BatchLog()
    guard = planning_guard() if guarded else None
    model.fit(x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1,
              verbose=0, shuffle=False, callbacks=[log] + ([guard] if guard else []))
    if guard is not None:
        assert guard.oom_recoveries == 0, guard.oom_recoveries
    # Batches 2 on: batch 1 may still compile or trace (the settled k).
    later = [b - a for a, b in zip(log.ends[1:], log.ends[2:])] or [0.0]
    row = {
        "first_s": log.ends[0] - log.begin,
        "fit_s": log.ends[-1] - log.begin,
        "later_s": statistics.median(later),
        "ks": [int(k) if k is not None else None for k in log.ks],
        "final_k": guard.micro_batches if guard else None,
    }
    del model, guard
    gc.collect()
    keras.backend.clear_session()
    return row


def part_first_batch(kind, batch, steps, repeats, report):
    rng = np.random.default_rng(1)
    x = rng.random((batch * steps,) + SHAPES[kind], dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(batch * steps,))
    first_fit(kind, batch, 2, False, x, y)  # imports, kernels, thread pools
    rows = {"plain": [], "guard": []}
    for r in range(repeats):
        order = ("plain", "guard") if r % 2 == 0 else ("guard", "plain")
        for name in order:
            rows[name].append(first_fit(kind, batch, steps, name == "guard", x, y))
    result = {"part": "first_batch", "kind": kind, "batch": batch, "steps": steps,
              "repeats": repeats, "rows": rows}
    report.append(result)
    return result


def print_first_batch(result):
    rows = result["rows"]
    keys = ("first_s", "fit_s", "later_s")
    med = {n: {key: statistics.median(r[key] for r in rows[n]) for key in keys} for n in rows}

    def paired(key):  # guard minus plain, per pair
        return statistics.median(g[key] - p[key] for g, p in zip(rows["guard"], rows["plain"]))

    ks = sorted({tuple(r["ks"]) for r in rows["guard"]})
    print(f"\n{BACKEND}: first batch, {result['kind']}, B={result['batch']}, fresh model "
          f"and guard, {result['repeats']} pairs: batch 0 plain "
          f"{med['plain']['first_s'] * 1e3:.0f} ms, guard {med['guard']['first_s'] * 1e3:.0f} ms "
          f"(guard - plain, median per pair {paired('first_s') * 1e3:+.0f} ms); whole first fit "
          f"of {result['steps']} batches plain {med['plain']['fit_s'] * 1e3:.0f} ms, guard "
          f"{med['guard']['fit_s'] * 1e3:.0f} ms ({paired('fit_s') * 1e3:+.0f} ms); batches 2 on "
          f"plain {med['plain']['later_s'] * 1e3:.1f} ms, guard {med['guard']['later_s'] * 1e3:.1f} "
          f"ms; guard's k per batch {' or '.join(str(list(k)) for k in ks)}")


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


def backend_version():
    if BACKEND == "tensorflow":
        import tensorflow as tf

        gpu = bool(tf.config.list_physical_devices("GPU"))
        return f"TensorFlow {tf.__version__}", gpu
    if BACKEND == "jax":
        import jax

        return f"JAX {jax.__version__} ({jax.devices()[0].platform})", \
            jax.devices()[0].platform != "cpu"
    if BACKEND == "torch":
        import torch

        return f"torch {torch.__version__} ({torch.get_num_threads()} threads)", \
            torch.cuda.is_available()
    return BACKEND, False


def code_version():
    """The commit measured, and whether the package had uncommitted edits."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "keras_memguard"],
                               cwd=ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' with uncommitted changes in keras_memguard/' if dirty else ''}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="1,2,3", help="1 and 2 run together")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mlp-batches", type=int, default=24,
                        help="data batches of B per fit, MLP")
    parser.add_argument("--cnn-batches", type=int, default=8,
                        help="data batches of B per fit, CNN")
    parser.add_argument("--first-repeats", type=int, default=3)
    parser.add_argument("--first-steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds: the MLP at B=32, one round")
    parser.add_argument("--json", default=None, help="write raw results here")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.batch, args.rounds = "mlp", 32, 1
        args.mlp_batches, args.first_repeats, args.first_steps = 2, 1, 3
    parts = {int(p) for p in args.parts.split(",")}
    warnings.simplefilter("ignore")  # NVML is absent without a GPU driver
    assert keras.backend.backend() == BACKEND, (keras.backend.backend(), BACKEND)

    started = time.time()
    version, gpu = backend_version()
    print(f"Keras backend {BACKEND}: {version}, Keras {keras.__version__}, Python "
          f"{platform.python_version()}; {os.cpu_count()} CPU cores ({cpu_model()}); "
          f"GPU: {gpu}; load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"code: {code_version()}", flush=True)
    report = []
    batches = {"mlp": args.mlp_batches, "cnn": args.cnn_batches}
    for kind in args.models.split(","):
        if parts & {1, 2}:
            result = part_variants(kind, args.batch, args.k, args.batch * batches[kind],
                                   args.rounds, report)
            if 1 in parts:
                print_overhead(result)
            if 2 in parts:
                print_accumulation(result)
            sys.stdout.flush()
        if 3 in parts:
            print_first_batch(part_first_batch(kind, args.batch, args.first_steps,
                                               args.first_repeats, report))
            sys.stdout.flush()
    print(f"\n{BACKEND}: total {time.time() - started:.0f} s; load average "
          f"{os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": BACKEND, "version": version, "report": report}, f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
