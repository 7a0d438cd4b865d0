"""benchmarks/admission.py's replay, on traces small enough to follow by hand: what each G3 rule
writes and which prefix blocks then hit (issue 43, point 4). The session rules (turn:K[@Q] and the
`continues` bound) are the evidence that on the generated multi-turn trace no rule reaches the
target, so they must count exactly what they claim to."""

from __future__ import annotations

import pytest
from bench_scripts import load_script

adm = load_script("admission.py", "bench_admission")

# Session 0 has two turns (the second extends the first's prompt), session 1 one turn.
TRACE = [[1, 2], [1, 2, 3], [7, 8]]
SESSIONS = [{"session": 0, "turn": 0}, {"session": 0, "turn": 1}, {"session": 1, "turn": 0}]


def run(rule: str) -> tuple[int, int]:
    r = adm.replay(TRACE, 1, 100, rule, SESSIONS)  # the upper tier holds one block: G3 serves the hits
    return r["hit_blocks"], r["g3_writes"]


def test_always_writes_every_computed_block() -> None:
    assert run("always") == (2, 5)


def test_continues_writes_only_the_turns_a_session_goes_on_from() -> None:
    assert run("continues") == (2, 2)  # 1 and 2 (turn 0 of session 0); 3, 7, 8 end their sessions


def test_turn_rule_skips_first_turns_and_loses_their_hits() -> None:
    assert run("turn:2") == (0, 3)  # turn 0 unwritten: turn 1 recomputes 1, 2 and writes 1, 2, 3
    assert run("turn:1") == run("always")
    assert run("turn:2@1") == run("always")  # Q = 1: every session's first turn too


def test_the_share_of_first_turns_written_follows_q() -> None:
    trace = [[10 * s + j for j in range(4)] for s in range(400)]
    sessions = [{"session": s, "turn": 0} for s in range(400)]
    writes = adm.replay(trace, 1, 10**6, "turn:2@0.25", sessions)["g3_writes"]
    assert 0.18 * 1600 < writes < 0.32 * 1600


@pytest.mark.parametrize("rule", ["turn:2", "continues"])
def test_session_rules_need_sessions(rule: str) -> None:
    with pytest.raises(ValueError, match="session"):
        adm.replay(TRACE, 1, 100, rule, None)


@pytest.mark.parametrize("rule", ["uses:0", "uses:2@0.5", "turn:x", "turn:2@1.5", "sometimes"])
def test_bad_rules_are_refused(rule: str) -> None:
    with pytest.raises(ValueError, match="Q must|is not"):
        adm.parse_rule(rule)
