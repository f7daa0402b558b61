"""The PyTorch backend's tests: a pytest process of their own.

Run as `KERAS_BACKEND=torch python -m pytest tests/torch_backend`;
`tests/conftest.py` leaves this folder out of the other backends' runs.
Keras reads its backend once, at import, so it is set here before any test
module imports Keras. Everything is skipped where torch is not installed.
"""

import importlib.util
import os
import sys

import pytest

os.environ["KERAS_BACKEND"] = "torch"
# The shared model builders (`torch_models`) import as a top-level module.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]


def _kernel_shows_a_freed_block_in_vmhwm():
    """Whether `VmHWM` keeps a 64 MiB block made, touched and freed.

    The host probe's interval peak is the kernel's `VmHWM`. Read here with
    nothing of the package: where the kernel does not raise it for such a
    block, no probe can, and the tests of that peak are skipped.
    """
    import torch

    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False

    def read():
        values = {}
        with open("/proc/self/status") as status:
            for line in status:
                key = line.split(":")[0]
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(line.split()[1]) * 1024
        return values

    held = torch.ones(16 * 2**20)  # 64 MiB, touched
    del held
    values = read()
    return values.get("VmHWM", 0) - values.get("VmRSS", 0) >= 48 * 2**20


@pytest.fixture
def freed_peaks_in_vmhwm():
    """Skips a test where the kernel's `VmHWM` misses a freed block."""
    if not _kernel_shows_a_freed_block_in_vmhwm():
        pytest.skip("The kernel's VmHWM did not keep a 64 MiB block made and freed here.")
