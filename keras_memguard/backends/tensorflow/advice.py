"""What `advise` asks of Keras' TensorFlow backend.

Every variant exists here: the dtype policies (made alike on every
backend, `keras_memguard.advice.variants`), the `"remat"` rung
(`keras_memguard.backends.tensorflow.remat`, as
`MemoryGuard(escalate=("remat",))` switches it on) and `jit_compile=True`
(XLA). Only the jit variant uses XLA: Keras' `"auto"` turns it on on GPUs,
so the others switch it off. The measured steps read a `tf.data` input
with nothing prefetched beside the step, and their peak is the allocator's
(`MemoryMonitor`). The interface is the one every backend's `advice` module
has (see `keras_memguard.backends`).

Runs in `advise`'s measuring child only (it imports TensorFlow).
"""

import contextlib

import tensorflow as tf

from keras_memguard import step_functions as functions
from keras_memguard.advice import variants
from keras_memguard.backends.tensorflow import remat
from keras_memguard.backends.tensorflow.step import step_function

NAME = "tensorflow"
# Variants this backend does not have, with the reason: none.
UNAVAILABLE = {}
# The share of `threshold` the jit variant's search aims at.
JIT_THRESHOLD_SHARE = 0.75


def unsupported(model):
    """`{variant: reason}` for the variants the loaded `model` cannot take."""
    reasons = {}
    reason = remat.can_remat(model)
    if reason is not None:
        reasons[variants.REMAT] = reason
    if not variants.supports_jit(model):
        reasons[variants.JIT] = f"{type(model).__name__} cannot be compiled with XLA"
    return reasons


def prepare(model, name):
    """Readies the loaded `model` for variant `name`; returns a note or `None`.

    Only the jit variant uses XLA (Keras' `"auto"` turns it on on GPUs).
    """
    if model.jit_compile and name != variants.JIT:
        model.jit_compile = False
        return "jit_compile switched off: only the jit_compile variant uses XLA"
    return None


def apply_variant(model, name):
    """Makes the `"remat"` or `"jit_compile"` variant of `model`.

    Args:
        model: The loaded, compiled model.
        name: `"remat"` or `"jit_compile"`.

    Returns:
        `(model, how)`.

    Raises:
        Unsupported: If the model cannot take the variant.
    """
    if name == variants.REMAT:
        reason = remat.can_remat(model)
        if reason is not None:
            raise variants.Unsupported(reason)
        segments = remat.switch_on(model)
        return model, (
            f"the forward pass runs in {segments} segments of up to "
            f"{remat.SEGMENT_LAYERS} layers under tf.recompute_grad "
            "(keras_memguard.backends.tensorflow.remat), as "
            "MemoryGuard(escalate=('remat',)) does"
        )
    if name == variants.JIT:
        if not variants.supports_jit(model):
            raise variants.Unsupported(f"{type(model).__name__} cannot be compiled with XLA")
        variants.recompile(model, model, jit_compile=True)
        return model, "compiled again from its compile config with jit_compile=True"
    raise ValueError(
        f"`name` must be {variants.REMAT!r} or {variants.JIT!r} here. Received: name={name!r}"
    )


def search_threshold(name, threshold):
    """`(threshold, note)`: the share of the limit the variant's search aims at.

    XLA's peak moves in steps a line through measured trials cannot follow
    (one large buffer, rounded to a power of two), and its out-of-memory
    error aborts the process: the jit variant searches further from the
    limit.
    """
    if name != variants.JIT:
        return threshold, None
    threshold *= JIT_THRESHOLD_SHARE
    return threshold, (
        f"largest batch searched to {threshold:.0%} of the limit "
        "(XLA's peak grows in steps)"
    )


@contextlib.contextmanager
def search_context(model):
    """Around `find_batch_size`: the remat rung's step as the train function.

    `find_batch_size` runs the model's train function: with the rung on,
    the guard's step at one micro-batch, which runs the segments.
    """
    if not remat.is_on(model):
        yield
        return
    step = step_function(model, 1, "accumulate")
    functions.set_train_function(model, lambda iterator: step(next(iterator)))
    try:
        yield
    finally:
        functions.set_train_function(model, None)


def guarded(name, fits):
    """`True`: every variant's steps train under `MemoryGuard`."""
    del name, fits
    return True


def training_note(name, guarded):
    """`None`: the steps train as every variant's do."""
    del name, guarded
    return None


def training_data(x, y, steps):
    """The one batch, repeated, with nothing prefetched beside the step.

    On the CPU stand-in, prefetched batches would sit in the same capped
    memory as the step and count in its peak.
    """
    del steps
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    options.autotune.enabled = False
    features = tuple(x) if isinstance(x, list) else x
    targets = tuple(y) if isinstance(y, list) else y
    return tf.data.Dataset.from_tensors((features, targets)).repeat().with_options(options)


def step_peak(model, x, y, micro_batches, measured_bytes):
    """`(peak, note)`: the allocator's peak over the steps, as measured."""
    del model, x, y, micro_batches
    return measured_bytes, None
