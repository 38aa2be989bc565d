"""`memfit ui` end to end in a real browser (headless Chromium through Selenium): the server started as a user
starts it, the form filled, an estimate run and shown, an OOM message diagnosed, a bad value answered with the
CLI's message. Every request the page makes goes to the app itself (other hosts do not resolve).

Skipped without gradio, selenium, or a `chromium` and a `chromedriver` (`apt-get install chromium
chromium-driver`). With MEMFIT_SCREENSHOTS=DIR the screenshots are also saved there (docs/images/)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("gradio")
webdriver = pytest.importorskip("selenium.webdriver")

_BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
_DRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_BROWSER is None or _DRIVER is None, reason="needs chromium and chromedriver")]

#: A real message (tests/data/oom/corpus.json `rlinf255`: other processes hold the GPU).
_OOM = json.loads((Path(__file__).parents[1] / "data" / "oom" / "corpus.json").read_text(encoding="utf-8"))
_OOM = next(c["text"] for c in _OOM if c["id"] == "rlinf255")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "MEMFIT_CACHE_DIR": str(tmp_path_factory.mktemp("c"))}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "memfit", "ui", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    first_page_s = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    assert r.status == 200
                first_page_s = time.monotonic() - started
                break
            except OSError:
                time.sleep(0.2)
        assert first_page_s is not None, proc.stdout.read() if proc.poll() is not None else "no page in 120 s"
        yield url, first_page_s
    finally:
        proc.terminate()
        proc.wait(10)


def _save(driver, tmp_path, name):
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    assert len(image.getcolors(maxcolors=1 << 20) or ()) > 16  # not blank
    out = os.environ.get("MEMFIT_SCREENSHOTS")
    if out:
        shutil.copy(shot, Path(out) / name)


@pytest.fixture(scope="module")
def driver():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,1400",
                # no network but the app: every other host unresolvable
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(_DRIVER), options=opts)
    d.execute_cdp_cmd("Network.enable", {})
    yield d
    d.quit()


def _wait(driver, predicate, timeout_s=240):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(lambda d: predicate(d))


def _status(driver):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, "#status textarea").get_attribute("value") or ""


def _type(driver, elem_id, text):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    box.send_keys(text)


def _run(driver, button, word):
    """Click `button` (`<verb>-btn`) and wait for that verb's status with `word` (or its `not run`)."""
    from selenium.webdriver.common.by import By

    verb = button.split("-")[0] + ":"
    driver.find_element(By.ID, button).click()
    _wait(driver, lambda d: _status(d).startswith(verb) and (word in _status(d) or "not run" in _status(d)))
    return _status(driver)


def test_the_app_estimates_diagnoses_and_answers_a_bad_value(server, driver, tiny_bert_dir, tmp_path):
    from selenium.webdriver.common.by import By

    url, first_page_s = server
    print(f"memfit ui: first page {first_page_s:.1f} s after the process started")
    driver.get_log("performance")
    driver.get(url)
    _wait(driver, lambda d: d.find_elements(By.ID, "estimate-btn"), 60)

    # the form: an uploaded config.json (a small BERT), batch 4, length 64, on the default T4
    upload = driver.find_element(By.CSS_SELECTOR, "#config-upload input[type=file]")
    upload.send_keys(str(Path(tiny_bert_dir) / "config.json"))
    _wait(driver, lambda d: "config.json" in d.find_element(By.ID, "config-upload").text, 30)
    _type(driver, "batch", "4")
    _type(driver, "length", "64")
    status = _run(driver, "estimate-btn", "done")
    assert status.startswith("estimate: done"), status
    frame = driver.find_element(By.CSS_SELECTOR, "#result iframe#memfit-view")
    driver.switch_to.frame(frame)
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.chart") == "ready", 30)
    assert driver.find_elements(By.CSS_SELECTOR, "path[data-category=weights]")
    peak = int(driver.find_element(By.CSS_SELECTOR, "[data-marker=peak]").get_attribute("data-bytes"))
    driver.switch_to.default_content()
    _save(driver, tmp_path, "ui-estimate.png")

    # the same setup through the Python API: the page shows its peak
    from memfit import TrainSetup, estimate

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=64, per_device_train_batch_size=4), gpu="T4")
    assert peak == r.peak_allocated_bytes

    # an OOM message pasted: the diagnosis with its bar and causes
    _type(driver, "oom-text", _OOM)
    status = _run(driver, "diagnose-btn", "done")
    assert status.startswith("diagnose: done"), status
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "#result iframe#memfit-view"))
    primary = driver.find_element(By.CSS_SELECTOR, "li.cause[data-primary=true]")
    assert primary.get_attribute("data-kind") == "other_processes"
    assert driver.find_elements(By.CSS_SELECTOR, "rect[data-segment=request]")
    driver.switch_to.default_content()
    _save(driver, tmp_path, "ui-diagnose.png")

    # a bad value: the CLI's one-line message in the page, no traceback
    _type(driver, "batch", "four")
    status = _run(driver, "estimate-btn", "not run")
    error = driver.find_element(By.ID, "memfit-ui-error").text
    assert "--batch-size" in error and "four" in error and "Traceback" not in error, error
    _save(driver, tmp_path, "ui-error.png")

    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    sent = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    urls = {m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"}
    outside = {u for u in urls if not u.startswith((url, "data:", "blob:", "about:"))}
    assert outside == set()


def test_the_first_page_answers_quickly_once_the_server_listens(server):
    url, _ = server
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and b"memfit" in r.read()
    assert time.monotonic() - started < 2


def test_a_long_run_shows_progress_and_cancel_stops_it(server, driver):
    """The built-in example's plan (tens of seconds): the status counts while it runs; Cancel ends it."""
    from selenium.webdriver.common.by import By

    url, _ = server
    driver.get(url)
    _wait(driver, lambda d: d.find_elements(By.ID, "plan-btn"), 60)
    driver.find_element(By.ID, "plan-btn").click()  # the form as loaded: the built-in example on a T4
    seen = []
    _wait(driver, lambda d: seen.append(_status(d)) or _status(d).startswith("plan: simulating"), 120)
    driver.find_element(By.ID, "cancel-btn").click()
    deadline = time.monotonic() + 30
    while not _status(driver).startswith("plan: cancelled") and time.monotonic() < deadline:
        seen.append(_status(driver))
        time.sleep(0.5)
    assert _status(driver).startswith("plan: cancelled"), seen[-3:] + [driver.find_element(By.ID, "result").text]
