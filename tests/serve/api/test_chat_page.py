"""The browser pages of the server: the chat page (``/``) driven in Debian's headless Chromium through Selenium
against a real server on loopback, and the pages' HTTP rules (local assets only, 404s, docs behind the key)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

import serving
from k3 import K3ForCausalLM
from k3.config import preset
from k3.serve.api.app import BackgroundServer, Limits, create_app
from k3.serve.engine import Engine
from k3.chat import chat_format

MODEL = "k3-tiny"
KEY = "page-key"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

# Installed in the page after it loads: records the body of every request the page sends (window.sent) and the
# text length of the newest assistant turn at every change of the conversation (window.lengths).
RECORDER = """
window.sent = [];
const original = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.sent.push(JSON.parse(init.body));
  return original(url, init);
};
window.lengths = [];
new MutationObserver(() => {
  const turn = [...document.querySelectorAll("#conversation .turn.assistant")].pop();
  if (turn) window.lengths.push(turn.textContent.length);
}).observe(document.getElementById("conversation"), {childList: true, subtree: true, characterData: true});
"""


class Endless(K3ForCausalLM):
    """The tiny K3 of `serving.model` with its end-of-message ids masked: every reply runs to its token limit,
    so a reply without one lasts long enough to press Stop (or to outlast a request timeout)."""

    def forward_groups(self, groups, full=None, replay=None):
        results = super().forward_groups(groups, full, replay)
        ends = list(chat_format(serving.tokenizer()).stop_ids(serving.tokenizer()))
        for logits, _ in results:
            logits[..., ends] = -1e4  # finite: the engine refuses non-finite logits
        return results


@pytest.fixture(scope="module")
def engine():
    model = Endless(preset("tiny"))
    model.load_state_dict(serving.model().state_dict())
    engine = Engine(model.eval(), serving.tokenizer(), prefill_chunk=32, max_model_len=2048).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine, MODEL, api_key=KEY)) as server:
        yield server


def fetch(url: str, path: str, key: str | None = None) -> tuple[int, dict[str, str], str]:
    """(status, headers with lower-case names, body text) of one GET."""
    parts = urlparse(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", path, headers={"authorization": f"Bearer {key}"} if key else {})
    response = conn.getresponse()
    body = response.read().decode(errors="replace")
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def get(url: str, path: str, key: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body text) of one GET."""
    status, headers, body = fetch(url, path, key)
    return status, headers.get("content-type", ""), body


def health(url: str) -> dict:
    return json.loads(get(url, "/health")[2])


# ---------------------------------------------------------------------------------------------- HTTP
def test_pages_are_local_and_the_docs_follow_the_key(engine, server):
    status, kind, page = get(server.url, "/")  # open without the key: a browser navigation sends none
    assert status == 200 and kind.startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert {"/static/chat.js", "/static/chat.css"} <= set(assets)
    assert all(a.startswith(("/", "data:")) for a in assets), assets
    for name, media in (("chat.js", "text/javascript"), ("chat.css", "text/css"), ("chat.html", "text/html")):
        status, kind, body = get(server.url, f"/static/{name}")
        assert status == 200 and kind.startswith(media) and "https://cdn" not in body
    for path in ("/static/../api.py", "/static/..%2Fapi.py", "/static/api.py", "/static/nope.js", "/static/",
                 "/docs/index.html", "/docs/../pages.py"):
        status, kind, body = get(server.url, path, KEY)
        assert status == 404 and kind == "application/json" and json.loads(body)["error"]["message"], path

    docs_assets = ("/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/favicon.png")
    for path in ("/docs", "/openapi.json", *docs_assets):
        assert get(server.url, path)[0] == 401, path
    status, _, docs = get(server.url, "/docs", KEY)
    assert status == 200 and "https://" not in docs
    assert set(re.findall(r'(?:src|href)="([^"]*)"', docs)) == set(docs_assets)
    assert all(get(server.url, path, KEY)[0] == 200 for path in docs_assets)
    assert {"/", "/docs", "/static/{name}"}.isdisjoint(json.loads(get(server.url, "/openapi.json", KEY)[2])["paths"])

    with BackgroundServer(create_app(engine, MODEL, api_key=KEY, limits=Limits(public_docs=True))) as public:
        for path in ("/docs", "/openapi.json", *docs_assets):
            assert get(public.url, path)[0] == 200, path
        assert get(public.url, "/v1/models")[0] == 401


def policy(headers: dict[str, str]) -> dict[str, set[str]]:
    """A Content-Security-Policy header as {directive: sources}."""
    parts = [d.split() for d in headers["content-security-policy"].split(";") if d.strip()]
    return {d[0]: set(d[1:]) for d in parts}


def test_pages_forbid_framing_inline_code_and_other_origins(server):
    """Both pages send a Content-Security-Policy and X-Frame-Options: DENY; neither allows inline styles, the chat
    page no inline script at all (it has none), the docs page only Swagger UI's one inline script, by its hash."""
    for path in ("/", "/static/chat.html", "/docs"):
        status, headers, page = fetch(server.url, path, KEY)
        rules = policy(headers)
        assert status == 200 and headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        assert rules["default-src"] == rules["frame-ancestors"] == rules["base-uri"] == {"'none'"}
        assert rules["connect-src"] == rules["style-src"] == {"'self'"}
        inline = re.findall(r"<script>(.*?)</script>", page, re.DOTALL)
        digests = {f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in inline}
        assert rules["script-src"] == {"'self'"} | digests, path
    page = get(server.url, "/")[2]
    assert not re.search(r"<script(?![^>]*\bsrc=)|\bstyle=|\bon[a-z]+=", page)  # nothing inline to allow
    for path in ("/static/chat.js", "/static/chat.css"):
        assert fetch(server.url, path)[1]["x-content-type-options"] == "nosniff"


# ---------------------------------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.chrome.service import Service

    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"no headless Chromium: {', '.join(missing)} missing (Debian's chromium and chromium-driver; "
                    f"`make test` installs them when run as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(argument)
    # every network request (for the origin check) and console message (for Content-Security-Policy violations)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait_for(predicate, seconds: float = 15, what: str = "the page") -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def page_state(driver) -> str:
    return driver.find_element("id", "status").get_attribute("data-state")


def fill(driver, element_id: str, text: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    if text:
        field.send_keys(text)


def send(driver, text: str) -> None:
    """Type and send a message; fails with the page's error if the request is refused at once."""
    asked = len(driver.find_elements("css selector", "#conversation .turn.user"))
    error = driver.find_element("id", "error")
    fill(driver, "prompt", text)
    driver.find_element("id", "send").click()
    wait_for(lambda: len(driver.find_elements("css selector", "#conversation .turn.user")) > asked
             or error.is_displayed(), what="the message to be sent")
    assert not error.is_displayed(), error.text


def answers(driver) -> list:
    return driver.find_elements("css selector", "#conversation .turn.assistant")


def finished(driver, count: int) -> bool:
    return page_state(driver) == "ready" and len(answers(driver)) == count


def text_of(element, selector: str) -> str:
    found = element.find_elements("css selector", selector)
    return found[0].get_attribute("textContent") if found else ""


def policy_violations(driver) -> list[str]:
    """Console messages of the pages loaded since the last call that report a Content-Security-Policy violation."""
    return [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]


def requested_urls(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def test_chat_page_streams_keeps_the_conversation_and_stops(browser, server, engine, tmp_path):
    driver = browser
    driver.get(server.url + "/")
    wait_for(lambda: page_state(driver) == "error", what="the model list to fail without a key")
    error = driver.find_element("id", "error")
    assert error.is_displayed() and "invalid or missing API key" in error.text  # the OpenAI error body's message
    assert not driver.find_element("id", "send").is_enabled()
    driver.find_element("id", "api-key").send_keys(KEY + "\t")  # "change" lists the models again, with the key
    wait_for(lambda: page_state(driver) == "ready", what="the model list")
    assert driver.find_element("id", "model").text == MODEL and not error.is_displayed()
    driver.refresh()  # the key is kept for this tab in sessionStorage, never in localStorage (which outlives it)
    wait_for(lambda: page_state(driver) == "ready", what="the page to load again")
    assert driver.find_element("id", "api-key").get_attribute("value") == KEY
    assert driver.execute_script("return [sessionStorage.getItem('k3-api-key'), localStorage.length]") == [KEY, 0]
    driver.execute_script("localStorage.setItem('k3-api-key', 'left by an older page')")
    driver.refresh()  # a key an older page left in localStorage is removed
    wait_for(lambda: page_state(driver) == "ready", what="the page to load a third time")
    assert driver.execute_script("return localStorage.length") == 0
    driver.execute_script(RECORDER)

    # thinking mode (the default): the reply streams into the collapsible reasoning block
    fill(driver, "temperature", "0")
    fill(driver, "max-tokens", "160")
    send(driver, "def load(path):")
    wait_for(lambda: finished(driver, 1), what="the first reply")
    (first,) = answers(driver)
    reasoning = text_of(first, "details.reasoning .reasoning-text")
    assert reasoning and first.find_element("css selector", "details.reasoning summary").text == "Reasoning"
    lengths = driver.execute_script("return window.lengths")
    growing = [n for n in lengths if n > 0]
    assert len(set(growing)) >= 4 and growing == sorted(growing), lengths  # arrived in many pieces, in order
    request = driver.execute_script("return window.sent")[-1]
    assert request == {"model": MODEL, "messages": [{"role": "user", "content": "def load(path):"}], "stream": True,
                       "mode": "thinking", "temperature": 0, "max_tokens": 160}

    # instruct mode: no reasoning block; the request carries the history with the first reply's reasoning
    driver.find_element("id", "mode-instruct").click()
    fill(driver, "max-tokens", "40")
    send(driver, "and then?")
    wait_for(lambda: finished(driver, 2), what="the second reply")
    second = answers(driver)[1]
    assert not second.find_elements("css selector", "details.reasoning") and text_of(second, ".content")
    request = driver.execute_script("return window.sent")[-1]
    assert request["mode"] == "instruct" and [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert request["messages"][1] == {"role": "assistant", "content": text_of(first, ".content"),
                                      "reasoning_content": reasoning}

    # Stop: a long generation (the rest of the context) is aborted in the page and cancelled by the server
    aborts = health(server.url)["finished"].get("abort", 0)
    fill(driver, "max-tokens", "")
    send(driver, "write a long story")
    wait_for(lambda: len(answers(driver)) == 3 and len(text_of(answers(driver)[2], ".content")) > 20,
             what="the long reply to stream")
    assert page_state(driver) == "busy"
    driver.find_element("id", "stop").click()
    wait_for(lambda: finished(driver, 3), seconds=5, what="the page to be ready after Stop")
    wait_for(lambda: health(server.url)["finished"].get("abort", 0) == aborts + 1, seconds=5,
             what="the server to cancel the request")
    wait_for(lambda: not engine.running and not engine.num_waiting, seconds=5, what="the engine to be idle")
    stopped = answers(driver)[2]
    assert text_of(stopped, ".meta") == "stopped" and not driver.find_element("id", "error").is_displayed()
    partial = text_of(stopped, ".content")

    # the conversation goes on after Stop, the stopped reply kept as it was shown
    fill(driver, "max-tokens", "8")
    send(driver, "thanks")
    wait_for(lambda: finished(driver, 4), what="the reply after Stop")
    messages = driver.execute_script("return window.sent")[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"]
    assert messages[5]["content"] == partial and messages[6] == {"role": "user", "content": "thanks"}

    screenshot = tmp_path / "chat.png"
    assert driver.save_screenshot(str(screenshot))
    assert screenshot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and screenshot.stat().st_size > 5000

    # New chat: an empty conversation, and the next request carries only its own message
    driver.find_element("id", "new-chat").click()
    assert answers(driver) == []
    send(driver, "hello")
    wait_for(lambda: finished(driver, 1), what="the reply in a new chat")
    assert driver.execute_script("return window.sent")[-1]["messages"] == [{"role": "user", "content": "hello"}]

    origin = server.url + "/"
    urls = requested_urls(driver)
    assert origin in urls and origin + "v1/chat/completions" in urls
    assert all(url.startswith((origin, "data:")) for url in urls), urls  # nothing left the loopback origin
    assert policy_violations(driver) == []  # the page works within its Content-Security-Policy


def test_chat_page_shows_an_error_event_from_the_stream(browser, engine):
    """A generation past the server's request timeout ends the stream with ``event: error``: the page shows its
    message and keeps what had arrived."""
    with BackgroundServer(create_app(engine, MODEL, limits=Limits(request_timeout=0.5))) as server:
        browser.get(server.url + "/")
        wait_for(lambda: page_state(browser) == "ready", what="the page")
        browser.find_element("id", "mode-instruct").click()
        send(browser, "tell me everything")
        wait_for(lambda: finished(browser, 1) or (page_state(browser) == "ready" and browser.find_element(
            "id", "error").is_displayed()), what="the request timeout")
        error = browser.find_element("id", "error")
        assert error.is_displayed() and "request timeout" in error.text
        (reply,) = answers(browser)
        assert text_of(reply, ".content") and text_of(reply, ".meta") == "failed"
    wait_for(lambda: not engine.running and not engine.num_waiting, seconds=5, what="the engine to be idle")


def test_docs_render_the_api_from_local_assets(browser, engine):
    """Swagger UI (served from the package's files) renders the OpenAPI 3.1 document, with nothing from outside."""
    with BackgroundServer(create_app(engine, MODEL)) as server:
        browser.get_log("performance")  # drop what earlier pages requested
        policy_violations(browser)
        browser.get(server.url + "/docs")
        wait_for(lambda: browser.find_elements("css selector", ".opblock-summary-path"), what="Swagger UI")
        paths = {e.get_attribute("data-path") for e in browser.find_elements("css selector", ".opblock-summary-path")}
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= paths
        urls = requested_urls(browser)
        assert server.url + "/openapi.json" in urls
        assert all(url.startswith((server.url + "/", "data:")) for url in urls), urls
        assert policy_violations(browser) == []  # Swagger UI works within its Content-Security-Policy
