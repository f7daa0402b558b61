"""`MemoryGuard` on Keras' JAX backend: the glue for one `fit`, `evaluate` or `predict`.

A model whose class has a `train_step` of its own, a model Keras runs
without XLA (`run_eagerly=True`, `jit_compile=False`, or a layer such as
`RandomRotation` that does not support XLA), or any model under
`keras.distribution` (the micro-batched step is compiled with XLA for one
device), trains each batch whole through Keras' own train function
(`WholeTrainFunction`), as in plain `fit`: the guard reads memory around
it and names that step when a batch runs out of memory. Otherwise the
guard trains through the JAX training core
(`keras_memguard.backends.jax`): a `ReplayingTrainFunction` put inside the
model's logs carrier, which, before a batch of a new shape runs, compiles
the micro-batched step for candidate counts and plans from what XLA says
each needs (`plan_micro_batches`), and replays a batch that raised XLA's
out-of-memory error with the count the decider gives (`decider.fail`).
Batches of a shape already planned reuse the count: no compile, no
analysis, a dict lookup. The compiled steps and the counts planned are kept
per model across `fit` calls (compiling is the expensive part: a new `fit`
of the same model, a loop of one-epoch fits, compiles nothing again) while
the model's optimizer and variables and the guard's limit stay the same.

Where the device reports peaks (`JaxMemoryProbe` on a GPU), each batch's
measured peak beyond what the analysis predicted becomes a margin kept
free in later plans; a CPU device reports none, and the plan is the
analysis alone.

`evaluate` and `predict` (and `fit`'s validation) run in slices of each
batch (`keras_memguard.backends.jax.inference`), their count planned per
batch shape from the compiled slice step the same way; a slice that runs
out of memory is run again in smaller slices.

Imports JAX and Keras, never TensorFlow.
"""

import logging
import weakref

from keras_memguard import decider
from keras_memguard import forward_writes
from keras_memguard import split_loss
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks import messages
from keras_memguard.callbacks import oom_report
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends import compat
from keras_memguard.backends import shared
from keras_memguard.backends.jax.compiled import StepCache
from keras_memguard.backends.jax.compiled import shape_key
from keras_memguard.backends.jax.inference import SlicedPredictFunction
from keras_memguard.backends.jax.inference import SlicedTestFunction
from keras_memguard.backends.jax.inference import double_slices
from keras_memguard.compiled_plan import excess_bytes
from keras_memguard.compiled_plan import SplitDoesNotTrace
from keras_memguard.compiled_plan import plan_micro_batches
from keras_memguard.backends.jax.replay import ReplayingTrainFunction
from keras_memguard.backends.jax.replay import WholeTrainFunction
from keras_memguard.backends.jax.replay import is_out_of_memory
from keras_memguard.backends.jax.step import batch_size_of
from keras_memguard.backends.jax.support import check_supported
from keras_memguard.backends.jax.support import distribution_text
from keras_memguard.backends.jax.support import eager_reason

logger = logging.getLogger("keras_memguard")

# model -> (what the entry is valid for, StepCache, {shape key: count}).
_KEPT = weakref.WeakKeyDictionary()


def _kept(model, limit_bytes, config):
    """The model's step cache and planned counts, made anew when stale."""
    optimizer = getattr(model, "optimizer", None)
    valid_for = (
        id(optimizer),
        len(model.trainable_variables),
        len(model.non_trainable_variables),
        len(getattr(optimizer, "variables", ())),
        len(model.metrics_variables),
        limit_bytes,
        config,
    )
    kept = _KEPT.get(model)
    if kept is None or kept[0] != valid_for:
        kept = _KEPT[model] = (valid_for, StepCache(model), {})
    return kept[1], kept[2]


def unsupported_options(options):
    """The `GuardOptions` the JAX backend cannot honour, in words, or `None`."""
    refused = []
    # "auto" accumulates: without "shrink" there is nothing to switch to.
    if options.mode not in ("accumulate", "auto"):
        refused.append(f"mode={options.mode!r}")
    if options.escalate:
        refused.append(f"escalate={options.escalate!r}")
    if options.scale_learning_rate:
        refused.append("scale_learning_rate=True")
    if not refused:
        return None
    return (
        "On Keras' JAX backend `MemoryGuard` micro-batches with gradient "
        "accumulation (mode='accumulate') and plans from the compiled step; "
        f"not supported there yet: {', '.join(refused)}. HINT: leave these "
        "options at their defaults, or train on the TensorFlow backend."
    )


class JaxTrainingRun:
    """One `fit` of a model under `MemoryGuard`, on the JAX backend.

    Args:
        session: The guard's `GuardSession` (its controller, reader,
            limits and options); the smallest of its limits is planned
            against.
        fit: What identifies this `fit` (the callbacks' shared `params`).
        log_key: The logs key the micro-batch count is reported under.
    """

    def __init__(self, session, fit, log_key):
        self.session = session
        self.fit = fit
        self.log_key = log_key
        self.model = session.model
        self.limit_bytes = float(session.smallest_limit)
        # Shape key -> the count planned (or replayed) for it.
        self.cache, self.planned = _kept(self.model, self.limit_bytes, session.config)
        # Bytes beyond the analysis that measured peaks showed (a margin).
        self.margin_bytes = 0
        self.function = None
        self._carrier = None
        self._previous_inner = None
        self._before = None
        self._memory = None
        self._key = None

    @property
    def last_batch_size(self):
        """Samples in the batch that ran last, or `None`."""
        return self.function.last_batch_size if self.function else None

    def begin_epoch(self):
        """Nothing at an epoch's start: steps are counted per call."""

    def after_train_batch(self, batch, logs):
        """Nothing in Keras' batch hook: the carrier's contribution did it."""

    def micro_batch_size(self, micro_batches):
        """Samples in one micro-batch, or `None`."""
        size = self.last_batch_size
        return -(-size // micro_batches) if size else None

    def begin(self):
        """Checks the model and options; installs the replaying function."""
        model = self.model
        session = self.session
        reason = unsupported_options(session.options)
        if reason is not None:
            raise UnsupportedTrainingSetupError(reason)
        check_supported(model)
        whole = None
        distributed = distribution_text()
        eager = eager_reason(model)
        if compat.overrides_train_step(model):
            # A step of the model's own: nothing in it can be split.
            whole = messages.own_step_whole(type(model).__name__, "jax")
        elif eager is not None:
            # The micro-batched step is compiled with XLA; Keras' runs without.
            whole = messages.eager_whole(type(model).__name__, eager)
        elif distributed is not None:
            # The micro-batched step is compiled for one device.
            whole = messages.distributed_whole(type(model).__name__, distributed)
        if whole is not None:
            # Keras' own train function runs each batch whole, as in plain `fit`.
            session.train_whole_batches(whole, "jax")
        if not session.started:
            session.start(self.limit_bytes, 0, 0)
        if whole:
            self.function = WholeTrainFunction(
                model, self._on_out_of_memory, before_call=self._read_before
            )
        else:
            self.function = ReplayingTrainFunction(
                model,
                micro_batches=session.micro_batches,
                cache=self.cache,
                plan=self._plan,
                on_out_of_memory=self._on_out_of_memory,
                on_split_error=self._on_split_error,
            )
        self._carrier, self._previous_inner = logs_carrier.train_inside(
            model, session, self._contribute, self.fit, self.function
        )
        if whole:
            self.function.inner = self._previous_inner

    def end(self):
        """Puts the train function in place before back."""
        logs_carrier.leave(
            self.model, self.session, self._carrier, self.function, self._previous_inner
        )
        self._carrier = None
        self.function = None

    def _read_before(self):
        """Before a whole batch: the memory in use (and the peak reset)."""
        self._before = shared.in_use_bytes(self.session.read())

    def _plan(self, state, data):
        """The count for the batch about to run (the function's `plan`)."""
        samples = self.session.read()  # resets the peak
        self._before = shared.in_use_bytes(samples)
        key = self._key = shape_key(data)
        k = self.planned.get(key)
        if k is not None:
            self._memory = self.cache.analysed(k, data)
            self._set_count(k)
            return k
        if not self.session.options.plan:
            k = self.session.micro_batches
        else:
            try:
                k = self._plan_new_shape(state, data)
            except SplitDoesNotTrace as failed:
                k = self._on_split_error(batch_size_of(data), failed.micro_batches, failed.error)
        model = self.model
        variables = (
            model.trainable_variables, model.non_trainable_variables,
            model.optimizer.variables, model.metrics_variables,
        )
        marked = compat.summed_added_losses(model)
        values = [pair for group in zip(variables, state) for pair in zip(*group)]
        split_loss.check_once(model, data, batch_size_of(data), k, values=values)
        forward_writes.check_once(model, data, batch_size_of(data), k, values=values)
        summed = compat.summed_added_losses(model)
        if summed != marked and any(summed or ()):
            # The steps compiled so far count those losses by their share.
            self.cache.forget_programs()
        self.planned[key] = k
        self._set_count(k)
        return k

    def _plan_new_shape(self, state, data):
        batch_size = batch_size_of(data)
        config = self.session.config
        previous = self.session.micro_batches
        decided = _plan_from_analysis(
            lambda k: self.cache.memory(k, state, data),
            batch_size,
            self.limit_bytes,
            config,
            self._before,
            self.margin_bytes,
            config.min_micro_batches,
        )
        if decided is None:
            logger.info(
                "the compiled step gives no memory analysis on this device: "
                "batch %d runs with %s, and an out-of-memory error is replayed",
                batch_size,
                decider.micro_batches_text(previous),
            )
            return min(previous, batch_size)
        self._memory = decided.memory
        # Once per batch shape: a compile-time decision worth a line.
        messages.log_plan(
            decider.Plan(decided.micro_batches, previous, decided.predicted_usage, decided.reason),
            batch_size,
        )
        return decided.micro_batches

    def _on_split_error(self, batch_size, micro_batches, error):
        return self.session.whole_after_split_error(error, "jax")

    def _set_count(self, k):
        controller = self.session.controller
        if controller.state.micro_batches != k:
            controller.set_micro_batches(k)

    def _on_out_of_memory(self, failure):
        """The count to replay a batch with, from the decider, or raises."""
        batch_size = failure.batch_size
        # What the failed step needed on top of the memory in use before it:
        # its compiled analysis where it compiled (XLA allocates a step's
        # buffers as the analysis says), else the allocation the error
        # names. The decider sizes the replay from that, in one jump.
        needed = failure.allocation_bytes
        if failure.memory is not None:
            needed = max(needed or 0, failure.memory.demand_bytes)
        in_use = self._before
        if in_use is None and failure.memory is not None:
            in_use = float(failure.memory.argument_bytes)
        decided = self.session.controller.fail(
            decider.Failure(
                batch_size,
                failure.micro_batches,
                1.0,
                self._before,
                self.limit_bytes,
                in_use_bytes=None if needed is None else in_use,
                allocation_bytes=needed,
            )
        )
        if decided.cannot_split is not None:
            raise oom_report.cannot_split_error(
                self.session, decided, batch_size, failure.micro_batches
            ) from failure.error
        k = min(decided.micro_batches, batch_size)
        if failure.analyse is not None:
            # The smallest larger count whose compiled step fits, where that
            # is more than the decider's. Also where the failed count did not
            # compile (a GPU's autotuner out of memory): the error then names
            # only the autotuner's buffer, and counts that cannot compile
            # either are planned past instead of replayed one by one.
            planned = _plan_from_analysis(
                failure.analyse,
                batch_size,
                self.limit_bytes,
                self.session.config,
                self._before,
                self.margin_bytes,
                min(batch_size, failure.micro_batches + 1),
            )
            if planned is not None and planned.fits:
                k = max(k, planned.micro_batches)
        messages.log_replay(batch_size, failure.micro_batches, k, str(-(-batch_size // k)))
        # Later batches of this shape start from the count that replayed it.
        self.planned[self._key] = k
        self._memory = None
        self._set_count(k)
        return k

    def _contribute(self, logs):
        """After each train function call: margin, logs and scalars."""
        session = self.session
        session.read(self._carrier.batch_key)
        # JAX cannot reset a device's peak: a sample's peak is the
        # high-water mark; the step's own peak is known only where the mark
        # rose during it (the interval since the read before the step).
        peak = max(
            (p for p in session.probe.interval_peaks() if p is not None), default=None
        )
        excess = excess_bytes(self._memory, self._before, peak)
        if excess is not None and excess > self.margin_bytes:
            self.margin_bytes = excess
        session.advance(self.function.last_call_batches)
        logs[self.log_key] = session.micro_batches
        if session.writer is not None:
            session.write_scalars(self.micro_batch_size(session.micro_batches))


# model -> {kind: (what the entry is valid for, sliced function, {shape: count})}.
_KEPT_INFERENCE = weakref.WeakKeyDictionary()

_FUNCTIONS = {"evaluate": SlicedTestFunction, "predict": SlicedPredictFunction}


def inference_run(session, kind):
    """Starts the run of an `evaluate` or `predict` call.

    Args:
        session: The guard's `GuardSession`.
        kind: `"evaluate"` or `"predict"`.

    Returns:
        The started `JaxInferenceRun`.
    """
    run = JaxInferenceRun(session, kind, session.smallest_limit)
    run.begin()
    return run


class JaxInferenceRun:
    """One `evaluate` or `predict` (or `fit`'s validation) under `MemoryGuard`.

    Args:
        session: The guard's `GuardSession`.
        kind: `"evaluate"` or `"predict"`.
        limit_bytes: The device memory limit planned against.
    """

    def __init__(self, session, kind, limit_bytes):
        self.session = session
        self.kind = kind
        self.model = session.model
        self.limit_bytes = float(limit_bytes)
        self.controller = session.inference_controller(kind)
        valid_for = (id(self.model.optimizer), self.limit_bytes, session.config)
        kept = _KEPT_INFERENCE.setdefault(self.model, {}).get(kind)
        if kept is None or kept[0] != valid_for:
            function = _FUNCTIONS[kind](
                self.model, plan=self._plan, on_out_of_memory=self._on_out_of_memory
            )
            kept = _KEPT_INFERENCE[self.model][kind] = (valid_for, function, {})
        _, self.function, self.planned = kept
        # The function outlives this run: it calls back into the latest one.
        self.function.plan = self._plan
        self.function.on_out_of_memory = self._on_out_of_memory
        self._previous = None
        self._installed = False
        self._key = None

    def begin(self):
        """Installs the sliced function in place of Keras' own.

        Under `keras.distribution`, or where Keras runs the model without
        XLA, Keras' own function runs each batch whole, as in plain
        `evaluate`: the sliced one is compiled with XLA for one device.
        """
        check_supported(self.model)
        if distribution_text() is not None or eager_reason(self.model) is not None:
            return
        self._previous = shared.install_inference_function(
            self.model, self.kind, self.function
        )
        self._installed = True

    def end(self):
        """Puts Keras' own function back."""
        if self._installed:
            shared.restore_inference_function(self.model, self.kind, self._previous)
            self._installed = False

    def after_batch(self):
        """Nothing after a batch: the plan is per shape, made before it."""

    def _plan(self, function, state, data):
        key = self._key = shape_key(data)
        k = self.planned.get(key)
        if k is not None:
            return k
        batch_size = batch_size_of(data)
        samples = self.session.read()
        decided = _plan_from_analysis(
            lambda count: function.memory(count, state, data),
            batch_size,
            self.limit_bytes,
            self.session.config,
            shared.in_use_bytes(samples),
            0,
            1,
        )
        if decided is None:
            k = function.micro_batches
        else:
            k = decided.micro_batches
            messages.log_inference_plan(self.kind, batch_size, k, decided.reason)
        self.planned[key] = k
        return k

    def _on_out_of_memory(self, failure):
        k = double_slices(failure)
        messages.log_inference_slices(
            self.kind, failure.batch_size, failure.micro_batches, None, k
        )
        self.planned[self._key] = k
        self.controller.count_replay()
        return k


class _NoAnalysis(Exception):
    """The backend compiled the step but gave no memory analysis."""


def _plan_from_analysis(memory_of, batch_size, limit_bytes, config, in_use_bytes,
                        margin_bytes, min_micro_batches):
    """`plan_micro_batches` over `memory_of(k)`; `None` without an analysis."""

    def analyse(k):
        try:
            memory = memory_of(k)
        except (ValueError, TypeError) as error:
            if k > 1:  # the model's code fails on a micro-batch
                raise SplitDoesNotTrace(k, error) from error
            raise
        except Exception as error:
            if is_out_of_memory(error):  # a GPU's autotuner, while compiling
                return None
            raise
        if memory is None:
            raise _NoAnalysis()
        return memory

    try:
        return plan_micro_batches(
            analyse,
            batch_size,
            limit_bytes,
            threshold=config.threshold,
            in_use_bytes=in_use_bytes,
            margin_bytes=margin_bytes,
            min_micro_batches=min_micro_batches,
            max_micro_batches=config.max_micro_batches,
        )
    except _NoAnalysis:
        return None
