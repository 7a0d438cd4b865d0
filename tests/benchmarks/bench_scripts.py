"""Loading a script of benchmarks/ by path, for the tests of this folder: `benchmarks` is no
package, and tests/benchmarks would shadow the name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_script(file: str, name: str) -> Any:
    """benchmarks/`file` as a module called `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
