"""`keras_memguard.advise` and `keras-memguard advise` on the JAX backend.

The fast tests run in this process: the variants JAX does not have are
refused by name, the peak on the CPU is the compiled step's analysis, and
a CPU without `memory_limit` fails the measurement with a reason instead
of crashing. The slow one runs the command for real: a batch beyond the
largest that fits trains in micro-batches under the guard.
"""

import json

import keras
import pytest

from keras_memguard import backends
from keras_memguard.__main__ import main as cli_main
from keras_memguard.advice import child
from keras_memguard.advice import variants

LIMIT_MIB = 24


def small_cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "cnn.keras")
    small_cnn().save(path)
    return path


def test_remat_and_jit_are_not_available_on_jax_and_say_why():
    advice = backends.current().advice()
    assert advice.NAME == "jax"
    model = small_cnn()
    for name, why in (("remat", "TensorFlow-only"), ("jit_compile", "compiled by XLA already")):
        with pytest.raises(variants.Unsupported) as error:
            variants.apply_variant(model, name)
        assert str(error.value).startswith(f"{name} is not available on the jax backend: ")
        assert why in str(error.value)
    # The dtype policies exist here as everywhere.
    rebuilt, how = variants.apply_variant(model, "mixed_bfloat16")
    assert rebuilt.compute_dtype == "bfloat16" and "weights copied" in how


def test_the_peak_on_the_cpu_is_the_compiled_steps_analysis():
    advice = backends.current().advice()
    model = small_cnn()
    x = variants.make_inputs(model, 32)
    y = variants.make_targets(model, x)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    one, note = advice.step_peak(model, x, y, 1, None)
    four, _ = advice.step_peak(model, x, y, 4, None)
    assert one > four > 0 and "memory analysis" in note
    # A device that reports peaks: the measured one stands.
    assert advice.step_peak(model, x, y, 1, 123.0) == (123.0, None)


def test_a_cpu_without_a_memory_limit_fails_with_the_reason(saved, tmp_path):
    output = tmp_path / "float32.json"
    spec = {
        "model": saved, "variant": "float32", "batch_size": 8, "input_shape": None,
        "input_range": None, "steps": 2, "memory_limit": None, "max_trials": 2,
        "threshold": 0.85, "output": str(output),
    }
    assert child.main([json.dumps(spec)]) == 0
    result = json.loads(output.read_text())
    assert result["status"] == "failed" and result["backend"] == "jax"
    assert "MemoryLimitUnknownError" in result["reason"]
    assert "--memory-limit-mib" in result["reason"]
    # The variants JAX does not have are known before the model loads.
    assert set(result["unsupported"]) == {"remat", "jit_compile"}


@pytest.mark.slow
def test_the_command_micro_batches_a_batch_beyond_the_largest(saved, tmp_path, capsys):
    json_path = tmp_path / "advice.json"
    status = cli_main(
        [
            "advise", saved, "--batch-size", "2048",
            "--variants", "mixed_bfloat16,remat,jit_compile",
            "--memory-limit-mib", str(LIMIT_MIB), "--steps", "3", "--max-trials", "4",
            "--json", str(json_path), "--timeout", "300",
        ]
    )
    assert status == 0
    data = json.loads(json_path.read_text())
    assert data["format"] == "keras_memguard.advise" and data["backend"] == "jax"
    assert data["device"] == "CPU:0" and data["limit_mib"] == LIMIT_MIB
    rows = {v["name"]: v for v in data["variants"]}
    assert list(rows) == ["float32", "mixed_bfloat16", "remat", "jit_compile"]
    for name in ("float32", "mixed_bfloat16"):
        row = rows[name]
        assert row["status"] == "ok", row
        # 2048 does not fit in one step: the guard split it, and each
        # micro-batch is no larger than the largest batch that fits.
        assert row["largest_batch_size"] < 2048 <= row["micro_batches"] * row["largest_batch_size"]
        assert 0 < row["peak_mib"] < LIMIT_MIB and row["step_seconds"] > 0
        assert "memory analysis" in row["how"]
        assert row["out_of_memory_errors"] == 0
    assert rows["float32"]["peak_saving"] == 0.0
    assert rows["mixed_bfloat16"]["peak_saving"] is not None
    for name in ("remat", "jit_compile"):
        assert rows[name]["status"] == "unsupported"
        assert "not available on the jax backend" in rows[name]["reason"]
    out = capsys.readouterr().out
    assert "remat           unsupported: remat is not available on the jax backend" in out
