"""Server flags come from one settings dataclass (issue 39), the way engine flags come from
`EngineConfig`: every `ServerSettings` field that declares a flag is a `nanollmserve serve`
option (and an environment variable), parsed into the settings by the one generic function,
and a field without a flag is none; a bad value fails as a UserError before the model loads.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from nanollmserve.cli.env_defaults import env_name
from nanollmserve.cli.main import build_parser
from nanollmserve.errors import UserError
from nanollmserve.server_settings import ServerSettings, server_settings_from_args

pytestmark = [pytest.mark.milestone("m28"), pytest.mark.timeout(120)]


def _serve_parser():
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return parser, subparsers.choices["serve"]


def _parse(monkeypatch, *argv: str):
    for name in list(__import__("os").environ):
        if name.startswith("NANOLLMSERVE_"):
            monkeypatch.delenv(name)
    parser, _ = _serve_parser()
    return parser.parse_args(["serve", *argv])


def test_every_flag_field_is_a_serve_option_and_the_others_are_not():
    _, serve = _serve_parser()
    options = {o for action in serve._actions for o in action.option_strings}
    for f in dataclasses.fields(ServerSettings):
        flag = "--" + f.metadata.get("name", f.name).replace("_", "-")
        if "help" in f.metadata:
            assert flag in options, f.name
        else:
            assert flag not in options, f.name


def test_the_flags_become_the_settings(monkeypatch):
    args = _parse(
        monkeypatch,
        "--served-model-name", "a", "b",
        "--log-prompts",
        "--no-enable-log-requests",
        "--allowed-origins", json.dumps(["https://app.example"]),
        "--allow-credentials",
        "--responses-store-max-bytes", "1MiB",
        "--kv-role", "decode",
        "--reasoning-parser", "qwen3",
    )  # fmt: skip
    settings = server_settings_from_args(args, tracer="a tracer")
    assert settings.served_model_names == ["a", "b"]
    assert (settings.log_prompts, settings.log_requests) == (True, False)
    assert settings.allowed_origins == ["https://app.example"]
    assert settings.allowed_methods == ["*"] and settings.allow_credentials
    assert settings.response_store_max_bytes == 1 << 20
    assert (settings.kv_role, settings.reasoning_parser) == ("decode", "qwen3")
    assert settings.tracer == "a tracer"
    # The command line's defaults: request logging on, which an app built in code is not.
    defaults = server_settings_from_args(_parse(monkeypatch))
    assert defaults.log_requests and not ServerSettings().log_requests
    assert defaults.served_model_names == [] and defaults.response_store_max_bytes == 64 << 20
    same = {"log_requests", "tracer"}
    assert {
        f.name: getattr(defaults, f.name)
        for f in dataclasses.fields(ServerSettings)
        if f.name not in same
    } == {f.name: getattr(ServerSettings(), f.name) for f in dataclasses.fields(ServerSettings)
          if f.name not in same}  # fmt: skip


def test_a_flag_field_is_an_environment_variable_too(monkeypatch):
    monkeypatch.setenv(env_name("--log-prompts"), "1")
    monkeypatch.setenv(env_name("--allowed-methods"), '["GET"]')
    parser, _ = _serve_parser()
    settings = server_settings_from_args(parser.parse_args(["serve"]))
    assert settings.log_prompts and settings.allowed_methods == ["GET"]


@pytest.mark.parametrize("value", ["not json", '{"a": 1}', "[1, 2]"])
def test_a_bad_cors_list_is_a_user_error(monkeypatch, value):
    args = _parse(monkeypatch, "--allowed-origins", value)
    with pytest.raises(UserError, match="--allowed-origins must be a JSON list"):
        server_settings_from_args(args)
