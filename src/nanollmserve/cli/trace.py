"""`nanollmserve trace export --format chrome`: a flight record as a Chrome trace / Perfetto
JSON file (`engine/trace_export.py`), from a saved record (`--input FILE`, the JSON lines of
/debug/steps) or a running server (`--url URL`, which needs `--enable-debug-endpoints` and
`--admin-api-key`: /debug/steps is an admin route; the key comes from `--admin-api-key`
(alias `--api-key`) or NANOLLMSERVE_ADMIN_API_KEY).
"""

from __future__ import annotations

import argparse
import json
import os

from nanollmserve.errors import UserError

API_KEY_ENV = "NANOLLMSERVE_ADMIN_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace", help="export the engine's flight record", description=__doc__
    )
    actions = parser.add_subparsers(dest="trace_action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export",
        help="write a flight record as a Chrome trace (ui.perfetto.dev, chrome://tracing)",
        description=__doc__,
    )
    export.add_argument("--format", default="chrome", choices=["chrome"], help="(default chrome)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="FILE", help="a saved flight record (JSON lines)")
    source.add_argument("--url", metavar="URL", help="a server's base URL: reads /debug/steps")
    export.add_argument(
        "--since", type=int, default=0, metavar="STEP", help="steps from this one (default 0)"
    )
    export.add_argument(
        "--admin-api-key",
        "--api-key",
        dest="api_key",
        default=None,
        help=f"the server's admin key (/debug/steps is an admin route) (default: ${API_KEY_ENV})",
    )
    export.add_argument("--output", required=True, metavar="FILE", help="the trace JSON to write")
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from nanollmserve.engine.trace_export import chrome_trace
    from nanollmserve.replay import read_record

    if args.input is not None:
        try:
            with open(args.input) as f:
                record = read_record(f)
        except OSError as exc:
            raise UserError(f"cannot read {args.input}: {exc.strerror}") from None
    else:
        record = read_record(_fetch_lines(args.url, args.since, args.api_key))
    steps = [step for step in record.steps if step["step"] >= args.since]
    trace = chrome_trace(steps)
    with open(args.output, "w") as f:
        json.dump(trace, f)
    print(f"wrote {args.output}: {len(steps)} steps, {len(trace['traceEvents'])} trace events")
    return 0


def _fetch_lines(url: str, since: int, api_key: str | None) -> list[str]:
    import httpx

    api_key = api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(
            f"{url.rstrip('/')}/debug/steps", params={"since": since}, headers=headers, timeout=60
        )
    except httpx.HTTPError as exc:
        raise UserError(f"cannot read {url}/debug/steps: {exc}") from None
    if response.status_code != 200:
        raise UserError(
            f"{url}/debug/steps answered {response.status_code} (is the server started with "
            f"--enable-debug-endpoints and --admin-api-key, and the admin key right?): "
            f"{response.text[:200]}"
        )
    return response.text.splitlines()
