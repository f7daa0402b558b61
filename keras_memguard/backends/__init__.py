"""Each Keras backend's code, and the one place the backend is chosen.

Keras keeps each backend in `keras/src/backend/<name>/` and picks its
trainer once, from `keras.backend.backend()`. So does this package: one
subpackage per backend (`tensorflow/`, `jax/`, `torch/`), each with a
`protocol` module giving the same small set of names, and `current()`,
which imports the protocol of the backend in use on first call. Everything
above this folder (the callbacks, the finder, the report) asks `current()`
and never imports a framework itself.

A backend's `protocol` module provides:

- `NAME`: the Keras backend's name.
- `make_probe(devices=None, memory_limit=None)`: the memory probe (its
  samples are `keras_memguard.probes.base.AllocatorSample`s).
- `training_run(session, fit, log_key)`: the run of one `fit` under
  `MemoryGuard` (`begin`, `end`, `begin_epoch`, `after_train_batch`,
  `micro_batch_size`). `session` is the guard's
  `keras_memguard.callbacks.session.GuardSession` (its model, controller,
  reader, limits, writer and options: all a run reads or changes), `fit`
  identifies the `fit` (the callbacks' shared `params`), `log_key` is the
  logs key the micro-batch count goes under.
- `inference_run(session, kind)`: the run of one `evaluate` or `predict`
  (`after_batch`, `end`), or `None` where that call runs unguarded (a
  TensorFlow model its slices cannot serve).
- `mixin_class()`: that backend's `MemGuardMixin`.
- `multi_worker_preparer()`: that backend's `prepare_multi_worker`
  (TensorFlow's; elsewhere one that returns the model unchanged).
- `VALIDATION_IN_FIT`: whether `fit`'s validation is guarded by the
  training run (`begin_validation`, `after_validation_batch`,
  `end_validation`) rather than as an
  `evaluate` of its own.
- `PROFILES_SPIKES`: whether `MemoryMonitor(profile_spikes=...)` works,
  and where it does, `spike_profiler(log_dir, spike_fraction,
  max_profiles)`, its tracer.
- `batch_size_finder()`: the backend's `finder` module, what
  `find_batch_size` asks of it: `SEARCH` (`"trials"`: real trial steps;
  `"compiled"`: compiled steps' memory analyses, nothing run),
  `PEAK_FROM_IN_USE`, `PEAK_STALL_IS_ROUNDING`, `TOP_VARIES`,
  `STEP_ERRORS`, `LIMIT_UNKNOWN`, `NOTHING_MEASURED`, `prepare_process(probe)`,
  `build_state(model, first)`,
  `sample_size(first)`,
  `gradient_bytes(model)`, `is_dataset(x)`, `dataset_batches(dataset)`,
  `rebatched(dataset, size)`, `as_array(value)`,
  `uses_compiled_step(model)`, and for trials `run_trial(model, probe,
  source, size)` (which raises `TrialsCannotGoOn` where no further trial
  can run in this process) and `largest_compiled(model, source, room,
  ran, upper)`,
  for a compiled search `step_analyser(model, first)` and
  `batch_multiple(model)` (what every batch must be a multiple of).
- `advice()`: the backend's `advice` module, what `advise`'s measuring
  child asks of it: `NAME`, `UNAVAILABLE` (`{variant: reason}` for the
  variants the backend does not have), `unsupported(model)`,
  `prepare(model, name)`, `apply_variant(model, name)` (variants beyond
  the dtype policies), `search_threshold(name, threshold)`,
  `search_context(model)`, `guarded(name, fits)`,
  `training_note(name, guarded)`, `training_data(x, y, steps)` and
  `step_peak(model, x, y, micro_batches, measured_bytes)`.
- `growth_evidence()`: the backend's `growth` module, what the growth
  evidence (`keras_memguard.growth_check.snapshot`) asks of it:
  `count(objects, kinds)` (figures over `gc.get_objects()`:
  `traced_functions`, `cached_datasets`, `live_tensors_mib`, where the
  backend has them) and `nbytes(value)` (a framework tensor's bytes, or
  `None`).
- `sees_gpu()`: whether the framework lists a GPU (asked only where NVML
  is missing, to say why).
- `record_writer(path)`: the writer of TensorBoard's event records, or
  `None` for TensorBoard's own.

Adding a backend is a folder here and one line in `_REGISTERED`.
"""

import importlib

import keras

from keras_memguard.errors import UnsupportedTrainingSetupError

_REGISTERED = {
    "tensorflow": "keras_memguard.backends.tensorflow.protocol",
    "jax": "keras_memguard.backends.jax.protocol",
    "torch": "keras_memguard.backends.torch.protocol",
}

_loaded = {}


class TrialsCannotGoOn(Exception):
    """No further `find_batch_size` trial can run in this process.

    Raised by a backend's `run_trial`; the search answers from the trials
    that ran.
    """


def names():
    """The Keras backends the package supports, a sorted tuple of names."""
    return tuple(sorted(_REGISTERED))


def current():
    """The protocol module of the Keras backend in use.

    Returns:
        The backend's `protocol` module (see this package's docstring).

    Raises:
        UnsupportedTrainingSetupError: If Keras runs on a backend the
            package has no folder for.
    """
    name = keras.backend.backend()
    protocol = _loaded.get(name)
    if protocol is None:
        module = _REGISTERED.get(name)
        if module is None:
            raise UnsupportedTrainingSetupError(
                f"keras_memguard works on Keras' {', '.join(names())} "
                f"backends; this is the {name} backend. Received: "
                f"KERAS_BACKEND={name!r}. HINT: set KERAS_BACKEND to one of "
                f"{', '.join(repr(n) for n in names())}."
            )
        protocol = _loaded[name] = importlib.import_module(module)
    return protocol
