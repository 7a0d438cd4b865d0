"""Cost-aware proposal lengths (engine/spec/budget.py) against a simulated engine: a forward that
costs c0 + c1 * tokens and proposals accepted with known per-position probabilities."""
from __future__ import annotations

import random

import pytest

from engine.spec.budget import COST_MARGIN, EXPLORE_EVERY, SpecBudget


def _feed_steps(b: SpecBudget, c0: float, c1: float, batch: int, rng: random.Random, steps: int = 200) -> None:
    for _ in range(steps):
        tokens = batch + rng.randrange(0, 3 * batch + 1)  # some requests carried proposals
        b.observe_step(tokens, c0 + c1 * tokens)


def _ids(batch: int) -> list[str]:
    return [f"r{i}" for i in range(batch)]


def _feed_verifies(b: SpecBudget, accept: list[float], rng: random.Random, n: int = 300,
                   ids: list[str] | None = None) -> None:
    ids = ids or _ids(16)
    for j in range(n):
        accepted = 0
        while accepted < len(accept) and rng.random() < accept[accepted]:
            accepted += 1
        b.observe_verify(ids[j % len(ids)], len(accept), accepted)


def test_cost_per_token_recovers_the_linear_cost_model():
    rng = random.Random(0)
    b = SpecBudget(3)
    assert b.cost_per_token(16) == 0.0  # nothing measured: proposals are free until shown otherwise
    _feed_steps(b, 0.014, 0.001, 16, rng)
    assert b.cost_per_token(16) == pytest.approx(0.016 / 0.030, rel=1e-6)
    assert b.cost_per_token(1) == pytest.approx(0.001 / 0.015, rel=1e-6)


def test_steps_of_one_size_give_no_slope():
    b = SpecBudget(3)
    for _ in range(50):
        b.observe_step(16, 0.03)
    assert b.cost_per_token(16) == 0.0


# Fitted cost per token: 0.016 / 0.030 = 0.53 at batch 16, 0.001 / 0.015 = 0.067 at batch 1; a
# position is proposed while its chance of acceptance exceeds COST_MARGIN (1.2: 0.64 at batch 16)
# times that. Each request's own rate is estimated from few verifications, so the cases keep clear
# of the threshold.
@pytest.mark.parametrize("accept, c1, batch, expect", [
    ([0.95, 0.95, 0.95], 0.001, 1, 3),  # weight-bound: propose everything
    ([0.97, 0.97, 0.3], 0.001, 16, 2),  # P_2 = 0.94 > 0.64 > P_3 = 0.28
    ([0.35, 0.35, 0.35], 0.001, 16, 0),  # not worth a token at batch 16
    ([0.5, 0.5, 0.1], 0.001, 1, 2),  # ... but at batch 1 the extra tokens are nearly free
])
def test_lengths_follow_acceptance_and_cost(accept, c1, batch, expect):
    assert COST_MARGIN == 1.2  # the cases above are placed around its threshold
    rng = random.Random(1)
    b = SpecBudget(3)
    _feed_steps(b, 0.014, c1, batch, rng)
    _feed_verifies(b, accept, rng, ids=_ids(batch))
    got = [b.lengths(_ids(batch), [3] * batch) for _ in range(EXPLORE_EVERY - 1)]  # no exploring step among them
    assert all(g == [expect] * batch for g in got), got
    assert all(n <= 2 for n in b.lengths(_ids(batch), [2] * batch))  # never past a request's limit


def test_a_gated_batch_still_explores_one_request():
    rng = random.Random(2)
    b = SpecBudget(3)
    _feed_steps(b, 0.014, 0.001, 16, rng)
    _feed_verifies(b, [0.1, 0.1, 0.1], rng)
    runs = [b.lengths(_ids(16), [3] * 16) for _ in range(4 * EXPLORE_EVERY)]
    explored = [r for r in runs if any(r)]
    assert len(explored) == 4 and all(sorted(r) == [0] * 15 + [3] for r in explored)
    # ... and a text that turns repetitive is noticed
    _feed_verifies(b, [1.0, 1.0, 1.0], rng, n=200)
    assert b.lengths(_ids(16), [3] * 16) == [3] * 16


def test_each_request_gets_the_lengths_its_own_acceptance_earns():
    """In one batch, a request that keeps copying its prompt proposes and one whose proposals
    fail does not; a request with no history yet follows the engine-wide rate."""
    rng = random.Random(3)
    b = SpecBudget(3)
    _feed_steps(b, 0.014, 0.001, 16, rng)
    for _ in range(40):
        _feed_verifies(b, [0.97, 0.97, 0.97], rng, n=1, ids=["copying"])
        _feed_verifies(b, [0.1, 0.1, 0.1], rng, n=1, ids=["prose"])
    got = b.lengths(["copying", "prose"] + _ids(14), [3] * 16)
    assert got[0] == 3 and got[1] == 0, got
    # the engine-wide rate is the two requests' mix (~0.5 at position 0): not worth a token at batch 16
    assert got[2:] == [0] * 14, got
    b.release("copying")
    assert b.lengths(["copying"] + _ids(15), [3] * 16)[0] == 0  # forgotten: back to the engine-wide rate
