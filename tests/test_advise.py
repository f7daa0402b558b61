"""`keras_memguard.advise` and `keras-memguard advise`.

The fast tests run in this process: the dtype-rebuilt model against the
original, the inputs and targets built from a model, the JSON and the
table, and bad arguments. The slow ones run `advise` for real: its
children inherit a small memory cap from the environment, and what it
reports for the CNN is checked against the same training done by hand
under the same cap.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_memguard
import programs
from keras_memguard import advice as advice_lib
from keras_memguard.__main__ import main as cli_main
from keras_memguard.advice import variants
from keras_memguard.testing import memory_cap_env
from keras_memguard.testing import run_with_memory_cap
from programs import advise_models

SCHEMA_KEYS = [
    "format", "version", "model", "batch_size", "device", "limit_mib",
    "fixed_mib", "per_sample_mib", "largest_batch_size", "variants",
]
VARIANT_KEYS = [
    "name", "status", "reason", "largest_batch_size", "peak_mib",
    "step_seconds", "peak_saving", "time_saving",
]


# The rebuilt model computes the same function.


@pytest.mark.parametrize(
    "policy, tolerance", [("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)]
)
@pytest.mark.parametrize("build", [advise_models.cnn, advise_models.transformer])
def test_the_rebuilt_model_computes_the_same_function(build, policy, tolerance):
    model = build()
    x = variants.make_inputs(model, 4)
    expected = model.predict(x, verbose=0)
    rebuilt, how = variants.rebuild_with_policy(model, policy)
    assert keras.mixed_precision.global_policy().name == "float32"
    layers = [l for l in rebuilt.layers if not isinstance(l, keras.layers.InputLayer)]
    assert layers and all(l.dtype_policy.name == policy for l in layers)
    assert rebuilt.compute_dtype != "float32"
    got = np.asarray(rebuilt.predict(x, verbose=0), dtype="float32")
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance * scale)
    assert isinstance(rebuilt.loss, type(model.loss))
    assert type(rebuilt.optimizer).__name__ == (
        "LossScaleOptimizer" if policy == "mixed_float16" else "Adam"
    )
    assert f"{policy!r}" in how and "weights copied" in how
    # The weights are copies, not shared: the original keeps its own.
    rebuilt.layers[-1].kernel.assign(rebuilt.layers[-1].kernel * 0)
    assert np.abs(model.layers[-1].kernel.numpy()).sum() > 0


def test_a_rebuilt_model_differs_when_the_weights_differ():
    """The comparison above can fail: other weights, other predictions."""
    model = advise_models.cnn(seed=0)
    other = advise_models.cnn(seed=1)
    x = variants.make_inputs(model, 4)
    rebuilt, _ = variants.rebuild_with_policy(other, "mixed_float16")
    got = np.asarray(rebuilt.predict(x, verbose=0), dtype="float32")
    expected = model.predict(x, verbose=0)
    assert not np.allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


# Inputs and targets.


def test_token_inputs_index_the_embedding_and_targets_fit_the_loss():
    model = advise_models.transformer(vocabulary=50)
    x = variants.make_inputs(model, 256)
    assert x.shape == (256, advise_models.LENGTH) and x.dtype == np.int32
    assert x.min() == 0 and x.max() == 49
    y = variants.make_targets(model, x)
    assert y.shape == (256,) and y.dtype == np.int32 and 0 <= y.min() and y.max() <= 3
    ranged = variants.make_inputs(model, 64, input_range=(5, 7))
    assert set(np.unique(ranged)) == {5, 6}


@pytest.mark.parametrize(
    "loss, shape, check",
    [
        ("categorical_crossentropy", (8, 10), lambda y: (y.sum(axis=1) == 1).all()),
        ("binary_crossentropy", (8, 10), lambda y: set(np.unique(y)) <= {0.0, 1.0}),
        ("mse", (8, 10), lambda y: y.dtype == np.float32 and (y < 0).any()),
        (keras.losses.SparseCategoricalCrossentropy(), (8,), lambda y: y.max() < 10),
    ],
)
def test_targets_follow_the_loss(loss, shape, check):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(10)])
    model.compile("sgd", loss)
    y = variants.make_targets(model, variants.make_inputs(model, 8))
    assert y.shape == shape and check(y)


def test_an_unknown_dimension_needs_input_shape():
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"unknown dimension.*--input-shape"):
        variants.make_inputs(model, 2)
    assert variants.make_inputs(model, 2, input_shape=(7, 3)).shape == (2, 7, 3)


# The result, its JSON and its table.


def _raw(peak_mib, seconds, **extra):
    mib = 1024 * 1024
    raw = {
        "status": "ok", "device": "CPU:0", "limit_bytes": 600 * mib,
        "largest_batch_size": 100, "micro_batches": 1, "out_of_memory_errors": 0,
        "peak_bytes": peak_mib * mib, "step_seconds": seconds,
        "weights_bytes": mib, "optimizer_bytes": 2 * mib, "gradient_bytes": mib,
        "in_use_bytes": 5 * mib, "bytes_per_sample": mib / 2,
    }
    raw.update(extra)
    return raw


def test_the_json_has_the_schema_and_savings_against_float32(tmp_path):
    results = {
        "float32": _raw(400, 0.2),
        "mixed_float16": _raw(300, 0.1, how="rebuilt: ..."),
        "remat": {"status": "unsupported", "reason": "not a chain"},
        "jit_compile": {"status": "failed", "reason": "InternalError: boom"},
    }
    names = ("float32", "mixed_float16", "remat", "jit_compile")
    advice = advice_lib._assemble("m.keras", 64, names, results, None)
    path = tmp_path / "a.json"
    advice_lib._write_json(advice, str(path))
    data = json.loads(path.read_text())
    assert list(data)[: len(SCHEMA_KEYS)] == SCHEMA_KEYS
    assert data["format"] == "keras_memguard.advise" and data["version"] == 1
    assert (data["limit_mib"], data["fixed_mib"], data["per_sample_mib"]) == (600.0, 4.0, 0.5)
    rows = {v["name"]: v for v in data["variants"]}
    for row in data["variants"]:
        assert list(row)[: len(VARIANT_KEYS)] == VARIANT_KEYS
    assert rows["float32"]["peak_saving"] == 0.0
    assert rows["mixed_float16"]["peak_saving"] == 0.25
    assert rows["mixed_float16"]["time_saving"] == 0.5
    assert rows["remat"]["status"] == "unsupported" and rows["remat"]["peak_mib"] is None
    assert rows["jit_compile"]["reason"] == "InternalError: boom"
    table = advice.table()
    assert "+25%" in table and "unsupported: not a chain" in table
    assert "mixed_float16: rebuilt: ..." in table


def test_a_crashed_child_is_reported_with_its_last_error_line():
    completed = subprocess.CompletedProcess(
        [], -6, "", "2026 ... some line\nF0000 xla.cc:1] Check failed: allocation\nAborted\n"
    )
    reason = advice_lib._crash_reason(completed)
    assert reason == (
        "the measuring process ended with signal SIGABRT: "
        "F0000 xla.cc:1] Check failed: allocation"
    )


# Bad arguments.


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.keras"
    path.write_bytes(b"not read before the arguments are checked")
    return str(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, r"`batch_size` must be an integer >= 1. Received: batch_size=0"),
        ({"batch_size": 2.5}, r"Received: batch_size=2.5"),
        ({"steps": 1}, r"`steps` must be an integer >= 2. Received: steps=1"),
        ({"variants": ["fp8"]}, r"`variants` must be a list of names from .*Received: variants=\['fp8'\]"),
        ({"variants": "remat"}, r"Received: variants='remat'"),
        ({"input_shape": (64, "x")}, r"`input_shape` must be .*Received: input_shape=\(64, 'x'\)"),
        ({"input_shape": (0, 3)}, r"Received: input_shape=\(0, 3\)"),
        ({"input_range": (5, 1)}, r"`input_range` must be \(low, high\).*Received: input_range=\(5, 1\)"),
        ({"threshold": 1.5}, r"`threshold` must be in \(0, 1\]. Received: threshold=1.5"),
        ({"memory_limit": -1}, r"`memory_limit` must be .*Received: memory_limit=-1"),
        ({"verbose": 2}, r"`verbose` must be 0 or 1. Received: verbose=2"),
        ({"timeout": 0}, r"`timeout` must be a number > 0. Received: timeout=0"),
    ],
)
def test_bad_arguments_say_what_is_valid(model_file, kwargs, message):
    arguments = {"batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        keras_memguard.advise(model_file, **arguments)


def test_a_model_path_must_be_a_saved_model(tmp_path):
    with pytest.raises(ValueError, match=r"`model_path` must name a file saved by `model.save`"):
        keras_memguard.advise(str(tmp_path / "model.txt"), 8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        keras_memguard.advise(str(tmp_path / "missing.keras"), 8)


def test_the_command_refuses_bad_input_with_status_2(model_file, capsys):
    assert cli_main(["advise", model_file, "--batch-size", "0"]) == 2
    assert "`batch_size` must be an integer >= 1" in capsys.readouterr().err
    for bad in (["--input-shape", "64,x,3"], ["--variants", "fp8"], ["--input-range", "3,1"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["advise", model_file, "--batch-size", "8", *bad])
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err


# For real, under a cap.

CNN_CAP_MIB = 250
CNN_BATCH = 32
# One inter-op thread in the CNN's children: with TensorFlow's default,
# independent ops of a step run side by side in an order that varies from
# run to run, and the mixed-precision step's peak with it, so the saving
# compared below did not repeat (bench/RESULTS.md, "The peaks `advise`
# reads depend on TensorFlow's inter-op threads").
CNN_ENV = {"TF_NUM_INTEROP_THREADS": "1"}


@pytest.fixture(scope="module")
def cnn_advice(tmp_path_factory):
    """`advise` on the saved CNN under a 250 MiB cap, every variant."""
    directory = tmp_path_factory.mktemp("advise_cnn")
    path = str(directory / "cnn.keras")
    advise_models.cnn().save(path)
    patch = pytest.MonkeyPatch()
    # The children inherit the cap (this process keeps the suite's own).
    for name, value in memory_cap_env(CNN_CAP_MIB, base_env=CNN_ENV).items():
        patch.setenv(name, value)
    try:
        advice = keras_memguard.advise(
            path, CNN_BATCH, steps=3, max_trials=4, log_dir=str(directory / "logs"), verbose=0
        )
    finally:
        patch.undo()
    return advice, directory


@pytest.mark.slow
def test_advise_reports_every_variant_of_a_cnn_recovering_any_trial_that_runs_out(cnn_advice):
    advice, directory = cnn_advice
    assert [v.name for v in advice.variants] == list(advice_lib.VARIANTS)
    failed = [(v.name, v.reason) for v in advice.variants if v.status != "ok"]
    assert not failed
    errors = {v.name: (v.out_of_memory_errors, v.largest_batch_size) for v in advice.variants}
    # Without XLA a trial at the very top may run out of memory in a later
    # step (where the input's batches land splits the free memory); the
    # search recovers. The XLA variant runs no step that does not fit.
    assert errors["jit_compile"][0] == 0, errors
    assert all(v.out_of_memory_errors <= 1 for v in advice.variants), errors
    assert advice.device == "CPU:0" and advice.limit_mib == CNN_CAP_MIB
    # A batch of 32 fits whole, so the largest batch is beyond it.
    assert advice.largest_batch_size > CNN_BATCH
    assert all(v.micro_batches == 1 for v in advice.variants)
    for v in advice.variants:
        assert 0 < v.peak_mib < CNN_CAP_MIB and v.step_seconds > 0, v
    assert 0 < advice.fixed_mib < advice.per_sample_mib * CNN_BATCH
    written = json.loads((directory / "logs" / "memguard" / "advise.json").read_text())
    assert written == json.loads(json.dumps(advice.to_dict()))


@pytest.mark.slow
def test_advise_savings_agree_with_training_by_hand(cnn_advice):
    advice, _ = cnn_advice
    run = run_with_memory_cap(
        programs.source("advise_by_hand", CNN_BATCH), CNN_CAP_MIB, env=CNN_ENV
    )
    by_hand = 1 - run.result["mixed_float16"] / run.result["float32"]
    reported = {v.name: v for v in advice.variants}["mixed_float16"].peak_saving
    # Same sign and order of magnitude: mixed precision halves the
    # activations, not the whole peak.
    assert by_hand > 0.05 and reported > 0.05, (by_hand, reported)
    assert 1 / 3 < reported / by_hand < 3, (by_hand, reported)


@pytest.mark.slow
def test_the_command_on_a_transformer_with_token_inputs(tmp_path):
    path = str(tmp_path / "transformer.keras")
    advise_models.transformer().save(path)
    json_path = tmp_path / "advice.json"
    env = memory_cap_env(200)
    env.pop("TF_CPP_MIN_LOG_LEVEL")  # the command sets it itself
    completed = subprocess.run(
        [
            sys.executable, "-m", "keras_memguard", "advise", path,
            "--batch-size", "64", "--variants", "mixed_float16,remat",
            "--steps", "3", "--max-trials", "4",
            "--json", str(json_path), "--log-dir", str(tmp_path / "logs"),
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert completed.returncode == 0, completed.stderr
    output = completed.stdout + completed.stderr
    for noise in ("absl", "I0000", "oneDNN", "cpu_feature_guard", "Traceback"):
        assert noise not in output, output
    data = json.loads(json_path.read_text())
    assert data == json.loads((tmp_path / "logs" / "memguard" / "advise.json").read_text())
    rows = {v["name"]: v for v in data["variants"]}
    assert list(rows) == ["float32", "mixed_float16", "remat"]
    # Token ids out of the embedding's range would fail the lookup.
    assert rows["float32"]["status"] == "ok" and rows["mixed_float16"]["status"] == "ok"
    assert rows["float32"]["out_of_memory_errors"] == 0
    assert rows["mixed_float16"]["out_of_memory_errors"] == 0
    assert rows["remat"]["status"] == "unsupported"
    assert "multi_head_attention" in rows["remat"]["reason"]
    assert "mixed_float16" in completed.stdout and "unsupported: layer" in completed.stdout


@pytest.mark.slow
def test_a_model_that_does_not_load_is_reported_not_raised(tmp_path, capsys):
    path = tmp_path / "broken.keras"
    path.write_bytes(b"not a zip file")
    advice = keras_memguard.advise(str(path), 8, variants=["remat"], verbose=1)
    assert [(v.name, v.status) for v in advice.variants] == [
        ("float32", "failed"), ("remat", "failed"),
    ]
    assert advice.variants[0].reason == advice.variants[1].reason
    assert "\n" not in advice.variants[0].reason and advice.variants[0].reason
    assert advice.fixed_mib is None and advice.variants[0].peak_saving is None
    assert "float32  failed:" in capsys.readouterr().out
