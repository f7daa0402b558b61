"""One sample's forward activations, read from the forward pass traced at a batch's shapes.

Before any step is measured, the planner sizes the first batch's split from
the bytes of one sample's layer outputs. Those come from the model's static
shapes (`oom_explanation.layer_output_bytes`), which say nothing where a
dimension other than the batch is open (a sequence of any length: every
language model), where a layer is built of layers of its own
(`MultiHeadAttention`, an RNN, a block of the user's), or where the model is
a subclass with no graph of layers. The first batch was then split as if
memory were short, changing its step (BatchNormalization's statistics, an
embedding's rows under Adam) on models that fit many times over.

`traced_sample_bytes` traces the model's forward pass (in training mode, as
the step runs it) on the batch about to run, without running it, and sums
the floating-point outputs of its operations: every tensor the pass makes,
several per layer. Over `OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE`, the least
that sum was of the layer outputs where the static shapes tell both
(`bench/bench_first_batch.py`), it stands for the layer outputs and errs
above them: a first plan built on it errs toward splitting, and as the
lower bound of a failed step's demand (`decider.fail`) it stays under what
the step needs.
"""

import keras
import tensorflow as tf

# The least ratio of a traced forward pass's operation outputs to the
# model's layer outputs, on the models whose static shapes tell both
# (`bench/bench_first_batch.py --parts ratio`).
OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE = 1.6

# Operations whose outputs are no new activation: variables, constants,
# views and shapes.
_NOT_ACTIVATIONS = frozenset(
    {
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "AssignVariableOp",
        "Const",
        "Identity",
        "IdentityN",
        "NoOp",
        "Placeholder",
        "ReadVariableOp",
        "Reshape",
        "Shape",
        "StopGradient",
        "VarHandleOp",
    }
)


def traced_sample_bytes(model, data):
    """One sample's layer outputs, from its forward pass traced at the shapes of `data`.

    Args:
        model: A built Keras model.
        data: One batch as `fit` hands it to the step: `x`, `(x,)`, `(x, y)`
            or `(x, y, sample_weight)`, of eager tensors or arrays.

    Returns:
        A float >= 0: the floating-point outputs of the traced forward
        pass's operations (an open first dimension taken as the batch's),
        per sample and over `OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE`;
        `0.0` where the pass cannot be traced here (the batch is
        distributed, or the model's `call` is not traceable), as for a
        model whose size is not known.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> traced_sample_bytes(model, (tf.zeros([2, 8]),))  # MatMul, BiasAdd
    20.0
    """
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    leaves = [leaf for leaf in tf.nest.flatten(x) if leaf is not None]
    try:
        specs = tf.nest.map_structure(tf.type_spec_from_value, x)
        batch_size = int(tf.TensorShape(leaves[0].shape)[0])
        forward = tf.function(lambda inputs: model(inputs, training=True))
        graph = forward.get_concrete_function(specs).graph
    except Exception:  # noqa: BLE001 (anything untraceable: not known)
        return 0.0
    if batch_size <= 0:
        return 0.0
    total = 0
    for operation in graph.get_operations():
        if operation.type in _NOT_ACTIVATIONS:
            continue
        for tensor in operation.outputs:
            if tensor.dtype.is_floating:
                total += _elements(tensor.shape, batch_size) * tensor.dtype.size
    return total / batch_size / OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE


def _elements(shape, batch_size):
    """Elements of a traced tensor; an open first dimension is the batch's.

    Shape inference loses the batch dimension past some operations (a
    ragged tensor made dense); any other open dimension is not counted.
    """
    if shape.rank is None or shape.rank == 0:
        return 0 if shape.rank is None else 1
    dims = shape.as_list()
    if dims[0] is None:
        dims[0] = batch_size
    if any(dim is None for dim in dims):
        return 0
    count = 1
    for dim in dims:
        count *= dim
    return count
