"""AllocatorProbe's limit and usage under a real cap (run under 300 MiB).

Run by tests/test_allocator_probe.py; reports through `emit_result`.
"""

import warnings


def main():
    warnings.simplefilter("always")
    import tensorflow as tf
    from keras_memguard import AllocatorProbe
    from keras_memguard.testing import emit_result

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = AllocatorProbe()
        probe.reset()
        x = tf.zeros([50 * 2**20])  # 200 MiB of float32
        (s,) = probe.sample()
    emit_result({
        "mode": probe.mode,
        "limit": probe.limit_bytes("CPU:0"),
        "source": probe.limit_source("CPU:0"),
        "peak": s.peak_bytes,
        "usage": s.usage,
        "user_limit": AllocatorProbe(memory_limit=2**30).limit_bytes("CPU:0"),
        "warnings": [str(w.message) for w in caught],
    })


if __name__ == "__main__":
    main()
