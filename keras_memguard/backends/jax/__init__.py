"""The training core on Keras' JAX backend.

The counterpart of `keras_memguard.backends.tensorflow` for `KERAS_BACKEND=jax`, and
the only package that touches the JAX trainer's internals (through
`keras_memguard.backends.compat`). Its modules, one responsibility each:
`step` (the micro-batched, non-donating train step), `compiled` (compiled
steps per count and batch shapes, and what XLA says they need), `planning`
(the smallest count whose compiled step fits), `replay` (the train function
`fit` calls, which replays a batch after an out-of-memory error),
`support` (what cannot be guarded yet, refused before `fit` starts),
`inference` (`evaluate` and `predict` in slices that can be replayed) and
`mixin` (`MemGuardMixin` on this backend).

Imports JAX and Keras, never TensorFlow.
"""

from keras_memguard.backends.jax.compiled import StepCache
from keras_memguard.compiled_plan import StepMemory
from keras_memguard.compiled_plan import CompiledPlan
from keras_memguard.compiled_plan import excess_bytes
from keras_memguard.compiled_plan import plan_micro_batches
from keras_memguard.backends.jax.replay import ReplayingTrainFunction
from keras_memguard.backends.jax.replay import StepOutOfMemory
from keras_memguard.backends.jax.replay import double_micro_batches
from keras_memguard.backends.jax.replay import is_out_of_memory
from keras_memguard.backends.jax.step import make_train_step
from keras_memguard.backends.jax.step import micro_batch_segments
from keras_memguard.backends.jax.step import micro_batch_train_step
from keras_memguard.backends.jax.support import check_supported

__all__ = [
    "CompiledPlan",
    "ReplayingTrainFunction",
    "StepCache",
    "StepMemory",
    "StepOutOfMemory",
    "check_supported",
    "double_micro_batches",
    "excess_bytes",
    "is_out_of_memory",
    "make_train_step",
    "micro_batch_segments",
    "micro_batch_train_step",
    "plan_micro_batches",
]
