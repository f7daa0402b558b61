"""What `advise` asks of Keras' JAX backend.

The dtype policies exist here as everywhere (`keras_memguard.advice.variants`
rebuilds the model), and the guard trains a batch that does not fit in
micro-batches as on every backend. Two variants do not exist: every JAX
train step is compiled by XLA already (`jit_compile` is always on, so the
float32 row is XLA's), and the `"remat"` rung is TensorFlow-only in this
package. Both are reported as not available, with the reason.

The peak: where the device keeps memory statistics (a GPU) it is what
`MemoryMonitor` read over the measured steps; JAX on the CPU keeps none,
and the figure is then XLA's `memory_analysis()` of the train step
compiled at the requested batch and the micro-batch count the guard used
(its arguments plus what it allocates), as `find_batch_size` and
`MemoryGuard` plan on JAX. The interface is the one every backend's
`advice` module has (see `keras_memguard.backends`).
"""

import contextlib

import numpy as np

from keras_memguard.advice import variants
from keras_memguard.backends.jax import finder

NAME = "jax"
# Variants this backend does not have, with the reason.
UNAVAILABLE = {
    variants.REMAT: variants.unavailable(
        variants.REMAT,
        NAME,
        "the remat rung is TensorFlow-only in keras_memguard",
    ),
    variants.JIT: variants.unavailable(
        variants.JIT,
        NAME,
        "every JAX train step is compiled by XLA already, so the float32 "
        "row measures jit_compile",
    ),
}


def unsupported(model):
    """`{}`: what the model cannot take beyond `UNAVAILABLE` is found by trying."""
    del model
    return {}


def prepare(model, name):
    """Nothing to ready: Keras' JAX step is compiled whatever `jit_compile` says."""
    del model, name
    return None


def apply_variant(model, name):
    """Not reached: every variant beyond the dtype policies is `UNAVAILABLE`.

    Raises:
        Unsupported: Always, with the reason.
    """
    del model
    raise variants.Unsupported(
        UNAVAILABLE.get(name) or variants.unavailable(name, NAME, "no such variant")
    )


def search_threshold(name, threshold):
    """`(threshold, None)`: the compiled search reads XLA's buffers, no margin more."""
    del name
    return threshold, None


def search_context(model):
    """Nothing around `find_batch_size`."""
    del model
    return contextlib.nullcontext()


def guarded(name, fits):
    """`True`: every variant's steps train under `MemoryGuard`."""
    del name, fits
    return True


def training_note(name, guarded):
    """`None`: the steps train as every variant's do."""
    del name, guarded
    return None


def training_data(x, y, steps):
    """The one batch, served `steps` times (`variants.RepeatedBatch`)."""
    return variants.RepeatedBatch(x, y, steps)


def step_peak(model, x, y, micro_batches, measured_bytes):
    """`(peak, note)`: the measured peak, or the compiled step's analysis.

    Args:
        model: The variant's model, after its steps.
        x: The requested batch's inputs.
        y: Its targets.
        micro_batches: The count the guard trained it with.
        measured_bytes: `MemoryMonitor`'s peak over the steps, or `None`
            where the device keeps no statistics (the CPU).

    Returns:
        `(bytes, note)`: the peak and, where it is XLA's analysis, a
        sentence saying so (`None` otherwise).
    """
    if measured_bytes is not None:
        return measured_bytes, None
    first = (_first(x), _first(y), None)
    memory = finder.step_analyser(model, first)(len(_leaves(x)[0]), micro_batches)
    if memory is None:
        return None, None
    return float(memory.argument_bytes + memory.demand_bytes), (
        "peak: XLA's memory analysis of the train step compiled at this batch "
        f"and {micro_batches} micro-batch(es) (JAX keeps no memory statistics "
        "on this device)"
    )


def _leaves(value):
    return value if isinstance(value, (list, tuple)) else [value]


def _first(value):
    if isinstance(value, (list, tuple)):
        return type(value)(np.asarray(v)[:1] for v in value)
    return np.asarray(value)[:1]
