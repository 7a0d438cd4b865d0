"""Each engine setting is declared once, in EngineConfig (engine/config.py): `LLM(...)` has no
defaults of its own, `kvtier serve` / `generate` / `extract` generate their engine flags from the
declarations, and a default changed there reaches all of them (issue 40)."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect

import pytest

import engine.llm as llm_mod
from engine.config import EngineConfig, engine_settings, setting
from engine.llm import LLM
from server.args import add_engine_args, llm_kwargs
from server.cli import main as cli_main


def defaults(config: type) -> dict[str, object]:
    return {f.name: f.default.value if isinstance(f.default, enum.Enum) else f.default
            for f in dataclasses.fields(config) if f.init and f.name != "model"}


def test_llm_takes_the_settings_and_declares_no_defaults():
    params = inspect.signature(LLM.__init__).parameters
    assert [(n, p.kind) for n, p in params.items()] == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), ("model", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("settings", inspect.Parameter.VAR_KEYWORD)]
    with pytest.raises(TypeError, match="bogus_setting"):
        LLM("unused", block_size=16, bogus_setting=1)


def test_every_setting_is_a_flag_whose_default_is_the_declared_one():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    kwargs = llm_kwargs(p.parse_args([]))
    assert set(kwargs) == {f.name for f in engine_settings()}
    assert {n: v for n, v in kwargs.items() if n != "model"} == defaults(EngineConfig)


@pytest.mark.parametrize("command", ["serve", "generate", "extract"])
def test_every_setting_is_in_each_commands_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for f in engine_settings()[1:]:
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        assert flag in out, f"{command} --help lacks {flag}"


def test_a_changed_default_reaches_the_flags_the_help_and_llm(monkeypatch, capsys):
    @dataclasses.dataclass(frozen=True)
    class Changed(EngineConfig):
        block_size: int = setting(32, "tokens per KV block, a power of two (default: %(default)s)")

    p = argparse.ArgumentParser()
    add_engine_args(p, Changed)
    assert llm_kwargs(p.parse_args([]))["block_size"] == 32
    p.print_help()
    assert "(default: 32)" in capsys.readouterr().out

    built = []

    class NoEngine:  # LLM's config, without loading a model
        def __init__(self, config):
            built.append(config)

    monkeypatch.setattr(llm_mod, "EngineConfig", Changed)
    monkeypatch.setattr(llm_mod, "EngineCore", NoEngine)
    LLM("unused", device="cpu")
    assert built[0].block_size == 32 and built[0] == Changed(model="unused", device="cpu")
