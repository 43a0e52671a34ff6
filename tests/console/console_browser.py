"""A real headless Chromium (Debian's ``chromium`` + ``chromium-driver``) driven through Selenium.

Tests skip, saying why, when either is missing (``.ci/run`` installs both). Chromium starts with a
fresh profile and with every background service off, so it never reaches beyond 127.0.0.1.
Screenshots go to ``tests/console/results/`` (ignored by git) for a person to look at.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).parent / "results"
DESKTOP = (1280, 800)
PHONE = (390, 844)
CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--no-default-browser-check", "--mute-audio",
]


def chromium() -> tuple[str, str]:
    """Paths of chromium and chromedriver, or skip the test naming what is missing."""
    pytest.importorskip("selenium", reason="selenium is not installed (./install.sh --dev)")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if not p)
        pytest.skip(f"{missing} not found: apt-get install chromium chromium-driver (.ci/run does it)")
    return browser, driver


@contextmanager
def browser_session() -> Iterator[Any]:
    """A Chromium at 1280x800 with network logging (to read the headers the page sends)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium()
    profile = tempfile.mkdtemp(prefix="meshllm-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in [*CHROMIUM_FLAGS, f"--window-size={DESKTOP[0]},{DESKTOP[1]}", f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_script_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_js(driver: Any, script: str, timeout: float, message: str) -> Any:
    """Poll ``return <script>`` until it is truthy; its value, or AssertionError naming ``message``."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(f"return {script}"))
    except TimeoutException:
        raise AssertionError(f"{message} (waited {timeout} s)") from None


def set_viewport(driver: Any, size: tuple[int, int]) -> None:
    """Emulate a screen of ``size`` CSS pixels (a phone is narrower than a headless window may be)."""
    width, height = size
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def set_theme(driver: Any, theme: str) -> None:
    """Click the page's theme button until it says ``theme`` (auto, light, dark)."""
    for _ in range(3):
        if driver.execute_script("return document.getElementById('theme').textContent") == f"Theme: {theme}":
            return
        driver.execute_script("document.getElementById('theme').click()")
    raise AssertionError(f"the theme button never reached {theme}")


def screenshot(driver: Any, name: str, size: tuple[int, int] = DESKTOP) -> Path:
    """Save what a screen of ``size`` shows, as ``results/<name>.png``."""
    RESULTS.mkdir(exist_ok=True)
    set_viewport(driver, size)
    path = RESULTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def show_view(driver: Any, view: str) -> None:
    """Select a tab (mesh, models, chat, owner) by clicking it, as a user would."""
    driver.execute_script(f"document.getElementById('tab-{view}').click()")
    wait_js(driver, f"!document.getElementById('view-{view}').hidden", 5, f"the {view} view did not open")


def sent_headers(driver: Any, path: str) -> list[dict[str, str]]:
    """Request headers of every request the page made to ``path`` since the last call (from the network log)."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            request = message["params"]["request"]
            if request["url"].split("#")[0].endswith(path):
                out.append({k.lower(): v for k, v in request["headers"].items()})
    return out


CONTRAST_JS = """
const canvas = document.createElement('canvas'); canvas.width = canvas.height = 1;
const ctx = canvas.getContext('2d', {willReadFrequently: true});
function rgba(css) {  // any CSS colour (light-dark(), color-mix(), oklch ...) as [r, g, b, a]
  ctx.clearRect(0, 0, 1, 1); ctx.fillStyle = '#000'; ctx.fillStyle = css; ctx.fillRect(0, 0, 1, 1);
  const d = ctx.getImageData(0, 0, 1, 1).data; return [d[0], d[1], d[2], d[3] / 255];
}
function over(top, under) { const a = top[3]; return [0, 1, 2].map(i => top[i] * a + under[i] * (1 - a)).concat(1); }
function background(node) {
  const layers = [];
  for (let n = node; n && n.nodeType === 1; n = n.parentElement) {
    const c = rgba(getComputedStyle(n).backgroundColor);
    if (c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
  }
  let bg = [255, 255, 255, 1];
  if (!layers.length || layers[layers.length - 1][3] < 1) bg = rgba(getComputedStyle(document.body).backgroundColor);
  for (const c of layers.reverse()) bg = over(c, bg);
  return bg;
}
function lum(c) { const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); }
function ratio(a, b) { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); }
const bad = [];
for (const node of document.querySelectorAll('body *')) {
  const text = [...node.childNodes].filter(c => c.nodeType === 3).map(c => c.textContent).join('').trim();
  if (!text || !node.checkVisibility() || node.closest(':disabled, .visually-hidden, svg')) continue;
  const style = getComputedStyle(node);
  const fg = over(rgba(style.color), background(node));
  const r = ratio(fg, background(node));
  const large = parseFloat(style.fontSize) >= 24 || (parseFloat(style.fontSize) >= 18.66 && +style.fontWeight >= 700);
  if (r < (large ? 3 : 4.5)) bad.push(`${text.slice(0, 30)}: ${r.toFixed(2)}`);
}
return bad;
"""

UNLABELLED_JS = """
const bad = [];
for (const c of document.querySelectorAll('button, input, select, textarea, [tabindex]:not([tabindex="-1"])')) {
  const labelled = c.labels?.length || c.getAttribute('aria-label') || c.getAttribute('aria-labelledby')
    || (c.tagName === 'BUTTON' && c.textContent.trim());
  if (!labelled) bad.push(c.outerHTML.slice(0, 80));
}
return bad;
"""


def contrast_failures(driver: Any) -> list[str]:
    """Visible HTML text whose contrast with its background is under WCAG AA (4.5:1, 3:1 for large)."""
    return driver.execute_script(CONTRAST_JS)


def unlabelled_controls(driver: Any) -> list[str]:
    """Controls (and other focusable elements) without an accessible name."""
    return driver.execute_script(UNLABELLED_JS)
