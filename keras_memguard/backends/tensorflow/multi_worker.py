"""Guarded training under `tf.distribute.MultiWorkerMirroredStrategy`.

Plain Keras 3 `fit` does not run under `MultiWorkerMirroredStrategy`
(keras-team/keras#20585, tensorflow/tensorflow#72388). With more than one
worker (TensorFlow 2.21 with Keras 3.15) it fails twice:

1. Keras' symbolic build before the first batch calls
   `strategy.reduce("MEAN", (x, y), axis=None)` on the whole first batch. The
   strategy's `reduce` takes one `DistributedValues`, not a nest; with one
   worker the tuple passes through untouched (a `MEAN` of a non-distributed
   value is the value), with several it goes to the cross-device ops, which
   try `tf.convert_to_tensor` on the tuple of `PerReplica` values: "Attempt
   to convert a value (PerReplica: ...) with an unsupported type".
2. `reduce_per_replica(logs, strategy, "auto")` reduces every log with
   `strategy.reduce("MEAN", v, axis=0)` under multi-worker collectives, but
   the logs are scalars: "Invalid reduction dimension 0 for input with 0
   dimensions". The train step itself (forward, loss scaled by
   `num_replicas_in_sync`, gradient all-reduce in `optimizer.apply`, metric
   updates) traces and runs fine.

`prepare_multi_worker(model)` fixes both on one model instance: the symbolic
build gets the first local replica's batch (shapes only, no collective), and
every log value gets a leading axis of 1 before the reduction, so that the
`axis=0` mean is the mean across replicas. With it, plain `fit` and
`evaluate` run under the strategy too.

The out-of-memory replay needs more care. Collective instance keys are
assigned at call time, one per collective call, in the same order on every
worker. A worker whose step runs out of memory before the gradient
all-reduce leaves its peers waiting inside that all-reduce; replaying the
batch locally (what `ReplayTrainFunction` does) starts a *new* call with the
next instance key, which the peers never match: both workers wait forever,
with no error. So `MultiWorkerTrainFunction` splits each step in two
compiled functions:

- a local phase: the micro-batched forward and backward passes
  (`accumulate_gradients`), with no collective at all. An out-of-memory
  error here changes nothing and leaves no peer waiting;
- an agreement (one small all-gather): every worker learns whether any
  worker ran out of memory, and the batch size. If one did, every worker
  calls the same out-of-memory handler with the same inputs, so all pick
  the same larger `k` (or all raise `MicroBatchTooLargeError`); the workers
  that ran out of memory compute their gradients again, and the agreement
  repeats;
- an apply phase: loss tracker, `optimizer.apply` (the gradient
  all-reduce) and metrics, once every worker has its gradients.

An out-of-memory error in the apply phase (all-reduce buffers, optimizer
temporaries) cannot be replayed: a peer may already be inside the
all-reduce, and TensorFlow cannot recover aborted collectives in-process
("Restart your program to reset"). The worker then reports the error to the
cluster through the coordination service, which aborts the peers'
collectives at once, and every worker raises
`DistributedOutOfMemoryError`. A model whose own `train_step` cannot be
split (a `MemGuardMixin` override) gets the same fail-fast treatment for
every out-of-memory error.

Usage decisions are agreed the same way: `agree_on_usage` takes the maximum
over all workers before the decider reacts, so every worker changes `k` at
the same step.
"""

import keras
import tensorflow as tf
from keras import tree

from keras_memguard.errors import DistributedOutOfMemoryError
from keras_memguard.errors import UnsupportedTrainingSetupError

from keras_memguard.backends import compat
from keras_memguard import step_functions as functions
from keras_memguard.backends.tensorflow.accumulation import accumulate_gradients
from keras_memguard.backends.tensorflow.accumulation import build_metrics
from keras_memguard.backends.tensorflow.replay import batch_size_of
from keras_memguard.backends.tensorflow.replay import run_execution
from keras_memguard.backends.tensorflow.replay import sample_size_of
from keras_memguard.backends.tensorflow.splitting import validate_micro_batches
from keras_memguard.backends.tensorflow.splitting import validate_mode
from keras_memguard.backends.tensorflow.step import build_optimizer
from keras_memguard.backends.tensorflow.step import cached_function
from keras_memguard.backends.tensorflow.step import finish_step
from keras_memguard.backends.tensorflow.step import trains_with_own_step
from keras_memguard.forward_writes import warn_batch_statistics_once


# The coordination-service key under which a worker that runs out of memory
# stores its index before aborting the cluster's collectives: the peers see
# an `AbortedError` and read the key to tell it from any other abort.
_OOM_WORKER_KEY = "keras_memguard/out_of_memory_worker"
# How long a peer waits for that key after an abort (it is stored before
# the abort is reported, so it is normally there at once).
_OOM_WORKER_WAIT_MS = 2000
_PREPARED_ATTR = "_memguard_multi_worker_prepared"


def is_multi_worker(strategy):
    """Tells whether a strategy runs collectives across several workers.

    Args:
        strategy: A `tf.distribute.Strategy`, or `None`.

    Returns:
        `True` for a `tf.distribute.MultiWorkerMirroredStrategy` in
        multi-worker mode (a `TF_CONFIG` cluster of more than one task).

    Example:

    >>> is_multi_worker(tf.distribute.get_strategy())
    False
    """
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and compat.in_multi_worker_mode(strategy)


def worker_index(strategy):
    """Returns this worker's task index in the cluster (0 when unknown)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    task_id = getattr(resolver, "task_id", None)
    return int(task_id) if task_id is not None else 0


def first_local_batch(strategy, batch):
    """Returns the first local replica's part of a distributed batch.

    Enough for a symbolic build, which needs shapes and dtypes only, and
    runs no collective.

    Args:
        strategy: The `tf.distribute.Strategy` the batch comes from.
        batch: A nested structure of `DistributedValues` or tensors.

    Returns:
        The same structure, with plain tensors.
    """

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tree.map_structure(local, batch)


def with_leading_axis(logs):
    """Gives every value of a step's logs a leading axis of size 1.

    Call it inside the replica function, on what `train_step` returns, so
    that `reduce_logs` can average across replicas.

    Args:
        logs: A nested structure of tensors (or `None`).

    Returns:
        The same structure, each tensor `t` replaced by `t[None]`.
    """
    return tree.map_structure(
        lambda value: None if value is None else tf.expand_dims(value, 0), logs
    )


def reduce_logs(logs, strategy):
    """Averages per-replica logs across all replicas of all workers.

    Keras' `reduce_per_replica(..., "auto")` reduces with
    `strategy.reduce("MEAN", v, axis=0)` under multi-worker collectives,
    which fails on scalar logs. With a leading axis of 1 on each value
    (`with_leading_axis`, inside the replica function) the `axis=0` mean is
    the mean across replicas, element-wise: the value Keras gives under
    `MirroredStrategy`.

    Args:
        logs: A nested structure of per-replica values from `strategy.run`,
            each with the leading axis `with_leading_axis` adds.
        strategy: The `tf.distribute.Strategy` that ran the step.

    Returns:
        The same structure, one tensor per value, without the leading axis.
    """
    return tree.map_structure(
        lambda value: None
        if value is None
        else strategy.reduce("MEAN", value, axis=0),
        logs,
    )


def prepare_multi_worker(model):
    """Makes a model trainable under `MultiWorkerMirroredStrategy`.

    Call it once after `model.compile()`, inside or outside the strategy's
    scope, before the first `fit`. It changes this model instance only:

    - its symbolic build (run by `fit` before any callback) uses the first
      local replica's part of the first batch instead of reducing the whole
      batch across workers, which Keras 3 cannot do
      (keras-team/keras#20585);
    - its train, test and predict functions give each log value a leading
      axis before Keras reduces it, so the multi-worker mean reduction works
      on scalars.

    Nothing is saved with the model; a loaded model needs the call again.
    Under any other strategy it does nothing.

    Args:
        model: A Keras model (TensorFlow backend) built under the
            strategy's scope.

    Returns:
        `model`, for chaining.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    keras_memguard.prepare_multi_worker(model)
    model.fit(dataset, callbacks=[keras_memguard.MemoryGuard()])
    ```
    """
    if not is_multi_worker(model.distribute_strategy):
        return model
    if getattr(model, _PREPARED_ATTR, False):
        return model
    compat.override_build_and_make_function(
        model,
        to_build_batch=lambda batch: first_local_batch(
            model.distribute_strategy, batch
        ),
        wrap_step=lambda step: lambda data: with_leading_axis(step(data)),
    )
    object.__setattr__(model, _PREPARED_ATTR, True)
    # Functions built before this call would still reduce the Keras way.
    functions.set_train_function(model, None)
    functions.set_test_function(model, None)
    return model


def agree_max(strategy, values):
    """The element-wise maximum of `values` over all replicas and workers.

    One all-gather of a small vector across the cluster. Every worker must
    call it at the same point, the same number of times.

    Args:
        strategy: The `tf.distribute.Strategy`.
        values: A list of Python numbers (the same length everywhere).

    Returns:
        A list of Python floats.

    Raises:
        DistributedOutOfMemoryError: If another worker reported an
            out-of-memory error that aborted the cluster's collectives.
    """
    if not is_multi_worker(strategy):
        return [float(v) for v in values]
    function = _agree_function(strategy)
    vector = tf.constant([float(v) for v in values], tf.float64)
    try:
        result = function(vector)
    except tf.errors.OpError as error:
        _raise_if_peer_aborted(error)
        raise
    return [float(v) for v in result.numpy()]


_agree_functions = {}


def _agree_function(strategy):
    function = _agree_functions.get(id(strategy))
    if function is not None and function[0] is strategy:
        return function[1]

    def gather_max(vector):
        context_ = tf.distribute.get_replica_context()
        gathered = context_.all_gather(tf.expand_dims(vector, 0), axis=0)
        return tf.reduce_max(gathered, axis=0)

    @tf.function(reduce_retracing=True)
    def agree(vector):
        result = strategy.run(gather_max, args=(vector,))
        return strategy.experimental_local_results(result)[0]

    _agree_functions[id(strategy)] = (strategy, agree)
    return agree


def agree_on_usage(strategy, usage, largest_batch_size=None):
    """Makes every worker decide from the same numbers.

    Args:
        strategy: The `tf.distribute.Strategy`.
        usage: This worker's memory usage (peak / limit), or `None` when
            unknown.
        largest_batch_size: This worker's largest batch so far, or `None`.

    Returns:
        `(usage, largest_batch_size)`: the maxima over all workers, each
        `None` when no worker knows it.
    """
    usage_value, batch_value = agree_max(
        strategy,
        [
            -1.0 if usage is None else usage,
            -1.0 if largest_batch_size is None else largest_batch_size,
        ],
    )
    return (
        None if usage_value < 0 else usage_value,
        None if batch_value < 0 else int(batch_value),
    )


def _raise_if_peer_aborted(error):
    """Raises the package error when `error` is another worker's abort."""
    if not isinstance(error, tf.errors.AbortedError):
        return
    worker = compat.cluster_value(_OOM_WORKER_KEY, _OOM_WORKER_WAIT_MS)
    if worker is None or not worker.isdigit():
        return
    raise DistributedOutOfMemoryError(
        _abort_message(int(worker), local=False), worker=int(worker)
    ) from error


def _abort_message(worker, local):
    who = "This worker" if local else f"Worker {worker}"
    return (
        f"{who} ran out of memory where the batch cannot be replayed across "
        "workers (during the gradient all-reduce and optimizer update, or in "
        "a `train_step` override that keras_memguard cannot split), so every "
        "worker stopped; TensorFlow cannot recover aborted collectives in the "
        "same process. HINT: restart the workers (with "
        "keras.callbacks.BackupAndRestore and the same `backup_dir` for "
        "MemoryGuard, training resumes with the guard's micro-batch count), "
        "lower MemoryGuard's `threshold` so micro-batching starts before "
        "memory runs out, or lower the batch size."
    )


def _report_and_raise(strategy, error):
    """Aborts every worker's collectives, then raises the package error."""
    worker = worker_index(strategy)
    try:
        compat.set_cluster_value(_OOM_WORKER_KEY, str(worker))
        compat.report_error_to_cluster(
            tf.errors.ABORTED,
            f"keras_memguard: worker {worker} ran out of memory: "
            f"{error.message}",
        )
    except Exception:  # noqa: BLE001 - the peers still fail when we exit.
        pass
    raise DistributedOutOfMemoryError(
        _abort_message(worker, local=True), worker=worker
    ) from error


def _on_replica_device(gradient):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.identity(gradient.values),
            tf.identity(gradient.indices),
            gradient.dense_shape,
        )
    return tf.identity(gradient)


def _splittable(model):
    """Tells whether the model trains with keras_memguard's own step."""
    return not trains_with_own_step(model)


class MultiWorkerTrainFunction:
    """`ReplayTrainFunction` for `MultiWorkerMirroredStrategy` clusters.

    Each batch runs in three parts: the local, micro-batched gradient
    computation (no collective, so an out-of-memory error there leaves no
    peer waiting), one all-gather through which every worker learns whether
    any worker ran out of memory, and the apply phase (loss tracker,
    gradient all-reduce and optimizer update, metrics). A batch that ran out
    of memory on any worker is replayed on the workers that need it with the
    `k` every worker gets from the same handler call; an out-of-memory error
    in the apply phase raises `DistributedOutOfMemoryError` on every worker.

    Args:
        model: The compiled Keras model, built under the strategy's scope
            and passed to `prepare_multi_worker`.
        micro_batches: The number of micro-batches to start with.
            Defaults to `1`.
        mode: Only `"accumulate"`: one update per micro-batch would need a
            gradient all-reduce inside the micro-batch loop.
            Defaults to `"accumulate"`.
        on_out_of_memory: Called as `on_out_of_memory(batch_size,
            micro_batches, error)` on every worker when any worker runs out
            of memory in the local phase, with the same `batch_size` and
            `micro_batches` everywhere; returns the `k` to replay with, or
            raises. `None` raises `DistributedOutOfMemoryError`.
            Defaults to `None`.
        plan: Called as `plan(batch_size, sample_size, data)` before each
            batch's first try with this worker's batch size; returns the
            number of micro-batches to run it with. It must decide from
            numbers every worker agreed on, so that all plan alike. `None`
            keeps the count in force. Defaults to `None`.
        on_split_error: Called as `on_split_error(batch_size,
            micro_batches, error)` on every worker when tracing the local
            step of more than one micro-batch raised `ValueError` or
            `TypeError` on any worker (the model's code fails on a
            micro-batch; nothing ran); returns the count to run the batch
            with, or raises. `None` re-raises the error. Defaults to `None`.

    Raises:
        UnsupportedTrainingSetupError: If `mode` is `"shrink"`.
    """

    def __init__(
        self,
        model,
        micro_batches=1,
        mode="accumulate",
        on_out_of_memory=None,
        plan=None,
        on_split_error=None,
    ):
        self.model = model
        self.strategy = model.distribute_strategy
        self.micro_batches = validate_micro_batches(micro_batches)
        self.mode = validate_mode(mode)
        if mode != "accumulate":
            raise UnsupportedTrainingSetupError(
                "`mode='shrink'` is not supported under "
                "MultiWorkerMirroredStrategy: each update all-reduces the "
                "gradients, which cannot run inside the micro-batch loop. "
                f"Received: mode={mode!r}. HINT: use mode='accumulate'."
            )
        self.on_out_of_memory = on_out_of_memory
        self.on_split_error = on_split_error
        self.plan = plan
        self.splittable = _splittable(model)
        self.last_batch_size = None
        self.largest_batch_size = None
        self.last_sample_size = None


    # The guard splits each replica's part of the batch; this worker's data
    # is its replicas' part (one replica per worker in the common case).
    @property
    def last_replica_batch_size(self):
        """Samples of the last batch on this worker's replica."""
        return self.last_batch_size

    @property
    def largest_replica_batch_size(self):
        """Samples of the largest batch so far on this worker's replica."""
        return self.largest_batch_size

    def __call__(self, iterator):
        return run_execution(self.model, iterator, self.run)

    def run(self, data):
        """Trains on one batch on every worker, replaying it on OOM.

        Args:
            data: One batch as the distributed iterator yields it.

        Returns:
            The step's logs, averaged over all replicas.
        """
        if not self.splittable:
            return self._run_whole(data)
        local_batch = batch_size_of(data) or 0
        if self.plan is not None and local_batch:
            self.last_sample_size = sample_size_of(data, self.strategy)
            self.micro_batches = self.plan(local_batch, self.last_sample_size, data)
        result = None
        while True:
            micro_batches = self.micro_batches
            error = split_error = None
            if result is None:
                try:
                    result = self._local_step(micro_batches)(data)
                except tf.errors.ResourceExhaustedError as oom:
                    error = oom
                except (ValueError, TypeError) as traced:
                    # Raised while tracing: no op of the step ran here.
                    if micro_batches <= 1 or self.on_split_error is None:
                        raise
                    split_error = traced
            # A worker with a smaller last batch may have planned fewer
            # micro-batches: the handler gets the largest count everywhere.
            failed, batch_size, micro_batches, split_failed = agree_max(
                self.strategy,
                [result is None, local_batch, micro_batches, split_error is not None],
            )
            batch_size = int(batch_size)
            micro_batches = int(micro_batches)
            self.last_batch_size = batch_size
            if batch_size > (self.largest_batch_size or 0):
                self.largest_batch_size = batch_size
            if split_failed:
                # Every worker runs the batch at the count the handler
                # gives, its own split gradients dropped.
                if split_error is None:
                    split_error = ValueError(
                        "Another worker's step failed on a micro-batch."
                    )
                result = None
                self.micro_batches = self.on_split_error(
                    batch_size, micro_batches, split_error
                )
                continue
            if not failed:
                break
            if error is None:
                error = tf.errors.ResourceExhaustedError(
                    None, None, "Another worker ran out of memory on this batch."
                )
            if self.on_out_of_memory is None:
                raise DistributedOutOfMemoryError(
                    f"A worker ran out of memory at {micro_batches} "
                    "micro-batches and no handler chose a replay."
                ) from error
            # The same handler, state and inputs on every worker: the same
            # new `k` everywhere, or the same error everywhere.
            self.micro_batches = self.on_out_of_memory(
                batch_size, micro_batches, error
            )
        try:
            return self._apply()(data, result)
        except tf.errors.OpError as error:
            _raise_if_peer_aborted(error)
            if isinstance(error, tf.errors.ResourceExhaustedError):
                _report_and_raise(self.strategy, error)
            raise

    def _run_whole(self, data):
        """A train step that cannot be split: fail fast on any OOM."""
        batch_size = batch_size_of(data)
        self.last_batch_size = batch_size
        if batch_size and batch_size > (self.largest_batch_size or 0):
            self.largest_batch_size = batch_size
        try:
            return self._whole_step(self.micro_batches)(data)
        except tf.errors.OpError as error:
            _raise_if_peer_aborted(error)
            if isinstance(error, tf.errors.ResourceExhaustedError):
                _report_and_raise(self.strategy, error)
            raise

    def _whole_step(self, micro_batches):
        return cached_function(
            self.model,
            ("multi_worker_whole", micro_batches, self.mode),
            lambda: self._build_whole_step(micro_batches),
        )

    def _build_whole_step(self, micro_batches):
        strategy = self.strategy
        # `MemGuardMixin`'s hook, looked up by name as `step.step_body` does:
        # the prefix keeps it clear of the user's own attributes.
        pinned = getattr(self.model, "_memguard_train_step_for")
        train_step = pinned(micro_batches, self.mode)

        def replica_step(data):
            return with_leading_axis(train_step(data))

        @tf.function(reduce_retracing=True)
        def whole_step(data):
            return reduce_logs(strategy.run(replica_step, args=(data,)), strategy)

        return whole_step

    def _local_step(self, micro_batches):
        return cached_function(
            self.model,
            ("multi_worker_local", micro_batches),
            lambda: self._build_local_step(micro_batches),
        )

    def _build_local_step(self, micro_batches):
        model = self.model
        strategy = self.strategy

        def local(data):
            warn_batch_statistics_once(model, micro_batches)
            build_optimizer(model)
            return accumulate_gradients(model, data, micro_batches)

        @tf.function(reduce_retracing=True)
        def local_step(data):
            return strategy.run(local, args=(data,))

        return local_step

    def _apply(self):
        return cached_function(self.model, ("multi_worker_apply",), self._build_apply)

    def _build_apply(self):
        model = self.model
        strategy = self.strategy

        def apply(data, result):
            # Function inputs carry no device; the all-reduce needs one.
            gradients = [_on_replica_device(g) for g in result.gradients]
            _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            build_metrics(model, y, result.y_pred)
            return with_leading_axis(finish_step(model, data, result, gradients))

        @tf.function(reduce_retracing=True)
        def apply_step(data, result):
            logs = strategy.run(apply, args=(data, result))
            return reduce_logs(logs, strategy)

        return apply_step
