"""The planner: out-of-memory errors per run, settled micro-batch, plan cost.

Every training figure comes from child processes under a real cap on
TensorFlow's CPU BFC allocator (`keras_memguard.testing.memory_cap_env`).

Part "cnn" (600 MiB cap, the 64x64x3 CNN of bench_guard.py): for each batch
size, two runs of the same set-up in a row sharing one plan cache (a fresh
`$KERAS_HOME`): the first starts from nothing, the second from the cache,
both with `MemoryGuard()` (which reserves the rest of the allocator's limit
in one region before planning); then a third run started by hand at the
best count (`MemoryGuard(plan=False, micro_batches=best_k,
cooldown=10**9)`, the baseline for time), which reserves the region itself
(`region.reserve_region`) since the guard does not when it does not plan:
before `fit` with a tf.data input, at the start of training (where the
planning guard reserves, after Keras turned the arrays into tensors) with
`--input numpy`.
Reported per run: out-of-memory errors, the micro-batch counts per batch,
the micro-batch it settled on against the best micro-batch, and the seconds
to the end of the first epoch against the run started at the best count.
The best micro-batch is the largest `ceil(batch / k)` not above `--best`,
160 by default: the largest batch plain training was measured to fit under
this cap with the region reserved (136, 147 and 160 fit; 170 and 204 run
out of memory). Without the reservation plain training fits 136 from a
fresh process and fails at 138, the figure used before the reservation.

Part "history" (600 MiB cap, the same CNN at batch 408): one process per
schedule of micro-batch counts, one model, one single-batch
`model.fit(dataset.take(1))`-style fit per count, each with its own
`MemoryGuard(plan=False, micro_batches=k, cooldown=10**9,
reserve_memory=False)` (a guard that does not plan never reserves), with
and without `region.reserve_region("CPU:0", 600 MiB)` before the first
fit. Reported: whether each step ran out of memory (`oom_recoveries` of
its guard, which replays such a batch with twice the micro-batches), above
all the last step (k=3, 136 per micro-batch) after the history before it.

Part "text" (200 MiB cap, the convolutional text classifier and the
length-bucketed batches of `tests/programs/common.py`: batch 256, six bucket
lengths 64 to 512 tokens, each twice, shuffled): a first and a cached second
run with `MemoryGuard()` sharing one fresh `$KERAS_HOME` (OOMs, samples
trained against expected, micro-batch counts per bucket length, seconds);
then, one process each, plain training (no guard, region reserved) of one
512-token batch at each of `--text-micro`, for the best micro-batch of the
longest bucket.

Part "text_steps" (200 MiB cap, the same classifier): the guard's own step
peak (`MemoryMonitor`'s `memory_peak_mib`) for 512-token batches of 256 at
fixed micro-batch counts, one process per `--text-schedules` entry (a
count per batch; `MemoryGuard(plan=False, micro_batches=k,
cooldown=10**9)` per count, the region reserved first): what the planner
reads for the same step after different earlier steps.

Part "repeat" (89 MiB cap, `tests/programs/prefetched_pipeline_under_cap.py`:
a small 32x32x3 CNN fed a shuffled, prefetched tf.data pipeline, batch 128,
8 batches): `--repeat-runs` runs of `MemoryGuard()`, each from an empty plan
cache (a fresh `$KERAS_HOME`), two at a time as a busy machine would run
them. Reported per run: out-of-memory errors, the counts per batch, the
micro-batch it settled on, seconds; then the smallest settled micro-batch
over the largest (the issue's goal: within 10%).

Part "cost" (in process): the per-batch cost of `decider.plan`, and of
`decider.observe` of a reading that teaches something new followed by
`plan` (medians of timed loops).

Part "apps" (keras.applications models with `weights=None` on 64x64x3,
numpy arrays through Keras' own pipeline, as a user calls `fit`): plain
training's peak uncapped, then under a cap of `--apps-cap` times it a first
and a cached run with `MemoryGuard()`, and the fewest micro-batches a fixed
count of 1, 2, 4, ... (`plan=False`, region reserved at the start of
training, where the planning guard reserves it) trains with and no
error, by hand, and the fewest whose peak also stays under the guard's
threshold (what planning aims at).

    python bench/bench_planner.py [--parts cnn,history,text,text_steps,cost,apps,repeat]
        [--batches 272,408,1024] [--best 160] [--steps 6]
        [--schedules "3,3;8,3;16,3;32,3"] [--text-micro 128,160,192,256]
        [--text-threshold 0.9] [--text-schedules "2,2,2;3,3,3,2,2,2;1,2,2,2"]
        [--json results.json]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CAP_MIB = 600
TEXT_CAP_MIB = 200
REPEAT_CAP_MIB = 89
HISTORY_BATCH = 408
MIB = 2**20
PARTS = ("cnn", "history", "text", "text_steps", "cost", "apps", "repeat")


def ks_callback():
    """A callback that records `logs["micro_batches"]` per batch (`ks`)."""
    return import_text_programs().MicroBatchCounts()


def reserve(cap_mib):
    """Reserves the rest of the cap in one region, as the planning guard does."""
    import tensorflow as tf

    from keras_memguard.backends.tensorflow import region

    reserved = region.reserve_region("CPU:0", cap_mib * MIB)
    # The region's one allocation must not count as training's peak.
    tf.config.experimental.reset_memory_stats("CPU:0")
    return reserved // MIB


def reserve_at_train_begin(cap_mib=CAP_MIB):
    """A callback that reserves the rest of the cap when training starts,
    where the planning guard does: after Keras turned numpy arrays into
    tensors. Reserved before `fit`, the allocator hands the arrays and the
    prefetched batches chunks that fit them closer, and less is in use
    before every step than the guard ever sees (64 MiB less for the bench
    CNN at batch 1024)."""
    import keras

    class Reserve(keras.callbacks.Callback):
        reserved_mib = 0

        def on_train_begin(self, logs=None):
            self.reserved_mib = reserve(cap_mib)

    return Reserve()


def import_bench_guard():
    # bench_guard sets an 8 GiB cap when it is not a child; this process
    # has its cap from the parent already.
    argv = sys.argv
    sys.argv = [argv[0], "--child", "x"]
    sys.path.insert(0, HERE)
    import bench_guard

    sys.argv = argv
    return bench_guard


def child_cnn(spec):
    bg = import_bench_guard()
    import keras_memguard

    batch = spec["batch"]
    model = bg.build_model("design_cnn")
    if spec.get("input") == "numpy":
        # Keras' own pipeline from arrays: it prefetches, and on the CPU
        # stand-in its buffers share the capped allocator with the step.
        import numpy as np

        rng = np.random.default_rng(0)
        x = rng.random((batch * spec["steps"], 64, 64, 3), dtype=np.float32)
        y = rng.integers(0, 10, batch * spec["steps"])
        data = {"x": x, "y": y, "batch_size": batch, "shuffle": False}
    else:
        data = {"x": bg.generated_dataset("design_cnn", batch, spec["steps"])}
    reserved = 0
    ks = ks_callback()
    callbacks = [ks]
    reserver = None
    if spec["by_hand_k"]:
        if spec.get("input") == "numpy":
            reserver = reserve_at_train_begin()
            callbacks.append(reserver)
        else:
            reserved = reserve(CAP_MIB)
        guard = keras_memguard.MemoryGuard(
            plan=False, micro_batches=spec["by_hand_k"], cooldown=10**9
        )
    else:
        guard = keras_memguard.MemoryGuard()
    start = time.perf_counter()
    model.fit(**data, epochs=1, verbose=0, callbacks=callbacks + [guard])
    if reserver is not None:
        reserved = reserver.reserved_mib
    seconds = time.perf_counter() - start
    return {
        "ooms": guard.oom_recoveries,
        "ks": ks.ks,
        "k": guard.micro_batches,
        "micro": -(-batch // guard.micro_batches),
        "reserved_mib": reserved,
        "seconds": round(seconds, 1),
    }


def child_history(spec):
    bg = import_bench_guard()
    import keras_memguard

    batch = spec["batch"]
    model = bg.build_model("design_cnn")
    dataset = bg.generated_dataset("design_cnn", batch, 1)
    reserved = reserve(CAP_MIB) if spec["reserve"] else 0
    steps = []
    for k in spec["schedule"]:
        # One model for the whole schedule: the allocator's history is the
        # point. Each step is its own single-batch fit with its own guard.
        guard = keras_memguard.MemoryGuard(
            plan=False, micro_batches=k, cooldown=10**9, reserve_memory=False
        )
        start = time.perf_counter()
        model.fit(dataset.take(1), epochs=1, verbose=0, callbacks=[guard])
        steps.append({
            "k": k,
            "micro": -(-batch // k),
            "ooms": guard.oom_recoveries,
            "k_after": guard.micro_batches,
            "seconds": round(time.perf_counter() - start, 1),
        })
    return {"reserved_mib": reserved, "steps": steps}


def import_text_programs():
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from programs import common

    return common


def child_text(spec):
    common = import_text_programs()
    import keras_memguard

    dataset, order = common.bucketed_text()
    ks = ks_callback()
    guard = keras_memguard.MemoryGuard(threshold=spec.get("threshold", 0.9))
    model = common.text_classifier(metrics=[common.SampleCount()])
    start = time.perf_counter()
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[ks, guard])
    seconds = time.perf_counter() - start
    return {
        "ooms": guard.oom_recoveries,
        "samples": int(history.history["samples"][-1]),
        "expected": len(order) * common.TEXT_BATCH,
        "batch": common.TEXT_BATCH,
        "lengths": [int(length) for length in order],
        "ks": ks.ks,
        "seconds": round(seconds, 1),
    }


def child_text_plain(spec):
    common = import_text_programs()
    import tensorflow as tf

    micro = spec["micro"]
    length = common.TEXT_LENGTHS[-1]
    model = common.text_classifier()
    dataset, _ = common.bucketed_text(repeats=1, batch=micro, lengths=(length,))
    reserved = reserve(TEXT_CAP_MIB)
    start = time.perf_counter()
    try:
        model.fit(dataset, epochs=1, verbose=0)
        fits = True
    except tf.errors.ResourceExhaustedError:
        fits = False
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {
        "micro": micro,
        "length": length,
        "fits": fits,
        "peak_mib": round(peak / MIB, 1) if fits else None,
        "reserved_mib": reserved,
        "seconds": round(time.perf_counter() - start, 1),
    }


def child_text_steps(spec):
    common = import_text_programs()
    import keras

    import keras_memguard

    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            peaks.append(round(logs["memory_peak_mib"], 1))

    model = common.text_classifier()
    reserved = reserve(TEXT_CAP_MIB)
    for k in spec["schedule"]:
        dataset, _ = common.bucketed_text(repeats=1, lengths=common.TEXT_LENGTHS[-1:])
        guard = keras_memguard.MemoryGuard(
            plan=False, micro_batches=k, cooldown=10**9, reserve_memory=False
        )
        model.fit(dataset, epochs=1, verbose=0,
                  callbacks=[keras_memguard.MemoryMonitor(), Peaks(), guard])
        if guard.oom_recoveries:
            peaks[-1] = None  # replayed: the step at k ran out of memory
    return {"schedule": spec["schedule"], "peaks_mib": peaks, "reserved_mib": reserved}


def child_apps(spec):
    """A keras.applications model fed numpy arrays, as a user would."""
    import numpy as np
    import keras
    import tensorflow as tf

    import keras_memguard

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, spec["model"])(
        weights=None, input_shape=(64, 64, 3), classes=10
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    batch = spec["batch"]
    rng = np.random.default_rng(0)
    x = rng.random((batch * spec["steps"], 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * spec["steps"])
    callbacks, guard = [ks_callback()], None
    if spec["run"] == "plain":
        callbacks = []
    elif spec["run"] == "fixed":
        # Reacting: a batch that peaks at the threshold raises the count.
        callbacks.append(reserve_at_train_begin(spec["cap_mib"]))
        guard = keras_memguard.MemoryGuard(
            plan=False, micro_batches=spec["k"], cooldown=10**9
        )
    else:
        guard = keras_memguard.MemoryGuard()
    if guard is not None:
        callbacks.append(guard)
    start = time.perf_counter()
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)
    except Exception as error:  # reported, as a user would see it
        return {"error": f"{type(error).__name__}: {str(error)[:200]}",
                "seconds": round(time.perf_counter() - start, 1)}
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "peak_mib": tf.config.experimental.get_memory_info("CPU:0")["peak"] / MIB,
        "ooms": guard.oom_recoveries if guard else 0,
        "ks": callbacks[0].ks if guard else [],
        "k": guard.micro_batches if guard else 1,
    }


def child_repeat(spec):
    import_text_programs()
    from programs import prefetched_pipeline_under_cap

    return prefetched_pipeline_under_cap.guarded_run()


CHILDREN = {
    "apps": child_apps,
    "cnn": child_cnn,
    "history": child_history,
    "repeat": child_repeat,
    "text": child_text,
    "text_plain": child_text_plain,
    "text_steps": child_text_steps,
}


def run_child(spec, cap_mib, keras_home=None):
    """Runs `spec` in a child under a `cap_mib` cap; a fresh `$KERAS_HOME`
    unless `keras_home` is given."""
    if keras_home is None:
        with tempfile.TemporaryDirectory() as home:
            return run_child(spec, cap_mib, home)
    from keras_memguard.testing import run_script_with_memory_cap

    run = run_script_with_memory_cap(
        [__file__, "--child", json.dumps(spec)], cap_mib, timeout=900,
        env={"KERAS_HOME": keras_home}, check=False,
    )
    return run.result if run.result is not None else {"error": run.stderr[-2000:]}


def plan_cost(rounds=7, calls=20000):
    from keras_memguard import decider

    config = decider.make_config()
    state = decider.init(config)
    for micro, peak in ((41, 2.5e8), (82, 4.2e8)):
        reading = decider.Reading(408, -(-408 // micro), 12288.0, 1e6, peak, 6.3e8)
        state = decider.observe(config, state, reading)[1]
    batch = decider.Batch(408, 12288.0, 1e6, 6.3e8)
    # A batch that teaches something new: observe, then plan from its state.
    reading = decider.Reading(408, 5, 12288.0, 1e6, 4.0e8, 6.3e8)
    plans, both = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            decider.plan(config, state, batch)
        plans.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(calls):
            decider.plan(config, decider.observe(config, state, reading)[1], batch)
        both.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(plans), statistics.median(both)


def best_micro(batch, best):
    """The largest `ceil(batch / k)` not above `best`, and its `k`."""
    micro = max(-(-batch // k) for k in range(1, batch + 1) if -(-batch // k) <= best)
    return micro, -(-batch // micro)


def part_cnn(args, raw):
    print(f"\n## cnn ({args.input} input): {CAP_MIB} MiB cap, "
          f"best = largest ceil(batch / k) <= {args.best}")
    print("| batch | run | OOMs | k per batch | settled k (micro-batch) "
          "| settled / best | seconds | / by hand |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batches.split(",")):
        best, best_k = best_micro(batch, args.best)
        results = {}
        with tempfile.TemporaryDirectory() as home:
            for run, k in (("first", 0), ("second (cache)", 0), ("by hand", best_k)):
                spec = {"part": "cnn", "batch": batch, "steps": args.steps,
                        "by_hand_k": k, "input": args.input}
                results[run] = run_child(spec, CAP_MIB, home)
        raw.setdefault("cnn", {})[batch] = {"best": best, "best_k": best_k, **results}
        base = results["by hand"].get("seconds")
        for run, r in results.items():
            if "error" in r:
                print(f"batch {batch} {run}: failed\n{r['error']}")
                continue
            ratio = f"{r['seconds'] / base:.2f}x" if base else "-"
            ks = ",".join(str(k) for k in r["ks"])
            print(
                f"| {batch} | {run} | {r['ooms']} | {ks} | {r['k']} ({r['micro']}) "
                f"| {r['micro'] / best:.2f} of {best} | {r['seconds']} | {ratio} |",
                flush=True,
            )


def part_apps(args, raw):
    print(f"\n## apps: keras.applications (weights=None, 64x64x3, numpy input), "
          f"batch {args.apps_batch}, cap {args.apps_cap:.2f} x the plain peak")
    print("| model | cap MiB | run | OOMs | k per batch | settled micro-batch "
          "| / best by hand (no error; under the threshold) | seconds | / by hand |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    batch, steps = args.apps_batch, args.apps_steps
    for name in args.apps.split(","):
        spec = {"part": "apps", "model": name, "batch": batch, "steps": steps}
        plain = run_child({**spec, "run": "plain"}, 8192)
        if "error" in plain:
            print(f"{name}: plain failed: {plain['error']}")
            continue
        cap = int(args.apps_cap * plain["peak_mib"])
        results = {}
        with tempfile.TemporaryDirectory() as home:
            for run in ("first", "cached"):
                results[run] = run_child({**spec, "run": "guard", "cap_mib": cap}, cap, home)
        # By hand: the fewest micro-batches, of 1, 2, 4, ..., a fixed count
        # trains with and no error (none when one sample does not fit), and
        # the fewest whose peak also stays under the guard's threshold.
        best, under, k = None, None, 1
        while under is None and k <= batch:
            r = run_child({**spec, "run": "fixed", "k": k, "cap_mib": cap}, cap)
            if "error" not in r and r["ooms"] == 0:
                best = best or (k, r)
                # The fixed guard reacts (raises the count) to a batch
                # that peaked at its threshold or above.
                if set(r["ks"]) == {k}:
                    under = (k, r)
            elif "single sample" in r.get("error", ""):
                break
            k *= 2
        raw.setdefault("apps", {})[name] = {"plain": plain, "cap_mib": cap, "best": best,
                                            "under": under, **results}
        best_micro = -(-batch // best[0]) if best else None
        under_micro = -(-batch // under[0]) if under else None
        base = best[1]["seconds"] if best else None
        rows = list(results.items()) + ([("by hand", best[1])] if best else [])
        if under and under[0] != best[0]:
            rows.append(("by hand, under the threshold", under[1]))
        for run, r in rows:
            if "error" in r:
                print(f"| {name} | {cap} | {run} | - | - | {r['error']} | - | {r['seconds']} | - |")
                continue
            micro = -(-batch // r["k"])
            ratio = f"{micro / best_micro:.2f} of {best_micro}" if best_micro else "-"
            if under_micro:
                ratio += f"; {micro / under_micro:.2f} of {under_micro}"
            ks = ",".join(str(k) for k in r["ks"])
            time_ratio = f"{r['seconds'] / base:.2f}x" if base else "-"
            print(f"| {name} | {cap} | {run} | {r['ooms']} | {ks} | {micro} | {ratio} "
                  f"| {r['seconds']} | {time_ratio} |", flush=True)


def part_repeat(args, raw):
    from concurrent.futures import ThreadPoolExecutor

    cap = REPEAT_CAP_MIB
    print(f"\n## repeat: {cap} MiB cap, a shuffled, prefetched tf.data pipeline, "
          f"{args.repeat_runs} runs from an empty plan cache")
    print("| run | OOMs | k per batch | settled micro-batch | seconds |")
    print("| --- | --- | --- | --- | --- |")
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_child({"part": "repeat"}, cap),
                                range(args.repeat_runs)))
    raw["repeat"] = results
    settled = []
    for run, r in enumerate(results, 1):
        if "error" in r:
            print(f"run {run}: failed\n{r['error']}")
            continue
        micro = -(-128 // r["ks"][-1])
        settled.append(micro)
        ks = ",".join(str(k) for k in r["ks"])
        print(f"| {run} | {r['oom_recoveries']} | {ks} | {micro} | {r['seconds']} |",
              flush=True)
    if settled:
        print(f"settled smallest / largest: {min(settled) / max(settled):.2f}", flush=True)


def count_schedules(text):
    """`"3,3;8,3"` -> `[("3,3", [3, 3]), ("8,3", [8, 3])]`."""
    return [(item, [int(k) for k in item.split(",")]) for item in text.split(";")]


def part_history(args, raw):
    print(f"\n## history: {CAP_MIB} MiB cap, batch {HISTORY_BATCH}, one model per "
          "process, one single-batch fit per k")
    print("| schedule | without region | with region |")
    print("| --- | --- | --- |")
    for text, schedule in count_schedules(args.schedules):
        cells = []
        for reserve_first in (False, True):
            spec = {"part": "history", "batch": HISTORY_BATCH,
                    "schedule": schedule, "reserve": reserve_first}
            r = run_child(spec, CAP_MIB)
            raw.setdefault("history", {}).setdefault(text, {})[
                "with region" if reserve_first else "without region"] = r
            if "error" in r:
                cells.append("failed")
                print(f"schedule {text} reserve={reserve_first}: failed\n{r['error']}")
                continue
            last = r["steps"][-1]
            verdict = "OOM" if last["ooms"] else "fits"
            steps = ", ".join(
                f"k={s['k']} ({s['micro']}): {s['ooms']} OOM" for s in r["steps"]
            )
            region_text = f"; region {r['reserved_mib']} MiB" if reserve_first else ""
            cells.append(f"last step {verdict} [{steps}{region_text}]")
        print(f"| {text} | {cells[0]} | {cells[1]} |", flush=True)


def part_text(args, raw):
    print(f"\n## text: {TEXT_CAP_MIB} MiB cap, bucketed text, "
          f"MemoryGuard(threshold={args.text_threshold})")
    print("| run | OOMs | samples / expected | k per bucket length | seconds |")
    print("| --- | --- | --- | --- | --- |")
    runs = {}
    with tempfile.TemporaryDirectory() as home:
        for run in ("first", "second (cache)"):
            r = run_child(
                {"part": "text", "threshold": args.text_threshold}, TEXT_CAP_MIB, home
            )
            runs[run] = r
            if "error" in r:
                print(f"text {run}: failed\n{r['error']}")
                continue
            per_length = {}
            for length, k in zip(r["lengths"], r["ks"]):
                per_length.setdefault(length, []).append(k)
            by_length = ", ".join(
                f"{length}: {'/'.join(str(k) for k in ks)}"
                for length, ks in sorted(per_length.items())
            )
            print(f"| {run} | {r['ooms']} | {r['samples']} / {r['expected']} "
                  f"| {by_length} | {r['seconds']} |", flush=True)
    raw["text"] = runs
    print("\nplain training (no guard, region reserved), one 512-token batch:")
    plain = {}
    for micro in (int(m) for m in args.text_micro.split(",")):
        r = run_child({"part": "text_plain", "micro": micro}, TEXT_CAP_MIB)
        plain[micro] = r
        if "error" in r:
            print(f"plain {micro}: failed\n{r['error']}")
            continue
        peak = f", peak {r['peak_mib']} MiB" if r["fits"] else ""
        print(f"  micro-batch {micro}: {'fits' if r['fits'] else 'out of memory'}"
              f"{peak} (region {r['reserved_mib']} MiB, {r['seconds']} s)", flush=True)
    raw["text_plain"] = plain
    fitting = [m for m, r in plain.items() if r.get("fits")]
    for run, r in runs.items():
        if not fitting or "ks" not in r:
            continue
        batch = r["batch"]
        best, best_k = best_micro(batch, max(fitting))
        longest = max(r["lengths"])
        ks = [k for length, k in zip(r["lengths"], r["ks"]) if length == longest]
        settled = -(-batch // ks[-1])
        print(f"{run} run, longest bucket ({longest}): settled k={ks[-1]} (micro-batch "
              f"{settled}), best k={best_k} (micro-batch {best}, the largest "
              f"ceil({batch} / k) <= {max(fitting)}): {settled / best:.2f} of best")


def part_text_steps(args, raw):
    print(f"\n## text_steps: {TEXT_CAP_MIB} MiB cap, 512-token batches of 256, "
          "the guard's step peak at fixed counts")
    print("| counts per batch | peak per batch (MiB; - = out of memory) |")
    print("| --- | --- |")
    for text, schedule in count_schedules(args.text_schedules):
        r = run_child({"part": "text_steps", "schedule": schedule}, TEXT_CAP_MIB)
        raw.setdefault("text_steps", {})[text] = r
        if "error" in r:
            print(f"schedule {text}: failed\n{r['error']}")
            continue
        cells = ", ".join("-" if p is None else str(p) for p in r["peaks_mib"])
        print(f"| {text} | {cells} |", flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = json.loads(sys.argv[2])
        from keras_memguard.testing import emit_result

        emit_result(CHILDREN[spec["part"]](spec))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run, of {','.join(PARTS)}")
    parser.add_argument("--batches", default="272,408,1024")
    parser.add_argument(
        "--best", type=int, default=160,
        help=("the largest batch plain training was measured to fit under the "
              f"{CAP_MIB} MiB cap with the region reserved (136, 147, 160 fit; "
              "170 and 204 do not; without the reservation it was 136)"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--input", choices=("dataset", "numpy"), default="dataset",
                        help=("part cnn: a tf.data pipeline that prefetches nothing, "
                              "or numpy arrays through Keras' own pipeline"))
    parser.add_argument("--schedules", default="3,3;8,3;16,3;32,3",
                        help="';'-separated micro-batch count schedules (batch 408)")
    parser.add_argument("--text-micro", default="128,160,192,256",
                        help="micro-batch sizes of plain 512-token training")
    parser.add_argument("--text-threshold", type=float, default=0.9,
                        help="the guard's threshold in the text part")
    parser.add_argument("--text-schedules", default="2,2,2;3,3,3,2,2,2;1,2,2,2",
                        help="';'-separated count schedules of part text_steps")
    parser.add_argument("--apps", default="ResNet50,EfficientNetB0,MobileNetV2",
                        help="part apps: keras.applications models")
    parser.add_argument("--apps-batch", type=int, default=32)
    parser.add_argument("--apps-steps", type=int, default=3)
    parser.add_argument("--apps-cap", type=float, default=0.55,
                        help="part apps: the cap as a share of plain training's peak")
    parser.add_argument("--repeat-runs", type=int, default=6,
                        help="part repeat: runs from an empty plan cache")
    parser.add_argument("--json", help="also write every raw result here")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    raw = {}
    if "cost" in parts:
        cost, with_observe = plan_cost()
        raw["plan_us"], raw["observe_plan_us"] = cost, with_observe
        print(f"plan() per batch: {cost:.1f} us (median of 7 x 20000 calls)", flush=True)
        print(f"observe() + plan() per batch: {with_observe:.1f} us", flush=True)
    for name, part in (
        ("cnn", part_cnn), ("history", part_history), ("text", part_text),
        ("text_steps", part_text_steps), ("apps", part_apps), ("repeat", part_repeat),
    ):
        if name in parts:
            part(args, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
