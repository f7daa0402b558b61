"""The PyTorch backend's tests: a pytest process of their own.

Run as `KERAS_BACKEND=torch python -m pytest tests/torch_backend`;
`tests/conftest.py` leaves this folder out of the other backends' runs.
Keras reads its backend once, at import, so it is set here before any test
module imports Keras. Everything is skipped where torch is not installed.
"""

import importlib.util
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
# The shared model builders (`torch_models`) import as a top-level module.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("torch") is None:
    collect_ignore_glob = ["test_*.py"]
