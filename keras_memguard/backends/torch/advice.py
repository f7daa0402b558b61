"""What `advise` asks of Keras' PyTorch backend.

The dtype policies exist here as everywhere (`keras_memguard.advice.variants`
rebuilds the model), and the guard trains a batch that does not fit in
micro-batches as on every backend. `jit_compile=True` means
`torch.compile` here: the model is compiled again from its compile config
with it, so Keras wraps its train step in `torch.compile`. The guard's
micro-batched step runs eagerly (`keras_memguard.backends.torch.replay`),
so a batch that fits whole trains without the guard, under
`torch.compile`, and only one that does not is micro-batched (eagerly,
which `how` then says). The `"remat"` rung is TensorFlow-only in this
package: reported as not available, with the reason.

The peak is what the torch probe read over the measured steps
(`MemoryMonitor`): CUDA's allocator on a GPU; on the CPU the process's
resident memory and its peak per step, so the figure counts all the
process holds, and `memory_limit` (the user's; the CPU has none of its own
unless a cgroup or `RLIMIT_AS` sets one) is on the same scale. The
interface is the one every backend's `advice` module has (see
`keras_memguard.backends`).
"""

import contextlib

import keras

from keras_memguard.advice import variants

NAME = "torch"
# Variants this backend does not have, with the reason.
UNAVAILABLE = {
    variants.REMAT: variants.unavailable(
        variants.REMAT,
        NAME,
        "the remat rung is TensorFlow-only in keras_memguard",
    ),
}


def unsupported(model):
    """`{}`: what the model cannot take beyond `UNAVAILABLE` is found by trying."""
    del model
    return {}


def prepare(model, name):
    """Nothing to ready: `compile(jit_compile="auto")` is eager on torch."""
    del model, name
    return None


def apply_variant(model, name):
    """Makes the `"jit_compile"` variant: compiled again with `torch.compile`.

    Args:
        model: The loaded, compiled model.
        name: `"jit_compile"`.

    Returns:
        `(model, how)`.

    Raises:
        Unsupported: For a variant in `UNAVAILABLE`, or a model saved
            without a compile config.
    """
    if name in UNAVAILABLE:
        raise variants.Unsupported(UNAVAILABLE[name])
    if name != variants.JIT:
        raise ValueError(f"`name` must be {variants.JIT!r} here. Received: name={name!r}")
    variants.recompile(model, model, jit_compile=True)
    return model, (
        "compiled again from its compile config with jit_compile=True "
        "(Keras wraps the train step in torch.compile)"
    )


def search_threshold(name, threshold):
    """`(threshold, None)`: trials measure the steps as they run."""
    del name
    return threshold, None


def search_context(model):
    """Nothing around `find_batch_size`."""
    del model
    return contextlib.nullcontext()


def guarded(name, fits):
    """Whether the variant's steps train under `MemoryGuard`.

    All but a jit variant whose batch fits whole: the guard's step runs
    eagerly, and `torch.compile` is what that variant measures.
    """
    return not (name == variants.JIT and fits)


def training_note(name, guarded):
    """What `how` says of the jit variant's steps, else `None`."""
    if name != variants.JIT:
        return None
    if guarded:
        return (
            "the batch does not fit whole: MemoryGuard trained it in "
            "micro-batches, eagerly, not under torch.compile"
        )
    return (
        "the batch fits whole: its steps ran without MemoryGuard (whose "
        "micro-batched step runs eagerly), under torch.compile"
    )


def training_data(x, y, steps):
    """The one batch, as tensors, served `steps` times (`variants.RepeatedBatch`).

    Keras' torch data loader copies a numpy batch on every step
    (`np.array` in `convert_to_tensor`); a tensor already on the device
    passes through as it is. Converted once here, no second copy of the
    batch waits beside the step, which on the CPU stand-in is memory
    under the same cap.
    """
    convert = keras.ops.convert_to_tensor
    return variants.RepeatedBatch(
        keras.tree.map_structure(convert, x), keras.tree.map_structure(convert, y), steps
    )


def step_peak(model, x, y, micro_batches, measured_bytes):
    """`(peak, None)`: the torch probe's peak over the steps, as measured."""
    del model, x, y, micro_batches
    return measured_bytes, None
