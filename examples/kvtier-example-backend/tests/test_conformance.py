"""Run kvtier's conformance kit against DirBackend: this is the whole test file."""

from connectors.conformance import BackendConformance
from kvtier_example_backend import DirBackend


class TestDirBackend(BackendConformance):
    def make_backend(self, tmp_path):
        return DirBackend(tmp_path / "store")
