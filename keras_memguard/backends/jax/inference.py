"""`evaluate` and `predict` on Keras' JAX backend, in slices that can be replayed.

Keras' JAX `evaluate` calls `logs, state = model.test_function(state,
iterator)` and `predict` calls `outputs, state =
model.predict_function(state, iterator)` once per step. The functions here
have those signatures: each batch they pull runs as `micro_batches` slices
through Keras' own stateless `test_step` / `predict_step`, compiled without
donating the state, so a slice that raises XLA's out-of-memory error is run
again, in smaller slices, on the state it started from. Evaluation threads
the metrics' state through the slices (Keras' loss tracker weighs each
slice's mean loss by its samples, and a summed loss is scaled to count
whole), so the metrics are those of the whole batch; prediction concatenates the slices' outputs in order, on the host.

Before a batch of a new shape runs, `plan` (when given) may choose the
count from what XLA says each slice's compiled step needs (`memory`).
"""

import jax
import numpy as np

from keras_memguard.backends import shared
from keras_memguard.decider import validate_micro_batches
from keras_memguard.backends.jax.compiled import shape_key
from keras_memguard.backends.jax.compiled import spec_of
from keras_memguard.backends.jax.compiled import step_memory
from keras_memguard.backends.jax.replay import failed_allocation_bytes
from keras_memguard.backends.jax.replay import is_out_of_memory
from keras_memguard.backends.jax.replay import StepOutOfMemory
from keras_memguard.backends.jax.step import batch_size_of
from keras_memguard.backends.jax.step import rows
from keras_memguard.backends import compat


def double_slices(failure):
    """The default handler: `keras_memguard.backends.shared.slice_count`.

    Raises:
        MicroBatchTooLargeError: If a slice of one sample failed.
    """
    return shared.slice_count(failure)


class _SlicedFunction:
    """Runs a non-donating, compiled step over the slices of each batch."""

    def __init__(self, model, micro_batches=1, plan=None, on_out_of_memory=None):
        self.model = model
        self.micro_batches = validate_micro_batches(micro_batches)
        self.plan = plan
        self.on_out_of_memory = on_out_of_memory or double_slices
        self.replays = 0
        self.last_batch_size = None
        self._jitted = jax.jit(self._step)
        self._compiled = {}
        self._latest = None

    def _step(self, state, data, summed_scale):
        """One slice; `summed_scale` scales a loss reduced by `"sum"`.

        Keras' loss tracker weighs each slice's loss by its samples: a
        slice's summed loss times the inverse of its share of the batch
        adds up to the batch's sum (`compat.scaling_summed_losses`). An
        argument, so one compile serves slices of any batch.
        """
        raise NotImplementedError

    def _executable(self, state, data):
        key = shape_key(data)
        compiled = self._compiled.get(key)
        if compiled is None:
            scale = jax.ShapeDtypeStruct((), np.float32)
            compiled = self._jitted.lower(spec_of(state), spec_of(data), scale).compile()
            self._compiled[key] = compiled
        return compiled

    def memory(self, micro_batches, state, data):
        """What one slice's compiled step needs at a count (compiles, runs nothing).

        Returns:
            A `StepMemory`, or `None` when the backend gives no analysis.
        """
        size = -(-batch_size_of(data) // micro_batches)
        return step_memory(self._executable(state, rows(data, 0, size)), micro_batches)

    def _slices(self, state, data, on_slice):
        """Runs `data` slice by slice; `on_slice(result)` gets each result."""
        batch_size = self.last_batch_size = batch_size_of(data)
        self._latest = state
        if self.plan is not None:
            planned = self.plan(self, state, data)
            if planned is not None:
                self.micro_batches = validate_micro_batches(planned)
        start = 0
        while start < batch_size:
            k = min(self.micro_batches, batch_size)
            stop = min(batch_size, start + -(-batch_size // k))
            piece = rows(data, start, stop - start)
            try:
                # Waited for: on a GPU an allocation that fails shows only
                # when a result is read (XLA runs asynchronously).
                scale = np.float32(batch_size / (stop - start))
                result, state = jax.block_until_ready(
                    self._executable(state, piece)(state, piece, scale)
                )
                self._latest = state
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                failure = StepOutOfMemory(batch_size, k, error, failed_allocation_bytes(error))
                larger = self.on_out_of_memory(failure)
                self.micro_batches = shared.checked_larger_count(
                    larger, k, batch_size, error, unit="slice"
                )
                self.replays += 1
                continue  # the same samples, in smaller slices
            on_slice(result)
            start = stop
        return state

    def _executions(self, state, iterator, run, kind):
        try:
            result, state = run(state, next(iterator))
            for _ in range(getattr(self.model, "steps_per_execution", 1) - 1):
                try:
                    data = next(iterator)
                except StopIteration:
                    break
                result, state = run(state, data)
        except StopIteration:
            raise  # the end of the data: Keras ends the loop
        except BaseException:
            # The state of the last completed slice (never donated) goes
            # back into the model's variables: nothing is lost.
            if self._latest is not None:
                compat.keep_jax_state(self.model, self._latest, kind)
            raise
        return result, state


class SlicedTestFunction(_SlicedFunction):
    """`model.test_function` for JAX `evaluate`: slices, replayed on OOM.

    Args:
        model: A compiled Keras model on the JAX backend.
        micro_batches: The slices to start with, an `int` >= 1. Defaults to
            `1`.
        plan: A function `(function, state, data) -> int or None` called
            before each batch; an int sets its slice count. Defaults to
            `None`.
        on_out_of_memory: A function `StepOutOfMemory -> int` returning a
            larger count, or raising. Defaults to `None`: `double_slices`.
    """

    def _step(self, state, data, summed_scale):
        with compat.scaling_summed_losses(summed_scale):
            return self.model.test_step(state, data)

    def __call__(self, state, iterator):
        return self._executions(state, iterator, self.run, "test")

    def run(self, state, data):
        """Evaluates one batch: `(logs, state)`, as `test_step` returns them."""
        last = []
        state = self._slices(state, data, last.append)
        return last[-1], state


class SlicedPredictFunction(_SlicedFunction):
    """`model.predict_function` for JAX `predict`: slices, replayed on OOM.

    Each slice's outputs are copied to host memory (numpy) as it completes,
    so the outputs of a long `predict` do not pile up on the device.

    Args:
        model: A compiled Keras model on the JAX backend.
        micro_batches: The slices to start with, an `int` >= 1. Defaults to
            `1`.
        plan: As for `SlicedTestFunction`. Defaults to `None`.
        on_out_of_memory: As for `SlicedTestFunction`. Defaults to `None`.
    """

    def _step(self, state, data, summed_scale):
        del summed_scale  # no loss
        outputs, non_trainable = self.model.predict_step(state, data)
        return outputs, (state[0], non_trainable)

    def __call__(self, state, iterator):
        return self._executions(state, iterator, self.run, "predict")

    def run(self, state, data):
        """Predicts one batch: `(outputs, state)`, outputs as numpy arrays."""
        pieces = []
        state = self._slices(
            state, data, lambda outputs: pieces.append(jax.tree_util.tree_map(np.asarray, outputs))
        )
        outputs = jax.tree_util.tree_map(lambda *parts: np.concatenate(parts), *pieces)
        return outputs, state
