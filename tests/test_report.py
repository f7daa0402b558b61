"""keras-memguard report: the figures of real runs, the PNG/HTML, the command.

The runs are real `fit` calls with MemoryMonitor and MemoryGuard writing
event files. Their figures are known by construction: a callback holds a
48 MiB tensor during one batch (so that batch has the highest peak, and its
usage of a 64 MiB limit makes the guard split), and, under a real memory cap
in a process of its own, a batch of 256 runs out of memory (each such error
costs the allocator's 10 s of retries).
"""

import base64
import gc
import importlib.metadata
import inspect
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

import keras
import tensorflow as tf

import keras_memguard
import programs
from keras_memguard import __main__ as cli_main
from keras_memguard.report import advice as advice_lib
from keras_memguard.report import events
from keras_memguard.report import plot
from keras_memguard.report import summary as summary_lib
from keras_memguard.report.events import Series
from keras_memguard.report.summary import KChange
from keras_memguard.testing import run_with_memory_cap

MIB = 1024 * 1024
LIMIT = 64 * MIB
SPIKE_MIB = 48
SPIKE_AT = (0, 2)  # (epoch, batch): global step 3
BATCH = 50
SAMPLES = 200  # 4 batches per epoch, 2 epochs: steps 1-8


def reactive_only():
    """MemoryGuard arguments that leave k to the measured peaks.

    A guard that plans k ahead (where it has a `plan` argument) would split
    before the spike this file's run is built around.
    """
    if "plan" in inspect.signature(keras_memguard.MemoryGuard).parameters:
        return {"plan": False}
    return {}


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((24, 24, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    return model


def make_data():
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(SAMPLES, 24, 24, 3)).astype("float32"),
        rng.normal(size=(SAMPLES, 1)).astype("float32"),
    )


class Spike(keras.callbacks.Callback):
    """Holds a tensor of `SPIKE_MIB` during one batch (read at its end)."""

    def __init__(self):
        super().__init__()
        self.epoch = None
        self.held = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == SPIKE_AT:
            self.held = tf.ones((SPIKE_MIB * MIB // 4,), tf.float32)

    def on_train_batch_end(self, batch, logs=None):
        self.held = None


@pytest.fixture(scope="module")
def known_run(tmp_path_factory):
    """Steps 1-8 in 2 epochs; step 3 holds 48 MiB more, over the guard's
    threshold of a 64 MiB limit. Keeps what the callbacks put in each
    batch's logs: the figures the event files must give back."""
    log_dir = tmp_path_factory.mktemp("report") / "logs"
    x, y = make_data()
    model = make_model()
    monitor = keras_memguard.MemoryMonitor(log_dir=str(log_dir), memory_limit=LIMIT)
    guard = keras_memguard.MemoryGuard(
        threshold=0.7, memory_limit=LIMIT, cooldown=1000, log_dir=str(log_dir),
        **reactive_only(),
    )
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            (logs["memory_peak_mib"], logs["micro_batches"])
        )
    )
    model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
        callbacks=[monitor, guard, Spike(), record],
    )
    peaks, ks = zip(*seen)
    return {
        "log_dir": log_dir,
        "micro_batches": guard.micro_batches,
        "peaks": peaks,  # per step, MiB, as the batch logs had them
        "ks": tuple(int(k) for k in ks),  # k after each step
    }


@pytest.fixture(scope="module")
def known_summary(known_run):
    (run,) = events.load_runs(known_run["log_dir"])
    return run, summary_lib.summarize(run)


def png_size(data):
    """(width, height) from a PNG's signature and IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --- The figures of a run whose figures are known ---


def test_reads_the_run_with_tensorboards_loader(known_run, known_summary):
    run, _ = known_summary
    assert run.name == "."
    assert run.path == str(known_run["log_dir"] / "memguard")
    assert list(run.devices) == ["cpu0"]
    assert run.steps == tuple(range(1, 9))
    assert run.micro_batches.steps == tuple(range(1, 9))


def test_highest_peak_is_the_spiked_step(known_run, known_summary):
    run, summary = known_summary
    peak = run.devices["cpu0"]["peak"]
    # The event files give back what the batch logs had (float32 scalars).
    np.testing.assert_allclose(peak.values, known_run["peaks"], rtol=1e-6)
    highest = summary.highest
    assert highest.device == "cpu0"
    assert highest.peak_step == 1 + int(np.argmax(known_run["peaks"])) == 3
    assert highest.peak_mib == pytest.approx(max(known_run["peaks"]), rel=1e-6)
    assert highest.peak_mib >= SPIKE_MIB
    assert highest.limit_mib == LIMIT / MIB
    # The tensor is still held when step 3 is read, so current shows it too.
    current = dict(zip(*run.devices["cpu0"]["current"][:2]))
    assert current[3] >= SPIKE_MIB


def test_k_changes_and_settles_where_the_guard_ended(known_run, known_summary):
    _, summary = known_summary
    ks = known_run["ks"]
    expected = tuple(
        KChange(step + 1, ks[step - 1], ks[step])
        for step in range(1, len(ks))
        if ks[step] != ks[step - 1]
    )
    assert summary.k_changes == expected
    # The limit is small enough that the spike splits the batches.
    assert max(ks) >= 2 and 3 in [change.step for change in expected]
    assert summary.final_k == known_run["micro_batches"] == ks[-1]
    assert summary.final_micro_batch_size == -(-BATCH // ks[-1])
    assert summary.recoveries == ()
    assert summary.recovery_count == 0
    assert summary.recovery_seconds is None


def test_epoch_ends_come_from_the_monitor(known_summary):
    _, summary = known_summary
    assert summary.epoch_ends == (4, 8)
    assert summary.epoch_source == "monitor"
    assert (summary.first_step, summary.last_step) == (1, 8)


def test_summary_text(known_summary):
    run, summary = known_summary
    text = summary_lib.format_summary(summary)
    assert "steps 1-8, 2 epochs (ending at steps 4, 8)" in text
    assert re.search(
        r"highest peak: \d+\.\d MiB on cpu0 at step 3 \(\d+% of its 64\.0 MiB limit\)", text
    ), text
    changes = summary.k_changes
    assert (
        f"settled on k={summary.final_k} (micro-batch {summary.final_micro_batch_size}); "
        f"{len(changes)} change{'s' if len(changes) > 1 else ''}: "
        + ", ".join(f"after step {c.step}: {c.old} -> {c.new}" for c in changes)
    ) in text
    assert "out-of-memory recoveries: none" in text
    # The monitor logged the process's resident memory at every step.
    assert run.host_rss.steps == tuple(range(1, 9))
    assert re.search(
        r"host memory \(RSS\): \d+\.\d MiB at step 1, \d+\.\d MiB at step 8 "
        r"\([+-]\d+\.\d MiB\); highest \d+\.\d MiB at step [1-8]\n", text
    ), text


# --- Drawing ---


# A few seconds: out of the fast loop.
@pytest.mark.slow
def test_png_decodes_at_the_expected_size(known_run, tmp_path):
    import matplotlib.image

    output = tmp_path / "report.png"
    text = keras_memguard.report.make_report(known_run["log_dir"], output=output)
    assert "at step 3" in text
    data = output.read_bytes()
    assert png_size(data) == plot.figure_size_pixels(1) == (1200, 750)
    pixels = matplotlib.image.imread(output)
    assert pixels.shape[:2] == (750, 1200)
    # Something was drawn: not a blank page.
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20


def test_html_is_one_self_contained_page(known_run, tmp_path):
    output = tmp_path / "report.HTML"
    text = keras_memguard.report.make_report(known_run["log_dir"], output=str(output))
    page = output.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    (encoded,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert png_size(base64.b64decode(encoded)) == (1200, 750)
    # Nothing is fetched from elsewhere.
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert " -&gt; " in page  # the summary, escaped
    assert text.splitlines()[-1].replace(">", "&gt;") in page


def test_several_runs_are_found_and_drawn_one_below_the_other(known_run, tmp_path):
    for name in ("a", "b/c"):
        shutil.copytree(known_run["log_dir"] / "memguard", tmp_path / name / "memguard")
    assert [r.name for r in events.load_runs(tmp_path)] == ["a", "b/c"]
    output = tmp_path / "both.png"
    text = keras_memguard.report.make_report(tmp_path, output=output)
    assert text.count("Run ") == 2
    assert png_size(output.read_bytes()) == plot.figure_size_pixels(2) == (1200, 1500)
    # The run directory itself is accepted too.
    (run,) = events.load_runs(tmp_path / "a" / "memguard")
    assert run.steps == tuple(range(1, 9))


# --- Out-of-memory explanations ---


def test_out_of_memory_explanations_are_listed_tolerating_missing_keys(known_run, tmp_path):
    run_dir = tmp_path / "memguard"
    shutil.copytree(known_run["log_dir"] / "memguard", run_dir)
    (run_dir / "oom-7.json").write_text(json.dumps({"step": 7, "in_use_bytes": 10 * MIB}))
    (run_dir / "oom-3.json").write_text(
        json.dumps(
            {
                "step": 3,
                "failed_allocation_bytes": int(129.5 * MIB),
                "in_use_bytes": 400 * MIB,
                "largest_free_chunk_bytes": 80 * MIB,
                "largest_tensors": [
                    {"bytes": 64 * MIB, "layer": "conv2d_1", "shape": [256, 62, 62, 64]},
                    {"bytes": 2 * MIB},
                    "not a tensor",
                ],
            }
        )
    )
    (run_dir / "oom-x.json").write_text("{not json")
    (run_dir / "oom-y.json").write_text("[1, 2]")
    (run,) = events.load_runs(tmp_path)
    assert [r["file"] for r in run.oom_reports] == [
        "oom-3.json", "oom-7.json", "oom-x.json", "oom-y.json"
    ]
    text = summary_lib.format_summary(summary_lib.summarize(run))
    assert (
        "step 3 (oom-3.json): failed to allocate 129.5 MiB; in use 400.0 MiB; "
        "largest free chunk 80.0 MiB" in text
    )
    assert "largest tensors: 64.0 MiB conv2d_1 (256, 62, 62, 64); 2.0 MiB" in text
    assert "step 7 (oom-7.json): in use 10.0 MiB" in text
    assert "oom-x.json: could not be read" in text
    assert "oom-y.json: could not be read (a JSON list, not an object)" in text


# --- keras-memguard advise's result in the log directory ---

ADVICE = {
    "format": "keras_memguard.advise", "version": 1,
    "model": "path/to/model.keras", "batch_size": 64, "device": "CPU:0",
    "limit_mib": 600.0, "fixed_mib": 12.3, "per_sample_mib": 0.8,
    "largest_batch_size": 512,
    "variants": [
        {"name": "float32", "status": "ok", "reason": None, "largest_batch_size": 512,
         "peak_mib": 310.2, "step_seconds": 0.123, "peak_saving": 0.0,
         "time_saving": 0.0},
        {"name": "mixed_float16", "status": "ok", "reason": None,
         "largest_batch_size": 880, "peak_mib": 180.4, "step_seconds": 0.0984,
         "peak_saving": 1 - 180.4 / 310.2, "time_saving": 1 - 0.0984 / 0.123},
        {"name": "remat", "status": "unsupported",
         "reason": "layer 'multi_head_attention' does not take the previous layer's output",
         "largest_batch_size": None, "peak_mib": None, "step_seconds": None,
         "peak_saving": None, "time_saving": None},
        {"name": "jit_compile", "status": "failed", "reason": "XlaRuntimeError: boom",
         "largest_batch_size": None, "peak_mib": None, "step_seconds": None,
         "peak_saving": None, "time_saving": None},
    ],
}


def _with_advice(known_run, tmp_path, content):
    log_dir = tmp_path / "logs"
    shutil.copytree(known_run["log_dir"], log_dir)
    (log_dir / "memguard" / "advise.json").write_text(
        content if isinstance(content, str) else json.dumps(content)
    )
    return log_dir


def test_read_advice_is_none_without_a_file(known_run):
    assert advice_lib.read_advice(known_run["log_dir"]) is None


def test_advice_is_read_and_printed_as_a_table_under_the_run(known_run, tmp_path):
    log_dir = _with_advice(known_run, tmp_path, ADVICE)
    advice = advice_lib.read_advice(log_dir)
    # The run directory itself is accepted too.
    assert advice_lib.read_advice(log_dir / "memguard") == advice
    assert advice.path == str(log_dir / "memguard" / "advise.json")
    assert (advice.model, advice.batch_size, advice.device) == (
        "path/to/model.keras", 64, "CPU:0"
    )
    assert (advice.limit_mib, advice.fixed_mib, advice.per_sample_mib) == (600.0, 12.3, 0.8)
    assert advice.largest_batch_size == 512
    assert [(v.name, v.status) for v in advice.variants] == [
        ("float32", "ok"), ("mixed_float16", "ok"), ("remat", "unsupported"),
        ("jit_compile", "failed"),
    ]
    text = keras_memguard.report.make_report(log_dir)
    summary, _, table = text.partition(
        "  advice (advise.json): model path/to/model.keras, batch 64 on CPU:0 "
        "(limit 600.0 MiB)\n"
    )
    assert summary.startswith("Run ") and "highest peak:" in summary, text
    assert table.splitlines() == [
        "    fixed 12.3 MiB; per sample 0.800 MiB; largest batch 512",
        "    variant        largest batch  peak MiB  step ms     saving vs float32",
        "    float32                  512     310.2    123.0    peak +0%, time +0%",
        "    mixed_float16            880     180.4     98.4  peak +42%, time +20%",
        "    remat          unsupported: layer 'multi_head_attention' does not take "
        "the previous layer's output",
        "    jit_compile    failed: XlaRuntimeError: boom",
    ]


def test_advice_extra_keys_are_ignored_and_micro_batches_shown(known_run, tmp_path):
    data = json.loads(json.dumps(ADVICE))
    data["seconds"] = 180.3
    for variant, k in zip(data["variants"], (1, 2, None, None)):
        variant.update({"micro_batches": k, "how": "rebuilt"})
    text = keras_memguard.report.make_report(_with_advice(known_run, tmp_path, data))
    assert re.search(r"saving vs float32  micro-batches\n", text), text
    assert re.search(r"mixed_float16 .* peak \+42%, time \+20%              2\n", text), text


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "Expecting property name"),
        ("[1, 2]", "a JSON list, not an object"),
        ({**ADVICE, "format": "other"}, "`format` must be 'keras_memguard.advise'"),
        ({**ADVICE, "version": 2}, "`version` 2 is not one this keras_memguard reads"),
        ({**ADVICE, "variants": {"float32": {}}}, "`variants` must be a list"),
        ({**ADVICE, "batch_size": "64"}, "`batch_size` must be an integer or null"),
        ({**ADVICE, "variants": [{"name": "float32", "status": "done"}]},
         "variants[0]: `status` must be one of ok, unsupported, failed, not 'done'"),
        ({**ADVICE, "variants": [{**ADVICE["variants"][0], "peak_mib": "big"}]},
         "variants[0]: `peak_mib` must be a number or null"),
    ],
)
def test_a_malformed_advice_file_warns_and_the_report_goes_on(
    known_run, tmp_path, capsys, content, why
):
    log_dir = _with_advice(known_run, tmp_path, content)
    path = log_dir / "memguard" / "advise.json"
    with pytest.warns(UserWarning) as caught:
        assert advice_lib.read_advice(log_dir) is None
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"{path} is left out of the report: it is not a readable "
                              "keras-memguard advise result (")
    assert why in message
    # The command: the summary, and the warning as one line on stderr.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command reports it itself
        assert cli_main.main(["report", str(log_dir)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Run ") and "advice (" not in out
    assert err == f"keras-memguard report: warning: {message}\n"


def test_a_log_dir_with_only_advice_is_reported(tmp_path, capsys):
    (tmp_path / "memguard").mkdir()
    (tmp_path / "memguard" / "advise.json").write_text(json.dumps(ADVICE))
    assert cli_main.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "advice (advise.json): model path/to/model.keras, batch 64 on CPU:0"
    )
    assert "  mixed_float16            880     180.4     98.4" in out
    # Nothing to draw: one clear line.
    assert cli_main.main(["report", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 1
    assert "holds an advice file but no keras_memguard event files" in (
        capsys.readouterr().err
    )


# --- Figures from scripted series (pure) ---


def test_recovery_time_is_the_batch_time_beyond_a_typical_batch():
    oom = Series(
        steps=(1, 2, 3, 4, 5, 6, 8),
        values=(0, 0, 0, 1, 1, 3, 3),
        wall_times=(100.0, 101.0, 102.0, 113.0, 114.0, 136.0, 138.0),
    )
    found, per_step = summary_lib.recoveries(oom)
    assert per_step == 1.0
    assert [(r.step, r.count) for r in found] == [(4, 1), (6, 2)]
    assert [r.seconds for r in found] == [10.0, 21.0]


def test_a_recovery_at_the_first_point_has_no_derivable_time():
    oom = Series(steps=(1, 2), values=(1, 1), wall_times=(5.0, 6.0))
    (recovery,), _ = summary_lib.recoveries(oom)
    assert recovery == summary_lib.Recovery(1, 1, None)


def test_k_changes_from_a_scripted_series():
    k = Series(steps=(1, 2, 3, 4, 5), values=(1, 2, 2, 4, 2), wall_times=(0,) * 5)
    assert summary_lib.k_changes(k) == (
        KChange(2, 1, 2), KChange(4, 2, 4), KChange(5, 4, 2)
    )


def test_epoch_ends_placed_by_wall_time():
    steps = Series(steps=(1, 2, 3, 4), values=(1,) * 4, wall_times=(1.0, 2.0, 5.0, 6.0))
    assert events.epoch_ends_from_wall_times(steps, [2.5, 6.5, 0.5]) == [2, 4]


def test_epoch_ends_from_keras_tensorboard_when_no_monitor_wrote_them(tmp_path):
    x, y = make_data()
    model = make_model()
    guard = keras_memguard.MemoryGuard(memory_limit=1 << 40, log_dir=str(tmp_path))
    model.fit(
        x[:100], y[:100], batch_size=BATCH, epochs=3, verbose=0,
        callbacks=[guard, keras.callbacks.TensorBoard(log_dir=str(tmp_path))],
    )
    (run,) = events.load_runs(tmp_path)
    assert run.devices == {}
    summary = summary_lib.summarize(run)
    assert summary.epoch_ends == (2, 4, 6)
    assert summary.epoch_source == "keras"
    text = summary_lib.format_summary(summary)
    assert "placed by the wall times of Keras' TensorBoard epochs" in text
    assert "memory: not logged (MemoryMonitor with log_dir writes it)" in text
    assert f"settled on k={guard.micro_batches} (micro-batch " in text


# --- The command ---


def test_main_in_process(known_run, tmp_path, capsys):
    output = tmp_path / "out.html"
    assert cli_main.main(["report", str(known_run["log_dir"]), "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"settled on k={known_run['micro_batches']}" in out
    assert f"Wrote {output}" in out
    assert output.read_text().startswith("<!DOCTYPE html>")
    # Without --output: the summary only.
    assert keras_memguard.report.main([str(known_run["log_dir"])]) == 0
    assert "at step 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["missing-dir"], "is not a directory"),
        (["{empty}"], "No keras_memguard event files under"),
        (["{log_dir}", "--output", "x.pdf"], "must be a file ending in .png or .html. Received: output='x.pdf'"),
    ],
)
def test_command_errors_are_one_clear_line(known_run, tmp_path, capsys, args, expected):
    (tmp_path / "empty").mkdir()
    args = [
        a.format(empty=tmp_path / "empty", log_dir=known_run["log_dir"]) for a in args
    ]
    assert cli_main.main(["report"] + args) == 1
    err = capsys.readouterr().err
    assert err.startswith("keras-memguard report: error: ")
    assert expected in err


def test_command_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli_main.main(["report"])
    assert info.value.code == 2
    assert "LOG_DIR" in capsys.readouterr().err


def test_missing_matplotlib_names_the_extra(known_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(keras_memguard.MissingExtraError) as info:
        keras_memguard.report.make_report(known_run["log_dir"], output=tmp_path / "x.png")
    assert isinstance(info.value, ImportError)
    assert info.value.extra == "report"
    assert 'pip install "keras-memguard[report]"' in str(info.value)
    assert not (tmp_path / "x.png").exists()
    assert cli_main.main(["report", str(known_run["log_dir"]), "-o", str(tmp_path / "x.png")]) == 1
    assert 'pip install "keras-memguard[report]"' in capsys.readouterr().err
    # The summary alone needs no matplotlib.
    assert "at step 3" in keras_memguard.report.make_report(known_run["log_dir"])


def test_console_script_is_declared():
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    scripts = config["options.entry_points"]["console_scripts"].strip().splitlines()
    assert "keras-memguard = keras_memguard.__main__:main" in scripts
    extras = config["options.extras_require"]
    assert "matplotlib" in extras["report"].split()
    assert "matplotlib" in extras["test"].split()
    # The README's first command installs the cpu extra and the quickstart
    # then suggests `keras-memguard report ... --output report.png`.
    assert "matplotlib" in extras["cpu"].split()
    assert "matplotlib" in extras["gpu"].split()
    # Where the package is installed with this entry point, it loads main.
    for entry in importlib.metadata.entry_points(group="console_scripts"):
        if entry.name == "keras-memguard":
            assert entry.load() is cli_main.main


@pytest.mark.slow
def test_python_dash_m_report_prints_the_summary_first_without_tensorflow_noise(
    known_run, tmp_path
):
    output = tmp_path / "run.png"
    # As a user's shell has it: TensorFlow's defaults, which print its
    # start-up lines (oneDNN, CPU features) on import.
    env = {
        key: value for key, value in os.environ.items()
        if key not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")
    }
    run = subprocess.run(
        [sys.executable, "-m", "keras_memguard", "report", str(known_run["log_dir"]),
         "--output", str(output)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert run.stdout.startswith(f"Run {known_run['log_dir'] / 'memguard'}\n"), run.stdout
    assert "highest peak:" in run.stdout and "at step 3" in run.stdout
    assert run.stdout.endswith(f"Wrote {output}\n"), run.stdout
    assert png_size(output.read_bytes()) == (1200, 750)


# --- A run with real out-of-memory recoveries (a capped process) ---


@pytest.mark.slow
def test_recoveries_and_their_time_under_a_real_cap(tmp_path):
    log_dir = tmp_path / "logs"
    run = run_with_memory_cap(
        programs.source("report_under_cap", log_dir), memory_limit_mib=600, timeout=500
    )
    result = run.result
    # One WARNING line per recovery says why.
    assert run.stderr.count("out of memory at step 3 (micro-batch") == result["oom_recoveries"]
    (run,) = events.load_runs(log_dir)
    summary = summary_lib.summarize(run)
    ks, counts = zip(*result["per_step"])
    rises = [
        (step, count - previous)
        for step, (previous, count) in enumerate(zip((0,) + counts, counts), start=1)
        if count > previous
    ]
    assert result["oom_recoveries"] >= 1
    assert [(r.step, r.count) for r in summary.recoveries] == rises
    assert summary.recovery_count == result["oom_recoveries"]
    # The batch of 256 is step 3 of the first epoch.
    assert rises[0][0] == 3
    assert summary.final_k == result["micro_batches"] == ks[-1] >= 2
    # Each out-of-memory error costs the allocator's 10 s of retries.
    assert 9.0 * summary.recovery_count <= summary.recovery_seconds < 120
    assert summary.epoch_ends == (4, 8)
    assert summary.highest.limit_mib == 600
    text = summary_lib.format_summary(summary)
    assert re.search(
        rf"out-of-memory recoveries: {summary.recovery_count} \(step 3.*\); "
        r"about \d+\.\d s spent in them",
        text,
    ), text
    output = tmp_path / "run.png"
    keras_memguard.report.make_report(log_dir, output=output)
    assert png_size(output.read_bytes()) == (1200, 750)
    # Each recovery is explained: the failed allocation, the allocator's
    # figures, and the live tensors named by layer. The batch of 256 fails
    # in the second convolution, holding the first one's output: the
    # model's largest tensor (256 x 62 x 62 x 64 floats).
    first = summary.oom_reports[0]
    assert first["file"] == "oom-3.json" and first["step"] == 3
    assert first["source"] == "bfc_memory_dump"
    assert first["micro_batches"] == 1 and first["replayed_with"] >= 2
    assert first["failed_layer"] == "conv2d_1"
    assert first["failed_allocation_bytes"] == 4 * np.prod(first["failed_shape"])
    assert first["in_use_bytes"] + first["largest_free_chunk_bytes"] <= 600 * MIB
    assert first["largest_free_chunk_bytes"] < first["failed_allocation_bytes"]
    largest = first["largest_tensors"][0]
    assert (largest["layer"], largest["kind"]) == ("conv2d", "output")
    assert largest["shape"] == [256, 62, 62, 64]
    assert largest["bytes"] == 256 * 62 * 62 * 64 * 4
    assert len(summary.oom_reports) == summary.recovery_count
    assert "failed to allocate 225.0 MiB in layer 'conv2d_1'" in text
    assert "largest tensors: 240.2 MiB output of conv2d (256, 62, 62, 64)" in text
    assert "largest live tensor 240 MiB, output of 'conv2d'" in first["explanation"]


class _KeepsThirtyTwoMiBAnEpoch(keras.callbacks.Callback):
    """A leak: holds 32 MiB more of device memory at every epoch's end."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def on_epoch_end(self, epoch, logs=None):
        self.kept.append(tf.ones((8 * MIB,), tf.float32))


@pytest.mark.slow(floor=True)
def test_the_floor_its_growth_and_the_projection_are_reported_and_drawn(tmp_path):
    x, y = make_data()
    log_dir = tmp_path / "logs"
    monitor = keras_memguard.MemoryMonitor(
        log_dir=str(log_dir), memory_limit=4096 * MIB, growth=True
    )
    leak = _KeepsThirtyTwoMiBAnEpoch()
    gc.collect()
    make_model().fit(
        x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0,
        callbacks=[monitor, leak],
    )
    (run,) = events.load_runs(log_dir)
    assert "host" not in run.devices  # the host's floor is not a device
    (device,) = run.devices
    assert len(run.devices[device]["floor"].values) == 6
    assert len(run.host_floor.values) == 6
    summary = summary_lib.summarize(run)
    floors = {floor.series: floor for floor in summary.floors}
    assert set(floors) == {device, "host"}
    floor = floors[device]
    # 32 MiB kept an epoch. Memory that other tests of this process left
    # behind, or that TensorFlow caches while the fit runs, moves the first
    # and last floors by some MiB (25 more seen at the floor end); the rate,
    # a median of slopes, holds (32.0 MiB an epoch in that run).
    assert 140 <= floor.last_mib - floor.first_mib <= 240, floor
    assert 28 <= floor.growth_mib_per_epoch <= 36, floor
    assert floor.limit_mib == 4096
    assert floor.epochs_to_limit == math.ceil((4096 - floor.last_mib) / floor.growth_mib_per_epoch)
    text = summary_lib.format_summary(summary)
    assert f"floor of {device} (memory in use between steps)" in text, text
    assert "MiB per epoch: at that rate it reaches the 4096.0 MiB limit in about" in text, text
    labels = [
        line.get_label()
        for axes in plot.draw([run], [summary]).axes
        for line in axes.get_lines()
    ]
    assert f"{device} floor (per epoch)" in labels and "floor (per epoch)" in labels


def test_a_floor_without_growth_says_no_rise_was_found():
    floor = summary_lib.floor_summary(
        "gpu0", Series((4, 8), (100.0, 100.5), (0.0, 1.0)), Series(), Series((4,), (8000.0,), (0.0,))
    )
    assert floor.epochs_to_limit is None
    assert summary_lib.format_floor(floor) == (
        "floor of gpu0 (memory in use between steps): 100.0 MiB in the first epoch, "
        "100.5 MiB in the last of 2; no rise found"
    )
