"""examples/jax_guard.py runs as the README shows, planned before the first batch."""

import os
import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "jax_guard.py"


def test_the_jax_example_plans_split_batches_that_train_as_plain_fit(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KERAS_BACKEND="jax"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The monitor watches for growth: a steady run raises no alarm.
    assert "Memory keeps growing" not in result.stderr, result.stderr[-3000:]
    planned = re.search(r"planned k=(\d+) for batch 512: compiled step needs", result.stderr)
    assert planned and int(planned.group(1)) > 1, result.stderr[-3000:]
    k = planned.group(1)
    assert f"micro-batches per batch: [{k}, {k}], replays after an out-of-memory error: 0" in result.stdout
    difference = float(re.search(r"largest weight difference from plain fit: (\S+)", result.stdout).group(1))
    assert difference < 1e-4, result.stdout
    assert os.listdir(tmp_path / "memguard")
