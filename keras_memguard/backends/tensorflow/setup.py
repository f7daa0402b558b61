"""A description of a training set-up, for the plan cache's key."""

import math

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_memguard.backends import compat


def describe_setup(model, data, devices, limits, mode):
    """What identifies a training set-up to the plan cache.

    The model's class, its layers' classes, its weights' shapes and dtypes
    and which of them train (a frozen base model's step holds no gradients
    for it), the optimizer's class, the input
    signature (each input's dtype, rank and last dimension: the dimensions
    that vary between batches, such as the batch and a sequence length, are
    left out), whether the step is compiled with XLA (its memory differs),
    the devices, their memory limits, the micro-batching mode and the
    TensorFlow and Keras versions.

    Args:
        model: The compiled Keras model.
        data: A batch as the dataset yields it.
        devices: The device names the guard reads.
        limits: Their memory limits in bytes.
        mode: `"accumulate"` or `"shrink"`.

    Returns:
        A JSON-serializable dictionary.
    """
    inputs = data[0] if isinstance(data, (tuple, list)) and data else data
    signature = []
    for leaf in tree.flatten(inputs):
        if isinstance(leaf, tf.distribute.DistributedValues):
            leaf = leaf.values[0]
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        rank = None if shape is None else len(shape)
        last = None if not rank or rank < 2 else shape[-1]
        signature.append([str(getattr(dtype, "name", dtype)), rank, last])
    optimizer = getattr(model, "optimizer", None)
    return {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        # Classes and shapes, not names: Keras numbers the names of every
        # new instance (`dense_3`), the same set-up built twice must match.
        "layers": [type(layer).__name__ for layer in compat.all_layers(model)],
        # What the layers compute in: the weights stay float32 under mixed
        # precision, the activations do not.
        "policies": compat.dtype_policies(model),
        "weights": [[list(w.shape), str(w.dtype)] for w in model.weights],
        "trainable": [bool(w.trainable) for w in model.weights],
        "optimizer": None if optimizer is None else type(optimizer).__name__,
        "inputs": signature,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "devices": list(devices),
        "limits": [int(l) if l else None for l in limits],
        "mode": mode,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def gradient_bytes(model):
    """Bytes of the model's trainable weights: the gradients a step holds.

    Memory a training step needs whatever its micro-batch, so a floor for
    the step's part that does not shrink.

    Args:
        model: The Keras model.

    Returns:
        A float.
    """
    total = 0
    for variable in model.trainable_weights:
        size = math.prod(variable.shape)
        try:
            total += size * np.dtype(variable.dtype).itemsize
        except TypeError:  # a dtype numpy does not know (bfloat16)
            total += size * 2
    return float(total)
