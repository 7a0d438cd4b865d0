"""Acceptance 7 (issue 3): loads do not stall other requests.

The engine is driven step by step. Two requests are decoding when a third arrives whose
prefix sits in a deliberately slowed G3 (each block read sleeps SLOW_S first). While the
third is in WAITING_FOR_REMOTE_KVS, every engine step still gives both decoding requests a
token, no step waits for the load, and the loaded request's tokens equal offload off.

Also here: several loads that land together and over-commit G1 (a scheduling bug, see the
xfail reason).
"""

from __future__ import annotations

import threading
import time

import pytest

from checkpoints import random_prompt
from engine.core.request import RequestStatus
from offload_helpers import (
    OB,
    check_integrity,
    deadline,
    greedy,
    hit_tokens,
    offload_llm,
    reads_through_get_into,
    reference,
    run,
)

LONG = random_prompt(641, 7401)  # 10 offload blocks in G3
SLOW_S = 0.1  # per block read: the load takes >= 1 s
WAITING = RequestStatus.WAITING_FOR_REMOTE_KVS


def test_slow_g3_load_does_not_stall_running_requests(model_dir, tmp_path):
    (ref,) = reference(model_dir, [LONG])
    disk = tmp_path / "g3"
    a = offload_llm(model_dir, kv_offload_disk=str(disk))
    run(a, [LONG])
    a.close()

    # One read at a time, so that the load's length is known: reads x SLOW_S.
    one_reader = {"kv_connector_extra_config": {"g3_read_threads": 1}}
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), num_gpu_blocks=300, kv_transfer_config=one_reader)
    eng = llm.engine
    try:
        runners = [eng.make_request(f"run{i}", random_prompt(20, 7410 + i), greedy(1800)) for i in range(2)]
        for r in runners:
            eng.add_request(r)
        while not all(r.output_token_ids for r in runners):
            eng.step()
        assert all(r.status is RequestStatus.RUNNING for r in runners)

        g3 = eng.connector.tier("G3").backend
        real_get_into, reads = g3.get_into, []

        def slow_get_into(keys, outs):
            reads.extend([time.perf_counter()] * len(keys))
            time.sleep(SLOW_S * len(keys))
            return real_get_into(keys, outs)

        g3.get_into = slow_get_into
        reads_through_get_into(g3)
        loader = eng.make_request("loader", LONG, greedy())
        eng.add_request(loader)
        steps = []  # (loader status before, after, ids that got a token, step start, step end)
        with deadline(60, "the step loop"):
            while not loader.status.finished:
                before = loader.status
                t0 = time.perf_counter()
                got = eng.step()
                steps.append((before, loader.status, {r.request_id for r in got}, t0, time.perf_counter()))
                time.sleep(0.002)  # pacing, so that on any machine the runners outlast the load
                assert not any(r.status.finished for r in runners), "runners finished before the load: raise max_tokens"
        for r in runners:
            eng.abort_request(r.request_id)
        eng.step()  # let the aborts settle

        assert len(reads) == hit_tokens(len(LONG)) // OB  # every block came through the slow path
        loading = [s for s in steps if s[0] is WAITING and s[1] is WAITING]
        assert len(loading) >= 10, f"only {len(loading)} steps saw the request loading"
        load_span = loading[-1][4] - loading[0][3]
        assert load_span >= 0.8 * len(reads) * SLOW_S, "the load did not overlap engine steps"
        starved = [i for i, s in enumerate(loading) if not {"run0", "run1"} <= s[2]]
        assert not starved, f"{len(starved)} of {len(loading)} loading steps gave a running request no token"
        longest = max(s[4] - s[3] for s in loading)
        assert longest < len(reads) * SLOW_S / 2, f"a step took {longest:.2f} s: it waited for the load"

        assert loader.output_token_ids == ref
        assert loader.cached_by_tier == {"G3": hit_tokens(len(LONG))}
        assert loader.status is RequestStatus.FINISHED_LENGTH
        eng.connector.flush()
        check_integrity(llm)
    finally:
        llm.close()


# ------------------------------------------------------------------------- loads landing together
SMALL, BIG = random_prompt(300, 7420), random_prompt(520, 7421)  # 16 and 32 G1 blocks to load
DEADLOCK = (
    "BUG (deadlock): requests whose async loads have landed wait in the queue holding their G1 "
    "blocks; Scheduler.schedule's admission loop (engine/core/scheduler.py) stops at the first waiting "
    "request that cannot allocate the rest of its prompt (`if not self.kv.allocate_slots(req, n, "
    "hits): break`), and preemption only considers running requests. With 50 G1 blocks, loads of "
    "16 + 32 blocks land in the same poll; Scheduler.finish_load re-queues each at the FRONT in the "
    "iteration order of the `received` set (connectors/tiered.py get_finished, a set of request-id "
    "strings: the order depends on PYTHONHASHSEED); if the 300-token request ends up first it needs "
    "3 more blocks, 2 are free, nothing runs, and EngineCore.step raises 'scheduler made no progress "
    "with requests pending' (LLM.generate fails). Also reproduced with plain LLM.generate on the G2 "
    "path (same prompts and G1 size, second pass after a flush) under 6 of 8 PYTHONHASHSEED values. Fix: at async-load admission allocate the whole prompt's blocks, or "
    "let a loaded waiting request that cannot proceed give its blocks back (they stay prefix-cached) "
    "or skip it instead of breaking.")


def _ids_with_front(front: str) -> tuple[str, str]:
    """Request ids (small, big) such that the set of landed loads, built as get_finished
    builds it (SMALL is admitted first, so its load lands first), iterates with `front`
    last: finish_load re-queues it last, at the front of the waiting queue."""
    for i in range(1000):
        ids = {"small": f"small{i}", "big": f"big{i}"}
        received = set()
        received.add(ids["small"])
        received.add(ids["big"])
        if list(received)[-1] == ids[front]:
            return ids["small"], ids["big"]
    raise AssertionError("no id pair found")


@pytest.mark.parametrize("front", [
    "big",
    "small",
])
def test_loads_landing_together_on_a_full_g1_complete(model_dir, tmp_path, front):
    ref = reference(model_dir, [SMALL, BIG])
    disk = tmp_path / "g3"
    a = offload_llm(model_dir, kv_offload_disk=str(disk))
    run(a, [SMALL, BIG])
    a.close()

    llm = offload_llm(model_dir, kv_offload_disk=str(disk), num_gpu_blocks=50)
    eng = llm.engine
    try:
        small_id, big_id = _ids_with_front(front)
        reqs = [eng.make_request(small_id, SMALL, greedy()), eng.make_request(big_id, BIG, greedy())]
        for r in reqs:
            eng.add_request(r)
        eng.step()  # admission allocates whole prompts (19 + 33 blocks): one loads, one queues for G1
        assert any(r.status is WAITING for r in reqs)
        eng.connector.flush()  # both loads land before the next poll
        with deadline(30, "the step loop"):
            for _ in range(10_000):
                if all(r.status.finished for r in reqs):
                    break
                eng.step()
        assert [r.output_token_ids for r in reqs] == ref
        assert [r.cached_by_tier for r in reqs] == [{"G3": hit_tokens(len(SMALL))}, {"G3": hit_tokens(len(BIG))}]
        check_integrity(llm)
    finally:
        llm.close()


def test_idle_engine_sleeps_while_a_load_is_in_flight(model_dir, tmp_path):
    """With nothing to run but a load, step() waits on the connector's completion signal. It
    used to poll every 0.5 ms, which took a core from the copy (2-core machines lost ~half
    the G2 load bandwidth). A load of 10 blocks slowed to >= 1 s must take few steps."""
    disk = tmp_path / "g3"
    a = offload_llm(model_dir, kv_offload_disk=str(disk))
    run(a, [LONG])
    a.close()
    one_reader = {"kv_connector_extra_config": {"g3_read_threads": 1}}
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), kv_transfer_config=one_reader)
    eng = llm.engine
    try:
        g3 = eng.connector.tier("G3").backend
        real_get_into = g3.get_into

        def slow_get_into(keys, outs):
            time.sleep(SLOW_S * len(keys))
            return real_get_into(keys, outs)

        g3.get_into = slow_get_into
        reads_through_get_into(g3)
        loader = eng.make_request("loader", LONG, greedy())
        eng.add_request(loader)
        idle_steps, t0 = 0, time.perf_counter()
        with deadline(60, "the load"):
            while loader.status is not RequestStatus.RUNNING and not loader.status.finished:
                if eng.step() == [] and loader.status is WAITING:
                    idle_steps += 1
        load_s = time.perf_counter() - t0
        assert load_s >= SLOW_S * (hit_tokens(len(LONG)) // OB)
        # Polling would be ~2000 steps per second; the signal wait is <= 20 per second.
        assert idle_steps <= load_s / eng.IDLE_WAIT_S + 5, (idle_steps, load_s)
    finally:
        llm.close()


def test_a_preempted_request_ahead_of_a_landed_load_does_not_block_it(model_dir, tmp_path):
    """A load lands (the loaded request waits at the queue's front, holding its whole prompt's
    blocks) in the step where the running request needs a block G1 no longer has: it preempts
    itself and goes to the front, ahead of the loaded one, and then needs one block more than is
    free. The loaded request must go first (it needs no block to start); stopping at the queue's
    head stalled the engine ('scheduler made no progress'). Seen first under tensor parallelism,
    whose loads land later than one rank's."""
    runner_prompt, loaded_prompt = random_prompt(40, 7430), random_prompt(257, 7431)  # 3 + 17 G1 blocks
    ref = reference(model_dir, [runner_prompt, loaded_prompt], max_tokens=16)
    disk = tmp_path / "g3"
    a = offload_llm(model_dir, kv_offload_disk=str(disk))
    run(a, [loaded_prompt])
    a.close()
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), num_gpu_blocks=20)
    eng = llm.engine
    try:
        g3 = eng.connector.tier("G3").backend
        real_get_into, gate = g3.get_into, threading.Event()

        def gated_get_into(keys, outs):
            gate.wait(30)
            return real_get_into(keys, outs)

        g3.get_into = gated_get_into
        reads_through_get_into(g3)
        runner = eng.make_request("runner", runner_prompt, greedy(16))
        eng.add_request(runner)
        eng.step()  # its prompt: 3 blocks
        loaded = eng.make_request("loaded", loaded_prompt, greedy(16))
        eng.add_request(loaded)
        with deadline(60, "the runner's decode"):
            while runner.num_computed_tokens < 48:  # its next token needs a 4th block; G1 has none free
                eng.step()
        assert loaded.status is WAITING and eng.kv.pool.num_free_blocks() == 0
        gate.set()
        eng.connector.flush()  # the load lands at the next step's poll
        eng.step()
        assert runner.status is RequestStatus.PREEMPTED  # ahead of the loaded request now
        with deadline(60, "the step loop"):
            while not (runner.status.finished and loaded.status.finished):
                eng.step()
        assert [runner.output_token_ids, loaded.output_token_ids] == ref
        assert loaded.cached_by_tier == {"G3": hit_tokens(len(loaded_prompt))}
        check_integrity(llm)
    finally:
        llm.close()
