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
import shutil
import struct
import urllib.parse
import warnings

import keras
import numpy as np
import pytest

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
