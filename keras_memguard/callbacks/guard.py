"""MemoryGuard: micro-batch before memory runs out, replay a batch that did.

The callback is glue: Keras' hooks hand each `fit` to its backend's run
(`keras_memguard.backends.current()`, picked once as Keras picks its
trainer) and each `evaluate` or `predict` to an inference run; the
decisions are the controller's (`controller.py`, over the pure decider),
the words are in `messages.py` and `oom_report.py`. What outlives one
call (the controller, the step count, the writer, the reader) is in the
guard's `GuardSession` (`session.py`), which each run is handed.
"""

import keras

from keras_memguard import backends
from keras_memguard import keras_models
from keras_memguard.callbacks import copies
from keras_memguard.callbacks import guard_options
from keras_memguard.callbacks import inference
from keras_memguard.callbacks.session import GuardOptions
from keras_memguard.callbacks.session import GuardSession
from keras_memguard.sinks import tensorboard as tb

MICRO_BATCHES_LOG_KEY = "micro_batches"


class MemoryGuard(keras.callbacks.Callback):
    """Splits batches into micro-batches before device memory runs out.

    Before each training batch, the guard reads the memory in use and
    predicts the step's peak at each micro-batch count `k` from the batches
    it has seen; the batch runs at the smallest `k` whose predicted peak
    stays under `threshold` of the device's memory limit. In `"accumulate"`
    mode the micro-batches' gradients are summed and applied once: the
    update is the one the whole batch would give. A batch that still runs
    out of memory is replayed with smaller micro-batches, with no sample
    skipped and nothing applied twice; when one sample per micro-batch does
    not fit (or the failed allocation does not shrink with the micro-batch),
    `MicroBatchTooLargeError` is raised. Validation, `evaluate` and
    `predict` batches that run out of memory are run again in slices. Every
    other exception passes through untouched.

    Sequential and functional models need no change, and models that mix in
    `MemGuardMixin` keep their own `train_step`; the model's class is never
    changed, so saving and loading work as usual. The guard adds
    `micro_batches` to the batch and epoch `logs`; with `log_dir` it writes
    TensorBoard scalars to `<log_dir>/memguard` and explains each
    out-of-memory error there. `k` and the counters persist across epochs
    and `fit` calls, and what the guard learned is kept under
    `$KERAS_HOME/memguard/` for the next `fit` of the same set-up. See
    `keras_memguard.decider` for the memory model.

    Args:
        threshold: Usage (peak / limit) a batch is never planned at or
            above; when reacting (`plan=False`), the peak usage at which `k`
            doubles. In (0, 1]. Defaults to `0.9`.
        release: When reacting, the predicted usage below which `k` may
            halve, in (0, 1) and below `threshold`. `None` means
            `threshold - 0.2` (half the threshold for thresholds up to 0.4).
            Defaults to `None`.
        mode: `"accumulate"` (one update per batch), `"shrink"` (one update
            per micro-batch: a smaller effective batch) or `"auto"`
            (accumulate while the gradient accumulators fit, then shrink).
            Defaults to `"accumulate"`.
        max_micro_batches: The largest `k` allowed, or `None` for no cap
            other than the batch size. Defaults to `None`.
        cooldown: When reacting, batches the predicted usage must stay below
            `release`, and the fewest batches between two usage-driven
            changes, before `k` halves. Defaults to `20`.
        micro_batches: The count to start with when the guard has no saved
            state: with `plan=True`, the first batch's split when nothing is
            known (`1` lets the guard choose: the whole batch where its
            layer outputs leave the memory free many times over, else a
            cautious 8); with `plan=False`, the count until the usage
            changes it. Defaults to `1`.
        memory_limit: Device memory limit in bytes (an int for every device,
            or a dict from TensorFlow device string to bytes). `None`
            resolves it as `AllocatorProbe` documents. Defaults to `None`.
        scale_learning_rate: While shrinking (`"shrink"`, or `"auto"` once
            it shrinks), divide a float learning rate by `k` (the linear
            scaling rule). Defaults to `False`.
        log_dir: Directory for TensorBoard logs and out-of-memory reports,
            or `None` for none. Defaults to `None`.
        backup_dir: Directory where the guard keeps its state (the
            `backup_dir` of your `keras.callbacks.BackupAndRestore`), or
            `None` to keep it in memory only. Defaults to `None`.
        plan: Plan each batch before it runs (`True`), or react to each
            batch's peak after it ran (`False`: the `release`/`cooldown`
            rule). Defaults to `True`.
        plan_cache: Keep what the guard learned in `$KERAS_HOME/memguard/`
            and start the next `fit` of the same set-up from it. Defaults to
            `True`.
        reserve_memory: When planning (or with `escalate`) on TensorFlow's
            CPU BFC allocator, reserve the rest of the limit as one region
            first, so what fits does not depend on earlier batches (nothing
            is reserved on a GPU). Defaults to `True`.
        escalate: Rungs to climb when one sample per micro-batch does not
            fit, a tuple: `("remat",)` recomputes the forward pass in
            segments (`keras_memguard.backends.tensorflow.remat`), trading
            step time for memory. Defaults to `()`.

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
        config = guard_options.decider_config(
            threshold, release, mode, max_micro_batches, cooldown, micro_batches,
            memory_limit, plan, escalate, scale_learning_rate=scale_learning_rate,
            plan_cache=plan_cache, reserve_memory=reserve_memory,
        )  # fmt: skip
        guard_options.check_folder("backup_dir", backup_dir)
        self.mode = mode
        self.plan = plan
        self.plan_cache = plan_cache
        self.reserve_memory = reserve_memory
        self.escalate = tuple(escalate)
        self.memory_limit = memory_limit
        self.scale_learning_rate = scale_learning_rate
        self.log_dir = log_dir
        self.backup_dir = backup_dir
        options = GuardOptions(
            mode=mode, plan=plan, plan_cache=plan_cache, escalate=self.escalate,
            reserve_memory=reserve_memory, scale_learning_rate=scale_learning_rate,
            memory_limit=memory_limit, micro_batches=micro_batches, log_dir=log_dir,
            backup_dir=backup_dir,
        )  # fmt: skip
        # What outlives one call, handed to each run.
        self.session = GuardSession(
            config, options, tb.writer_for(log_dir) if log_dir is not None else None
        )
        # The `fit` now (its backend's training run), or None.
        self._run = None
        # The session's step when the epoch began (None outside an epoch).
        self._epoch_first_step = None
        # `evaluate` / `predict` outside `fit`: the run now, or None.
        self._inference = None
        # What a copy or an unpickled guard is made from (`copies`).
        self._arguments = dict(
            threshold=threshold, release=release, mode=mode,
            max_micro_batches=max_micro_batches, cooldown=cooldown,
            micro_batches=micro_batches, memory_limit=memory_limit,
            scale_learning_rate=scale_learning_rate, log_dir=log_dir,
            backup_dir=backup_dir, plan=plan, plan_cache=plan_cache,
            reserve_memory=reserve_memory, escalate=self.escalate,
        )  # fmt: skip

    def __reduce__(self):
        # Copied or pickled (a search's trials): a new guard, same settings.
        return copies.reduced(self, MemoryGuard, self._arguments)

    @property
    def config(self):
        """The decider's configuration (a `keras_memguard.decider.DeciderConfig`)."""
        return self.session.config

    @property
    def controller(self):
        """The `GuardController` that plans, observes and replays training."""
        return self.session.controller

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
        inferred = self.session.inference_oom_count(inference.EVALUATE)
        return self.controller.state.eval_oom_count + inferred

    @property
    def predict_oom_recoveries(self):
        """How many times `predict` ran out of memory and went on in slices."""
        return self.session.inference_oom_count(inference.PREDICT)

    @property
    def rungs_on(self):
        """The rungs of `escalate` switched on, a tuple of names."""
        return self.controller.rungs_on

    @property
    def last_oom_explanation(self):
        """The `OomExplanation` of the last out-of-memory error, or `None`."""
        return self.session.last_oom_explanation

    def set_model(self, model):
        keras_models.check_model(model, "MemoryGuard")
        super().set_model(model)
        self.session.attach(model)

    # Keras' hooks: each hands over to the run of its backend.

    def on_train_begin(self, logs=None):
        backend = backends.current()
        session = self.session
        session.resolve_limits()
        session.collect_garbage_once()
        session.load_state()
        session.begin_fit(self.model)
        self._run = backend.training_run(session, self.params, MICRO_BATCHES_LOG_KEY)
        self._run.begin()
        session.reset_peaks()
        if session.writer is not None:
            session.step = session.writer.acquire(self, session.step)

    def on_train_end(self, logs=None):
        if self._run is not None:
            self._run.end()
            self._run = None
        self.session.save_plan()
        self.session.close_dumps()
        if self.session.writer is not None:
            self.session.writer.release(self)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_first_step = self.session.step
        if self._run is not None:
            self._run.begin_epoch()

    def on_epoch_end(self, epoch, logs=None):
        # Not for an epoch no batch ran in (an empty dataset): its count
        # would be a plan no batch used.
        if logs is not None and self.session.step != self._epoch_first_step:
            logs[MICRO_BATCHES_LOG_KEY] = self.micro_batches
        self.session.save_state()
        self.session.save_plan()
        if self.session.writer is not None:
            self.session.writer.flush()

    def on_train_batch_end(self, batch, logs=None):
        if self._run is not None:
            self._run.after_train_batch(batch, logs)

    def on_test_begin(self, logs=None):
        if self._run is not None and backends.current().VALIDATION_IN_FIT:
            self._run.begin_validation()  # `fit`'s validation
        else:
            self._begin_inference(inference.EVALUATE)

    def on_test_batch_end(self, batch, logs=None):
        if self._run is not None and backends.current().VALIDATION_IN_FIT:
            self._run.after_validation_batch()
        elif self._inference is not None:
            self._inference.after_batch()

    def on_test_end(self, logs=None):
        if self._run is not None and backends.current().VALIDATION_IN_FIT:
            self._run.end_validation()
            # Validation's peak must not count as the next training batch's.
            self.session.reset_peaks()
        else:
            self._end_inference()

    def on_predict_begin(self, logs=None):
        self._begin_inference(inference.PREDICT)

    def on_predict_batch_end(self, batch, logs=None):
        if self._inference is not None:
            self._inference.after_batch()

    def on_predict_end(self, logs=None):
        self._end_inference()

    # `evaluate` and `predict`: planned and sliced.

    def _begin_inference(self, kind):
        backend = backends.current()
        self.session.resolve_limits()
        self.session.collect_garbage_once()
        self._inference = backend.inference_run(self.session, kind)

    def _end_inference(self):
        if self._inference is not None:
            self._inference.end()
            self._inference = None
        if self._run is None:
            self.session.close_dumps()
