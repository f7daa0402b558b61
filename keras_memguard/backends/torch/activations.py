"""One sample's forward activations, counted over a forward pass of two samples.

Before any step is measured, the planner sizes the first batch's split from
the bytes of one sample's layer outputs. Where the model's static shapes do
not tell them (tokens of any length, `MultiHeadAttention` and RNNs, which
are built of layers, a subclassed model), the first batch was split as if
memory were short, changing its step on models that fit many times over.

PyTorch runs eagerly, so nothing can be read without running: the model's
forward pass runs once on the batch's first two samples, in inference mode
and without autograd (no BatchNormalization statistics or dropout draws
move), and a `torch.overrides.TorchFunctionMode` sums the floating-point
outputs with a row per sample of the torch functions it calls, views
aside. Over `OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE`, the least that sum
was of the layer outputs where the static shapes tell both
(`bench/bench_first_batch.py`), it stands for the layer outputs, erring
above them as TensorFlow's traced estimate does.
"""

import keras
import torch
from torch.overrides import TorchFunctionMode

# The least ratio of a two-sample forward pass's function outputs to the
# model's layer outputs, on the models whose static shapes tell both
# (`KERAS_BACKEND=torch python bench/bench_first_batch.py --parts ratio`).
OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE = 2.8

# Samples the forward pass runs on: two, so that a weight's dimension of one
# is not taken for a row per sample.
SAMPLES = 2

# Functions whose output shares its input's memory.
_VIEWS = frozenset(
    {
        "__getitem__", "as_strided", "broadcast_to", "contiguous", "detach",
        "expand", "flatten", "movedim", "narrow", "permute", "reshape",
        "select", "slice", "split", "squeeze", "t", "transpose", "unbind",
        "unflatten", "unsqueeze", "view", "view_as",
    }
)


class _OutputBytes(TorchFunctionMode):
    """Sums the floating-point outputs, a row per sample, of the torch functions called under it.

    A tensor without `samples` rows (a weight read or cast) is no activation.
    """

    def __init__(self, samples):
        super().__init__()
        self.samples = samples
        self.total = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") not in _VIEWS:
            for item in keras.tree.flatten(result):
                if (
                    isinstance(item, torch.Tensor)
                    and item.is_floating_point()
                    and item.dim() > 0
                    and item.shape[0] == self.samples
                ):
                    self.total += item.numel() * item.element_size()
        return result


def counted_sample_bytes(model, data):
    """One sample's layer outputs, from a forward pass of the batch's first two samples.

    Args:
        model: A built Keras model.
        data: One batch as `fit` hands it to the step: `x`, `(x,)`, `(x, y)`
            or `(x, y, sample_weight)`.

    Returns:
        A float >= 0: the floating-point outputs with a row per sample of
        the torch functions the forward pass called, views aside, per
        sample and over `OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE`; `0.0`
        where the pass cannot run on part of the batch here, as for a model
        whose size is not known.

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    >>> counted_sample_bytes(model, (torch.zeros([2, 8]),)) > 0
    True
    """
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    try:
        leaves = [item for item in keras.tree.flatten(x) if item is not None]
        samples = min(SAMPLES, int(leaves[0].shape[0]))
        part = keras.tree.map_structure(
            lambda item: None if item is None else item[:samples], x
        )
        counter = _OutputBytes(samples)
        with torch.no_grad(), counter:
            model(part, training=False)
    except Exception:  # noqa: BLE001 (anything that cannot run so: not known)
        return 0.0
    if samples < 1:
        return 0.0
    return counter.total / samples / OPERATION_BYTES_PER_LAYER_OUTPUT_BYTE
