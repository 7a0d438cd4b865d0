"""vLLM's `--config FILE`: flags from a YAML mapping, with the command line winning.

Keys are flag names without the leading dashes, written `max-model-len` or `max_model_len`; `model`
names the checkpoint. Each entry is turned into its command-line arguments and parsed, so argparse
checks the value as it checks the flag (a bad value exits 2 naming the flag); the results become
the parser's defaults, which a flag given on the command line overrides. A key that is no flag is
an error naming it, never ignored: a misspelt key would otherwise leave the server running with a
default the operator thought they had changed.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def config_path(argv: list[str]) -> str | None:
    """The --config value on the command line, if any (the last one, as argparse takes it)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    return pre.parse_known_args(argv)[0].config


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each long flag by its name without dashes (dashes and underscores both), and `model`."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse has no public listing of its actions
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = out[opt[2:].replace("-", "_")] = action
    return out


def _args(key: str, flag: str, value: Any, action: argparse.Action) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{key}: true or false expected; got {value!r}")
        if key.replace("_", "-") == f"no-{flag}":  # `no-enable-prefix-caching: true`
            value = not value
        return [f"--{flag}" if value else f"--no-{flag}"]
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"{key}: true or false expected; got {value!r}")
        # A store_true flag set false is its default: nothing to pass (a store_false flag the reverse).
        return [f"--{flag}"] if value == (action.const is True) else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [f"--{flag}", *(str(v) for v in value)]
    if isinstance(value, (dict, list)):  # a JSON-valued flag (--kv-transfer-config, --allowed-origins)
        return [f"--{flag}", json.dumps(value)]
    if isinstance(value, bool):
        return [f"--{flag}", "true" if value else "false"]
    return [f"--{flag}", str(value)]


def expand(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Applies `argv`'s --config file, if any: its values become `parser`'s defaults (checked as
    the flags they name: a bad one exits 2 naming the flag), so the command line still wins, and
    its `model` becomes the positional MODEL when the command line gives none. Returns the argv
    to parse. Calls `parser.error` (exit 2) for an unreadable file, one that is not a mapping, or
    an unknown key."""
    path = config_path(argv)
    if path is None:
        return argv
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--config {path}: cannot read it: {e}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML: {str(e).splitlines()[0]}")
    if data is None:
        return argv
    if not isinstance(data, dict):
        parser.error(f"--config {path}: the file must hold a mapping of flag names to values")
    options = _options(parser)
    unknown = sorted(str(k) for k in data if str(k) not in options or str(k) in ("config", "help"))
    if unknown:
        parser.error(f"--config {path}: unknown key(s) {', '.join(unknown)} (keys are flag names without the "
                     "dashes, e.g. max-model-len or max_model_len)")
    args: list[str] = []
    model = None
    for key, value in data.items():
        key = str(key)
        if value is None:  # null: the flag's default
            continue
        if key == "model":
            model = str(value)
            continue
        action = options[key]
        flag = next(o[2:] for o in action.option_strings if o.startswith("--"))
        try:
            args += _args(key, flag, value, action)
        except ValueError as e:
            parser.error(f"--config {path}: {e}")
    # Parsed on their own (argparse checks each value as its flag's), then made defaults: a flag
    # on the command line overrides them whatever the order, and no list-valued flag can swallow
    # a positional argument that follows it.
    given, plain = vars(parser.parse_args(args)), vars(parser.parse_args([]))
    parser.set_defaults(**{k: v for k, v in given.items() if v != plain[k]})
    if model is not None and parser.parse_known_args(argv)[0].model is None:
        return [model, *argv]
    return argv
