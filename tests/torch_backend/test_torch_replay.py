"""The replaying train function: out-of-memory errors, replays, nothing twice.

In-process tests raise torch's own `torch.OutOfMemoryError` from inside the
forward pass (a layer, on chosen calls), after BatchNormalization and
Dropout have run: the replayed run must equal a run that used the final
counts from the start. The slow test hits a real allocation failure of
torch's CPU allocator in a child process under an address-space cap.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import keras

from torch_models import make_failing
from torch_models import make_mlp
from torch_models import max_relative_difference
from torch_models import mlp_data
from keras_memguard.backends.torch.replay import CPU_OUT_OF_MEMORY
from keras_memguard.backends.torch.replay import ReplayingTrainFunction
from keras_memguard.backends.torch.replay import StepOutOfMemory
from keras_memguard.backends.torch.replay import double_micro_batches
from keras_memguard.backends.torch.replay import failed_allocation_bytes
from keras_memguard.backends.torch.replay import is_out_of_memory
from keras_memguard.errors import MicroBatchTooLargeError
from keras_memguard.testing import run_with_address_space_cap

CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.10 GiB of which 1.06 GiB is free."
)
CPU_MESSAGE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
    "allocate memory: you tried to allocate 471859200 bytes. Error code 12 "
    "(Cannot allocate memory)"
)
FIT = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "cpu_oom_replay.py")


def test_out_of_memory_errors_are_recognized():
    assert is_out_of_memory(torch.OutOfMemoryError(CUDA_MESSAGE))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("out of memory"))
    assert is_out_of_memory(RuntimeError(CPU_MESSAGE))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError(CPU_OUT_OF_MEMORY))
    assert not is_out_of_memory(KeyboardInterrupt())


def test_failed_allocation_sizes_are_read_from_the_message():
    assert failed_allocation_bytes(torch.OutOfMemoryError(CUDA_MESSAGE)) == 2 * 2**30
    assert failed_allocation_bytes(RuntimeError(CPU_MESSAGE)) == 471859200
    assert failed_allocation_bytes(torch.OutOfMemoryError("out of memory")) is None


def test_default_handler_doubles_then_gives_up_at_one_sample():
    error = torch.OutOfMemoryError(CUDA_MESSAGE)
    assert double_micro_batches(StepOutOfMemory(16, 2, error, None)) == 4
    assert double_micro_batches(StepOutOfMemory(6, 4, error, None)) == 6
    with pytest.raises(MicroBatchTooLargeError, match="one sample") as caught:
        double_micro_batches(StepOutOfMemory(6, 6, error, None))
    assert caught.value.__cause__ is error


def _counts(*counts):
    """A `plan` giving `counts[i]` to the i-th batch, the last one after."""
    seen = []

    def plan(batch):
        seen.append(batch)
        return counts[min(len(seen), len(counts)) - 1]

    return plan


def test_replayed_batches_apply_nothing_twice():
    """Fails inside the 2nd micro-batch of batch 1 (after micro-batch 1 ran
    forward and backward, after BatchNormalization and Dropout), and in
    the 1st micro-batch of batch 2. The run equals one planned at the
    counts the replays ended on: weights, optimizer, moving statistics,
    seed state and logs."""
    x, y = mlp_data()
    keras.utils.set_random_seed(0)
    model = make_failing({2, 7}, torch.OutOfMemoryError, CUDA_MESSAGE)
    keras.utils.set_random_seed(0)
    reference = make_failing()
    reference.set_weights(model.get_weights())

    function = ReplayingTrainFunction(model, micro_batches=2)
    model.train_function = function
    # `Dropout()` draws from torch's global generator: the same draws.
    keras.utils.set_random_seed(1)
    history = model.fit(x, y, **FIT)
    reference.train_function = ReplayingTrainFunction(reference, plan=_counts(4, 8))
    keras.utils.set_random_seed(1)
    reference_history = reference.fit(x, y, **FIT)

    assert function.replays == 2
    assert [f.micro_batches for f in function.failures] == [2, 4]
    assert [f.allocation_bytes for f in function.failures] == [2 * 2**30] * 2
    assert all(f.error.__traceback__ is None for f in function.failures)
    assert function.micro_batches == 8
    assert function.last_batch_size == 12
    assert max_relative_difference(reference, model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 8
    for key, values in reference_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-6)
    assert all(v.value.grad is None or torch.isfinite(v.value.grad).all() for v in model.trainable_weights)


def test_shrink_mode_goes_on_with_the_rows_not_yet_applied():
    """In shrink mode the micro-batches applied before a failure stay; the
    replay trains the batch's remaining rows."""
    x, y = mlp_data(16)
    keras.utils.set_random_seed(0)
    model = make_failing({3}, torch.OutOfMemoryError, CUDA_MESSAGE)
    function = ReplayingTrainFunction(model, micro_batches=4, mode="shrink")
    model.train_function = function
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    # 4 rows at a time, then the failure in rows 8-12; the remaining 8
    # rows at the size 8 micro-batches give the batch (2 rows): 2 + 4.
    assert function.replays == 1
    assert int(model.optimizer.iterations.numpy()) == 2 + 4


def test_an_error_that_is_not_out_of_memory_passes_through():
    x, y = mlp_data(16)
    model = make_failing({1}, RuntimeError, "mat1 and mat2 shapes cannot be multiplied")
    weights = [v.numpy() for v in model.trainable_weights]
    function = ReplayingTrainFunction(model, micro_batches=2)
    model.train_function = function
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not is_out_of_memory(caught.value)
    assert function.replays == 0 and function.failures == []
    assert int(model.optimizer.iterations.numpy()) == 0
    for before, after in zip(weights, model.trainable_weights):
        np.testing.assert_array_equal(before, after.numpy())


def test_handler_must_return_a_larger_count():
    x, y = mlp_data(16)
    model = make_failing({1}, torch.OutOfMemoryError, CUDA_MESSAGE)
    model.train_function = ReplayingTrainFunction(model, micro_batches=2, on_out_of_memory=lambda f: 2)
    with pytest.raises(ValueError, match=r"larger than the one that failed \(2\).*Received: 2"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_one_sample_per_micro_batch_that_fails_raises():
    x, y = mlp_data(4)
    model = make_failing(set(range(1, 100)), torch.OutOfMemoryError, CUDA_MESSAGE)
    function = ReplayingTrainFunction(model)
    model.train_function = function
    with pytest.raises(MicroBatchTooLargeError):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert [f.micro_batches for f in function.failures] == [1, 2, 4]
    assert int(model.optimizer.iterations.numpy()) == 0


def test_jit_compile_runs_the_step_eagerly_with_a_warning():
    model = make_mlp()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=True)
    model.train_function = ReplayingTrainFunction(model, micro_batches=2)
    x, y = mlp_data(16)
    with pytest.warns(UserWarning, match="runs eagerly"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


@pytest.mark.slow
def test_real_cpu_out_of_memory_is_replayed(tmp_path):
    """Plain `fit` of a CNN at batch 512 runs out of memory under the cap;
    the mixin trains every batch, ending with the weights of an uncapped
    run at the count it ended on."""
    with open(PROGRAM) as file:
        program = file.read()
    env = {"KERAS_BACKEND": "torch"}
    # Plain `fit` at 512 maps 2.7 GiB at its peak on Keras 3.8 and 3.2 GiB
    # on 3.15; 2.5 GiB is short of both.
    capped = run_with_address_space_cap(
        program, 2500, env=env, arguments=["capped", str(tmp_path / "capped.npz")]
    )
    result = capped.result
    assert result["plain_error"] is not None, "plain fit did not run out of memory"
    assert CPU_OUT_OF_MEMORY in result["plain_error"]
    assert result["plain_error_is_out_of_memory"]
    assert result["replays"] >= 1
    assert all(failure[3] for failure in result["failures"])
    assert result["iterations"] == 2  # every batch trained, once
    k = result["micro_batches"]

    reference = subprocess.run(
        [sys.executable, PROGRAM, "reference", str(tmp_path / "reference.npz"), str(k)],
        capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )
    assert reference.returncode == 0, reference.stderr[-4000:]
    with np.load(tmp_path / "capped.npz") as a, np.load(tmp_path / "reference.npz") as b:
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7)
