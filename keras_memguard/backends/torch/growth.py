"""What PyTorch adds to the growth evidence (`growth_evidence()`).

The bytes of the live tensors among the objects the garbage collector
tracks (a callback that keeps each batch's outputs shows there), and
`nbytes` for one tensor.
"""

import torch

_MIB = 1024 * 1024


def nbytes(value):
    """The bytes of a `torch.Tensor`, or `None` for anything else."""
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:
            return None
    return None


def count(objects, kinds=None):
    """PyTorch's figures: `live_tensors_mib`, the bytes of live tensors.

    Args:
        objects: The tracked objects (a `gc.get_objects()` list).
        kinds: Unused.

    Returns:
        A dict with `live_tensors_mib`.
    """
    seen = {}
    total = 0
    for obj in objects:
        kind_of = type(obj)
        is_tensor = seen.get(kind_of)
        if is_tensor is None:
            is_tensor = seen[kind_of] = issubclass(kind_of, torch.Tensor)
        if is_tensor:
            total += nbytes(obj) or 0
    return {"live_tensors_mib": total / _MIB}
