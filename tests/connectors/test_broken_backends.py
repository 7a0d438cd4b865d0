"""The conformance kit fails deliberately broken backends, with messages that say what is wrong."""

from __future__ import annotations

import re

import pytest

import broken_backends as bb
from connectors.conformance import BackendConformance

pytest_plugins = ["pytester"]

KIT_TESTS = sorted(n for n in dir(BackendConformance) if n.startswith("test_"))

# (backend, kit test that must fail, regex its message must match)
CASES = [
    (bb.StaleBackend, "test_overwrite_latest_wins", r"stale value"),
    (bb.WrongBytesBackend, "test_round_trip_sizes", r"65537-byte block returned wrong bytes.*offset 32768"),
    (bb.LossyBackend, "test_many_keys_not_lost", r"data lost without reporting"),
    (bb.RacyBackend, "test_concurrent_puts_not_lost", r"lost without reporting: is the backend thread-safe"),
    (bb.TornBackend, "test_concurrent_mixed_ops", r"no put ever stored for this key \(torn or wrong bytes\)"),
    (bb.AliasingBackend, "test_put_accepts_buffers_and_copies_them", r"kept a reference to the caller's buffer"),
    (bb.TrustingBackend, "test_bad_keys_rejected", r"with a key .* must raise TypeError or ValueError"),
    (bb.NoCloseBackend, "test_close", r"get after close must raise BackendError"),
    (bb.ReversedScatterBackend, "test_scatter_reads", r"Scatter pieces hold wrong bytes"),
]


def run_kit_test(backend_cls: type, name: str) -> None:
    getattr(BackendConformance(), name)(backend_cls())


@pytest.mark.parametrize("name", KIT_TESTS)
def test_reference_dict_backend_passes(name: str) -> None:
    # The broken backends are this one plus one defect each, so each failure below is that defect.
    run_kit_test(bb.DictBackend, name)


@pytest.mark.parametrize(("backend_cls", "name", "message"), CASES, ids=[c[0].__name__ for c in CASES])
def test_kit_names_the_defect(backend_cls: type, name: str, message: str) -> None:
    with pytest.raises(AssertionError) as info:
        run_kit_test(backend_cls, name)
    assert re.search(message, str(info.value)), f"unclear failure message: {info.value}"


def test_kit_run_by_pytest_reports_failures(pytester: pytest.Pytester) -> None:
    """What a plugin author sees: pytest on their file fails, and the report says why."""
    pytester.makepyfile(
        test_plugin="""
        import broken_backends as bb
        from connectors.conformance import BackendConformance

        class TestStale(BackendConformance):
            def make_backend(self, tmp_path):
                return bb.StaleBackend()

        class TestRacy(BackendConformance):
            def make_backend(self, tmp_path):
                return bb.RacyBackend()
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 3, result.stdout.str()
    out = result.stdout.str()
    assert "FAILED test_plugin.py::TestStale::test_overwrite_latest_wins" in out, out
    assert "FAILED test_plugin.py::TestRacy::test_concurrent_puts_not_lost" in out, out
    result.stdout.fnmatch_lines(["E*AssertionError: get of a key after overwrite #1 returned a stale value*"])
    result.stdout.fnmatch_lines(["E*AssertionError: * lost without reporting: is the backend thread-safe?"])
