"""What one `MemoryGuard` keeps across calls and hands to each run.

A guard's runs (the glue of one `fit`, `evaluate` or `predict` on a
backend, `keras_memguard.backends`) share what outlives any one of them:
the controller that holds the decider's state, the allocator reader and
the limits it resolved, the TensorBoard writer, the step count, the
allocator's dump capture and one controller per kind of inference. The
`GuardSession` holds all of it behind public names, with the guard's
options as an immutable `GuardOptions`; the guard makes one and hands it
to every run, and no run reaches into the guard itself.
"""

import gc
import json
import logging
from typing import NamedTuple, Optional, Tuple

import keras

from keras_memguard import decider
from keras_memguard.backends import compat
from keras_memguard import oom_explanation
from keras_memguard.callbacks import messages
from keras_memguard.callbacks.controller import GuardController
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.sinks import tensorboard as tb
from keras_memguard.whole_batches import check_micro_batches
from keras_memguard.whole_batches import stateful_layers

logger = logging.getLogger("keras_memguard")

# The scalars written per batch, in `write_scalars`' order; the threshold
# draws its line in the dashboard's usage chart.
SCALAR_TAGS = (tb.MICRO_BATCHES, tb.MICRO_BATCH_SIZE, tb.OOM_RECOVERIES, tb.THRESHOLD)
# The share of the limit the memory in use must reach before the guard
# collects Python's garbage (`GuardSession.collect_garbage_once`).
GARBAGE_SHARE = 0.02


class GuardOptions(NamedTuple):
    """`MemoryGuard`'s options as its runs read them (see `MemoryGuard`).

    Attributes:
        mode: `"accumulate"`, `"shrink"` or `"auto"`.
        plan: Whether each batch is planned before it runs.
        plan_cache: Whether the plan cache is read and written.
        escalate: The rungs the guard may climb, a tuple of names.
        reserve_memory: Whether the BFC allocator's region is reserved
            before the first batch.
        scale_learning_rate: Whether the learning rate is divided by `k`
            in `"shrink"` mode.
        memory_limit: The user's memory limit (bytes, a dict from device
            string to bytes, or `None`).
        micro_batches: The count to start with when nothing is restored.
        log_dir: The TensorBoard directory, or `None`.
        backup_dir: The directory the state is kept in, or `None`.
    """

    mode: str = "accumulate"
    plan: bool = True
    plan_cache: bool = True
    escalate: Tuple[str, ...] = ()
    reserve_memory: bool = True
    scale_learning_rate: bool = False
    memory_limit: object = None
    micro_batches: int = 1
    log_dir: Optional[str] = None
    backup_dir: Optional[str] = None


class GuardSession:
    """The state a `MemoryGuard` shares with its runs, behind public names.

    Made once per guard. `attach` binds it to the model of each `fit`
    (the allocator reader is per model); `resolve_limits` reads the limits
    at the start of each call; the runs read and write the rest through
    the methods below. The session is also the consumer the shared reader
    knows the guard by, and the owner the model's logs carrier knows.

    Args:
        config: The decider's `DeciderConfig`.
        options: A `GuardOptions`.
        writer: The TensorBoard writer of `options.log_dir`, or `None`.
            Defaults to `None`.

    Attributes:
        options: The `GuardOptions`, fixed for the session's life.
        config: The decider's `DeciderConfig` (reacting instead of planning
            after `stop_planning`).
        controller: The `GuardController` of training.
        writer: The TensorBoard writer, or `None`.
        model: The Keras model `attach` was given, or `None`.
        reader: The model's `SharedAllocatorReader`, or `None` before
            `attach`.
        limits: The memory limit of each of the reader's devices (bytes,
            or `None` where unknown), from the last `resolve_limits`.
        step: The training steps run so far (restored from `backup_dir`).
        last_oom_explanation: The `OomExplanation` of the last
            out-of-memory error, or `None`.

    Example:

    ```python
    session = GuardSession(config, GuardOptions(plan=False))
    session.attach(model)
    session.resolve_limits()
    session.start(session.smallest_limit)
    ```
    """

    def __init__(self, config, options, writer=None):
        self.options = options
        self.config = config
        self.controller = GuardController(
            config,
            options.micro_batches if not options.plan else None,
            options.escalate,
            options.backup_dir,
        )
        self.writer = writer
        self.model = None
        self.reader = None
        self.limits = ()
        self.step = 0
        self.last_oom_explanation = None
        self._started = False
        self._restored = False
        # The trained step's signature at the last `fit` (`begin_fit`).
        self._trained_step = None
        self._collected = False
        self._dumps = None
        # `evaluate` / `predict`: one controller per kind, kept between calls.
        self._inference_controllers = {}
        # The model's stateful layers, whose batches run whole (`attach`).
        self.stateful_layers = ()
        # The `messages.WholeStep` of a model whose batches train whole
        # (`train_whole_batches`), or `None`.
        self.whole_step = None
        # The configuration of `evaluate` and `predict`, where training's
        # count is capped for a reason theirs is not; `None`: `config`.
        self._inference_config = None
        # The warning of `whole_after_split_error`, said once a whole batch
        # has trained (`advance`), or `None`.
        self._unsaid_warning = None

    # The model and its limits.

    def attach(self, model):
        """Binds the session to `model` and registers with its shared reader.

        A model with stateful layers (`whole_batches`) has its batches
        trained, evaluated and predicted whole: the count is capped at one,
        and a count asked for above it is refused here, before `fit` runs.

        Raises:
            UnsupportedTrainingSetupError: If `micro_batches` above one was
                asked for a model with stateful layers.
        """
        if self.whole_step is not None and model is not self.model:
            # Another model: whether its batches train whole is found again.
            self.config = self._inference_config or self.config
            self.controller.config = self.config
            self.whole_step = self._inference_config = None
        self.model = model
        self.reader = shared_reader(model)
        self.reader.register(self, self.options.memory_limit)
        self.stateful_layers = stateful_layers(model)
        if self.stateful_layers and self.config.max_micro_batches != 1:
            check_micro_batches(model, self.options.micro_batches)
            logger.warning(
                "%s", messages.stateful_whole_batches(type(model).__name__, self.stateful_layers)
            )
            self.config = self.config._replace(max_micro_batches=1)
            self.controller.config = self.config
            self.controller.set_micro_batches(1)
            for controller in self._inference_controllers.values():
                controller.config = self.config

    def train_whole_batches(self, whole, backend, after_a_step=False):
        """Trains the model's batches whole, as plain `fit` runs them.

        Where nothing can be split (a model's own `train_step`; a JAX step
        under `keras.distribution`), the training count is capped at one and
        the guard watches memory and explains an out-of-memory error (the
        backend's run reads an XLA step before it runs). `evaluate` and
        `predict` keep their own configuration. Warns once per session.

        Args:
            whole: The `messages.WholeStep` that says why, for the messages.
            backend: The Keras backend's name (the warning differs).
            after_a_step: If `True`, the warning waits until a batch has
                trained (`advance`).

        Raises:
            UnsupportedTrainingSetupError: If `micro_batches` above one was
                asked for.
        """
        if self.options.micro_batches > 1:
            raise UnsupportedTrainingSetupError(
                messages.whole_step_refused(whole, self.options.micro_batches)
            )
        if self.whole_step is None:
            warning = messages.whole_step_batches(whole, backend)
            if after_a_step:
                self._unsaid_warning = warning
            else:
                logger.warning("%s", warning)
        self.whole_step = whole
        if self.config.max_micro_batches != 1:
            if self._inference_config is None:
                self._inference_config = self.config
            self.config = self.config._replace(max_micro_batches=1)
            self.controller.config = self.config
            self.controller.set_micro_batches(1)

    def whole_after_split_error(self, error, backend):
        """The count after a split step raised `error`: one, or raises.

        `error` is not an out-of-memory error: the model's code fails on a
        micro-batch where plain `fit` runs the whole batch (code that
        assumes the batch size), so its batches train whole from here
        (`train_whole_batches`). It warns once the whole batch has trained:
        where that raises too, the error is not the split's, and `fit` ends
        with it as plain `fit` does, with no warning that blames the split.
        Where the user asked for micro-batches,
        `UnsupportedTrainingSetupError` says so instead, and nothing was
        trained.

        Args:
            error: What the split step raised.
            backend: The Keras backend's name.

        Returns:
            `1`, the count to run the batch with.

        Raises:
            UnsupportedTrainingSetupError: If `micro_batches` above one was
                asked for.
        """
        try:
            self.train_whole_batches(
                messages.split_fails_whole(type(self.model).__name__, error),
                backend,
                after_a_step=True,
            )
        except UnsupportedTrainingSetupError as refused:
            raise refused from error
        return 1

    def collect_garbage_once(self):
        """Collects Python's garbage before the first batch this guard measures.

        Garbage from before it (a failed step's tensors, held in reference
        cycles) would otherwise be freed whenever the cycle collector runs,
        perhaps during a measured step, and make its demand read low. Once
        per guard, and only where the memory in use (which holds any such
        garbage) is at least `GARBAGE_SHARE` of the limit: a full
        collection takes a while in a process that holds a large model,
        and less than that cannot move a reading by more than the
        threshold's headroom can take. Call after `resolve_limits`.
        """
        if self._collected:
            return
        limit = self.smallest_limit if any(self.limits) else None
        in_use = max(
            (sample.current_bytes for sample in self.read() if sample.current_bytes is not None),
            default=None,
        )
        if limit is not None and in_use is not None and in_use < GARBAGE_SHARE * limit:
            return
        self._collected = True
        gc.collect()

    def resolve_limits(self):
        """Reads the limit of each device into `limits`.

        Returns:
            The limits, a list of bytes (or `None`) per device.

        Raises:
            MemoryLimitUnknownError: If no device's limit is known.
        """
        probe = self.reader.probe
        limits = resolve_limits(probe, self.options.memory_limit)
        if not any(limits):
            raise MemoryLimitUnknownError(
                messages.memory_limit_unknown(probe.devices, keras.backend.backend())
            )
        self.limits = limits
        return limits

    @property
    def smallest_limit(self):
        """The smallest known limit in `limits`: the one planned against."""
        return min(limit for limit in self.limits if limit)

    @property
    def probe(self):
        """The reader's memory probe."""
        return self.reader.probe

    def read(self, key=None):
        """The reader's samples for this session (see `SharedAllocatorReader.read`).

        Args:
            key: Identifies the batch read (a carrier's `batch_key`), or
                `None` for a reading of its own, which resets the peaks.
                Defaults to `None`.

        Returns:
            A tuple of `AllocatorSample`, one per device.
        """
        return self.reader.read(self, key)

    def read_aside(self):
        """A reading whose peak is no consumer's (see `SharedAllocatorReader.read_aside`).

        Returns:
            A tuple of `AllocatorSample`, one per device.
        """
        return self.reader.read_aside()

    def reset_peaks(self):
        """Resets the allocator peaks (see `SharedAllocatorReader.reset`)."""
        self.reader.reset()

    # The decider's state.

    @property
    def micro_batches(self):
        """The number of micro-batches each training batch is split into now."""
        return self.controller.state.micro_batches

    @property
    def eval_micro_batches(self):
        """The number of slices each validation batch is evaluated in now."""
        return self.controller.state.eval_micro_batches

    @property
    def started(self):
        """Whether the controller was started (`start`) for training."""
        return self._started

    @property
    def has_restored_state(self):
        """Whether `load_state` found a state saved under `backup_dir`."""
        return self._restored

    def start(self, limit_bytes, fixed_bytes=0.0, sample_bytes=0.0, state=None):
        """Starts the controller for training (`GuardController.start`) and marks it started."""
        self.controller.start(limit_bytes, fixed_bytes, sample_bytes, state)
        self._started = True

    def begin_fit(self, model):
        """Starts the memory model over where the step changed since the last `fit`.

        What the decider learned describes the step of the `fit` it came
        from. A fine-tuning's second `fit`, after a base model frozen for the
        first is made trainable and the model compiled again, runs a step
        that holds gradients and optimizer updates for the base too; planned
        from the first `fit`'s readings it runs out of memory. So where the
        trainable weights, the layers' dtype policies, the optimizer's class
        or `jit_compile` changed, the readings are dropped and the next batch
        plans as the first of a run does (from the plan cache entry of the
        new set-up, where there is one); what was learned stays in the cache
        under the old set-up.
        The micro-batch count in force and the error counts are kept.
        """
        signature = _trained_step(model)
        changed = self._trained_step is not None and signature != self._trained_step
        self._trained_step = signature
        if changed and self._started and self.options.plan and not self._restored:
            self.plan_anew()
            self._started = False

    def plan_anew(self):
        """The step changed: what was learned is cached, and the memory model starts over.

        Where the guard plans, the state is kept in the plan cache under the
        set-up it was learned for, no later figure is cached under it, and
        the decider's readings are dropped (the count in force is kept).
        """
        if self.options.plan:
            self.save_plan()
            self.controller.plan_key = None
            self.controller.restart_model()

    def react_where_unreadable(self):
        """Reacts to errors instead of planning where the memory cannot be read.

        Planning needs the memory in use before a batch and its peak after.
        A device that keeps no statistics (TensorFlow's default CPU
        allocator with oneDNN off; PyTorch's host memory without `/proc`)
        gives neither, and the first batch's cautious split would hold for
        the whole run with nothing to learn from: a step unlike plain
        `fit`'s (BatchNormalization's statistics, an embedding's rows under
        Adam), and slower. Where every device planned against is such a
        device, the guard stops planning (`stop_planning`), once, with a
        warning: batches train whole (or at the `micro_batches` asked for)
        until one runs out of memory.
        """
        if not (self.config.predictive and self.options.plan):
            return
        probe = self.probe
        smallest = self.smallest_limit
        planned = [d for d, limit in zip(probe.devices, self.limits) if limit == smallest]
        if planned and all(probe.device_mode(d) == "unavailable" for d in planned):
            self.stop_planning()
            count = self.controller.state.micro_batches
            logger.warning("%s", messages.unreadable_whole_batches(planned, count))

    def start_unless_planning(self, start):
        """Calls `start()` at a run's beginning where no plan hook will.

        Not started yet: checks first whether the memory can be read
        (`react_where_unreadable`); where the guard then does not plan, no
        plan hook starts the session before the first batch, so `start`
        (the run's own `start` with what it knows now) does. Planning runs
        start from their first plan instead, with the batch in hand.

        Args:
            start: A function of no arguments that starts this session.
        """
        if self.started:
            return
        self.react_where_unreadable()
        if not self.config.predictive:
            start()

    def stop_planning(self):
        """Reacts to each batch's peak from now on instead of planning it.

        The configuration stops predicting (`evaluate`'s and `predict`'s
        too, where training's differs from theirs); without a restored
        state, the decider starts again from `options.micro_batches`, as a
        guard made with `plan=False` would.
        """
        self.config = self.config._replace(predictive=False)
        self.controller.config = self.config
        if self._inference_config is not None:
            self._inference_config = self._inference_config._replace(predictive=False)
        if not self._restored:
            self.controller.state = decider.init(self.config, self.options.micro_batches)

    def advance(self, steps):
        """Counts `steps` more training steps, and says what waited for one."""
        self.step += steps
        if self._unsaid_warning is not None:
            logger.warning("%s", self._unsaid_warning)
            self._unsaid_warning = None

    def save_state(self):
        """Saves the controller's state and the step under `backup_dir`."""
        self.controller.save_state(self.step, self._backup_setup())

    def load_state(self):
        """Goes on from the state saved under `backup_dir`, if any, and if
        it was saved while training the same step (`_trained_step`)."""
        step = self.controller.load_state(self._backup_setup())
        if step is not None:
            self.step = step
            self._restored = True

    def _backup_setup(self):
        # The trained step's signature as JSON reads it back (lists); none
        # for a model not built yet (built from its first batch), whose
        # weights cannot tell.
        if self.model is None or not self.model.trainable_variables:
            return None
        return json.loads(json.dumps(_trained_step(self.model)))

    def save_plan(self):
        """Keeps what was learned in the plan cache, when planning and started."""
        if self.options.plan and self._started:
            self.controller.save_plan()

    def inference_controller(self, kind):
        """The controller of `evaluate` or `predict`, made on first use.

        Args:
            kind: `"evaluate"` or `"predict"`.

        Returns:
            A `GuardController` kept for the session's life.
        """
        controller = self._inference_controllers.get(kind)
        if controller is None:
            config = self._inference_config or self.config
            controller = self._inference_controllers[kind] = GuardController(config)
        return controller

    def inference_oom_count(self, kind):
        """How many times `kind` ran out of memory and went on in slices."""
        controller = self._inference_controllers.get(kind)
        return controller.state.oom_count if controller is not None else 0

    # What is written.

    def write_scalars(self, micro_batch_size):
        """Queues the batch's row of scalars, where there is a writer.

        Args:
            micro_batch_size: Samples in one micro-batch, or `None`.
        """
        if self.writer is None:
            return
        state = self.controller.state
        row = (state.micro_batches, micro_batch_size, state.oom_count, self.config.threshold)
        self.writer.write_values(self.step, SCALAR_TAGS, row)

    def capture_dumps(self, new=True):
        """Captures the allocator's dumps, which explain out-of-memory errors.

        Args:
            new: Start a new capture in place of the current one (`True`),
                or keep a capture already running. Defaults to `True`.
        """
        if new or self._dumps is None:
            self._dumps = oom_explanation.MemoryDumpCapture()

    def take_latest_dump(self):
        """The newest allocator dump since the last call, parsed, or `None`."""
        return self._dumps.take_latest() if self._dumps is not None else None

    def close_dumps(self):
        """Stops capturing dumps and removes the temporary ones."""
        if self._dumps is not None:
            self._dumps.close()
            self._dumps = None


def _trained_step(model):
    """What sets a model's training step apart: its trainable weights, the
    dtypes its layers compute in, its optimizer and XLA."""
    return (
        tuple((tuple(v.shape), str(v.dtype)) for v in model.trainable_variables),
        tuple(compat.dtype_policies(model)),
        type(getattr(model, "optimizer", None)).__name__,
        bool(getattr(model, "jit_compile", False)),
    )
