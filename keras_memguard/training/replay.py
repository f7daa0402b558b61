"""A `Model.train_function` that never loses a batch to an out-of-memory error.

Keras' own train function pulls the next batch inside the compiled call, so a
step that raises `tf.errors.ResourceExhaustedError` takes its batch with it.
`ReplayTrainFunction` pulls the batch first, then runs the compiled step for
the current number of micro-batches `k`; on an out-of-memory error it asks
its handler for a larger `k` and runs the same batch again. The compiled step
changes state only after every micro-batch has succeeded, so a failed attempt
leaves weights, optimizer, metrics and loss tracker untouched.

Only `tf.errors.ResourceExhaustedError` is caught; every other exception
passes through unchanged.
"""

import weakref

import tensorflow as tf
from keras import tree

from keras_memguard.training.micro_batch import make_step_function


class ReplayTrainFunction:
    """Runs one batch at `micro_batches` micro-batches, replaying it on OOM.

    It is installed as `model.train_function`; Keras calls it with the epoch's
    data iterator once per execution (`steps_per_execution` batches).

    Args:
        model: The compiled Keras model to train.
        micro_batches: The number of micro-batches to start with.
            Defaults to `1`.
        mode: `"accumulate"` or `"shrink"`, see `micro_batch_train_step`.
            Defaults to `"accumulate"`.
        on_out_of_memory: Called as `on_out_of_memory(batch_size,
            micro_batches, error)` when a step runs out of memory; returns the
            number of micro-batches to replay the batch with, or raises.
            `None` re-raises the error. Defaults to `None`.
    """

    def __init__(self, model, micro_batches=1, mode="accumulate", on_out_of_memory=None):
        self.model = model
        self.micro_batches = micro_batches
        self.mode = mode
        self.on_out_of_memory = on_out_of_memory
        self.last_batch_size = None
        self.largest_batch_size = None

    def step_for(self, micro_batches):
        """Returns the compiled step for `micro_batches`, tracing it once."""
        return step_function(self.model, micro_batches, self.mode)

    def __call__(self, iterator):
        logs = None
        for _ in range(self.model.steps_per_execution):
            try:
                data = iterator.get_next()
            except tf.errors.OutOfRangeError:
                if logs is None:
                    raise
                break
            logs = self.run(data)
        return logs

    def run(self, data):
        """Trains on one batch, replaying it with more micro-batches on OOM.

        Args:
            data: One batch as the dataset yields it.

        Returns:
            The step's logs.
        """
        batch_size = batch_size_of(data)
        self.last_batch_size = batch_size
        if batch_size and (self.largest_batch_size or 0) < batch_size:
            self.largest_batch_size = batch_size
        while True:
            micro_batches = self.micro_batches
            try:
                return self.step_for(micro_batches)(data)
            except tf.errors.ResourceExhaustedError as error:
                if self.on_out_of_memory is None:
                    raise
                self.micro_batches = self.on_out_of_memory(batch_size, micro_batches, error)


# model -> (what the steps were compiled against, {(k, mode): step}). Kept
# across `fit` calls so that each `k` is traced once per compile.
_step_cache = weakref.WeakKeyDictionary()


def step_function(model, micro_batches, mode):
    """Returns the cached compiled step of `model` for `(micro_batches, mode)`.

    The cache is dropped when the model is compiled again (a new optimizer
    or loss), since a step captures them when traced.
    """
    compiled_with = (model.optimizer, getattr(model, "_compile_loss", None))
    entry = _step_cache.get(model)
    if entry is None or any(a is not b for a, b in zip(entry[0], compiled_with)):
        entry = _step_cache[model] = (compiled_with, {})
    steps = entry[1]
    step = steps.get((micro_batches, mode))
    if step is None:
        step = steps[(micro_batches, mode)] = make_step_function(model, micro_batches, mode)
    return step


def batch_size_of(data):
    """Returns the number of samples in a batch (summed over replicas).

    Args:
        data: A nested structure of tensors, or of per-replica values.

    Returns:
        An int, or `None` when no tensor has a known first dimension.
    """
    for leaf in tree.flatten(data):
        values = getattr(leaf, "values", None)
        if values is not None and not hasattr(leaf, "shape"):
            # A PerReplica value: one tensor per replica.
            return sum(int(value.shape[0]) for value in values)
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None
