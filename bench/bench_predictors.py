"""How well can a training step's peak memory be predicted before it runs?

For two models of different shapes (the 64x64x3 CNN of the design notes and
`bench_planner.py`, and a one-block Transformer-style text model) at several
micro-batch sizes, this measures the real peak of one training step and
compares it with what each predictor said.

The measured peak: each (model, size, step kind) runs in a fresh child
process under the BFC CPU allocator with an 8 GiB cap (so every allocation is
counted and nothing fails) and oneDNN off, as `keras_memguard.testing` does.
The step is Keras' own `model.train_step((x, y))` inside `tf.function`, as
`model.make_train_function` wraps it: `jit_compile=False` ("plain") or
`jit_compile=True` ("jit"). Step 1 traces (and compiles); the measured peak
is `get_memory_info("CPU:0")["peak"]` of step 2, after `reset_memory_stats`.
The allocator's history changes peaks, so every measurement is its own
process; the children of a round run one after the other in a shuffled
order, and the figure is the median over the rounds.

Predictors:
1. planner: `keras_memguard.decider`'s line, fitted by `observe` from the
   measured peaks at two sizes (with `current` before the step as
   `base_bytes`), `predict_peak` at the others.
2. static: from the built model's static shapes, no step run: the bytes of
   every layer's output at that micro-batch (activations kept for the
   backward pass) plus the input batch, plus 4x the trainable weights
   (weights, gradients, Adam's two slots) and the other variables once.
3. XLA: the HloProto of the jit step
   (`experimental_get_compiler_ir(x, y)(stage="optimized_hlo_proto_serialized")`,
   parsed with `tensorflow.compiler.xla.service.hlo_pb2`): the sum of its
   buffer allocations' sizes (the figure TensorFlow's own tests take as the
   peak), compared with both steps. A second row lays the allocator's chunk
   rule over it: each non-parameter allocation of 1 MiB or more is taken to
   get a fresh BFC region (regions double from 2 MiB) that is split only
   when it is at least twice the request or 128 MiB would remain
   (bfc_allocator.cc), the chunk counted whole otherwise.
4. profiler: a `tf.profiler.experimental` trace of step 3, its
   MemoryAllocation/MemoryDeallocation events read from the `.xplane.pb`:
   the allocator's own peak (should equal `get_memory_info`), and the peak of
   the bytes the step *requested* (before the allocator's rounding). A
   measurement of the same step, not a prediction: it tells how much of the
   peak is rounding.
5. BFC memory dump (`--oom`): one step under a cap that fails, with
   `TF_BFC_MEMORY_DUMP`; the `MemoryDump`s written at the out-of-memory error
   (one per failed attempt) are parsed
   (`tensorflow.core.protobuf.bfc_memory_map_pb2`), and the failed request
   (from the error message) is set against the largest free chunk and the
   room under the cap not yet reserved by the allocator's regions. By
   default: the CNN's plain step at micro-batch 138 and its jit step at 128,
   both under 600 MiB (an XLA out-of-memory error aborts the process; the
   dump is written before).

Run from the repository root (about 12 minutes on 2 shared cores):

    python bench/bench_predictors.py [--rounds 2] [--sizes 8,16,32,64,128]
        [--models cnn,text] [--oom cnn:plain:138:600,cnn:jit:128:600]
        [--json out.json]
"""

import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the package of this checkout, without TensorFlow
from keras_memguard.testing import emit_result  # noqa: E402

MIB = 2**20
UNCAPPED_MIB = 8192

# The text model: token ids in, one Transformer block, a class out.
TEXT_VOCAB = 8000
TEXT_LEN = 128
TEXT_DIM = 128
TEXT_HEADS = 4
TEXT_FFN = 512
CLASSES = 10

# BFC allocator constants (tensorflow/core/common_runtime/bfc_allocator.cc,
# xla/tsl/framework/bfc_allocator.cc): the first region of a growing
# allocator, and the largest waste a chunk may carry without being split.
BFC_FIRST_REGION = 2 * MIB
BFC_MAX_INTERNAL_FRAGMENTATION = 128 * MIB
BFC_MIN_ALLOCATION = 256


# --------------------------------------------------------------------------
# Child side (TensorFlow imported here only: the parent sets the cap).


def build_model(kind):
    """The model `kind` ("cnn" or "text"), seeded, compiled with Adam."""
    import keras

    if kind == "cnn":
        sys.path.insert(0, ROOT)
        from tests.programs.common import design_cnn

        return design_cnn()
    if kind != "text":
        raise ValueError(f"unknown model {kind!r}")
    keras.utils.set_random_seed(0)
    layers = keras.layers
    tokens = keras.Input((TEXT_LEN,), dtype="int32")
    h = layers.Embedding(TEXT_VOCAB, TEXT_DIM)(tokens)
    a = layers.MultiHeadAttention(TEXT_HEADS, TEXT_DIM // TEXT_HEADS)(h, h)
    h = layers.LayerNormalization()(layers.Add()([h, a]))
    f = layers.Dense(TEXT_FFN, activation="relu")(h)
    f = layers.Dense(TEXT_DIM)(f)
    h = layers.LayerNormalization()(layers.Add()([h, f]))
    h = layers.GlobalAveragePooling1D()(h)
    model = keras.Model(tokens, layers.Dense(CLASSES)(h))
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def make_batch(kind, size, tf):
    if kind == "cnn":
        x = tf.random.stateless_uniform((size, 64, 64, 3), seed=(1, 0))
    else:
        x = tf.random.stateless_uniform(
            (size, TEXT_LEN), seed=(1, 0), maxval=TEXT_VOCAB, dtype=tf.int32
        )
    y = tf.random.stateless_uniform(
        (size,), seed=(2, 0), maxval=CLASSES, dtype=tf.int32
    )
    return x, y


def sample_size(kind):
    """Elements of one sample's inputs (the planner's `sample_size`)."""
    return 64 * 64 * 3 if kind == "cnn" else TEXT_LEN


def static_prediction(model, x, y):
    """Bytes predicted from static shapes: `(fixed, per_batch)` at x's batch."""
    import keras
    import numpy as np

    size = int(x.shape[0])
    per_sample = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        for out in keras.tree.flatten(layer.output):
            elements = int(np.prod([d for d in out.shape[1:]]))
            per_sample += elements * np.dtype(out.dtype).itemsize
    batch_bytes = x.shape.num_elements() * x.dtype.size
    batch_bytes += y.shape.num_elements() * y.dtype.size
    trainable = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in model.trainable_variables
    )
    trainable_ids = {id(v) for v in model.trainable_variables}
    others = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in model.variables
        if id(v) not in trainable_ids
    )
    # Adam's two slots per weight are counted in the 4x; the rest once.
    other_opt = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in model.optimizer.variables
    ) - 2 * trainable
    fixed = 4 * trainable + others + max(other_opt, 0)
    return {
        "fixed": fixed,
        "activations": per_sample * size,
        "batch_bytes": batch_bytes,
        "trainable_bytes": trainable,
        "total": fixed + per_sample * size + batch_bytes,
    }


def parse_hlo(serialized):
    """Buffer allocations of a serialized HloProto, by kind, in bytes."""
    from tensorflow.compiler.xla.service import hlo_pb2

    proto = hlo_pb2.HloProto()
    proto.ParseFromString(serialized)
    kinds = {"parameter": 0, "constant": 0, "output": 0, "temp": 0}
    large = []
    for alloc in proto.buffer_assignment.buffer_allocations:
        if alloc.is_entry_computation_parameter:
            kind = "parameter"
        elif alloc.is_constant:
            kind = "constant"
        elif alloc.maybe_live_out:
            kind = "output"
        else:
            kind = "temp"
        kinds[kind] += alloc.size
        if kind != "parameter" and alloc.size >= MIB:
            large.append(alloc.size)
    return {
        "sum": sum(kinds.values()),
        "allocations": len(proto.buffer_assignment.buffer_allocations),
        "by_kind": kinds,
        "large_non_parameter": sorted(large, reverse=True),
    }


def read_profile(logdir):
    """Allocation events of the CPU allocator in a profiler trace."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return None
    space = xplane_pb2.XSpace()
    with open(max(files, key=os.path.getmtime), "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = plane.event_metadata
        stat_names = plane.stat_metadata
        for line in plane.lines:
            for event in line.events:
                name = names[event.metadata_id].name
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {}
                for stat in event.stats:
                    key = stat_names[stat.metadata_id].name
                    if stat.HasField("ref_value"):
                        stats[key] = stat_names[stat.ref_value].name
                    else:
                        stats[key] = (
                            stat.int64_value or stat.uint64_value
                            or stat.double_value or stat.str_value
                        )
                events.append((line.timestamp_ns + event.offset_ps // 1000,
                               name, stats))
    events.sort(key=lambda e: e[0])
    live = {}
    requested = peak_requested = 0
    peak_in_use = 0
    largest = (0, "")
    fragmentation = 0.0
    for _, name, stats in events:
        if stats.get("allocator_name") not in (None, "bfc_cpu_allocator_for_gpu"):
            continue
        addr = stats.get("addr")
        if name == "MemoryAllocation":
            size = int(stats.get("requested_bytes") or 0)
            live[addr] = size
            requested += size
            if size > largest[0]:
                largest = (size, str(stats.get("tf_op", "")))
        else:
            requested -= live.pop(addr, 0)
        peak_requested = max(peak_requested, requested)
        peak_in_use = max(peak_in_use, int(stats.get("peak_bytes_in_use") or 0))
        fragmentation = max(fragmentation, float(stats.get("fragmentation") or 0))
    return {
        "events": len(events),
        "peak_requested_above_start": peak_requested,
        "peak_bytes_in_use": peak_in_use,
        "largest_request": largest[0],
        "largest_request_op": largest[1],
        "max_fragmentation": fragmentation,
    }


def child_measure(task):
    import tensorflow as tf

    model_kind, size, mode = task["model"], task["size"], task["mode"]
    model = build_model(model_kind)
    x, y = make_batch(model_kind, size, tf)
    if not model.built:
        model.build(x.shape)
    model.optimizer.build(model.trainable_variables)
    start = time.perf_counter()
    static = static_prediction(model, x, y)
    static["seconds"] = time.perf_counter() - start

    step = tf.function(
        lambda x, y: model.train_step((x, y)), jit_compile=(mode == "jit")
    )
    info = tf.config.experimental.get_memory_info
    steps = []
    for _ in range(2):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = info("CPU:0")["current"]
        start = time.perf_counter()
        float(step(x, y)["loss"])
        steps.append({
            "seconds": time.perf_counter() - start,
            "current_before": before,
            "peak": info("CPU:0")["peak"],
        })
    result = {"task": task, "steps": steps, "static": static}

    # Step 3 under the profiler.
    logdir = tempfile.mkdtemp(prefix="predictors_prof_")
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = info("CPU:0")["current"]
        start = time.perf_counter()
        tf.profiler.experimental.start(logdir)
        float(step(x, y)["loss"])
        tf.profiler.experimental.stop()
        traced = time.perf_counter() - start
        peak = info("CPU:0")["peak"]
        start = time.perf_counter()
        profile = read_profile(logdir)
        if profile is not None:
            profile.update({
                "trace_seconds": traced,
                "parse_seconds": time.perf_counter() - start,
                "current_before": before,
                "peak": peak,
            })
        result["profile"] = profile
    finally:
        shutil.rmtree(logdir, ignore_errors=True)

    if mode == "jit" and task.get("ir", True):
        start = time.perf_counter()
        serialized = step.experimental_get_compiler_ir(x, y)(
            stage="optimized_hlo_proto_serialized"
        )
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        xla = parse_hlo(serialized)
        xla["compile_seconds"] = compiled
        xla["parse_seconds"] = time.perf_counter() - start
        result["xla"] = xla
    return result


def oom_request_bytes(message):
    """Bytes of the tensor an out-of-memory message names, or `None`."""
    match = re.search(r"allocate ([\d.]+)([KMG]i)?B", message)
    if match:  # XLA: "Out of memory while trying to allocate 591.52MiB."
        scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[match.group(2)]
        return int(float(match.group(1)) * scale)
    match = re.search(r"shape\[([\d,]+)\] and type (\w+)", message)
    if not match:
        return None
    itemsize = {"float": 4, "int32": 4, "double": 8, "half": 2, "int64": 8}
    return math.prod(int(d) for d in match.group(1).split(",")) * itemsize.get(
        match.group(2), 4)


def read_dump(path):
    from tensorflow.core.protobuf import bfc_memory_map_pb2

    dump = bfc_memory_map_pb2.MemoryDump()
    with open(path, "rb") as f:
        dump.ParseFromString(f.read())
    in_use = [c for c in dump.chunk if c.in_use]
    free = [c for c in dump.chunk if not c.in_use]
    return {
        "allocator": dump.allocator_name,
        "bytes_in_use": dump.stats.bytes_in_use,
        "peak_bytes_in_use": dump.stats.peak_bytes_in_use,
        "largest_alloc_size": dump.stats.largest_alloc_size,
        "fragmentation_metric": dump.stats.fragmentation_metric,
        "num_allocs": dump.stats.num_allocs,
        "chunks_in_use": len(in_use),
        "in_use_chunk_bytes": sum(c.size for c in in_use),
        "in_use_requested_bytes": sum(c.requested_size for c in in_use),
        "free_chunks": len(free),
        "free_bytes": sum(c.size for c in free),
        "largest_free_chunk": max((c.size for c in free), default=0),
        "reserved_bytes": sum(c.size for c in dump.chunk),
        "op_names": sorted({c.op_name for c in dump.chunk}),
        "snapshots": len(dump.snap_shot),
    }


def child_oom(task):
    import tensorflow as tf

    model_kind, size, mode = task["model"], task["size"], task["mode"]
    model = build_model(model_kind)
    x, y = make_batch(model_kind, size, tf)
    if not model.built:
        model.build(x.shape)
    model.optimizer.build(model.trainable_variables)
    static = static_prediction(model, x, y)
    step = tf.function(
        lambda x, y: model.train_step((x, y)), jit_compile=(mode == "jit")
    )
    info = tf.config.experimental.get_memory_info
    result = {"task": task, "static": static}
    if mode == "jit":
        # Compiled before the step: its out-of-memory error aborts the process.
        result["xla"] = parse_hlo(step.experimental_get_compiler_ir(x, y)(
            stage="optimized_hlo_proto_serialized"))
    before = info("CPU:0")["current"]
    result["current_before"] = before
    start = time.perf_counter()
    # Sent before the step: an XLA out-of-memory error can abort the process.
    emit_result(result)
    try:
        float(step(x, y)["loss"])
        result["failed"] = False
        result["peak"] = info("CPU:0")["peak"]
    except tf.errors.ResourceExhaustedError as error:
        result["failed"] = True
        result["message"] = str(error).splitlines()[0][:400]
        result["request_bytes"] = oom_request_bytes(str(error))
    result["seconds"] = time.perf_counter() - start
    if mode == "plain":
        # What XLA's buffer assignment says of the same step (compiled only).
        jit_step = tf.function(
            lambda x, y: model.train_step((x, y)), jit_compile=True
        )
        try:
            result["xla"] = parse_hlo(jit_step.experimental_get_compiler_ir(x, y)(
                stage="optimized_hlo_proto_serialized"))
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            result["xla_error"] = repr(error)[:300]
    return result


def child_main(task):
    import warnings

    warnings.simplefilter("ignore")
    handler = child_oom if task["kind"] == "oom" else child_measure
    result = handler(task)
    emit_result(result)


# --------------------------------------------------------------------------
# Parent side (no TensorFlow).


def run_child(task, cap_mib, extra_env=None, timeout=600):
    from keras_memguard.testing import run_script_with_memory_cap

    start = time.perf_counter()
    out = run_script_with_memory_cap(
        [os.path.abspath(__file__), "--child", json.dumps(task)],
        cap_mib, timeout=timeout, env=extra_env, check=False,
    )
    result = out.result
    if result is None:
        raise RuntimeError(
            f"child {task} exited {out.returncode} with no result:\n"
            f"{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        )
    result["returncode"] = out.returncode
    result["process_seconds"] = time.perf_counter() - start
    return result


def bfc_counted(request):
    """Bytes a fresh BFC region counts for one large request (see docstring)."""
    rounded = -(-request // BFC_MIN_ALLOCATION) * BFC_MIN_ALLOCATION
    region = BFC_FIRST_REGION
    while region < rounded:
        region *= 2
    if region >= 2 * rounded or region - rounded >= BFC_MAX_INTERNAL_FRAGMENTATION:
        return rounded
    return region


def xla_bfc(xla):
    """XLA's buffer sum with each large temporary counted as a BFC chunk."""
    small = xla["sum"] - sum(xla["large_non_parameter"])
    return small + sum(bfc_counted(s) for s in xla["large_non_parameter"])


def rel(pred, measured):
    return (pred - measured) / measured


def summarize(values):
    errors = [abs(v) for v in values]
    return {
        "median_abs": statistics.median(errors),
        "max_abs": max(errors),
        "min_signed": min(values),
        "max_signed": max(values),
    }


def median_of(results, path):
    values = []
    for r in results:
        value = r
        for key in path:
            value = value[key] if value is not None else None
        if value is not None:
            values.append(value)
    return statistics.median(values) if values else None


def analyse(measurements, sizes, models):
    """Per (model, mode, size) medians and per predictor errors."""

    cells = {}
    for r in measurements:
        t = r["task"]
        cells.setdefault((t["model"], t["mode"], t["size"]), []).append(r)
    table = {}
    for key, rs in cells.items():
        cell = {
            "rounds": len(rs),
            "peak": median_of(rs, ("steps", 1, "peak")),
            "peaks": sorted(r["steps"][1]["peak"] for r in rs),
            "first_peak": median_of(rs, ("steps", 0, "peak")),
            "current_before": median_of(rs, ("steps", 1, "current_before")),
            "step_seconds": median_of(rs, ("steps", 1, "seconds")),
            "first_step_seconds": median_of(rs, ("steps", 0, "seconds")),
            "static": rs[0]["static"]["total"],
            "static_activations": rs[0]["static"]["activations"],
            "static_fixed": rs[0]["static"]["fixed"]
            + rs[0]["static"]["batch_bytes"],
            "static_seconds": median_of(rs, ("static", "seconds")),
        }
        profiled = [r for r in rs if r.get("profile")]
        if profiled:
            cell["profile_peak"] = median_of(profiled, ("profile", "peak_bytes_in_use"))
            cell["profile_step_peak"] = median_of(profiled, ("profile", "peak"))
            cell["profile_requested"] = statistics.median(
                r["profile"]["current_before"]
                + r["profile"]["peak_requested_above_start"] for r in profiled
            )
            cell["profile_trace_seconds"] = median_of(profiled, ("profile", "trace_seconds"))
            cell["profile_parse_seconds"] = median_of(profiled, ("profile", "parse_seconds"))
            cell["largest_request"] = profiled[0]["profile"]["largest_request"]
            cell["largest_request_op"] = profiled[0]["profile"]["largest_request_op"]
            cell["max_fragmentation"] = median_of(profiled, ("profile", "max_fragmentation"))
        with_xla = [r for r in rs if r.get("xla")]
        if with_xla:
            xla = with_xla[0]["xla"]
            cell["xla_sum"] = xla["sum"]
            cell["xla_by_kind"] = xla["by_kind"]
            cell["xla_large"] = xla["large_non_parameter"]
            cell["xla_bfc"] = xla_bfc(xla)
            cell["xla_compile_seconds"] = median_of(with_xla, ("xla", "compile_seconds"))
            cell["xla_parse_seconds"] = median_of(with_xla, ("xla", "parse_seconds"))
        table[key] = cell

    # Predictions and errors.
    rows = []  # one dict per (predictor, model, measured step)
    for model in models:
        ss = sample_size(model)
        for mode in ("plain", "jit"):
            if not all((model, mode, s) in table for s in sizes):
                continue
            measured = {s: table[(model, mode, s)]["peak"] for s in sizes}
            # 1. the planner's line from two sizes.
            for fit_sizes in ((sizes[0], sizes[1]), (sizes[-3], sizes[-2])):
                start = time.perf_counter()
                cells = [table[(model, mode, s)] for s in fit_sizes]
                preds = {s: decider_peak(cells, fit_sizes, ss, s) for s in sizes
                         if s not in fit_sizes}
                cost = (time.perf_counter() - start) * 1e6
                rows.append({
                    "predictor": f"planner line, fit at {fit_sizes[0]} and {fit_sizes[1]}",
                    "model": model, "target": mode,
                    "errors": {s: rel(p, measured[s]) for s, p in preds.items()},
                    "predicted": preds,
                    "cost": f"{cost:.0f} us + 2 measured steps",
                })
            # 2. static shapes.
            preds = {s: table[(model, mode, s)]["static"] for s in sizes}
            rows.append({
                "predictor": "static shapes",
                "model": model, "target": mode,
                "errors": {s: rel(p, measured[s]) for s, p in preds.items()},
                "predicted": preds,
                "cost": "{:.1f} ms".format(1e3 * statistics.median(
                    table[(model, mode, s)]["static_seconds"] for s in sizes)),
            })
            # 3. XLA's buffer assignment (always from the jit step's HLO).
            if all("xla_sum" in table.get((model, "jit", s), {}) for s in sizes):
                compile_s = statistics.median(
                    table[(model, "jit", s)]["xla_compile_seconds"] for s in sizes)
                for label, field in (("XLA buffer sum", "xla_sum"),
                                     ("XLA sum, BFC chunk rule", "xla_bfc")):
                    if field == "xla_bfc" and mode != "jit":
                        continue  # the rule models XLA's one temporary buffer
                    preds = {s: table[(model, "jit", s)][field] for s in sizes}
                    rows.append({
                        "predictor": label, "model": model, "target": mode,
                        "errors": {s: rel(p, measured[s]) for s, p in preds.items()},
                        "predicted": preds,
                        "cost": f"{compile_s:.1f} s (an XLA compile)",
                    })
            # 4. the profiler (a measurement of the same step).
            if all("profile_requested" in table[(model, mode, s)] for s in sizes):
                trace_s = statistics.median(
                    table[(model, mode, s)]["profile_trace_seconds"]
                    - table[(model, mode, s)]["step_seconds"] for s in sizes)
                parse_s = statistics.median(
                    table[(model, mode, s)]["profile_parse_seconds"] for s in sizes)
                # Against the peak of the profiled step itself (step 3).
                own = {s: table[(model, mode, s)]["profile_step_peak"] for s in sizes}
                for label, field in (
                    ("profiler: requested bytes (vs its own step)", "profile_requested"),
                    ("profiler: peak_bytes_in_use (vs its own step)", "profile_peak"),
                ):
                    preds = {s: table[(model, mode, s)][field] for s in sizes}
                    rows.append({
                        "predictor": label, "model": model, "target": mode,
                        "errors": {s: rel(p, own[s]) for s, p in preds.items()},
                        "predicted": preds,
                        "cost": f"{trace_s:+.2f} s trace, {parse_s * 1e3:.0f} ms parse"
                        " (after a step)",
                    })
    return table, rows


def decider_peak(cells, fit_sizes, ss, size):
    """The decider's predicted peak at `size`, from steps measured at `fit_sizes`.

    The memory in use before the step (of the last measured one) plus the
    step's own demand on the decider's line.
    """
    from keras_memguard import decider

    config = decider.make_config()
    state = decider.init(config)
    for s, cell in zip(fit_sizes, cells):
        reading = decider.Reading(
            s, 1, ss, cell["current_before"], cell["peak"], UNCAPPED_MIB * MIB
        )
        state = decider.observe(config, state, reading)[1]
    return (cells[-1]["current_before"] or 0) + decider.predict_demand(state, size * ss)


def oom_predictions(result, table, sizes):
    """What the predictors said of the failed step, in bytes."""

    task = result["task"]
    model, mode, size = task["model"], task["mode"], task["size"]
    predictions = {"static shapes": result["static"]["total"]}
    ss = sample_size(model)
    for fit_sizes in ((sizes[0], sizes[1]), (sizes[-3], sizes[-2])):
        cells = [table.get((model, mode, s)) for s in fit_sizes]
        if None in cells:
            continue
        predictions[f"planner line, fit at {fit_sizes[0]} and {fit_sizes[1]}"] = (
            decider_peak(cells, fit_sizes, ss, size))
    xla = result.get("xla")
    if xla:
        predictions["XLA buffer sum"] = xla["sum"]
        if mode == "jit":
            predictions["XLA sum, BFC chunk rule"] = xla_bfc(xla)
    return predictions


def run_oom(spec, report):
    model, mode, size, cap = spec.split(":")
    task = {"kind": "oom", "model": model, "mode": mode, "size": int(size)}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "dump")
        result = run_child(task, int(cap), {"TF_BFC_MEMORY_DUMP": prefix})
        dumps = sorted(glob.glob(prefix + "_*"),
                       key=lambda p: int(p.rsplit(".", 1)[1]))
        result["cap_mib"] = int(cap)
        result["dump_files"] = len(dumps)
        if dumps:
            from keras_memguard.testing import run_script_with_memory_cap

            parsed = run_script_with_memory_cap(
                [os.path.abspath(__file__), "--read-dumps", dumps[0], dumps[-1]],
                UNCAPPED_MIB, timeout=120, check=False,
            )
            if parsed.result is not None:
                result["dumps"] = parsed.result
    report.append(result)
    return result


def fmt_mib(value):
    return "-" if value is None else f"{value / MIB:.0f}"


def fmt_err(value):
    return f"{100 * value:+.0f}%"


def print_report(table, rows, sizes, models, ooms):
    print("\n### Measured peaks and predictions (MiB)\n")
    print("| model | step | size | measured peak (rounds) | step 1 | step 3 (profiled)"
          " | before step | static | XLA sum | XLA + BFC rule | profiler requested |"
          " profiler peak | largest request | step s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        for mode in ("plain", "jit"):
            for s in sizes:
                c = table.get((model, mode, s))
                if c is None:
                    continue
                jit = table.get((model, "jit", s), {})
                spread = "/".join(fmt_mib(p) for p in c["peaks"])
                print(
                    f"| {model} | {mode} | {s} | {fmt_mib(c['peak'])} ({spread}) | "
                    f"{fmt_mib(c['first_peak'])} | {fmt_mib(c.get('profile_step_peak'))} | "
                    f"{fmt_mib(c['current_before'])} | "
                    f"{fmt_mib(c['static'])} | {fmt_mib(jit.get('xla_sum'))} | "
                    f"{fmt_mib(jit.get('xla_bfc'))} | "
                    f"{fmt_mib(c.get('profile_requested'))} | "
                    f"{fmt_mib(c.get('profile_peak'))} | "
                    f"{fmt_mib(c.get('largest_request'))} | "
                    f"{c['step_seconds']:.2f} |"
                )
    print("\n### Relative error of each predictor against the measured peak\n")
    print("(predicted - measured) / measured, over the sizes each predictor did"
          " not fit on\n")
    print("| predictor | model | measured step | " + " | ".join(
        str(s) for s in sizes) + " | median abs | max abs | cost |")
    print("|---|---|---|" + "---:|" * (len(sizes) + 2) + "---|")
    for row in rows:
        summary = summarize(list(row["errors"].values()))
        row["summary"] = summary
        cells = " | ".join(
            fmt_err(row["errors"][s]) if s in row["errors"] else "fit"
            for s in sizes)
        print(f"| {row['predictor']} | {row['model']} | {row['target']} | {cells} | "
              f"{100 * summary['median_abs']:.0f}% | {100 * summary['max_abs']:.0f}% |"
              f" {row['cost']} |")
    for r in ooms:
        t = r["task"]
        print(f"\n### Out of memory: {t['model']} {t['mode']} micro-batch {t['size']}"
              f" under {r['cap_mib']} MiB\n")
        print(f"- failed: {r.get('failed')} (exit {r['returncode']}), "
              f"{r.get('seconds', float('nan')):.1f} s; request "
              f"{fmt_mib(r.get('request_bytes'))} MiB; {r.get('message', '')[:200]}")
        cap = r["cap_mib"] * MIB
        print("- predicted peaks: " + "; ".join(
            f"{name} {fmt_mib(value)} MiB ({value / cap:.0%} of the cap)"
            for name, value in r.get("predictions", {}).items()))
        for name, d in zip(("first dump", "last dump"), r.get("dumps", [])):
            print(
                f"- {name} of {r['dump_files']}: in use {fmt_mib(d['bytes_in_use'])} MiB"
                f" in {d['chunks_in_use']} chunks (requested "
                f"{fmt_mib(d['in_use_requested_bytes'])}), free in regions "
                f"{fmt_mib(d['free_bytes'])} in {d['free_chunks']} chunks, largest free "
                f"{fmt_mib(d['largest_free_chunk'])}, reserved {fmt_mib(d['reserved_bytes'])}"
                f" (unreserved under the cap "
                f"{fmt_mib(r['cap_mib'] * MIB - d['reserved_bytes'])}), peak "
                f"{fmt_mib(d['peak_bytes_in_use'])}, largest_alloc_size "
                f"{fmt_mib(d['largest_alloc_size'])}, fragmentation_metric "
                f"{d['fragmentation_metric']:.3f}, op names {d['op_names']},"
                f" snapshots {d['snapshots']}"
            )
            request = r.get("request_bytes")
            if request:
                room = max(d["largest_free_chunk"], cap - d["reserved_bytes"])
                print(f"  - request {fmt_mib(request)} MiB against the largest free"
                      f" chunk or unreserved room, {fmt_mib(room)} MiB: "
                      + ("cannot fit, as the allocator said" if room < request
                         else "would fit: the dump does not explain the error"))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--read-dumps":
        emit_result([read_dump(p) for p in sys.argv[2:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="8,16,32,64,128")
    parser.add_argument("--models", default="cnn,text")
    parser.add_argument("--modes", default="plain,jit")
    parser.add_argument("--oom", default="cnn:plain:138:600,cnn:jit:128:600",
                        help="model:mode:size:cap_mib,... ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    models = args.models.split(",")
    modes = args.modes.split(",")
    rng = random.Random(args.seed)
    start = time.perf_counter()
    measurements = []
    for round_index in range(args.rounds):
        # The HloProto is deterministic: compiled in the first round only.
        tasks = [{"kind": "measure", "model": m, "size": s, "mode": mode,
                  "ir": round_index == 0}
                 for m in models for s in sizes for mode in modes]
        rng.shuffle(tasks)
        for task in tasks:
            r = run_child(task, UNCAPPED_MIB)
            measurements.append(r)
            print(f"round {round_index + 1} {task['model']} {task['mode']} "
                  f"{task['size']}: peak {fmt_mib(r['steps'][1]['peak'])} MiB, "
                  f"{r['process_seconds']:.1f} s", flush=True)
    ooms = []
    for spec in filter(None, args.oom.split(",")):
        r = run_oom(spec, ooms)
        print(f"oom {spec}: failed={r.get('failed')}, {r['process_seconds']:.1f} s",
              flush=True)
    table, rows = analyse(measurements, sizes, models)
    for r in ooms:
        r["predictions"] = oom_predictions(r, table, sizes)
    print_report(table, rows, sizes, models, ooms)
    print(f"\nTotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "measurements": measurements,
                "table": {"|".join(map(str, k)): v for k, v in table.items()},
                "rows": rows, "ooms": ooms,
            }, f, indent=1, default=str)


if __name__ == "__main__":
    main()
