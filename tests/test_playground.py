"""The web playground's static page (m20), without a browser: `GET /` is HTML and
`/static/app.js`, `/static/app.css` have their content types, all with the strict CSP and
nosniff headers; the three paths are open with `--api-key` while the API stays closed; the
files hold no inline script or style (the CSP would block them) and the JS never turns text
into HTML. The browser test is tests/test_playground_browser.py.
"""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from live_server import shared_server

from nanollmserve.api.auth import OPEN_PATHS, APIKeyMiddleware
from nanollmserve.api.playground import CONTENT_SECURITY_POLICY, FILES
from nanollmserve.api.playground import router as playground_router

pytestmark = pytest.mark.milestone("m20")

STATIC = resources.files("nanollmserve.api").joinpath("static")


def _check_headers(response: httpx.Response, media_type: str) -> None:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == media_type
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert response.headers["x-content-type-options"] == "nosniff"


def test_page_and_assets_are_served_with_types_and_csp_without_a_key():
    app = FastAPI()
    app.include_router(playground_router)

    @app.get("/stats")
    async def stats():
        return {"num_requests_running": 0}

    app.add_middleware(APIKeyMiddleware, api_key="secret", open_paths=OPEN_PATHS)
    with TestClient(app) as client:
        for path, (name, media_type) in FILES.items():
            response = client.get(path)
            _check_headers(response, media_type)
            assert response.content == STATIC.joinpath(name).read_bytes()
        assert client.get("/stats").status_code == 401
        assert client.get("/static/other.js").status_code == 401  # only the listed files
        headers = {"Authorization": "Bearer secret"}
        assert client.get("/stats", headers=headers).json() == {"num_requests_running": 0}


def test_csp_is_strict():
    policy = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert policy["default-src"] == policy["script-src"] == policy["style-src"] == "'self'"
    assert policy["connect-src"] == "'self'" and policy["object-src"] == "'none'"
    assert policy["frame-ancestors"] == "'none'" and policy["base-uri"] == "'none'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY


def test_static_files_have_no_inline_code_and_no_html_sinks():
    html = STATIC.joinpath("index.html").read_text()
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts and all("src=" in tag for tag in scripts)  # no inline script
    assert "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing from another host
    js = STATIC.joinpath("app.js").read_text()
    sinks = r"\.(innerHTML|outerHTML|insertAdjacentHTML|write)\b|\beval\(|new Function"
    assert not re.search(sinks, js)
    assert "sessionStorage" in js and "localStorage" not in js


def test_live_server_serves_the_page_without_the_key():
    server = shared_server()  # started with an API key
    assert server.api_key
    response = httpx.get(f"{server.url}/", timeout=10)
    _check_headers(response, "text/html; charset=utf-8")
    assert "/static/app.js" in response.text
    _check_headers(httpx.get(f"{server.url}/static/app.js", timeout=10), FILES["/static/app.js"][1])
    assert httpx.get(f"{server.url}/stats", timeout=10).status_code == 401
    assert server.stats()["is_healthy"] is True
    assert "/" not in server.client().get("/openapi.json").json()["paths"]
