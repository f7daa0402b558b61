"""The JAX backend's tests: a pytest process of their own.

Run as `KERAS_BACKEND=jax python -m pytest tests/jax_backend`; `tests/conftest.py`
leaves this folder out of the TensorFlow run. Keras reads its backend once,
at import, so it is set here before any test module imports Keras. Two CPU
devices (XLA's host platform split) let the tests see several devices.
Everything is skipped where jax is not installed.
"""

import importlib.util
import os

os.environ["KERAS_BACKEND"] = "jax"
# The tests are written for JAX's CPU device (no memory statistics, limits
# passed as `memory_limit`), also on a machine with a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

if importlib.util.find_spec("jax") is None:
    collect_ignore_glob = ["test_*.py"]
