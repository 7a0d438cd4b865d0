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
from engine.config import EngineConfig, UsageContext, engine_settings, is_flag, setting
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
    for f in filter(is_flag, engine_settings()):
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


def test_the_step_budgets_default_depends_on_who_runs_the_engine():
    from engine.core.setup import step_token_budget

    offline, server = (EngineConfig(model="unused", device="cpu", usage_context=u) for u in UsageContext)
    assert step_token_budget(offline, 512) == UsageContext.OFFLINE.max_num_batched_tokens == 4096
    assert step_token_budget(server, 512) == UsageContext.SERVER.max_num_batched_tokens == 2048
    assert EngineConfig(model="unused", device="cpu", usage_context="server").usage_context is UsageContext.SERVER
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert llm_kwargs(p.parse_args([]), UsageContext.SERVER)["usage_context"] is UsageContext.SERVER


def test_server_settings_are_declared_once_too(monkeypatch, capsys):
    """`kvtier serve`'s own flags are generated from ServerSettings' declarations: a changed
    default reaches the flag, the help and the settings built from the flags."""
    from server.args import add_setting_args
    from server.serve import build_parser
    from server.settings import ServerSettings

    ns = build_parser().parse_args([])
    built = ServerSettings.from_flags(ns, served_model_names=("m",), model_path="m")
    for f in ServerSettings.flag_fields():
        if f.name != "api_key":  # its default is $KVTIER_API_KEY's value
            assert getattr(built, f.name) == f.default, f.name

    @dataclasses.dataclass(frozen=True)
    class Changed(ServerSettings):
        max_pending_requests: int = setting(64, "sequences in flight (default: %(default)s)")

    p = argparse.ArgumentParser()
    add_setting_args(p, Changed)
    ns = p.parse_args([])
    assert Changed.from_flags(ns, served_model_names=("m",), model_path="m").max_pending_requests == 64
    p.print_help()
    assert "(default: 64)" in capsys.readouterr().out
    monkeypatch.setenv("KVTIER_API_KEY", "k")
    assert build_parser().parse_args([]).api_key == "k"
    with pytest.raises(ValueError, match="port"):
        ServerSettings.from_flags(build_parser().parse_args(["--port", "70000"]), served_model_names=("m",),
                                  model_path="m")
