"""Slice counts for an XLA-compiled test or predict step, before it runs.

Keras compiles `evaluate`'s and `predict`'s steps with XLA wherever it
compiles the train step so (`jit_compile`), and after an out-of-memory
error inside an XLA program TensorFlow can abort the process: a
validation batch larger than the training batch (`validation_batch_size`)
must not be run whole where its program does not fit. `CompiledSlicePlanner`
plans the slices of such a batch as the guard plans a training step on
XLA: from the buffer assignment of the step compiled for one slice
(`CompiledBatchStep.memory`), the smallest count whose slice fits under
the target beside the memory in use, its buffers then tried on the device
(`xla_memory.allocates`), where an error is an ordinary one.
"""

import logging

from keras_memguard.compiled_plan import plan_micro_batches
from keras_memguard.backends.tensorflow import xla_memory
from keras_memguard.backends.tensorflow.slice_replay import slice_batch
from keras_memguard.backends.tensorflow.slice_replay import spec_key

logger = logging.getLogger("keras_memguard")


class CompiledSlicePlanner:
    """Plans the slices of each batch of an XLA-compiled test or predict step.

    Called as `planner(step, data, batch_size, micro_batches)` (the
    `plan_compiled` hook of `ReplayTestFunction` and
    `ReplayPredictFunction`): returns the count to run the batch in, never
    fewer than `micro_batches` (the decider's, or one an error taught). A
    count planned for a batch's shapes is kept while it still fits beside
    the memory in use, so a compile is read once per batch shape, not once
    per batch.

    Args:
        limit_bytes: The device memory limit planned against.
        threshold: The share of `limit_bytes` a slice's step stays under.
        in_use: A function returning the bytes in use on the device now,
            or `None` when unknown; called after the buffers are tried too,
            so its reading should reach no reader's peak (the tries can
            reach the limit).
        kind: What the step runs, for the log: `"fit's validation"`,
            `"evaluate"` or `"predict"`.
    """

    def __init__(self, limit_bytes, threshold, in_use, kind):
        self.kind = kind
        self.limit_bytes = float(limit_bytes)
        self.threshold = threshold
        self.in_use = in_use
        # Batch shapes -> (count, that count's `StepMemory`).
        self._planned = {}
        # (batch shapes, slice size) -> `StepMemory` or None.
        self._memory = {}

    def __call__(self, step, data, batch_size, micro_batches):
        in_use = self.in_use()
        target = self.threshold * self.limit_bytes
        key = (spec_key(data), batch_size)
        kept = self._planned.get(key)
        if kept is not None:
            count, memory = kept
            if count >= micro_batches and (in_use or 0) + memory.demand_bytes < target:
                return count

        def analyse(count):
            size = -(-batch_size // count)
            if (key, size) not in self._memory:
                piece = data if size == batch_size else slice_batch(data, 0, size)
                self._memory[key, size] = step.memory(piece)
            memory = self._memory[key, size]
            return None if memory is None else memory._replace(micro_batches=count)

        if analyse(micro_batches) is None:
            return micro_batches  # No program to read: the decider's count.
        planned = plan_micro_batches(
            analyse,
            batch_size,
            self.limit_bytes,
            threshold=self.threshold,
            in_use_bytes=in_use,
            min_micro_batches=micro_batches,
        )
        count = planned.micro_batches
        # Where the free memory is in pieces, the largest buffer can find
        # no block: more slices, until its buffers are placed.
        while count < batch_size:
            memory = analyse(count)
            placed = memory is not None and xla_memory.allocates(memory, self.in_use)
            if placed and placed.beyond_bytes is not None:
                break
            count = min(batch_size, 2 * count)
        self.in_use()  # The tries' blocks are not the batch's peak.
        memory = analyse(count)
        if memory is not None:
            self._planned[key] = (count, memory)
        if count > micro_batches:
            logger.info(
                "planned %d slices for a batch of %d of %s (XLA): %s",
                count, batch_size, self.kind, planned.reason,
            )
        return count
