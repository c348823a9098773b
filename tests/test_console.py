"""The web console end to end: a real headless Chromium (Debian's, driven by selenium through
Debian's chromedriver; `make browser` installs both) against a real `treadle serve` of the
embedded SmolLM2-135M-Instruct. Each test keeps screenshots in a temporary folder, named in
its output."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from treadle.engine.status import FREE
from tests.test_server import MODEL, Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
API_KEY = "console-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


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
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})   # for get_log("browser")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-server"))
    yield srv
    assert srv.request("POST", "/reset_prefix_cache")[0] == 200, srv.log()
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def keyed_server(smollm2_path, tmp_path_factory):
    """An API key and n-gram speculation: one server start for the tests of both."""
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-key"), "--api-key", API_KEY,
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    yield srv
    assert srv.stop() == 0, srv.log()


def open_console(driver, server: Server, view: str = "playground") -> WebDriverWait:
    driver.get(f"http://127.0.0.1:{server.port}/")
    wait = WebDriverWait(driver, 60, poll_frequency=0.05)
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == MODEL)
    driver.find_element(By.ID, f"tab-{view}").click()
    return wait


def open_console_with_key(driver, server: Server) -> WebDriverWait:
    driver.get(f"http://127.0.0.1:{server.port}/")
    enter_key(driver, API_KEY)
    wait = WebDriverWait(driver, 60, poll_frequency=0.05)
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == MODEL)
    return wait


def text_of(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def set_field(driver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def enter_key(driver, key: str) -> None:
    set_field(driver, "api-key", key)
    driver.find_element(By.ID, "api-key").send_keys(Keys.TAB)   # leaving the box stores it


def console_errors(driver) -> list[str]:
    """The browser console's errors since the last call (failed loads among them)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def status_requests(server: Server) -> int:
    """GETs of /v1/engine/status so far, from the server's access log."""
    return server.log_path.read_text(errors="replace").count('"GET /v1/engine/status ')


def get(server: Server, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, content type) of a GET, whatever its body."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("content-type", "")
    finally:
        conn.close()


def test_page_loads_with_its_icon_and_no_console_errors(browser, server):
    console_errors(browser)   # drop what earlier pages left
    open_console(browser, server)
    icon = browser.execute_async_script(
        "const done = arguments[0]; const href = document.querySelector('link[rel=icon]').href;"
        "fetch(href).then((r) => done([href, r.status, r.headers.get('content-type')]));")
    assert icon[1:] == [200, "image/svg+xml"], icon
    assert get(server, "/favicon.ico") == (200, "image/svg+xml")   # for pages without the link
    assert console_errors(browser) == []
    # The server has no speculation: its switch stays hidden (a CSS rule once showed it).
    assert not browser.find_element(By.ID, "spec-toggle").is_displayed()


def test_status_is_polled_only_on_the_dashboard(browser, server):
    open_console(browser, server)   # one status request at load, for the model name
    time.sleep(0.3)
    on_playground = status_requests(server)
    time.sleep(1.2)
    assert status_requests(server) == on_playground
    browser.find_element(By.ID, "tab-dashboard").click()
    time.sleep(1.2)
    assert status_requests(server) >= on_playground + 2   # every 500 ms
    browser.find_element(By.ID, "tab-playground").click()
    time.sleep(0.3)   # a request in flight at the switch
    after = status_requests(server)
    time.sleep(1.2)
    assert status_requests(server) == after


def test_a_refused_send_shows_its_error_in_the_answer(browser, server):
    wait = open_console(browser, server)
    set_field(browser, "max-tokens", "100000")   # past max_model_len: a 400
    browser.find_element(By.ID, "prompt").send_keys("Hello")
    browser.find_element(By.ID, "send").click()
    failed = wait.until(lambda d: d.find_element(By.CSS_SELECTOR,
                                                 ".message.assistant[data-state=failed]"))
    assert failed.find_element(By.CLASS_NAME, "error").text.startswith("400: ")
    assert "max_tokens" in failed.text and "no tokens" not in failed.text
    # The failed turn is not sent again: the next answer is that of a one-message chat.
    set_field(browser, "max-tokens", "8")
    browser.find_element(By.ID, "prompt").send_keys("Say hi")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state=done]"))
    shown = browser.find_element(By.CSS_SELECTOR, ".message.assistant[data-state=done] .text"
                                 ).get_attribute("textContent")
    api = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=8)
    assert shown == api.choices[0].message.content


# A chart's bitmap, read back: its size, and the pixels drawn in the y labels' margin, below the
# x axis (the x labels) and in the line's blue inside the plot (margins as console.js' CHART).
CHART_PIXELS = """
const c = document.getElementById(arguments[0]), dpr = window.devicePixelRatio;
const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const ink = { yLabels: 0, xLabels: 0, line: 0 };
for (let y = 0; y < c.height; y++) {
  for (let x = 0; x < c.width; x++) {
    const i = 4 * (y * c.width + x);
    if (!data[i + 3]) continue;
    if (x < 40 * dpr) ink.yLabels++;
    else if (y > c.height - 18 * dpr) ink.xLabels++;
    else if (data[i + 2] > 180 && data[i] < 120) ink.line++;
  }
}
return { size: [c.width, c.height], expected: [Math.round(c.clientWidth * dpr),
         Math.round(c.clientHeight * dpr)], dpr, ...ink };
"""


def chart_pixels(driver, chart_id: str) -> dict:
    return driver.execute_script(CHART_PIXELS, chart_id)


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


def test_a_thinking_models_reasoning_streams_into_its_fold(browser, smollm2_path, tmp_path_factory,
                                                          artifacts):
    """With deepseek_r1's parser the output is reasoning up to a </think> SmolLM2 never writes:
    the console streams it into the reasoning fold, as the API's `reasoning` has it."""
    srv = Server(smollm2_path, tmp_path_factory.mktemp("console-thinking"),
                 "--reasoning-parser", "deepseek_r1")
    try:
        wait = open_console(browser, srv)
        set_field(browser, "max-tokens", "24")
        browser.find_element(By.ID, "prompt").send_keys("Why is the sky blue?")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".message.assistant").get_attribute(
            "data-state") == "done")
        answer = browser.find_element(By.CSS_SELECTOR, ".message.assistant")
        fold = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
        browser.save_screenshot(str(artifacts / "playground-reasoning.png"))
        api = srv.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Why is the sky blue?"}],
            temperature=0, top_p=1, max_tokens=24)
        message = api.choices[0].message
        assert message.content is None and message.reasoning
        assert fold.get_attribute("open") is not None
        assert fold.find_element(By.TAG_NAME, "div").get_attribute("textContent") == message.reasoning
        assert answer.find_element(By.CLASS_NAME, "text").get_attribute("textContent") == ""
        assert "TTFT" in answer.find_element(By.CLASS_NAME, "answer-stats").text
        # The token view shows every token of the reply, the thought's, in place of the fold.
        browser.find_element(By.ID, "show-tokens").click()
        assert not fold.is_displayed()
        tokens = answer.find_elements(By.CLASS_NAME, "token")
        assert "".join(t.get_attribute("textContent") for t in tokens) == message.reasoning
        browser.find_element(By.ID, "show-tokens").click()
        assert fold.is_displayed()
    finally:
        assert srv.stop() == 0, srv.log()


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
    # A screen of 2 device pixels per CSS pixel: a chart sized in CSS pixels would be blurred.
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 0, "height": 0, "deviceScaleFactor": 2, "mobile": False})
    try:
        _follow_a_load(browser, server, artifacts)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def _follow_a_load(browser, server, artifacts):
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
    for chart in ("throughput-chart", "ttft-chart"):
        pixels = wait.until(lambda d: (p := chart_pixels(d, chart))["line"] and p)
        assert pixels["dpr"] == 2 and pixels["size"] == pixels["expected"], pixels
        assert pixels["yLabels"] and pixels["xLabels"], pixels   # the axes have their labels
    browser.save_screenshot(str(artifacts / "dashboard-idle.png"))


def test_a_narrow_window_needs_no_sideways_scrolling(browser, server, artifacts):
    browser.set_window_size(420, 900)
    try:
        for view in ("playground", "dashboard"):
            wait = open_console(browser, server, view)
            wait.until(lambda d: chart_pixels(d, "throughput-chart")["yLabels"]
                       if view == "dashboard" else True)
            fit = browser.execute_script(
                "const root = document.documentElement;"
                "const key = document.getElementById('api-key').getBoundingClientRect();"
                "return { inner: innerWidth, scroll: root.scrollWidth, client: root.clientWidth,"
                "         left: key.left, right: key.right };")
            assert fit["inner"] <= 420 and fit["scroll"] <= fit["client"], (view, fit)
            assert 0 <= fit["left"] and fit["right"] <= fit["client"], (view, fit)   # the key box
            browser.save_screenshot(str(artifacts / f"narrow-{view}.png"))
        pixels = chart_pixels(browser, "throughput-chart")   # redrawn to the narrow size
        assert pixels["size"] == pixels["expected"], pixels
    finally:
        browser.set_window_size(1400, 1000)


def test_pause_keep_with_and_without_clearing_and_resume_finishes_exactly(browser, server,
                                                                          artifacts):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="The history of weaving", max_tokens=60, temperature=0,
                  extra_body={"ignore_eos": True})
    expected = client.completions.create(**kwargs).choices[0].text
    wait = open_console(browser, server, "dashboard")
    for button, clears in (("pause-keep", False), ("pause-keep-clear", True)):
        pieces: list[str] = []

        def stream() -> None:
            for chunk in client.completions.create(stream=True, **kwargs):
                pieces.extend(c.text for c in chunk.choices)
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait.until(lambda d: len(pieces) > 5)
        before = server.request("GET", "/v1/engine/status")[1]["stats"]["num_preemptions"]
        browser.find_element(By.ID, button).click()
        wait.until(lambda d: text_of(d, "pause-state") == "paused (keep)")
        frozen = len(pieces)
        status = server.request("GET", "/v1/engine/status")[1]
        # Kept: the request stays running on its blocks. Cleared: it is preempted, and no block
        # is held or cached.
        assert status["stats"]["num_preemptions"] - before == clears, (button, status)
        assert len(status["running"]) == (not clears), (button, status)
        assert (set(status["kv_cache"]["cells"]) == {FREE}) == clears, (button, status)
        time.sleep(0.5)
        assert len(pieces) == frozen and reader.is_alive()   # no token while paused
        browser.save_screenshot(str(artifacts / f"dashboard-{button}.png"))
        browser.find_element(By.ID, "resume").click()
        wait.until(lambda d: text_of(d, "pause-state") == "running")
        reader.join(120)
        assert not reader.is_alive()
        assert "".join(pieces) == expected


def test_controls_need_the_api_key(browser, keyed_server, artifacts):
    srv = keyed_server
    # /metrics stays open to scrapers, as in vLLM; everything else needs the key.
    assert get(srv, "/metrics")[0] == 200
    for path in ("/v1/models", "/v1/engine/status", "/is_paused"):
        assert get(srv, path)[0] == 401, path
    asked = status_requests(srv)
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")   # the page itself needs no key
        browser.execute_script("localStorage.removeItem('treadle-api-key')")
        console_errors(browser)
        browser.refresh()
        wait = WebDriverWait(browser, 60, poll_frequency=0.05)
        wait.until(lambda d: d.find_element(By.ID, "key-needed").is_displayed())
        browser.find_element(By.ID, "tab-dashboard").click()
        wait.until(lambda d: "needs API key" in text_of(d, "dashboard-error"))
        time.sleep(1.0)
        # Without a key nothing is asked: no 401s in the browser's console.
        assert status_requests(srv) == asked and console_errors(browser) == []
        browser.find_element(By.ID, "pause-abort").click()
        wait.until(lambda d: "refused: 401" in text_of(d, "control-message"))
        assert "API key" in text_of(browser, "control-message")
        assert srv.request("GET", "/is_paused", headers=AUTH)[1] == {"is_paused": False}
        browser.save_screenshot(str(artifacts / "dashboard-no-key.png"))

        enter_key(browser, "wrong")   # one 401, then the polling stops until a key is entered
        wait.until(lambda d: "401" in text_of(d, "dashboard-error"))
        assert browser.find_element(By.ID, "key-needed").is_displayed()
        time.sleep(1.2)
        assert status_requests(srv) == asked + 1

        enter_key(browser, API_KEY)
        browser.find_element(By.ID, "pause-abort").click()
        wait.until(lambda d: text_of(d, "pause-state") == "paused (abort)")
        browser.find_element(By.ID, "resume").click()
        wait.until(lambda d: text_of(d, "pause-state") == "running")
        assert not browser.find_element(By.ID, "dashboard-error").is_displayed()
        assert not browser.find_element(By.ID, "key-needed").is_displayed()
    finally:
        browser.execute_script("localStorage.removeItem('treadle-api-key')")


def spec_draft_tokens(server: Server) -> int:
    return server.request("GET", "/v1/engine/status", headers=AUTH)[1]["stats"]["spec_draft_tokens"]


def test_speculation_toggle_changes_drafts_not_text(browser, keyed_server, artifacts):
    srv = keyed_server
    wait = open_console_with_key(browser, srv)
    try:
        wait.until(lambda d: d.find_element(By.ID, "spec-toggle").is_displayed())
        set_field(browser, "max-tokens", "30")
        texts = []
        for on in (False, True):
            if browser.find_element(By.ID, "speculation").is_selected() != on:
                browser.find_element(By.ID, "speculation").click()
            drafts = spec_draft_tokens(srv)
            browser.find_element(By.ID, "clear-chat").click()
            browser.find_element(By.ID, "prompt").send_keys(
                "Repeat exactly: red, green, blue, red, green, blue, red, green, blue")
            browser.find_element(By.ID, "send").click()
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-state=done]"))
            texts.append(browser.find_element(By.CSS_SELECTOR, ".message.assistant .text").text)
            now = spec_draft_tokens(srv)
            assert (now > drafts) == on, (on, drafts, now)
        browser.save_screenshot(str(artifacts / "playground-speculation.png"))
        assert texts[0] == texts[1]   # drafts change the speed, never the text
    finally:
        browser.execute_script("localStorage.removeItem('treadle-api-key')")


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


@pytest.mark.parametrize("metrics_require_api_key", [False, True])
def test_metrics_require_api_key(metrics_require_api_key):
    """The key middleware on a stand-in app: /metrics is open unless the flag says otherwise."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from treadle.entrypoints.openai.server import APIKeyMiddleware

    app = FastAPI()
    for path in ("/metrics", "/health", "/version"):
        app.add_api_route(path, lambda: {})
    app.add_middleware(APIKeyMiddleware, api_key=API_KEY,
                       metrics_require_api_key=metrics_require_api_key)
    client = TestClient(app)
    assert client.get("/metrics").status_code == (401 if metrics_require_api_key else 200)
    assert client.get("/metrics", headers=AUTH).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/version").status_code == 401
