"""The playground's Timeline tab (m24), without a browser: the page ships the tab, its pane
and canvas and loads `/static/timeline.js`, which is served like the other playground files
(open without the key, strict CSP, nosniff) by the server and let through by the router's
key check too; the script polls `/debug/steps?since=`, sends the page's API key, draws with
requestAnimationFrame and never turns text into HTML. The browser tests are
tests/test_playground_timeline_browser.py.
"""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest
from live_server import shared_server

from nanollmserve.api.playground import CONTENT_SECURITY_POLICY, FILES, PLAYGROUND_PATHS
from nanollmserve.router.auth import PLAYGROUND_PATHS as ROUTER_PLAYGROUND_PATHS

pytestmark = pytest.mark.milestone("m24")

STATIC = resources.files("nanollmserve.api").joinpath("static")


def test_the_page_ships_the_timeline_tab():
    html = STATIC.joinpath("index.html").read_text()
    assert re.search(r'<button[^>]*id="tab-timeline"[^>]*data-tab="timeline"', html)
    assert re.search(r'<section[^>]*id="pane-timeline"[^>]*hidden', html)
    assert 'id="timeline-canvas"' in html and 'id="timeline-detail"' in html
    assert '<script src="/static/timeline.js" defer></script>' in html
    # After app.js, whose helpers (the API key's headers) it uses.
    assert html.index("/static/app.js") < html.index("/static/timeline.js")
    for phase in ("queued", "prefill", "decode", "preempted", "finished"):
        assert f"swatch phase-{phase}" in html


def test_the_timeline_script_polls_debug_steps_with_the_key_and_draws_on_frames():
    js = STATIC.joinpath("timeline.js").read_text()
    assert 'fetch("/debug/steps?since=" + since' in js
    assert "headers: authHeaders()" in js
    assert "requestAnimationFrame(" in js and 'getContext("2d")' in js
    assert "--enable-debug-endpoints" in js  # what the 404 notice tells the user
    assert "TIMELINE_WINDOW = 500" in js  # a bounded window of steps
    sinks = r"\.(innerHTML|outerHTML|insertAdjacentHTML|write)\b|\beval\(|new Function"
    assert not re.search(sinks, js)
    assert not re.search(r"https?://", js)  # nothing from another host
    assert "localStorage" not in js


def test_the_script_is_served_and_open_like_the_rest_of_the_page():
    assert FILES["/static/timeline.js"] == ("timeline.js", "text/javascript; charset=utf-8")
    # The router lets the same paths through its key check (it cannot import the api package).
    assert ROUTER_PLAYGROUND_PATHS == PLAYGROUND_PATHS
    server = shared_server()  # started with an API key
    response = httpx.get(f"{server.url}/static/timeline.js", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/javascript; charset=utf-8"
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.content == STATIC.joinpath("timeline.js").read_bytes()
    assert 'data-tab="timeline"' in httpx.get(f"{server.url}/", timeout=10).text
