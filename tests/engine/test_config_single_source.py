"""Engine settings have one source, `EngineConfig`: the `LLM(...)` keywords and the CLI's engine
flags are checked against its fields and defaults here, so a default changed in one place and not
the others fails (issue 13)."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

from engine.config import EngineConfig
from engine.llm import LLM
from server.args import add_engine_args, llm_kwargs

# LLM keywords whose value the config normalizes (a JSON string becomes a dict, a name an enum).
NORMALIZED = {"scheduling_policy", "kv_load_failure_policy"}


def config_fields() -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty)
        out[f.name] = getattr(default, "value", default)  # enums compare by value
    return out


def test_llm_keywords_are_the_config_fields_with_the_same_defaults():
    params = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items() if n != "self"}
    fields = config_fields()
    assert set(params) == set(fields), (set(params) ^ set(fields))
    drift = {n: (params[n], fields[n]) for n in params if n != "model" and params[n] != fields[n]}
    assert not drift, f"LLM(...) defaults differ from EngineConfig's: {drift}"


def test_cli_flags_map_onto_the_config_with_the_same_defaults():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args([])
    kwargs = llm_kwargs(ns)
    fields = config_fields()
    assert set(kwargs) <= set(fields), set(kwargs) - set(fields)
    drift = {n: (v, fields[n]) for n, v in kwargs.items()
             if n != "model" and v is not None and v != fields[n] and n not in NORMALIZED}
    drift.update({n: (v, fields[n]) for n, v in kwargs.items() if n in NORMALIZED and v != fields[n]})
    # A flag left unset may pass None where the config's default applies (then LLM's default does).
    none_ok = {n for n, v in kwargs.items() if v is None}
    assert not drift, f"CLI flag defaults differ from EngineConfig's: {drift}"
    assert all(n in fields for n in none_ok)
