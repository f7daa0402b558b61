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

Also measured, per call in microseconds (median of repeats, the variants
interleaved and rotated each repeat): one `get_memory_info`, one
`reset_memory_stats`, one `AllocatorProbe.sample()`, one reading of the
process's resident memory (`HostMemoryProbe.rss_bytes()`, an `os.pread` of
`/proc/self/statm`) and, to compare, `psutil`'s (where it is installed)
and a fresh open-read-close of the file; the monitor's
`on_train_batch_end` called directly with a logs dict; and the whole
per-batch path `fit` runs (the model's logs carrier calling the callbacks'
contributions after the train function, then `on_train_batch_end`) for the
monitor alone and for the monitor with `MemoryGuard`, both with `log_dir`,
once with a stand-in for the whole train function and once with the guard's
own train function (batch sizes, planning, the planner's reading) around a
stand-in for the compiled step; and, in a real `fit` with both callbacks,
the median time of each of their per-batch hooks.
"CPU per batch" adds the event writer's thread: process CPU time of the calls
plus the flush of their events, per call.
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

from keras_memguard import decider  # noqa: E402
from keras_memguard.callbacks import logs_carrier  # noqa: E402
from keras_memguard.callbacks.guard import MemoryGuard  # noqa: E402
from keras_memguard.callbacks.monitor import MemoryMonitor  # noqa: E402
from keras_memguard.callbacks.sampling import shared_reader  # noqa: E402
from keras_memguard.backends.tensorflow.run import TfTrainingRun  # noqa: E402
from keras_memguard.probes.host import HostMemoryProbe  # noqa: E402
from keras_memguard.backends.tensorflow.probe import AllocatorProbe  # noqa: E402

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


def interleaved_per_call(calls, number, repeat):
    """Wall and CPU microseconds per call of each entry, interleaved.

    Args:
        calls: `{name: (call, after)}`: `call()` is timed `number` times in a
            row; `after()` (or `None`) runs right after, inside the CPU
            measurement only (the event flush: the writer thread's share).
        number: Calls per timing.
        repeat: Timings per entry; the order rotates each repeat.

    Returns:
        `({name: median wall us}, {name: median CPU us})`.
    """
    names = list(calls)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(repeat):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            call, after = calls[name]
            start_cpu = time.process_time()
            start = time.perf_counter()
            for _ in range(number):
                call()
            elapsed = time.perf_counter() - start
            if after is not None:
                after()
            wall[name].append(elapsed / number * 1e6)
            cpu[name].append((time.process_time() - start_cpu) / number * 1e6)
    return (
        {name: statistics.median(v) for name, v in wall.items()},
        {name: statistics.median(v) for name, v in cpu.items()},
    )


def _writer_flush(callback):
    writer = callback._writer
    return None if writer is None else writer.flush


def direct_batch_end(log_dir):
    """`MemoryMonitor.on_train_batch_end` called directly with a logs dict.

    No logs carrier is installed, so each call reads the probe itself, as it
    does when the train function is replaced after `on_train_begin`.
    Returns `(call, after, close)`.
    """
    model = build_model()  # its own reader: this monitor is its one consumer
    monitor = MemoryMonitor(log_dir=log_dir)
    monitor.set_model(model)
    monitor.set_params({"epochs": 1, "steps": None, "verbose": 0})
    monitor.on_train_begin()
    logs_carrier.detach(model, monitor)
    monitor.on_epoch_begin(0)
    batches = itertools.count()
    logs = {"loss": 0.5}

    def call():
        monitor.on_train_batch_end(next(batches), logs)

    return call, _writer_flush(monitor), monitor.on_train_end


def fit_path(log_dir, with_guard, plan=False, history=True):
    """The per-batch path of `fit`: the logs carrier, then the batch hook.

    The callbacks are set up as `fit` sets them up (`on_train_begin`
    installs the model's logs carrier, and the guard its train function in
    it); then the carrier's inner function is a stand-in returning a logs
    dict, so a call costs what the callbacks add to a batch, not a training
    step. With `plan`, the guard's own train function stays in the carrier
    and only its compiled step is a stand-in: each call also pulls a batch
    (the same eager tensors), reads its sizes, plans it and gives the
    planner the batch's reading. The stand-in allocates nothing, so every
    reading is the same; the planner starts knowing that the memory in use
    before training is 0, which gives it a line from the first reading.
    With `history`, the model has the `History` Keras gives every `fit`
    (by which the carrier tells a `fit` without the callbacks from theirs,
    every call); without it, that check is skipped, to time it.
    Returns `(call, after, close)`.
    """
    model = build_model()
    if history:
        model.history = keras.callbacks.History()  # as `CallbackList.set_model`
    monitor = MemoryMonitor(log_dir=log_dir)
    callbacks = [monitor]
    if with_guard:
        callbacks.append(MemoryGuard(log_dir=log_dir, plan_cache=False))
    params = {"epochs": 1, "steps": None, "verbose": 0}
    model.make_train_function()
    for callback in callbacks:
        callback.set_model(model)
        callback.set_params(params)
    for callback in callbacks:
        callback.on_train_begin()
    for callback in callbacks:
        callback.on_epoch_begin(0)
    carrier = logs_carrier.current(model)
    train_logs = {"loss": 0.5}
    iterator = None
    if plan:
        guard = callbacks[-1]
        function = guard._run.function
        function.step_for = lambda micro_batches: lambda data: train_logs
        function._state_built = True  # nothing to build for the stand-in
        guard.session.start(guard.session.smallest_limit)
        batch = (tf.zeros([BATCH, FEATURES]), tf.zeros([BATCH], tf.int64))
        iterator = itertools.repeat(batch)
    else:
        carrier.inner = lambda iterator: train_logs
    batches = itertools.count()

    def call():
        logs = carrier(iterator)
        batch = next(batches)
        for callback in callbacks:
            callback.on_train_batch_end(batch, logs)

    def close():
        for callback in callbacks:
            callback.on_train_end()

    return call, _writer_flush(monitor), close


# The label of `decider.plan`'s calls in `timed_hooks_in_fit`.
PLANS_COMPUTED = "    of which decider.plan, when computed"


def timed_hooks_in_fit(x, y, log_dir):
    """Microseconds per batch of each per-batch hook, in a real `fit`.

    MemoryMonitor and MemoryGuard (both with `log_dir`) on the bench MLP:
    each hook is wrapped with a timer before `fit` (the callbacks register
    their bound methods at train begin, so the wrappers are what runs).
    The guard's work before each step is timed from the call of its train
    function's `run` to the call of `step_for` (the batch's sizes and the
    plan), and its plan hook (`TfTrainingRun.plan_batch`) on its own, and the
    batches whose plan was computed (`decider.plan`). One warm-up fit,
    then the medians over the batches of a second fit.
    """
    monitor = MemoryMonitor(log_dir=log_dir)
    guard = MemoryGuard(log_dir=log_dir)
    durations = {}

    def wrap(owner, name, label):
        inner = getattr(owner, name, None)
        if inner is None:
            return
        times = durations.setdefault(label, [])
        clock = time.perf_counter

        def timed(*args, **kwargs):
            start = clock()
            result = inner(*args, **kwargs)
            times.append(clock() - start)
            return result

        setattr(owner, name, timed)
        wrapped.append((owner, name, inner))

    wrapped = []

    class TimeBeforeStep(keras.callbacks.Callback):
        """After the guard's `on_train_begin`: wraps its train function."""

        def on_train_begin(self, logs=None):
            function = guard._run.function
            run, step_for = function.run, function.step_for
            times = durations.setdefault(
                "MemoryGuard: before the step (batch sizes, plan)", []
            )
            clock = time.perf_counter
            started = []

            def timed_run(data):
                started.append(clock())
                return run(data)

            def timed_step_for(micro_batches):
                if started:
                    times.append(clock() - started.pop())
                return step_for(micro_batches)

            function.run = timed_run
            function.step_for = timed_step_for

    model = build_model()
    wrap(monitor, "_contribute", "MemoryMonitor: after the train function")
    # Part of the line above: the allocator reading itself, right after a
    # training step (cold caches), where the isolated figure is warm.
    wrap(shared_reader(model).probe, "sample", "  of which AllocatorProbe.sample()")
    wrap(monitor, "on_train_batch_end", "MemoryMonitor.on_train_batch_end")
    # The guard's run is made at train begin and hands its bound methods to
    # the carrier and the train function then: wrapped on the class.
    wrap(TfTrainingRun, "_contribute", "MemoryGuard: after the train function")
    wrap(guard, "on_train_batch_end", "MemoryGuard.on_train_batch_end")
    wrap(TfTrainingRun, "plan_batch", "  of which TfTrainingRun.plan_batch")
    # The controller reuses a plan while nothing it depends on changed.
    wrap(decider, "plan", PLANS_COMPUTED)
    try:
        for _ in range(2):
            for times in durations.values():
                times.clear()
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      callbacks=[monitor, guard, TimeBeforeStep()], shuffle=False)
    finally:
        for owner, name, inner in wrapped:
            setattr(owner, name, inner)
    batches = len(durations["MemoryGuard.on_train_batch_end"])
    computed = len(durations.get(PLANS_COMPUTED, ()))
    medians = {
        label: statistics.median(times) * 1e6 for label, times in durations.items() if times
    }
    return medians, (computed, batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--skip-fits", action="store_true",
                        help="only the per-call and per-hook figures (quicker)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile fit's per-batch path (monitor + guard, planning)")
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
    print(f"Python {platform.python_version()}, TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}; {os.cpu_count()} CPU cores ({cpu_model()}); "
          f"no GPU: {not tf.config.list_physical_devices('GPU')}; keras_memguard "
          f"from {os.path.dirname(os.path.dirname(decider.__file__))}")
    bare = None
    if not args.skip_fits:
        times, cpu_times = time_fits(x, y, variants, args.rounds)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        cpu_medians = {name: statistics.median(ts) for name, ts in cpu_times.items()}
        bare = medians["bare fit"]
        noop_median = medians["no-op batch callback"]

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

    # Per-call costs, interleaved.
    probe = AllocatorProbe()
    probe.reset()
    get_info = tf.config.experimental.get_memory_info
    reset_stats = tf.config.experimental.reset_memory_stats
    setups = {
        "direct, log_dir set": direct_batch_end(os.path.join(tmp, "direct")),
        "direct, log_dir=None": direct_batch_end(None),
        "fit path, monitor": fit_path(os.path.join(tmp, "path"), False),
        "fit path, monitor + guard": fit_path(os.path.join(tmp, "path_guard"), True),
        "fit path, monitor + guard, no fit check": fit_path(
            os.path.join(tmp, "path_guard_unchecked"), True, history=False
        ),
        "fit path, monitor + guard, planning": fit_path(
            os.path.join(tmp, "path_plan"), True, plan=True
        ),
    }
    number, repeat = 5000, 9
    host = HostMemoryProbe()

    def statm_open_read():
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1])

    calls = {
        "info": (lambda: get_info("CPU:0"), None),
        "reset": (lambda: reset_stats("CPU:0"), None),
        "sample": (probe.sample, None),
        "rss": (host.rss_bytes, None),
        "rss open": (statm_open_read, None),
    }
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        process = psutil.Process()
        calls["rss psutil"] = (lambda: process.memory_info().rss, None)
    calls.update({name: (call, after) for name, (call, after, _) in setups.items()})
    for call, _ in calls.values():  # warm-up: writers, tags, first reads
        for _ in range(100):
            call()
    wall_us, cpu_us = interleaved_per_call(calls, number, repeat)
    for _, _, close in setups.values():
        close()
    step_ms = None if bare is None else bare / STEPS * 1e3
    print()
    print("| Per call | median (us) | CPU per batch, writer thread included (us) "
          "| share of a bare step |")
    print("|---|---:|---:|---:|")
    for label, name in (
        ("`tf.config.experimental.get_memory_info('CPU:0')`", "info"),
        ("`tf.config.experimental.reset_memory_stats('CPU:0')`", "reset"),
        ("`AllocatorProbe.sample()` (read + reset, CPU:0)", "sample"),
        ("`HostMemoryProbe.rss_bytes()` (os.pread of the open /proc/self/statm)",
         "rss"),
        ("the same by open + read + close of /proc/self/statm (not used)",
         "rss open"),
        ("`psutil.Process().memory_info().rss` (not used)", "rss psutil"),
        ("`MemoryMonitor.on_train_batch_end`, direct (log_dir set)",
         "direct, log_dir set"),
        ("`MemoryMonitor.on_train_batch_end`, direct (log_dir=None)",
         "direct, log_dir=None"),
        ("fit's per-batch path: MemoryMonitor (log_dir set)", "fit path, monitor"),
        ("fit's per-batch path: MemoryMonitor + MemoryGuard (log_dir set)",
         "fit path, monitor + guard"),
        ("the same without the carrier's check of the `fit` it is in",
         "fit path, monitor + guard, no fit check"),
        ("the same, with the guard's train function planning (stand-in step)",
         "fit path, monitor + guard, planning"),
    ):
        if name not in wall_us:
            continue
        us = wall_us[name]
        share = "-" if step_ms is None else f"{us / (step_ms * 1e3):.2%}"
        print(f"| {label} | {us:.2f} | {cpu_us[name]:.2f} | {share} |")
    print(f"\nEach per-call figure: median of {repeat} interleaved timings of "
          f"{number} calls.")
    if step_ms is not None:
        print(f"bare step: {step_ms:.2f} ms")
    print(f"event files under {tmp}")

    hooks, (computed, batches) = timed_hooks_in_fit(x, y, os.path.join(tmp, "hooks"))
    print()
    print("| In a real fit, MemoryMonitor + MemoryGuard (log_dir set) "
          "| median per batch (us) |")
    print("|---|---:|")
    for label, us in hooks.items():
        print(f"| {label} | {us:.2f} |")
    total = sum(us for label, us in hooks.items() if not label.startswith(" "))
    print(f"| sum | {total:.2f} |")
    print(f"decider.plan computed for {computed} of {batches} batches")

    if args.profile:
        call, _, close = fit_path(os.path.join(tmp, "profile"), True, plan=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20000):
            call()
        profiler.disable()
        close()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print("\ncProfile of 20000 batches of fit's per-batch path (monitor + "
              "guard with its train function planning around a stand-in step, "
              "log_dir set), by tottime:")
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
