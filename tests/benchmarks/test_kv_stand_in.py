"""benchmarks/kv_stand_in.py writes a checkpoint whose KV cache per token is the source's, so that a
tier benchmark on it moves the source's bytes. Oracle: the engine's own KV layout of both."""
from __future__ import annotations

import json

from bench_scripts import load_script


def test_the_stand_in_has_the_sources_kv_bytes_per_token(ckpt_dir, tmp_path, capsys):
    from engine.model_config import load_model_config

    src = ckpt_dir("llama")
    out = tmp_path / "stand-in"
    assert load_script("kv_stand_in.py", "kv_stand_in").main([str(out), "--like", str(src), "--max-len", "4096"]) == 0
    a, b = load_model_config(src, "auto"), load_model_config(out, "auto")
    assert a.kv_widths == b.kv_widths and a.dtype == b.dtype and a.num_layers == b.num_layers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and cfg["intermediate_size"] == 64
    assert "KiB of KV per token" in capsys.readouterr().out


def test_a_source_it_cannot_copy_is_refused(ckpt_dir, tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        load_script("kv_stand_in.py", "kv_stand_in").main([str(tmp_path / "x"), "--like", str(ckpt_dir("qwen3"))])
    assert e.value.code == 2 and "a llama checkpoint is needed" in capsys.readouterr().err
