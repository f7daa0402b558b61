"""The TensorFlow examples run as the README tells users to run them.

Each runs as `python examples/<name>.py` in a process of its own (the
examples cap TensorFlow's allocator before importing it), from an empty
plan cache, and must end cleanly having trained every batch under the
guard. (`tests/jax_backend/test_jax_example.py` runs the JAX example.)
`language_model.py` runs with its step compiled by XLA, as on a GPU, and
without. They run at the newest end of the supported range only: the
floor end runs the rest of the suite, which covers what the examples use,
within CI's time.
"""

import os
import pathlib
import re
import subprocess
import sys

import keras
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in keras.version().split(".")[:2]) < (3, 9),
    reason="the examples run at the newest end only (CI time)",
)


def _run(name, tmp_path, *args):
    env = dict(os.environ, KERAS_HOME=str(tmp_path / "keras_home"))
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:]
    # The examples' monitors watch for growth: a steady run raises no alarm.
    assert "Memory keeps growing" not in run.stdout, run.stdout[-4000:]
    return run.stdout


def _recoveries(output):
    found = re.search(r"batches replayed after running out of memory: (\d+)", output)
    assert found, output[-3000:]
    return int(found.group(1))


@pytest.mark.slow
def test_the_quickstart_runs_out_of_memory_plainly_and_trains_every_batch_guarded(tmp_path):
    output = _run("quickstart", tmp_path, "--log-dir", str(tmp_path / "logs"), "--epochs", "1")
    assert "1. Plain fit at batch 256 under a 600 MiB cap (tensorflow)\n   ran out of memory" in output, output
    assert "every batch trained (768 samples per epoch)" in output, output
    # Planned before each batch: no error to recover from.
    assert "out-of-memory recoveries: 0" in output, output
    assert f"keras-memguard report {tmp_path / 'logs'}" in output


@pytest.mark.slow
def test_the_plain_model_example_trains_and_saves_a_plain_model(tmp_path):
    output = _run("guard_plain_model", tmp_path, "--log-dir", str(tmp_path / "logs"))
    assert _recoveries(output) == 0, output
    assert "saved as a plain Sequential" in output, output


@pytest.mark.slow
def test_the_mixin_example_trains_with_its_own_train_step(tmp_path):
    output = _run("guard_mixin_model", tmp_path, "--log-dir", str(tmp_path / "logs"))
    assert _recoveries(output) == 0, output
    assert int(re.search(r"model.micro_batches = (\d+)", output).group(1)) >= 2, output


@pytest.mark.slow
def test_the_vae_example_with_its_own_train_step_trains_every_batch(tmp_path):
    output = _run("vae", tmp_path, "--epochs", "1")
    assert "ran out of memory under the 160 MiB cap" in output, output
    assert _recoveries(output) <= 1, output
    losses = re.search(r"total_loss: ([0-9.]+)", output)
    assert losses and float(losses.group(1)) > 0, output


@pytest.mark.slow
@pytest.mark.parametrize("xla", ["on", "off"])
def test_the_language_model_example_trains_every_batch_with_and_without_xla(tmp_path, xla):
    # "on": the step compiled by XLA, as Keras compiles it on a GPU, where an
    # error inside the program can end the process: planned, never replayed.
    output = _run("language_model", tmp_path, "--xla", xla, "--log-dir", str(tmp_path / "logs"))
    # Plain `fit` fails: an error, or on XLA the process may end with it.
    assert re.search(
        r"in a process of its own\n   (ran out of memory|the process was killed)", output
    ), output
    assert f"the step compiled with XLA: {xla == 'on'}" in output, output
    assert "every batch trained (128 sequences per epoch); out-of-memory recoveries: 0" in output, output
    counts = [int(k) for k in re.findall(r"epoch \d: peak [0-9.]+ MiB, (\d+) micro-batches", output)]
    assert len(counts) == 2 and min(counts) >= 2, output
