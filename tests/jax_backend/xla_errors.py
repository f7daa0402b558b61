"""XLA's errors as a GPU raises them, for the seams JAX's CPU backend cannot reach."""

import jax


def autotuner_out_of_memory():
    """The error XLA's GPU compiler raised on an H100 under a 256 MiB limit
    when its autotuner could not allocate the buffers to try a convolution
    in (abridged: the message lists every failed try)."""
    return jax.errors.JaxRuntimeError(
        "NOT_FOUND: Failed to get configs for: 5 out of 26 instructions. See logs "
        "for all failures. Example failure: \nAll configs failed during profiling "
        "or were excluded from selection.\nFailures (30):\nEXECUTION FAILED: "
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 466.00MiB with "
        "allocator GPU_0_bfc on device 0. [tf-allocator-allocation-error='']",
        5,
    )
