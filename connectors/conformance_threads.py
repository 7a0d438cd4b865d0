"""The conformance kit's concurrency checks: transfer threads call a backend at once."""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections.abc import Callable

from connectors.backend import StorageBackend
from connectors.conformance_base import KitBase, _what_is_wrong, key_of, value_of
from kvstore.keys import BlockKey


class ConcurrencyChecks(KitBase):
    # ---- concurrency -----------------------------------------------------------------

    def _run_threads(self, work: Callable[[int, threading.Barrier], None]) -> list[str]:
        errors: list[str] = []
        barrier = threading.Barrier(self.threads)

        def run(tid: int) -> None:
            try:
                work(tid, barrier)
            except AssertionError as e:
                errors.append(f"thread {tid}: {e}")
            except Exception:
                errors.append(f"thread {tid} raised:\n{traceback.format_exc(limit=6)}")

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # switch threads often, so races show up under the GIL
        try:
            workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(self.threads)]
            for w in workers:
                w.start()
            deadline = time.monotonic() + self.concurrency_timeout_s
            for w in workers:
                w.join(max(0.0, deadline - time.monotonic()))
        finally:
            sys.setswitchinterval(old)
        stuck = sum(w.is_alive() for w in workers)
        assert not stuck, (
            f"backend hung under concurrent use (deadlock?): {stuck} of {self.threads} threads "
            f"still running after {self.concurrency_timeout_s:.0f} s"
        )
        return errors

    def test_concurrent_mixed_ops(self, backend: StorageBackend) -> None:
        keys = [key_of(f"concurrent/{i}") for i in range(24)]
        # Every version of a key has its own length, so a get_into of that length identifies it.
        versions = {k: [value_of(k, v, 200 + 3000 * v + i) for v in range(6)] for i, k in enumerate(keys)}
        allowed = {k: set(vs) for k, vs in versions.items()}
        everything = {v: k for k, vs in versions.items() for v in vs}

        def judge(key: BlockKey, got: bytes, op: str) -> str | None:
            if type(got) is bytes and got in allowed[key]:
                return None
            if type(got) is not bytes:
                return f"{op} returned a {type(got).__name__}, not bytes"
            if got in everything:
                return f"{op} returned another key's value (wrong bytes) under concurrent use"
            return f"{op} returned {len(got)} bytes that no put ever stored for this key (torn or wrong bytes)"

        def work(tid: int, barrier: threading.Barrier) -> None:
            rng = random.Random(tid)
            barrier.wait()
            for _ in range(self.ops_per_thread):
                k = rng.choice(keys)
                r = rng.random()
                if r < 0.4:
                    res = backend.put([k], [rng.choice(versions[k])])
                    assert isinstance(res, list) and len(res) == 1 and isinstance(res[0], bool), f"put returned {res!r}"
                elif r < 0.75:
                    got = backend.get([k])[0]
                    problem = None if got is None else judge(k, got, "get")
                    assert problem is None, problem
                elif r < 0.85:
                    backend.delete([k])
                elif r < 0.93:
                    want = rng.choice(versions[k])
                    buf = bytearray(len(want))
                    if backend.get_into([k], [buf]) == [True]:
                        assert bytes(buf) == want, ("get_into returned True with bytes that no put ever stored for "
                                                    "this key (torn or wrong bytes) under concurrent use")
                else:
                    res = backend.exists([k])
                    assert res in ([True], [False]), f"exists returned {res!r}"

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent put/get/delete; first: {errors[0]}"
        for k in keys:  # quiescent again: an ordinary put/get must still work for every key
            final = versions[k][-1]
            self._put_ok(backend, [k], [final], "a block after the concurrent phase")
            self._expect(backend, k, final, "a key after the concurrent phase", earlier=tuple(versions[k][:-1]))

    def test_concurrent_gets_return_their_own_key(self, backend: StorageBackend) -> None:
        """Transfer threads read different keys at once: each read must return its own key's
        bytes (a shared read buffer, a connection used by two threads at once, ... return
        another read's bytes)."""
        keys = [key_of(f"concurrent-get/{i}") for i in range(self.threads)]
        values = [value_of(k, 0, 64 * 1024 + i) for i, k in enumerate(keys)]
        self._put_ok(backend, keys, values, "blocks")
        everything = dict(zip(values, range(len(values))))

        def work(tid: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for _ in range(20):
                got = backend.get([keys[tid]])[0]
                if got == values[tid]:
                    continue
                if got in everything:
                    raise AssertionError(f"concurrent get returned key {everything[got]}'s value for key {tid} "
                                         "(another key's value): is a read buffer or connection shared between threads?")
                raise AssertionError(f"concurrent get of key {tid} {_what_is_wrong(got, values[tid])} while other "
                                     "threads read other keys: is a read buffer or connection shared between threads?")

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent gets of different keys; first: {errors[0]}"

    def test_concurrent_puts_not_lost(self, backend: StorageBackend) -> None:
        per_thread = 40
        keys = [[key_of(f"disjoint/{t}/{i}") for i in range(per_thread)] for t in range(self.threads)]

        def work(tid: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for i, k in enumerate(keys[tid]):
                assert backend.put([k], [value_of(k, 0, 512 + i)]) == [True], (
                    "put refused a small block under concurrent puts of other keys"
                )

        errors = self._run_threads(work)
        assert not errors, f"{len(errors)} errors under concurrent puts; first: {errors[0]}"
        flat = [k for ks in keys for k in ks]
        got = backend.get(flat)
        lost = [i for i, g in enumerate(got) if g is None]
        assert not lost, (
            f"{len(lost)} of {len(flat)} blocks stored concurrently (put returned True) were lost "
            "without reporting: is the backend thread-safe?"
        )
        for t, ks in enumerate(keys):
            for i, k in enumerate(ks):
                problem = _what_is_wrong(got[t * per_thread + i], value_of(k, 0, 512 + i))
                assert problem is None, f"get after concurrent puts {problem}"
