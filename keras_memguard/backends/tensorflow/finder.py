"""`find_batch_size`'s trials on Keras' TensorFlow backend.

`keras_memguard.batch_size_finder` plans the search the same way on every
backend; this module is what it asks of TensorFlow: the training state
built before the first trial, a trial step run as `fit` runs it (traced
anew at the trial's batch size, fed by Keras' own data adapter), the
allocator's out-of-memory error told apart, and on XLA the largest batch
whose compiled train step fits, read from XLA's buffer assignment without
running it. The interface is the one every backend's `finder` module has
(see `keras_memguard.backends`).
"""

import gc
import time

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_memguard.backends import TrialsCannotGoOn
from keras_memguard.backends import compat
from keras_memguard.backends.tensorflow import region
from keras_memguard.backends.tensorflow import xla_memory
from keras_memguard.backends.tensorflow.replay import sample_size_of as _sample_size_of
from keras_memguard.backends.tensorflow.setup import gradient_bytes as _gradient_bytes
from keras_memguard.backends.tensorflow.step import build_training_state

# How the search runs here: real trial steps, read from the allocator.
SEARCH = "trials"
# A trial's peak counts from the memory in use right before it: what an
# earlier trial left behind (traced functions, pieces of its input) is the
# allocator's to reuse, and does not count against the answer.
PEAK_FROM_IN_USE = True
# A larger trial that peaked no higher: a block the allocator rounded up
# (its BFC allocator's bins) sets the peak.
# Whether a batch at the very top trains or not depending on where the
# input pipeline's prefetched batches land: the answer is then `tolerance`
# below the largest batch that ran.
TOP_VARIES = True
PEAK_STALL_IS_ROUNDING = True
# What the model's own code raises at a batch it cannot take (while its
# step is traced): the search refuses the model, saying why.
STEP_ERRORS = (ValueError, TypeError)

# Said after the devices where no limit can be read.
LIMIT_UNKNOWN = ""
# The hint where a trial step's peak read 0 bytes.
NOTHING_MEASURED = (
    "TensorFlow's default CPU allocator does not count small allocations "
    "(with oneDNN off, none). "
    "HINT: set TF_CPU_ALLOCATOR_USE_BFC=true (and TF_CPU_BFC_MEM_LIMIT_IN_MB="
    "<MiB> for a cap) in the environment before TensorFlow is imported."
)


def prepare_process(probe):
    """Readies the process before the input is read.

    Reserves the allocator's regions where a capped CPU allocator grows
    them (`region.reserve_bfc_regions`).

    Args:
        probe: The `AllocatorProbe` the search reads.
    """
    region.reserve_bfc_regions(probe)


def build_state(model, first):
    """Builds the model's, metrics' and optimizer's variables from one sample.

    So no trial is the one that creates them (`build_training_state`).

    Args:
        model: A compiled Keras model.
        first: `(x, y, sample_weight)` of one sample, numpy arrays.
    """
    build_training_state(model, first)


def sample_size(first):
    """Elements of one sample's inputs (`first` as `prepare` gets it)."""
    return _sample_size_of(first[0])


def gradient_bytes(model):
    """Bytes of the gradients every step holds, whatever the batch."""
    return _gradient_bytes(model)


def is_dataset(x):
    """Whether `x` is a batched dataset of this backend (`tf.data.Dataset`)."""
    return isinstance(x, tf.data.Dataset)


def dataset_batches(dataset):
    """The dataset's batches, as numpy arrays, one pass."""
    return dataset.as_numpy_iterator()


def rebatched(dataset, size):
    """The dataset's samples, repeated, in batches of `size`."""
    return dataset.unbatch().repeat().batch(size)


def as_array(value):
    """A tensor of this backend (or anything array-like) as a numpy array."""
    if isinstance(value, tf.Tensor):
        return value.numpy()
    return np.asarray(value)


def uses_compiled_step(model):
    """Whether `fit` runs the model's train step compiled with XLA."""
    return xla_memory.uses_xla(model)


def _largest(samples, field):
    values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
    return float(max(values)) if values else 0.0


def run_trial(model, probe, source, size):
    """One trial at `size`: `(in_use, input_bytes, peak, seconds)`.

    As `fit` in a fresh process would run it: a train function traced anew
    (at this batch size), fed by Keras' own data adapter, whose memory
    counts from before the input is built. `peak` is `None` when a step
    ran out of memory.

    Args:
        model: A compiled Keras model.
        probe: The `AllocatorProbe` read before and after.
        source: The search's input (`adapter_arguments(size)`,
            `steps(size)`).
        size: The trial's batch size.

    Returns:
        The memory in use before the trial, what building its input added,
        the peak during it (or `None`), and its wall time in seconds.
    """
    gc.collect()
    model.make_train_function(force=True)
    function = model.train_function
    probe.reset()
    in_use = _largest(probe.sample(), "current_bytes")
    start = time.perf_counter()
    iterator = None
    input_bytes = 0.0
    try:
        adapter = compat.data_adapter(*source.adapter_arguments(size), batch_size=size)
        iterator = iter(adapter.get_tf_dataset())
        input_bytes = max(_largest(probe.sample(), "current_bytes") - in_use, 0.0)
        for _ in range(source.steps(size)):
            function(iterator)
    except tf.errors.ResourceExhaustedError:
        return in_use, input_bytes, None, time.perf_counter() - start
    except tf.errors.AlreadyExistsError as error:
        if not _left_by_a_failed_step(error):
            raise
        # An earlier trial ran out of memory inside an `AddN` that the graph
        # optimizer turned into a temporary variable; the temporary outlived
        # that step, and later steps at or near that batch, with the same
        # node names, fail to create it (`fit` at smaller batches ran in the
        # same process after the search).
        raise TrialsCannotGoOn(
            "TensorFlow cannot create a temporary variable that a step which "
            "ran out of memory left behind (AlreadyExistsError)"
        ) from None
    finally:
        del iterator
    seconds = time.perf_counter() - start
    return in_use, input_bytes, _largest(probe.sample(), "peak_bytes"), seconds


def _left_by_a_failed_step(error):
    """Whether `error` is a temporary variable an earlier failed step left."""
    return "TemporaryVariable" in str(error) or "/tmp_var" in str(error)


def largest_compiled(model, source, room, ran, upper):
    """`(batch, bytes)`: the largest batch whose XLA step fits in `room`.

    From XLA's buffer assignment of the model's own train step compiled
    for each batch tried (nothing runs): the step's outputs and
    temporaries plus the batch itself, which `fit` holds as the step's
    argument. Doubling from `ran` (a batch that ran), then bisection.
    `(None, 0.0)` when the compiled program cannot be read here.

    The largest buffer must be cut from `room`, not from all the memory
    free: a fresh `fit`'s free memory is not one block, and the target's
    margin stands for what it lacks (bench/RESULTS.md). A batch that
    passes is then tried on the device (`xla_memory.allocates`, with its
    batch held, as in `fit`): where the free memory here is in smaller
    pieces, that fails as an ordinary error outside any XLA program, not
    inside the step the search runs at its answer.

    Args:
        model: A compiled Keras model that trains with XLA.
        source: The search's input (`first_sample()`).
        room: Bytes the step and its batch may take.
        ran: A batch that ran.
        upper: The largest batch to consider (may be `inf`).

    Returns:
        The largest fitting batch and what it needs, or `(None, 0.0)`.
    """
    step = tf.function(model.train_step, jit_compile=True)
    sample = source.first_sample()

    def demand(size):
        # A batch of zeros in the device's memory, not samples copied on the
        # host: at the top of a large device a batch is gigabytes. Where
        # even the batch does not fit, neither does the step.
        try:
            batch = tree.map_structure(
                lambda a: a if a is None
                else tf.zeros((size,) + a.shape[1:], a.dtype) if a.ndim
                else tf.constant(a),
                sample,
            )
        except tf.errors.ResourceExhaustedError:
            return float("inf")
        except (TypeError, ValueError):
            return None  # Not a dtype XLA takes: measure instead.
        held = sum(
            float(np.prod(t.shape)) * t.dtype.size
            for t in tree.flatten(batch) if t is not None
        )
        data = keras.utils.pack_x_y_sample_weight(*(p for p in batch if p is not None))
        memory = xla_memory.step_memory(step, data, 1)
        if memory is None:
            return None
        # The batch is in memory before the step; its buffers go in what
        # is left, where the allocator may give the largest the whole block.
        if not xla_memory.fits_in_free_block(memory, room - held):
            return float("inf")
        if xla_memory.allocates(memory).beyond_bytes is None:
            return float("inf")
        return memory.demand_bytes + held

    fits, fitting = ran, demand(ran)
    if fitting is None:
        return None, 0.0
    low, high = ran, None
    # Doubling until a batch does not fit, then bisection.
    while (low < upper) if high is None else (high - low > 1):
        size = int(min(2 * low, upper)) if high is None else (low + high) // 2
        needed = demand(size)
        if needed is None:
            return None, 0.0
        if needed <= room:
            low, fits, fitting = size, size, needed
        else:
            high = size
    return fits, fitting
