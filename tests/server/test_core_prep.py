"""server/core_prep.py: requests are prepared off the core's step loop, within a time budget
(issue 38). The oracle is a prepare function the test controls (an Event it blocks on), so
the queue's own behaviour is what is checked: ready when done, refused when late, refused at
once when the same constraint was late before, abort drops it."""
from __future__ import annotations

import threading
import time

import pytest

from engine.core.request_factory import Prepared
from engine.sampling_params import SamplingParams
from server.core_prep import PrepQueue


def _wait(q: PrepQueue, timeout: float = 5.0) -> list:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = q.ready()
        if out:
            return out
        time.sleep(0.01)
    raise AssertionError("nothing became ready")


def test_prepared_off_the_calling_thread_and_handed_back():
    seen: list[str] = []

    def prepare(p: SamplingParams) -> Prepared:
        seen.append(threading.current_thread().name)
        if p.bad_words == ["bad"]:
            raise ValueError("no good")
        return Prepared()

    q = PrepQueue(prepare, 5.0)
    try:
        assert q.submit("a", {"request_id": "a"}, SamplingParams(bad_words=["x"])) is None
        assert q.submit("a", {"request_id": "a"}, SamplingParams(bad_words=["x"])) is not None  # a duplicate id
        (add, params, result), = _wait(q)
        assert add["request_id"] == "a" and isinstance(result, Prepared) and params.bad_words == ["x"]
        assert seen and seen[0].startswith("kvtier-prep")
        q.submit("b", {"request_id": "b"}, SamplingParams(bad_words=["bad"]))
        (_, _, why), = _wait(q)
        assert why == "no good"
        assert len(q) == 0
    finally:
        q.close()


def test_a_late_preparation_is_refused_and_so_is_its_constraint_afterwards():
    release = threading.Event()
    q = PrepQueue(lambda p: (release.wait(), Prepared())[1], 0.2)
    try:
        slow = SamplingParams(structured_outputs={"regex": "[a-z]+"})
        t0 = time.monotonic()
        q.submit("a", {"request_id": "a"}, slow)
        (_, _, why), = _wait(q)
        assert 0.2 <= time.monotonic() - t0 < 2 and "did not compile within 0.2s" in why
        assert "compile_timeout_s" in why
        again = q.submit("b", {"request_id": "b"}, SamplingParams(structured_outputs={"regex": "[a-z]+"}))
        assert again is not None and "did not compile" in again  # refused at once
        assert q.submit("c", {"request_id": "c"}, SamplingParams(structured_outputs={"regex": "[0-9]+"})) is None
        release.set()
        (add, _, result), = _wait(q)
        assert add["request_id"] == "c" and isinstance(result, Prepared)
    finally:
        release.set()
        q.close()


def test_abort_drops_a_request_being_prepared():
    release = threading.Event()
    q = PrepQueue(lambda p: (release.wait(), Prepared())[1], 5.0)
    try:
        q.submit("a", {"request_id": "a"}, SamplingParams(bad_words=["x"]))
        assert q.abort("a") and not q.abort("a") and len(q) == 0
        release.set()
        time.sleep(0.1)
        assert q.ready() == []
    finally:
        release.set()
        q.close()


def test_an_unexpected_error_in_preparation_is_a_refusal_not_a_crash():
    def prepare(p: SamplingParams) -> Prepared:
        raise RuntimeError("xgrammar said no")

    q = PrepQueue(prepare, 5.0)
    try:
        q.submit("a", {"request_id": "a"}, SamplingParams(bad_words=["x"]))
        (_, _, why), = _wait(q)
        assert "RuntimeError: xgrammar said no" in why
    finally:
        q.close()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        PrepQueue(lambda p: Prepared(), 0)


def test_a_stuck_compile_does_not_hold_the_requests_behind_it():
    """The first preparation never returns in time; the second, queued behind it, still runs
    (a spare thread takes the queue) instead of timing out too."""
    release = threading.Event()

    def prepare(p: SamplingParams) -> Prepared:
        if p.structured_outputs is not None and p.structured_outputs.regex == "slow":
            release.wait()
        return Prepared()

    q = PrepQueue(prepare, 0.3)
    try:
        q.submit("slow", {"request_id": "slow"}, SamplingParams(structured_outputs={"regex": "slow"}))
        q.submit("next", {"request_id": "next"}, SamplingParams(structured_outputs={"regex": "[0-9]+"}))
        got: dict = {}
        end = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < end:
            got.update({a["request_id"]: r for a, _, r in q.ready()})
            time.sleep(0.01)
        assert isinstance(got["next"], Prepared), got
        assert "did not compile" in got["slow"]
    finally:
        release.set()
        q.close()


def test_a_preparation_past_its_budget_is_niced_and_its_thread_leaves():
    """Its compile runs on for nobody: at normal priority a few of them took the cores from the
    step loop. Niced to 19, its thread leaves the pool once done; a spare serves the queue."""
    import os

    release, threads = threading.Event(), []

    def prepare(p: SamplingParams) -> Prepared:
        threads.append(threading.current_thread())
        if p.bad_words == ["slow"]:
            release.wait()
        return Prepared()

    q = PrepQueue(prepare, 0.2)
    try:
        q.submit("a", {"request_id": "a"}, SamplingParams(bad_words=["slow"]))
        (_, _, why), = _wait(q)
        assert "took longer than 0.2s" in why
        slow = threads[0]
        assert os.getpriority(os.PRIO_PROCESS, slow.native_id) == 19
        q.submit("b", {"request_id": "b"}, SamplingParams(bad_words=["x"]))
        (add, _, result), = _wait(q)
        assert add["request_id"] == "b" and isinstance(result, Prepared)
        assert threads[1] is not slow and os.getpriority(os.PRIO_PROCESS, threads[1].native_id) == 0
        release.set()
        slow.join(5)
        assert not slow.is_alive()
    finally:
        release.set()
        q.close()
