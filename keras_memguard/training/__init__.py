"""The training core: micro-batched steps and the out-of-memory replay.

The only package that touches Keras' training internals (through
`keras_memguard.training.compat`). Its modules, one responsibility each:
`splitting` (cutting a batch into micro-batches), `accumulation` (the
micro-batch loop and what it sums), `step` (the train step, its compiled
functions and their cache), `replay` (the train function that pulls a batch
and replays it after an out-of-memory error), `eval_replay` (evaluation in
slices), `multi_worker` (agreement across workers) and `mixin`
(`MemGuardMixin`).

The names below are for a `train_step` of your own and for tools built on
the core; most users need only `keras_memguard.MemoryGuard` and
`keras_memguard.MemGuardMixin`.
"""

from keras_memguard.training.accumulation import AccumulatedGradients
from keras_memguard.training.accumulation import accumulate_gradients
from keras_memguard.training.splitting import MicroBatch
from keras_memguard.training.splitting import split_micro_batches
from keras_memguard.training.step import has_batch_statistics_layers
from keras_memguard.training.step import make_step_function
from keras_memguard.training.step import micro_batch_train_step

__all__ = [
    "AccumulatedGradients",
    "MicroBatch",
    "accumulate_gradients",
    "has_batch_statistics_layers",
    "make_step_function",
    "micro_batch_train_step",
    "split_micro_batches",
]
