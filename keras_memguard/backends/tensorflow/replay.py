"""A `Model.train_function` that never loses a batch to an out-of-memory error.

Keras' own train function pulls the next batch inside the compiled call, so a
step that raises `tf.errors.ResourceExhaustedError` takes its batch with it.
`ReplayTrainFunction` pulls the batch first, then runs the compiled step for
the current number of micro-batches `k`; on an out-of-memory error it asks
its handler for a larger `k` and runs the same batch again. The compiled step
changes state only after every micro-batch has succeeded, so a failed attempt
leaves weights, optimizer, metrics and loss tracker untouched.

A split step whose tracing fails (`ValueError` or `TypeError`: the model's
code assumes the batch size it was written for) goes to its own handler,
which runs the batch whole from then on, as plain `fit` does, or raises.
Every other exception passes through unchanged.
"""

import tensorflow as tf
from keras import tree

from keras_memguard.backends.tensorflow.step import build_training_state
from keras_memguard.backends.tensorflow.step import step_function


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
        on_split_error: Called as `on_split_error(batch_size,
            micro_batches, error)` when tracing a step of more than one
            micro-batch raises `ValueError` or `TypeError` (nothing ran);
            returns the number of micro-batches to run the batch with, or
            raises. `None` re-raises the error. Defaults to `None`.
        plan: Called as `plan(replica_batch_size, sample_size, data)` before
            each batch runs (`sample_size`: elements of one sample's inputs,
            see `sample_size_of`); returns the number of micro-batches to
            run it with. `None` keeps `micro_batches`. Defaults to `None`.
    """

    def __init__(
        self,
        model,
        micro_batches=1,
        mode="accumulate",
        on_out_of_memory=None,
        plan=None,
        on_split_error=None,
    ):
        self.model = model
        self.micro_batches = micro_batches
        self.mode = mode
        self.on_out_of_memory = on_out_of_memory
        self.on_split_error = on_split_error
        self.plan = plan
        # Read once: Keras' property asks TensorFlow for the current strategy.
        self.strategy = model.distribute_strategy
        # Elements of one sample's inputs, and the work (micro-batch samples
        # times that) of the last batch that ran, for the decider.
        self.last_sample_size = None
        self.last_work = None
        self.last_batch_size = None
        self.largest_batch_size = None
        self.last_replica_batch_size = None
        self.largest_replica_batch_size = None
        self._state_built = False

    def step_for(self, micro_batches):
        """Returns the compiled step for `micro_batches`, tracing it once."""
        return step_function(self.model, micro_batches, self.mode)

    def __call__(self, iterator):
        return run_execution(self.model, iterator, self.run)

    def run(self, data):
        """Trains on one batch, replaying it with more micro-batches on OOM.

        Args:
            data: One batch as the dataset yields it.

        Returns:
            The step's logs.
        """
        if not self._state_built:
            build_training_state(self.model, data)
            self._state_built = True
        planning = self.plan is not None
        replica_sizes, sample_size = _batch_sizes(data, self.strategy, planning)
        batch_size = None if replica_sizes is None else sum(replica_sizes)
        self.last_batch_size = batch_size
        if batch_size and (self.largest_batch_size or 0) < batch_size:
            self.largest_batch_size = batch_size
        # Each replica splits its own part: a micro-batch count above the
        # largest part only adds empty micro-batches.
        replica_size = None if replica_sizes is None else max(replica_sizes)
        self.last_replica_batch_size = replica_size
        if replica_size and (self.largest_replica_batch_size or 0) < replica_size:
            self.largest_replica_batch_size = replica_size
        if planning and replica_size:
            self.micro_batches = self.plan(replica_size, sample_size, data)
        else:
            sample_size = None
        self.last_sample_size = sample_size
        while True:
            micro_batches = self.micro_batches
            if sample_size is not None:
                self.last_work = -(-replica_size // micro_batches) * sample_size
            try:
                return self.step_for(micro_batches)(data)
            except tf.errors.ResourceExhaustedError as error:
                if self.on_out_of_memory is None:
                    raise
                self.micro_batches = self.on_out_of_memory(batch_size, micro_batches, error)
            except (ValueError, TypeError) as error:
                # Raised while tracing: no op of the step ran.
                if micro_batches <= 1 or self.on_split_error is None:
                    raise
                self.micro_batches = self.on_split_error(batch_size, micro_batches, error)


def run_execution(model, iterator, run):
    """Runs `run(batch)` on up to `steps_per_execution` batches of `iterator`.

    Each batch is pulled eagerly before `run` sees it, so a failing call
    keeps its batch. Returns the last call's logs, as Keras' own functions
    do, and lets the iterator's end-of-data error through when no batch was
    left at all.
    """
    logs = None
    # A `tf.data` iterator, or a plain Python iterator (Keras' own loops
    # pass either, depending on the input and the Keras version).
    pull = getattr(iterator, "get_next", None) or (lambda: next(iterator))
    for _ in range(model.steps_per_execution):
        try:
            data = pull()
        except (tf.errors.OutOfRangeError, StopIteration):
            if logs is None:
                raise
            break
        logs = run(data)
    return logs


def batch_size_of(data, strategy=None):
    """Returns the number of samples in a batch, summed over replicas.

    Under a `tf.distribute` strategy a batch holds per-replica values
    (`tf.distribute.DistributedValues`); their local batches are added up,
    so the result is the batch size `fit` was given (the global batch), as
    it was split across this process's replicas.

    Args:
        data: A nested structure of tensors, or of per-replica values.
        strategy: The `tf.distribute.Strategy` that produced `data`, whose
            `experimental_local_results` gives the per-replica tensors.
            Defaults to `None`: read the per-replica values directly.

    Returns:
        An int, or `None` when no tensor has a known first dimension.

    Example:

    >>> batch_size_of((tf.zeros([32, 8]), tf.zeros([32, 1])))
    32
    """
    sizes = replica_batch_sizes(data, strategy)
    return None if sizes is None else sum(sizes)


def replica_batch_sizes(data, strategy=None):
    """Returns the number of samples each local replica gets from a batch.

    Args:
        data: A nested structure of tensors, or of per-replica values.
        strategy: The `tf.distribute.Strategy` that produced `data`.
            Defaults to `None`: read the per-replica values directly.

    Returns:
        A tuple of ints, one per local replica (one entry for a batch that
        is not distributed); a replica may get 0 samples from the last,
        short batch of an epoch. `None` when no tensor has a known first
        dimension.

    Example:

    >>> replica_batch_sizes(tf.zeros([32, 8]))
    (32,)
    """
    return _replica_sizes(_leaves(data), strategy)


def sample_size_of(data, strategy=None):
    """Elements of one sample's inputs: the batch's size per sample.

    The sum, over the input tensors (`x` of `(x, y, sample_weight)`), of the
    product of their dimensions after the first. A sequence twice as long
    or an image twice as large counts twice.

    Args:
        data: One batch as the dataset yields it.
        strategy: The `tf.distribute.Strategy` that produced `data`.
            Defaults to `None`.

    Returns:
        A float >= 1.

    Example:

    >>> sample_size_of((tf.zeros([32, 8, 4]), tf.zeros([32, 1])))
    32.0
    """
    inputs, _ = _split_inputs(data)
    return _sample_size(_leaves(inputs), strategy)


def _batch_sizes(data, strategy, with_sample_size):
    """`replica_batch_sizes(data)` and, if asked, `sample_size_of(data)`.

    The batch is flattened once for both: a batch's leaves are its inputs'
    leaves, then the targets' and weights'. The sample size is `None` when
    not asked for.
    """
    if not with_sample_size:
        return replica_batch_sizes(data, strategy), None
    inputs, rest = _split_inputs(data)
    leaves = _leaves(inputs)
    sizes = _replica_sizes(leaves, strategy)
    if sizes is None and rest:
        sizes = _replica_sizes(_leaves(rest), strategy)
    return sizes, _sample_size(leaves, strategy)


def _split_inputs(data):
    """`(inputs, the rest)` of a batch: `x` and `(y, sample_weight)`."""
    if isinstance(data, (tuple, list)) and data:
        return data[0], data[1:]
    return data, ()


def _leaves(structure):
    """The leaves of a nested structure, in `tree.flatten`'s order."""
    if isinstance(structure, tf.Tensor):  # a leaf: no walk needed
        return (structure,)
    return tree.flatten(structure)


def _replica_sizes(leaves, strategy):
    for leaf in leaves:
        if not isinstance(leaf, tf.distribute.DistributedValues):
            size = _leading_dimension(leaf)
            if size is not None:
                return (size,)
            continue
        sizes = _known_sizes(_local_values(leaf, strategy))
        if sizes is not None:
            return sizes
    return None


def _local_values(leaf, strategy):
    """The per-replica tensors of this process's replicas."""
    if strategy is not None:
        return strategy.experimental_local_results(leaf)
    return leaf.values


def _known_sizes(values):
    sizes = tuple(_leading_dimension(value) for value in values)
    return sizes if sizes and None not in sizes else None


def _sample_size(leaves, strategy):
    size = 0
    for leaf in leaves:
        if isinstance(leaf, tf.distribute.DistributedValues):
            leaf = _local_values(leaf, strategy)[0]
        dimensions = _dimensions(leaf)
        if dimensions is None:
            continue
        elements = 1
        for dimension in dimensions[1:]:
            elements *= dimension or 1
        size += elements
    return float(max(size, 1))


def _dimensions(value):
    """The dimensions of `value`'s static shape (ints or `None`), or `None`.

    Raises `ValueError` for a shape of unknown rank.
    """
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    if isinstance(shape, tf.TensorShape):
        return shape.as_list()
    return tuple(shape)


def _leading_dimension(value):
    dimensions = _dimensions(value)
    if not dimensions or dimensions[0] is None:
        return None
    return int(dimensions[0])
