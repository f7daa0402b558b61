"""What an XLA-compiled TensorFlow step needs, read before it first runs.

Keras 3 compiles the train step with XLA wherever a GPU is present
(`jit_compile="auto"`). XLA assigns every buffer of the compiled program
before it runs, and after an out-of-memory error inside an XLA program
TensorFlow's allocator can abort the process on the next step: on XLA an
error must be prevented, not recovered from. `step_memory` reads the
buffer assignment of the micro-batched step compiled for one batch's shapes
(`experimental_get_compiler_ir(...)(stage="optimized_hlo_proto_serialized")`)
into the same `StepMemory` the JAX backend reads from `memory_analysis()`,
so one planner (`keras_memguard.compiled_plan`) chooses the count on both.
"""

from typing import NamedTuple, Optional

import tensorflow as tf

from keras_memguard.compiled_plan import SplitDoesNotTrace
from keras_memguard.compiled_plan import StepMemory
from keras_memguard.backends import compat


def uses_xla(model):
    """Whether `model`'s train step is compiled with XLA (`jit_compile`)."""
    return bool(getattr(model, "jit_compile", False)) and not model.run_eagerly


def step_memory(step, data, micro_batches):
    """Reads what XLA assigned to a compiled step for `data`'s shapes.

    Args:
        step: A step from `make_step_function` (a `tf.function` compiled
            with `jit_compile=True`, maybe wrapped).
        data: One batch, as the step receives it.
        micro_batches: The count the step splits the batch into.

    Returns:
        A `StepMemory`: the entry parameters (weights, optimizer state and
        the batch, already resident) as `argument_bytes`, the buffers that
        outlive the step as `output_bytes`, the rest as `temp_bytes`; or
        `None` when the step is not compiled by XLA or the compiled program
        cannot be read here.

    Raises:
        SplitDoesNotTrace: If `micro_batches` is above one and tracing the
            step raised `ValueError` or `TypeError`.
    """
    function = getattr(step, "compiled_step", step)
    get_ir = getattr(function, "experimental_get_compiler_ir", None)
    if get_ir is None:
        return None
    data = compat.optionals_to_none(data)
    trace = getattr(function, "get_concrete_function", None)
    if micro_batches > 1 and trace is not None:
        try:
            trace(data)
        except (ValueError, TypeError) as error:
            raise SplitDoesNotTrace(micro_batches, error) from error
    try:
        blob = get_ir(data)(stage="optimized_hlo_proto_serialized")
        proto = compat.parse_hlo_proto(blob)
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
        # Not an XLA function, or the module is not there on this version.
        return None
    return memory_of_buffer_assignment(proto.buffer_assignment, micro_batches)


def memory_of_buffer_assignment(assignment, micro_batches):
    """Sums an XLA `BufferAssignmentProto`'s allocations into a `StepMemory`."""
    arguments = outputs = temporaries = largest = 0
    for allocation in assignment.buffer_allocations:
        size = int(allocation.size)
        if allocation.is_entry_computation_parameter:
            arguments += size
            continue
        if allocation.is_thread_local:
            continue  # on the stack, not in the device allocator
        if allocation.maybe_live_out:
            outputs += size
        else:
            temporaries += size
        largest = max(largest, size)
    return StepMemory(
        micro_batches, arguments, outputs, temporaries, 0, largest_allocation_bytes=largest
    )


# TensorFlow's BFC allocator cuts a request from a larger free block only
# when the block is at least twice the request or the rest would be at
# least this large (`kMaxInternalFragmentation`); otherwise the request
# takes the whole block.
BFC_SPLIT_REMAINDER_BYTES = 128 * 2**20

# A buffer smaller than one that found no free block by less than this
# share of it is taken to find none either. The free blocks' sizes are not
# known, each try that fails waits 10 s in the allocator, and where a
# count's largest buffer is mostly memory no split shrinks (accumulators),
# count after count differs from it by a few KiB; a count skipped this way
# leaves a larger one, which splits more, not one that runs out of memory.
NEAR_FAILED_BLOCK_SHARE = 0.125


def fits_in_free_block(memory, free_bytes):
    """Tells whether a compiled step's buffers fit in one free block.

    The step's largest buffer is cut from the block, and the rest of its
    buffers go in what remains. Where the allocator would hand the largest
    buffer the whole block (`BFC_SPLIT_REMAINDER_BYTES`), nothing remains
    for the rest: a step can need less than the block and still not fit.

    Args:
        memory: The step's `StepMemory`.
        free_bytes: The free block's size in bytes.

    Returns:
        `True` when the step's buffers fit in the block.
    """
    largest = memory.largest_allocation_bytes
    if memory.demand_bytes > free_bytes:
        return False
    if memory.demand_bytes <= largest:
        return True
    return 2 * largest <= free_bytes or free_bytes - largest >= BFC_SPLIT_REMAINDER_BYTES


class FailedBlock(NamedTuple):
    """A block the allocator could not hand out, and the memory in use then.

    Attributes:
        size_bytes: The size of the single allocation that failed.
        in_use_bytes: The memory in use on the device right before it.
    """

    size_bytes: int
    in_use_bytes: int


class Probe(NamedTuple):
    """What trying a compiled step's buffers on the device found.

    Attributes:
        beyond_bytes: The bytes the allocator counted beyond the largest
            buffer's size (`0` without a count of the memory in use), or
            `None` when the allocations ran out of memory.
        failed_block: A `FailedBlock` where the largest buffer alone did
            not fit and the memory in use was known; else `None`.
    """

    beyond_bytes: Optional[int]
    failed_block: Optional[FailedBlock] = None


def allocates(memory, in_use=None):
    """Tries a compiled step's buffers on the device before the step runs.

    XLA allocates a step's temporaries in one piece: a step can fail with
    memory to spare when no free block is that large (the allocator is
    fragmented). Allocating blocks of the step's sizes (its largest buffer,
    and the rest in one), without writing them, and freeing them again
    answers that before the step runs; an out-of-memory error outside an
    XLA program is an ordinary, recoverable error. The memory in use
    before and after the largest buffer also tells what the allocator
    handed it: a whole free block where the block was not large enough to
    cut (`BFC_SPLIT_REMAINDER_BYTES`). The step's peak then reads that
    block's remainder beyond its program, on every batch, as plain `fit`'s
    would: it is the allocator's rounding, not memory taken beside the
    step.

    Args:
        memory: The step's `StepMemory`.
        in_use: A function returning the bytes in use on the device, or
            `None` when the device keeps no count. Defaults to `None`.

    Returns:
        A `Probe`.
    """
    largest = memory.largest_allocation_bytes
    sizes = [largest, max(0, memory.demand_bytes - largest)]
    held = []
    beyond = 0
    try:
        before = in_use() if in_use else None
        for index, size in enumerate(sizes):
            if size:
                try:
                    held.append(tf.raw_ops.Empty(shape=[size], dtype=tf.uint8, init=False))
                except tf.errors.ResourceExhaustedError:
                    alone = index == 0 and before is not None
                    return Probe(None, FailedBlock(size, before) if alone else None)
                if index == 0 and before is not None:
                    after = in_use()
                    if after is not None:
                        beyond = max(0, int(after - before - size))
    finally:
        del held
    return Probe(beyond)


def still_fails(memory, failed_block, in_use_bytes):
    """Whether a probe of `memory` would fail as `failed_block` did.

    No free block held `failed_block.size_bytes`; while no memory was freed
    since (the memory in use is no lower), none holds a buffer at least as
    large either, and one smaller by under `NEAR_FAILED_BLOCK_SHARE` of it
    is taken to find none. Answering that without trying matters: TensorFlow's
    allocator waits up to 10 seconds for memory to be freed before an
    allocation fails (its retry on failure), so every failed probe stalls
    training that long.

    Args:
        memory: The step's `StepMemory`.
        failed_block: A `FailedBlock`, or `None`.
        in_use_bytes: The memory in use now, or `None` when unknown.

    Returns:
        `True` when the probe would fail.
    """
    return (
        failed_block is not None
        and in_use_bytes is not None
        and in_use_bytes >= failed_block.in_use_bytes
        and memory.largest_allocation_bytes
        >= failed_block.size_bytes * (1.0 - NEAR_FAILED_BLOCK_SHARE)
    )
