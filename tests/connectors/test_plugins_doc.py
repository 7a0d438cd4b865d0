"""docs/PLUGINS.md's Python blocks run, in order, as one module: the backend it writes passes the
conformance kit, is selected as a tier, and serves a prefix to a new engine (issue 13)."""
from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "PLUGINS.md"
MODULE = "kvtier_plugins_doc_example"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_plugin_guide_examples_run(ckpt_dir, tmp_path, monkeypatch):
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 4, "the guide lost its examples"
    mod = types.ModuleType(MODULE)
    mod.__dict__.update(MODEL=str(ckpt_dir("qwen3")))
    monkeypatch.setitem(sys.modules, MODULE, mod)  # so that "module:Class" finds the guide's backend
    for block in blocks:
        exec(compile(block, f"{DOC.name}", "exec"), mod.__dict__)
    # The guide's kit subclass, run here: every check passes on the guide's backend.
    kit = mod.TestDictBackend()
    names = [n for n, _ in inspect.getmembers(kit, inspect.ismethod) if n.startswith("test_")]
    assert len(names) >= 15
    for i, name in enumerate(names):
        backend = kit.make_backend(tmp_path / f"kit{i}")
        try:
            getattr(kit, name)(backend)
        finally:
            backend.close()
