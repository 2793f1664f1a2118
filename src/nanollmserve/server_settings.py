"""ServerSettings: what the HTTP app (and the gRPC service beside it) is configured with. Like
`EngineConfig` for the engine flags, each field that is a `nanollmserve serve` flag declares
its flag here (its help, and how argparse reads it), and the CLI builds the flags from this
dataclass (`add_server_args`) and the settings from the parsed flags
(`server_settings_from_args`): a new server flag is a new field and its use, nothing else.

The fields with no flag are set by whoever builds the app (a test, `serve` for the tracer).
The serve flags that shape the process rather than the app (`--host`, `--port`, TLS,
`--shutdown-timeout`, ...) stay in `cli/serve.py`; the request limits are `RequestLimits`'
(`request_limits.py`), the engine's `EngineConfig`'s. No FastAPI or torch here: the CLI
parses its flags before loading anything.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field, fields

from nanollmserve.body_limit import MAX_REQUEST_BYTES
from nanollmserve.errors import UserError
from nanollmserve.sizes import parse_size

__all__ = [
    "DEFAULT_RESPONSE_STORE_MAX_BYTES",
    "KV_ROLES",
    "ServerSettings",
    "add_server_args",
    "server_settings_from_args",
]

DEFAULT_RESPONSE_STORE_MAX_BYTES = 64 << 20
"""What the stored /v1/responses results may hold in all, by default (64 MiB)."""
KV_ROLES = ("prefill", "decode", "both")
KV_TRANSFERS = ("store", "ray")
API_KEY_ENV = "NANOLLMSERVE_API_KEY"

SERVER_GROUP = "server"
CORS_GROUP = "CORS (off unless --allowed-origins; then preflights work)"


def _json_list(value, flag: str) -> list[str]:
    """A CORS flag's JSON list of strings (a list given in code passes as is)."""
    if isinstance(value, list):
        return value
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise UserError(f"{flag} must be a JSON list: {exc}") from None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise UserError(f"{flag} must be a JSON list of strings, got {value}")
    return parsed


def _flag(help: str, *, group: str = SERVER_GROUP, **argparse_kwargs) -> dict:
    """A field's flag: its help and argparse keywords (`name`: the flag when it is not the
    field's name; `cli_default`: the flag's default when not the field's; `convert`: from the
    parsed value to the field's; `aliases`: more options, each with its argparse keywords)."""
    return {"help": help, "group": group, **argparse_kwargs}


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(
        default_factory=list,
        metadata=_flag(
            "name(s) clients use in `model` (default: the model's name); '*' among them "
            "accepts any name, as llama.cpp's server does (the base model runs it)",
            name="served_model_name",
            nargs="+",
            metavar="NAME",
            cli_default=None,
            convert=lambda names: list(names or []),
        ),
    )
    """Names the model answers to; the first is the one reported. Empty: the model's name."""
    allow_runtime_lora_updating: bool = field(
        default=False,
        metadata=_flag(
            "let the operator load and unload LoRA adapters (POST /v1/load_lora_adapter, "
            "/v1/unload_lora_adapter: admin routes, behind --admin-api-key)"
        ),
    )
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter work (404 otherwise); admin
    routes, behind `admin_api_key`."""
    api_key: str | None = field(
        default=None,
        metadata=_flag(
            f"require 'Authorization: Bearer KEY' on every route but /health, the "
            f"playground's page and files and (unless --metrics-require-auth) /metrics "
            f"(default: ${API_KEY_ENV}; prefer the variable, command lines are visible)"
        ),
    )
    """When set, every route except /health (and /metrics, see below) needs
    `Authorization: Bearer <api_key>`."""
    admin_api_key: str | None = field(
        default=None,
        metadata=_flag(
            "the operator's key for the admin routes (POST /sleep, /wake_up, GET "
            "/is_sleeping, /debug/steps), never the API key; without it those routes are off "
            "(404) (default: $NANOLLMSERVE_ADMIN_API_KEY; prefer the variable)"
        ),
    )
    """What the admin routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/debug/steps`) need,
    never the api_key; None: those routes are off (404)."""
    tool_call_parser: str | None = field(
        default=None,
        metadata=_flag(
            "how tool calls are read from the model's text (vLLM's names; hermes: "
            "<tool_call>{...}</tool_call>, Qwen, SmolLM2)",
            choices=["hermes"],
        ),
    )
    """The parser of `tool_choice: "auto"` (with `--enable-auto-tool-choice`, which `serve`
    checks); None: "auto" with tools is a 400."""
    reasoning_parser: str | None = field(
        default=None,
        metadata=_flag(
            "split a reasoning model's <think>...</think> into reasoning_content (chat) and "
            "a reasoning item (responses); structured output then applies to the answer after "
            "</think> (default: off, the thinking stays in the text)",
            choices=["deepseek_r1", "qwen3"],
        ),
    )
    """A reasoning model's thinking goes to `reasoning_content` (chat) and a `reasoning`
    item (responses); None: it stays in the text."""
    kv_role: str = field(
        default="both",
        metadata=_flag(
            "prefill/decode disaggregation (the router's --policy pd): prefill workers "
            "compute prompts and hand their KV blocks on, decode workers generate from them, "
            "through the --kv-offload-dir store they share (same directory, e.g. on /dev/shm; "
            "needed by prefill and decode); reported by /health (default %(default)s: both)",
            choices=list(KV_ROLES),
        ),
    )
    """prefill | decode | both, reported by /health for the router's pd policy."""
    slot_save_path: str | None = field(
        default=None,
        metadata=_flag(
            "llama.cpp's slot actions (POST /slots/{id}?action=save|restore|erase): save a "
            "sequence place's cached KV blocks and tokens to a file in this directory and "
            "restore them into the prefix cache; a private directory of this user (made 0700; "
            "one writable by others is refused), files 0600, behind the API key (the admin key "
            "alone with --admin-api-key) (default: off, the actions answer 501)",
            metavar="DIR",
        ),
    )
    """Where saved slots go (`engine/slot_save.py`); None: slot actions are a 501."""
    kv_transfer: str = field(
        default="store",
        metadata=_flag(
            "how prefill and decode workers move KV blocks: store = through the "
            "--kv-offload-dir directory they share (one host: /dev/shm); ray = through Ray's "
            "object store (workers on different hosts; each keeps its own --kv-offload-dir, "
            "with the same key; joins the Ray cluster at RAY_ADDRESS) (default %(default)s)",
            choices=list(KV_TRANSFERS),
        ),
    )
    """store | ray: the transport of prefill/decode disaggregation's blocks."""
    kv_transfer_hold_seconds: float = field(
        default=120.0,
        metadata=_flag(
            "--kv-transfer ray, prefill worker: seconds it keeps a prompt's blocks in Ray's "
            "object store after answering phase 1 (at most --kv-offload-max-bytes of them, "
            "oldest freed first); a decode worker that fetches later recomputes them "
            "(0 to 3600; default %(default)s)",
            type=float,
            metavar="S",
        ),
    )
    kv_transfer_timeout: float = field(
        default=10.0,
        metadata=_flag(
            "--kv-transfer ray, decode worker: seconds it waits for a prompt's blocks from "
            "Ray's object store; a block missing or late is recomputed (0 to 3600; default "
            "%(default)s)",
            type=float,
            metavar="S",
        ),
    )
    enable_debug_endpoints: bool = field(
        default=False,
        metadata=_flag(
            "serve GET /debug/steps, the engine's flight record (--step-record), behind "
            "the admin key, --admin-api-key (default: off, a 404)"
        ),
    )
    """GET /debug/steps (the engine's flight record) is served (404 otherwise)."""
    metrics_require_auth: bool = field(
        default=False,
        metadata=_flag(
            "with --api-key, require the key on /metrics too (default: open to scrapers)"
        ),
    )
    """With an api_key, /metrics needs it too; by default scrapers read /metrics freely."""
    response_store_max_bytes: int = field(
        default=DEFAULT_RESPONSE_STORE_MAX_BYTES,
        metadata=_flag(
            "bytes the stored /v1/responses results (store: true) may hold in all, least "
            "recently used evicted first; one larger than this is not stored "
            "(default %(default)s)",
            name="responses_store_max_bytes",
            type=parse_size,
            cli_default="64MiB",
            metavar="SIZE",
        ),
    )
    """The bytes the stored responses may hold in all (LRU)."""
    timings: bool = field(
        default=True,
        metadata=_flag(
            "put llama.cpp's `timings` (prompt and generated tokens, ms, tokens/s) on "
            "/v1/completions and /v1/chat/completions answers, at the top level and in a "
            "stream's last chunk; --no-timings leaves them out (/completion always has them) "
            "(default: on)",
            action=argparse.BooleanOptionalAction,
        ),
    )
    """llama.cpp's `timings` on the OpenAI completions and chat answers."""
    log_requests: bool = field(
        default=False,
        metadata=_flag(
            "log one line per finished request: id, prompt/cached/generated tokens, TTFT, "
            "E2E, finish reason, status (default: on)",
            name="enable_log_requests",
            action=argparse.BooleanOptionalAction,
            cli_default=True,
            aliases=[
                (
                    "--disable-log-requests",
                    {"action": "store_false", "help": "same as --no-enable-log-requests"},
                )
            ],
        ),
    )
    """Log one line per ended request (`nanollmserve serve` turns it on)."""
    log_prompts: bool = field(
        default=False,
        metadata=_flag("put the prompt text in the request log line (default: never logged)"),
    )
    """Put the prompt text in that line too."""
    allowed_origins: list[str] = field(
        default_factory=list,
        metadata=_flag(
            "origins browsers may call from, a JSON list: '[\"https://app.example\"]' "
            "(default %(default)s: CORS off, same-origin only)",
            group=CORS_GROUP,
            cli_default="[]",
            metavar="JSON",
            convert=_json_list,
        ),
    )
    """CORS: origins browsers may call from (empty: CORS off, same-origin only; `*`: any)."""
    allowed_methods: list[str] = field(
        default_factory=lambda: ["*"],
        metadata=_flag(
            "methods allowed cross-origin, a JSON list (default %(default)s)",
            group=CORS_GROUP,
            cli_default='["*"]',
            metavar="JSON",
            convert=_json_list,
        ),
    )
    allowed_headers: list[str] = field(
        default_factory=lambda: ["*"],
        metadata=_flag(
            "request headers allowed cross-origin, a JSON list (default %(default)s)",
            group=CORS_GROUP,
            cli_default='["*"]',
            metavar="JSON",
            convert=_json_list,
        ),
    )
    allow_credentials: bool = field(
        default=False,
        metadata=_flag("allow cookies / credentials cross-origin (default: off)", group=CORS_GROUP),
    )
    # -- no flag: set by whoever builds the app --------------------------------------------
    max_request_bytes: int = MAX_REQUEST_BYTES
    response_store_size: int = 1024
    """Responses kept for GET /v1/responses/{id} and previous_response_id (LRU)."""
    tracer: object | None = None
    """`--otlp-traces-endpoint`: the `nanollmserve.tracing.spans.Tracer` that gives each
    generation request a span (HTTP and gRPC); None: tracing off."""


def _flag_fields():
    return [f for f in fields(ServerSettings) if "help" in f.metadata]


def _dest(f) -> str:
    """The flag's name (and argparse dest): the field's unless it says otherwise."""
    return f.metadata.get("name", f.name)


def _option(f) -> str:
    return "--" + _dest(f).replace("_", "-")


def add_server_args(parser: argparse.ArgumentParser, group: str) -> None:
    """One flag per flag field of ServerSettings, in the field's argument group (`group`:
    the title of the first one, "server", which `serve` also adds its own flags to)."""
    groups = {}
    for action_group in parser._action_groups:
        groups[action_group.title] = action_group
    for f in _flag_fields():
        meta = f.metadata
        title = group if meta["group"] == SERVER_GROUP else meta["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups[title]
        if "cli_default" in meta:
            default = meta["cli_default"]
        elif f.default is not MISSING:
            default = f.default
        else:
            default = f.default_factory()
        kwargs = {"dest": _dest(f), "default": default, "help": meta["help"]}
        for key in ("type", "nargs", "metavar", "choices", "action"):
            if key in meta:
                kwargs[key] = meta[key]
        if f.type == "bool" and "action" not in kwargs:
            kwargs["action"] = "store_true"
        target.add_argument(_option(f), **kwargs)
        for option, alias_kwargs in meta.get("aliases", ()):
            target.add_argument(option, dest=_dest(f), **alias_kwargs)


def server_settings_from_args(args: argparse.Namespace, **others) -> ServerSettings:
    """The settings of the parsed flags (UserError for a value that does not convert);
    `others`: the fields with no flag (`tracer=`)."""
    values = {}
    for f in _flag_fields():
        value = getattr(args, _dest(f))
        convert = f.metadata.get("convert")
        if convert is _json_list:
            value = _json_list(value, _option(f))
        elif convert is not None:
            value = convert(value)
        values[f.name] = value
    return ServerSettings(**values, **others)
