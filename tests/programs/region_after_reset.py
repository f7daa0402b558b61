"""A region reserved after a probe reset the allocator's peak.

In a process under a 600 MiB cap: a 60 MiB tensor grows the allocator's
regions and is freed, a probe samples (which resets TensorFlow's peak), and
then `region.reserve_region` sizes the region. Sized from the allocator's
reset peak alone, it asked for more than the allocator had left and failed
only after TensorFlow's 10 s of retries. Reports the bytes reserved and the
package's log lines.
"""

import logging

import tensorflow as tf

from keras_memguard.backends.tensorflow import region
from keras_memguard.backends.tensorflow.probe import AllocatorProbe
from keras_memguard.testing import emit_result

MIB = 1 << 20


def main():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("keras_memguard")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    probe = AllocatorProbe(devices=["CPU:0"])
    probe.reset()
    tensor = tf.zeros([60 * MIB // 4])
    del tensor
    probe.sample()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    reserved = region.reserve_region("CPU:0", 600 * MIB)
    emit_result({
        "reserved_mib": reserved // MIB,
        "peak_after_sample_mib": peak / MIB,
        "lines": lines,
    })


if __name__ == "__main__":
    main()
