"""Headless Chromium on TensorBoard's Custom Scalars page: the helpers of
tests/test_dashboard.py, and a program that takes a screenshot of a log
directory's dashboard.

    dashboard LOG_DIR OUT.png [WIDTH HEIGHT]

starts TensorBoard on LOG_DIR, waits for the charts to draw, writes the
screenshot and stops both processes. The page is read through the DevTools
protocol (`--remote-debugging-pipe`): TensorBoard's dashboards draw their
charts inside shadow roots, which `--dump-dom` leaves out.
"""

import base64
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


class DevTools:
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
CARDS_JS = r"""
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




@contextlib.contextmanager
def tensorboard(log_dir, timeout=120):
    """Serves `log_dir` from a TensorBoard process; yields its URL.

    Waits until the Custom Scalars plugin serves a layout; stops the
    process on exit.
    """
    port = free_port()
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
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    "TensorBoard exited: " + process.stderr.read().decode()[-3000:]
                )
            try:
                layout = json.loads(http_get(url + "/data/plugin/custom_scalars/layout"))
                if layout.get("category"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"TensorBoard served no layout in {timeout} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def read_cards(url, width, height, expected_cards, timeout=90, settings=None):
    """Loads the Custom Scalars page; returns `(cards, png)`.

    `settings` (a dict such as `{"_smoothingWeight": 0}`) go where the
    dashboard reads its own: the URL fragment and the page's local storage
    (the page is loaded again after they are stored).

    Waits until `expected_cards` chart cards each show "Matches (N)" and
    drew a line (or until `timeout`), then takes a screenshot.
    """
    binary = chromium_binary()
    if binary is None:
        raise FileNotFoundError("no chromium on PATH")
    browser = DevTools(binary, width=width, height=height)
    try:
        fragment = "".join(f"&{key}={value}" for key, value in (settings or {}).items())
        browser.open(url + "/#custom_scalars" + fragment)
        if settings:
            for key, value in settings.items():
                browser.evaluate(
                    f"localStorage.setItem({json.dumps(key)}, {json.dumps(str(value))})"
                )
            browser.call("Page.reload")
        deadline = time.monotonic() + timeout
        cards = []
        while time.monotonic() < deadline:
            cards = json.loads(browser.evaluate(CARDS_JS) or "[]")
            if len(cards) == expected_cards and all(
                "Matches (" in card["text"] and card["lines"] for card in cards
            ):
                break
            time.sleep(0.5)
        time.sleep(1)  # the charts' last transition
        return cards, browser.screenshot()
    finally:
        browser.close()


# For a picture of a short run: every point as it was, none left out of
# the scale (TensorBoard's defaults smooth by 0.6 and ignore outliers).
PICTURE_SETTINGS = {"_smoothingWeight": 0, "_ignoreYOutliers": "false"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    log_dir, out = argv[0], argv[1]
    width, height = (int(v) for v in argv[2:4]) if len(argv) >= 4 else (1600, 470)
    with tensorboard(log_dir) as url:
        layout = json.loads(http_get(url + "/data/plugin/custom_scalars/layout"))
        charts = sum(len(c["chart"]) for c in layout["category"])
        cards, png = read_cards(url, width, height, charts, settings=PICTURE_SETTINGS)
    with open(out, "wb") as f:
        f.write(png)
    print(f"{out}: {len(cards)} charts")


if __name__ == "__main__":
    main()
