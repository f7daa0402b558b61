"""Escalation rungs: does anything train a model that does not fit at batch 1?

Measurement for the planner issue ("Plan before running", item 6: escalate
when one sample per micro-batch does not fit, only where a saving is
measured). Run from the repository root:

    python bench/bench_escalation.py --jobs 2             # the grid (~30 min)
    python bench/bench_escalation.py --rounds 3 --caps 330 380 420
    python bench/bench_escalation.py --caps 480 --steps 5 --no-numerics  # timing
    python bench/bench_escalation.py --caps 330 380 --no-numerics \
        --variants after_oom_jit after_oom_remat after_oom_remat_jit
    python bench/bench_escalation.py --find-threshold     # plain's cap only
    python bench/bench_escalation.py --json /tmp/esc.json # raw trials too

The model does not fit at one sample under the low caps: 10
`Conv2D(64, 3, padding="same", activation="relu")` layers on 256x256x3
input, then `GlobalAveragePooling2D` and `Dense(10)`, SGD, sparse
categorical cross-entropy from logits, batch size 1. Every trial is one
child process (the cap is read once per process) under the real BFC CPU
allocator cap (`keras_memguard.testing.memory_cap_env`: BFC on, the cap in
MiB, oneDNN off), which builds the model and runs `model.fit` (the real
Keras train function, not `train_on_batch`) on a `tf.data` pipeline of
`--steps` batches for one epoch. The variants:

- `plain`: `compile(jit_compile=False)`.
- `jit`: `compile(jit_compile=True)` (XLA).
- `remat`: the same functional model with the convolutions grouped in
  segments of 3 layers (3+3+3+1), each segment a `RecomputeSegment` layer
  whose `call` is `tf.recompute_grad(run_the_segment)(x)`;
  `jit_compile=False`.
- `remat_jit`: `remat` with `jit_compile=True`.
- `rematscope`: the plain model built inside
  `keras.RematScope(mode="full")` (Keras 3.9+; skipped where missing);
  `jit_compile=False`.
- `rematscope_jit`: `rematscope` with `jit_compile=True`.
- `after_oom_jit`, `after_oom_remat`, `after_oom_remat_jit` (not in the
  default grid): plain `fit` on the first batch first (it runs out of memory
  under the low caps), then the rung switched on in the same process, on
  the same variables and optimizer, as a guard would have to do it
  (`jit`: `model.jit_compile = True` and
  `model.make_train_function(force=True)`; the remat rungs: a new
  functional model over the same layer objects, compiled with the same
  optimizer), then `fit` over all batches.

Before the grid, a variant that fails uncapped with an error that is not
about memory (the numerics child below) is left out of the grid and
reported (`--no-preflight` runs it anyway).

A trial is one of: `ok` (all steps trained), `oom`
(`ResourceExhaustedError`, or an XLA error whose text says
RESOURCE_EXHAUSTED / out of memory), `error` (any other exception, text
kept), `crash` (the process died without a result: exit status kept) or
`timeout`; "then exit N" marks a trial whose process returned its result
and then died with status N. Per trial it records the allocator peak
(`get_memory_info("CPU:0")["peak"]`, reset right before `fit`; read after
`fit` or after the error), the step time (median of the steps after the
first, from batch begin to batch end), and whether all weights are finite
after `fit`. Reading the peak: the BFC allocator counts a whole free chunk
as in use when it hands it out unsplit (it splits only when the chunk is at
least twice the request or the rest is at least 128 MiB), so a large single
request (XLA's temporary buffer) can read as nearly the whole cap; after an
out-of-memory error the peak leaves out the request that failed.

Numerics: one more child (a large 8 GiB cap, so nothing is short of memory)
builds every variant from the same initial weights and runs one `fit` step
on the same sample with SGD; it reports each variant's update against the
plain update (`max|dw_variant - dw_plain| / max|dw_plain|`, which is the
relative gradient difference, since SGD's update is `-lr * grad`), the
largest weight difference, and a second plain run as the noise floor.

Prints Markdown tables (the summary table: successes/trials, median peak
MiB over the successful trials (over all trials where none succeeded),
median step time).
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("plain", "jit", "remat", "remat_jit", "rematscope", "rematscope_jit")
# A rung switched on in the same process after plain training ran out of
# memory on its first batch (not in the default grid).
AFTER_OOM = ("after_oom_jit", "after_oom_remat", "after_oom_remat_jit")
DEFAULT_CAPS = (300, 330, 360, 380, 420, 480)
SEED = 1234
IMAGE = 256
CHANNELS = 64
DEPTH = 10
SEGMENT = 3
CLASSES = 10
LEARNING_RATE = 0.01
MIB = 1024 * 1024


# --------------------------------------------------------------------------
# Child side: runs under the cap, imports TensorFlow.
# --------------------------------------------------------------------------


def _build(variant, reuse=None, optimizer=None):
    """Returns `(model, named)`: the compiled model and its layers by name.

    With `reuse` (the `named` of an earlier model) and `optimizer` (its
    optimizer), the new model is built over the same layer objects (same
    variables) and compiled with that optimizer: a rung switched on in the
    same process.
    """
    import keras
    import tensorflow as tf

    use_jit = variant.endswith("_jit") or variant == "jit"
    keras.utils.set_random_seed(SEED)

    class RecomputeSegment(keras.layers.Layer):
        """Runs a few layers under `tf.recompute_grad` (one checkpoint)."""

        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner = list(inner)

        def build(self, input_shape):
            # Variables must exist before `tf.recompute_grad` traces the
            # segment (no variable creation inside a custom gradient).
            shape = input_shape
            for layer in self.inner:
                if not layer.built:  # built already when reused
                    layer.build(shape)
                shape = layer.compute_output_shape(shape)

        def call(self, x):
            def run_segment(t):
                for layer in self.inner:
                    t = layer(t)
                return t

            # Positional only: custom_gradient rejects keyword arguments
            # outside eager execution.
            return tf.recompute_grad(run_segment)(x)

        def compute_output_shape(self, input_shape):
            for layer in self.inner:
                input_shape = layer.compute_output_shape(input_shape)
            return input_shape

    def layers_and_model():
        if reuse is not None:
            convs = [reuse[f"conv{i}"] for i in range(DEPTH)]
            head = reuse["head"]
        else:
            convs = [
                keras.layers.Conv2D(
                    CHANNELS, 3, padding="same", activation="relu", name=f"conv{i}"
                )
                for i in range(DEPTH)
            ]
            head = keras.layers.Dense(CLASSES, name="head")
        inputs = keras.Input((IMAGE, IMAGE, 3))
        x = inputs
        if variant.startswith("remat") and not variant.startswith("rematscope"):
            for start in range(0, DEPTH, SEGMENT):
                x = RecomputeSegment(
                    convs[start : start + SEGMENT], name=f"segment{start // SEGMENT}"
                )(x)
        else:
            for conv in convs:
                x = conv(x)
        x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
        outputs = head(x)
        model = keras.Model(inputs, outputs, name=f"convnet_{variant}")
        named = {layer.name: layer for layer in convs + [head]}
        return model, named

    if variant.startswith("rematscope"):
        if not hasattr(keras, "RematScope"):
            raise NotImplementedError(
                f"keras.RematScope is missing in Keras {keras.__version__}"
            )
        with keras.RematScope(mode="full"):
            model, named = layers_and_model()
    else:
        model, named = layers_and_model()
    if optimizer is None:
        optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=use_jit,
    )
    return model, named


def _data(steps):
    import numpy as np

    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((steps, IMAGE, IMAGE, 3), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(steps,)).astype("int32")
    return x, y


def _dataset(steps):
    import tensorflow as tf

    x, y = _data(steps)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(1)


def _is_oom(error):
    import tensorflow as tf

    if isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _first_line(error, limit=300):
    """The error's type and its first informative lines, without colours."""
    import re

    lines = [
        re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        for line in str(error).splitlines()
    ]
    lines = [line for line in lines if line and not line.startswith("Exception encountered")]
    text = " ".join(lines[:2])
    oom = re.search(r"OOM when allocating tensor with shape\[[^\]]*\]", str(error))
    if oom:
        text = oom.group(0) + "; " + text
    return (type(error).__name__ + ": " + text)[:limit]


def _versions():
    import platform

    import keras
    import tensorflow as tf

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def child_trial(config):
    """One (variant, cap) trial: `fit` for `steps` batches, one epoch."""
    import keras
    import numpy as np
    import tensorflow as tf

    result = {"variant": config["variant"], **_versions()}
    step_times = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            step_times.append(time.perf_counter() - self._start)

    variant = config["variant"]
    if config.get("reserve"):
        from keras_memguard.backends.tensorflow import region

        result["reserved_mib"] = (
            region.reserve_region("CPU:0", config["cap_mib"] * MIB) / MIB
        )
    try:
        model, named = _build("plain" if variant in AFTER_OOM else variant)
    except NotImplementedError as error:
        result.update(status="skipped", message=str(error))
        return result
    dataset = _dataset(config["steps"])
    if variant in AFTER_OOM:
        # Plain first, on the first batch; then the rung on the same
        # variables and optimizer, as a guard would do it.
        try:
            model.fit(dataset.take(1), epochs=1, verbose=0)
            result["first_status"] = "ok"
        except Exception as error:
            result["first_status"] = "oom" if _is_oom(error) else "error"
            result["first_message"] = _first_line(error)
        rung = variant[len("after_oom_") :]
        if rung == "jit":
            model.jit_compile = True
            model.make_train_function(force=True)
        else:
            model, _ = _build(rung, reuse=named, optimizer=model.optimizer)
    tf.config.experimental.reset_memory_stats("CPU:0")
    result["current_before_fit_mib"] = (
        tf.config.experimental.get_memory_info("CPU:0")["current"] / MIB
    )
    try:
        model.fit(dataset, epochs=1, verbose=0, callbacks=[StepTimer()])
        status, message = "ok", ""
    except Exception as error:  # classified below; a result is all we keep
        status = "oom" if _is_oom(error) else "error"
        message = _first_line(error)
    info = tf.config.experimental.get_memory_info("CPU:0")
    result.update(
        status=status,
        message=message,
        steps_done=len(step_times),
        peak_mib=info["peak"] / MIB,
        step_times_s=step_times,
        step_time_s=statistics.median(step_times[1:]) if len(step_times) > 1 else None,
    )
    if status == "ok":
        result["finite"] = bool(
            all(np.all(np.isfinite(np.asarray(w))) for w in model.get_weights())
        )
    return result


def child_numerics(config):
    """One `fit` step per variant from the same weights on the same sample."""
    import numpy as np
    import tensorflow as tf

    x, y = _data(1)

    def one_step(variant, initial):
        model, named = _build(variant)
        if initial is not None:
            for name, weights in initial.items():
                named[name].set_weights(weights)
        before = {name: [np.array(w) for w in layer.get_weights()] for name, layer in named.items()}
        tf.config.experimental.reset_memory_stats("CPU:0")
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(1)
        model.fit(dataset, epochs=1, verbose=0)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / MIB
        after = {name: [np.array(w) for w in layer.get_weights()] for name, layer in named.items()}
        return before, after, peak

    result = {"variants": {}, **_versions()}
    initial, plain_after, peak = one_step("plain", None)
    result["variants"]["plain"] = {"status": "ok", "peak_mib": peak}
    plain_update = np.concatenate(
        [(a - b).ravel() for n in initial for a, b in zip(plain_after[n], initial[n])]
    )
    plain_after_flat = np.concatenate([a.ravel() for n in initial for a in plain_after[n]])
    scale = float(np.max(np.abs(plain_update)))
    for variant in ["plain_again"] + [v for v in config["variants"] if v != "plain"]:
        build_as = "plain" if variant == "plain_again" else variant
        try:
            before, after, peak = one_step(build_as, initial)
        except NotImplementedError as error:
            result["variants"][variant] = {"status": "skipped", "message": str(error)}
            continue
        except Exception as error:  # kept as a result
            result["variants"][variant] = {"status": "error", "message": _first_line(error)}
            continue
        update = np.concatenate(
            [(a - b).ravel() for n in initial for a, b in zip(after[n], before[n])]
        )
        after_flat = np.concatenate([a.ravel() for n in initial for a in after[n]])
        result["variants"][variant] = {
            "status": "ok",
            "peak_mib": peak,
            "update_rel_diff": float(np.max(np.abs(update - plain_update)) / scale),
            "weight_max_abs_diff": float(np.max(np.abs(after_flat - plain_after_flat))),
            "finite": bool(np.all(np.isfinite(after_flat))),
        }
    result["plain_update_max_abs"] = scale
    return result


def child_guard_rung(config):
    """Step time of `MemoryGuard`'s own step with and without its remat rung
    (memory: the trials above).

    One process, generous cap; the two variants alternate, the order
    reversed every other round, each a `fit` of `steps` batches of one
    sample (the first step, which compiles, left out).
    """
    import keras

    import keras_memguard
    from keras_memguard.backends.tensorflow import remat

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((256, 256, 3))]
        + [keras.layers.Conv2D(64, 3, padding="same", activation="relu")
           for _ in range(10)]
        + [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)]
    )
    model.compile(keras.optimizers.SGD(0.01),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    dataset = _dataset(config["steps"])
    times = {"plain": [], "remat": []}

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    for round_ in range(config["rounds"]):
        order = ("plain", "remat") if round_ % 2 == 0 else ("remat", "plain")
        for variant in order:
            if variant == "remat":
                remat.switch_on(model)
            else:
                remat.switch_off(model)
            timer = StepTimer()
            timer.times = []
            guard = keras_memguard.MemoryGuard(
                memory_limit=1 << 40, plan=False, micro_batches=1, cooldown=10**9
            )
            model.fit(dataset, epochs=1, verbose=0, callbacks=[timer, guard])
            times[variant].append(statistics.median(timer.times[1:]))
    ratios = [r / p for r, p in zip(times["remat"], times["plain"])]
    return {
        "kind": "guard_rung",
        "step_s": {v: statistics.median(t) for v, t in times.items()},
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        **_versions(),
    }


def child_main(config):
    import logging

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.get_logger().setLevel(logging.ERROR)
    if config["kind"] == "trial":
        out = child_trial(config)
    elif config["kind"] == "guard_rung":
        out = child_guard_rung(config)
    else:
        out = child_numerics(config)
    from keras_memguard.testing import emit_result

    emit_result(out)
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Parent side: never imports TensorFlow.
# --------------------------------------------------------------------------


def run_child(config, cap_mib, timeout):
    from keras_memguard.testing import run_script_with_memory_cap

    start = time.perf_counter()
    try:
        completed = run_script_with_memory_cap(
            [os.path.abspath(__file__), "--child", json.dumps(config)],
            cap_mib, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return {
            "variant": config.get("variant"),
            "status": "timeout",
            "returncode": None,
            "wall_s": time.perf_counter() - start,
        }
    wall = time.perf_counter() - start
    result = completed.result
    if result is None:
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
        result = {
            "variant": config.get("variant"),
            "status": "crash",
            "message": " | ".join(tail)[-400:],
        }
    result["returncode"] = completed.returncode
    result["wall_s"] = wall
    return result


def trial(variant, cap, steps, timeout, reserve=False):
    config = {"kind": "trial", "variant": variant, "steps": steps,
              "cap_mib": cap, "reserve": reserve}
    out = run_child(config, cap, timeout)
    out["cap_mib"] = cap
    return out


def _describe(r):
    status = r["status"]
    if status == "crash":
        status = f"crash(rc={r['returncode']})"
    extra = ""
    if r.get("peak_mib") is not None:
        extra += f" peak={r['peak_mib']:.0f}MiB"
    if r.get("step_time_s") is not None:
        extra += f" step={r['step_time_s']:.2f}s"
    if r.get("status") == "ok":
        extra += f" finite={r.get('finite')}"
    if r.get("message") and r["status"] != "ok":
        extra += f" [{r['message'][:120]}]"
    if r.get("first_status"):
        extra += f" first(plain)={r['first_status']}"
    if r.get("returncode") not in (0, None) and r["status"] != "crash":
        extra += f" exit={r['returncode']}"
    return f"{r['variant']:>15} cap={r['cap_mib']:>4} {status}{extra} ({r['wall_s']:.0f}s wall)"


def find_threshold(low, high, steps, timeout, variant="plain", resolution=10,
                   reserve=False):
    """Bisects the lowest cap at which `variant` trains once (one trial each)."""
    trials = []
    while high - low > resolution:
        mid = (low + high) // 2
        r = trial(variant, mid, steps, timeout, reserve=reserve)
        trials.append(r)
        print(_describe(r), flush=True)
        if r["status"] == "ok":
            high = mid
        else:
            low = mid
    return high, trials


def summarize(trials, variants, caps):
    header = "| variant | " + " | ".join(f"{c} MiB" for c in caps) + " |"
    lines = [header, "|---|" + "---:|" * len(caps)]
    for variant in variants:
        cells = []
        for cap in caps:
            rs = [r for r in trials if r["variant"] == variant and r["cap_mib"] == cap]
            if not rs:
                cells.append("")
                continue
            if all(r["status"] == "skipped" for r in rs):
                cells.append("n/a")
                continue
            ok = [r for r in rs if r["status"] == "ok" and r.get("finite", True)]
            base = ok if ok else [r for r in rs if r.get("peak_mib") is not None]
            cell = f"{len(ok)}/{len(rs)}"
            if base:
                cell += f", {statistics.median(r['peak_mib'] for r in base):.0f}"
            times = [r["step_time_s"] for r in ok if r.get("step_time_s") is not None]
            if times:
                cell += f", {statistics.median(times):.2f} s"
            failures = {}
            for r in rs:
                key = r["status"]
                if key == "ok" and not r.get("finite", True):
                    key = "non-finite"
                if key == "crash":
                    key = f"crash rc={r['returncode']}"
                elif r.get("returncode") not in (0, None):
                    # The result came back, then the process died.
                    key += f" then exit {r['returncode']}"
                if key != "ok":
                    failures[key] = failures.get(key, 0) + 1
            if failures:
                cell += " (" + ", ".join(f"{n} {k}" for k, n in failures.items()) + ")"
            firsts = [r["first_status"] for r in rs if r.get("first_status")]
            if firsts:
                cell += f"; plain first: {firsts.count('oom')}/{len(firsts)} oom"
            cells.append(cell)
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def numerics_table(numerics):
    lines = [
        "| variant | uncapped peak (MiB) | max abs weight diff vs plain | update diff / max plain update |",
        "|---|---:|---:|---:|",
    ]
    for variant, r in numerics["variants"].items():
        if r["status"] != "ok":
            lines.append(f"| {variant} | {r['status']}: {r['message'][:100]} | | |")
        elif variant == "plain":
            lines.append(f"| plain | {r['peak_mib']:.0f} | (reference) | (reference) |")
        else:
            lines.append(
                f"| {variant} | {r['peak_mib']:.0f} | {r['weight_max_abs_diff']:.2e} "
                f"| {r['update_rel_diff']:.2e} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="trials per (variant, cap)")
    parser.add_argument("--caps", type=int, nargs="+", default=list(DEFAULT_CAPS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        choices=VARIANTS + AFTER_OOM)
    parser.add_argument("--steps", type=int, default=3, help="batches per fit (one epoch)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    parser.add_argument("--find-threshold", action="store_true",
                        help="only bisect plain's lowest working cap (one trial per cap)")
    parser.add_argument("--no-numerics", action="store_true")
    parser.add_argument("--no-preflight", action="store_true",
                        help="run variants in the grid even if they fail uncapped")
    parser.add_argument("--jobs", type=int, default=1,
                        help="trials run at once (each is its own capped process); "
                        "more than 1 makes step times noisier")
    parser.add_argument("--json", help="also write every raw trial here")
    parser.add_argument("--guard-rung", action="store_true",
                        help="only MemoryGuard's step with and without its remat "
                        "rung: step time, one process under a 2 GiB cap")
    parser.add_argument("--reserve", action="store_true",
                        help="reserve the rest of the cap in one allocator region "
                        "first, as MemoryGuard does when planning")
    args = parser.parse_args(argv)

    if args.guard_rung:
        out = run_child(
            {"kind": "guard_rung", "steps": args.steps, "rounds": args.rounds},
            2048, args.timeout * 10,
        )
        print(json.dumps(out))
        return

    if args.find_threshold:
        cap, _ = find_threshold(
            200, 800, args.steps, args.timeout, variant=args.variants[0],
            reserve=args.reserve,
        )
        print(f"{args.variants[0]} trains at {cap} MiB, not {cap - 10} MiB or less (one trial each)")
        return

    start = time.perf_counter()
    trials = []
    numerics = None
    if not args.no_numerics:
        numerics = run_child(
            {"kind": "numerics", "variants": [v for v in args.variants if v in VARIANTS]}, 8192, args.timeout * 3
        )
        print(json.dumps(numerics), flush=True)
    # Rounds outermost, and within a round the caps and variants interleaved,
    # so slow drift in the machine's load spreads over every cell.
    variants = list(args.variants)
    skipped_note = ""
    if numerics is not None and not args.no_preflight:
        # A variant that fails with a non-memory error under the 8 GiB cap
        # fails the same way under every cap: no need to repeat it.
        failing = {
            v: r["message"]
            for v, r in numerics.get("variants", {}).items()
            if r.get("status") in ("error", "skipped")
        }
        for v, message in failing.items():
            if v in variants:
                variants.remove(v)
                skipped_note += f"\n- {v}: left out of the grid, uncapped it gave: {message}"
    plan = []
    for round_index in range(args.rounds):
        for cap in args.caps:
            order = list(variants)
            if round_index % 2:
                order.reverse()
            plan.extend((round_index, cap, v) for v in order)

    def run_one(item):
        round_index, cap, variant = item
        r = trial(variant, cap, args.steps, args.timeout, reserve=args.reserve)
        r["round"] = round_index
        print(_describe(r), flush=True)
        return r

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        trials = list(pool.map(run_one, plan))
    versions = next(
        ({k: r[k] for k in ("python", "tensorflow", "keras")} for r in trials if "keras" in r),
        {},
    )
    print()
    print(f"Versions: {versions}; {args.rounds} rounds, {args.steps} steps per fit, "
          f"{args.jobs} trial(s) at a time; "
          f"total wall {time.perf_counter() - start:.0f} s")
    print("Cell: successes/trials, median peak MiB (of successful trials, else of all), "
          "median step time")
    print()
    print(summarize(trials, variants, args.caps))
    if skipped_note:
        print(skipped_note)
    if numerics is not None and numerics.get("status") not in ("crash", "timeout"):
        print()
        print(numerics_table(numerics))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "trials": trials, "numerics": numerics,
                 "versions": versions},
                f,
                indent=1,
            )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        main()
