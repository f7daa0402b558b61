"""The exceptions keras_memguard raises.

Every error the package raises on purpose derives from `MemGuardError`, so a
caller can catch the package's own errors without catching TensorFlow's.
"""


class MemGuardError(Exception):
    """Base class of every error raised by keras_memguard."""


class MicroBatchTooLargeError(MemGuardError):
    """A micro-batch of a single sample still runs out of memory.

    Raised by the out-of-memory replay when splitting the batch further is
    impossible. The message states the measured single-sample peak and the
    device memory limit, and suggests remedies.

    Args:
        message: The explanation shown to the user.
        peak_bytes: The allocator peak measured for the failing attempt, or
            `None` when it could not be read.
        limit_bytes: The device memory limit, or `None` when unknown.
    """

    def __init__(self, message, peak_bytes=None, limit_bytes=None):
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.limit_bytes = limit_bytes


class CompiledStepOutOfMemoryError(MemGuardError):
    """An XLA-compiled train step ran out of memory; the batch is not replayed.

    After an out-of-memory error inside an XLA program, TensorFlow's
    allocator can abort the whole process on the next step, so the guard
    stops `fit` with this error instead of replaying the batch. The weights
    are those after the last batch that completed; what the guard learned
    is kept in its plan cache, so the next run plans the step with more
    micro-batches.

    Args:
        message: The explanation shown to the user.
        weights_path: Where the model's weights were saved (under the
            guard's `backup_dir`), or `None`.
    """

    def __init__(self, message, weights_path=None):
        super().__init__(message)
        self.weights_path = weights_path


class MemoryLimitUnknownError(MemGuardError):
    """No memory limit could be resolved for a device the guard must watch."""


class UnsupportedTrainingSetupError(MemGuardError):
    """The model or `fit` configuration cannot be guarded safely."""


class DistributedOutOfMemoryError(MemGuardError):
    """A worker ran out of memory where the batch cannot be replayed.

    Raised on every worker of a `MultiWorkerMirroredStrategy` cluster, within
    moments of each other, when one worker runs out of memory while its
    peers may be inside a collective (the gradient all-reduce and optimizer
    update, or a `train_step` override that cannot be split). TensorFlow
    cannot recover aborted collectives in the same process: restart the
    workers.

    Args:
        message: The explanation shown to the user.
        worker: The index of the worker that ran out of memory, or `None`
            when unknown.
    """

    def __init__(self, message, worker=None):
        super().__init__(message)
        self.worker = worker


class DevicesAlreadyInitializedError(MemGuardError, RuntimeError):
    """TensorFlow initialized its devices before `configure_devices` ran.

    Memory growth, logical device memory limits and the GPU allocator can
    only be chosen before TensorFlow initializes its devices, which the
    first op, tensor, model or dataset does. Also a `RuntimeError`, the type
    TensorFlow itself raises for this.
    """


class MissingExtraError(MemGuardError, ImportError):
    """An optional dependency of the package is not installed.

    Also an `ImportError`. The message names the command that installs it.

    Args:
        message: The explanation shown to the user.
        extra: The name of the package extra that installs the dependency,
            such as `"report"`.
    """

    def __init__(self, message, extra=None):
        super().__init__(message)
        self.extra = extra
