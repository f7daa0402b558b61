"""`find_batch_size` under a real 600 MiB cap, checked against the allocator.

The 64x64x3 CNN of the benchmarks. After the search, batches 2% larger
at a time than the one found are run by hand until one runs out of
memory: the largest that ran is the largest batch that fits, to compare
the answer with. Run by
tests/test_batch_size_finder.py; reports through `emit_result`.
"""

import math

import numpy as np
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import design_cnn


# Steps of 2% above the answer tried by hand (about 27% in all).
MAX_STEPS_UP = 12


def main():
    model = design_cnn()
    rng = np.random.default_rng(0)
    x = rng.random((96, 64, 64, 3), dtype=np.float32)
    y = rng.integers(0, 10, 96)
    found = keras_memguard.find_batch_size(model, x, y, batch_size=1024)
    result = {
        "largest": found.largest_batch_size,
        "peak": found.measured_peak_bytes,
        "limit": found.limit_bytes,
        "errors": found.out_of_memory_errors,
        "trials": [
            [t.batch_size, t.in_use_bytes, t.peak_bytes, t.predicted_peak_bytes]
            for t in found.trials
        ],
        "micro_batches": found.micro_batches,
        "iterations": int(model.optimizer.iterations.numpy()),
    }
    # The largest batch that fits, by hand: 2% more at a time until one
    # runs out of memory (the first error ends it, so no earlier one has
    # left the memory in pieces).
    fits, size = found.largest_batch_size, found.largest_batch_size
    for _ in range(MAX_STEPS_UP):
        size = max(size + 1, math.ceil(size * 1.02))
        index = np.arange(size) % len(x)
        try:
            model.train_on_batch(x[index], y[index])
        except tf.errors.ResourceExhaustedError:
            break
        fits = size
    result["largest_that_fits"] = fits
    emit_result(result)


if __name__ == "__main__":
    main()
