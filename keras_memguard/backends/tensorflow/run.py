"""`MemoryGuard` on TensorFlow: the glue for one `fit`.

Puts the replaying train function (`backends/tensorflow/replay.py`, or the
multi-worker one) inside the model's logs carrier, plans each batch before
it runs from the memory in use right then, gives the decider each batch's
peak after it, replays a batch that ran out of memory with the count the
decider gives (or raises `MicroBatchTooLargeError`), climbs the rungs of
`escalate`, and slices `fit`'s validation batches that run out of memory.
The decisions are the controller's (`callbacks/controller.py`, over the
pure `keras_memguard.decider`); what outlives one `fit` (the controller,
the plan cache key, the step count, the writer) is in the guard's
`GuardSession`, which the run is handed.
"""

import functools

import keras
import tensorflow as tf

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard import forward_writes
from keras_memguard import split_loss
from keras_memguard.callbacks import agreement
from keras_memguard.callbacks import inference
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks import messages
from keras_memguard.callbacks import oom_report
from keras_memguard.compiled_plan import count_after_no_free_block
from keras_memguard.compiled_plan import excess_bytes
from keras_memguard.compiled_plan import SplitDoesNotTrace
from keras_memguard.compiled_plan import plan_micro_batches
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.backends.tensorflow import activations
from keras_memguard.backends.tensorflow import region
from keras_memguard.backends import compat
from keras_memguard.backends.tensorflow import multi_worker
from keras_memguard.backends.tensorflow import remat
from keras_memguard.backends.tensorflow import xla_memory
from keras_memguard.backends.tensorflow.compiled_slices import CompiledSlicePlanner
from keras_memguard.backends.tensorflow.eval_replay import ReplayTestFunction
from keras_memguard.backends.tensorflow.mixin import MemGuardMixin
from keras_memguard.backends.tensorflow.predict_replay import ReplayPredictFunction
from keras_memguard.backends.tensorflow.replay import ReplayTrainFunction
from keras_memguard.backends.tensorflow.setup import describe_setup
from keras_memguard.backends.tensorflow.setup import gradient_bytes
from keras_memguard.backends.tensorflow.step import cached_function
from keras_memguard.backends.tensorflow.step import trains_with_own_step

# A batch size no real batch reaches: the bound when the size is unknown.
_UNKNOWN_BATCH_SIZE = 1 << 30


class TfTrainingRun:
    """One `fit` of a TensorFlow-backend model under `MemoryGuard`.

    Args:
        session: The guard's `GuardSession` (its controller, reader,
            limits, writer and options).
        fit: What identifies this `fit` (the callbacks' shared `params`).
        log_key: The logs key the micro-batch count is reported under.
    """

    def __init__(self, session, fit, log_key):
        self.session = session
        self.model = session.model
        self.fit = fit
        self.log_key = log_key
        self.function = None
        self.multi_worker = False
        self._carrier = None
        self._previous_inner = None
        # Whether the carrier ran this batch's bookkeeping already.
        self._contributed = False
        self._eval_function = None
        # `fit`'s validation, planned (`begin_validation`): the evaluate
        # controller, the memory in use before the batch, whether it failed.
        self._validation = None
        self._validation_before = None
        self._validation_failed = False
        self._base_learning_rate = None
        # Memory in use right before the batch that runs now.
        self._before = None
        # Under several workers: the agreed memory in use after the last
        # batch, planned from before the next.
        self._agreed_in_use = None
        self._last_batch = -1
        # An XLA step is planned from its compiled program: the plan per
        # batch shapes with the bytes the allocator rounds its largest
        # buffer up by (`xla_memory.allocates`), and how far measured peaks
        # went past both.
        self.xla = False
        self._compiled_plans = {}
        # Batch shapes whose whole step (stateful layers, a step of the
        # model's own) was read and probed, and fits.
        self._whole_checked = set()
        # Whether this `fit`'s input was looked at for ragged tensors (once:
        # the batches of one input share their kind).
        self._input_checked = False
        self._compiled_plan = None
        self._block_rounding = 0
        self._xla_margin = 0

    def begin(self):
        """Checks the model, starts the decider where no plan hook will, installs."""
        session, model = self.session, self.model
        self._input_checked = False
        if not _trains_with_default_step(model):
            session.train_whole_batches(
                messages.own_step_whole(type(model).__name__, "tensorflow"), "tensorflow"
            )
        self.multi_worker = multi_worker.is_multi_worker(model.distribute_strategy)
        self.xla = xla_memory.uses_xla(model) and not self.multi_worker
        if not self.multi_worker and compat.summed_added_losses(model) is None:
            # Losses the layers add are measured at the first split
            # (`split_loss`), not guessed from a traced graph.
            compat.mark_summed_added_losses(model, ())
        carrier = logs_carrier.current(model)
        if self.multi_worker and not session.started:
            if session.config.predictive and trains_with_own_step(model):
                # A step that cannot be split runs its collectives inside the
                # micro-batch loop: every worker must keep the same count, so
                # the workers react to agreed numbers after each batch.
                session.stop_planning()
            # The most constrained worker's limit; each worker's readings
            # are scaled to it as fractions of its own limit.
            session.start(
                agreement.agreed_limit(model.distribute_strategy, session.limits),
                gradient_bytes(model),
                oom_explanation.layer_output_bytes(model),
            )
        else:
            # Without planning no plan hook runs first: start from what is
            # known now (the layer outputs bound a replay's demand from
            # below, as planning's).
            session.start_unless_planning(
                lambda: session.start(
                    session.smallest_limit,
                    gradient_bytes(model),
                    oom_explanation.layer_output_bytes(model),
                )
            )
        options = dict(
            micro_batches=session.micro_batches,
            # "auto" accumulates until the accumulators do not fit.
            mode="accumulate" if session.options.mode == "auto" else session.options.mode,
            on_out_of_memory=self.on_out_of_memory,
        )
        if self.multi_worker:
            # Makes Keras' symbolic build and log reduction work across
            # workers; resets the train and test functions.
            multi_worker.prepare_multi_worker(model)
            logs_carrier.reinstall(model, carrier, model.train_function)
            plan = self.plan_batch if session.config.predictive else None
            self.function = multi_worker.MultiWorkerTrainFunction(
                model, plan=plan, on_split_error=self._on_split_error, **options
            )
        else:
            self.function = ReplayTrainFunction(
                model, plan=self.plan_batch, on_split_error=self._on_split_error, **options
            )
        if (
            session.options.reserve_memory
            and (session.options.plan or session.options.escalate)
            and not self.multi_worker
        ):
            # A rung climbed after an out-of-memory error needs it too: in a
            # grown allocator the error leaves no piece large enough.
            region.reserve_bfc_regions(session.probe)
        # The guard's function trains inside the model's logs carrier.
        self._carrier, self._previous_inner = logs_carrier.train_inside(
            model, session, self._contribute, self.fit, self.function
        )
        self.apply(session.micro_batches)
        # The allocator's dump at an out-of-memory error explains it.
        session.capture_dumps()

    def end(self):
        """Puts the train and test functions and the learning rate back."""
        logs_carrier.leave(
            self.model, self.session, self._carrier, self.function, self._previous_inner
        )
        self._carrier = None
        self.end_validation()
        if self._base_learning_rate is not None:
            self.model.optimizer.learning_rate.assign(self._base_learning_rate)
            self._base_learning_rate = None

    def begin_epoch(self):
        self._last_batch = -1

    def after_train_batch(self, batch, logs):
        """Keras' batch hook: the bookkeeping, unless the carrier did it."""
        if self._contributed:
            self._contributed = False
            return
        # No carrier (the train function was replaced after on_train_begin).
        self._after_batch(batch, logs, (id(logs), batch))

    def begin_validation(self):
        """Plans `fit`'s validation batches in slices; slices those that run out of memory."""
        # Several replicas: Keras' own test function (slices are cut in Python).
        if not ReplayTestFunction.supports(self.model):
            return
        session = self.session
        plan = None
        if session.options.plan and not self.xla:
            # As `evaluate` under the guard plans: from its own readings (a
            # forward pass holds none of training's gradients), kept in the
            # session's evaluate controller.
            self._validation = session.inference_controller(inference.EVALUATE)
            self._validation.start(
                session.smallest_limit, 0.0, oom_explanation.layer_output_bytes(self.model)
            )
            plan = self._plan_validation_batch
        self._eval_function = ReplayTestFunction(
            self.model,
            micro_batches=session.eval_micro_batches,
            on_out_of_memory=self.on_eval_out_of_memory,
            plan=plan,
            # On XLA the slices are planned: an error there is not replayed.
            plan_compiled=(
                _compiled_slice_planner(self.session, "fit's validation") if self.xla else None
            ),
        )
        self._eval_function.install()

    def end_validation(self):
        if self._eval_function is not None:
            self._eval_function.restore()
            self._eval_function = None
        self._validation = None

    def _plan_validation_batch(self, batch_size, sample_size, data):
        """The slices a validation batch runs in: never fewer than an error taught."""
        validation = self._validation
        if validation.needs_sample_bytes:
            validation.set_sample_bytes(activations.traced_sample_bytes(self.model, data))
        # Reading resets the peak: the batch's own peak is read after it.
        self._validation_before = self._in_use(self.session.read())
        self._validation_failed = False
        planned = validation.plan(batch_size, sample_size, self._validation_before)
        return max(planned, self.session.eval_micro_batches)

    def after_validation_batch(self):
        """Gives the validation planner the batch's peak (none after an error)."""
        function = self._eval_function
        if self._validation is None or function is None or self._validation_failed:
            return
        reading = inference.sliced_batch_reading(
            self._validation, function, self.session.read(), self.session.limits,
            self._validation_before,
        )
        if reading is not None:
            self._validation.observe(reading)

    def micro_batch_size(self, micro_batches):
        """Samples in one micro-batch of one replica, or `None`."""
        size = self.function.last_replica_batch_size if self.function else None
        return -(-size // micro_batches) if size else None

    # Each batch: plan before it, observe after it.

    def plan_batch(self, batch_size, sample_size, data):
        """The count the batch about to run gets (the function's `plan`)."""
        session = self.session
        controller = session.controller
        if not session.started:
            self._start(data)
        if self.multi_worker:
            if self._agreed_in_use is None:
                # The first batch: every worker reads and agrees now (the
                # read also resets the peak, as below).
                _, self._agreed_in_use = self._agreed_usage(session.read())
            # What every worker agreed on after the last batch.
            before = self._before = self._agreed_in_use
        else:
            # Reading resets the peak: the batch's own peak is read after it.
            self._before = before = self._in_use(session.read())
        if self.xla:
            if not self._input_checked:
                self._input_checked = True
                if session.whole_step is None and _has_ragged(data):
                    session.train_whole_batches(
                        messages.ragged_on_xla(type(self.model).__name__), "tensorflow"
                    )
            # The compiled program is the plan; the decider's count is the
            # floor without `plan` (the user's, or one an error taught).
            k = self._plan_compiled(controller.state.micro_batches, batch_size, data, before)
            split_loss.check_once(self.model, data, batch_size, k)
            forward_writes.check_once(self.model, data, batch_size, k)
            return self._apply(k)
        k = controller.plan(batch_size, sample_size, before)
        if (
            k >= batch_size
            and session.options.escalate
            and not controller.one_sample_fits(batch_size, sample_size, before)
            and self._climb(
                "one sample per micro-batch is predicted not to fit a batch of "
                f"{batch_size}"
            )
        ):
            k = controller.plan(batch_size, sample_size, before)
        if self._may_stop_accumulating():
            why = None
            if not self._accumulation_fits(before):
                why = (
                    f"{messages.mib_text(before)} is in use before the batch and the "
                    "accumulators leave less room than a micro-batch's gradients take"
                )
            elif k >= batch_size and not controller.one_sample_fits(
                batch_size, sample_size, before
            ):
                why = (
                    "one sample per micro-batch is predicted not to fit a batch of "
                    f"{batch_size} beside the accumulators"
                )
            if why is not None and self._stop_accumulating(why):
                k = controller.plan(batch_size, sample_size, before)
        if not self.multi_worker:
            split_loss.check_once(self.model, data, batch_size, k)
            forward_writes.check_once(self.model, data, batch_size, k)
        return self._apply(k)

    def _apply(self, k):
        if k != self.function.micro_batches:
            self.apply(k)
        return k

    def _plan_compiled(self, k, batch_size, data, before):
        """The count of an XLA step: the smallest whose compiled program fits.

        Each count's buffer assignment is read once per batch shapes (and
        kept with the model's compiled steps); a plan is reused while the
        memory in use beside it still leaves it under the threshold. Without
        `plan`, counts below `k` are not tried. Returns `k` where the
        program cannot be read (the decider's plan then stands).
        """
        session, model = self.session, self.model
        controller = session.controller
        limit = controller.limit_bytes
        target = session.config.threshold * limit
        shapes = _shapes_of(data)
        rung = remat.is_on(model)

        def analyse(count):
            return cached_function(
                model,
                ("xla_memory", count, self.function.mode, rung, shapes),
                lambda: xla_memory.step_memory(self.function.step_for(count), data, count),
            )

        if session.stateful_layers or session.whole_step:
            # Whole batches only: the step runs as in plain `fit`, unless its
            # program cannot fit beside the memory in use at all, or its
            # buffers find no place in the free memory (an error inside the
            # program would end the process). Read once per batch shapes.
            memory = analyse(1)
            if memory is None or shapes in self._whole_checked:
                return 1
            no_block = None
            fits = (before or 0) + memory.demand_bytes <= limit
            if fits:
                probe = xla_memory.allocates(
                    memory, lambda: self._in_use(session.read_aside())
                )
                # The probe's blocks are not the step's peak.
                session.read_aside()
                if probe.beyond_bytes is None:
                    fits, no_block = False, memory.largest_allocation_bytes
            if not fits:
                if session.stateful_layers:
                    message = messages.stateful_step_too_large(
                        batch_size, session.stateful_layers, memory.demand_bytes,
                        before or 0, limit, no_block,
                    )
                else:
                    message = messages.whole_step_too_large(
                        batch_size, session.whole_step, memory.demand_bytes,
                        before or 0, limit, no_block,
                    )
                raise MicroBatchTooLargeError(message, limit_bytes=limit)
            self._whole_checked.add(shapes)
            return 1
        planned, rounding = self._compiled_plans.get(shapes, (None, 0))
        in_use = before or 0
        if planned is not None and (
            in_use + planned.memory.demand_bytes + self._xla_margin >= target
            or (not session.options.plan and planned.micro_batches < k)
        ):
            planned = None
        if planned is None:
            # Without `plan`, counts below `k` are not tried. The program is
            # read where the search starts, so the read is not a compile of
            # its own (a count the search may never try).
            start = 1 if session.options.plan else k
            try:
                if analyse(start) is None:
                    return k
                planned, rounding = self._search_compiled(analyse, start, batch_size, before)
            except SplitDoesNotTrace as failed:
                # The whole batch's step, as plain `fit` runs it, from here.
                self.session.whole_after_split_error(failed.error, "tensorflow")
                return self._plan_compiled(1, batch_size, data, before)
            self._compiled_plans[shapes] = (planned, rounding)
            if planned.micro_batches != self.function.micro_batches:
                messages.log_plan(planned, batch_size)
            # The probes' blocks (a failed one reaches the limit) are not
            # the step's: its peak, and what it takes beyond the analysis,
            # are read from here, by the guard and by every other reader.
            session.read_aside()
        self._compiled_plan, self._block_rounding = planned, rounding
        if controller.state.micro_batches != planned.micro_batches:
            controller.set_micro_batches(planned.micro_batches)
        return planned.micro_batches

    def _search_compiled(self, analyse, start, batch_size, before):
        """`(plan, rounding)`: the smallest count whose program fits and whose blocks are free now.

        Counts from `start` up are searched. XLA allocates the step's
        buffers in large pieces: a count can fit
        in total and still find no free block for its largest buffer (the
        allocator is fragmented), which the probe (`xla_memory.allocates`)
        tells before the step runs. After a count fails the probe, counts
        from twice it on (or from a larger count already read whose largest
        buffer is smaller) are tried until one passes; then halfway between
        the largest that failed and the smallest that passed, while that
        saves more than an eighth of the micro-batches (each count read is
        one compile, once per batch shapes). A count whose largest buffer
        is at least one the probe found no block for is not tried (a failed
        allocation waits 10 s in TensorFlow's allocator). Where no count
        fits, `"auto"` stops accumulating and the search starts again;
        otherwise `MicroBatchTooLargeError` is raised. `rounding` is what
        the allocator counted beyond the found count's largest buffer.
        """
        session = self.session

        def in_use():
            return self._in_use(session.read_aside())

        # The largest count that failed the probe, the smallest that passed.
        lowest, failed, found, rounding = start, None, None, 0
        # A block no probe found room for: no step runs during the search,
        # so a buffer at least as large fails too (and each failed try
        # waits 10 s in TensorFlow's allocator).
        failed_block = None
        while True:
            planned = plan_micro_batches(
                analyse,
                batch_size,
                self.session.controller.limit_bytes,
                threshold=session.config.threshold,
                in_use_bytes=before,
                margin_bytes=self._xla_margin,
                min_micro_batches=min(lowest, batch_size),
                max_micro_batches=session.config.max_micro_batches,
            )
            if planned.fits and (found is None or planned.micro_batches < found.micro_batches):
                if failed_block and xla_memory.still_fails(planned.memory, failed_block, in_use()):
                    beyond = None
                else:
                    probe = xla_memory.allocates(planned.memory, in_use)
                    beyond = probe.beyond_bytes
                    failed_block = probe.failed_block or failed_block
                if beyond is not None:
                    found, rounding = planned, beyond
                else:
                    failed = max(failed or 0, planned.micro_batches)
            elif found is not None:
                return found, rounding  # nothing between fits
            if found is not None:
                if failed is None:
                    return found, rounding
                gap = found.micro_batches - failed
                if gap <= max(1, found.micro_batches // 8):
                    return found, rounding
                lowest = failed + gap // 2
                continue
            if planned.fits and planned.micro_batches < batch_size:
                lowest = count_after_no_free_block(planned)
                continue
            if not (
                self._may_stop_accumulating()
                and self._stop_accumulating(
                    f"no micro-batch count of the compiled step fits a batch of "
                    f"{batch_size} beside the accumulators"
                )
            ):
                raise oom_report.compiled_step_too_large(
                    session, planned, batch_size, before, failed is not None,
                    shrinking=self.function.mode == "shrink",
                )
            lowest, failed = start, None

    def _contribute(self, logs):
        """Observes after each train function call; adds the count to `logs`.

        Called by the model's `LogsCarrier` before Keras hands the logs to
        the callbacks, so every callback sees the value.
        """
        # The batch number Keras 3.15 passes to on_train_batch_end: the
        # execution's last step.
        steps = self.model.steps_per_execution or 1
        self._after_batch(self._last_batch + steps, logs, self._carrier.batch_key)
        self._contributed = True

    def _after_batch(self, batch, logs, key):
        """Gives the decider the batch's peak; applies a reacting change."""
        session = self.session
        session.advance(batch - self._last_batch)
        self._last_batch = batch
        samples = session.read(key)
        peak, limit = self._peak(samples)
        function = self.function
        if function is not None and limit:
            ran_with = function.micro_batches
            if self.multi_worker:
                # The same numbers at the same step on every worker.
                peak, self._agreed_in_use = self._agreed_usage(samples)
                limit = session.controller.limit_bytes
                after = self._agreed_in_use
            else:
                after = self._in_use(samples)
            decided = session.controller.observe(
                decider.Reading(
                    function.last_replica_batch_size or _UNKNOWN_BATCH_SIZE,
                    ran_with,
                    getattr(function, "last_sample_size", None) or 1.0,
                    self._before,
                    peak,
                    limit,
                    after,
                )
            )
            if self.xla and self._compiled_plan is not None:
                # What the step took beyond its analysis and the
                # allocator's rounding (memory taken beside it while it
                # ran) is kept free in later plans.
                excess = excess_bytes(
                    self._compiled_plan.memory,
                    self._before,
                    None if peak is None else peak - self._block_rounding,
                )
                self._xla_margin = max(self._xla_margin, excess or 0)
            elif decided.changed:
                messages.log_decision(decided, self._micro_batch_text(decided.micro_batches))
                self.apply(decided.micro_batches)
                session.save_state()
        if logs is not None:
            logs[self.log_key] = session.micro_batches
        if session.writer is not None:
            session.write_scalars(self.micro_batch_size(session.micro_batches))

    def _peak(self, samples):
        """`(peak, limit)` of the device nearest its limit, or `(None, limit)`."""
        usage = None
        found = (None, self.session.controller.limit_bytes)
        for sample, device_limit in zip(samples, self.session.limits):
            peak = sample.peak_bytes
            if peak is None or not device_limit:
                continue
            if usage is None or peak / device_limit > usage:
                usage = peak / device_limit
                found = (float(peak), float(device_limit))
        return found

    def _agreed_usage(self, samples):
        session = self.session
        return agreement.agreed_usage(
            self.model.distribute_strategy, samples, session.limits, session.controller.limit_bytes
        )

    def _in_use(self, samples):
        """Memory in use on the device planned against, or `None`."""
        limit = self.session.controller.limit_bytes
        in_use = None
        for sample, device_limit in zip(samples, self.session.limits):
            if device_limit == limit and sample.current_bytes is not None:
                in_use = max(in_use or 0.0, float(sample.current_bytes))
        return in_use

    def _start(self, data):
        """Starts the decider for this `fit`: limit, fixed bytes, plan cache."""
        session = self.session
        state = None
        options = session.options
        if options.plan and options.plan_cache and not session.has_restored_state:
            fields = describe_setup(
                self.model, data, session.probe.devices, session.limits, options.mode
            )
            state = session.controller.load_plan(fields)
        sample_bytes = oom_explanation.layer_output_bytes(self.model)
        if not sample_bytes and state is None and not self.xla:
            # The first batch is planned from its layer outputs (an XLA
            # step from its compiled program): where the static shapes do
            # not tell them, the batch's traced forward pass does.
            sample_bytes = activations.traced_sample_bytes(self.model, data)
        session.start(
            session.smallest_limit,
            gradient_bytes(self.model),
            sample_bytes,
            state,
        )

    def _on_split_error(self, batch_size, micro_batches, error):
        return self.session.whole_after_split_error(error, "tensorflow")

    # Out of memory.

    def on_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the micro-batch count to replay a batch with, or raises."""
        session = self.session
        function = self.function
        # Each replica splits its own part of the (global) batch.
        replica_batch_size = function.last_replica_batch_size or batch_size
        explanation = oom_report.explain(session, error, replica_batch_size, micro_batches)
        if not self.multi_worker:  # the workers agreed on the reading before
            self._before = decider.in_use_beside_replay(
                self._before, self._in_use(session.read())
            )
        failure = decider.Failure(
            replica_batch_size or _UNKNOWN_BATCH_SIZE,
            micro_batches,
            getattr(function, "last_sample_size", None) or 1.0,
            self._before,
            session.controller.limit_bytes,
            explanation.in_use_bytes,
            explanation.failed_allocation_bytes,
            explanation.failed_shape,
            explanation.largest_free_chunk_bytes,
        )
        if self.multi_worker:
            failure = agreement.agreed_failure(
                self.model.distribute_strategy,
                failure,
                session.smallest_limit,
                session.controller.limit_bytes,
            )
        decided = session.controller.fail(failure)
        if self.xla:
            self._stop_compiled(explanation, error)
        # The optimizer's update works on whole weights. After a split,
        # accumulating step's loop only the accumulators can make room for
        # it (`mode="auto"`); unsplit, Keras' step may update some weights
        # while the backward pass still holds activations, which a split
        # shrinks. Where one sample per micro-batch still fails there, the
        # error names the update, not a sample.
        update_op = oom_explanation.in_optimizer_update(
            explanation.failed_op, getattr(self.model, "optimizer", None)
        )
        in_update = update_op and micro_batches > 1 and function.mode == "accumulate"
        if (
            not update_op
            and decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE
            and session.options.escalate
            and self._climb(
                f"batch {batch_size} ran out of memory at one sample per micro-batch"
            )
        ):
            session.controller.count_replay()
            session.controller.set_micro_batches(micro_batches)
            oom_report.report(session, explanation._replace(replayed_with=micro_batches))
            session.save_state()
            return micro_batches
        if (
            (
                decided.cannot_split
                in (decider.CANNOT_SPLIT_BATCH_SIZE, decider.CANNOT_SPLIT_ALLOCATION)
                or not self._accumulation_fits(self._before)
                or in_update
            )
            and self._may_stop_accumulating()
            and self._stop_accumulating(
                f"batch {batch_size} ran out of memory at "
                f"{messages.micro_batches_text(micro_batches)} beside the accumulators"
            )
        ):
            # The step without accumulators starts from a fresh plan (or,
            # reacting, from the count that failed: it only gets cheaper).
            new_k = micro_batches
            if session.options.plan and function.last_sample_size:
                new_k = session.controller.plan(
                    replica_batch_size, function.last_sample_size, self._before
                )
            session.controller.count_replay()
            session.controller.set_micro_batches(new_k)
            oom_report.report(session, explanation._replace(replayed_with=new_k))
            self.apply(new_k)
            session.save_state()
            return new_k
        if in_update or (update_op and decided.cannot_split):
            oom_report.report(session, explanation)
            raise MicroBatchTooLargeError(
                messages.optimizer_update_too_large(
                    explanation.failed_op,
                    explanation.failed_allocation_bytes,
                    explanation.failed_shape,
                    self._before,
                    session.controller.limit_bytes,
                    gradient_bytes(self.model) if function.mode == "accumulate" else 0,
                ),
                limit_bytes=session.controller.limit_bytes,
            ) from error
        if decided.cannot_split:
            oom_report.report(session, explanation)
            raise oom_report.cannot_split_error(
                session,
                decided,
                batch_size,
                micro_batches,
                remat_refusal=remat.can_remat(self.model),
                accumulation=(
                    self._before,
                    gradient_bytes(self.model) if function.mode == "accumulate" else 0,
                ),
            ) from error
        new_k = decided.micro_batches
        oom_report.report(session, explanation._replace(replayed_with=new_k))
        messages.log_replay(batch_size, micro_batches, new_k, self._micro_batch_text(new_k))
        self.apply(new_k)
        session.save_state()
        session.save_plan()
        return new_k

    def _stop_compiled(self, explanation, error):
        """Ends `fit` after an XLA step (train or validation) ran out of memory: no replay.

        After such an error TensorFlow's allocator can abort the process at
        the next step, so the batch is not replayed. What the decider
        learned goes to the plan cache and the state to `backup_dir`, with
        the weights, so a new run starts from them.
        """
        session = self.session
        oom_report.report(session, explanation)
        session.save_state()
        session.save_plan()
        weights_path = oom_report.save_weights_for_restart(session)
        raise oom_report.compiled_step_error(session, explanation, weights_path) from error

    def on_eval_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the slice count to go on evaluating with, or raises.

        Only evaluation's count changes; training's `k` and
        `oom_recoveries` stay as they are.
        """
        session = self.session
        # The failed slice's memory is in this batch's peak: not a reading.
        self._validation_failed = True
        if self.xla:
            # As for training: no replay after an error in an XLA program.
            self._stop_compiled(
                oom_report.explain(session, error, batch_size, micro_batches), error
            )
        decided = session.controller.fail_evaluation(batch_size or 1, micro_batches)
        if decided.cannot_split:
            raise oom_report.cannot_split_error(
                session, decided, batch_size, micro_batches, evaluating=True
            ) from error
        new_k = decided.micro_batches
        done = self._eval_function.samples_done if self._eval_function else 0
        messages.log_eval_slices(batch_size, micro_batches, done, new_k, session.micro_batches)
        session.save_state()
        return new_k

    def _climb(self, why):
        """Switches on the next rung of `escalate`; whether one was."""
        session, model = self.session, self.model
        rung = session.controller.next_rung(lambda rung: remat.can_remat(model))
        if rung is None:
            return False
        segments = remat.switch_on(model)
        messages.log_rung(rung, why, segments, remat.SEGMENT_LAYERS)
        self._plan_anew()
        return True

    def _may_stop_accumulating(self):
        """Whether `mode="auto"` may still switch accumulation off."""
        return (
            self.session.options.mode == "auto"
            and self.function.mode == "accumulate"
            and not self.multi_worker
        )

    def _accumulation_fits(self, in_use):
        controller = self.session.controller
        # The decider's fixed bytes are the trainable weights' (`start`).
        return decider.accumulation_fits(
            in_use, controller.state.fixed_bytes, controller.limit_bytes
        )

    def _stop_accumulating(self, why):
        """`mode="auto"`: each micro-batch its own update from now on; whether it switched."""
        messages.log_accumulation_off(why, gradient_bytes(self.model))
        self.function.mode = "shrink"
        self._compiled_plans.clear()
        self._whole_checked.clear()
        self._plan_anew()
        self.apply(self.function.micro_batches)
        return True

    def _plan_anew(self):
        """The step changed (a rung, accumulation off): the memory model starts over.

        What was learned holds for the step as it was: it is kept in the
        plan cache (a next run changes the step again before its first
        batch), and this run's later figures are not cached under it.
        """
        self.session.plan_anew()

    # Helpers.

    def apply(self, micro_batches):
        """Makes the next batch run with `micro_batches` micro-batches."""
        if self.function is not None:
            self.function.micro_batches = micro_batches
        if isinstance(self.model, MemGuardMixin):
            self.model.micro_batches = micro_batches
        shrinking = self.function is not None and self.function.mode == "shrink"
        if shrinking and self.session.options.scale_learning_rate:
            self._scale_learning_rate(micro_batches)

    def _scale_learning_rate(self, micro_batches):
        optimizer = self.model.optimizer
        if compat.learning_rate_variable(optimizer) is None:
            raise UnsupportedTrainingSetupError(messages.learning_rate_schedule())
        if self._base_learning_rate is None:
            self._base_learning_rate = float(optimizer.learning_rate)
        optimizer.learning_rate.assign(self._base_learning_rate / micro_batches)

    def _micro_batch_text(self, micro_batches):
        size = self.micro_batch_size(micro_batches)
        if size is None:
            return None
        function = self.function
        if function.last_replica_batch_size != function.last_batch_size:
            return f"{size} per replica"
        return f"{size}"


def inference_run(session, kind):
    """Starts the run of an `evaluate` or `predict` call; `None` where unsupported.

    Args:
        session: The guard's `GuardSession`.
        kind: `"evaluate"` or `"predict"`.

    Returns:
        The started `InferenceRun`, or `None` where the model's
        distribution strategy cannot be sliced.
    """
    model = session.model
    function_class = {
        inference.EVALUATE: ReplayTestFunction,
        inference.PREDICT: ReplayPredictFunction,
    }[kind]
    if not function_class.supports(model):
        replicas = model.distribute_strategy.num_replicas_in_sync
        messages.log_inference_unsupported(kind, replicas)
        return None
    session.capture_dumps(new=False)
    session.react_where_unreadable()
    run = inference.InferenceRun(
        kind,
        model,
        session.inference_controller(kind),
        session.reader,
        session,
        session.limits,
        functools.partial(oom_report.explain, session),
        functools.partial(oom_report.report, session),
        stop_compiled=(
            functools.partial(_stop_compiled_inference, session, kind)
            if xla_memory.uses_xla(model)
            else None
        ),
        plan_compiled=(
            _compiled_slice_planner(session, kind) if xla_memory.uses_xla(model) else None
        ),
        # Without XLA the first batch is planned from its layer outputs
        # (an XLA step from its compiled program).
        sample_bytes_of=(
            None if xla_memory.uses_xla(model)
            else functools.partial(activations.traced_sample_bytes, model)
        ),
    )
    run.start()
    return run


def _compiled_slice_planner(session, kind):
    """Plans the slices of an XLA test or predict step against the smallest limit.

    `None` (no plan hook) where the model's batches run whole.
    """
    if session.stateful_layers:
        return None

    def in_use():
        # Read aside: the tries' blocks reach no reader's peak.
        values = [s.current_bytes for s in session.read_aside() if s.current_bytes is not None]
        return float(max(values)) if values else None

    return CompiledSlicePlanner(session.smallest_limit, session.config.threshold, in_use, kind)


def _stop_compiled_inference(session, kind, explanation, error):
    """Ends `evaluate` or `predict` after an XLA step ran out of memory: no replay."""
    oom_report.report(session, explanation)
    raise oom_report.compiled_step_error(session, explanation, None, call=kind) from error


def _has_ragged(data):
    """Whether a batch holds a ragged tensor (no fixed shape for XLA to split)."""
    return any(isinstance(item, tf.RaggedTensor) for item in tf.nest.flatten(data))


def _shapes_of(data):
    """The shapes of a batch's tensors: what a compiled step is specialized to."""
    return tuple(
        tuple(item.shape) if hasattr(item, "shape") else None
        for item in keras.tree.flatten(data)
    )


def _trains_with_default_step(model):
    """Whether `model` trains with Keras' own step or the mixin's (both split)."""
    return type(model).train_step is keras.Model.train_step or isinstance(model, MemGuardMixin)