"""`evaluate` and `predict` under `MemoryGuard`: planned slices, replayed slices.

Glue between Keras' test and predict hooks and the decider. For each kind
of run (`"evaluate"`, `"predict"`) the guard keeps one `GuardController`
with its own decider state: a forward pass holds none of training's
gradients or optimizer temporaries, so its memory says nothing about the
training step's, nor the other way round. The state lives as long as the
guard, so a second `evaluate` plans from what the first one measured.

Each batch is planned before it runs (the memory in use now, the demand
the readings predict), observed after it (its peak), and a slice that runs
out of memory is sized down from what the error says, exactly as in `fit`.
"""

import logging

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard.callbacks import messages
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.whole_batches import stateful_layers

logger = logging.getLogger("keras_memguard")

EVALUATE = "evaluate"
PREDICT = "predict"


class InferenceRun:
    """One `evaluate` or `predict` call under the guard.

    Args:
        kind: `"evaluate"` or `"predict"`.
        model: The Keras model.
        controller: The `GuardController` of this kind of run.
        reader: The guard's shared allocator reader.
        consumer: The object the reader knows the guard by.
        limits: The memory limit of each device, as the guard resolved them.
        explain: Called as `explain(error, batch_size, micro_batches)`;
            returns an `OomExplanation`.
        report: Called with an `OomExplanation` to log (and write) it.
        stop_compiled: For a model whose steps XLA compiles: called as
            `stop_compiled(explanation, error)` at an out-of-memory error,
            it raises instead of a replay (after such an error TensorFlow
            can abort the process). `None` otherwise. Defaults to `None`.
        plan_compiled: For such a model: the slicing function's
            `plan_compiled` hook, which plans each batch's slices from the
            compiled step's buffers. `None` otherwise. Defaults to `None`.
        sample_bytes_of: Called as `sample_bytes_of(data)` before the first
            batch of a model whose static shapes tell no layer output's
            size: one sample's layer outputs, read from the batch (the
            traced forward pass), so that a batch that fits runs whole
            rather than in the cautious first split. `None`: not read.
            Defaults to `None`.
    """

    def __init__(
        self, kind, model, controller, reader, consumer, limits, explain, report,
        stop_compiled=None,
        plan_compiled=None,
        sample_bytes_of=None,
    ):
        self.kind = kind
        self.model = model
        self.controller = controller
        self.reader = reader
        self.consumer = consumer
        self.limits = limits
        self.explain = explain
        self.report = report
        self.stop_compiled = stop_compiled
        self.plan_compiled = plan_compiled
        self.sample_bytes_of = sample_bytes_of
        self.function = None
        self._before = None
        self._replayed = False

    def start(self):
        """Installs the replaying function; plans against the smallest limit."""
        model = self.model
        self.controller.start(
            min(limit for limit in self.limits if limit),
            0.0,  # Weights and the rest are in use before each batch.
            oom_explanation.layer_output_bytes(model),
        )
        # TensorFlow's slicing functions, imported here: this module is
        # also loaded on the JAX backend, where no slices are cut yet.
        from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
        from keras_memguard.backends.tensorflow.predict_replay import ReplayPredictFunction

        function_class = ReplayTestFunction if self.kind == EVALUATE else ReplayPredictFunction
        # Reacting too: the memory in use before each batch sizes a replay.
        self.function = function_class(
            model,
            micro_batches=self.controller.state.micro_batches,
            on_out_of_memory=self._on_out_of_memory,
            plan=self._plan,
            plan_compiled=self.plan_compiled,
        )
        self.function.install()
        self.reader.reset()

    def end(self):
        """Puts back the model's own function. Safe to call twice."""
        if self.function is not None:
            self.function.restore()
            self.function = None

    def _plan(self, batch_size, sample_size, data):
        if self.sample_bytes_of is not None and self.controller.needs_sample_bytes:
            self.controller.set_sample_bytes(self.sample_bytes_of(data))
        # Reading resets the peak: the batch's own peak is read after it.
        self._before = self._in_use(self.reader.read(self.consumer, None))
        return self.controller.plan(batch_size, sample_size, self._before)

    def after_batch(self):
        """Gives the decider the batch's peak (none for a replayed batch)."""
        function = self.function
        if function is None:
            return
        samples = self.reader.read(self.consumer, None)
        if self._replayed:
            # The failed slice's memory is in that peak.
            self._replayed = False
            return
        reading = sliced_batch_reading(
            self.controller, function, samples, self.limits, self._before
        )
        if reading is not None:
            self.controller.observe(reading)

    def _in_use(self, samples):
        limit = self.controller.limit_bytes
        in_use = None
        for sample, device_limit in zip(samples, self.limits):
            if device_limit == limit and sample.current_bytes is not None:
                in_use = max(in_use or 0.0, float(sample.current_bytes))
        return in_use

    def _on_out_of_memory(self, batch_size, micro_batches, error):
        """Sizes the slices the rest of the batch goes on in, or raises."""
        explanation = self.explain(error, batch_size, micro_batches)
        if self.stop_compiled is not None:
            self.stop_compiled(explanation, error)
        self._before = decider.in_use_beside_replay(
            self._before, self._in_use(self.reader.read(self.consumer, None))
        )
        decided = self.controller.fail(
            decider.Failure(
                batch_size,
                micro_batches,
                self.function.last_sample_size or 1.0,
                self._before,
                self.controller.limit_bytes,
                explanation.in_use_bytes,
                explanation.failed_allocation_bytes,
                explanation.failed_shape,
                explanation.largest_free_chunk_bytes,
            )
        )
        if decided.cannot_split:
            self.report(explanation)
            samples = self.reader.read(self.consumer, None)
            peak = max((s.peak_bytes or 0 for s in samples), default=0) or None
            limit = self.controller.limit_bytes
            if decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE:
                message = messages.too_large(batch_size, micro_batches, peak, limit)
            elif decided.cannot_split == decider.CANNOT_SPLIT_ALLOCATION:
                message = messages.allocation_does_not_shrink(
                    decided.reason, batch_size, peak, limit
                )
            else:
                message = messages.cap_reached(
                    micro_batches, batch_size, evaluating=True,
                    stateful=stateful_layers(self.model),
                )
            raise MicroBatchTooLargeError(
                f"{self.kind.capitalize()}: {message}", peak_bytes=peak, limit_bytes=limit
            ) from error
        new_k = decided.micro_batches
        self.report(explanation._replace(replayed_with=new_k))
        done = getattr(self.function, "samples_done", None)
        messages.log_inference_slices(self.kind, batch_size, micro_batches, done, new_k)
        self._replayed = True
        self.reader.reset()
        return new_k


def sliced_batch_reading(controller, function, samples, limits, before):
    """The decider's `Reading` of a batch a slicing function just ran, or `None`.

    Shared by `evaluate` and `predict` (`InferenceRun`) and by `fit`'s
    validation on TensorFlow, which plans with the same controller.

    Args:
        controller: The `GuardController` that planned the batch.
        function: The slicing function (`last_batch_size`,
            `micro_batches`, `last_sample_size`).
        samples: The allocator samples read after the batch.
        limits: The memory limit of each device, in the samples' order.
        before: The memory in use before the batch.

    Returns:
        A `decider.Reading` of the peak on the devices planned against, or
        `None` where no peak or no batch size is known.
    """
    limit = controller.limit_bytes
    peak = None
    for sample, device_limit in zip(samples, limits):
        if device_limit == limit and sample.peak_bytes is not None:
            peak = max(peak or 0.0, float(sample.peak_bytes))
    if peak is None or not function.last_batch_size:
        return None
    return decider.Reading(
        function.last_batch_size,
        function.micro_batches,
        function.last_sample_size or 1.0,
        before,
        peak,
        limit,
    )
