"""A short run of the JAX benchmark script (bench/jax_backend/)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "jax_backend" / "bench_jax_plan.py"


def test_bench_jax_plan_smoke_run():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KERAS_BACKEND="jax"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert "jax" in rows[0]
    measured = [r for r in rows if "compile_s" in r]
    assert len(measured) == 6 and all(r["need_mib"] > 0 for r in measured)
    assert any("error_percent" in r for r in rows)


GUARD_SCRIPT = SCRIPT.parent / "bench_jax_guard.py"


def test_bench_jax_guard_smoke_run():
    result = subprocess.run(
        [sys.executable, str(GUARD_SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KERAS_BACKEND="jax"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    medians = {r["variant"]: r for r in rows if "median_s" in r}
    assert set(medians) == {"plain", "guard", "guard+monitor"}
    assert all(r["median_s"] > 0 for r in medians.values())


GPU_SCRIPT = SCRIPT.parent / "bench_jax_gpu.py"


def gpu_bench():
    """`bench_jax_gpu`, imported from its folder."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_jax_gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_jax_gpu


def test_bench_jax_gpu_says_it_needs_a_gpu_where_there_is_none(tmp_path):
    # The script runs its parts on an NVIDIA GPU only; without nvidia-smi
    # on the PATH it stops at once, saying so.
    result = subprocess.run(
        [sys.executable, str(GPU_SCRIPT), "--parts", "probe"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, KERAS_BACKEND="jax", PATH=str(tmp_path)),
    )
    assert result.returncode == 1
    assert "bench_jax_gpu needs an NVIDIA GPU (nvidia-smi:" in result.stderr


@pytest.mark.slow
def test_bench_jax_gpu_own_step_part_runs_on_the_cpu(capsys):
    # The GPU part's code, on the CPU with a limit given: every `fit` trains.
    bench_jax_gpu = gpu_bench()
    bench_jax_gpu.part_own_step(32, memory_limit=1 << 30)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [r["run"] for r in rows] == ["plain", "guard", "guard, then a smaller batch"], rows
    assert all(r["error"] is None and r["weights"] == "changed" for r in rows), rows


@pytest.mark.slow
def test_bench_jax_gpu_whole_part_runs_on_the_cpu(capsys):
    # The GPU part's code, on the CPU's two devices with a limit given.
    bench_jax_gpu = gpu_bench()
    bench_jax_gpu.part_whole(8, rounds=1, steps=2, memory_limit=1 << 30)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [(r["setup"], r["devices"]) for r in rows] == [("own_step", 2), ("data_parallel", 2)]
    assert all(r["largest_weight_difference"] < 1e-5 and r["guard_step_ms"] > 0 for r in rows), rows
