"""Run code under a real, capped TensorFlow allocator.

TensorFlow's CPU allocator becomes a BFC allocator with a hard cap when
`TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB=N` are set
before TensorFlow is imported: going past the cap raises a real
`tf.errors.ResourceExhaustedError`, exactly as a full GPU does. TensorFlow
reads these variables once per process, so each cap needs its own process;
`run_with_memory_cap` starts one.

oneDNN is switched off in capped processes: with it on, a second
out-of-memory error in one process can crash TensorFlow 2.21.
"""

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, NamedTuple, Optional

RESULT_MARKER = "KERAS_MEMGUARD_RESULT "


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


def run_with_memory_cap(code, memory_limit_mib, timeout=600, env=None, check=True):
    """Runs Python source in a new process under a capped allocator.

    Args:
        code: Python source to run. It may call
            `keras_memguard.testing.emit_result(value)` to return a value.
        memory_limit_mib: The allocator cap in MiB.
        timeout: Seconds before the process is killed. Defaults to `600`.
        env: Extra environment variables for the process. Defaults to `None`.
        check: If `True`, a non-zero exit raises `RuntimeError` carrying the
            process output. Defaults to `True`.

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
        ["-c", textwrap.dedent(code)], memory_limit_mib, timeout, env, check
    )


def run_script_with_memory_cap(
    arguments, memory_limit_mib, timeout=600, env=None, check=True
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
