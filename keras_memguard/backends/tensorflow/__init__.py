"""The training core: micro-batched steps and the out-of-memory replay.

The only package that touches Keras' training internals (through
`keras_memguard.backends.compat`). Its modules, one responsibility each:
`splitting` (cutting a batch into micro-batches), `accumulation` (the
micro-batch loop and what it sums), `step` (the train step, its compiled
functions and their cache), `replay` (the train function that pulls a batch
and replays it after an out-of-memory error), `slice_replay` (a batch run
in slices, smaller after an out-of-memory error) under `eval_replay` and
`predict_replay` (evaluation and prediction), `multi_worker` (agreement across workers) and `mixin`
(`MemGuardMixin`).

The names below are for a `train_step` of your own and for tools built on
the core; most users need only `keras_memguard.MemoryGuard` and
`keras_memguard.MemGuardMixin`.
"""

import importlib

# Loaded on first use, so that `keras_memguard.step_functions` (the one
# writer of a model's step functions) imports without TensorFlow.
_EXPORTS = {
    "AccumulatedGradients": "keras_memguard.backends.tensorflow.accumulation",
    "MicroBatch": "keras_memguard.backends.tensorflow.splitting",
    "accumulate_gradients": "keras_memguard.backends.tensorflow.accumulation",
    "has_batch_statistics_layers": "keras_memguard.forward_writes",
    "make_step_function": "keras_memguard.backends.tensorflow.step",
    "micro_batch_train_step": "keras_memguard.backends.tensorflow.step",
    "split_micro_batches": "keras_memguard.backends.tensorflow.splitting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(
            f"module 'keras_memguard.backends.tensorflow' has no attribute {name!r}"
        )
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
