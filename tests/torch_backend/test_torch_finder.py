"""`find_batch_size` on PyTorch: planned trial steps, read from the torch probe."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import torch

import keras_memguard
from keras_memguard.testing import RESULT_MARKER, address_space_cap_env

ROOM = 160 << 20


def resident_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.random((n, 16, 16, 3), dtype=np.float32), rng.integers(0, 4, n)


def state_of(model):
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    return [np.array(v.numpy()) for v in variables]


def test_trials_run_and_everything_is_put_back():
    model = small_cnn()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = state_of(model)
    limit = resident_bytes() + ROOM
    result = keras_memguard.find_batch_size(
        model, x, y, batch_size=8192, memory_limit=limit, max_trials=4, verbose=0
    )
    for a, b in zip(before, state_of(model)):
        np.testing.assert_array_equal(a, b)
    ran = [t for t in result.trials if t.peak_bytes is not None]
    assert ran and len(result.trials) <= 4
    # The answer is the largest batch that ran under the target (a trial
    # above it bounds the search; no allocator's prefetch landing to leave
    # room for, as on TensorFlow).
    under = [t.batch_size for t in ran if t.peak_bytes <= 0.95 * limit]
    assert result.largest_batch_size == max(under), result.trials
    assert result.limit_bytes == limit
    assert all(t.peak_bytes <= limit for t in ran)
    assert result.micro_batches >= 8192 / result.largest_batch_size


def test_a_data_loader_is_refused_by_name():
    model = small_cnn()
    x, y = data(8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=4,
    )
    with pytest.raises(ValueError) as error:
        keras_memguard.find_batch_size(model, loader, memory_limit=ROOM)
    assert "Received: x=DataLoader" in str(error.value)


def test_bad_arguments_say_what_is_valid():
    model = small_cnn()
    x, y = data(8)
    with pytest.raises(ValueError) as error:
        keras_memguard.find_batch_size(model, x, y, memory_limit=ROOM, threshold=1.5)
    assert "`threshold` must be in (0, 1]. Received: threshold=1.5" in str(error.value)


# A child capped as a machine whose memory runs out: after importing and a
# tiny warm-up `fit`, its address space may grow by HEADROOM, and the
# finder is told the resident memory plus HEADROOM.
_CHILD = """
import json, resource, sys
import numpy as np, keras
import keras_memguard
from keras_memguard.testing import emit_result

HEADROOM = 600 * 2**20

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def make():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64, 64, 3)),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 64, 64, 3)).astype("float32")
y = rng.integers(0, 10, size=(512,))
make().fit(x[:8], y[:8], batch_size=8, verbose=0)
size, resident = status("VmSize"), status("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))
if sys.argv[1] == "find":
    found = keras_memguard.find_batch_size(make(), x, y, memory_limit=resident + HEADROOM, verbose=0)
    emit_result({
        "answer": found.largest_batch_size,
        "errors": found.out_of_memory_errors,
        "trials": [[t.batch_size, t.peak_bytes] for t in found.trials],
    })
else:
    try:
        make().fit(x, y, batch_size=int(sys.argv[2]), epochs=1, verbose=0)
    except RuntimeError as error:
        if "can't allocate memory" not in str(error):
            raise
        emit_result({"trained": False})
    else:
        emit_result({"trained": True})
"""


def _in_a_fresh_process(*arguments):
    import json

    env = dict(address_space_cap_env(), KERAS_BACKEND="torch")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), *map(str, arguments)],
        capture_output=True, text=True, timeout=400, env=env,
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(done.stderr[-3000:])


@pytest.mark.slow
def test_the_answer_trains_in_plain_fit_in_a_fresh_process_and_is_close():
    found = _in_a_fresh_process("find")
    answer = found["answer"]
    assert found["errors"] <= 2, found
    assert _in_a_fresh_process("fit", answer)["trained"], found
    # Not far below the largest that trains: 1.6 times the answer does not.
    # (On the CPU the finder's own process keeps address space that earlier
    # trials and an error left mapped, which a fresh process has free: its
    # answers ran 0.7-0.85 of the largest batch a fresh process trains.)
    assert not _in_a_fresh_process("fit", -(-answer * 8 // 5))["trained"], found
