"""The memory dashboard, in a real TensorBoard, in a real browser.

A small `fit` with MemoryMonitor, MemoryGuard and keras' TensorBoard writes
its logs; TensorBoard serves them from a process of its own, and headless
Chromium (Debian's `chromium` package) loads the Custom Scalars page, read
through the DevTools protocol (tests/programs/dashboard.py: the charts are
drawn inside shadow roots, which `--dump-dom` leaves out). Every process
started here is stopped in a `finally`, and each wait has a deadline.
"""

import json
import os
import re
import shutil
import struct
import urllib.parse
import warnings

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalars_metadata

import keras_memguard
from keras_memguard.sinks import tensorboard as tb
from programs import dashboard

BATCHES = 4
EPOCHS = 2
STEPS = BATCHES * EPOCHS
CPU0 = tb.device_tags("cpu0")
# Chart title -> the tags it shows: all of them written by this run's fit.
EXPECTED = {
    tb.DEVICE_CHART.format(dev="cpu0"): {CPU0["current"], CPU0["peak"], CPU0["limit"]},
    # The monitor writes the process's resident memory.
    tb.HOST_CHART: {tb.HOST_RSS_MIB},
    # The guard writes its threshold: drawn over the usage.
    tb.USAGE_CHART: {CPU0["usage"], tb.THRESHOLD},
    tb.MICRO_BATCH_CHART: {tb.MICRO_BATCHES, tb.OOM_RECOVERIES},
}
WIDTH, HEIGHT = 1600, 900


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("dashboard_logs")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * BATCHES, 16))
    y = rng.normal(size=(32 * BATCHES, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(
            x, y, batch_size=32, epochs=EPOCHS, verbose=0,
            callbacks=[
                keras_memguard.MemoryMonitor(log_dir=log_dir),
                keras_memguard.MemoryGuard(log_dir=log_dir),
                keras.callbacks.TensorBoard(log_dir=log_dir),
            ],
        )
    return log_dir


def test_host_chart_shows_exactly_the_host_rss_tag():
    layout = tb.dashboard_layout(["cpu0"], host=True)
    (category,) = layout.category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    # After the device charts, before usage and the micro-batches.
    assert list(charts) == [
        tb.DEVICE_CHART.format(dev="cpu0"), tb.HOST_CHART, tb.USAGE_CHART,
        tb.MICRO_BATCH_CHART,
    ]
    written = set(CPU0.values()) | {
        tb.HOST_RSS_MIB, tb.MICRO_BATCHES, tb.OOM_RECOVERIES, tb.THRESHOLD
    }
    host_floor = tb.FLOOR_MIB.format(dev=tb.HOST)
    written.add(host_floor)
    regexes = charts[tb.HOST_CHART]
    assert {tag for tag in written if any(re.match(r, tag) for r in regexes)} == {
        tb.HOST_RSS_MIB, host_floor
    }
    for title, regexes in charts.items():
        if title != tb.HOST_CHART:
            assert not any(re.match(r, tb.HOST_RSS_MIB) for r in regexes), title
            assert not any(re.match(r, host_floor) for r in regexes), title


def test_the_writer_adds_the_host_chart_when_the_host_tag_appears(tmp_path):
    writer = tb.writer_for(tmp_path)
    writer.write_values(1, (CPU0["current"], CPU0["peak"]), (1.0, 2.0))
    writer.flush()
    writer.write_values(2, (CPU0["current"], tb.HOST_RSS_MIB), (1.0, 500.0))
    writer.flush()
    acc = event_accumulator.EventAccumulator(
        writer.run_dir, size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    layouts = [
        (event.step, [
            chart.title
            for chart in layout_pb2.Layout.FromString(
                event.tensor_proto.string_val[0]
            ).category[0].chart
        ])
        for event in acc.Tensors(custom_scalars_metadata.CONFIG_SUMMARY_TAG)
    ]
    assert layouts == [
        (1, [tb.DEVICE_CHART.format(dev="cpu0")]),
        (2, [tb.DEVICE_CHART.format(dev="cpu0"), tb.HOST_CHART]),
    ]
    writer.close()


@pytest.fixture(scope="module")
def tensorboard_url(log_dir):
    with dashboard.tensorboard(log_dir, timeout=120) as url:
        yield url


@pytest.mark.slow
def test_tensorboard_serves_the_layout_and_each_chart_s_data(tensorboard_url):
    layout = json.loads(
        dashboard.http_get(tensorboard_url + "/data/plugin/custom_scalars/layout")
    )
    (category,) = layout["category"]
    assert category["title"] == tb.DASHBOARD_CATEGORY
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
    assert set(charts) == set(EXPECTED)
    for title, regexes in charts.items():
        served = {}
        for regex in regexes:
            query = urllib.parse.urlencode({"run": tb.RUN_NAME, "tag": regex})
            reply = json.loads(dashboard.http_get(
                f"{tensorboard_url}/data/plugin/custom_scalars/scalars?{query}"
            ))
            assert reply["regex_valid"], regex
            served.update(reply["tag_to_events"])
        assert set(served) == EXPECTED[title]
        for tag in EXPECTED[title]:
            # [wall_time, step, value] per batch.
            assert [step for _, step, _ in served[tag]] == list(range(1, STEPS + 1)), tag


@pytest.mark.slow
def test_custom_scalars_page_shows_every_chart_with_data_in_chromium(
    tensorboard_url, tmp_path
):
    if dashboard.chromium_binary() is None:
        pytest.skip(
            "No Chromium on PATH (chromium, chromium-browser or google-chrome); "
            "on Debian: apt-get install -y chromium"
        )
    cards, png = dashboard.read_cards(
        tensorboard_url, WIDTH, HEIGHT, len(EXPECTED), timeout=90
    )
    (tmp_path / "dashboard.png").write_bytes(png)
    shots = os.environ.get("KERAS_MEMGUARD_SCREENSHOT_DIR")
    if shots:  # to look at it
        shutil.copy(tmp_path / "dashboard.png", os.path.join(shots, "dashboard.png"))

    by_title = {}
    for card in cards:
        for title in EXPECTED:
            if title in card["text"].splitlines():
                by_title[title] = card
    assert set(by_title) == set(EXPECTED), cards
    for title, card in by_title.items():
        # "Matches (N)": the series the chart draws; each drew its lines.
        assert f"Matches ({len(EXPECTED[title])})" in card["text"], card
        assert card["lines"] >= len(EXPECTED[title]), card
    # A PNG of the page's size.
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (WIDTH, HEIGHT)
