"""`find_batch_size`'s answer, then plain `fit` at a batch, each in its own process.

The README's usage: `found = find_batch_size(model, x, y)` and then
`model.fit(x, y, batch_size=found.largest_batch_size)`, checked where the
user takes the answer: in a fresh process. The 64x64x3 CNN of the
benchmarks with 1024 samples, under the test's cap, with the allocator and
`jit_compile="auto"` as on a GPU (`act_as_gpu`).

    finder_then_fit.py find INPUT JIT   -> {"answer": ..., "trials": [...]}
    finder_then_fit.py fit INPUT JIT BATCH -> {"trained": true/false}

INPUT: `numpy`, `dataset` (a batched `tf.data.Dataset`) or `py_dataset`
(a `keras.utils.PyDataset`), or `decoder`: the decoder language model of
`programs.unseen_under_cap` on its numpy token ids instead of the CNN, or
`attention`: a one-block Transformer classifier on numpy sequences, or
`rows`: an MLP over 1024 rows a sample, about 17 MiB a sample in a step;
JIT: `auto` or `off`. Run by
tests/test_batch_size_finder.py; reports through `emit_result`.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import attention_classifier, design_cnn, row_mlp

SAMPLES = 1024


class Batches(keras.utils.PyDataset):
    """The arrays in batches, as a user's `PyDataset` serves them."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def data(kind, batch_size):
    """`(x, y)` as `fit` takes them, for input `kind` at `batch_size`."""
    rng = np.random.default_rng(0)
    x = rng.random((SAMPLES, 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, SAMPLES)
    if kind == "numpy":
        return x, y
    if kind == "dataset":
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size), None
    return Batches(x, y, batch_size), None


def main(action, kind, jit, batch_size=32):
    if kind == "decoder":
        from programs.unseen_under_cap import decoder

        model, x, y, _ = decoder()
    elif kind == "rows":
        # 16 samples to search on, two full batches to train on.
        model, x, y = row_mlp(16 if action == "find" else 2 * int(batch_size))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    elif kind == "attention":
        # 64 sequences to search on (trials repeat them), eight full
        # batches to train on: its step's peak grows over the first steps.
        model, x, y = attention_classifier(64 if action == "find" else 8 * int(batch_size))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        model = design_cnn()
        x, y = data(kind, int(batch_size))
    if jit == "off":
        model.jit_compile = False
    if action == "find":
        found = keras_memguard.find_batch_size(model, x, y, verbose=0)
        emit_result({
            "answer": found.largest_batch_size,
            "errors": found.out_of_memory_errors,
            "trials": [[t.batch_size, t.peak_bytes] for t in found.trials],
            "xla": bool(model.jit_compile),
        })
        return
    try:
        model.fit(x, y, batch_size=None if y is None else int(batch_size), verbose=0)
    except tf.errors.ResourceExhaustedError:
        emit_result({"trained": False})
        return
    emit_result({"trained": True, "xla": bool(model.jit_compile)})


if __name__ == "__main__":
    main(*sys.argv[1:])
