"""MemoryGuard: micro-batch before memory runs out, replay a batch that did."""

import logging
import os

import keras

from keras_memguard import decider
from keras_memguard import oom_explanation
from keras_memguard import plan_cache
from keras_memguard.callbacks import inference
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks import messages
from keras_memguard.callbacks.controller import GuardController
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.decider import validate_micro_batches
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.probes import region
from keras_memguard.probes.tf_allocator import AllocatorProbe
from keras_memguard.probes.tf_allocator import cpu_bfc_limit_bytes
from keras_memguard.sinks import tensorboard as tb
from keras_memguard.training import compat

# Each backend's training core, as Keras picks its trainer: the module loads
# without TensorFlow on the JAX backend.
BACKEND = keras.backend.backend()
if BACKEND == "tensorflow":
    from keras_memguard.callbacks import agreement
    from keras_memguard.training import multi_worker
    from keras_memguard.training import remat
    from keras_memguard.training.eval_replay import ReplayTestFunction
    from keras_memguard.training.mixin import MemGuardMixin
    from keras_memguard.training.predict_replay import ReplayPredictFunction
    from keras_memguard.training.replay import ReplayTrainFunction
    from keras_memguard.training.setup import describe_setup
    from keras_memguard.training.setup import gradient_bytes
    from keras_memguard.training.step import trains_with_own_step
elif BACKEND == "jax":
    from keras_memguard.callbacks.jax_run import JaxInferenceRun
    from keras_memguard.callbacks.jax_run import JaxTrainingRun

logger = logging.getLogger("keras_memguard")

MODES = ("accumulate", "shrink")
# Opt-in rungs past one sample per micro-batch (`training/remat.py`'s RUNG).
RUNGS = ("remat",)
MICRO_BATCHES_LOG_KEY = "micro_batches"
# A batch size no real batch reaches: the bound when the size is unknown.
_UNKNOWN_BATCH_SIZE = 1 << 30
# The scalars written per batch, in `_write_scalars`' order; the threshold
# draws its line in the dashboard's usage chart.
_SCALAR_TAGS = (tb.MICRO_BATCHES, tb.MICRO_BATCH_SIZE, tb.OOM_RECOVERIES, tb.THRESHOLD)


class MemoryGuard(keras.callbacks.Callback):
    """Splits batches into micro-batches before device memory runs out.

    The guard pulls each training batch before it runs and plans it: it
    reads the memory in use right before the batch (weights, optimizer
    slots, the input pipeline's buffers, anything outside the step),
    predicts the step's own demand at each micro-batch count `k` from the
    demands measured so far (the batch's peak minus what was in use before
    it), taking the batch's size and shapes into account (a sequence twice
    as long counts twice), and runs it at the smallest `k` whose demand fits
    the memory free now under `threshold` (any count, not only powers of
    two). A count comes down again only when the lower one fits with room to
    spare, so `k` stays steady. The first batch of a set-up it has never
    seen runs at 8 micro-batches (or `micro_batches`, when given). What it
    learned is kept in a small JSON file under `$KERAS_HOME/memguard/`
    (`~/.keras/memguard/` by default), so the next `fit` of the same set-up
    starts at the right `k` (`plan_cache=False` turns that off). See
    `keras_memguard.decider` for the memory model.

    Under `MultiWorkerMirroredStrategy` the workers agree on each batch's
    peak and memory in use (as fractions of each worker's limit, scaled to
    the smallest limit), so all plan alike. With `plan=False`, or for a
    model with its own `train_step` under several workers, the guard reacts
    instead: at or
    above `threshold` it doubles `k` before the next batch; once the usage
    predicted at `k / 2` has stayed below `release` for `cooldown` batches,
    it halves `k` again. The input pipeline, the number of steps and the
    progress bar stay as they are: each batch is split inside the train
    step.

    In `"accumulate"` mode the gradients of the `k` micro-batches are summed,
    weighted by each one's share of the samples, and applied once: the update
    is the one the whole batch would give. In `"shrink"` mode every
    micro-batch is its own update (a smaller effective batch).

    A batch that still runs out of memory (`tf.errors.ResourceExhaustedError`)
    is run again with a strictly smaller micro-batch, sized from what the
    error says (the memory that was free, the failed allocation and the
    largest free block): no sample is skipped and nothing is applied twice.
    When a micro-batch of one sample does not fit, or the failed allocation
    does not shrink with the micro-batch, `MicroBatchTooLargeError` is raised
    at once. Every other exception passes through untouched.

    Each out-of-memory error is explained in one WARNING line and, with
    `log_dir`, in `<log_dir>/memguard/oom-<step>.json`: the allocation that
    failed and its layer, the memory in use, the largest free block and the
    fragmentation (from the `MemoryDump` TensorFlow's BFC allocator writes
    when `TF_BFC_MEMORY_DUMP` is set; the guard sets it to a temporary
    directory during `fit` unless it is set already), and the largest live
    tensors named by the layer whose tensor has their size. The last one is
    `last_oom_explanation` (a `keras_memguard.oom_explanation.OutOfMemoryExplanation`).

    Works on any compiled Keras model (TensorFlow backend): plain Sequential
    and functional models need no change, and models that mix in
    `MemGuardMixin` keep their own `train_step`. The model's class is never
    changed, so `model.save` and `keras.models.load_model` work as usual.

    Writes, per batch, the TensorBoard scalars `memguard/micro_batches`,
    `memguard/micro_batch_size` and `memguard/oom_recoveries` to the run
    `<log_dir>/memguard`, adds `micro_batches` (when planning, the count the
    batch ran with; otherwise the count for the next batch) to the batch and
    epoch `logs` the train function returns, so every callback sees it
    whatever its place in the `callbacks` list, and logs one INFO line
    through the `keras_memguard` logger per change, saying why (`planned
    k=3 for batch 408: predicted peak 88% of 600 MiB under target 90%`).

    A validation batch (during `fit`) that runs out of memory is evaluated
    in smaller slices instead, going on from the first sample not yet
    evaluated: the validation metrics are those of the whole batch. The
    slice count (`eval_micro_batches`) grows per error and stays for the
    next validations; training's `k` and `oom_recoveries` are left alone.

    With `escalate=("remat",)`, a batch that does not fit at one sample per
    micro-batch is run with the forward pass in recomputed segments
    (`keras_memguard.training.remat`); `rungs_on` lists the rungs switched
    on.

    `k` and the counters persist across epochs and `fit` calls. To resume them
    with `keras.callbacks.BackupAndRestore`, give both the same directory.

    Args:
        threshold: Usage (peak / limit) never planned at or above; when
            reacting, the peak usage at which `k` doubles. In (0, 1].
            Defaults to `0.9`.
        release: When reacting, the predicted usage below which `k` may
            halve, in (0, 1) and below `threshold`. `None` means
            `threshold - 0.2` (half the threshold for thresholds up to 0.4).
            Defaults to `None`.
        mode: `"accumulate"` or `"shrink"`. Defaults to `"accumulate"`.
        max_micro_batches: The largest `k` allowed, or `None` for no cap
            other than the batch size. Defaults to `None`.
        cooldown: When reacting, batches the predicted usage must stay below
            `release`, and the least number of batches between two
            usage-driven changes, before `k` halves. Defaults to `20`.
        micro_batches: The number of micro-batches to start with, when the
            guard has no saved state (from an earlier `fit` or from
            `backup_dir`): with `plan=True`, the first batch's split when
            nothing is known (`1` means the default cautious split of 8);
            with `plan=False`, the count until the usage changes it.
            Defaults to `1`.
        memory_limit: Device memory limit in bytes (an int for every device,
            or a dict from TensorFlow device string to bytes). `None`
            resolves it as `AllocatorProbe` documents. Defaults to `None`.
        scale_learning_rate: In `"shrink"` mode, divide a float learning rate
            by `k` while micro-batching (the linear scaling rule for the
            smaller effective batch). Defaults to `False`.
        log_dir: Directory for TensorBoard logs, or `None` for none.
            Defaults to `None`.
        backup_dir: Directory where the guard keeps its state (the
            `backup_dir` of your `keras.callbacks.BackupAndRestore`), or
            `None` to keep it in memory only. Defaults to `None`.
        plan: Plan each batch before it runs (`True`), or react to each
            batch's peak after it ran (`False`: the `release`/`cooldown`
            rule). Defaults to `True`.
        plan_cache: Keep what the guard learned in `$KERAS_HOME/memguard/`
            and start the next `fit` of the same set-up from it. A corrupt
            or foreign file there is ignored with one warning. Defaults to
            `True`.
        reserve_memory: When planning (or with `escalate`) on TensorFlow's
            BFC allocator on the CPU, reserve the rest of the limit in one
            allocator region before the first batch (once per process; no
            memory is touched until tensors use it). Without it, what fits
            depends on the sizes of earlier batches. Nothing is reserved on
            a GPU. Defaults to `True`.
        escalate: Rungs the guard may climb when one sample per
            micro-batch does not fit, a tuple. `("remat",)`: run the forward
            pass in segments of 3 layers, each recomputed in the backward
            pass (`tf.recompute_grad`), for Sequential models and functional
            chains without dropout or BatchNormalization; it trades step
            time for memory (`bench/RESULTS.md` has the figures). The rung
            is switched on before the batch when one sample is predicted
            not to fit (from the plan cache, after an earlier run), else
            after the batch ran out of memory at one sample, which is then
            replayed. A model the rung cannot work on is named in the error.
            Defaults to `()` (never).

    Raises:
        ValueError: If an argument is out of range.

    Example:

    ```python
    guard = keras_memguard.MemoryGuard(threshold=0.9, log_dir="logs")
    model.fit(x, y, batch_size=256, epochs=10, callbacks=[guard])
    print(guard.micro_batches, guard.oom_recoveries)
    ```
    """

    def __init__(
        self,
        threshold=0.9,
        release=None,
        mode="accumulate",
        max_micro_batches=None,
        cooldown=20,
        micro_batches=1,
        memory_limit=None,
        scale_learning_rate=False,
        log_dir=None,
        backup_dir=None,
        plan=True,
        plan_cache=True,
        reserve_memory=True,
        escalate=(),
    ):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        for name, value in (
            ("scale_learning_rate", scale_learning_rate),
            ("plan", plan),
            ("plan_cache", plan_cache),
            ("reserve_memory", reserve_memory),
        ):
            if not isinstance(value, bool):
                raise ValueError(
                    f"`{name}` must be True or False. Received: {name}={value!r}"
                )
        if isinstance(escalate, str) or not isinstance(escalate, (tuple, list)) or any(
            rung not in RUNGS for rung in escalate
        ):
            raise ValueError(
                f"`escalate` must be a tuple of rung names from {RUNGS}. "
                f"Received: escalate={escalate!r}"
            )
        validate_micro_batches(micro_batches)
        # Validates threshold, release, cooldown and max_micro_batches.
        self.config = decider.make_config(
            threshold=threshold,
            release=release,
            cooldown=cooldown,
            first_split=micro_batches if micro_batches > 1 else 8,
            max_micro_batches=max_micro_batches,
            predictive=plan,
        )
        if max_micro_batches is not None and micro_batches > max_micro_batches:
            raise ValueError(
                "`micro_batches` must not exceed `max_micro_batches`. Received: "
                f"micro_batches={micro_batches}, max_micro_batches={max_micro_batches}"
            )
        if memory_limit is not None:
            AllocatorProbe(memory_limit=memory_limit)  # validates it
        self.mode = mode
        self.plan = plan
        self.plan_cache = plan_cache
        self.reserve_memory = reserve_memory
        self.escalate = tuple(escalate)
        self.memory_limit = memory_limit
        self.scale_learning_rate = scale_learning_rate
        self.log_dir = log_dir
        self.backup_dir = backup_dir
        self._start_micro_batches = micro_batches
        self.controller = GuardController(
            self.config, micro_batches if not plan else None, self.escalate
        )
        self._writer = tb.writer_for(log_dir) if log_dir is not None else None
        self._reader = None
        self._limits = ()
        self._function = None
        self._carrier = None
        self._previous_inner = None
        # Whether the carrier ran this batch's bookkeeping already.
        self._contributed = False
        self._eval_function = None
        # `evaluate` / `predict` outside `fit`: the run now, and one
        # controller per kind, kept between calls.
        self._inference = None
        self._inference_controllers = {}
        self._base_learning_rate = None
        self._multi_worker = False
        self._started = False
        self._has_restored_state = False
        self._plan_key = None
        self._plan_fields = None
        # Memory in use right before the batch that runs now.
        self._before = None
        # Under several workers: the agreed memory in use after the last
        # batch, planned from before the next.
        self._agreed_in_use = None
        self._step = 0
        self._last_batch = -1
        self._dumps = None
        self.last_oom_explanation = None
        # The `fit` on the JAX backend (a `JaxTrainingRun`), or None.
        self._jax_run = None

    @property
    def state(self):
        """The decider's state (a `keras_memguard.decider.DeciderState`)."""
        return self.controller.state

    @property
    def micro_batches(self):
        """The number of micro-batches each batch is split into now."""
        return self.controller.state.micro_batches

    @property
    def oom_recoveries(self):
        """How many batches were replayed after an out-of-memory error."""
        return self.controller.state.oom_count

    @property
    def eval_micro_batches(self):
        """The number of slices each validation batch is evaluated in now."""
        return self.controller.state.eval_micro_batches

    @property
    def eval_oom_recoveries(self):
        """How many times evaluation ran out of memory and went on in slices.

        `fit`'s validation and `model.evaluate(callbacks=[guard])` together.
        """
        controller = self._inference_controllers.get(inference.EVALUATE)
        inferred = controller.state.oom_count if controller is not None else 0
        return self.controller.state.eval_oom_count + inferred

    @property
    def predict_oom_recoveries(self):
        """How many times `predict` ran out of memory and went on in slices."""
        controller = self._inference_controllers.get(inference.PREDICT)
        return controller.state.oom_count if controller is not None else 0

    @property
    def rungs_on(self):
        """The rungs of `escalate` switched on, a tuple of names."""
        return self.controller.rungs_on

    def set_model(self, model):
        super().set_model(model)
        self._reader = shared_reader(model)
        self._reader.register(self, self.memory_limit)

    # Keras' hooks.

    def on_train_begin(self, logs=None):
        if BACKEND != "tensorflow":
            self._begin_other_backend()
            return
        model = self.model
        self._check_model(model)
        self._limits = self._resolve_limits()
        self._load_state()
        self._multi_worker = multi_worker.is_multi_worker(model.distribute_strategy)
        carrier = logs_carrier.current(model)
        if self._multi_worker and not self._started:
            if self.config.predictive and trains_with_own_step(model):
                # A step that cannot be split runs its collectives inside the
                # micro-batch loop: every worker must keep the same count, so
                # the workers react to agreed numbers after each batch.
                self.config = self.config._replace(predictive=False)
                self.controller.config = self.config
                if not self._has_restored_state:
                    self.controller.state = decider.init(
                        self.config, self._start_micro_batches
                    )
            # The most constrained worker's limit; each worker's readings
            # are scaled to it as fractions of its own limit.
            self.controller.start(
                agreement.agreed_limit(model.distribute_strategy, self._limits),
                gradient_bytes(model),
                oom_explanation.layer_output_bytes(model),
            )
            self._started = True
        elif not self._started and not self.plan:
            # No plan hook runs first: start from what is known now.
            self.controller.start(min(l for l in self._limits if l), gradient_bytes(model))
            self._started = True
        if self._multi_worker:
            # Makes Keras' symbolic build and log reduction work across
            # workers; resets the train and test functions.
            multi_worker.prepare_multi_worker(model)
            logs_carrier.reinstall(model, carrier, model.train_function)
            self._function = multi_worker.MultiWorkerTrainFunction(
                model,
                micro_batches=self.micro_batches,
                mode=self.mode,
                on_out_of_memory=self._on_out_of_memory,
                plan=self._plan_batch if self.config.predictive else None,
            )
        else:
            self._function = ReplayTrainFunction(
                model,
                micro_batches=self.micro_batches,
                mode=self.mode,
                on_out_of_memory=self._on_out_of_memory,
                plan=self._plan_batch,
            )
        if self.reserve_memory and (self.plan or self.escalate) and not self._multi_worker:
            # A rung climbed after an out-of-memory error needs it too: in a
            # grown allocator the error leaves no piece large enough.
            self._reserve_regions()
        # The guard's function trains inside the model's logs carrier.
        self._carrier = logs_carrier.attach(model, self, self._contribute, self.params)
        self._previous_inner = self._carrier.inner
        self._carrier.inner = self._function
        self._contributed = False
        self._apply(self.micro_batches)
        # The allocator's dump at an out-of-memory error explains it.
        self._dumps = oom_explanation.MemoryDumpCapture()
        self._reader.reset()
        if self._writer is not None:
            self._writer.acquire(self)

    def on_train_end(self, logs=None):
        if self._jax_run is not None:
            self._jax_run.end()
            self._jax_run = None
            if self._writer is not None:
                self._writer.release(self)
            return
        self._save_plan()
        if self._dumps is not None:
            self._dumps.close()
            self._dumps = None
        carrier = self._carrier
        if carrier is not None and carrier.inner is self._function:
            carrier.inner = self._previous_inner
        logs_carrier.detach(self.model, self)
        self._carrier = None
        self._previous_inner = None
        self._function = None
        self._restore_test_function()
        self._restore_learning_rate()
        if self._writer is not None:
            self._writer.release(self)

    def on_epoch_begin(self, epoch, logs=None):
        self._last_batch = -1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[MICRO_BATCHES_LOG_KEY] = self.micro_batches
        self._save_state()
        self._save_plan()
        if self._writer is not None:
            self._writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        if self._jax_run is not None:
            return  # the run's carrier contribution did the work
        if self._contributed:
            self._contributed = False
            return
        # No carrier (the train function was replaced after on_train_begin).
        self._after_batch(batch, logs, (id(logs), batch))

    def on_test_begin(self, logs=None):
        if BACKEND != "tensorflow":
            self._begin_other_backend_inference(inference.EVALUATE)
            return
        if self._function is None:
            # `model.evaluate(callbacks=[guard])`: planned and sliced.
            self._begin_inference(inference.EVALUATE, ReplayTestFunction)
            return
        # `fit`'s validation. Several replicas: Keras' own test function
        # (slices are cut in Python).
        if not ReplayTestFunction.supports(self.model):
            return
        self._eval_function = ReplayTestFunction(
            self.model,
            micro_batches=self.eval_micro_batches,
            on_out_of_memory=self._on_eval_out_of_memory,
        )
        self._eval_function.install()

    def on_test_batch_end(self, batch, logs=None):
        if self._inference is not None:
            self._inference.after_batch()

    def on_test_end(self, logs=None):
        if BACKEND != "tensorflow":
            self._end_other_backend_inference()
            return
        if self._function is None:
            self._end_inference()
            return
        self._restore_test_function()
        # Validation's peak must not count as the next training batch's.
        self._reader.reset()

    def on_predict_begin(self, logs=None):
        if BACKEND != "tensorflow":
            self._begin_other_backend_inference(inference.PREDICT)
            return
        self._begin_inference(inference.PREDICT, ReplayPredictFunction)

    def on_predict_batch_end(self, batch, logs=None):
        if self._inference is not None:
            self._inference.after_batch()

    def on_predict_end(self, logs=None):
        if BACKEND != "tensorflow":
            self._end_other_backend_inference()
            return
        self._end_inference()

    def _begin_other_backend(self):
        """Starts a `fit` on a backend other than TensorFlow (JAX)."""
        if BACKEND != "jax":
            raise UnsupportedTrainingSetupError(messages.backend_unsupported(BACKEND))
        self._limits = self._resolve_limits()
        self._load_state()
        limit = min(l for l in self._limits if l)
        if not self._started:
            self.controller.start(limit, 0, 0)
            self._started = True
        self._jax_run = JaxTrainingRun(self, limit, MICRO_BATCHES_LOG_KEY)
        self._jax_run.begin()
        self._reader.reset()
        if self._writer is not None:
            self._writer.acquire(self)

    def _begin_other_backend_inference(self, kind):
        """Slices the batches of `evaluate` or `predict` on JAX."""
        if BACKEND != "jax":
            messages.log_inference_not_guarded(BACKEND, kind)
            return
        self._limits = self._resolve_limits()
        self._inference = JaxInferenceRun(self, kind, min(l for l in self._limits if l))
        self._inference.begin()

    def _end_other_backend_inference(self):
        if self._inference is not None:
            self._inference.end()
            self._inference = None

    def _begin_inference(self, kind, function_class):
        """Plans and slices the batches of an `evaluate` or `predict` call."""
        model = self.model
        if not function_class.supports(model):
            messages.log_inference_unsupported(
                kind, model.distribute_strategy.num_replicas_in_sync
            )
            return
        self._limits = self._resolve_limits()
        controller = self._inference_controllers.get(kind)
        if controller is None:
            controller = self._inference_controllers[kind] = GuardController(self.config)
        if self._dumps is None:
            self._dumps = oom_explanation.MemoryDumpCapture()
        self._inference = inference.InferenceRun(
            kind,
            model,
            controller,
            self._reader,
            self,
            self._limits,
            self._explain,
            self._report,
        )
        self._inference.start()

    def _end_inference(self):
        if self._inference is not None:
            self._inference.end()
            self._inference = None
        if self._dumps is not None and self._function is None:
            self._dumps.close()
            self._dumps = None

    # Each batch: plan before it, observe after it.

    def _plan_batch(self, batch_size, sample_size, data):
        """The count the batch about to run gets (the function's `plan`)."""
        controller = self.controller
        if not self._started:
            self._start(data)
        if self._multi_worker:
            if self._agreed_in_use is None:
                # The first batch: every worker reads and agrees now (the
                # read also resets the peak, as below).
                _, self._agreed_in_use = self._agreed_usage(
                    self._reader.read(self, None)
                )
            # What every worker agreed on after the last batch.
            before = self._before = self._agreed_in_use
        else:
            # Reading resets the peak: the batch's own peak is read after it.
            self._before = before = self._in_use(self._reader.read(self, None))
        k = controller.plan(batch_size, sample_size, before)
        if (
            k >= batch_size
            and self.escalate
            and not controller.one_sample_fits(batch_size, sample_size, before)
            and self._climb(
                "one sample per micro-batch is predicted not to fit a batch of "
                f"{batch_size}"
            )
        ):
            k = controller.plan(batch_size, sample_size, before)
        if k != self._function.micro_batches:
            self._apply(k)
        return k

    def _contribute(self, logs):
        """Observes after each train function call; adds `micro_batches`.

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
        self._step += batch - self._last_batch
        self._last_batch = batch
        samples = self._reader.read(self, key)
        peak, limit = self._peak(samples)
        function = self._function
        if function is not None and limit:
            ran_with = function.micro_batches
            before = self._before
            if self._multi_worker:
                # The same numbers at the same step on every worker.
                peak, self._agreed_in_use = self._agreed_usage(samples)
                limit = self.controller.limit_bytes
            decided = self.controller.observe(
                decider.Reading(
                    function.last_replica_batch_size or _UNKNOWN_BATCH_SIZE,
                    ran_with,
                    getattr(function, "last_sample_size", None) or 1.0,
                    before,
                    peak,
                    limit,
                )
            )
            if decided.changed:
                messages.log_decision(decided, self._micro_batch_text(decided.micro_batches))
                self._apply(decided.micro_batches)
                self._save_state()
        if logs is not None:
            logs[MICRO_BATCHES_LOG_KEY] = self.micro_batches
        if self._writer is not None:
            self._write_scalars()

    def _peak(self, samples):
        """`(peak, limit)` of the device nearest its limit, or `(None, limit)`."""
        usage = None
        found = (None, self.controller.limit_bytes)
        for sample, device_limit in zip(samples, self._limits):
            peak = sample.peak_bytes
            if peak is None or not device_limit:
                continue
            if usage is None or peak / device_limit > usage:
                usage = peak / device_limit
                found = (float(peak), float(device_limit))
        return found

    def _agreed_usage(self, samples):
        return agreement.agreed_usage(
            self.model.distribute_strategy, samples, self._limits, self.controller.limit_bytes
        )

    def _in_use(self, samples):
        """Memory in use on the device planned against, or `None`."""
        limit = self.controller.limit_bytes
        in_use = None
        for sample, device_limit in zip(samples, self._limits):
            if device_limit == limit and sample.current_bytes is not None:
                in_use = max(in_use or 0.0, float(sample.current_bytes))
        return in_use

    def _start(self, data):
        """Starts the decider for this `fit`: limit, fixed bytes, plan cache."""
        limit = min(l for l in self._limits if l)
        state = None
        if self.plan and self.plan_cache and not self._has_restored_state:
            self._plan_fields = describe_setup(
                self.model, data, self._reader.probe.devices, self._limits, self.mode
            )
            self._plan_key = plan_cache.setup_key(self._plan_fields)
            state = plan_cache.load(self._plan_key, self._plan_fields)
            if state is not None:
                logger.info(
                    "planning from %d measurement%s of an earlier run (%s)",
                    len(state.readings),
                    "" if len(state.readings) == 1 else "s",
                    plan_cache.path_for(self._plan_key),
                )
        self.controller.start(
            limit,
            gradient_bytes(self.model),
            oom_explanation.layer_output_bytes(self.model),
            state,
        )
        self._started = True

    # Out of memory.

    def _on_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the micro-batch count to replay a batch with, or raises."""
        function = self._function
        # Each replica splits its own part of the (global) batch.
        replica_batch_size = function.last_replica_batch_size or batch_size
        explanation = self._explain(error, replica_batch_size, micro_batches)
        failure = decider.Failure(
            replica_batch_size or _UNKNOWN_BATCH_SIZE,
            micro_batches,
            getattr(function, "last_sample_size", None) or 1.0,
            self._before,
            self.controller.limit_bytes,
            explanation.in_use_bytes,
            explanation.failed_allocation_bytes,
            explanation.failed_shape,
            explanation.largest_free_chunk_bytes,
        )
        if self._multi_worker:
            failure = agreement.agreed_failure(
                self.model.distribute_strategy,
                failure,
                min(l for l in self._limits if l),
                self.controller.limit_bytes,
            )
        decided = self.controller.fail(failure)
        if (
            decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE
            and self.escalate
            and self._climb(
                f"batch {batch_size} ran out of memory at one sample per micro-batch"
            )
        ):
            self.controller.count_replay()
            self.controller.set_micro_batches(micro_batches)
            self._report(explanation._replace(replayed_with=micro_batches))
            self._save_state()
            return micro_batches
        if decided.cannot_split:
            self._report(explanation)
            raise self._cannot_split_error(decided, batch_size, micro_batches) from error
        new_k = decided.micro_batches
        self._report(explanation._replace(replayed_with=new_k))
        messages.log_replay(batch_size, micro_batches, new_k, self._micro_batch_text(new_k))
        self._apply(new_k)
        self._save_state()
        self._save_plan()
        return new_k

    def _on_eval_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the slice count to go on evaluating with, or raises.

        Only evaluation's count changes; training's `k` and
        `oom_recoveries` stay as they are.
        """
        decided = self.controller.fail_evaluation(batch_size or 1, micro_batches)
        if decided.cannot_split:
            raise self._cannot_split_error(
                decided, batch_size, micro_batches, evaluating=True
            ) from error
        new_k = decided.micro_batches
        done = self._eval_function.samples_done if self._eval_function else 0
        messages.log_eval_slices(batch_size, micro_batches, done, new_k, self.micro_batches)
        self._save_state()
        return new_k

    def _explain(self, error, batch_size, micro_batches):
        """Why the batch ran out of memory, from the allocator's dump."""
        dump = self._dumps.take_latest() if self._dumps is not None else None
        limits = [limit for limit in self._limits or () if limit]
        return oom_explanation.explain(
            getattr(error, "message", None) or str(error),
            dump,
            self.model,
            step=self._step + 1,
            batch_size=batch_size,
            micro_batches=micro_batches,
            limit_bytes=min(limits) if limits else None,
        )

    def _report(self, explanation):
        """One WARNING line, and `<log_dir>/memguard/oom-<step>.json`."""
        self.last_oom_explanation = explanation
        text = oom_explanation.describe(explanation)
        if explanation.replayed_with is not None:
            replay = decider.micro_batches_text(explanation.replayed_with)
            text += f"; replaying with {replay}"
        if self.log_dir is not None:
            try:
                path = oom_explanation.write(
                    explanation, os.path.join(self.log_dir, tb.RUN_NAME), text
                )
                text += f" ({path})"
            except OSError as write_error:
                text += f" (not written: {write_error})"
        logger.warning("%s", text)

    def _cannot_split_error(self, decided, batch_size, micro_batches, evaluating=False):
        """The `MicroBatchTooLargeError` for a batch no count can help."""
        samples = self._reader.read(self, None)
        peak = max((s.peak_bytes or 0 for s in samples), default=0) or None
        limit = max((l or 0 for l in self._limits), default=0) or None
        prefix = "Validation: " if evaluating else ""
        if decided.cannot_split == decider.CANNOT_SPLIT_BATCH_SIZE:
            controller = self.controller
            tried = controller.rungs_on + tuple(
                f"{rung} (not possible: {reason})"
                for rung, reason in controller.rungs_refused.items()
            )
            message = messages.too_large(
                batch_size, micro_batches, peak, limit, self.escalate, tried
            )
        elif decided.cannot_split == decider.CANNOT_SPLIT_ALLOCATION:
            message = messages.allocation_does_not_shrink(
                decided.reason, batch_size, peak, limit
            )
        else:
            message = messages.cap_reached(micro_batches, batch_size, evaluating)
        return MicroBatchTooLargeError(prefix + message, peak_bytes=peak, limit_bytes=limit)

    # Escalation.

    def _climb(self, why):
        """Switches on the next rung of `escalate`; whether one was."""
        model = self.model
        rung = self.controller.next_rung(lambda rung: remat.can_remat(model))
        if rung is None:
            return False
        segments = remat.switch_on(model)
        messages.log_rung(rung, why, segments, remat.SEGMENT_LAYERS)
        if self.plan:
            # What was learned holds for the step without the rung: kept
            # in the cache (a next run climbs before its first batch), and
            # the model starts over for the step with it.
            self._save_plan()
            self._plan_key = None
            self.controller.restart_model()
        return True

    # Helpers.

    def _restore_test_function(self):
        if self._eval_function is not None:
            self._eval_function.restore()
            self._eval_function = None

    def _check_model(self, model):
        trains_with_default_step = (
            type(model).train_step is keras.Model.train_step
            or isinstance(model, MemGuardMixin)
        )
        if not trains_with_default_step:
            raise UnsupportedTrainingSetupError(messages.own_train_step(type(model).__name__))

    def _resolve_limits(self):
        probe = self._reader.probe
        limits = resolve_limits(probe, self.memory_limit)
        if not any(limits):
            raise MemoryLimitUnknownError(
                messages.memory_limit_unknown(probe.devices, BACKEND)
            )
        return limits

    def _reserve_regions(self):
        """One free region for the rest of each CPU BFC allocator's limit."""
        probe = self._reader.probe
        limit = cpu_bfc_limit_bytes()
        if limit is None:
            return
        for device in probe.devices:
            if probe.device_mode(device) == "bfc":
                region.reserve_region(device, limit)

    def _apply(self, micro_batches):
        """Makes the next batch run with `micro_batches` micro-batches."""
        if self._function is not None:
            self._function.micro_batches = micro_batches
        if isinstance(self.model, MemGuardMixin):
            self.model.micro_batches = micro_batches
        if self.mode == "shrink" and self.scale_learning_rate:
            self._scale_learning_rate(micro_batches)

    def _scale_learning_rate(self, micro_batches):
        learning_rate = self.model.optimizer.learning_rate
        if compat.learning_rate_variable(self.model.optimizer) is None:
            raise UnsupportedTrainingSetupError(messages.learning_rate_schedule())
        if self._base_learning_rate is None:
            self._base_learning_rate = float(learning_rate)
        self.model.optimizer.learning_rate.assign(self._base_learning_rate / micro_batches)

    def _restore_learning_rate(self):
        if self._base_learning_rate is not None:
            self.model.optimizer.learning_rate.assign(self._base_learning_rate)
            self._base_learning_rate = None

    def _micro_batch_size(self, micro_batches):
        """Samples in one micro-batch of one replica, or `None`."""
        if self._jax_run is not None:
            size = self._jax_run.last_batch_size
            return -(-size // micro_batches) if size else None
        function = self._function
        size = function.last_replica_batch_size if function else None
        return -(-size // micro_batches) if size else None

    def _micro_batch_text(self, micro_batches):
        size = self._micro_batch_size(micro_batches)
        if size is None:
            return None
        function = self._function
        if function.last_replica_batch_size != function.last_batch_size:
            return f"{size} per replica"
        return f"{size}"

    def _write_scalars(self):
        """Queues the batch's row; the writer's thread encodes it."""
        k = self.micro_batches
        self._writer.write_values(
            self._step,
            _SCALAR_TAGS,
            (
                k,
                self._micro_batch_size(k),
                self.oom_recoveries,
                self.config.threshold,
            ),
        )

    # What is kept.

    def _save_state(self):
        if self.backup_dir is not None:
            self.controller.save(self.backup_dir, self._step)

    def _load_state(self):
        if self.backup_dir is None:
            return
        step = self.controller.load(self.backup_dir)
        if step is not None:
            self._step = step
            self._has_restored_state = True

    def _save_plan(self):
        if self.plan and self._plan_key and self._started:
            plan_cache.save(self._plan_key, self._plan_fields, self.controller.state)
