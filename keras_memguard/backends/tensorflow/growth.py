"""What TensorFlow adds to the growth evidence (`growth_evidence()`).

`count` goes over the objects the garbage collector tracks (one list,
taken once by `keras_memguard.growth_check.snapshot`) and counts the
traced graphs of every live `tf.function` (a function retraced on new
shapes adds one per shape), the live `tf.data` pipelines that end in a
`.cache()` (an in-memory cache fills host memory during the first pass),
and the bytes of the live eager tensors. `nbytes` sizes one tensor.
"""

import tensorflow as tf

_MIB = 1024 * 1024


def nbytes(value):
    """The bytes of a TensorFlow tensor or variable, or `None` for anything else."""
    if not (isinstance(value, (tf.Tensor, tf.Variable)) or tf.is_tensor(value)):
        return None
    try:
        elements = value.shape.num_elements()
        if elements is None:
            return None
        return int(elements) * value.dtype.size
    except (AttributeError, TypeError, ValueError):
        return None


_eager = []


def _eager_type():
    if not _eager:
        _eager.append(type(tf.constant(0.0)))
    return _eager[0]


def _kind(kind_of):
    if issubclass(kind_of, tf.types.experimental.PolymorphicFunction):
        return "tf_function"
    if kind_of.__name__ == "CacheDataset" and issubclass(kind_of, tf.data.Dataset):
        return "cache"
    if issubclass(kind_of, _eager_type()):
        return "tensor"  # eager tensors only: a graph's tensors hold no memory
    return ""


def count(objects, kinds=None):
    """Counts TensorFlow's figures among `objects` (a `gc.get_objects()` list).

    Args:
        objects: The tracked objects.
        kinds: Unused here (the callers' cache of type kinds).

    Returns:
        A dict: `traced_functions` (traced graphs over all live
        `tf.function`s), `cached_datasets`, `live_tensors_mib`.
    """
    seen = {}
    traced = cached = 0
    tensor_bytes = 0
    for obj in objects:
        kind_of = type(obj)
        kind = seen.get(kind_of)
        if kind is None:
            kind = seen[kind_of] = _kind(kind_of)
        if not kind:
            continue
        if kind == "tf_function":
            try:
                traced += obj.experimental_get_tracing_count()
            except Exception:
                pass
        elif kind == "cache":
            cached += 1
        else:
            tensor_bytes += nbytes(obj) or 0
    return {
        "traced_functions": traced,
        "cached_datasets": cached,
        "live_tensors_mib": tensor_bytes / _MIB,
    }
