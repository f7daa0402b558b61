"""AllocatorProbe without the BFC allocator: the mode TensorFlow was started
in (oneDNN on: "default"; off: "unavailable"), its samples and its warnings.

Run by tests/test_allocator_probe.py with `TF_ENABLE_ONEDNN_OPTS` set and
no BFC variables; reports through `emit_result`. The warnings must point at
this file, the probe's caller.
"""

import warnings


def main():
    import tensorflow as tf
    from keras_memguard import AllocatorProbe
    from keras_memguard.testing import emit_result

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = AllocatorProbe()
        probe.reset()
        small = tf.zeros([16])  # Below what the default allocator counts.
        samples = [probe.sample() for _ in range(3)]
        big = tf.zeros([4 * 2**20])
        samples.append(probe.sample())
    emit_result({
        "mode": probe.mode,
        "source": probe.limit_source("CPU:0"),
        "limit": probe.limit_bytes("CPU:0"),
        "samples": [[s.current_bytes, s.peak_bytes, s.usage] for (s,) in samples],
        "warnings": [[str(w.message), w.filename] for w in caught],
    })


if __name__ == "__main__":
    main()
