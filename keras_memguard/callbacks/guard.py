"""MemoryGuard: micro-batch before memory runs out, replay a batch that did."""

import json
import logging
import os

import keras

from keras_memguard import oom_explanation
from keras_memguard import plan_cache
from keras_memguard import planner
from keras_memguard import policy
from keras_memguard.callbacks import logs_carrier
from keras_memguard.callbacks.sampling import resolve_limits
from keras_memguard.callbacks.sampling import shared_reader
from keras_memguard.errors import MemoryLimitUnknownError
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.errors import UnsupportedTrainingSetupError
from keras_memguard.probes import region
from keras_memguard.probes.tf_allocator import AllocatorProbe
from keras_memguard.probes.tf_allocator import cpu_bfc_limit_bytes
from keras_memguard.sinks import tensorboard as tb
from keras_memguard.training import compat
from keras_memguard.training import multi_worker
from keras_memguard.training import remat
from keras_memguard.training.eval_replay import ReplayTestFunction
from keras_memguard.training.mixin import MemGuardMixin
from keras_memguard.training.replay import ReplayTrainFunction
from keras_memguard.training.setup import describe_setup
from keras_memguard.training.splitting import validate_micro_batches

logger = logging.getLogger("keras_memguard")

MODES = ("accumulate", "shrink")
# Opt-in rungs past one sample per micro-batch (see `training/remat.py`).
RUNGS = (remat.RUNG,)
MICRO_BATCHES_LOG_KEY = "micro_batches"
STATE_FILE = "memguard_state.json"
_MIB = 1024 * 1024
# The scalars written per batch, in `_write_scalars`' order; the threshold
# draws its line in the dashboard's usage chart.
_SCALAR_TAGS = (tb.MICRO_BATCHES, tb.MICRO_BATCH_SIZE, tb.OOM_RECOVERIES, tb.THRESHOLD)


class MemoryGuard(keras.callbacks.Callback):
    """Splits batches into micro-batches before device memory runs out.

    The guard pulls each training batch before it runs and plans it: from
    the peaks measured so far (the highest memory in use during each batch,
    against the device memory limit) it predicts the batch's peak at each
    micro-batch count `k`, taking the batch's size and shapes into account
    (a sequence twice as long counts twice), and runs it at the smallest `k`
    predicted to stay under `threshold` (any count, not only powers of two).
    The first batch of a set-up it has never seen runs at 8 micro-batches
    (or `micro_batches`, when given); the plan grows from the measurements.
    What it learned is kept in a small JSON file under
    `$KERAS_HOME/memguard/` (`~/.keras/memguard/` by default), so the next
    `fit` of the same set-up starts at the right `k` (`plan_cache=False`
    turns that off). See `keras_memguard.planner` for the memory model.

    With `plan=False`, or under `MultiWorkerMirroredStrategy` (where the
    workers must agree), the guard reacts instead: at or above `threshold`
    it doubles `k` before the next batch; once the usage predicted at
    `k / 2` has stayed below `release` for `cooldown` batches, it halves `k`
    again. The input pipeline, the number of steps and the progress bar stay
    as they are: each batch is split inside the train step.

    In `"accumulate"` mode the gradients of the `k` micro-batches are summed,
    weighted by each one's share of the samples, and applied once: the update
    is the one the whole batch would give. In `"shrink"` mode every
    micro-batch is its own update (a smaller effective batch).

    A batch that still runs out of memory (`tf.errors.ResourceExhaustedError`)
    is run again with twice the micro-batches, as often as needed: no sample
    is skipped and nothing is applied twice. When a micro-batch of one sample
    does not fit, `MicroBatchTooLargeError` is raised. Every other exception
    passes through untouched.

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
    slice count (`eval_micro_batches`) doubles per error and stays for the
    next validations; training's `k`, its policy and `oom_recoveries` are
    left alone.

    With `escalate=("remat",)`, a batch that does not fit at one sample per
    micro-batch is run with the forward pass in recomputed segments
    (`keras_memguard.training.remat`); `rungs_on` lists the rungs switched
    on.

    `k` and the counters persist across epochs and `fit` calls. To resume them
    with `keras.callbacks.BackupAndRestore`, give both the same directory.

    Args:
        threshold: Peak usage (peak / limit) at or above which `k` doubles,
            in (0, 1]. Defaults to `0.9`.
        release: Predicted usage below which `k` may halve, in (0, 1) and
            below `threshold`. `None` means `threshold - 0.2` (half the
            threshold for thresholds up to 0.4). Defaults to `None`.
        mode: `"accumulate"` or `"shrink"`. Defaults to `"accumulate"`.
        max_micro_batches: The largest `k` allowed, or `None` for no cap
            other than the batch size. Defaults to `None`.
        cooldown: Batches the predicted usage must stay below `release`, and
            the least number of batches between two usage-driven changes,
            before `k` halves. Defaults to `20`.
        micro_batches: The number of micro-batches to start with, when the
            guard has no saved state (from an earlier `fit` or from
            `backup_dir`): with `plan=True`, the first batch's split when
            nothing is known (`1` means the default cautious split of 8);
            with `plan=False`, the count until the policy changes it.
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
            policy). Defaults to `True`.
        plan_cache: Keep what the planner learned in
            `$KERAS_HOME/memguard/` and start the next `fit` of the same
            set-up from it. A corrupt or foreign file there is ignored with
            one warning. Defaults to `True`.
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
            chains without dropout or BatchNormalization; measured 1.04x
            to 1.20x the step time and a quarter less memory on the CPU
            stand-in (`bench/RESULTS.md`). The rung is switched on before
            the batch when the planner predicts that one sample does not
            fit (from the plan cache, after an earlier run), else after the
            batch ran out of memory at one sample, which is then replayed.
            A model the rung cannot work on is named in the error.
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
        self.config = policy.make_config(
            threshold=threshold,
            release=release,
            cooldown=cooldown,
            max_micro_batches=max_micro_batches,
        )
        if mode not in MODES:
            raise ValueError(
                f"`mode` must be one of {MODES}. Received: mode={mode!r}"
            )
        if not isinstance(scale_learning_rate, bool):
            raise ValueError(
                "`scale_learning_rate` must be True or False. "
                f"Received: scale_learning_rate={scale_learning_rate!r}"
            )
        self.mode = mode
        for name, value in (
            ("plan", plan),
            ("plan_cache", plan_cache),
            ("reserve_memory", reserve_memory),
        ):
            if not isinstance(value, bool):
                raise ValueError(
                    f"`{name}` must be True or False. Received: {name}={value!r}"
                )
        self.plan = plan
        self.plan_cache = plan_cache
        self.reserve_memory = reserve_memory
        if isinstance(escalate, str) or not isinstance(escalate, (tuple, list)) or any(
            rung not in RUNGS for rung in escalate
        ):
            raise ValueError(
                f"`escalate` must be a tuple of rung names from {RUNGS}. "
                f"Received: escalate={escalate!r}"
            )
        self.escalate = tuple(escalate)
        # The rungs switched on, and those refused with why (each rung is
        # tried once), for `MicroBatchTooLargeError`'s message.
        self.rungs_on = ()
        self._rungs_refused = {}
        self.planner_config = planner.make_planner_config(
            threshold=threshold,
            first_split=micro_batches if micro_batches > 1 else 8,
            max_micro_batches=max_micro_batches,
        )
        self.planner_state = None
        self._planning = False
        self._plan_key = None
        self._plan_fields = None
        self._plan_limit = None
        # The last plan and what it was planned from (see `_plan_batch`).
        self._last_plan = None
        if memory_limit is not None:
            AllocatorProbe(memory_limit=memory_limit)  # validates it
        self.memory_limit = memory_limit
        self.scale_learning_rate = scale_learning_rate
        self.log_dir = log_dir
        self.backup_dir = backup_dir
        validate_micro_batches(micro_batches)
        if max_micro_batches is not None and micro_batches > max_micro_batches:
            raise ValueError(
                "`micro_batches` must not exceed `max_micro_batches`. Received: "
                f"micro_batches={micro_batches}, max_micro_batches={max_micro_batches}"
            )
        self.state = policy.init_state(micro_batches)
        self._writer = tb.writer_for(log_dir) if log_dir is not None else None
        self._reader = None
        self._function = None
        self._carrier = None
        self._previous_inner = None
        # Whether the carrier ran this batch's bookkeeping already.
        self._contributed = False
        # Evaluation has its own micro-batch count and counter: an
        # evaluation batch says nothing about a training step's memory.
        self._eval_function = None
        self.eval_state = policy.init_eval_state()
        self._base_learning_rate = None
        self._multi_worker = False
        self._step = 0
        self._last_batch = -1
        self._dumps = None
        self.last_oom_explanation = None

    @property
    def micro_batches(self):
        """The number of micro-batches each batch is split into now."""
        return self.state.micro_batches

    @property
    def oom_recoveries(self):
        """How many batches were replayed after an out-of-memory error."""
        return self.state.oom_count

    @property
    def eval_micro_batches(self):
        """The number of slices each validation batch is evaluated in now."""
        return self.eval_state.micro_batches

    @property
    def eval_oom_recoveries(self):
        """How many times validation ran out of memory and went on in slices."""
        return self.eval_state.oom_count

    def set_model(self, model):
        super().set_model(model)
        self._reader = shared_reader(model)
        self._reader.register(self, self.memory_limit)

    def on_train_begin(self, logs=None):
        model = self.model
        self._check_model(model)
        self._limits = self._resolve_limits()
        self._load_state()
        self._multi_worker = multi_worker.is_multi_worker(model.distribute_strategy)
        carrier = logs_carrier.current(model)
        if self._multi_worker:
            # Makes Keras' symbolic build and log reduction work across
            # workers; resets the train and test functions.
            multi_worker.prepare_multi_worker(model)
            logs_carrier.reinstall(model, carrier, model.train_function)
        function_class = (
            multi_worker.MultiWorkerTrainFunction
            if self._multi_worker
            else ReplayTrainFunction
        )
        # Several workers decide together from agreed numbers (the policy);
        # one worker plans each batch before it runs.
        self._planning = self.plan and not self._multi_worker
        if self.reserve_memory and (self._planning or self.escalate):
            # A rung climbed after an out-of-memory error needs it too: in a
            # grown allocator the error leaves no piece large enough.
            self._reserve_regions()
        options = {"plan": self._plan_batch} if self._planning else {}
        self._function = function_class(
            model,
            micro_batches=self.state.micro_batches,
            mode=self.mode,
            on_out_of_memory=self._on_out_of_memory,
            **options,
        )
        # The guard's function trains inside the model's logs carrier.
        self._carrier = logs_carrier.attach(model, self, self._contribute, self.params)
        self._previous_inner = self._carrier.inner
        self._carrier.inner = self._function
        self._contributed = False
        self._apply(self.state.micro_batches)
        # The allocator's dump at an out-of-memory error explains it.
        self._dumps = oom_explanation.MemoryDumpCapture()
        self._reader.reset()
        if self._writer is not None:
            self._writer.acquire(self)

    def on_train_end(self, logs=None):
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

    def _contribute(self, logs):
        """Decides after each train function call; adds `micro_batches`.

        Called by the model's `LogsCarrier` before Keras hands the logs to
        the callbacks, so every callback sees the value.
        """
        # The batch number Keras 3.15 passes to on_train_batch_end: the
        # execution's last step.
        steps = self.model.steps_per_execution or 1
        self._after_batch(self._last_batch + steps, logs, self._carrier.batch_key)
        self._contributed = True

    def on_train_batch_end(self, batch, logs=None):
        if self._contributed:
            self._contributed = False
            return
        # No carrier (the train function was replaced after on_train_begin).
        self._after_batch(batch, logs, (id(logs), batch))

    def _after_batch(self, batch, logs, key):
        """Reads the batch's peak, asks the policy, applies its decision."""
        self._step += batch - self._last_batch
        self._last_batch = batch
        samples = self._reader.read(self, key)
        usage = None
        limit = None
        for sample, device_limit in zip(samples, self._limits):
            peak = sample.peak_bytes
            if peak is None or not device_limit:
                continue
            device_usage = peak / device_limit
            if usage is None or device_usage > usage:
                usage, limit = device_usage, device_limit
        if self._planning:
            self._observe(samples, usage, limit)
        else:
            self._decide(usage, limit)
        if logs is not None:
            logs[MICRO_BATCHES_LOG_KEY] = self.state.micro_batches
        if self._writer is not None:
            self._write_scalars()

    def _decide(self, usage, limit):
        """The reactive policy: the next batch's `k` from this one's peak."""
        if self._multi_worker:
            # The same decision at the same step on every worker.
            usage, _ = multi_worker.agree_on_usage(self.model.distribute_strategy, usage)
        decision, self.state = policy.decide(
            self.config,
            self.state,
            usage,
            largest_batch_size=self._function.largest_replica_batch_size or None,
        )
        if decision.changed:
            self._announce(decision, limit)
            self._apply(decision.micro_batches)
            self._save_state()

    # Planning.

    def _observe(self, samples, usage, limit):
        """Gives the planner the peak of the batch that just ran.

        A reading that teaches the planner nothing new leaves
        `planner_state` the same object, so the next plan is reused.
        """
        work = self._function.last_work
        if usage is None or work is None or self.planner_state is None:
            return
        current = None
        for sample, device_limit in zip(samples, self._limits):
            device_current = sample.current_bytes
            if device_limit == limit and device_current is not None:
                current = max(current or 0, device_current)
        self.planner_state = planner.observe(
            self.planner_config,
            self.planner_state,
            work,
            limit,
            usage * limit,
            current_bytes=current,
        )

    def _reserve_regions(self):
        """One free region for the rest of each CPU BFC allocator's limit."""
        probe = self._reader.probe
        limit = cpu_bfc_limit_bytes()
        if limit is None:
            return
        for device in probe.devices:
            if probe.device_mode(device) == "bfc":
                region.reserve_region(device, limit)

    def _plan_batch(self, batch_size, sample_size, data):
        """Plans the micro-batch count of the batch about to run."""
        if self.planner_state is None:
            self._start_planner(data)
        # The planner is pure over immutable values: while the state is the
        # same object (no new reading, no out-of-memory error) and the batch
        # the same shape, the count is the same. The reason's text is built
        # only for a change.
        config = self.planner_config
        state = self.planner_state
        key = (batch_size, sample_size, self._plan_limit)
        last = self._last_plan
        if last is not None and last[0] is state and last[1] is config and last[2] == key:
            k = last[3]
        else:
            k = planner.planned_micro_batches(config, state, *key)
            self._last_plan = (state, config, key, k)
        if (
            k >= batch_size
            and self.escalate
            and not planner.one_sample_fits(config, state, sample_size, self._plan_limit)
            and self._climb(
                "one sample per micro-batch is predicted not to fit a batch of "
                f"{batch_size}"
            )
        ):
            return self._plan_batch(batch_size, sample_size, data)
        if k != self.state.micro_batches:
            decided = planner.plan(config, state, *key)
            logger.info(
                "planned k=%d for batch %d: %s (micro-batch %d)",
                k,
                batch_size,
                decided.reason,
                -(-batch_size // k),
            )
            self.state = self.state._replace(
                micro_batches=k, batches_since_change=0, calm_batches=0
            )
            self._apply(k)
        return k

    def _start_planner(self, data):
        """Starts the planner, from the plan cache when it has this set-up."""
        self._plan_limit = min(l for l in self._limits if l)
        state = None
        if self.plan_cache:
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
        self.planner_state = state or planner.init_planner_state(
            limit_bytes=self._plan_limit
        )

    def _save_plan(self):
        if self._planning and self._plan_key and self.planner_state is not None:
            plan_cache.save(self._plan_key, self._plan_fields, self.planner_state)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs[MICRO_BATCHES_LOG_KEY] = self.state.micro_batches
        self._save_state()
        self._save_plan()
        if self._writer is not None:
            self._writer.flush()

    def on_test_begin(self, logs=None):
        # Only `fit`'s validation (the train function is installed then);
        # `model.evaluate(callbacks=[guard])` runs as Keras runs it. Several
        # replicas: Keras' own test function (slices are cut in Python).
        if self._function is None or not ReplayTestFunction.supports(self.model):
            return
        self._eval_function = ReplayTestFunction(
            self.model,
            micro_batches=self.eval_state.micro_batches,
            on_out_of_memory=self._on_eval_out_of_memory,
        )
        self._eval_function.install()

    def on_test_end(self, logs=None):
        if self._function is None:
            return
        self._restore_test_function()
        # Validation's peak must not count as the next training batch's.
        self._reader.reset()

    # The out-of-memory replay.

    def _on_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the micro-batch count to replay a batch with, or raises."""
        # Each replica splits its own part of the (global) batch.
        replica_batch_size = self._function.last_replica_batch_size or batch_size
        decision, state = policy.on_out_of_memory(
            self.config,
            self.state._replace(micro_batches=micro_batches),
            replica_batch_size or None,
        )
        explanation = self._explain(error, replica_batch_size, micro_batches)
        if decision.cannot_split == policy.CANNOT_SPLIT_BATCH_SIZE and self.escalate:
            self._learn_out_of_memory()
            climbed = self._climb(
                f"batch {batch_size} ran out of memory at one sample per micro-batch"
            )
        else:
            climbed = False
        if climbed:
            self.state = self.state._replace(oom_count=self.state.oom_count + 1)
            self._report(explanation._replace(replayed_with=micro_batches))
            self._save_state()
            return micro_batches
        if decision.cannot_split:
            self._report(explanation)
            raise self._cannot_split_error(
                decision,
                batch_size,
                micro_batches,
                cap_text=(
                    f"Out of memory at {micro_batches} micro-batches, the cap set "
                    f"by `max_micro_batches`; the batch of {batch_size} samples "
                    "cannot be split further. HINT: raise `max_micro_batches` or "
                    "lower the batch size."
                ),
            ) from error
        new_k = decision.micro_batches
        if self._planning and self.planner_state is not None:
            new_k = self._replan_after_out_of_memory(
                replica_batch_size, micro_batches, new_k, explanation
            )
            state = state._replace(micro_batches=new_k)
        self.state = state
        self._report(explanation._replace(replayed_with=new_k))
        logger.info(
            "out of memory at %d micro-batch%s of a batch of %d: replaying it "
            "with %d micro-batches (micro-batch %s)",
            micro_batches,
            "" if micro_batches == 1 else "es",
            batch_size,
            new_k,
            self._micro_batch_text(new_k),
        )
        self._apply(new_k)
        self._save_state()
        self._save_plan()
        return new_k

    def _learn_out_of_memory(self, largest_fitting_fraction=None):
        """The planner learns that the last batch's micro-batch failed."""
        work = self._function.last_work
        if self._planning and self.planner_state is not None and work is not None:
            self.planner_state = planner.observe_out_of_memory(
                self.planner_config,
                self.planner_state,
                work,
                self._plan_limit,
                largest_fitting_work=(
                    None
                    if largest_fitting_fraction is None
                    else work * largest_fitting_fraction
                ),
            )

    def _replan_after_out_of_memory(self, batch_size, failed_k, doubled_k, explanation):
        """The planner learns the failure and plans the replay."""
        function = self._function
        if function.last_work is None or not batch_size:
            return doubled_k
        self._learn_out_of_memory(explanation.fitting_fraction)
        replanned = planner.plan(
            self.planner_config,
            self.planner_state,
            batch_size,
            function.last_sample_size,
            self._plan_limit,
        ).micro_batches
        # Never the count that failed, nor fewer; within the policy's cap.
        new_k = max(replanned, failed_k + 1)
        cap = self.config.max_micro_batches
        return min(new_k, batch_size, cap or new_k)

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
            replay = policy.micro_batches_text(explanation.replayed_with)
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

    def _on_eval_out_of_memory(self, batch_size, micro_batches, error):
        """Chooses the slice count to go on evaluating with, or raises.

        Only evaluation's count changes; training's `k`, the policy state
        and `oom_recoveries` stay as they are.
        """
        decision, eval_state = policy.on_eval_out_of_memory(
            self.config,
            self.eval_state._replace(micro_batches=micro_batches),
            batch_size or None,
        )
        if decision.cannot_split:
            raise self._cannot_split_error(
                decision,
                batch_size,
                micro_batches,
                cap_text=(
                    f"Out of memory evaluating at {micro_batches} micro-batches, "
                    "the cap set by `max_micro_batches`; the validation batch of "
                    f"{batch_size} samples cannot be split further. HINT: raise "
                    "`max_micro_batches` or lower `validation_batch_size`."
                ),
                prefix="Validation: ",
            ) from error
        self.eval_state = eval_state
        new_k = eval_state.micro_batches
        done = self._eval_function.samples_done if self._eval_function else 0
        logger.info(
            "out of memory evaluating a validation batch of %d at %d "
            "micro-batch%s: going on from sample %d with %d micro-batches "
            "(micro-batch %d); training keeps %d micro-batch%s",
            batch_size,
            micro_batches,
            "" if micro_batches == 1 else "es",
            done,
            new_k,
            -(-batch_size // new_k),
            self.state.micro_batches,
            "" if self.state.micro_batches == 1 else "es",
        )
        self._save_state()
        return new_k

    # Escalation.

    def _climb(self, why):
        """Switches on the next rung of `escalate`; whether one was."""
        model = self.model
        for rung in self.escalate:
            if rung in self.rungs_on or rung in self._rungs_refused:
                continue
            reason = remat.can_remat(model)
            if reason is not None:
                self._rungs_refused[rung] = reason
                continue
            segments = remat.switch_on(model)
            self.rungs_on += (rung,)
            logger.info(
                "rung %r on: %s; the forward pass now runs in %d recomputed "
                "segments of up to %d layers",
                rung,
                why,
                segments,
                remat.SEGMENT_LAYERS,
            )
            if self._planning:
                # What was learned holds for the step without the rung: kept
                # in the cache (a next run climbs before its first batch),
                # and the planner starts over for the step with it.
                self._save_plan()
                self._plan_key = None
                self.planner_state = planner.init_planner_state(
                    limit_bytes=self._plan_limit
                )
                self._last_plan = None
            return True
        return False

    # Helpers.

    def _cannot_split_error(self, decision, batch_size, micro_batches, cap_text, prefix=""):
        """The `MicroBatchTooLargeError` for a batch the policy cannot split."""
        samples = self._reader.read(self, None)
        peak = max((s.peak_bytes or 0 for s in samples), default=0) or None
        limit = max((l or 0 for l in self._limits), default=0) or None
        if decision.cannot_split == policy.CANNOT_SPLIT_BATCH_SIZE:
            tried = self.rungs_on + tuple(
                f"{rung} (not possible: {reason})"
                for rung, reason in self._rungs_refused.items()
            )
            message = _too_large_message(
                batch_size, micro_batches, peak, limit, self.escalate, tried
            )
        else:
            message = cap_text
        return MicroBatchTooLargeError(
            prefix + message, peak_bytes=peak, limit_bytes=limit
        )

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
            raise UnsupportedTrainingSetupError(
                f"MemoryGuard cannot micro-batch {type(model).__name__}: its own "
                "`train_step` does not use keras_memguard's machinery. HINT: "
                "mix `keras_memguard.MemGuardMixin` into the class "
                f"(`class {type(model).__name__}(MemGuardMixin, ...)`) and build "
                "the override on `self.accumulate_gradients(...)`."
            )

    def _resolve_limits(self):
        probe = self._reader.probe
        limits = resolve_limits(probe, self.memory_limit)
        if not any(limits):
            raise MemoryLimitUnknownError(
                "MemoryGuard cannot tell how close training is to running out of "
                f"memory: no memory limit is known for {', '.join(probe.devices)}. "
                "HINT: pass `memory_limit=<bytes>` to MemoryGuard, configure a "
                "logical device with a `memory_limit` "
                "(tf.config.set_logical_device_configuration), or on the CPU set "
                "TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB "
                "before TensorFlow is imported."
            )
        return limits

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
            raise UnsupportedTrainingSetupError(
                "`scale_learning_rate=True` needs a float learning rate; this "
                "optimizer uses a schedule. HINT: scale the schedule yourself "
                "or pass scale_learning_rate=False."
            )
        if self._base_learning_rate is None:
            self._base_learning_rate = float(learning_rate)
        self.model.optimizer.learning_rate.assign(self._base_learning_rate / micro_batches)

    def _restore_learning_rate(self):
        if self._base_learning_rate is not None:
            self.model.optimizer.learning_rate.assign(self._base_learning_rate)
            self._base_learning_rate = None

    def _micro_batch_size(self, micro_batches):
        """Samples in one micro-batch of one replica, or `None`."""
        function = self._function
        size = function.last_replica_batch_size if function else None
        return -(-size // micro_batches) if size else None

    def _micro_batch_text(self, micro_batches):
        size = self._micro_batch_size(micro_batches)
        function = self._function
        if function and function.last_replica_batch_size != function.last_batch_size:
            return f"{size} per replica"
        return f"{size}"

    def _announce(self, decision, limit):
        reason = decision.reason
        if decision.action == "increase" and decision.usage is not None and limit:
            reason = (
                f"peak {decision.usage:.0%} of {limit / _MIB:.0f} MiB "
                f">= {self.config.threshold:.0%}"
            )
        micro = ""
        if self._micro_batch_size(decision.micro_batches):
            micro = f" (micro-batch {self._micro_batch_text(decision.micro_batches)})"
        logger.info(
            "%s: micro-batches %d -> %d%s",
            reason,
            decision.previous_micro_batches,
            decision.micro_batches,
            micro,
        )

    def _write_scalars(self):
        """Queues the batch's row; the writer's thread encodes it."""
        state = self.state
        k = state.micro_batches
        function = self._function
        size = function.last_replica_batch_size if function else None
        self._writer.write_values(
            self._step,
            _SCALAR_TAGS,
            (
                k,
                -(-size // k) if size else None,  # `_micro_batch_size(k)`
                state.oom_count,
                self.config.threshold,
            ),
        )

    def _state_path(self):
        return os.path.join(self.backup_dir, STATE_FILE)

    def _save_state(self):
        if self.backup_dir is None:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        payload = {
            "policy": policy.state_to_dict(self.state),
            "step": self._step,
            "eval": {
                "micro_batches": self.eval_state.micro_batches,
                "oom_count": self.eval_state.oom_count,
            },
        }
        if self.planner_state is not None:
            payload["planner"] = planner.planner_state_to_dict(self.planner_state)
        tmp = self._state_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, self._state_path())

    def _load_state(self):
        if self.backup_dir is None or not os.path.exists(self._state_path()):
            return
        with open(self._state_path()) as f:
            payload = json.load(f)
        self.state = policy.state_from_dict(payload["policy"])
        self._step = payload.get("step", self._step)
        if payload.get("planner") is not None:
            self.planner_state = planner.planner_state_from_dict(payload["planner"])
        evaluation = payload.get("eval") or {}
        self.eval_state = policy.init_eval_state(
            int(evaluation.get("micro_batches", 1)),
            int(evaluation.get("oom_count", 0)),
        )


def _too_large_message(batch_size, micro_batches, peak, limit, escalate=(), rungs_tried=()):
    peak_text = f"{peak / _MIB:.1f} MiB" if peak else "unknown"
    limit_text = f"{limit / _MIB:.1f} MiB" if limit else "unknown"
    counted = policy.micro_batches_text(micro_batches)
    tried = f" Tried: {counted} of one sample"
    if rungs_tried:
        tried += f", then the rungs: {', '.join(rungs_tried)}."
    elif escalate:
        tried += "."
    else:
        tried += (
            "; no rung was allowed. HINT: `MemoryGuard(escalate=(\"remat\",))` "
            "recomputes activations in the backward pass instead of keeping them."
        )
    return (
        f"A micro-batch of a single sample does not fit in device memory: the "
        f"batch of {batch_size} sample{'' if batch_size == 1 else 's'} ran out of "
        f"memory even at {counted}. Measured peak before the failure: "
        f"{peak_text}; memory limit: {limit_text}.{tried} HINT: use mixed precision "
        "(keras.mixed_precision.set_global_policy('mixed_float16')), a smaller "
        "model or input size, or a device with more memory (a larger memory "
        "limit)."
    )
