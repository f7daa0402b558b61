"""The TensorBoard sink: event bytes, the queue, the dashboard layout, crashes.

The training thread only queues rows; encoding and writing happen at flushes
and on the writer's thread. These tests read what reaches the disk with
TensorBoard's own loaders, and run fits that die of an exception in
processes of their own.
"""

import json
import math
import os
import re
import struct
import subprocess
import time

import numpy as np
import pytest
from tensorboard.backend.event_processing import data_provider
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2
from tensorboard.plugins.custom_scalar import custom_scalars_plugin
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalars_metadata

import programs
from keras_memguard.sinks import tensorboard as tb

CPU0 = tb.device_tags("cpu0")
GPU1 = tb.device_tags("gpu1")


def _events(run_dir):
    """Every event of the run's event files, in order."""
    from tensorboard.backend.event_processing import event_file_loader

    events = []
    for name in sorted(os.listdir(run_dir)):
        loader = event_file_loader.RawEventFileLoader(os.path.join(run_dir, name))
        events += [event_pb2.Event.FromString(raw) for raw in loader.Load()]
    return events


def _scalars(run_dir):
    acc = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def _served_layout(log_dir):
    """The layout the Custom Scalars plugin serves for `log_dir`."""
    from tensorboard import context
    from tensorboard.plugins import base_plugin

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(log_dir))
    plugin = custom_scalars_plugin.CustomScalarsPlugin(
        base_plugin.TBContext(
            logdir=str(log_dir), data_provider=provider, plugin_name_to_instance={}
        )
    )
    return json.loads(plugin.layout_impl(context.RequestContext(), experiment=""))


class _Holder:
    """Stands in for a callback holding the writer."""


# --------------------------------------------------------------------------
# Event bytes


@pytest.mark.parametrize("step", [0, 1, 127, 128, 300, 2**40, -1])
def test_encoded_events_parse_as_tensorboard_events(step):
    summary = b"".join(
        tb._value_prefix(tag) + tb._float32_bytes(value)
        for tag, value in ((CPU0["peak"], 12.5), ("é/ü" * 60, -3.0))
    )
    event = event_pb2.Event.FromString(tb.encode_event(step, 1234.5, summary))
    assert event.step == step and event.wall_time == 1234.5
    assert [(v.tag, v.simple_value) for v in event.summary.value] == [
        (CPU0["peak"], 12.5),
        ("é/ü" * 60, -3.0),
    ]


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3.0),
        (np.float64(0.25), 0.25),
        (np.float32(1.5), 1.5),
        (True, 1.0),
        (1e39, math.inf),
        (-1e39, -math.inf),
        (1 / 3, float(np.float32(1 / 3))),
    ],
)
def test_values_are_float32_as_tensorboard_stores_them(value, expected):
    (stored,) = struct.unpack("<f", tb._float32_bytes(value))
    assert stored == expected


def test_nan_is_kept():
    (stored,) = struct.unpack("<f", tb._float32_bytes(math.nan))
    assert math.isnan(stored)


# --------------------------------------------------------------------------
# The writer


def test_rows_of_one_step_become_one_event_and_none_is_skipped(tmp_path):
    writer = tb.ScalarWriter(str(tmp_path / "memguard"))
    tags = (CPU0["current"], CPU0["peak"], CPU0["limit"], CPU0["usage"])
    writer.write_values(1, tags, (10.0, 12.0, 100.0, 0.12))
    writer.write(1, ((tb.MICRO_BATCHES, 2), (tb.MICRO_BATCH_SIZE, None)))
    writer.write_values(2, tags, (11.0, None, 100.0, None))
    writer.write(2, ((tb.MICRO_BATCHES, 2),))
    writer.flush()
    scalar_events = [e for e in _events(writer.run_dir) if e.summary.value and
                     e.summary.value[0].tag != custom_scalars_metadata.CONFIG_SUMMARY_TAG]
    assert [(e.step, [v.tag for v in e.summary.value]) for e in scalar_events] == [
        (1, [*tags, tb.MICRO_BATCHES]),
        (2, [CPU0["current"], CPU0["limit"], tb.MICRO_BATCHES]),
    ]
    assert _scalars(writer.run_dir)[CPU0["usage"]] == [(1, pytest.approx(0.12))]
    writer.close()


def test_nothing_is_written_on_the_training_thread_until_a_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "FLUSH_SECS", 60)
    writer = tb.ScalarWriter(str(tmp_path / "memguard"))
    holder = _Holder()
    writer.acquire(holder)
    writer.write(1, ((tb.MICRO_BATCHES, 1),))
    # Queued, not yet encoded: nothing until the thread or a flush runs.
    assert writer._pending
    writer.flush()
    assert not writer._pending
    assert _scalars(writer.run_dir)[tb.MICRO_BATCHES] == [(1, 1.0)]
    writer.release(holder)
    assert writer._thread is None


def test_the_thread_writes_without_a_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "FLUSH_SECS", 0.05)
    writer = tb.ScalarWriter(str(tmp_path / "memguard"))
    holder = _Holder()
    writer.acquire(holder)
    writer.write(3, ((tb.OOM_RECOVERIES, 1),))
    for _ in range(100):
        if not writer._pending:
            break
        time.sleep(0.05)
    assert not writer._pending
    assert _scalars(writer.run_dir)[tb.OOM_RECOVERIES] == [(3, 1.0)]
    writer.release(holder)


def test_one_file_across_fits_and_a_new_one_when_it_was_deleted(tmp_path):
    import shutil

    writer = tb.writer_for(tmp_path / "logs")
    holder = _Holder()
    for step in (1, 2):
        writer.acquire(holder)
        writer.write(step, ((tb.MICRO_BATCHES, step),))
        writer.release(holder)
    run_dir = tmp_path / "logs" / "memguard"
    assert len(os.listdir(run_dir)) == 1
    assert _scalars(run_dir)[tb.MICRO_BATCHES] == [(1, 1.0), (2, 2.0)]
    shutil.rmtree(tmp_path / "logs")
    writer.acquire(holder)
    writer.write(3, ((tb.MICRO_BATCHES, 3),))
    writer.release(holder)
    assert _scalars(run_dir)[tb.MICRO_BATCHES] == [(3, 3.0)]
    # The new file has the dashboard too.
    assert _served_layout(tmp_path / "logs")["category"]


def test_an_unwritable_directory_warns_once_and_drops_events(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = tb.ScalarWriter(str(blocker / "memguard"))
    holder = _Holder()
    writer.acquire(holder)
    with caplog.at_level("WARNING", logger="keras_memguard"):
        for step in range(3):
            writer.write(step, ((tb.MICRO_BATCHES, 1),))
            writer.flush()
    writer.release(holder)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1
    assert not writer._pending


# --------------------------------------------------------------------------
# The dashboard layout


def _charts(layout):
    (category,) = layout.category
    assert category.title == tb.DASHBOARD_CATEGORY
    return {chart.title: list(chart.multiline.tag) for chart in category.chart}


def _matches(regexes, tag):
    return any(re.match(regex, tag) for regex in regexes)


def test_layout_charts_match_exactly_the_tags_they_show():
    charts = _charts(tb.dashboard_layout(["cpu0", "gpu1"]))
    assert list(charts) == [
        tb.DEVICE_CHART.format(dev="cpu0"),
        tb.DEVICE_CHART.format(dev="gpu1"),
        tb.USAGE_CHART,
        tb.MICRO_BATCH_CHART,
    ]
    floors = {dev: tb.FLOOR_MIB.format(dev=dev) for dev in ("cpu0", "gpu1", tb.HOST)}
    every_tag = [
        tag for names in (CPU0, GPU1) for tag in names.values()
    ] + [tb.MICRO_BATCHES, tb.MICRO_BATCH_SIZE, tb.OOM_RECOVERIES, tb.THRESHOLD] + [
        *floors.values(),
        *(tb.GROWTH_MIB_PER_EPOCH.format(dev=dev) for dev in ("cpu0", "gpu1", tb.HOST)),
    ]
    expected = {
        tb.DEVICE_CHART.format(dev="cpu0"): {
            CPU0["current"], CPU0["peak"], CPU0["limit"], floors["cpu0"]
        },
        tb.DEVICE_CHART.format(dev="gpu1"): {
            GPU1["current"], GPU1["peak"], GPU1["limit"], floors["gpu1"]
        },
        tb.USAGE_CHART: {CPU0["usage"], GPU1["usage"], tb.THRESHOLD},
        tb.MICRO_BATCH_CHART: {tb.MICRO_BATCHES, tb.OOM_RECOVERIES},
    }
    for title, regexes in charts.items():
        assert {t for t in every_tag if _matches(regexes, t)} == expected[title]


def test_layout_leaves_out_what_was_not_written():
    assert list(_charts(tb.dashboard_layout(["cpu0"], guard=False))) == [
        tb.DEVICE_CHART.format(dev="cpu0"), tb.USAGE_CHART
    ]
    assert list(_charts(tb.dashboard_layout(usage=False))) == [tb.MICRO_BATCH_CHART]


def test_layout_is_written_once_then_only_when_a_device_appears(tmp_path):
    writer = tb.writer_for(tmp_path)
    cpu_tags = (CPU0["current"], CPU0["peak"], CPU0["limit"], CPU0["usage"])
    for step in range(1, 4):
        writer.write_values(step, cpu_tags, (1.0, 2.0, 3.0, 0.5))
        writer.write(step, ((tb.MICRO_BATCHES, 1), (tb.OOM_RECOVERIES, 0)))
        writer.flush()
    gpu_tags = (GPU1["current"], GPU1["peak"], GPU1["limit"], GPU1["usage"])
    writer.write_values(4, gpu_tags, (1.0, 2.0, 3.0, 0.5))
    writer.flush()
    layouts = [
        (e.step, layout_pb2.Layout.FromString(v.tensor.string_val[0]))
        for e in _events(writer.run_dir)
        for v in e.summary.value
        if v.tag == custom_scalars_metadata.CONFIG_SUMMARY_TAG
    ]
    # Once for the first step's rows, again for the new device.
    assert [(step, list(_charts(layout))) for step, layout in layouts] == [
        (1, [tb.DEVICE_CHART.format(dev="cpu0"), tb.USAGE_CHART, tb.MICRO_BATCH_CHART]),
        (4, [
            tb.DEVICE_CHART.format(dev="cpu0"),
            tb.DEVICE_CHART.format(dev="gpu1"),
            tb.USAGE_CHART,
            tb.MICRO_BATCH_CHART,
        ]),
    ]
    # TensorBoard's Custom Scalars plugin serves the latest.
    served = _served_layout(tmp_path)
    assert [c["title"] for c in served["category"][0]["chart"]] == list(
        _charts(layouts[-1][1])
    )
    writer.close()


# --------------------------------------------------------------------------
# A process that dies of an exception escaping `fit`


@pytest.mark.slow
@pytest.mark.parametrize("where", ["callback", "data"])
def test_completed_batches_are_on_disk_when_an_exception_ends_the_process(
    tmp_path, where
):
    result = subprocess.run(
        programs.command("monitor_crash", str(tmp_path), where),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode != 0
    assert "crash at batch" in result.stderr, result.stderr[-3000:]
    scalars = _scalars(tmp_path / "memguard")
    # Batches 1-5 completed in the second epoch (steps 9-13); with the
    # error in a callback, the sixth batch's values were taken before the
    # callbacks ran.
    last = 14 if where == "callback" else 13
    for tag in (CPU0["peak"], CPU0["usage"], tb.MICRO_BATCHES, tb.OOM_RECOVERIES):
        assert [step for step, _ in scalars[tag]] == list(range(1, last + 1)), tag
    # The first epoch's end was flushed at the time: its epoch peak is there.
    assert [step for step, _ in scalars[CPU0["epoch_peak"]]] == [8]
