"""Overhead of MemoryMonitor on Keras `fit`, and of its per-batch work.

Run from the repository root:

    python3 bench/bench_monitor.py            # 21 rounds
    python3 bench/bench_monitor.py --rounds 31 --profile

One process, under the BFC CPU allocator (8 GiB cap) with oneDNN off, as in
tests/conftest.py. A small MLP (512-512-10, Adam, batch 256, 100 steps per
fit; one model per variant, built alike) is trained by every variant in
turn; variants are interleaved, their order rotated each round, each warmed
up first, and the median fit time is reported. Each model has its own
allocator reader, so one monitor's cost does not leak into another's. The fair baseline for a per-batch callback is the no-op callback
that overrides `on_train_batch_end`: any batch-level callback makes Keras
turn the step's logs into Python floats every batch.

Also measured (median of repeats, microseconds per call): one
`AllocatorProbe.sample()`, one `get_memory_info`, and one
`MemoryMonitor.on_train_batch_end` called directly with a logs dict.
Prints Markdown tables.
"""

import os

# Before TensorFlow is imported: read once per process.
os.environ.update(
    {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8192",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
    }
)

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_memguard.callbacks.monitor import MemoryMonitor  # noqa: E402
from keras_memguard.probes.tf_allocator import AllocatorProbe  # noqa: E402

BATCH = 256
STEPS = 100
FEATURES = 512
UNITS = 512
CLASSES = 10


class NoOpBatchCallback(keras.callbacks.Callback):
    """Overrides the batch hook and does nothing: Keras' own per-batch cost."""

    def on_train_batch_end(self, batch, logs=None):
        pass


def build_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(UNITS, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_fits(x, y, variants, rounds):
    """Wall and CPU seconds per fit for each variant, interleaved, rotated.

    CPU time is the process's, all threads together (TensorFlow's pool, the
    event writers' threads): less sensitive than wall time to other
    processes on a shared machine, and it counts background work too.
    """
    names = list(variants)
    times = {name: [] for name in names}
    cpu_times = {name: [] for name in names}
    models = {name: build_model() for name in names}

    def fit(name):
        start, start_cpu = time.perf_counter(), time.process_time()
        models[name].fit(
            x, y, batch_size=BATCH, epochs=1, verbose=0,
            callbacks=variants[name](), shuffle=False,
        )
        return time.perf_counter() - start, time.process_time() - start_cpu

    for name in names:  # warm-up: tracing, writers, NVML's one warning
        fit(name)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            wall, cpu = fit(name)
            times[name].append(wall)
            cpu_times[name].append(cpu)
    return times, cpu_times


def per_call_us(fn, number, repeat):
    """Median microseconds per call over `repeat` runs of `number` calls."""
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def monitor_batch_end_us(model, log_dir, number, repeat):
    """Median microseconds of one on_train_batch_end, called directly."""
    monitor = MemoryMonitor(log_dir=log_dir)
    monitor.set_model(model)
    monitor.set_params({"epochs": 1, "steps": None, "verbose": 0})
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    batches = itertools.count()
    logs = {"loss": 0.5}

    def call():
        monitor.on_train_batch_end(next(batches), logs)

    us = per_call_us(call, number, repeat)
    monitor.on_train_end()
    return monitor, call, us


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile MemoryMonitor.on_train_batch_end")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # NVML is absent without a GPU driver

    rng = np.random.default_rng(0)
    x = rng.random((BATCH * STEPS, FEATURES), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(BATCH * STEPS,))

    tmp = tempfile.mkdtemp(prefix="bench_monitor_")
    # One instance per variant, reused by every round (as a user reusing a
    # callback list would): MemoryMonitor's step keeps rising across fits.
    monitor = MemoryMonitor(log_dir=os.path.join(tmp, "monitor"))
    monitor_logs_only = MemoryMonitor(log_dir=None)
    keras_tb = keras.callbacks.TensorBoard(
        log_dir=os.path.join(tmp, "keras_tb"), update_freq="batch"
    )
    noop = NoOpBatchCallback()
    variants = {
        "bare fit": lambda: [],
        "no-op batch callback": lambda: [noop],
        'MemoryMonitor(update_freq="batch", log_dir=tmp)': lambda: [monitor],
        "MemoryMonitor(log_dir=None) (logs keys only)": lambda: [monitor_logs_only],
        'keras TensorBoard(update_freq="batch")': lambda: [keras_tb],
    }
    times, cpu_times = time_fits(x, y, variants, args.rounds)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    cpu_medians = {name: statistics.median(ts) for name, ts in cpu_times.items()}
    bare = medians["bare fit"]
    noop_median = medians["no-op batch callback"]

    print(f"Python {platform.python_version()}, TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}; {os.cpu_count()} CPU cores ({cpu_model()}); "
          f"no GPU: {not tf.config.list_physical_devices('GPU')}")
    print(f"MLP {FEATURES}-{UNITS}-{CLASSES} (Adam), batch {BATCH}, {STEPS} steps "
          f"per fit, {args.rounds} rounds (after 1 warm-up fit per variant), "
          "medians.\n")
    # Rounds are interleaved, so the ratio within each round cancels the
    # slow drifts of a shared machine: its median is the steadier estimate.
    print("| Variant | median fit (s) | per step (ms) | min..max (s) "
          "| vs bare | vs no-op | median of per-round ratios vs bare "
          "| median CPU (s) | CPU vs bare |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, median in medians.items():
        ts = times[name]
        paired = statistics.median(
            t / b for t, b in zip(ts, times["bare fit"])
        )
        cpu = cpu_medians[name]
        print(f"| {name} | {median:.4f} | {median / STEPS * 1e3:.2f} "
              f"| {min(ts):.3f}..{max(ts):.3f} | {median / bare:.3f}x "
              f"| {median / noop_median:.3f}x | {paired:.3f}x "
              f"| {cpu:.3f} | {cpu / cpu_medians['bare fit']:.3f}x |")

    # Per-call costs.
    probe = AllocatorProbe()
    probe.reset()
    get_info = tf.config.experimental.get_memory_info
    number, repeat = 20000, 9
    sample_us = per_call_us(probe.sample, number, repeat)
    info_us = per_call_us(lambda: get_info("CPU:0"), number, repeat)
    reset_us = per_call_us(
        lambda: tf.config.experimental.reset_memory_stats("CPU:0"), number, repeat
    )
    # A fresh model each: its reader has this one consumer, as in a fit.
    _, _, batch_end_us = monitor_batch_end_us(
        build_model(), os.path.join(tmp, "direct"), number // 4, repeat
    )
    _, _, batch_end_logs_only_us = monitor_batch_end_us(
        build_model(), None, number // 4, repeat
    )
    step_ms = bare / STEPS * 1e3
    print()
    print("| Per call | median (us) | share of a bare step |")
    print("|---|---:|---:|")
    for label, us in (
        ("`tf.config.experimental.get_memory_info('CPU:0')`", info_us),
        ("`tf.config.experimental.reset_memory_stats('CPU:0')`", reset_us),
        ("`AllocatorProbe.sample()` (read + reset, CPU:0)", sample_us),
        ("`MemoryMonitor.on_train_batch_end` (log_dir set)", batch_end_us),
        ("`MemoryMonitor.on_train_batch_end` (log_dir=None)", batch_end_logs_only_us),
    ):
        print(f"| {label} | {us:.2f} | {us / (step_ms * 1e3):.2%} |")
    print(f"\nbare step: {step_ms:.2f} ms; event files under {tmp}")

    if args.profile:
        monitor, call, _ = monitor_batch_end_us(
            build_model(), os.path.join(tmp, "profile"), 1, 1
        )
        monitor.on_train_begin()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20000):
            call()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print("\ncProfile of 20000 on_train_batch_end calls (log_dir set), by tottime:")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
