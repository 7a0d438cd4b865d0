"""The packages' one-way dependency order (docs/STRUCTURE.md), read from every module's imports:
plugins <- policies <- kvstore <- kvtools, connectors <- engine <- server. Imports inside
functions count too: a lazy import is still a dependency."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ORDER = ["plugins", "policies", "kvstore", "connectors", "engine", "server"]
# What each package may import from this repository.
ALLOWED = {p: set(ORDER[:i + 1]) for i, p in enumerate(ORDER)}
ALLOWED["kvtools"] = {"plugins", "policies", "kvstore", "kvtools"}
ALLOWED["server"] |= {"kvtools"}
OURS = set(ALLOWED)


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package of this repository, line) for each import in `path`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {(n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in OURS}
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    wrong = [f"{f.relative_to(REPO)}:{line} imports {dep}"
             for f in sorted((REPO / package).rglob("*.py"))
             for dep, line in sorted(imported_packages(f)) if dep not in ALLOWED[package]]
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(wrong)


def test_the_order_is_the_documented_one():
    doc = (REPO / "docs" / "STRUCTURE.md").read_text()
    assert " ← ".join(f"`{p}`" for p in ORDER) in doc


def test_no_python_at_the_repository_root():
    assert not sorted(p.name for p in REPO.glob("*.py"))
