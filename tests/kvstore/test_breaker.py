"""G4's circuit breaker (kvstore/remote.py) on a fake clock: states, doubling pauses, next probe."""
from __future__ import annotations

from kvstore.remote import BreakerState, CircuitBreaker


def test_pauses_double_per_failed_probe_and_reset_on_success():
    now = [100.0]
    b = CircuitBreaker(2.0, 5.0, "G4 test", clock=lambda: now[0])
    assert b.allow() and b.next_probe_in() == 0.0
    b.failure(TimeoutError("t"))
    assert b.state is BreakerState.OPEN and not b.allow() and b.next_probe_in() == 2.0
    now[0] += 2.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure(TimeoutError("t"))
    assert b.next_probe_in() == 4.0  # doubled
    now[0] += 4.0
    assert b.allow()
    b.failure(TimeoutError("t"))
    assert b.next_probe_in() == 5.0  # capped at max_cooldown_s
    now[0] += 5.0
    assert b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED and b.next_probe_in() == 0.0 and b.opens == 1
