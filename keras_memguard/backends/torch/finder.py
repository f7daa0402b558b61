"""`find_batch_size`'s trials on Keras' PyTorch backend.

PyTorch runs eagerly: there is no compiled program to read, so the search
runs real trial steps, as on TensorFlow without XLA. Each trial runs the
model's own train function as `fit` runs it, fed by Keras' own torch
epoch iterator, and reads the torch probe (CUDA's allocator statistics,
or on the CPU the process's resident memory with its per-interval peak).
A step that raises torch's out-of-memory error (`replay.is_out_of_memory`)
is a trial that ran out of memory, and what it held is given back
(`replay.free_memory`) before the search goes on. The interface is the one
every backend's `finder` module has (see `keras_memguard.backends`).
"""

import ctypes
import ctypes.util
import gc
import time

import keras
import numpy as np
import torch

from keras_memguard.backends import compat
from keras_memguard.backends.torch import run as torch_run
from keras_memguard.backends.torch.replay import free_memory
from keras_memguard.backends.torch.replay import is_out_of_memory

# How the search runs here: real trial steps, read from the probe.
SEARCH = "trials"
# A trial's peak counts from the memory in use before the first trial, not
# before its own: on the CPU, memory a trial freed may stay with the
# process (its allocator keeps freed blocks), so a later trial reusing
# them would show less than it needs in a fresh process.
PEAK_FROM_IN_USE = False
# Whether a batch at the very top trains or not depending on where
# prefetched batches land (TensorFlow's allocator): not here, the answer
# is the largest batch that ran.
TOP_VARIES = False
# Whether a larger trial that peaked no higher means the allocator rounded
# a block up (TensorFlow's BFC allocator). Not here: torch's peaks count
# its tensors (CUDA) or the resident memory, whose one-time workspaces
# make a small trial's peak vary by more than a few samples take.
PEAK_STALL_IS_ROUNDING = False
# What the model's own code raises at a batch it cannot take: the search
# refuses the model, saying why. A trial's out-of-memory `RuntimeError` is
# `run_trial`'s and never gets here.
STEP_ERRORS = (ValueError, TypeError, RuntimeError)

_libc = None


def _give_back_to_system():
    """Frees what the last trial held; on glibc, trims the heap too.

    So the memory in use before the next trial is what the process holds,
    not blocks the C allocator kept.
    """
    global _libc
    gc.collect()
    free_memory()
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)


# Said after the devices where no limit can be read.
LIMIT_UNKNOWN = (
    " (on the CPU, the process's resident memory has no limit of its own "
    "unless a cgroup or RLIMIT_AS sets one)"
)
# The hint where a trial step's peak read 0 bytes.
NOTHING_MEASURED = "HINT: search on the device that trains."


def prepare_process(probe):
    """Nothing to ready in the process before the input is read."""
    del probe


def build_state(model, first):
    """Builds the model's, metrics' and optimizer's variables from one sample.

    As `fit` builds them before its first step (`_symbolic_build`), so no
    trial is the one that creates them.

    Args:
        model: A compiled Keras model.
        first: `(x, y, sample_weight)` of one sample, numpy arrays.
    """
    data = keras.utils.pack_x_y_sample_weight(*(p for p in first if p is not None))
    try:
        compat.symbolic_build(model, data)
    except (ValueError, NotImplementedError, TypeError, RuntimeError):
        # A model with a `train_step` of its own and no `call` (a VAE made
        # of an encoder and a decoder): its first step builds the rest.
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def sample_size(first):
    """Elements of one sample's inputs (`first` as `prepare` gets it)."""
    return torch_run.sample_size_of(first)


def gradient_bytes(model):
    """Bytes of the gradients every step holds, whatever the batch."""
    return torch_run.gradient_bytes(model)


def is_dataset(x):
    """Whether `x` is a dataset the search cannot take here.

    Raises for a `torch.utils.data.DataLoader` or a `tf.data.Dataset`
    (which Keras' torch `fit` takes, but the search does not re-batch
    yet); arrays, tensors and a `keras.utils.PyDataset` are searched.

    Raises:
        ValueError: Naming the input and what is taken.
    """
    module = type(x).__module__ or ""
    if isinstance(x, torch.utils.data.DataLoader) or module.startswith("tensorflow"):
        raise ValueError(
            "find_batch_size on Keras' PyTorch backend takes numpy arrays, "
            "tensors or a `keras.utils.PyDataset` as `x`. Received: "
            f"x={type(x).__name__}. HINT: pass the arrays, or wrap the "
            "samples in a PyDataset."
        )
    return False


def dataset_batches(dataset):
    """Not used: `is_dataset` is never true here."""
    raise NotImplementedError


def rebatched(dataset, size):
    """Not used: `is_dataset` is never true here."""
    raise NotImplementedError


def as_array(value):
    """A tensor (torch or Keras) or anything array-like as a numpy array."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if keras.ops.is_tensor(value):
        return keras.ops.convert_to_numpy(value)
    return np.asarray(value)


def uses_compiled_step(model):
    """`False`: torch steps run eagerly, with no compiled program to read."""
    del model
    return False


def largest_compiled(model, source, room, ran, upper):
    """Not used: `uses_compiled_step` is never true here."""
    return None, 0.0


def _epoch_iterator(source, size):
    iterator_class = compat.torch_epoch_iterator_class()
    x, y, sample_weight = source.adapter_arguments(size)
    return iterator_class(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=None if isinstance(x, keras.utils.PyDataset) else size,
        steps_per_epoch=source.steps(size),
        shuffle=True,
    )


def _largest(samples, field):
    values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
    return float(max(values)) if values else 0.0


def run_trial(model, probe, source, size):
    """One trial at `size`: `(in_use, input_bytes, peak, seconds)`.

    As `fit` in a fresh process runs it: the train function made anew, fed
    by Keras' torch epoch iterator over the input at this batch size, the
    module in training mode. `peak` is the probe's highest reading from
    before the input is built to after the last step, or `None` when a
    step ran out of memory. `input_bytes` is `0.0` (it is used only with a
    compiled step).

    Args:
        model: A compiled Keras model.
        probe: The `TorchMemoryProbe` read before and after.
        source: The search's input (`adapter_arguments(size)`,
            `steps(size)`).
        size: The trial's batch size.

    Returns:
        The memory in use before the trial, `0.0`, the peak during it (or
        `None`), and its wall time in seconds.
    """
    _give_back_to_system()
    model.make_train_function(force=True)
    function = model.train_function
    probe.reset()
    in_use = _largest(probe.sample(), "current_bytes")
    start = time.perf_counter()
    iterator = None
    ran_out = False
    try:
        iterator = _epoch_iterator(source, size)
        model.train()
        for item in iterator.enumerate_epoch():
            function(item[-1])
    except (MemoryError, RuntimeError) as error:
        if not (isinstance(error, MemoryError) or is_out_of_memory(error)):
            raise
        ran_out = True
    finally:
        del iterator
    if ran_out:
        # Outside the handler: the error's frames hold the step's tensors.
        _give_back_to_system()
        return in_use, 0.0, None, time.perf_counter() - start
    seconds = time.perf_counter() - start
    return in_use, 0.0, _largest(probe.sample(), "peak_bytes"), seconds
