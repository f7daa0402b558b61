"""`keras_memguard.testing.act_as_gpu`: a capped process that runs as on a GPU."""

import pytest

from keras_memguard.testing import act_as_gpu
from keras_memguard.testing import run_with_memory_cap

AS_SEEN_BY_THE_PROCESS = """
import keras
import tensorflow as tf

from keras_memguard.testing import emit_result

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(loss="mse")
info = tf.config.experimental.get_memory_info("CPU:0")
emit_result({
    "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
    "jit_compile": model.jit_compile,
    "reserved_mib": info["peak"] / 2**20,
})
"""


@pytest.mark.slow
def test_a_process_acting_as_a_gpu_runs_one_op_at_a_time_under_xla_in_one_region():
    seen = run_with_memory_cap(AS_SEEN_BY_THE_PROCESS, 200, as_gpu=True).result
    # One inter-op thread: TensorFlow runs a GPU's kernels one at a time.
    assert seen["inter_op_threads"] == 1
    assert seen["jit_compile"] is True
    # The cap, less the headroom, taken as one region at the start.
    assert seen["reserved_mib"] > 150
    plain = run_with_memory_cap(AS_SEEN_BY_THE_PROCESS, 200).result
    assert plain["inter_op_threads"] == 0
    assert plain["jit_compile"] is False
    assert plain["reserved_mib"] < 1


def test_acting_as_a_gpu_after_the_first_op_raises_a_clear_error():
    import tensorflow as tf

    # This process has run ops on the default inter-op threads.
    tf.constant(1.0) + 1.0
    with pytest.raises(RuntimeError) as info:
        act_as_gpu()
    message = str(info.value)
    assert "before TensorFlow runs its first op" in message
    assert "Received: 0 inter-op threads" in message
