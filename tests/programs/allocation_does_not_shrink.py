"""A batch whose failing allocation does not shrink with the micro-batch.

A 32x32x3 CNN fed a PyDataset of batches of random sizes (8 to 64 samples)
under a 30 MiB cap: the second convolution's backward pass asks for one
27 MiB workspace (`[31, 784, 288]` floats) whatever the micro-batch, and the
largest free block is 16 MiB. Run by tests/test_planning.py; reports through
`emit_result`.
"""

import numpy as np
import keras

import keras_memguard
from keras_memguard.testing import emit_result
from programs.common import MicroBatchCounts, cnn


class RandomSizes(keras.utils.PyDataset):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sizes = np.random.default_rng(0).integers(8, 65, 12)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, index):
        size = int(self.sizes[index])
        rng = np.random.default_rng(index)
        return rng.random((size, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, size)


def main():
    model = cnn(
        (32, 32, 3), lambda: [keras.layers.Conv2D(32, 3, activation="relu") for _ in range(2)]
    )
    guard = keras_memguard.MemoryGuard(plan_cache=False)
    result = {"ks": []}
    ks = MicroBatchCounts()
    try:
        model.fit(RandomSizes(), epochs=1, verbose=0, callbacks=[ks, guard])
        result["error"] = None
    except keras_memguard.MicroBatchTooLargeError as error:
        result["error"] = str(error)
    result.update(
        ks=ks.ks,
        oom_recoveries=guard.oom_recoveries,
        batches_trained=int(model.optimizer.iterations.numpy()),
    )
    emit_result(result)


if __name__ == "__main__":
    main()
