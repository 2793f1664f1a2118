"""The web playground (m20) in a real browser: Playwright for Python drives Debian's Chromium
against a live server started with an API key.

It opens `/`, sends a prompt and sees the streamed reply grow and the per-reply stats line
appear; presses Stop mid-stream and sees `/stats` report 0 running requests; sees a wrong
key answered with a readable 401 message; feeds the renderer a canned SSE reply holding
`<script>` and `<img onerror>` (via `page.route`) and checks nothing ran and the text is
shown; watches the live panel's numbers move while a thread sends load; and takes the
desktop and phone screenshots (written to $PLAYGROUND_SCREENSHOTS when set, e.g.
docs/assets).

Run by `make test-integration`, which installs the `playwright` package and Debian's
`chromium` first (`scripts/setup-integration`; never `playwright install`); without them the
tests skip, saying why, or fail in CI.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from apt_binary import apt_binary, python_module
from live_server import LiveServer

pytestmark = [pytest.mark.integration, pytest.mark.milestone("m20")]

KEY = "playground-key"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def server():
    live = LiveServer.start("--num-kv-blocks", "256", api_key=KEY)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def browser():
    executable = apt_binary("chromium")
    python_module("playwright")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, server):
    """open_page(viewport=DESKTOP) -> a page on `/`; fails the test on a CSP violation or a
    script error."""
    contexts, problems = [], []

    def open_page(viewport=DESKTOP):
        context = browser.new_context(viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
        page.on(
            "console",
            lambda msg: problems.append(msg.text) if "Content Security Policy" in msg.text else 0,
        )
        page.goto(f"{server.url}/")
        return page

    yield open_page
    for context in contexts:
        context.close()
    assert not problems, problems


def enter_key(page, key: str = KEY) -> None:
    page.fill("#api-key", key)
    page.press("#api-key", "Tab")  # 'change': the page reloads the model list and stats
    if key == KEY:
        # Polled from Python: Playwright's wait_for_function evaluates its string with eval()
        # in the page, which the playground's strict CSP (no 'unsafe-eval') refuses.
        wait_until(lambda: page.locator("#model option").count() > 0, 60, "the model list")


def send(page, prompt: str, max_tokens: int = 32) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")


def last_reply(page) -> str:
    return page.evaluate(
        "() => { const m = [...document.querySelectorAll('.message.assistant')].pop();"
        " return m ? m.querySelector('.message-body').textContent : ''; }"
    )


def reply_stats(page) -> str:
    return page.evaluate(
        "() => { const m = [...document.querySelectorAll('.message.assistant')].pop();"
        " return m ? m.querySelector('.reply-stats').textContent : ''; }"
    )


def wait_until(condition, timeout: float = 240.0, what: str = "condition"):
    """The condition's value once it is true. The deadline only bounds a hang: Chromium, the
    server and the load share a few CPUs, so a reply can take minutes on a busy machine."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.1)
    return value


def ignore_eos(route) -> None:
    """Forwards the page's chat request with ignore_eos, so the reply runs to max_tokens."""
    body = json.loads(route.request.post_data)
    body["ignore_eos"] = True
    route.continue_(post_data=json.dumps(body))


def test_page_loads_without_the_key_and_lists_the_model(open_page, server):
    page = open_page()
    assert page.title() == "nanollmserve playground"
    assert page.locator("#live-status").inner_text() in ("(needs API key)", "")
    enter_key(page)
    assert page.locator("#model option").first.inner_text() == "SmolLM2-135M-Instruct"
    wait_until(lambda: page.locator("#stat-running").inner_text() != "-", 60, "live stats")


def test_chat_streams_and_shows_reply_stats(open_page, server):
    page = open_page()
    enter_key(page)
    page.fill("#temperature", "0")
    page.route("**/v1/chat/completions", ignore_eos)
    send(page, "Write a short poem about the sea.", max_tokens=48)
    lengths = set()
    while not reply_stats(page):
        lengths.add(len(last_reply(page)))
        time.sleep(0.02)
    lengths.discard(0)
    assert len(lengths) >= 3, f"the reply did not grow while streaming: {sorted(lengths)}"
    stats = reply_stats(page)
    assert "TTFT" in stats and "tok/s" in stats, stats
    assert "prompt " in stats and "(cached " in stats and "completion 48" in stats, stats
    assert page.locator(".message.user").count() == 1
    assert not page.locator("#error").is_visible()


def test_stop_aborts_the_request_on_the_server(open_page, server):
    page = open_page()
    enter_key(page)
    aborted_before = server.stats()["num_requests_aborted"]
    page.route("**/v1/chat/completions", ignore_eos)
    send(page, "Tell me a very long story.", max_tokens=4000)
    wait_until(lambda: len(last_reply(page)) > 10, what="streamed text")
    assert server.stats()["num_requests_running"] == 1
    page.click("#stop-button")
    stats = wait_until(
        lambda: (s := server.stats())["num_requests_running"] == 0 and s, 60, "0 running"
    )
    assert stats["num_requests_aborted"] == aborted_before + 1
    wait_until(lambda: "stopped" in reply_stats(page), 60, "'stopped' in the stats line")
    assert page.locator("#send").is_enabled() and page.locator("#stop-button").is_disabled()


def test_a_wrong_key_shows_a_readable_401(open_page, server):
    page = open_page()
    enter_key(page, "wrong-key")
    send(page, "Hello?")
    error = page.locator("#error")
    error.wait_for(state="visible", timeout=60_000)
    text = error.inner_text()
    assert "401" in text and "API key" in text, text
    assert page.locator(".message").count() == 0  # the turn was taken back ...
    assert page.input_value("#prompt") == "Hello?"  # ... into the composer, to resend


def canned_stream(content: str) -> str:
    chunk = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        *(
            {**chunk, "choices": [{"index": 0, "delta": {"content": piece}}]}
            for piece in content.split("|")
        ),
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {
            **chunk,
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 30,
                "total_tokens": 39,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_model_output_is_shown_as_text_never_run(open_page, server):
    page = open_page()
    enter_key(page)
    reply = (
        'Here: <script>window.pwned=1</script>|<img src=x onerror="window.pwned=2">|\n\n'
        "```html\n<script>window.pwned=3</script>\n```\n\n**bold** and `<b>code</b>`\n"
        "- one\n- <iframe src=javascript:window.pwned=4>"
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=canned_stream(reply)
        ),
    )
    send(page, "Say something dangerous")
    wait_until(lambda: reply_stats(page), 60, "the stats line")
    time.sleep(0.5)  # give an injected onerror handler the time it would need
    assert page.evaluate("window.pwned") is None
    messages = page.locator("#messages")
    assert messages.locator("script, img, iframe").count() == 0
    text = messages.inner_text()
    assert "<script>window.pwned=1</script>" in text
    assert '<img src=x onerror="window.pwned=2">' in text
    assert "<iframe src=javascript:window.pwned=4>" in text
    assert messages.locator("pre code").inner_text() == "<script>window.pwned=3</script>"
    assert messages.locator("strong").inner_text() == "bold"
    assert messages.locator("p code").inner_text() == "<b>code</b>"
    assert messages.locator("li").count() == 2


def test_completions_tab_shows_logprobs_per_token(open_page, server):
    page = open_page()
    enter_key(page)
    page.click("#tab-completions")
    assert page.locator("#pane-chat").is_hidden() and page.locator("#system").is_hidden()
    page.fill("#max_tokens", "6")
    page.fill("#temperature", "0")
    page.fill("#raw-prompt", "The capital of France is")
    page.click("#complete")
    stats = wait_until(lambda: page.locator("#completion-stats").inner_text(), what="stats")
    assert "completion 6" in stats, stats
    assert not page.locator("#completion-error").is_visible()
    tokens = page.locator("#completion-output .token")
    assert tokens.count() == 6
    title = tokens.first.get_attribute("title")
    assert title.startswith(("logprob -", "logprob 0")), title
    assert "\ntop: " in title, title
    assert (
        page.locator("#completion-output .prompt-text").inner_text() == "The capital of France is"
    )


def test_live_panel_moves_under_load(open_page, server):
    page = open_page()
    enter_key(page)
    wait_until(lambda: page.locator("#stat-gen-total").inner_text() != "-", 60, "live stats")
    generated_before = int(page.locator("#stat-gen-total").inner_text())
    # Three streams that run until the panel has shown them (then they disconnect, which
    # aborts them): on the fast default path, short requests ended between two polls of the
    # panel, so the load lasts as long as the test needs it, whatever the machine's speed.
    body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    enough = threading.Event()

    def stream():
        with (
            server.client(timeout=280) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for _ in response.iter_lines():
                if enough.is_set():
                    return

    streams = [threading.Thread(target=stream) for _ in range(3)]
    for thread in streams:
        thread.start()
    seen_running, seen_tps = set(), set()

    def panel_moved() -> bool:
        seen_running.add(page.locator("#stat-running").inner_text())
        seen_tps.add(page.locator("#stat-tps").inner_text())
        running = [int(v) for v in seen_running if v != "-"]
        return max(running, default=0) >= 2 and any(v not in ("-", "0.0") for v in seen_tps)

    try:
        wait_until(panel_moved, 60, "the live panel to show 2 running and a token rate")
    finally:
        enough.set()
        for thread in streams:
            thread.join(60)
    # The panel polls on its own clock: wait for the poll that saw the load end.
    wait_until(
        lambda: (
            int(page.locator("#stat-gen-total").inner_text()) > generated_before
            and page.locator("#stat-running").inner_text() == "0"
        ),
        60,
        "the live panel to show the generated tokens and 0 running",
    )
    assert max(int(v) for v in seen_running if v != "-") >= 2, seen_running
    assert any(v not in ("-", "0.0") for v in seen_tps), seen_tps


@pytest.mark.timeout(600)  # two 80-token replies rendered by Chromium
def test_screenshots_desktop_and_phone(open_page, server, tmp_path):
    out = Path(os.environ.get("PLAYGROUND_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    for name, viewport in (("playground-desktop.png", DESKTOP), ("playground-phone.png", PHONE)):
        page = open_page(viewport)
        enter_key(page)
        page.fill("#system", "You are a concise assistant.")
        page.fill("#temperature", "0")
        send(page, "What is a KV cache in an LLM server? Answer briefly.", max_tokens=80)
        wait_until(lambda page=page: reply_stats(page), what="the reply")
        time.sleep(1.2)  # let the live panel poll once more
        page.screenshot(path=str(out / name), full_page=viewport is PHONE)
        assert (out / name).stat().st_size > 10_000
