"""examples/quickstart.py on Keras' PyTorch backend, as the README shows it.

On the CPU the quickstart caps its own address space beyond what a
warmed-up process maps: plain `fit` at batch 256 runs out of memory
(torch's allocator `RuntimeError`), the guarded one trains every batch.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

QUICKSTART = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


@pytest.mark.slow
def test_the_quickstart_runs_out_of_memory_plainly_and_trains_every_batch_guarded(tmp_path):
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), "--backend", "torch", "--epochs", "1",
         "--log-dir", str(tmp_path / "logs")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env=dict(os.environ, KERAS_HOME=str(tmp_path / "keras_home")),
    )
    output = result.stdout
    assert result.returncode == 0, output[-4000:]
    # The monitor watches for growth: a steady run raises no alarm.
    assert "Memory keeps growing" not in output, output[-4000:]
    assert "1. Plain fit at batch 256 under a 600 MiB cap (torch)\n   ran out of memory (RuntimeError)" in output, output[-4000:]
    assert "every batch trained (768 samples per epoch)" in output, output[-4000:]
    planned = re.search(r"epoch 1: peak [\d.]+ MiB, (\d+) micro-batches", output)
    assert planned and int(planned.group(1)) > 1, output[-4000:]
    assert os.listdir(tmp_path / "logs" / "memguard")
