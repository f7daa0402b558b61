"""`evaluate` and `predict` on Keras' PyTorch backend, in slices, replayed on OOM.

Keras' torch `evaluate` and `predict` call `model.test_function(data)` and
`model.predict_function(data)` once per batch, `data` a list holding the
batch. `SlicedTestFunction` and `SlicedPredictFunction` are such functions:
they run the model's own `test_step` / `predict_step` over slices of the
batch, and when a slice raises an out-of-memory error they ask a handler
for a larger slice count and go on from the first sample not yet done, in
smaller slices. Nothing is counted twice: Keras' metrics and loss tracker
are weighted means updated per slice (so the batch's metrics are those of
the whole batch), a slice that fails has its metric updates put back, and
the predictions of the slices are concatenated into the batch's. A loss
that averages over unmasked elements is averaged per slice and weighted by
the slice's samples, as Keras weighs its batches; a summed loss is scaled
to count whole.
"""

import torch

from keras_memguard.backends import compat
from keras_memguard.backends import shared
from keras_memguard.backends.torch.replay import StateSnapshot
from keras_memguard.backends.torch.replay import StepOutOfMemory
from keras_memguard.backends.torch.replay import drop_tracebacks
from keras_memguard.backends.torch.replay import failed_allocation_bytes
from keras_memguard.backends.torch.replay import free_memory
from keras_memguard.backends.torch.replay import is_out_of_memory
from keras_memguard.backends.torch.step import batch_size_of
from keras_memguard.backends.torch.step import concatenated
from keras_memguard.backends.torch.step import rows
from keras_memguard.decider import validate_micro_batches


def more_slices(failure):
    """The default handler: `keras_memguard.backends.shared.slice_count`.

    Args:
        failure: A `StepOutOfMemory`.

    Returns:
        The slice count to go on with.

    Raises:
        MicroBatchTooLargeError: If a slice of one sample failed.
    """
    return shared.slice_count(failure)


class _SlicedFunction:
    """Runs the model's own step over the slices of each batch."""

    def __init__(self, model, micro_batches=1, plan=None, on_out_of_memory=None):
        self.model = model
        self.micro_batches = validate_micro_batches(micro_batches)
        self.plan = plan
        self.on_out_of_memory = on_out_of_memory or more_slices
        # Slices run again in smaller ones after an out-of-memory error.
        self.replays = 0
        self.last_batch_size = None

    def _step(self, piece):
        raise NotImplementedError

    def __call__(self, data):
        return self.run(data[0])

    def _slices(self, batch):
        """Runs `batch` slice by slice; returns each slice's result, in order."""
        batch_size = self.last_batch_size = batch_size_of(batch)
        if self.plan is not None:
            planned = self.plan(batch)
            if planned is not None:
                self.micro_batches = validate_micro_batches(planned)
        results = []
        start = 0
        while start < batch_size:
            k = min(self.micro_batches, batch_size)
            stop = min(batch_size, start + -(-batch_size // k))
            snapshot = StateSnapshot(self.model)
            try:
                # Keras' loss tracker weighs each slice's loss by its
                # samples: a summed loss scaled so that it counts whole.
                with torch.no_grad(), compat.scaling_summed_losses(
                    batch_size / (stop - start)
                ):
                    result = self._step(rows(batch, start, stop))
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                # The slice's metric updates, if any ran, go back; what it
                # held is freed before the smaller slices run.
                snapshot.restore()
                drop_tracebacks(error)
                free_memory()
                larger = self.on_out_of_memory(
                    StepOutOfMemory(batch_size, k, error, failed_allocation_bytes(error))
                )
                self.micro_batches = shared.checked_larger_count(
                    larger, k, batch_size, error, unit="slice"
                )
                self.replays += 1
                continue  # the same samples, in smaller slices
            results.append(result)
            start = stop
        return results


class SlicedTestFunction(_SlicedFunction):
    """`model.test_function` for torch `evaluate`: slices, replayed on OOM.

    Args:
        model: A compiled Keras model on the PyTorch backend.
        micro_batches: The slices to start with, an `int` >= 1. Defaults to
            `1`.
        plan: A function `batch -> int or None` called before each batch;
            an int sets its slice count. Defaults to `None`.
        on_out_of_memory: A function `StepOutOfMemory -> int` returning a
            larger count, or raising. Defaults to `None`: `more_slices`.

    Example:

    ```python
    set_test_function(model, SlicedTestFunction(model, micro_batches=4))
    model.evaluate(x, y, batch_size=256)
    ```
    """

    def _step(self, piece):
        return self.model.test_step(piece)

    def run(self, batch):
        """Evaluates one batch: the logs `test_step` returns after its last slice."""
        return self._slices(batch)[-1]


class SlicedPredictFunction(_SlicedFunction):
    """`model.predict_function` for torch `predict`: slices, replayed on OOM.

    Args:
        model: A compiled Keras model on the PyTorch backend.
        micro_batches: The slices to start with, an `int` >= 1. Defaults to
            `1`.
        plan: As for `SlicedTestFunction`. Defaults to `None`.
        on_out_of_memory: As for `SlicedTestFunction`. Defaults to `None`.
    """

    def _step(self, piece):
        return self.model.predict_step(piece)

    def run(self, batch):
        """Predicts one batch: the slices' outputs, concatenated."""
        return concatenated(self._slices(batch))


__all__ = ["SlicedPredictFunction", "SlicedTestFunction", "more_slices"]
