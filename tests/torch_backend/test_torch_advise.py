"""`keras_memguard.advise` and `keras-memguard advise` on the PyTorch backend.

The fast tests run in this process: the remat rung is refused by name,
`jit_compile` means `torch.compile` (and a batch that fits whole then
trains without the guard, whose micro-batched step runs eagerly). The
slow ones run for real: `advise` end to end, and one variant's measuring
child under a real address-space cap (`RLIMIT_AS`, set after a warm-up,
the CPU's stand-in for a full device), where the requested batch does not
fit whole and trains in micro-batches.
"""

import json
import subprocess
import sys
import textwrap

import keras
import pytest

import keras_memguard
from keras_memguard import backends
from keras_memguard.advice import variants
from keras_memguard.testing import RESULT_MARKER, address_space_cap_env


def wide_model():
    """Much memory per sample, little arithmetic: quick steps that fill memory."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64, 64, 4)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_remat_is_not_available_and_jit_compile_is_torch_compile():
    advice = backends.current().advice()
    assert advice.NAME == "torch"
    model = wide_model()
    with pytest.raises(variants.Unsupported) as error:
        variants.apply_variant(model, "remat")
    assert str(error.value) == (
        "remat is not available on the torch backend: the remat rung is "
        "TensorFlow-only in keras_memguard"
    )
    assert not model.jit_compile  # "auto" is eager on torch
    model, how = variants.apply_variant(model, "jit_compile")
    assert model.jit_compile is True and "torch.compile" in how
    # Whole batches run under torch.compile, without the guard; split
    # ones under the guard, eagerly, and `how` says which.
    assert not advice.guarded("jit_compile", fits=True)
    assert advice.guarded("jit_compile", fits=False)
    assert advice.guarded("float32", fits=True)
    assert "under torch.compile" in advice.training_note("jit_compile", False)
    assert "eagerly" in advice.training_note("jit_compile", True)
    assert advice.training_note("float32", True) is None


@pytest.mark.slow
def test_advise_measures_float32_and_reports_remat_as_not_available(tmp_path):
    path = str(tmp_path / "wide.keras")
    wide_model().save(path)
    advice = keras_memguard.advise(
        path, 16, variants=["remat"], memory_limit=8 << 30, steps=3, max_trials=3,
        json_path=str(tmp_path / "advice.json"), verbose=0,
    )
    assert advice.backend == "torch" and advice.device == "CPU:0"
    assert advice.limit_mib == 8192.0
    float32, remat = advice.variants
    assert float32.status == "ok", float32.reason
    assert float32.micro_batches == 1 and float32.largest_batch_size >= 16
    # The resident memory of the whole process, under the limit given.
    assert 0 < float32.peak_mib < advice.limit_mib and float32.step_seconds > 0
    assert remat.status == "unsupported" and "not available on the torch backend" in remat.reason
    data = json.loads((tmp_path / "advice.json").read_text())
    assert data["backend"] == "torch" and data["variants"][1]["status"] == "unsupported"
    assert "unsupported: remat is not available on the torch backend" in advice.table()


# One variant's child, run as `advise` runs it, but with its address space
# capped after a warm-up: it may grow by HEADROOM, and the limit given is
# the resident memory plus HEADROOM.
_CAPPED_CHILD = """
import json, resource, sys
import numpy as np, keras
from keras_memguard.advice import child
from keras_memguard.testing import emit_result

HEADROOM = 400 * 2**20

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

warm = keras.saving.load_model(sys.argv[1])
x = np.zeros((8, 64, 64, 4), "float32")
warm.fit(x, np.zeros(8, "int32"), batch_size=8, verbose=0)
del warm
size, resident = status("VmSize"), status("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))
spec = {
    "model": sys.argv[1], "variant": "float32", "batch_size": 1536,
    "input_shape": None, "input_range": None, "steps": 3,
    "memory_limit": resident + HEADROOM, "max_trials": 4, "threshold": 0.85,
    "output": sys.argv[2],
}
child.main([json.dumps(spec)])
with open(sys.argv[2]) as f:
    result = json.load(f)
result["limit_given"] = resident + HEADROOM
emit_result(result)
"""


@pytest.mark.slow
def test_under_a_real_cap_a_batch_that_does_not_fit_trains_in_micro_batches(tmp_path):
    path = str(tmp_path / "wide.keras")
    wide_model().save(path)
    env = dict(address_space_cap_env(), KERAS_BACKEND="torch")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CAPPED_CHILD), path, str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    lines = [l for l in done.stdout.splitlines() if l.startswith(RESULT_MARKER)]
    assert lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    assert result["status"] == "ok", json.dumps(result)
    # 1536 samples do not fit in one step under the cap: the largest batch
    # is below it, and the guard trained it in micro-batches no larger.
    largest = result["largest_batch_size"]
    assert largest < 1536 <= result["micro_batches"] * largest, result
    assert result["micro_batches"] >= 2
    # Every step ran under the cap; the peak read is the process's
    # resident memory, which the cap bounds only through its address space.
    assert 0 < result["peak_bytes"] <= 1.05 * result["limit_given"], result
