"""Runs the whole test process under TensorFlow's BFC CPU allocator.

Set before TensorFlow is imported, so every allocation is counted (the
default CPU allocator misses small ones) and a generous cap is in force.
Tests that need a small cap, and so real out-of-memory errors, start their own
process through `keras_memguard.testing.run_with_memory_cap`.
"""

import os

SUITE_MEMORY_LIMIT_MIB = 8192

# The JAX and PyTorch backends' tests run in a process of their own
# (KERAS_BACKEND=jax or torch): each run collects its own folder only.
_BACKEND_FOLDERS = {"jax": "jax_backend", "torch": "torch_backend"}
collect_ignore = [
    folder
    for backend, folder in _BACKEND_FOLDERS.items()
    if os.environ.get("KERAS_BACKEND") != backend
]

os.environ.update(
    {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(SUITE_MEMORY_LIMIT_MIB),
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
    }
)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _plan_cache_per_test(tmp_path, monkeypatch):
    """Each test gets its own `$KERAS_HOME`: no plan is shared by two tests
    (their models are often alike), none lands in the user's home."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
