"""The order test files start in: the longest first (a pytest plugin, loaded by conftest.py).

`make test` runs two xdist workers with `--dist loadfile`: a file is a unit of work, and a worker
takes the next unit when it runs low. With xdist's own order (most tests first) a file of a few
slow tests could start last and keep one worker busy for minutes while the other sat idle.
Longest-first is the classic fix for that (a worker's tail is then at most one short file).

The durations are seconds per file from an earlier run, in tests/file_durations.json. Refresh it
with `KVTIER_FILE_TIMES_OUT=tests/file_durations.json make test`: the controller process sums
each file's setup, call and teardown times and writes them when the session ends. A file the
JSON does not know yet starts first, so a new slow file never lands in the tail unnoticed.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / "file_durations.json"
OUT_ENV = "KVTIER_FILE_TIMES_OUT"


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known_durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ValueError(f"{DURATIONS}: expected a JSON object of file -> seconds")
    return {str(k): float(v) for k, v in data.items()}


def order_longest_first(nodeids: list[str], durations: dict[str, float]) -> list[int]:
    """Indices of `nodeids` with whole files moved, longest file first; unknown files lead;
    the order of files with equal times, and of tests within a file, is kept."""
    first_seen: dict[str, int] = {}
    for nid in nodeids:
        first_seen.setdefault(_file_of(nid), len(first_seen))
    rank = sorted(first_seen, key=lambda f: (-durations.get(f, float("inf")), first_seen[f]))
    position = {f: i for i, f in enumerate(rank)}
    return sorted(range(len(nodeids)), key=lambda i: (position[_file_of(nodeids[i])], i))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    order = order_longest_first([it.nodeid for it in items], _known_durations())
    items[:] = [items[i] for i in order]


class _Recorder:
    """Sums report durations per file on the process that sees every report (the controller)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[_file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session):
        ordered = dict(sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda kv: -kv[1]))
        self.out.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config):
    out = os.environ.get(OUT_ENV)
    if out and not hasattr(config, "workerinput"):  # xdist workers report to the controller
        config.pluginmanager.register(_Recorder(Path(out)), "kvtier-file-times")
