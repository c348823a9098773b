"""The web console end to end: a real headless Chromium (Debian's, driven by selenium through
Debian's chromedriver; `make browser` installs both) against a real `treadle serve` of the
embedded SmolLM2-135M-Instruct. Each test keeps screenshots in a temporary folder, named in
its output."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.test_server import MODEL, Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
API_KEY = "console-secret"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("console-screenshots")
    print(f"console screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # These machines have no network beyond loopback: no background traffic, no sandbox (root).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-server"))
    yield srv
    assert srv.request("POST", "/reset_prefix_cache")[0] == 200, srv.log()
    assert srv.stop() == 0, srv.log()


def open_console(driver, server: Server, view: str = "playground") -> WebDriverWait:
    driver.get(f"http://127.0.0.1:{server.port}/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.05)
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == MODEL)
    driver.find_element(By.ID, f"tab-{view}").click()
    return wait


def text_of(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def set_field(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def test_chat_streams_the_same_answer_as_the_api(browser, server, artifacts):
    wait = open_console(browser, server)
    set_field(browser, "max-tokens", "40")
    browser.find_element(By.ID, "prompt").send_keys("Write a haiku about a loom.")
    browser.find_element(By.ID, "send").click()
    # Tokens appear while the answer is still streaming.
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state=streaming]")
               and d.find_element(By.CSS_SELECTOR, ".message.assistant .text").text)
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute(
        "data-state") == "done")
    answer = browser.find_element(By.CSS_SELECTOR, ".message.assistant")
    stats = answer.find_element(By.CLASS_NAME, "answer-stats").text
    assert "TTFT" in stats and "tok/s" in stats, stats
    shown = answer.find_element(By.CLASS_NAME, "text").get_attribute("textContent")
    browser.save_screenshot(str(artifacts / "playground.png"))

    api = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a haiku about a loom."}],
        temperature=0, top_p=1, max_tokens=40)
    assert shown == api.choices[0].message.content

    browser.find_element(By.ID, "show-tokens").click()   # one span per token, coloured
    tokens = answer.find_elements(By.CLASS_NAME, "token")
    assert len(tokens) == api.usage.completion_tokens
    joined = "".join(t.get_attribute("textContent") for t in tokens)
    assert joined in (shown, shown + "<|im_end|>")   # the view shows the stop token too
    assert all(t.get_attribute("title").startswith("logprob ") for t in tokens)
    browser.save_screenshot(str(artifacts / "playground-tokens.png"))
    browser.find_element(By.ID, "show-tokens").click()


def _load(server: Server, n: int, max_tokens: int) -> list[threading.Thread]:
    client = server.client()

    def one(i: int) -> None:
        client.completions.create(model=MODEL, prompt=f"Story number {i}: once upon a time",
                                  max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_follows_a_load_and_returns_to_idle(browser, server, artifacts):
    wait = open_console(browser, server, "dashboard")
    wait.until(lambda d: text_of(d, "num-running") == "0")
    threads = _load(server, 4, 120)
    wait.until(lambda d: int(text_of(d, "num-running")) >= 2)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#kv-grid .cell.running"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
    assert rows and all(r.find_elements(By.CSS_SELECTOR, ".bar") for r in rows)
    owners = {c.get_attribute("data-owner") for c in
              browser.find_elements(By.CSS_SELECTOR, "#kv-grid .cell.running")}
    assert len(owners) >= 2   # a colour per request
    browser.save_screenshot(str(artifacts / "dashboard-busy.png"))
    for t in threads:
        t.join(120)
    wait.until(lambda d: text_of(d, "num-running") == "0"
               and not d.find_elements(By.CSS_SELECTOR, "#kv-grid .cell.running"))
    assert browser.find_elements(By.CSS_SELECTOR, "#kv-grid .cell.cached")   # prefixes kept
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#throughput-chart polyline"))
    browser.save_screenshot(str(artifacts / "dashboard-idle.png"))


def test_pause_keep_stops_generation_and_resume_finishes_exactly(browser, server, artifacts):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The history of weaving", max_tokens=150, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = client.completions.create(**kwargs).choices[0].text
    wait = open_console(browser, server, "dashboard")
    pieces: list[str] = []

    def stream() -> None:
        for chunk in client.completions.create(stream=True, **kwargs):
            pieces.extend(c.text for c in chunk.choices)
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait.until(lambda d: len(pieces) > 5)
    browser.find_element(By.ID, "pause-keep").click()
    wait.until(lambda d: text_of(d, "pause-state") == "paused (keep)")
    frozen = len(pieces)
    time.sleep(1.0)
    assert len(pieces) == frozen and reader.is_alive()   # no token while paused
    browser.save_screenshot(str(artifacts / "dashboard-paused.png"))
    browser.find_element(By.ID, "resume").click()
    wait.until(lambda d: text_of(d, "pause-state") == "running")
    reader.join(120)
    assert not reader.is_alive()
    assert "".join(pieces) == expected


def test_controls_need_the_api_key(browser, smollm2_path, tmp_path_factory, artifacts):
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-key"), "--api-key", API_KEY)
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")   # the page itself needs no key
        browser.execute_script("localStorage.removeItem('treadle-api-key')")
        browser.refresh()
        wait = WebDriverWait(browser, 60, poll_frequency=0.05)
        browser.find_element(By.ID, "tab-dashboard").click()
        wait.until(lambda d: "401" in text_of(d, "dashboard-error"))
        browser.find_element(By.ID, "pause-abort").click()
        wait.until(lambda d: "refused: 401" in text_of(d, "control-message"))
        assert "API key" in text_of(browser, "control-message")
        assert srv.request("GET", "/is_paused", headers={"Authorization": f"Bearer {API_KEY}"}
                           )[1] == {"is_paused": False}
        browser.save_screenshot(str(artifacts / "dashboard-no-key.png"))

        set_field(browser, "api-key", API_KEY)
        browser.find_element(By.ID, "pause-abort").click()   # the change event stores the key
        wait.until(lambda d: text_of(d, "pause-state") == "paused (abort)")
        browser.find_element(By.ID, "resume").click()
        wait.until(lambda d: text_of(d, "pause-state") == "running")
        assert not browser.find_element(By.ID, "dashboard-error").is_displayed()
    finally:
        browser.execute_script("localStorage.removeItem('treadle-api-key')")
        assert srv.stop() == 0, srv.log()


def test_speculation_toggle_changes_drafts_not_text(browser, smollm2_path, tmp_path_factory,
                                                    artifacts):
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-spec"), "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        wait = open_console(browser, srv)
        wait.until(lambda d: d.find_element(By.ID, "spec-toggle").is_displayed())
        set_field(browser, "max-tokens", "30")
        texts = []
        for on in (False, True):
            if browser.find_element(By.ID, "speculation").is_selected() != on:
                browser.find_element(By.ID, "speculation").click()
            drafts = srv.request("GET", "/v1/engine/status")[1]["stats"]["spec_draft_tokens"]
            browser.find_element(By.ID, "clear-chat").click()
            browser.find_element(By.ID, "prompt").send_keys(
                "Repeat exactly: red, green, blue, red, green, blue, red, green, blue")
            browser.find_element(By.ID, "send").click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state=done]"))
            texts.append(browser.find_element(By.CSS_SELECTOR, ".message.assistant .text").text)
            now = srv.request("GET", "/v1/engine/status")[1]["stats"]["spec_draft_tokens"]
            assert (now > drafts) == on, (on, drafts, now)
        browser.save_screenshot(str(artifacts / "playground-speculation.png"))
        assert texts[0] == texts[1]   # drafts change the speed, never the text
    finally:
        assert srv.stop() == 0, srv.log()


def test_no_console_flag(smollm2_path, tmp_path_factory):
    srv = Server(smollm2_path, tmp_path_factory.mktemp("no-console"), "--no-console")
    try:
        assert srv.request("GET", "/")[0] == 404
        status, body = srv.request("GET", "/v1/engine/status")   # the JSON stays
        assert status == 200 and body["running"] == [] and body["pause_mode"] is None
    finally:
        assert srv.stop() == 0, srv.log()


def test_status_groups_a_large_cache_and_colours_holders(tiny_checkpoints):
    """Engine-side: more blocks than MAX_GRID_CELLS are drawn in groups, a group showing its
    most telling block; a running request's blocks carry its index."""
    from treadle import LLM, SamplingParams
    from treadle.engine.status import CACHED, FREE, MAX_GRID_CELLS, engine_status

    llm = LLM(tiny_checkpoints["llama"], num_kv_blocks=3 * MAX_GRID_CELLS + 1, block_size=4)
    core = llm.engine.core
    llm.engine.add_request("r", {"prompt_token_ids": list(range(10, 30))},
                           SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.step()
    status = engine_status(core)
    grid = status["kv_cache"]
    assert grid["blocks_per_cell"] == 3 and len(grid["cells"]) == MAX_GRID_CELLS
    assert [r["id"] for r in status["running"]] == ["r"]
    assert grid["cells"][:2] == [0, 0]   # 20 prompt tokens: blocks 1-5, cells 0-1 held by "r"
    assert set(grid["cells"][2:]) == {FREE}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    cells = engine_status(core)["kv_cache"]["cells"]
    assert cells[0] == CACHED and set(cells[2:]) == {FREE}
