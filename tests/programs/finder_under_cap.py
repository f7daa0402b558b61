"""`find_batch_size` under a real 600 MiB cap, checked against the allocator.

The 64x64x3 CNN of the benchmarks. After the search, the batch 5% above
the one found is run by hand: it must run out of memory, so the answer is
within 5% of the largest batch that fits. Run by
tests/test_batch_size_finder.py; reports through `emit_result`.
"""

import math

import numpy as np
import tensorflow as tf

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import design_cnn


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
    above = math.ceil(1.05 * found.largest_batch_size)
    batch = np.take(x, np.arange(above) % len(x), axis=0), np.take(y, np.arange(above) % len(y))
    try:
        model.train_on_batch(*batch)
        result["above_fits"] = True
    except tf.errors.ResourceExhaustedError:
        result["above_fits"] = False
    result["above"] = above
    emit_result(result)


if __name__ == "__main__":
    main()
