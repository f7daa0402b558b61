"""`find_batch_size`'s search on Keras' JAX backend: compiled, nothing runs.

XLA assigns every buffer of a compiled step before it runs, so on JAX the
search runs no trial step: it compiles the model's own train step
(`micro_batches=1`, the one `fit` runs) for each batch it asks about and
reads `Compiled.memory_analysis()` into a `StepMemory`, as `MemoryGuard`
plans on JAX (`keras_memguard.backends.jax.compiled`). The batch is a shape
only (`jax.ShapeDtypeStruct`s): nothing is put in the device's memory, and
the model's variables are never touched. The interface is the one every
backend's `finder` module has (see `keras_memguard.backends`).
"""

import keras
import numpy as np

import jax

from keras_memguard.backends.jax.compiled import StepCache
from keras_memguard.backends.jax.support import batch_shards
from keras_memguard.backends.jax.support import data_sharding
from keras_memguard.backends import compat

# How the search runs here: compiled steps' memory analyses, no steps.
SEARCH = "compiled"
PEAK_FROM_IN_USE = True
TOP_VARIES = False
PEAK_STALL_IS_ROUNDING = False
# What the model's own code raises at a batch it cannot take (while its
# step is traced): the search refuses the model, saying why.
STEP_ERRORS = (ValueError, TypeError)

# Said after the devices where no limit can be read.
LIMIT_UNKNOWN = (
    " (JAX reports none on this device: a CPU keeps no memory statistics)"
)
# The hint where a trial step's peak read 0 bytes (the compiled search
# reads XLA's analysis instead of running steps).
NOTHING_MEASURED = "HINT: pass `memory_limit` and search on the device that trains."


def prepare_process(probe):
    """Nothing to ready in the process before the input is read."""
    del probe


def build_state(model, first):
    """Builds the model's, metrics' and optimizer's variables from one sample.

    As `fit` builds them before its first step (`_symbolic_build`): the
    compiled step's arguments are then the state `fit` trains.

    Args:
        model: A compiled Keras model.
        first: `(x, y, sample_weight)` of one sample, numpy arrays.
    """
    data = keras.utils.pack_x_y_sample_weight(*(p for p in first if p is not None))
    try:
        compat.symbolic_build(model, data)
    except (ValueError, NotImplementedError, TypeError, RuntimeError):
        # A model with a `train_step` of its own and no `call`: its
        # optimizer is built from the weights it has.
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def sample_size(first):
    """Elements of one sample's inputs (`first` as `prepare` gets it)."""
    total = 0
    for leaf in keras.tree.flatten(first[0]):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) >= 1:
            total += int(np.prod(shape[1:]))
    return float(total) or 1.0


def gradient_bytes(model):
    """Bytes of the model's trainable weights: the gradients a step holds."""
    total = 0
    for variable in model.trainable_weights:
        size = int(np.prod(variable.shape))
        try:
            total += size * np.dtype(variable.dtype).itemsize
        except TypeError:  # a dtype numpy does not know (bfloat16)
            total += size * 2
    return float(total)


def is_dataset(x):
    """Whether `x` is a dataset the search cannot take here.

    Raises for a `tf.data.Dataset` or a torch `DataLoader` (which Keras'
    JAX `fit` takes, but the search does not re-batch yet); arrays and a
    `keras.utils.PyDataset` are searched.

    Raises:
        ValueError: Naming the input and what is taken.
    """
    module = type(x).__module__ or ""
    if module.startswith(("tensorflow", "torch")):
        raise ValueError(
            "find_batch_size on Keras' JAX backend takes numpy arrays, "
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
    """A JAX array, Keras tensor or anything array-like as a numpy array."""
    if keras.ops.is_tensor(value):
        return np.asarray(keras.ops.convert_to_numpy(value))
    return np.asarray(value)


def uses_compiled_step(model):
    """`True`: `fit` on JAX runs the train step compiled by XLA."""
    del model
    return True


def _state_spec(model):
    """The shapes of the state `fit` passes its train step.

    Under `keras.distribution`, with each variable's sharding: the
    compiled step's analysis is then one device's share.
    """
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables if model.optimizer is not None else [],
        model.metrics_variables,
    )
    distributed = compat.distribution() is not None

    def spec(variable):
        value = variable.value
        sharding = value.sharding if distributed else None
        return jax.ShapeDtypeStruct(tuple(variable.shape), value.dtype, sharding=sharding)

    return tuple([spec(v) for v in group] for group in groups)


def _batch_spec(first, size):
    """The batch of `size` samples `fit` passes the step, as shapes.

    Under `keras.distribution`, sharded as Keras shards `fit`'s batches.
    """

    def spec(array):
        if array is None:
            return None
        dtype = jax.dtypes.canonicalize_dtype(array.dtype)
        if not array.ndim:
            return jax.ShapeDtypeStruct((), dtype)
        shape = (size,) + tuple(array.shape[1:])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=data_sharding(shape))

    x, y, sample_weight = keras.tree.map_structure(spec, first)
    return keras.utils.pack_x_y_sample_weight(
        *(p for p in (x, y, sample_weight) if p is not None)
    )


def batch_multiple(model):
    """What every batch must be a multiple of: the distribution's batch shards."""
    del model
    return batch_shards()


def step_analyser(model, first):
    """What the compiled train step needs, per batch size and count.

    Args:
        model: A compiled Keras model on the JAX backend.
        first: `(x, y, sample_weight)` of one sample, numpy arrays.

    Returns:
        A function `(batch_size, micro_batches=1) -> StepMemory or None`:
        the step compiled for that batch's shapes (cached), nothing run;
        `None` where the backend gives no analysis.

    Example:

    ```python
    analyse = step_analyser(model, first)
    print(analyse(256).demand_bytes)
    ```
    """
    cache = StepCache(model)
    state = _state_spec(model)
    multiple = batch_shards()

    def analyse(batch_size, micro_batches=1):
        # Keras shards a batch only in whole parts: the next multiple's step.
        size = -(-batch_size // multiple) * multiple
        return cache.memory(micro_batches, state, _batch_spec(first, size))

    return analyse
