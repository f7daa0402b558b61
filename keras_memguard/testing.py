"""Run code under a real, capped TensorFlow allocator.

TensorFlow's CPU allocator becomes a BFC allocator with a hard cap when
`TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB=N` are set
before TensorFlow is imported: going past the cap raises a real
`tf.errors.ResourceExhaustedError`, exactly as a full GPU does. TensorFlow
reads these variables once per process, so each cap needs its own process;
`run_with_memory_cap` starts one.

oneDNN is switched off in capped processes: with it on, a second
out-of-memory error in one process can crash TensorFlow 2.21.

`act_as_gpu` (or `as_gpu=True` on the runners) makes a capped process
behave as Keras and TensorFlow do on a GPU, the path users take: the
allocator holds the whole cap as one region from the start (TensorFlow's
GPU allocator without memory growth), `jit_compile="auto"` compiles
the step with XLA wherever the model supports it, and ops run one at a
time, as TensorFlow runs a GPU's kernels.
"""

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, NamedTuple, Optional

RESULT_MARKER = "KERAS_MEMGUARD_RESULT "
# Run before the child's own code when `as_gpu=True`.
_AS_GPU_PRELUDE = "import keras_memguard.testing as _t; _t.act_as_gpu(); del _t\n"
_gpu_jit = None


def act_as_gpu():
    """Makes this process's capped CPU behave as Keras and TensorFlow on a GPU.

    Three things differ between the capped CPU and a GPU, and all change
    what fits:

    - TensorFlow's GPU allocator takes the whole memory as one region at
      its first allocation (unless memory growth is on); the CPU one grows
      region by region and hands out whole regions for tensors up to half
      their size, so a fresh process fits less. This reserves the rest of
      the cap as one free region now.
    - Keras resolves `jit_compile="auto"` to XLA wherever a GPU is present
      and the model supports it (not under a `tf.distribute` strategy), and
      to no XLA on a CPU-only machine. From now on it resolves as on a GPU.
    - TensorFlow runs a GPU's kernels inline, one after another in the
      order its executor readies them; on the CPU, independent ops run at
      once on the inter-op thread pool and keep more tensors alive
      together, by a share that changes from run to run and is largest at
      small batches, where ops are short. This sets one inter-op thread,
      so ops run one at a time as on a GPU.

    Call it once, at the start of a process whose allocator is capped
    (`memory_cap_env`), before TensorFlow runs its first op.

    Raises:
        RuntimeError: If the process's CPU allocator is not capped, or
            TensorFlow already runs ops on more than one inter-op thread.

    Example:

    ```python
    from keras_memguard.testing import act_as_gpu, run_with_memory_cap

    run_with_memory_cap("model.fit(...)", memory_limit_mib=600, as_gpu=True)
    ```
    """
    global _gpu_jit
    import tensorflow as tf

    from keras_memguard.backends.tensorflow import region
    from keras_memguard.backends.tensorflow.probe import AllocatorProbe
    from keras_memguard.backends import compat

    if tf.config.threading.get_inter_op_parallelism_threads() != 1:
        try:
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            raise RuntimeError(
                "act_as_gpu must run before TensorFlow runs its first op: "
                "TensorFlow then fixes its inter-op threads, and a GPU runs "
                "one op at a time. Received: "
                f"{tf.config.threading.get_inter_op_parallelism_threads()} "
                "inter-op threads (0: one per core)"
            ) from None
    probe = AllocatorProbe()
    if probe.mode != "bfc":
        raise RuntimeError(
            "act_as_gpu needs TensorFlow's capped CPU allocator: set "
            "TF_CPU_ALLOCATOR_USE_BFC=true and TF_CPU_BFC_MEM_LIMIT_IN_MB "
            "before TensorFlow is imported (memory_cap_env). Received: "
            f"allocator mode {probe.mode!r}"
        )
    region.reserve_bfc_regions(probe)
    if _gpu_jit is None:
        _gpu_jit = compat.resolving_auto_jit_compile_as_on_gpu()
        _gpu_jit.__enter__()


def memory_cap_env(memory_limit_mib, base_env=None):
    """Returns environment variables that cap TensorFlow's CPU allocator.

    Args:
        memory_limit_mib: The cap in MiB, a positive integer.
        base_env: Mapping to start from. Defaults to `os.environ`.

    Returns:
        A new `dict` with `TF_CPU_ALLOCATOR_USE_BFC`,
        `TF_CPU_BFC_MEM_LIMIT_IN_MB` and `TF_ENABLE_ONEDNN_OPTS` set.

    Raises:
        ValueError: If `memory_limit_mib` is not a positive integer.

    Example:

    >>> env = memory_cap_env(512, base_env={})
    >>> env["TF_CPU_BFC_MEM_LIMIT_IN_MB"]
    '512'
    """
    if (
        isinstance(memory_limit_mib, bool)
        or not isinstance(memory_limit_mib, int)
        or memory_limit_mib < 1
    ):
        raise ValueError(
            "`memory_limit_mib` must be a positive integer. "
            f"Received: memory_limit_mib={memory_limit_mib!r}"
        )
    env = dict(os.environ if base_env is None else base_env)
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(memory_limit_mib)
    env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def address_space_cap_env(base_env=None):
    """Returns environment variables for a child whose address space is capped.

    Under an address-space cap the CPU probe reads the process's resident
    memory. glibc's `malloc` raises its mmap threshold each time a large
    block is freed, after which freed tensors stay in its heap, resident:
    the memory in use then climbs from batch to batch although nothing is
    alive, and a guard plans against memory that is free. A fixed threshold
    (`MALLOC_MMAP_THRESHOLD_`) hands every large block back when it is
    freed, so resident memory follows the tensors alive, as a device
    allocator's figure does. `run_with_address_space_cap` starts its child
    with these; a script that caps itself after a warm-up needs them at its
    start (glibc reads them once).

    Args:
        base_env: Mapping to start from. Defaults to `os.environ`.

    Returns:
        A new `dict` with `MALLOC_MMAP_THRESHOLD_` set (128 KiB) and
        `PYTHONUNBUFFERED` defaulted.

    Example:

    >>> address_space_cap_env(base_env={})["MALLOC_MMAP_THRESHOLD_"]
    '131072'
    """
    env = dict(os.environ if base_env is None else base_env)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def emit_result(value):
    """Sends a JSON-serializable value back to `run_with_memory_cap`.

    Call it once, from the code run under the cap.

    Args:
        value: Any value `json.dumps` accepts.
    """
    sys.stdout.write(RESULT_MARKER + json.dumps(value) + "\n")
    sys.stdout.flush()


class CappedRun(NamedTuple):
    """What a capped subprocess did.

    Attributes:
        returncode: The process exit status.
        stdout: Everything it printed to standard output.
        stderr: Everything it printed to standard error.
        result: The value passed to `emit_result`, or `None`.
    """

    returncode: int
    stdout: str
    stderr: str
    result: Optional[Any]


def run_with_memory_cap(
    code, memory_limit_mib, timeout=600, env=None, check=True, as_gpu=False
):
    """Runs Python source in a new process under a capped allocator.

    Args:
        code: Python source to run. It may call
            `keras_memguard.testing.emit_result(value)` to return a value.
        memory_limit_mib: The allocator cap in MiB.
        timeout: Seconds before the process is killed. Defaults to `600`.
        env: Extra environment variables for the process. Defaults to `None`.
        check: If `True`, a non-zero exit raises `RuntimeError` carrying the
            process output. Defaults to `True`.
        as_gpu: If `True`, the process calls `act_as_gpu` first. Defaults
            to `False`.

    Returns:
        A `CappedRun`.

    Raises:
        RuntimeError: If `check` is `True` and the process failed.
        subprocess.TimeoutExpired: If the process outran `timeout`.

    Example:

    ```python
    run = run_with_memory_cap(
        "import tensorflow as tf\\n"
        "from keras_memguard.testing import emit_result\\n"
        "emit_result(tf.config.experimental.get_memory_info('CPU:0'))",
        memory_limit_mib=256,
    )
    print(run.result["current"])
    ```
    """
    return run_script_with_memory_cap(
        ["-c", textwrap.dedent(code)], memory_limit_mib, timeout, env, check, as_gpu
    )


def run_script_with_memory_cap(
    arguments, memory_limit_mib, timeout=600, env=None, check=True, as_gpu=False
):
    """Runs `python ARGUMENTS...` in a new process under a capped allocator.

    The one runner of the tests' and benchmarks' capped processes: a script
    (`["bench/bench_planner.py", "--child", spec]`) or `["-c", source]`.

    Args:
        arguments: The interpreter's arguments, a list of strings.
        memory_limit_mib: The allocator cap in MiB.
        timeout: Seconds before the process is killed. Defaults to `600`.
        env: Extra environment variables for the process. Defaults to `None`.
        check: If `True`, a non-zero exit raises `RuntimeError` carrying the
            process output. Defaults to `True`.
        as_gpu: If `True`, the process calls `act_as_gpu` before the script
            or source runs. Defaults to `False`.

    Returns:
        A `CappedRun`; its `result` is the last value the process passed to
        `emit_result`.

    Raises:
        RuntimeError: If `check` is `True` and the process failed.
        subprocess.TimeoutExpired: If the process outran `timeout`.

    Example:

    ```python
    run = run_script_with_memory_cap(
        ["bench/bench_planner.py", "--child", '{"part": "cnn", ...}'], 600,
        check=False,
    )
    ```
    """
    process_env = memory_cap_env(memory_limit_mib)
    if env:
        process_env.update(env)
    if as_gpu:
        arguments = _after_act_as_gpu(list(arguments))
    completed = subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=process_env,
    )
    result = None
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"Capped process exited with status {completed.returncode}.\n"
            f"--- stdout ---\n{completed.stdout[-4000:]}\n"
            f"--- stderr ---\n{completed.stderr[-8000:]}"
        )
    return CappedRun(completed.returncode, completed.stdout, completed.stderr, result)


def _after_act_as_gpu(arguments):
    """The interpreter's arguments, with `act_as_gpu()` run first."""
    if arguments[0] == "-c":
        return ["-c", _AS_GPU_PRELUDE + arguments[1], *arguments[2:]]
    script = arguments[0]
    runner = (
        _AS_GPU_PRELUDE
        + "import runpy, sys\n"
        + f"sys.argv = {arguments!r}\n"
        + f"sys.path.insert(0, {os.path.dirname(os.path.abspath(script))!r})\n"
        + f"runpy.run_path({script!r}, run_name='__main__')\n"
    )
    return ["-c", runner]


def run_with_address_space_cap(
    code, address_space_mib, timeout=600, env=None, check=True, arguments=()
):
    """Runs Python source in a new process whose address space is capped.

    The child sets `resource.setrlimit(RLIMIT_AS, (N, N))` before anything
    else runs: an allocation past the cap fails as it would when a machine's
    memory is exhausted. PyTorch's CPU allocator then raises a real,
    catchable `RuntimeError` ("DefaultCPUAllocator: can't allocate memory"),
    the stand-in for a full device on Keras' PyTorch backend. Importing
    Keras on torch takes about a GiB of address space by itself, so a cap
    must sit above that. Linux only (`resource`).

    Args:
        code: Python source to run. It may call
            `keras_memguard.testing.emit_result(value)` to return a value.
        address_space_mib: The cap in MiB, a positive integer.
        timeout: Seconds before the process is killed. Defaults to `600`.
        env: Extra environment variables for the process. Defaults to `None`.
        check: If `True`, a non-zero exit raises `RuntimeError` carrying the
            process output. Defaults to `True`.
        arguments: Further arguments for the child, in its `sys.argv[1:]`.
            Defaults to `()`.

    Returns:
        A `CappedRun`.

    Raises:
        ValueError: If `address_space_mib` is not a positive integer.
        RuntimeError: If `check` is `True` and the process failed.
        subprocess.TimeoutExpired: If the process outran `timeout`.

    Example:

    ```python
    run = run_with_address_space_cap(
        "import torch\\n"
        "from keras_memguard.testing import emit_result\\n"
        "emit_result(torch.empty(2**20).numel())",
        address_space_mib=3000,
        env={"KERAS_BACKEND": "torch"},
    )
    print(run.result)
    ```
    """
    if (
        isinstance(address_space_mib, bool)
        or not isinstance(address_space_mib, int)
        or address_space_mib < 1
    ):
        raise ValueError(
            "`address_space_mib` must be a positive integer. "
            f"Received: address_space_mib={address_space_mib!r}"
        )
    limit = address_space_mib * 2**20
    prelude = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
        "del resource\n"
    )
    process_env = address_space_cap_env()
    if env:
        process_env.update(env)
    completed = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=process_env,
    )
    result = None
    for line in completed.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER):])
    if check and completed.returncode != 0:
        raise RuntimeError(
            f"Capped process exited with status {completed.returncode}.\n"
            f"--- stdout ---\n{completed.stdout[-4000:]}\n"
            f"--- stderr ---\n{completed.stderr[-8000:]}"
        )
    return CappedRun(completed.returncode, completed.stdout, completed.stderr, result)
