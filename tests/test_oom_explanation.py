"""The out-of-memory explanation: parsing, layer attribution, the file.

The real thing, under a real cap, is in tests/test_report.py
(`test_recoveries_and_their_time_under_a_real_cap`); here the pieces, with
TensorFlow's own `MemoryDump` protobuf and real Keras models.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import keras
import pytest
from tensorflow.core.protobuf import bfc_memory_map_pb2

from keras_memguard import oom_explanation

MIB = 1024 * 1024

# TensorFlow 2.21's message for a graph op (text before it trimmed).
GRAPH_MESSAGE = (
    "Graph execution error:\n\nDetected at node "
    "gradient_tape/functional_1/small_b_1/convolution/Conv2DBackpropInput defined at\n"
    "OOM when allocating tensor with shape[256,64,64,96] and type float on "
    "/job:localhost/replica:0/task:0/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu\n"
    "\t [[{{node gradient_tape/functional_1/small_b_1/convolution/Conv2DBackpropInput}}]]\n"
    "Hint: If you want to see a list of allocated tensors when OOM happens, add "
    "report_tensor_allocations_upon_oom to RunOptions.\n"
    " [Op:__inference_multi_step_on_iterator_1521]"
)
# An eager op's message names no node.
EAGER_MESSAGE = (
    "{{function_node __wrapped__AddV2_device_/job:localhost/replica:0/task:0/"
    "device:GPU:0}} OOM when allocating tensor with shape[1024,1024] and type half "
    "on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc "
    "[Op:AddV2]"
)


def make_model():
    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="small_a")(inputs)
    x = keras.layers.Conv2D(96, 3, padding="same", name="wide")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", name="small_b")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(x))
    model.compile("adam", "mse")
    return model


def make_dump(in_use, free, limit_left_unheld=0):
    """A MemoryDump with chunks of the given requested sizes."""
    dump = bfc_memory_map_pb2.MemoryDump(allocator_name="test")
    for size in in_use:
        dump.chunk.add(size=size, requested_size=size, in_use=True)
    for size in free:
        dump.chunk.add(size=size, requested_size=0, in_use=False)
    dump.stats.bytes_in_use = sum(in_use)
    return dump


def test_parses_the_failed_allocation_and_op_of_a_graph_error():
    found = oom_explanation.parse_error_message(GRAPH_MESSAGE)
    assert found == {
        "shape": (256, 64, 64, 96),
        "dtype": "float32",
        "bytes": 256 * 64 * 64 * 96 * 4,
        "device": "/job:localhost/replica:0/task:0/device:CPU:0",
        "allocator": "bfc_cpu_allocator_for_gpu",
        "op": "gradient_tape/functional_1/small_b_1/convolution/Conv2DBackpropInput",
    }


def test_parses_an_eager_error_and_an_unknown_text():
    found = oom_explanation.parse_error_message(EAGER_MESSAGE)
    assert (found["shape"], found["dtype"], found["bytes"]) == ((1024, 1024), "float16", 2 * MIB)
    assert found["allocator"] == "GPU_0_bfc" and found["op"] is None
    assert set(oom_explanation.parse_error_message("something else").values()) == {None}


def test_layer_of_op_reads_keras_name_scopes():
    names = {"wide", "small_b", "head"}
    assert oom_explanation.layer_of_op("functional_1/wide_1/Relu", names) == "wide"
    assert oom_explanation.layer_of_op("gradient_tape/m/small_b/MatMul", names) == "small_b"
    assert oom_explanation.layer_of_op("optimizer/update/Mul", names) is None
    assert oom_explanation.layer_of_op(None, names) is None


@pytest.mark.parametrize(
    "op, expected",
    [
        ("{name}/UnsortedSegmentSum_1", True),
        ("{name}_1/Sqrt", True),
        ("loss_scale_optimizer/{name}/Mul_2", True),
        ("StatefulPartitionedCall/{name}/AssignAddVariableOp", True),
        ("functional_1/dense/MatMul", False),
        ("gradient_tape/{name}/dense/MatMul", False),
        ("while/{name}/Mul", False),
        ("{name}", False),
    ],
)
def test_an_op_of_the_optimizers_update_is_told_from_the_steps(op, expected):
    # Keras names optimizers uniquely in a process ("adam", "adam_1", ...)
    # and runs the update in that name's scope.
    optimizer = keras.optimizers.Adam()
    named = op.format(name=optimizer.name)
    assert oom_explanation.in_optimizer_update(named, optimizer) is expected
    wrapped = keras.optimizers.LossScaleOptimizer(optimizer)
    assert oom_explanation.in_optimizer_update(named, wrapped) is expected
    assert oom_explanation.in_optimizer_update(named, None) is False
    assert oom_explanation.in_optimizer_update(None, optimizer) is False


def test_live_chunks_are_named_by_the_layer_whose_tensor_has_their_size():
    model = make_model()
    wide = 128 * 64 * 64 * 96 * 4
    small = 128 * 64 * 64 * 8 * 4
    batch_input = 256 * 64 * 64 * 3 * 4
    dump = make_dump(in_use=[small, wide, batch_input, 12345], free=[64 * MIB, 16 * MIB])
    explanation = oom_explanation.explain(
        GRAPH_MESSAGE, dump, model, step=7, batch_size=256, micro_batches=2,
        replayed_with=3, limit_bytes=1024 * MIB,
    )
    assert explanation.failed_layer == "small_b" and explanation.backward is True
    assert explanation.micro_batch_size == 128
    assert explanation.in_use_bytes == small + wide + batch_input + 12345
    held = small + wide + batch_input + 12345 + 80 * MIB
    unheld = 1024 * MIB - held
    assert explanation.largest_free_chunk_bytes == max(64 * MIB, unheld)
    free = 80 * MIB + unheld
    assert explanation.fragmentation == pytest.approx(1 - max(64 * MIB, unheld) / free)
    assert explanation.demand_bytes == explanation.in_use_bytes + 256 * 64 * 64 * 96 * 4
    # Over the limit: memory ran out, not a block big enough.
    assert explanation.fitting_fraction is None
    fragmented = explanation._replace(limit_bytes=2048 * MIB, largest_free_chunk_bytes=96 * MIB)
    assert fragmented.fitting_fraction == pytest.approx(0.25)
    tensors = explanation.largest_tensors
    assert [t.bytes for t in tensors] == sorted([small, wide, batch_input, 12345], reverse=True)
    assert (tensors[0].layers, tensors[0].kind, tensors[0].shape) == (
        ("wide",), "output", (128, 64, 64, 96)
    )
    assert (tensors[1].layers, tensors[1].kind) == (("small_a", "small_b"), "output")
    assert (tensors[2].layers, tensors[2].kind) == (("input",), "input")
    assert tensors[3] == oom_explanation.TensorEntry(12345, (), None, None)
    line = oom_explanation.describe(explanation)
    assert line.startswith(
        "out of memory at step 7 (micro-batch 128 of a batch of 256): layer "
        "'small_b' (backward pass) asked for 384 MiB [256,64,64,96] float32 with "
    )
    assert "largest live tensor 192 MiB, output of 'wide'" in line


def test_a_subclassed_models_layer_is_named_without_static_shapes():
    class Classifier(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = keras.layers.Conv2D(64, 3, name="c1")
            self.head = keras.layers.Dense(10, name="head")

        def call(self, x):
            return self.head(keras.ops.mean(self.conv(x), axis=(1, 2)))

    model = Classifier()
    model(keras.ops.zeros((1, 8, 8, 3)))
    message = GRAPH_MESSAGE.replace(
        "gradient_tape/functional_1/small_b_1/convolution/Conv2DBackpropInput",
        "classifier_1/c1_1/BiasAdd",
    )
    explanation = oom_explanation.explain(
        message, make_dump([5 * MIB], []), model, step=1, batch_size=8, micro_batches=1
    )
    assert explanation.failed_layer == "c1" and explanation.backward is False
    assert explanation.largest_tensors[0].layers == ()


def test_without_a_dump_what_is_unknown_stays_none():
    explanation = oom_explanation.explain(
        EAGER_MESSAGE, None, make_model(), step=1, batch_size=None, micro_batches=1
    )
    assert explanation.source == "error_message"
    assert explanation.failed_allocation_bytes == 2 * MIB
    assert explanation.in_use_bytes is None and explanation.largest_tensors == ()
    assert explanation.demand_bytes is None
    assert "asked for 2 MiB [1024,1024] float16" in oom_explanation.describe(explanation)


def test_the_file_is_json_and_a_second_failure_of_the_step_gets_its_own(tmp_path):
    explanation = oom_explanation.explain(
        GRAPH_MESSAGE, make_dump([MIB], [MIB]), make_model(), step=3,
        batch_size=256, micro_batches=1,
    )
    first = oom_explanation.write(explanation, str(tmp_path), "why")
    second = oom_explanation.write(explanation, str(tmp_path))
    assert os.path.basename(first) == "oom-3.json"
    assert os.path.basename(second) == "oom-3-2.json"
    data = json.loads(open(first).read())
    assert data["explanation"] == "why" and data["failed_shape"] == [256, 64, 64, 96]
    assert data["largest_tensors"] == [
        {"bytes": MIB, "layer": None, "kind": None, "shape": None}
    ]


def test_dump_capture_sets_the_variable_and_restores_it(tmp_path, monkeypatch):
    monkeypatch.delenv(oom_explanation.MEMORY_DUMP_VARIABLE, raising=False)
    capture = oom_explanation.MemoryDumpCapture()
    prefix = os.environ[oom_explanation.MEMORY_DUMP_VARIABLE]
    assert capture.take_latest() is None
    # What the allocator writes at a failure: `<prefix>_<allocator>.<us>`.
    for stamp, in_use in ((100, [MIB]), (200, [2 * MIB])):
        with open(f"{prefix}_bfc.{stamp}", "wb") as file:
            file.write(make_dump(in_use, []).SerializeToString())
    assert capture.take_latest().stats.bytes_in_use == 2 * MIB
    assert capture.take_latest() is None  # Read once, then removed.
    capture.close()
    assert oom_explanation.MEMORY_DUMP_VARIABLE not in os.environ
    assert not os.path.exists(os.path.dirname(prefix))
    # The user's own setting is kept, and so are their files.
    mine = str(tmp_path / "dump")
    monkeypatch.setenv(oom_explanation.MEMORY_DUMP_VARIABLE, mine)
    capture = oom_explanation.MemoryDumpCapture()
    with open(f"{mine}_bfc.5", "wb") as file:
        file.write(make_dump([MIB], []).SerializeToString())
    assert capture.take_latest().stats.bytes_in_use == MIB
    capture.close()
    assert os.environ[oom_explanation.MEMORY_DUMP_VARIABLE] == mine
    assert os.path.exists(f"{mine}_bfc.5")


def test_dumps_never_pile_up_and_a_killed_process_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(oom_explanation.MEMORY_DUMP_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # A directory of a process that no longer runs (a fit stopped by a
    # timeout), one of a running process (this one), and an old-style name.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"keras_memguard-dump-{dead.stdout.strip()}-abc"
    stale.mkdir()
    (stale / "memory_bfc.1").write_bytes(b"x" * 1000)
    live = tmp_path / f"keras_memguard-dump-{os.getpid()}-def"
    live.mkdir()
    old_style = tmp_path / "keras_memguard-dump-xyz"
    old_style.mkdir()
    day_old = time.time() - 25 * 3600
    os.utime(old_style, (day_old, day_old))
    recent_old_style = tmp_path / "keras_memguard-dump-uvw"
    recent_old_style.mkdir()
    capture = oom_explanation.MemoryDumpCapture()
    assert not stale.exists() and not old_style.exists()
    assert live.exists() and recent_old_style.exists()
    prefix = os.environ[oom_explanation.MEMORY_DUMP_VARIABLE]
    # The allocator retrying writes many dumps for one error: one is read,
    # none is left.
    for stamp in range(50):
        with open(f"{prefix}_bfc.{stamp}", "wb") as file:
            file.write(make_dump([MIB * (stamp + 1)], []).SerializeToString())
    assert capture.take_latest().stats.bytes_in_use == 50 * MIB
    assert os.listdir(os.path.dirname(prefix)) == []
    capture.close()
