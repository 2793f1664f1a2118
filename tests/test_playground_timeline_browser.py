"""The playground's Timeline tab (m24) in a real browser: Playwright drives Debian's Chromium
(as tests/test_playground_browser.py does) against a live server started with
`--enable-debug-endpoints` and a KV pool of 12 blocks, so that concurrent requests preempt.

What is drawn is read from `window.timelineModel`, the page's summary of its canvas: six
concurrent requests show a preemption (and hovering its cell shows that step's record, the
screenshot of docs/features/flight-recorder.md, written to $PLAYGROUND_SCREENSHOTS when set);
a repeated prompt shows a prefix hit; a gRPC request gets its row, speculative drafts and
grammar masks are counted (a second server, with ngram speculation); while 32 requests stream
(a third server, with the default KV pool), a requestAnimationFrame loop never waits long for a
frame and the timeline keeps redrawing.
Without the flag the tab says how to turn it on; with a wrong key it asks for the key; behind
a router with several workers it says to open a worker's page instead.

Run by `make test-integration`; without Chromium or Playwright the tests skip, saying why.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from apt_binary import apt_binary, python_module
from live_server import API_KEY, LiveServer, free_port, shared_server
from test_playground_browser import CHROMIUM_ARGS, DESKTOP, wait_until

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.integration, pytest.mark.milestone("m24")]

KEY = "timeline-key"
ADMIN_KEY = "timeline-admin-key"
"""/debug/steps is an admin route (m27): the tab's admin key field holds this."""
MODEL = "SmolLM2-135M-Instruct"
NUM_KV_BLOCKS = 12  # 192 tokens: six requests of ~45 + 48 tokens cannot all fit at once
REPEATED = "one two three four five six seven eight nine ten " * 4
MAX_FRAME_GAP_MS = 500  # generous: a frame is due every ~17 ms
MIN_FRAMES = 30  # half a second of frames at 60 Hz
LONG_STREAM_TOKENS = 1024  # longer than the measurement on any machine; hung up after it
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--enable-debug-endpoints",
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--grpc-port",
        str(grpc_port),
        api_key=KEY,
        admin_api_key=ADMIN_KEY,
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


@pytest.fixture(scope="module")
def spec_server():
    """Speculative decoding (ngram) on; structured output is always available."""
    live = LiveServer.start(
        "--enable-debug-endpoints", "--speculative-config", json.dumps(SPEC), api_key=KEY,
        admin_api_key=ADMIN_KEY,
    )  # fmt: skip
    yield live
    live.stop()


@pytest.fixture(scope="module")
def roomy_server():
    """The default KV pool: 32 requests decode in one batch."""
    live = LiveServer.start("--enable-debug-endpoints", api_key=KEY, admin_api_key=ADMIN_KEY)
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
    """open_page(url, key) -> a page on `url` with `key` entered; fails the test on a CSP
    violation or a script error."""
    contexts, problems = [], []

    def open_page(url: str = server.url, key: str = KEY, admin_key: str = ADMIN_KEY):
        context = browser.new_context(viewport=DESKTOP)
        contexts.append(context)
        page = context.new_page()
        page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
        page.on(
            "console",
            lambda msg: problems.append(msg.text) if "Content Security Policy" in msg.text else 0,
        )
        page.goto(f"{url}/")
        page.fill("#api-key", key)
        page.press("#api-key", "Tab")
        # The Timeline tab's key for /debug/steps: its field shows on that tab, as for a user.
        page.click("#tab-timeline")
        page.fill("#admin-key", admin_key)
        page.click("#tab-chat")
        return page

    yield open_page
    for context in contexts:
        context.close()
    assert not problems, problems


def model(page) -> dict:
    return page.evaluate("() => window.timelineModel")


def show_timeline(page, status: str = "live") -> dict:
    page.click("#tab-timeline")
    assert page.locator("#pane-timeline").is_visible() and page.locator("#pane-chat").is_hidden()
    return wait_until(lambda: (m := model(page))["status"] == status and m, 60, status)


def complete(server, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    with server.client(timeout=280) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def response_id(request_id: str) -> str:
    """The API response's id of an engine request id (`cmpl-X`, or `cmpl-X-0` for a choice)."""
    return re.sub(r"-\d+$", "", request_id)


def num_steps(server) -> int:
    """Steps the engine has run (the record's engine line)."""
    with server.admin_client() as client:
        response = client.get("/debug/steps", params={"since": 2**63 - 1})
    return response.json()["num_steps"]


def test_the_timeline_shows_a_preemption_and_its_record_on_hover(open_page, server, tmp_path):
    page = open_page()
    show_timeline(page)
    # Distinct first tokens: no shared prefix blocks, so the six really need 6 x 6 blocks.
    prompts = [f"Story {i}: {REPEATED}" for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda prompt: complete(server, prompt, 48), prompts))
    reply_ids = {reply["id"] for reply in replies}
    last_step = num_steps(server) - 1
    shown = wait_until(
        lambda: (m := model(page))["lastStep"] >= last_step and m, 60, "the last step drawn"
    )
    preemptions = [p for p in shown["preemptions"] if response_id(p["request_id"]) in reply_ids]
    assert preemptions and {p["reason"] for p in preemptions} == {"kv_cache_full"}, shown
    assert shown["cells"]["preempted"] >= len(preemptions)
    assert reply_ids <= {response_id(row) for row in shown["rows"]}
    assert shown["numKvBlocks"] == NUM_KV_BLOCKS and shown["maxKvUsed"] > NUM_KV_BLOCKS // 2
    assert shown["draws"] > 0

    preemption = preemptions[0]
    center = page.evaluate(
        "([step, id]) => timelineCellCenter(step, id)",
        [preemption["step"], preemption["request_id"]],
    )
    box = page.locator("#timeline-canvas").bounding_box()
    page.mouse.move(box["x"] + center["x"], box["y"] + center["y"])
    detail = page.locator("#timeline-detail")
    head = f"step {preemption['step']} · {preemption['request_id']}: preempted"
    wait_until(lambda: detail.inner_text().startswith(head), 30, "the hovered step's record")
    text = detail.inner_text()
    assert '"preemptions"' in text and '"kv_cache_full"' in text and '"duration_ms"' in text

    out = Path(os.environ.get("PLAYGROUND_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / "timeline-preemption.png"))
    assert (out / "timeline-preemption.png").stat().st_size > 10_000


def test_the_timeline_shows_a_prefix_hit_when_a_prompt_repeats(open_page, server):
    page = open_page()
    show_timeline(page)
    prompt = f"A repeated prompt: {REPEATED}"
    first = complete(server, prompt, 2)["id"]
    second = complete(server, prompt, 2)["id"]
    hits = wait_until(
        lambda: [h for h in model(page)["prefixHits"] if response_id(h["request_id"]) == second],
        60,
        "a prefix hit of the repeated prompt",
    )
    assert hits[0]["blocks"] >= 1
    shown = model(page)
    assert not [h for h in shown["prefixHits"] if response_id(h["request_id"]) == first]
    assert {first, second} <= {response_id(row) for row in shown["rows"]}


def test_grpc_requests_show_as_rows(open_page, server):
    page = open_page()
    show_timeline(page)

    async def generate():
        async with await connect(server.grpc_target, api_key=KEY) as client:
            return await client.generate("Once upon a time", max_tokens=4, temperature=0)

    # In a thread: Playwright's sync API keeps an event loop running in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, generate()).result(timeout=120)
    rows = wait_until(
        lambda: [row for row in model(page)["rows"] if row.startswith("grpc-")],
        60,
        "a row for the gRPC request",
    )
    assert len(rows) == 1, rows


def test_speculative_drafts_and_grammar_masks_are_shown(open_page, spec_server):
    page = open_page(spec_server.url)
    show_timeline(page)
    complete(spec_server, REPEATED, 24)  # repeats itself: the ngram proposer drafts
    with spec_server.client() as client:
        body = {"model": MODEL, "prompt": "Is the sky blue?", "max_tokens": 4}
        body["structured_outputs"] = {"choice": ["yes", "no"]}
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    shown = wait_until(
        lambda: (m := model(page))["grammarMasks"] > 0 and m, 60, "a grammar-masked step"
    )
    assert shown["drafts"]["proposed"] > 0 and shown["drafts"]["accepted"] > 0, shown["drafts"]
    assert shown["cells"]["decode"] > 0 and not shown["preemptions"]


FRAME_PROBE = """() => {
  const probe = { frames: 0, maxGapMs: 0, last: performance.now(), running: true };
  window.frameProbe = probe;
  const tick = (now) => {
    probe.maxGapMs = Math.max(probe.maxGapMs, now - probe.last);
    probe.last = now;
    probe.frames += 1;
    if (probe.running) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""
RESTART_FRAME_PROBE = """() => {
  Object.assign(window.frameProbe, { frames: 0, maxGapMs: 0, last: performance.now() });
}"""


@pytest.mark.timeout(600)
def test_the_page_stays_responsive_while_32_requests_stream(open_page, roomy_server):
    """32 clients keep a stream open each (a new one when one ends) until the page has been
    watched for MIN_FRAMES frames and three redraws, however fast the engine runs; then they
    hang up, and the page shows the last request of each."""
    page = open_page(roomy_server.url)
    show_timeline(page)
    page.evaluate(FRAME_PROBE)
    stop = threading.Event()
    streaming: dict[int, str] = {}  # client -> the id of its request now streaming
    last_ids: dict[int, str] = {}  # client -> the id of its latest request

    def client_loop(i: int) -> None:
        client = roomy_server.openai(strict=False)
        while not stop.is_set():
            streaming.pop(i, None)
            chunks = client.completions.create(
                model=MODEL,
                prompt=f"Request {i} counts:",
                max_tokens=LONG_STREAM_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with chunks:  # leaving it hangs up: the server aborts the request
                for chunk in chunks:
                    streaming[i] = last_ids[i] = chunk.id
                    if stop.is_set():
                        break

    with ThreadPoolExecutor(32) as pool:
        clients = [pool.submit(client_loop, i) for i in range(32)]
        try:
            wait_until(lambda: len(streaming) == 32, 240, "all 32 requests streaming")
            page.evaluate(RESTART_FRAME_PROBE)
            draws_seen = set()

            def watched_enough():
                draws_seen.add(model(page)["draws"])
                probe = page.evaluate("() => ({ ...window.frameProbe })")
                return probe["frames"] >= MIN_FRAMES and len(draws_seen) >= 3 and probe

            probe = wait_until(watched_enough, 240, f"{MIN_FRAMES} frames and 3 redraws")
        finally:
            stop.set()
        for client in clients:
            client.result(timeout=120)
    assert probe["maxGapMs"] < MAX_FRAME_GAP_MS, probe
    # Once the engine is idle, the page has drawn its last step: a row for each of the 32.
    roomy_server.wait_idle(timeout=60)
    last_step = num_steps(roomy_server) - 1
    shown = wait_until(
        lambda: (m := model(page))["lastStep"] >= last_step and m, 60, "the last step drawn"
    )
    assert len(last_ids) == 32
    assert set(last_ids.values()) <= {response_id(row) for row in shown["rows"]}, shown["rows"]


def test_without_debug_endpoints_the_tab_says_how_to_turn_them_on(open_page):
    shared = shared_server()  # started without --enable-debug-endpoints
    page = open_page(shared.url, API_KEY)
    shown = show_timeline(page, "off")
    assert "404" in shown["message"] and "--enable-debug-endpoints" in shown["message"]
    notice = page.locator("#timeline-notice")
    assert notice.is_visible() and "--enable-debug-endpoints" in notice.inner_text()


def test_a_wrong_key_asks_for_the_key(open_page):
    page = open_page(admin_key="wrong-key")
    shown = show_timeline(page, "needs-key")
    assert "401" in shown["message"] and "API key" in shown["message"]
    page.fill("#admin-key", ADMIN_KEY)  # the next poll uses the new key
    wait_until(lambda: model(page)["status"] == "live", 60, "the timeline to go live")
    assert page.locator("#timeline-notice").is_hidden()


def test_behind_a_router_with_several_workers_it_says_to_open_a_worker(open_page, server):
    """Also when the tab reopens while its last poll still waits on /stats (the CI run of
    stop 47 lost this race): that poll's answer is stale, and the next poll anchors again."""
    page = open_page()
    polling = lambda: page.evaluate("() => timeline.polling")  # noqa: E731
    wait_until(lambda: not polling(), 60, "open_page's own poll to end")
    held, mode = [], {"hold": True}  # while holding, every /stats waits for the test
    page.route("**/stats", lambda route: held.append(route) if mode["hold"] else as_router(route))
    page.click("#tab-timeline")
    wait_until(lambda: polling() and held, 60, "the poll to ask /stats")
    page.wait_for_timeout(200)  # lets the poll's request reach the route among the panel's
    page.click("#tab-chat")

    def as_router(route):
        """The worker's /stats with two workers listed, as the router's /stats has."""
        response = route.fetch()
        stats = response.json()
        worker = {"url": server.url, "is_healthy": True, "num_in_flight": 0, "num_routed": 0}
        stats["workers"] = [worker, {**worker, "url": "http://127.0.0.1:1"}]
        route.fulfill(response=response, json=stats)

    mode["hold"] = False
    page.click("#tab-timeline")  # reopened while the first poll is in flight
    for route in held:  # that poll (and the live panel's) sees one engine: it goes live
        route.fulfill(response=route.fetch())
    # No further click: a click on the open tab would start a fresh poll and hide the race.
    shown = wait_until(lambda: (m := model(page))["status"] == "router" and m, 60, "router")
    page.unroute_all(behavior="ignoreErrors")
    assert "2 workers" in shown["message"] and "--enable-debug-endpoints" in shown["message"]
