"""What each memory-saving technique saves on your model, measured.

`advise(model_path, batch_size)` measures a saved, compiled Keras model on
this device: its fixed memory and memory per sample, the largest batch
that trains in one step, and what `mixed_float16`, `mixed_bfloat16`, the
`"remat"` rung and `jit_compile=True` change in peak memory and step time
at `batch_size`, against `float32`.

Each variant runs in a process of its own (`keras_memguard.advice.child`,
the same Python and environment, so the same Keras backend, device and
memory cap): a variant then starts from a fresh allocator, as a training
run would, and one that crashes its process (XLA aborts on an
out-of-memory error) is reported, not fatal. This process never imports a
framework (TensorFlow, JAX or PyTorch): on a GPU it would reserve the
memory the children measure.

The same on every Keras backend: what a variant needs of one backend is
its `advice` module (`keras_memguard.backends.<name>.advice`). A variant
a backend does not have (the `"remat"` rung outside TensorFlow;
`jit_compile` on JAX, whose steps XLA always compiles) is reported as
`"unsupported"`, its reason saying it is not available on that backend.
On PyTorch `jit_compile=True` means `torch.compile`.
"""

import json
import numbers
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional, Tuple

__all__ = ["Advice", "VariantAdvice", "VARIANTS", "advise"]

BASELINE = "float32"
# The variants, in the order they run and print; the savings are against
# the first.
VARIANTS = (BASELINE, "mixed_float16", "mixed_bfloat16", "remat", "jit_compile")
FORMAT = "keras_memguard.advise"
VERSION = 1
STATUSES = ("ok", "unsupported", "failed")
MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")
_MIB = 1024 * 1024


class VariantAdvice(NamedTuple):
    """What one variant did, as in the JSON's `variants` list.

    Attributes:
        name: The variant, one of `VARIANTS`.
        status: `"ok"`, `"unsupported"` (the model cannot take it; `reason`
            says why) or `"failed"` (`reason` is the error's first line).
        reason: Why it is not `"ok"`, else `None`.
        largest_batch_size: The largest batch that trained in one step.
        peak_mib: The allocator's peak over the measured steps at the
            requested batch (MiB).
        step_seconds: The median step time at the requested batch.
        peak_saving: `1 - peak_mib / float32's peak_mib`.
        time_saving: `1 - step_seconds / float32's step_seconds`.
        micro_batches: The micro-batch count `MemoryGuard` trained the
            requested batch with (1: whole).
        out_of_memory_errors: Out-of-memory errors in the search and the
            steps (0 in the normal case).
        how: How the variant was made (a rebuilt model, a recompiled one),
            or `None`.
    """

    name: str
    status: str
    reason: Optional[str] = None
    largest_batch_size: Optional[int] = None
    peak_mib: Optional[float] = None
    step_seconds: Optional[float] = None
    peak_saving: Optional[float] = None
    time_saving: Optional[float] = None
    micro_batches: Optional[int] = None
    out_of_memory_errors: Optional[int] = None
    how: Optional[str] = None

    def to_dict(self):
        """The variant's JSON object."""
        return dict(self._asdict())


class Advice(NamedTuple):
    """What `advise` measured, as in its JSON (`to_dict`).

    Attributes:
        model: The model path, as given.
        batch_size: The batch the variants were compared at.
        device: The device measured (`"GPU:0"`, `"CPU:0"`), or `None`.
        limit_mib: Its memory limit (MiB), or `None`.
        fixed_mib: Memory every step keeps whatever the batch: the float32
            model's weights, optimizer variables and gradients (MiB).
        per_sample_mib: The float32 step's memory per sample (MiB).
        largest_batch_size: The float32 model's largest batch.
        variants: A `VariantAdvice` per variant, float32 first.
        in_use_mib: Memory in use measured right before a float32 step
            (weights, optimizer slots, the input batch; MiB).
        out_of_memory_errors: Out-of-memory errors over all variants.
        seconds: Wall time of the whole measurement.
        backend: The Keras backend measured on (`"tensorflow"`, `"jax"`,
            `"torch"`), or `None` where no child said.
    """

    model: str
    batch_size: int
    device: Optional[str]
    limit_mib: Optional[float]
    fixed_mib: Optional[float]
    per_sample_mib: Optional[float]
    largest_batch_size: Optional[int]
    variants: Tuple[VariantAdvice, ...]
    in_use_mib: Optional[float] = None
    out_of_memory_errors: int = 0
    seconds: Optional[float] = None
    backend: Optional[str] = None

    def to_dict(self):
        """The JSON object (`format` `"keras_memguard.advise"`, version 1)."""
        data = {"format": FORMAT, "version": VERSION}
        data.update(self._asdict())
        data["variants"] = [v.to_dict() for v in self.variants]
        return data

    def table(self):
        """The printed summary: one row per variant, then how each was made."""
        return format_table(self)


def advise(
    model_path,
    batch_size,
    input_shape=None,
    input_range=None,
    variants=None,
    steps=6,
    memory_limit=None,
    max_trials=8,
    threshold=0.85,
    json_path=None,
    log_dir=None,
    timeout=600,
    verbose=1,
):
    """Measures what each memory-saving technique saves on a saved model.

    For each variant (`float32`, `mixed_float16`, `mixed_bfloat16`, the
    `"remat"` rung, `jit_compile=True`) a process of its own loads the
    model, turns it into the variant, finds its largest batch with
    `find_batch_size`, and trains `steps` steps at `batch_size` with
    `MemoryGuard` (a batch that does not fit is split into micro-batches,
    not failed), measuring the allocator's peak and the median step time
    over the steps that did not trace. Inputs are random, shaped from the
    model's input specs; integer inputs (token ids) are drawn below the
    first Embedding layer's `input_dim`; targets fit the loss and output
    shapes. A dtype policy needs the model rebuilt: its layers carry their
    own dtype, so each float32 layer's config gets the policy, the weights
    are copied and the copy is compiled from the original's compile config
    (`how` says so). A variant the model cannot take is reported as
    `"unsupported"` with the reason, one that fails as `"failed"` with the
    error's first line.

    The children run on the Keras backend this process would use (its
    `KERAS_BACKEND`). On JAX and PyTorch the `"remat"` rung does not exist
    and is reported as not available there, as is `jit_compile` on JAX
    (XLA compiles every JAX step: the float32 row is its figure); on
    PyTorch `jit_compile` is `torch.compile`. JAX on the CPU keeps no
    memory statistics: its peak is XLA's memory analysis of the compiled
    step (`how` says so), and `memory_limit` is required there, as on
    PyTorch's CPU without a cgroup or address-space limit (whose peak is
    the process's resident memory).

    Args:
        model_path: A model saved with `model.save` (`.keras`, or legacy
            `.h5`), compiled.
        batch_size: The batch to compare the variants at, an integer >= 1.
        input_shape: The shape of one sample, without the batch dimension,
            for a model whose inputs have unknown dimensions: a tuple of
            ints, or a list of them (one per input). Defaults to `None`:
            the model's own input shapes.
        input_range: `(low, high)`: integer inputs are drawn from
            `[low, high)`. Defaults to `None`: below the smallest Embedding
            `input_dim` of the model (0 or 1 without an Embedding).
        variants: The variants to measure, names from `VARIANTS`; float32
            always runs (the savings are against it). Defaults to `None`:
            all of them.
        steps: Training steps per variant at `batch_size`, an integer >= 2;
            the first at each micro-batch count traces and is not counted.
            Defaults to `6`.
        memory_limit: The device memory limit in bytes, or `None` to resolve
            it as `MemoryGuard` does (which finds none on JAX's CPU, nor on
            PyTorch's without a cgroup or address-space limit: every
            variant then fails, saying so). Defaults to `None`.
        max_trials: Steps `find_batch_size` may take per variant, an
            integer >= 2. Defaults to `8`.
        threshold: The share of the limit the search for the largest batch
            (and `MemoryGuard`'s steps) may reach, in (0, 1]. Below
            `find_batch_size`'s own 0.95: the last trials land near the
            target, where the allocator's rounding, which the search's
            memory model cannot see, can still make a step run out of
            memory. Defaults to `0.85`.
        json_path: A file to write the JSON to, or `None`. Defaults to
            `None`.
        log_dir: A log directory: the JSON goes to
            `log_dir/memguard/advise.json` too, or `None`. Defaults to
            `None`.
        timeout: Seconds one variant's process may take. Defaults to `600`.
        verbose: `1` prints a line per variant and the table, `0` nothing.
            Defaults to `1`.

    Returns:
        An `Advice`.

    Raises:
        ValueError: If an argument is out of range.
        FileNotFoundError: If `model_path` does not exist.

    Example:

    ```python
    advice = keras_memguard.advise("model.keras", batch_size=64, json_path="advice.json")
    for variant in advice.variants:
        print(variant.name, variant.status, variant.peak_saving, variant.reason)
    ```
    """
    names = _validate(
        model_path, batch_size, input_shape, input_range, variants, steps,
        memory_limit, max_trials, threshold, timeout, verbose,
    )
    model_path = os.fspath(model_path)
    start = time.perf_counter()
    env = _child_env()
    results = {}
    skip = {}
    with tempfile.TemporaryDirectory(prefix="keras_memguard_advise_") as scratch:
        for name in names:
            if name in skip:
                raw = skip[name]
            else:
                spec = {
                    "model": os.path.abspath(model_path),
                    "variant": name,
                    "batch_size": int(batch_size),
                    "input_shape": _jsonable_shape(input_shape),
                    "input_range": list(input_range) if input_range is not None else None,
                    "steps": int(steps),
                    "memory_limit": memory_limit,
                    "max_trials": int(max_trials),
                    "threshold": float(threshold),
                    "output": os.path.join(scratch, f"{name}.json"),
                }
                began = time.perf_counter()
                raw = _run_child(spec, env, timeout)
                raw["seconds"] = time.perf_counter() - began
            results[name] = raw
            if verbose:
                _print_progress(name, raw)
            if name == BASELINE:
                skip = _skipped_after_baseline(raw)
    advice = _assemble(model_path, int(batch_size), names, results, memory_limit)
    advice = advice._replace(seconds=round(time.perf_counter() - start, 1))
    for path in _json_paths(json_path, log_dir):
        _write_json(advice, path)
    if verbose:
        print(advice.table(), flush=True)
    return advice


# Arguments.


def _validate(
    model_path, batch_size, input_shape, input_range, variants, steps,
    memory_limit, max_trials, threshold, timeout, verbose,
):
    """Checks the arguments; returns the variants to run, float32 first."""
    if not isinstance(model_path, (str, os.PathLike)):
        raise ValueError(
            "`model_path` must be a path to a saved model. "
            f"Received: model_path={model_path!r}"
        )
    path = os.fspath(model_path)
    if not path.lower().endswith(MODEL_SUFFIXES):
        raise ValueError(
            f"`model_path` must name a file saved by `model.save` (ending in "
            f"{', '.join(MODEL_SUFFIXES)}). Received: model_path={path!r}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"`model_path` {path!r} does not exist.")
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("steps", steps, 2),
        ("max_trials", max_trials, 2),
    ):
        if not _is_int(value) or value < low:
            raise ValueError(
                f"`{name}` must be an integer >= {low}. Received: {name}={value!r}"
            )
    if memory_limit is not None and (not _is_int(memory_limit) or memory_limit < 1):
        raise ValueError(
            "`memory_limit` must be a number of bytes (an integer >= 1) or "
            f"None. Received: memory_limit={memory_limit!r}"
        )
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, numbers.Real)
        or not 0 < threshold <= 1
    ):
        raise ValueError(f"`threshold` must be in (0, 1]. Received: threshold={threshold!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not timeout > 0
    ):
        raise ValueError(f"`timeout` must be a number > 0. Received: timeout={timeout!r}")
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    if input_shape is not None and not _valid_shapes(input_shape):
        raise ValueError(
            "`input_shape` must be the shape of one sample without the batch "
            "dimension, a tuple of integers >= 1 such as (64, 64, 3), or a "
            f"list of them (one per input). Received: input_shape={input_shape!r}"
        )
    if input_range is not None and not (
        isinstance(input_range, (tuple, list))
        and len(input_range) == 2
        and all(_is_int(v) for v in input_range)
        and input_range[0] < input_range[1]
    ):
        raise ValueError(
            "`input_range` must be (low, high), integers with low < high: "
            f"integer inputs are drawn from [low, high). Received: input_range={input_range!r}"
        )
    if variants is None:
        return VARIANTS
    if isinstance(variants, str) or not all(v in VARIANTS for v in variants):
        raise ValueError(
            f"`variants` must be a list of names from {list(VARIANTS)}. "
            f"Received: variants={variants!r}"
        )
    return tuple(v for v in VARIANTS if v == BASELINE or v in variants)


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_shape(value):
    return (
        isinstance(value, (tuple, list))
        and len(value) > 0
        and all(_is_int(d) and d >= 1 for d in value)
    )


def _valid_shapes(value):
    if _is_shape(value):
        return True
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, tuple) and _is_shape(v) for v in value)
    )


def _jsonable_shape(input_shape):
    if input_shape is None:
        return None
    if _is_shape(input_shape):
        return [int(d) for d in input_shape]
    return [[int(d) for d in shape] for shape in input_shape]


# The children.


def _child_env():
    """The same environment, TensorFlow's start-up lines off unless asked for.

    Where Keras is already imported here, the children get its backend
    (chosen from more than the environment: `keras.json`, or set before
    the import).
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    keras = sys.modules.get("keras")
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if callable(backend):
        try:
            env["KERAS_BACKEND"] = str(backend())
        except Exception:  # noqa: BLE001 - the environment's own choice stands
            pass
    # The child imports this package as this process did, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _run_child(spec, env, timeout):
    """Runs one variant's process; returns its result `dict`, never raises."""
    command = [sys.executable, "-m", "keras_memguard.advice.child", json.dumps(spec)]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {
            "status": "failed",
            "reason": f"the measuring process ran past timeout={timeout} s",
        }
    try:
        with open(spec["output"], encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = {"status": "failed"}
    if result.get("status") == "failed" and not result.get("reason"):
        # The child writes as it goes: a crash leaves no reason of its own.
        result["reason"] = _crash_reason(completed)
    return result


def _crash_reason(completed):
    """Why a child ended without writing its result (a crash)."""
    code = completed.returncode
    how = f"status {code}"
    if code < 0:
        try:
            how = f"signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    lines = [l.strip() for l in completed.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower() or "check failed" in l.lower()]
    last = (errors or lines or [""])[-1][:300]
    reason = f"the measuring process ended with {how}"
    return f"{reason}: {last}" if last else reason


def _skipped_after_baseline(raw):
    """Variants not worth a process, from what float32's process found."""
    skip = {}
    if raw.get("status") == "failed" and raw.get("stage") == "load":
        # The model itself did not load: every variant would fail alike.
        for name in VARIANTS[1:]:
            skip[name] = {"status": "failed", "reason": raw.get("reason")}
    for name, reason in (raw.get("unsupported") or {}).items():
        skip[name] = {"status": "unsupported", "reason": reason}
    return skip


def _print_progress(name, raw):
    status = raw.get("status")
    seconds = raw.get("seconds")
    took = f" ({seconds:.1f} s)" if seconds is not None else ""
    detail = f": {raw.get('reason')}" if status != "ok" else ""
    print(f"advise: {name} {status}{took}{detail}", flush=True)


# The result.


def _mib(value, digits=1):
    return None if value is None else round(value / _MIB, digits)


def _saving(value, baseline):
    if value is None or not baseline:
        return None
    return round(1.0 - value / baseline, 4)


def _assemble(model_path, batch_size, names, results, memory_limit):
    base = results.get(BASELINE, {})
    base_ok = base.get("status") == "ok"
    rows = []
    for name in names:
        raw = results[name]
        status = raw.get("status") if raw.get("status") in STATUSES else "failed"
        if status != "ok":
            rows.append(
                VariantAdvice(
                    name, status, raw.get("reason") or "no reason given", how=raw.get("how")
                )
            )
            continue
        peak = raw.get("peak_bytes")
        seconds = raw.get("step_seconds")
        rows.append(
            VariantAdvice(
                name=name,
                status="ok",
                reason=None,
                largest_batch_size=raw.get("largest_batch_size"),
                peak_mib=_mib(peak),
                step_seconds=None if seconds is None else round(seconds, 4),
                peak_saving=_saving(peak, base.get("peak_bytes")) if base_ok else None,
                time_saving=_saving(seconds, base.get("step_seconds")) if base_ok else None,
                micro_batches=raw.get("micro_batches"),
                out_of_memory_errors=raw.get("out_of_memory_errors"),
                how=raw.get("how"),
            )
        )
    measured = [results[n] for n in names if results[n].get("status") == "ok"]
    first = base if base_ok else (measured[0] if measured else {})
    limit = first.get("limit_bytes") or memory_limit
    fixed = None
    if base_ok:
        fixed = base["weights_bytes"] + base["optimizer_bytes"] + base["gradient_bytes"]
    return Advice(
        model=model_path,
        batch_size=batch_size,
        device=first.get("device"),
        limit_mib=_mib(limit),
        fixed_mib=_mib(fixed, 2),
        per_sample_mib=_mib(base.get("bytes_per_sample"), 3) if base_ok else None,
        largest_batch_size=base.get("largest_batch_size") if base_ok else None,
        variants=tuple(rows),
        in_use_mib=_mib(base.get("in_use_bytes"), 2) if base_ok else None,
        out_of_memory_errors=sum(r.get("out_of_memory_errors") or 0 for r in measured),
        backend=next((results[n]["backend"] for n in names if results[n].get("backend")), None),
    )


def _json_paths(json_path, log_dir):
    paths = []
    if json_path is not None:
        paths.append(os.fspath(json_path))
    if log_dir is not None:
        paths.append(os.path.join(os.fspath(log_dir), "memguard", "advise.json"))
    return paths


def _write_json(advice, path):
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(advice.to_dict(), f, indent=1)
        f.write("\n")


def _percent(value):
    return "-" if value is None else f"{100 * value:+.0f}%"


def format_table(advice):
    """The table `advise` prints for `advice` (an `Advice`)."""
    limit = "unknown" if advice.limit_mib is None else f"{advice.limit_mib:.1f} MiB"
    lines = [
        f"Model {advice.model}, batch {advice.batch_size} on "
        f"{advice.device or 'an unknown device'} (limit {limit})",
    ]
    if advice.fixed_mib is not None:
        lines.append(
            f"  fixed: {advice.fixed_mib:.1f} MiB of weights, optimizer variables "
            f"and gradients ({advice.in_use_mib:.1f} MiB in use before a step); "
            f"per sample: {advice.per_sample_mib:.3f} MiB; largest batch: "
            f"{advice.largest_batch_size}"
        )
    header = ("variant", "largest batch", "peak MiB", "step ms", "peak saving", "time saving", "micro-batches")
    rows = []
    for v in advice.variants:
        if v.status != "ok":
            rows.append((v.name, f"{v.status}: {v.reason}"))
            continue
        rows.append(
            (
                v.name,
                str(v.largest_batch_size),
                "-" if v.peak_mib is None else f"{v.peak_mib:.1f}",
                "-" if v.step_seconds is None else f"{1000 * v.step_seconds:.1f}",
                _percent(v.peak_saving),
                _percent(v.time_saving),
                str(v.micro_batches),
            )
        )
    widths = [len(h) for h in header]
    for row in rows:
        if len(row) == len(header):
            widths = [max(w, len(c)) for w, c in zip(widths, row)]
    def line(cells):
        first = cells[0].ljust(widths[0])
        if len(cells) != len(header):
            return f"  {first}  {cells[1]}"
        rest = "  ".join(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))
        return f"  {first}  {rest}"
    lines.append(line(header))
    lines.extend(line(row) for row in rows)
    notes = [v for v in advice.variants if v.how]
    if notes:
        lines.append("  how:")
        lines.extend(f"    {v.name}: {v.how}" for v in notes)
    if advice.out_of_memory_errors:
        lines.append(f"  out-of-memory errors while measuring: {advice.out_of_memory_errors}")
    return "\n".join(lines)
