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
from keras_memguard.callbacks import guard_options
from keras_memguard.callbacks import inference
from keras_memguard.callbacks.session import GuardOptions
from keras_memguard.callbacks.session import GuardSession
from keras_memguard.sinks import tensorboard as tb

MICRO_BATCHES_LOG_KEY = "micro_batches"


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
    instead: at or above `threshold` it doubles `k` before the next batch;
    once the usage predicted at `k / 2` has stayed below `release` for
    `cooldown` batches, it halves `k` again. The input pipeline, the number
    of steps and the progress bar stay as they are: each batch is split
    inside the train step.

    In `"accumulate"` mode the gradients of the `k` micro-batches are summed,
    weighted by each one's share of the samples, and applied once: the update
    is the one the whole batch would give. In `"shrink"` mode every
    micro-batch is its own update (a smaller effective batch). The
    accumulators take one buffer per trainable weight, which no split
    removes: `"auto"` accumulates until they are what does not fit (one
    sample per micro-batch runs out of memory beside them, is predicted to,
    or no compiled XLA step fits), then goes on as `"shrink"` for the rest
    of `fit`, with one WARNING line saying why; the batch that ran out of
    memory is replayed without them. On the JAX backend `"auto"`
    accumulates.

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
    largest live tensors, from the dump TensorFlow's BFC allocator writes
    (`keras_memguard.oom_explanation`). The last one is `last_oom_explanation`.

    Works on any compiled Keras model, on the TensorFlow and JAX backends
    (the README lists what JAX refuses): plain Sequential and functional
    models need no change, and models that mix in `MemGuardMixin` keep their
    own `train_step`. The model's class is never changed, so `model.save`
    and `keras.models.load_model` work as usual.

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
    (`keras_memguard.backends.tensorflow.remat`); `rungs_on` lists the rungs switched
    on.

    `k` and the counters persist across epochs and `fit` calls. To resume them
    with `keras.callbacks.BackupAndRestore`, give both the same directory.
    They live in `session` (a `keras_memguard.callbacks.session.GuardSession`,
    with the step count, the limits and the options), which each backend's
    run is handed.

    Args:
        threshold: Usage (peak / limit) never planned at or above; when
            reacting, the peak usage at which `k` doubles. In (0, 1].
            Defaults to `0.9`.
        release: When reacting, the predicted usage below which `k` may
            halve, in (0, 1) and below `threshold`. `None` means
            `threshold - 0.2` (half the threshold for thresholds up to 0.4).
            Defaults to `None`.
        mode: `"accumulate"`, `"shrink"` or `"auto"` (accumulate while
            the accumulators fit, then shrink). Defaults to `"accumulate"`.
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
        scale_learning_rate: In `"shrink"` mode (and `"auto"` once it
            shrinks), divide a float learning rate
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
        config = guard_options.decider_config(
            threshold, release, mode, max_micro_batches, cooldown, micro_batches,
            memory_limit, plan, escalate, scale_learning_rate=scale_learning_rate,
            plan_cache=plan_cache, reserve_memory=reserve_memory,
        )  # fmt: skip
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
        # `evaluate` / `predict` outside `fit`: the run now, or None.
        self._inference = None

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
        super().set_model(model)
        self.session.attach(model)

    # Keras' hooks: each hands over to the run of its backend.

    def on_train_begin(self, logs=None):
        backend = backends.current()
        session = self.session
        session.resolve_limits()
        session.load_state()
        self._run = backend.training_run(session, self.params, MICRO_BATCHES_LOG_KEY)
        self._run.begin()
        session.reset_peaks()
        if session.writer is not None:
            session.writer.acquire(self)

    def on_train_end(self, logs=None):
        if self._run is not None:
            self._run.end()
            self._run = None
        self.session.save_plan()
        self.session.close_dumps()
        if self.session.writer is not None:
            self.session.writer.release(self)

    def on_epoch_begin(self, epoch, logs=None):
        if self._run is not None:
            self._run.begin_epoch()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
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
        if self._inference is not None:
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
        self._inference = backend.inference_run(self.session, kind)

    def _end_inference(self):
        if self._inference is not None:
            self._inference.end()
            self._inference = None
        if self._run is None:
            self.session.close_dumps()
