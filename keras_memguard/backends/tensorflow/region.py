"""One allocator region for the whole limit, so capacity does not depend on history.

TensorFlow's BFC allocator on the CPU (`TF_CPU_ALLOCATOR_USE_BFC=true`, the
capped stand-in for a GPU) always grows: it takes memory in regions of 2,
4, 8, ... MiB as tensors need them and never returns or merges a region.
Which micro-batch fits then depends on what ran before: after steps at
smaller micro-batches, a micro-batch that fits from a fresh process can run
out of memory with enough memory free, but in pieces (regions grown for the
smaller tensors), none of them large enough.

On a GPU TensorFlow avoids that by default: without memory growth its BFC
allocator takes the whole memory as one region at the first allocation.
`reserve_region` does the same on the CPU: it allocates one uninitialized
tensor of the rest of the limit (pages are not touched, so no memory is
used yet) and frees it at once. The region stays, free, and later
allocations are cut from it; the ones that fit from a fresh process keep
fitting after any history.

The region's size must not exceed what the allocator has not yet reserved
(an allocation above that fails only after TensorFlow's 10 s of retries).
The allocator does not report its reserved bytes, so the size keeps a
headroom of four times the peak in use so far plus 16 MiB: regions double,
so those already grown hold at most about twice the peak. Once per device
and process; a failure is logged and not tried again.
"""

import logging

from keras_memguard.probes.base import MIB
from keras_memguard.backends.tensorflow.probe import cpu_bfc_limit_bytes
from keras_memguard.backends.tensorflow.probe import highest_peak_bytes

logger = logging.getLogger("keras_memguard")

# Regions double in size, so the regions already grown hold at most about
# twice the peak in use; twice that again for fragmentation.
HEADROOM_PEAK_FACTOR = 4
HEADROOM_BYTES = 16 * MIB
# Smaller than this, one region changes nothing worth the allocation.
MIN_REGION_BYTES = 64 * MIB

# Device -> bytes reserved (0 after a failure): one attempt per process.
_attempted = {}


def region_bytes(limit_bytes, current_bytes, peak_bytes):
    """The size `reserve_region` asks for, or 0 when it is not worth it.

    Args:
        limit_bytes: The allocator's limit in bytes.
        current_bytes: Memory in use now, in bytes.
        peak_bytes: The highest memory in use so far (at least
            `current_bytes`), in bytes.

    Returns:
        The bytes to reserve in one region (a multiple of 1 MiB), or 0.

    Example:

    >>> region_bytes(600 * 2**20, 2**20, 2**20) // 2**20
    579
    """
    peak = max(peak_bytes, current_bytes)
    size = limit_bytes - current_bytes - HEADROOM_PEAK_FACTOR * peak - HEADROOM_BYTES
    size = int(size // MIB) * MIB
    return size if size >= MIN_REGION_BYTES else 0


def reserve_region(device, limit_bytes):
    """Reserves the rest of `limit_bytes` on `device` as one free region.

    Only for TensorFlow's BFC allocator on the CPU (`AllocatorProbe` mode
    `"bfc"`); the caller checks that. Does nothing the second time for a
    device, whatever happened the first time.

    Args:
        device: A TensorFlow device string, e.g. `"CPU:0"`.
        limit_bytes: The allocator's limit in bytes.

    Returns:
        The bytes reserved, or 0 when nothing was (not worth it, done
        before, or the allocation failed).
    """
    if device in _attempted:
        return 0
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info(device)
    # The probes reset the allocator's peak at every sample: the highest
    # they read counts too, or a region grown for it is missed and the
    # allocation fails only after TensorFlow's 10 s of retries.
    peak = max(info["peak"], highest_peak_bytes(device))
    size = region_bytes(limit_bytes, info["current"], peak)
    _attempted[device] = 0
    if not size:
        return 0
    try:
        with tf.device(device):
            # Uninitialized: the pages stay untouched until tensors use them.
            # Two dimensions: one would overflow int32 above 8 GiB.
            region = tf.raw_ops.Empty(
                shape=[size // MIB, MIB // 4], dtype=tf.float32, init=False
            )
        del region
    except tf.errors.OpError:  # Never fail `fit` over an optimization.
        logger.info(
            "could not reserve %d MiB of %s in one allocator region; the "
            "allocator keeps growing region by region",
            size // MIB,
            device,
        )
        return 0
    _attempted[device] = size
    logger.info(
        "reserved %d MiB of %s's %d MiB limit in one allocator region, so "
        "what fits does not depend on earlier batches",
        size // MIB,
        device,
        limit_bytes // MIB,
    )
    return size


def reserve_bfc_regions(probe):
    """One free region for the rest of each CPU BFC allocator's limit.

    For each of `probe`'s devices in mode `"bfc"` (an `AllocatorProbe`),
    when `TF_CPU_BFC_MEM_LIMIT_IN_MB` sets the CPU allocator's limit.
    Without it the allocator keeps the regions it grew for small earlier
    steps, and a larger one fails with memory free but in pieces.
    """
    limit = cpu_bfc_limit_bytes()
    if limit is None:
        return
    for device in probe.devices:
        if probe.device_mode(device) == "bfc":
            reserve_region(device, limit)
