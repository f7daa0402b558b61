"""A short run of bench/bench_backends.py on Keras' JAX backend."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_backends.py"

FIGURE_LINES = (
    "| plain B=32 |",
    "| MemoryMonitor |",
    "| guard k=1 (plan) |",
    "| guard k=1 (fixed) |",
    "| guard k=4, B=32 |",
    "| keras GA k=4, B=8 |",
    "| plain B=8 |",
    "jax: first batch, mlp, B=32",
)


@pytest.mark.slow
def test_bench_backends_smoke_run_on_jax():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KERAS_BACKEND="jax"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Keras backend jax: JAX" in result.stdout, result.stdout[-3000:]
    for line in FIGURE_LINES:
        assert line in result.stdout, (line, result.stdout[-3000:])
