"""The HTML view in a real browser (headless Chromium through Selenium), with the network off.

Skipped without selenium or without a `chromium` and a `chromedriver` executable
(`apt-get install chromium chromium-driver`; `pip install selenium`)."""

import json
import shutil

import pytest

from memfit import TrainSetup, estimate
from memfit.report import report_timeline
from memfit.units import MiB

webdriver = pytest.importorskip("selenium.webdriver")

_BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
_DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(_BROWSER is None or _DRIVER is None, reason="needs chromium and chromedriver")


@pytest.fixture(scope="module")
def driver():
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,1000",
                # no network: every host unresolvable, every request to a dead proxy (and offline below)
                "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    d = webdriver.Chrome(service=Service(_DRIVER), options=opts)
    d.execute_cdp_cmd("Network.enable", {})
    d.execute_cdp_cmd("Network.emulateNetworkConditions",
                      {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})
    yield d
    d.quit()


def _load(driver, path):
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(path.as_uri())
    assert driver.execute_script("return document.body.dataset.chart") == "ready"
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    sent = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    urls = {m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"}
    assert urls <= {path.as_uri()}  # the file itself, nothing else


def _hover_peak(driver):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    peak = driver.find_element(By.CSS_SELECTOR, "[data-marker=peak]")
    ActionChains(driver).move_to_element(peak).perform()
    tip = driver.find_element(By.ID, "memfit-tooltip")
    assert tip.is_displayed()
    return peak, tip


def test_the_page_draws_the_estimate_and_hovering_lists_tensors(driver, tiny_bert_dir, tmp_path):
    from selenium.webdriver.common.by import By

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=64, per_device_train_batch_size=4), gpu="T4")
    path = tmp_path / "memfit.html"
    r.to_html(path)
    _load(driver, path)
    tl = report_timeline(r)
    series = driver.find_elements(By.CSS_SELECTOR, "path[data-category]")
    assert sorted(s.get_attribute("data-category") for s in series) == sorted(tl.categories)
    assert int(driver.find_element(By.ID, "memfit-chart").get_attribute("data-peak-allocated-bytes")) == \
        r.peak_allocated_bytes
    peak, tip = _hover_peak(driver)
    assert int(peak.get_attribute("data-bytes")) == r.peak_allocated_bytes
    assert int(tip.get_attribute("data-allocated-bytes")) == r.peak_allocated_bytes  # the peak's sample
    rows = tip.find_elements(By.CSS_SELECTOR, "tr.tensor")
    assert rows and {row.get_attribute("data-category") for row in rows} <= set(tl.categories)
    shot = tmp_path / "memfit.png"
    assert driver.save_screenshot(str(shot))
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    assert len(image.getcolors(maxcolors=1 << 20) or ()) > 16  # not blank: many colours, not one


def test_an_oom_page_marks_the_oom(driver, tiny_bert_dir, tmp_path):
    from selenium.webdriver.common.by import By

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=256, per_device_train_batch_size=32), gpu="T4",
                 capacity_bytes=96 * MiB)
    path = tmp_path / "oom.html"
    r.to_html(path)
    _load(driver, path)
    oom = driver.find_element(By.CSS_SELECTOR, "[data-marker=oom]")
    assert int(oom.get_attribute("data-index")) == report_timeline(r).oom_index
    assert driver.find_element(By.ID, "memfit-oom-message").text == r.oom.message.strip()
    _, tip = _hover_peak(driver)
    assert tip.find_elements(By.CSS_SELECTOR, "tr.tensor")
