"""tests/file_order.py: whole files move, longest first; unknown files lead; ties keep order."""

from __future__ import annotations

import random

from file_order import order_longest_first


def _reference(nodeids, durations):
    files = list(dict.fromkeys(n.split("::")[0] for n in nodeids))
    files.sort(key=lambda f: -durations.get(f, float("inf")))  # stable: ties keep first-seen order
    return [n for f in files for n in nodeids if n.split("::")[0] == f]


def test_matches_a_plain_reference_on_random_collections():
    rng = random.Random(0)
    for _ in range(200):
        files = [f"tests/t{i}.py" for i in range(rng.randint(1, 8))]
        nodeids = [f"{rng.choice(files)}::test_{j}" for j in range(rng.randint(1, 30))]
        durations = {f: float(rng.choice([1, 2, 2, 5, 9])) for f in files if rng.random() < 0.8}
        got = [nodeids[i] for i in order_longest_first(nodeids, durations)]
        assert got == _reference(nodeids, durations)


def test_a_slow_file_collected_last_runs_first():
    nodeids = ["tests/a.py::x", "tests/b.py::y", "tests/a.py::z", "tests/slow.py::s"]
    got = [nodeids[i] for i in order_longest_first(nodeids, {"tests/a.py": 3, "tests/b.py": 1, "tests/slow.py": 200})]
    assert got == ["tests/slow.py::s", "tests/a.py::x", "tests/a.py::z", "tests/b.py::y"]
