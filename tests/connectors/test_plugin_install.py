"""The out-of-tree example backend, pip-installed into this venv, is found by entry-point
name and by module path, and passes the conformance kit (acceptance 6)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from connectors.conformance import BackendConformance
from connectors.registry import available_backends, load_backend

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvtier-example-backend"
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    # Build from a copy: pip builds in the source tree, which would leave build/ and *.egg-info there.
    src = tmp_path_factory.mktemp("example") / "kvtier-example-backend"
    shutil.copytree(EXAMPLE, src)
    r = subprocess.run([*PIP, "install", "--no-deps", "--no-build-isolation", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, f"pip install failed:\n{r.stdout}\n{r.stderr}"
    importlib.invalidate_caches()
    yield src
    subprocess.run([*PIP, "uninstall", "-y", "kvtier-example-backend"], capture_output=True, check=False)
    sys.modules.pop("kvtier_example_backend", None)
    importlib.invalidate_caches()


def test_found_by_entry_point_and_module_path(installed_example, tmp_path: Path) -> None:
    assert "example-dir" in available_backends()
    by_name = load_backend("example-dir", root=tmp_path / "a")
    by_path = load_backend("kvtier_example_backend:DirBackend", root=tmp_path / "b")
    assert type(by_name) is type(by_path) and type(by_name).__name__ == "DirBackend"
    key = bytes(range(16))
    assert by_name.put([key], [b"block"]) == [True] and by_name.get([key]) == [b"block"]
    assert by_path.get([key]) == [None]


@pytest.mark.slow  # a second pytest process (~3-4 s); the class below runs the same kit in-process
def test_packages_own_conformance_tests_pass(installed_example: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=installed_example, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


@pytest.mark.usefixtures("installed_example")
class TestInstalledExampleBackend(BackendConformance):
    """The kit run here, on the backend as kvtier loads it: by its entry-point name."""

    def make_backend(self, tmp_path):
        return load_backend("example-dir", root=tmp_path / "store")
