"""Measures one variant of a saved model; run by `advise` in a process of its own.

`python -m keras_memguard.advice.child SPEC_JSON` loads the model, turns
it into the variant, finds its largest batch with `find_batch_size`, then
trains a few steps at the requested batch with `MemoryGuard` (a batch that
does not fit is micro-batched, not failed) and `MemoryMonitor` (the
allocator's peak per step), and writes what it measured as JSON to the
spec's `output` file. Every outcome is written there, an error included:
only a crash of the process itself (XLA aborts on an out-of-memory error)
leaves the file unwritten.

The same code on every Keras backend: what a variant needs of the backend
(which variants exist there, the remat rung, XLA or `torch.compile`, the
measured steps' input, the peak where the device keeps no statistics) is
the backend's `advice` module (`keras_memguard.backends.current().advice()`).
"""

import os

# Before TensorFlow is imported: its start-up lines are noise here.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402

from keras_memguard import backends  # noqa: E402
from keras_memguard.advice import variants  # noqa: E402
from keras_memguard.batch_size_finder import find_batch_size  # noqa: E402
from keras_memguard.callbacks.guard import MemoryGuard  # noqa: E402
from keras_memguard.callbacks.monitor import MemoryMonitor  # noqa: E402
from keras_memguard.errors import MemoryLimitUnknownError  # noqa: E402

_MIB = 1024 * 1024


class _Steps(keras.callbacks.Callback):
    """Per step: wall time, the allocator's peak (MiB) and the count `k`."""

    def __init__(self):
        super().__init__()
        self.rows = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        # Reading the loss waits for the step (asynchronous on a GPU).
        float(logs.get("loss", 0.0))
        self.rows.append(
            (
                time.perf_counter() - self._start,
                _float(logs.get("memory_peak_mib")),
                int(_float(logs.get("micro_batches")) or 1),
            )
        )


def _float(value):
    return None if value is None else float(value)


def warm_steps(rows):
    """The steps that did not trace: each after the first at its count `k`.

    The guard may start at one count and settle at another, and the first
    step at each count traces (and, with XLA, compiles) its function.
    """
    seen, warm = set(), []
    for row in rows:
        if row[2] in seen:
            warm.append(row)
        seen.add(row[2])
    return warm or rows[1:] or rows


def measure(spec, result):
    """Measures the variant of `spec` into `result`, a `dict`.

    `result["stage"]` says how far it got, for an error: `"load"` (then
    every variant would fail alike), `"variant"` or `"measure"`.
    """
    name = spec["variant"]
    protocol = backends.current()
    backend = protocol.advice()
    result.update(
        variant=name, status="failed", reason=None, stage="load", backend=protocol.NAME
    )
    if name == variants.BASELINE:
        # Which variants the parent need not start a process for: those
        # this backend does not have, known before the model loads.
        result["unsupported"] = dict(backend.UNAVAILABLE)
    model = keras.saving.load_model(spec["model"])
    if name == variants.BASELINE:
        result["unsupported"].update(backend.unsupported(model))
    _add_how(result, backend.prepare(model, name))
    result["stage"] = "variant"
    try:
        model, how = variants.apply_variant(model, name)
    except variants.Unsupported as error:
        result.update(status="unsupported", reason=str(error))
        return
    _add_how(result, how)
    result["stage"] = "measure"
    batch_size = spec["batch_size"]
    x = variants.make_inputs(model, batch_size, spec.get("input_shape"), spec.get("input_range"))
    y = variants.make_targets(model, x)
    probe = protocol.make_probe()
    result["device"] = probe.devices[0] if probe.devices else None
    limit = spec.get("memory_limit")
    threshold, note = backend.search_threshold(name, spec.get("threshold", 0.85))
    _add_how(result, note)
    _write(spec, result)
    with backend.search_context(model):
        found = find_batch_size(
            model,
            x,
            y,
            batch_size=batch_size,
            memory_limit=limit,
            max_trials=spec.get("max_trials", 8),
            threshold=threshold,
            verbose=0,
        )
    weights, optimizer = variants.variable_bytes(model)
    result.update(
        limit_bytes=found.limit_bytes,
        largest_batch_size=found.largest_batch_size,
        planned_micro_batches=found.micro_batches,
        weights_bytes=weights,
        optimizer_bytes=optimizer,
        gradient_bytes=protocol.batch_size_finder().gradient_bytes(model),
        in_use_bytes=found.in_use_bytes,
        step_fixed_bytes=found.fixed_bytes,
        bytes_per_sample=found.bytes_per_sample,
        trials=[
            [t.batch_size, t.in_use_bytes, t.peak_bytes, t.predicted_peak_bytes]
            for t in found.trials
        ],
    )
    # A crash while training leaves what was measured so far.
    _write(spec, result)
    steps = _Steps()
    fits = batch_size <= found.largest_batch_size
    monitor = MemoryMonitor(update_freq="batch", memory_limit=limit, nvml=False)
    callbacks = [monitor, steps]
    guard = None
    guarded = backend.guarded(name, fits)
    _add_how(result, backend.training_note(name, guarded))
    if guarded:
        guard = MemoryGuard(
            memory_limit=limit,
            threshold=spec.get("threshold", 0.85),
            plan_cache=False,
            # A batch no larger than one that ran trains whole, and the
            # guard only watches it; a larger one starts at the count the
            # search planned, with no cautious first split of 8 to trace
            # and leave.
            plan=not fits,
            micro_batches=1 if fits else max(found.micro_batches or 1, 2),
        )
        callbacks.insert(0, guard)
    model.fit(
        backend.training_data(x, y, spec["steps"]),
        epochs=1,
        steps_per_epoch=spec["steps"],
        verbose=0,
        callbacks=callbacks,
    )
    warm = warm_steps(steps.rows)
    peaks = [row[1] * _MIB for row in warm if row[1] is not None]
    micro_batches = max(row[2] for row in warm)
    peak, note = backend.step_peak(model, x, y, micro_batches, max(peaks) if peaks else None)
    _add_how(result, note)
    result.update(
        status="ok",
        stage=None,
        peak_bytes=peak,
        step_seconds=statistics.median(row[0] for row in warm),
        steps_measured=len(warm),
        micro_batches=micro_batches,
        out_of_memory_errors=found.out_of_memory_errors
        + (guard.oom_recoveries if guard is not None else 0),
    )


def _add_how(result, note):
    """Adds a sentence to `result["how"]` (how the variant was made)."""
    if note:
        result["how"] = f"{result['how']}; {note}" if result.get("how") else note


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    result = {"variant": spec.get("variant")}
    try:
        measure(spec, result)
    except MemoryLimitUnknownError as error:
        result.update(
            status="failed",
            reason=f"{variants.first_line(error)} (keras-memguard advise: --memory-limit-mib)",
        )
    except Exception as error:  # noqa: BLE001 - reported, never raised
        result.update(status="failed", reason=variants.first_line(error))
    _write(spec, result)
    return 0


def _write(spec, result):
    """Writes `result` to the spec's output file (whole, or not at all)."""
    partial = spec["output"] + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(partial, spec["output"])


if __name__ == "__main__":
    sys.exit(main())
