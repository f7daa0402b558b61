"""A short run of each benchmark under bench/, so that every one keeps working.

Each runs the way the README and bench/RESULTS.md run it, with the smallest
settings that still go through its parent and child processes: the figures
themselves are measured by hand (bench/RESULTS.md), never asserted here.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow

SMOKE_RUNS = {
    "bench_batch_size.py": (["--models", "cnn", "--methods", "memguard"], "| cnn | 600 | memguard |"),
    "bench_planner.py": (
        ["--parts", "cost,repeat", "--repeat-runs", "1"], "settled smallest / largest:"
    ),
    "bench_monitor.py": (["--rounds", "1", "--skip-fits"], "MemoryGuard: before the step"),
    "bench_growth.py": (
        ["--runs", "mlp", "--repeats", "1", "--epochs", "4", "--cost", "--cost-rounds", "1"],
        "steady runs: 1, runs with a growth warning: 0",
    ),
    "bench_guard.py": (["--parts", "1", "--rounds", "1", "--ks", "2"], "| k=2, B=256 |"),
    "bench_unseen.py": (
        ["--models", "mobilenet_v3", "--xla", "off", "--parts", "plain"], "| mobilenet_v3 | off | 64 |"
    ),
    "bench_escalation.py": (
        ["--rounds", "1", "--caps", "400", "--variants", "plain", "--steps", "1",
         "--no-numerics", "--no-preflight"],
        "| plain |",
    ),
    "bench_first_batch.py": (
        ["--ratio-models", "mlp", "--first-models", "string_input"], "| string_input | 0 |"
    ),
    "bench_predictors.py": (
        ["--rounds", "1", "--sizes", "8,16,32", "--models", "cnn", "--modes", "plain",
         "--oom", ""],
        "planner line, fit at 8 and 16",
    ),
}


def test_every_benchmark_has_a_smoke_run():
    scripts = {name for name in os.listdir(os.path.join(ROOT, "bench")) if name.endswith(".py")}
    assert scripts == set(SMOKE_RUNS)


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_runs(script):
    arguments, expected = SMOKE_RUNS[script]
    completed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", script), *arguments],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert expected in completed.stdout, completed.stdout[-4000:]


# bench_backends.py runs once per Keras backend (KERAS_BACKEND): its
# TensorFlow smoke run is the test below, its JAX and torch ones are in
# tests/jax_backend and tests/torch_backend. Registered here, after the
# parametrized test above took its list, for the check that every script
# has one.
SMOKE_RUNS["bench_backends.py"] = (["--smoke"], "tensorflow: first batch, mlp")

BACKENDS_FIGURE_LINES = (
    "| plain B=32 |",
    "| MemoryMonitor |",
    "| guard k=1 (plan) |",
    "| guard k=1 (fixed) |",
    "| guard k=4, B=32 |",
    "| keras GA k=4, B=8 |",
    "| plain B=8 |",
    ": first batch, mlp, B=32",
)


def test_bench_backends_smoke_run_on_tensorflow():
    completed = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_backends.py"), "--smoke"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND="tensorflow"),
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "Keras backend tensorflow: TensorFlow" in completed.stdout, completed.stdout[-4000:]
    for line in BACKENDS_FIGURE_LINES:
        assert line in completed.stdout, (line, completed.stdout[-4000:])
