"""What JAX adds to the growth evidence (`growth_evidence()`).

The bytes of every live `jax.Array` (`jax.live_arrays()`, JAX's own
list: a callback that keeps each batch's outputs shows there), and
`nbytes` for one array.
"""

import jax

_MIB = 1024 * 1024


def nbytes(value):
    """The bytes of a `jax.Array`, or `None` for anything else."""
    if isinstance(value, jax.Array):
        try:
            return int(value.nbytes)
        except Exception:
            return None
    return None


def count(objects, kinds=None):
    """JAX's figures: `live_tensors_mib`, the bytes of `jax.live_arrays()`.

    Args:
        objects: The tracked objects (unused: JAX lists its arrays itself).
        kinds: Unused.

    Returns:
        A dict with `live_tensors_mib`.
    """
    total = 0
    for array in jax.live_arrays():
        total += nbytes(array) or 0
    return {"live_tensors_mib": total / _MIB}
