"""Cost-aware proposal lengths (engine/spec_budget.py) against a simulated engine: a forward that
costs c0 + c1 * tokens and proposals accepted with known per-position probabilities."""
from __future__ import annotations

import random

import pytest

from engine.spec_budget import EXPLORE_EVERY, SpecBudget


def _feed_steps(b: SpecBudget, c0: float, c1: float, batch: int, rng: random.Random, steps: int = 200) -> None:
    for _ in range(steps):
        tokens = batch + rng.randrange(0, 3 * batch + 1)  # some requests carried proposals
        b.observe_step(tokens, c0 + c1 * tokens)


def _feed_verifies(b: SpecBudget, accept: list[float], rng: random.Random, n: int = 300) -> None:
    for _ in range(n):
        accepted = 0
        while accepted < len(accept) and rng.random() < accept[accepted]:
            accepted += 1
        b.observe_verify(len(accept), accepted)


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
# position is proposed while its chance of acceptance exceeds COST_MARGIN (1.5) times that.
@pytest.mark.parametrize("accept, c1, batch, expect", [
    ([0.95, 0.95, 0.95], 0.001, 1, 3),  # weight-bound: propose everything
    ([0.97, 0.97, 0.5], 0.001, 16, 2),  # P_2 = 0.94 > 0.8 > P_3 = 0.47
    ([0.6, 0.6, 0.6], 0.001, 16, 0),  # accepted more often than not, still not worth a token here
    ([0.5, 0.5, 0.1], 0.001, 1, 2),  # ... but at batch 1 the extra tokens are nearly free
])
def test_lengths_follow_acceptance_and_cost(accept, c1, batch, expect):
    rng = random.Random(1)
    b = SpecBudget(3)
    _feed_steps(b, 0.014, c1, batch, rng)
    _feed_verifies(b, accept, rng)
    got = [b.lengths([3] * batch) for _ in range(EXPLORE_EVERY - 1)]  # no exploring step among them
    assert all(g == [expect] * batch for g in got), got
    assert all(n <= 2 for n in b.lengths([2] * batch))  # never past a request's limit


def test_a_gated_batch_still_explores_one_request():
    rng = random.Random(2)
    b = SpecBudget(3)
    _feed_steps(b, 0.014, 0.001, 16, rng)
    _feed_verifies(b, [0.1, 0.1, 0.1], rng)
    runs = [b.lengths([3] * 16) for _ in range(4 * EXPLORE_EVERY)]
    explored = [r for r in runs if any(r)]
    assert len(explored) == 4 and all(sorted(r) == [0] * 15 + [3] for r in explored)
    # ... and a text that turns repetitive is noticed
    _feed_verifies(b, [1.0, 1.0, 1.0], rng, n=200)
    assert b.lengths([3] * 16) == [3] * 16
