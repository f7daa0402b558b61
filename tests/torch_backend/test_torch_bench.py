"""A short run of bench/bench_backends.py on Keras' PyTorch backend."""

import json
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
    "torch: first batch, mlp, B=32",
)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="The CPU probe reads /proc/self/status."
)
def test_bench_backends_smoke_run_on_torch():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=300,
        # The host path (resident memory), also on a machine with a GPU.
        env=dict(os.environ, KERAS_BACKEND="torch", KERAS_TORCH_DEVICE="cpu"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Keras backend torch: torch" in result.stdout, result.stdout[-3000:]
    for line in FIGURE_LINES:
        assert line in result.stdout, (line, result.stdout[-3000:])


GPU_SCRIPT = SCRIPT.parent / "torch_backend" / "bench_torch_gpu.py"


@pytest.mark.slow
def test_bench_torch_gpu_smoke_run_on_the_cpu():
    # Without CUDA the probe reads the host and the own-step part compares
    # plain and guarded `fit` on the CPU; the GPU halves say they are skipped.
    result = subprocess.run(
        [sys.executable, str(GPU_SCRIPT), "--parts", "probe,own_step"],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, KERAS_BACKEND="torch", CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = {}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            figures[(record["part"], record["figure"])] = record["value"]
    assert figures[("own_step", "device")] == "cpu", result.stdout[-3000:]
    assert figures[("own_step", "guard_own_log")] == [1.0, 1.0], figures
    assert figures[("own_step", "largest_relative_weight_difference")] < 1e-6, figures
    assert ("probe", "probe_sample_cost") in figures, figures
