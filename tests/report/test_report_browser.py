"""The HTML view in a real browser (headless Chromium through Selenium), with the network off.

Skipped without selenium or without a `chromium` and a `chromedriver` executable
(`apt-get install chromium chromium-driver`; `pip install selenium`)."""

import json
import shutil

import pytest

from memfit import TrainSetup, estimate
from memfit.report import report_timeline
from memfit.units import MiB, format_bytes

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


def _assert_shapes(rows, tl):
    """The hovered rows show the peak's largest live tensors as the timeline has them: size, category, module,
    shape and dtype."""
    from selenium.webdriver.common.by import By

    peak = next(s for s in tl.samples if s.index == tl.peak_index)
    cells = [[c.text for c in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    want = [("(" + ", ".join(map(str, t.shape)) + ")" if t.shape is not None else "\u2014",
             t.dtype or "\u2014", t.module or "\u2014") for t in peak.top]
    assert [(c[3], c[4], c[2]) for c in cells] == want
    assert any(c[3].startswith("(") and c[4] for c in cells)


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
    _assert_shapes(rows, tl)
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
    # the OOM point itself: the failing request stacked on what was allocated, above the chart's highest sample
    tl = report_timeline(r)
    bar = driver.find_element(By.CSS_SELECTOR, "[data-marker=oom-request]")
    assert int(bar.get_attribute("data-request-bytes")) == tl.oom_request.size_bytes
    assert int(bar.get_attribute("data-bytes")) == tl.samples[-1].allocated_bytes + tl.oom_request.size_bytes
    peak = driver.find_element(By.CSS_SELECTOR, "[data-marker=peak]")
    assert bar.location["y"] < peak.location["y"]  # drawn higher than the highest point reached
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).move_to_element(bar).perform()
    assert int(tip.get_attribute("data-index")) == tl.oom_index
    request = tip.find_element(By.CSS_SELECTOR, "tr.request")
    assert "not granted" in request.text and request.get_attribute("data-category") == tl.oom_request.category


# -- three setups, and the other verbs' pages ------------------------------------------------------------------
def _screenshot(driver, tmp_path, name):
    """A screenshot that is not blank; also saved to $MEMFIT_SCREENSHOTS (docs/images/) when set."""
    import os

    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    assert len(image.getcolors(maxcolors=1 << 20) or ()) > 16  # not blank: many colours, not one
    if os.environ.get("MEMFIT_SCREENSHOTS"):
        shutil.copy(shot, os.path.join(os.environ["MEMFIT_SCREENSHOTS"], name))


def _seed():
    from memfit.commands.estimate import SEED_CASE

    seed = {k: v for k, v in SEED_CASE.items() if k not in ("model", "gpu", "training_args")}
    seed["max_length"] = 4096  # the length an untruncated XLNet dataset reaches: it does not fit then
    return TrainSetup.from_kwargs(SEED_CASE["model"], training_args=SEED_CASE["training_args"], **seed), {
        "gpu": SEED_CASE["gpu"]}


def test_each_group_of_ranks_that_differ_is_drawn_and_hovered(driver, tiny_bert_dir, tmp_path):
    """ZeRO-2 over 3 ranks: besides rank 0's timeline, each other group of ranks has its own chart, drawn from its
    own data: a series per category, its own peak, and hovering it lists that rank's tensors in its own tooltip."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from memfit.parallel import ParallelSetup

    r = estimate(TrainSetup(model=tiny_bert_dir, max_length=16), gpu="T4",
                 parallel=ParallelSetup(world_size=3, strategy="zero2"))
    path = tmp_path / "zero2.html"
    r.to_html(path)
    _load(driver, path)
    boxes = driver.find_elements(By.CSS_SELECTOR, "[data-rank-timeline]")
    assert sorted(b.get_attribute("data-ranks") for b in boxes) == ["1", "2"]
    peaks = {}
    for box in boxes:
        data = json.loads(box.find_element(By.CSS_SELECTOR, "script.memfit-rank-data").get_attribute("textContent"))
        series = box.find_elements(By.CSS_SELECTOR, "path[data-category]")
        assert sorted(s.get_attribute("data-category") for s in series) == sorted(data["categories"])
        svg = box.find_element(By.CSS_SELECTOR, "svg")
        assert int(svg.get_attribute("data-peak-allocated-bytes")) == data["peak_allocated_bytes"]
        peak = box.find_element(By.CSS_SELECTOR, "[data-marker=peak]")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", peak)
        ActionChains(driver).move_to_element(peak).perform()
        tip = box.find_element(By.CSS_SELECTOR, ".tooltip")
        assert tip.is_displayed() and int(tip.get_attribute("data-allocated-bytes")) == data["peak_allocated_bytes"]
        assert tip.find_elements(By.CSS_SELECTOR, "tr.tensor")
        assert not driver.find_element(By.ID, "memfit-tooltip").is_displayed()  # rank 0's stays hidden
        peaks[box.get_attribute("data-ranks")] = data["peak_allocated_bytes"]
    main = int(driver.find_element(By.ID, "memfit-chart").get_attribute("data-peak-allocated-bytes"))
    assert main == r.peak_allocated_bytes and len({main, *peaks.values()}) == 3
    _screenshot(driver, tmp_path, "estimate-zero2.png")


def _qlora():
    return TrainSetup(model="meta-llama/Llama-3.2-1B", task="causal-lm", max_length=512, per_device_train_batch_size=2,
                      load_in_4bit=True, lora_r=16, precision="fp16", gradient_checkpointing=True), {"gpu": "T4"}


def _fsdp():
    from memfit.parallel import ParallelSetup

    return TrainSetup(model="gpt2", task="causal-lm", max_length=256, per_device_train_batch_size=2), {
        "gpu": "A100-40GB", "parallel": ParallelSetup(world_size=4, strategy="fsdp")}


@pytest.mark.slow
@pytest.mark.parametrize("name, make", [("seed", _seed), ("qlora", _qlora), ("fsdp4", _fsdp)])
def test_three_setups_in_the_browser(driver, tmp_path, name, make):
    """The seed case at 4096 tokens (does not fit a V100-16GB), a QLoRA Llama-3.2-1B on a T4, GPT-2 with FSDP over 4
    ranks."""
    from selenium.webdriver.common.by import By

    setup, kw = make()
    r = estimate(setup, cache=False, **kw)
    if name == "seed":
        assert r.fits is False
    path = tmp_path / f"{name}.html"
    r.to_html(path)
    _load(driver, path)
    tl = report_timeline(r)
    series = driver.find_elements(By.CSS_SELECTOR, "path[data-category]")
    assert sorted(s.get_attribute("data-category") for s in series) == sorted(tl.categories)
    peak, tip = _hover_peak(driver)
    if tl.oom_index is None:
        assert int(peak.get_attribute("data-bytes")) == r.peak_allocated_bytes
    else:  # the timeline stops at the OOM: its highest point is the one before it; the card gives the full peak
        assert int(peak.get_attribute("data-bytes")) == max(s.allocated_bytes for s in tl.samples)
        assert int(driver.find_element(By.CSS_SELECTOR, "[data-marker=oom]").get_attribute("data-index")) == \
            tl.oom_index
        assert format_bytes(r.peak_allocated_bytes) in driver.find_element(By.CSS_SELECTOR, ".cards").text
    rows = tip.find_elements(By.CSS_SELECTOR, "tr.tensor")
    assert rows and {row.get_attribute("data-category") for row in rows} <= set(tl.categories)
    if tl.oom_index is None or int(tip.get_attribute("data-index")) == tl.peak_index:
        _assert_shapes(rows, tl)
    _screenshot(driver, tmp_path, f"estimate-{name}.png")


def _load_static(driver, path):
    """A page without a script (plan, diagnose, replay): loads with no console error and no request."""
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(path.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    sent = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    assert {m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"} <= {
        path.as_uri()}


def test_the_diagnose_and_replay_pages_in_the_browser(driver, tmp_path):
    import gzip

    from selenium.webdriver.common.by import By

    from helpers import DATA_DIR
    from memfit.allocator.snapshot import replay_snapshot, what_if
    from memfit.diagnosis.verb import diagnose
    from memfit.report.diagnose_view import render_diagnosis_html
    from memfit.report.replay_view import render_replay_html

    corpus = json.loads((DATA_DIR / "oom" / "corpus.json").read_text(encoding="utf-8"))
    d = diagnose(next(c["text"] for c in corpus if c["id"] == "rlinf255"))
    path = tmp_path / "diagnose.html"
    path.write_text(render_diagnosis_html(d), encoding="utf-8")
    _load_static(driver, path)
    bar = driver.find_element(By.CSS_SELECTOR, "rect[data-segment=other_processes]")
    assert bar.size["width"] > 0.5 * driver.find_element(By.ID, "memfit-diagnose-bar").size["width"]  # 15 of 23.6 GiB
    _screenshot(driver, tmp_path, "diagnose.png")

    snap = json.loads(gzip.decompress((DATA_DIR / "snapshots" / "wedsonlin_medium_ctx128_trainstep.json.gz").read_bytes()))
    r = replay_snapshot(snap)
    series = [[], []]
    variants = [what_if(snap, t, reserved_after=s) for t, s in zip([None, "expandable_segments:True"], series)]
    path = tmp_path / "replay.html"
    path.write_text(render_replay_html("wedsonlin_medium_ctx128_trainstep.pickle", 0, r, variants, series),
                    encoding="utf-8")
    _load_static(driver, path)
    assert len(driver.find_elements(By.CSS_SELECTOR, "path[data-series]")) == 4
    _screenshot(driver, tmp_path, "replay.png")


@pytest.mark.slow
def test_the_plan_page_in_the_browser(driver, tmp_path):
    """A BERT that does not fit a 1771 MiB GPU as is (about 20 s of simulations)."""
    from selenium.webdriver.common.by import By
    from transformers import BertConfig

    from memfit.planner.search import plan
    from memfit.report.plan_view import render_plan_html

    BertConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, intermediate_size=1024,
               vocab_size=8000).save_pretrained(tmp_path)
    result = plan(TrainSetup(model=str(tmp_path), max_length=512, per_device_train_batch_size=16,
                             gradient_accumulation_steps=2), gpu="1771MiB")
    path = tmp_path / "plan.html"
    path.write_text(render_plan_html(result), encoding="utf-8")
    _load_static(driver, path)
    budget = driver.find_element(By.CSS_SELECTOR, "line[data-line=budget]")
    for c in driver.find_elements(By.CSS_SELECTOR, "circle[data-plan]"):  # fitting points under the budget line
        centre = c.location["y"] + c.size["height"] / 2
        assert (centre >= budget.location["y"]) == (c.get_attribute("data-fits") == "true")
    dots = driver.find_elements(By.CSS_SELECTOR, "circle[data-searched]")  # every configuration the search ranked
    assert len(dots) == len(result.searched) > len(result.plans)
    for c in dots:
        centre = c.location["y"] + c.size["height"] / 2
        assert (centre >= budget.location["y"] - 1) == (c.get_attribute("data-fits") == "true")
    assert driver.find_element(By.ID, "memfit-change").text
    _screenshot(driver, tmp_path, "plan.png")
