"""Guarded training under MultiWorkerMirroredStrategy: two real workers.

Each test starts two worker processes on 127.0.0.1 (a `TF_CONFIG` cluster),
each under a real capped BFC CPU allocator, bounds them with a timeout and
kills whatever is left. Workers report through `emit_result`.
"""

import json
import socket
import subprocess
import time

import numpy as np
import pytest

import keras

from keras_memguard.testing import RESULT_MARKER
from keras_memguard.testing import memory_cap_env
import programs

# Every test here starts processes of its own.
pytestmark = pytest.mark.slow

WORKER_TIMEOUT = 150  # seconds, for both workers together (a hang never ends)

# The test model at 48x48 inputs and 128 samples per worker: with 2 GiB
# (worker 0) it fits at one micro-batch; capped at CAP_OOM_MIB (worker 1)
# it runs out of memory at one micro-batch and fits at two (checked at
# caps of 96, 110 and 124 MiB).
CAP_OOM_MIB = 110
OOM_SCENARIO = {"side": 48, "n": 512, "batch": 256}


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_workers(scenario, caps_mib, timeout=WORKER_TIMEOUT):
    """Runs the worker program on a two-task cluster; returns both results."""
    ports = _free_ports(len(caps_mib))
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = []
    start = time.monotonic()
    try:
        for index, cap in enumerate(caps_mib):
            env = memory_cap_env(cap)
            env.update(
                TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": index}}
                ),
                MEMGUARD_SCENARIO=json.dumps(scenario),
                KERAS_BACKEND="tensorflow",
            )
            processes.append(
                subprocess.Popen(
                    programs.command("multi_worker_worker"),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        outputs = []
        for process in processes:
            left = max(1.0, timeout - (time.monotonic() - start))
            try:
                outputs.append(process.communicate(timeout=left))
            except subprocess.TimeoutExpired:
                pytest.fail(f"Workers still running after {timeout} s: a hang.")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    results = []
    for process, (stdout, stderr) in zip(processes, outputs):
        lines = [l for l in stdout.splitlines() if l.startswith(RESULT_MARKER)]
        assert lines, f"no result (status {process.returncode}):\n{stderr[-6000:]}"
        results.append(json.loads(lines[-1][len(RESULT_MARKER):]))
    return results, time.monotonic() - start


# Worker 0 reads its usage against a 1 MiB limit (far above threshold),
# worker 1 against 1 TiB (near zero): alone, only worker 0 would split.
ONLY_WORKER_0_SPLITS = [
    {"memory_limit": 1 << 20, "plan": False},
    {"memory_limit": 1 << 40, "plan": False},
]


def run_workers_without_error(scenario):
    """Both workers' results, each with room to spare; neither raised."""
    results, _ = run_workers(scenario, caps_mib=[2048, 2048])
    for result in results:
        assert "error" not in result, result.get("message")
    return results


def reference_weights(scenario):
    """Plain single-process training on the same global batches."""
    n, side = scenario["n"], scenario["side"]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((side, side, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, side, side, 3)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    model.fit(
        x, y, batch_size=scenario["batch"], epochs=1, shuffle=False, verbose=0
    )
    return model.get_weights()


def assert_same_weights(results, expected):
    for result in results:
        for got, want in zip(result["weights"], expected):
            np.testing.assert_allclose(np.array(got), want, atol=2e-6)


# The floor runs this one of the two-worker tests: its workers agree through
# TensorFlow's collectives, whose replays are MirroredStrategy's.
@pytest.mark.slow(floor=True)
def test_workers_agree_on_micro_batches_and_train_as_one_batch():
    scenario = {"side": 32, "n": 64, "batch": 16, "guard": ONLY_WORKER_0_SPLITS}
    first, second = results = run_workers_without_error(scenario)
    # Doubled at the same steps on both, up to one sample per micro-batch
    # (8 samples per worker).
    assert first["k"] == second["k"] == [2, 4, 8, 8]
    assert first["weights"] == second["weights"]
    assert first["loss"] == second["loss"]
    assert_same_weights(results, reference_weights(scenario))


def test_workers_plan_alike_from_agreed_readings_without_running_out_of_memory():
    # Worker 1's cap is too small for a batch at one micro-batch (see
    # CAP_OOM_MIB), worker 0 has room: planned from what both agreed on,
    # every batch fits on both at the same count.
    scenario = dict(OOM_SCENARIO, n=1024)
    scenario["guard"] = [{"plan_cache": False}] * 2
    results, _ = run_workers(scenario, caps_mib=[2048, CAP_OOM_MIB])
    for result in results:
        assert "error" not in result, result.get("message")
    first, second = results
    assert first["oom_recoveries"] == second["oom_recoveries"] == 0
    assert first["k"] == second["k"]
    # One micro-batch does not fit on worker 1: planned above it throughout.
    assert min(first["k"]) >= 2, first["k"]
    assert first["weights"] == second["weights"]
    assert_same_weights(results, reference_weights(scenario))


def test_out_of_memory_on_one_worker_is_replayed_on_all():
    # Worker 1's cap is too small for a batch at one micro-batch, not at
    # two; worker 0 has room. Both must replay the batch at k = 2.
    scenario = dict(OOM_SCENARIO, guard=[{"threshold": 1.0, "plan": False}] * 2)
    results, _ = run_workers(scenario, caps_mib=[2048, CAP_OOM_MIB])
    for result in results:
        assert "error" not in result, result.get("message")
    first, second = results
    assert first["oom_recoveries"] == second["oom_recoveries"] == 1
    assert first["k"] == second["k"]
    assert first["micro_batches"] == second["micro_batches"] == 2
    assert first["weights"] == second["weights"]
    assert_same_weights(results, reference_weights(scenario))


def test_out_of_memory_that_cannot_be_replayed_stops_all_workers_fast():
    # A `train_step` override cannot be split into a local phase and an
    # apply phase: when worker 1 runs out of memory, worker 0 may already
    # wait in the gradient all-reduce. Both must stop with the package's
    # error instead of hanging.
    scenario = dict(OOM_SCENARIO, custom_step=True, guard=[{"threshold": 1.0}] * 2)
    results, seconds = run_workers(scenario, caps_mib=[2048, CAP_OOM_MIB])
    for result in results:
        assert result.get("error") == "DistributedOutOfMemoryError", result
        assert result["worker"] == 1
        assert "restart the workers" in result["message"]
    assert "This worker ran out of memory" in results[1]["message"]
    assert "Worker 1 ran out of memory" in results[0]["message"]
    # One out-of-memory error (about 10 s of allocator retries), no hang.
    assert abs(results[0]["seconds"] - results[1]["seconds"]) < 10


def test_code_that_fails_on_a_micro_batch_trains_whole_on_every_worker():
    # A model whose code needs each worker's 8 samples: the split that
    # worker 0's readings ask for (against a 1 MiB limit) fails while its
    # step is traced. Both workers go on with whole batches, as plain `fit`
    # trains them, where `fit` ended with the model's own error.
    scenario = {
        "side": 16, "n": 64, "batch": 16, "fixed_batch": 8, "guard": ONLY_WORKER_0_SPLITS,
    }
    first, second = results = run_workers_without_error(scenario)
    # The count after each batch: 2 after the first (decided from worker
    # 0's readings), then 1 from the second batch's failed split on.
    assert first["k"] == second["k"] == [2, 1, 1, 1]
    assert first["weights"] == second["weights"]
    from programs.multi_worker_worker import fixed_batch_model

    model = fixed_batch_model(scenario["side"], None)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 16, 16, 3)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_same_weights(results, model.get_weights())
