"""The memory dashboard, in a real TensorBoard, in a real browser.

A small `fit` with MemoryMonitor, MemoryGuard and keras' TensorBoard writes
its logs; TensorBoard serves them from a process of its own, and headless
Chromium (Debian's `chromium` package) loads the Custom Scalars page. The
page is read through the DevTools protocol (`--remote-debugging-pipe`):
TensorBoard's dashboards draw their charts inside shadow roots, which
`--dump-dom` leaves out. Every process started here is stopped in a
`finally`, and each wait has a deadline.
"""

import base64
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings

import keras
import numpy as np
import pytest

import keras_memguard
from keras_memguard.sinks import tensorboard as tb

BATCHES = 4
EPOCHS = 2
STEPS = BATCHES * EPOCHS
CPU0 = tb.device_tags("cpu0")
# Chart title -> the tags it shows: all of them written by this run's fit.
EXPECTED = {
    tb.DEVICE_CHART.format(dev="cpu0"): {CPU0["current"], CPU0["peak"], CPU0["limit"]},
    tb.USAGE_CHART: {CPU0["usage"]},
    tb.MICRO_BATCH_CHART: {tb.MICRO_BATCHES, tb.OOM_RECOVERIES},
}
PAGE_TIMEOUT_S = 90


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


class _DevTools:
    """Headless Chromium driven over `--remote-debugging-pipe`.

    Chromium reads protocol messages on its file descriptor 3 and writes on
    4, each a JSON object ended by a NUL byte; `bash` maps those onto the
    child's stdin and stdout pipes.
    """

    def __init__(self, binary, width, height):
        self.width, self.height = width, height
        self.process = subprocess.Popen(
            [
                "bash", "-c",
                'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null',
                binary, "--headless", "--no-sandbox", "--disable-gpu",
                "--remote-debugging-pipe", "--hide-scrollbars",
                f"--window-size={width},{height}", "about:blank",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""
        self._id = 0
        self.session = None

    def call(self, method, params=None, timeout=30, session=True):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        self.process.stdin.write(json.dumps(message).encode() + b"\0")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer {method}")
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium exited")
                self._buffer += chunk

    def open(self, url):
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call(
            "Target.attachToTarget", {"targetId": target, "flatten": True}
        )["sessionId"]
        # The page's own size, whatever the window around it.
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self.width, "height": self.height,
             "deviceScaleFactor": 1, "mobile": False},
        )
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression):
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}
        )["result"]
        return result.get("value")

    def screenshot(self):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        return base64.b64decode(data)

    def close(self):
        try:
            self.call("Browser.close", timeout=5, session=False)
        except Exception:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


# Each multi-line chart card of the Custom Scalars dashboard: its rendered
# text (title, "Matches (N)") and how many line paths it drew.
_CARDS_JS = r"""
(() => {
  const walk = (root, visit) => {
    const stack = [root];
    while (stack.length) {
      const node = stack.pop();
      if (node.nodeType === 1 && visit(node) === false) continue;
      if (node.shadowRoot) stack.push(node.shadowRoot);
      for (const child of node.children || []) stack.push(child);
    }
  };
  const text = (root) => {
    const parts = [];
    walk(root, (el) => {
      const name = el.tagName.toLowerCase();
      if (name === "style" || name === "script") return false;
      for (const child of el.childNodes) {
        if (child.nodeType === 3 && child.textContent.trim())
          parts.push(child.textContent.trim());
      }
      if (el.shadowRoot) {
        for (const child of el.shadowRoot.childNodes) {
          if (child.nodeType === 3 && child.textContent.trim())
            parts.push(child.textContent.trim());
        }
      }
    });
    return parts.join("\n");
  };
  const cards = [];
  walk(document.documentElement, (el) => {
    if (el.tagName.toLowerCase() !== "tf-custom-scalar-multi-line-chart-card") return;
    let lines = 0;
    walk(el.shadowRoot || el, (inner) => {
      if (inner.tagName.toLowerCase() === "path" &&
          (inner.getAttribute("class") || "").split(/\s+/).includes("line") &&
          (inner.getAttribute("d") || "").length > 1) lines++;
    });
    cards.push({text: text(el.shadowRoot || el), lines});
  });
  return JSON.stringify(cards);
})()
"""


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
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir),
            "--port", str(port), "--host", "127.0.0.1", "--reload_interval", "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail("TensorBoard exited: " + process.stderr.read().decode()[-3000:])
            try:
                layout = json.loads(_get(url + "/data/plugin/custom_scalars/layout"))
                if layout.get("category"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "TensorBoard served no layout in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.slow
def test_tensorboard_serves_the_layout_and_each_chart_s_data(tensorboard_url):
    layout = json.loads(_get(tensorboard_url + "/data/plugin/custom_scalars/layout"))
    (category,) = layout["category"]
    assert category["title"] == tb.DASHBOARD_CATEGORY
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
    assert set(charts) == set(EXPECTED)
    for title, regexes in charts.items():
        served = {}
        for regex in regexes:
            query = urllib.parse.urlencode({"run": tb.RUN_NAME, "tag": regex})
            reply = json.loads(
                _get(f"{tensorboard_url}/data/plugin/custom_scalars/scalars?{query}")
            )
            assert reply["regex_valid"], regex
            served.update(reply["tag_to_events"])
        # Until the guard writes its threshold, the usage chart shows usage.
        assert EXPECTED[title] <= set(served) <= EXPECTED[title] | {tb.THRESHOLD}
        for tag in EXPECTED[title]:
            # [wall_time, step, value] per batch.
            assert [step for _, step, _ in served[tag]] == list(range(1, STEPS + 1)), tag


@pytest.mark.slow
def test_custom_scalars_page_shows_every_chart_with_data_in_chromium(
    tensorboard_url, tmp_path
):
    binary = _chromium()
    if binary is None:
        pytest.skip(
            "No Chromium on PATH (chromium, chromium-browser or google-chrome); "
            "on Debian: apt-get install -y chromium"
        )
    browser = _DevTools(binary, width=1600, height=900)
    try:
        browser.open(tensorboard_url + "/#custom_scalars")
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        cards = []
        while time.monotonic() < deadline:
            cards = json.loads(browser.evaluate(_CARDS_JS) or "[]")
            if len(cards) == len(EXPECTED) and all(
                "Matches (" in card["text"] and card["lines"] for card in cards
            ):
                break
            time.sleep(0.5)
        png = browser.screenshot()
    finally:
        browser.close()
    (tmp_path / "dashboard.png").write_bytes(png)
    shots = os.environ.get("KERAS_MEMGUARD_SCREENSHOT_DIR")
    if shots:
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
    # A PNG of the window's size.
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1600, 900)
