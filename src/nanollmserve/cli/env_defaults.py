"""Flags from the environment: every option of a parser can be set as `NANOLLMSERVE_<FLAG>`
(`--max-num-seqs 8` is `NANOLLMSERVE_MAX_NUM_SEQS=8`), a container-friendly convention.

`apply_env_defaults(parser)` walks the parser's options before it parses and makes each
variable that is set the option's default, so a flag on the command line still wins:
flag > environment > built-in default. Values are converted as argparse converts the flag's
(its `type`, its `choices`; a list flag takes space-separated values); an on/off flag takes
1/0, true/false, yes/no or on/off, and `NANOLLMSERVE_NO_X=1` means what `--no-X` means. An
empty variable counts as unset. A value that does not convert is not an error at once (other
subcommands share the environment): it is returned, and `serve` reports the first one as a
one-line error (exit status 2) before loading anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "NANOLLMSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction)


def env_name(option: str) -> str:
    """`--max-num-seqs` -> `NANOLLMSERVE_MAX_NUM_SEQS`."""
    return PREFIX + option.lstrip("-").replace("-", "_").upper()


def env_options(parser: argparse.ArgumentParser):
    """(variable name, action, value the flag stands for, or None) for every long option."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if not option.startswith("--"):
                continue
            if isinstance(action, argparse.BooleanOptionalAction):
                yield env_name(option), action, not option.startswith("--no-")
            elif isinstance(action, _FLAG_ACTIONS):
                yield env_name(option), action, action.const
            else:
                yield env_name(option), action, None


def apply_env_defaults(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """Set the defaults of `parser` from the environment. Returns ({dest: variable} of the
    defaults set, [one-line error per variable that did not convert])."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    errors: list[str] = []
    for name, action, flag_value in env_options(parser):
        raw = environ.get(name, "")
        if raw == "":
            continue
        try:
            value = _convert(action, raw, flag_value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            errors.append(f"{name}={raw!r}: {exc}")
            continue
        if action.dest in values and values[action.dest] != value:
            errors.append(f"{sources[action.dest]} and {name} disagree; set one of them")
            continue
        values[action.dest], sources[action.dest] = value, name
    parser.set_defaults(**values)
    return sources, errors


def _convert(action: argparse.Action, raw: str, flag_value: object) -> object:
    if flag_value is not None:
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        return flag_value if word in _TRUE else not flag_value
    if action.nargs in ("+", "*"):
        return [_one(action, item) for item in raw.split()]
    return _one(action, raw)


def _one(action: argparse.Action, raw: str) -> object:
    try:
        value = action.type(raw) if callable(action.type) else raw
    except ValueError:
        raise ValueError(f"invalid {getattr(action.type, '__name__', 'value')} value") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return value
