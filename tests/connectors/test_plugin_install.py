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


def test_installed_backend_is_selected_as_a_tier_by_name(installed_example, ckpt_dir, tmp_path: Path) -> None:
    """Issue 13: the entry-point name in `kv_connector_extra_config["tiers"]`; a second engine on
    the same store (G1 and G2 empty) gets its prefix from the plugin, with offload-off outputs."""
    from offload_helpers import KIND, hit_tokens, offload_llm, reference, run, tokens, workload

    model, prompts = ckpt_dir(KIND), workload()
    tc = {"kv_connector": "TieredOffloadConnector",
          "kv_connector_extra_config": {"tiers": [{"backend": "example-dir", "root": str(tmp_path / "kv")}]}}
    for attempt in range(2):
        llm = offload_llm(model, kv_transfer_config=tc)
        try:
            outs = run(llm, prompts)
            assert tokens(outs) == reference(model, prompts)
            got = [o.cached_tokens_by_tier.get("G3", 0) for o in outs]
            assert got == ([0] * len(prompts) if attempt == 0 else [hit_tokens(len(p)) for p in prompts])
            assert llm.get_stats().tiers["G3"]["backend"] == "example-dir"
        finally:
            llm.close()
