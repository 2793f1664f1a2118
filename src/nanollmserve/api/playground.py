"""The web playground: `GET /` serves a chat page, `/static/app.js` and `/static/app.css` its
script and style, `/static/timeline.js` its Timeline tab (drawn from `/debug/steps`); plain
files under `api/static/`, no build step, nothing from a CDN.

The page holds no data, so these paths are open even with `--api-key` (auth.py OPEN_PATHS;
the router's copy is router/auth.py PLAYGROUND_PATHS); the page asks for the key and sends
it on its own API calls. Every response
carries a strict Content-Security-Policy (scripts and styles only from this server, no
inline code, fetches only to this server) and `X-Content-Type-Options: nosniff`.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
# URL path -> (file under api/static, media type).
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
    "/static/timeline.js": ("timeline.js", "text/javascript; charset=utf-8"),
}
PLAYGROUND_PATHS = frozenset(FILES)

router = APIRouter()


@cache
def _read(name: str) -> bytes:
    return resources.files("nanollmserve.api").joinpath("static", name).read_bytes()


def _serve(path: str) -> Response:
    name, media_type = FILES[path]
    return Response(
        _read(name),
        media_type=media_type,
        headers={
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            # Revalidate each load, so a restarted server's new page is never mixed with old JS.
            "Cache-Control": "no-cache",
        },
    )


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return _serve("/")


@router.get("/static/app.js", include_in_schema=False)
async def app_js() -> Response:
    return _serve("/static/app.js")


@router.get("/static/app.css", include_in_schema=False)
async def app_css() -> Response:
    return _serve("/static/app.css")


@router.get("/static/timeline.js", include_in_schema=False)
async def timeline_js() -> Response:
    return _serve("/static/timeline.js")
