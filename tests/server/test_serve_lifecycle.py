"""Issue 5, acceptance 3 and 4: disconnects, engine-core crashes, SIGTERM, tenant isolation.

A client that goes away (mid-stream, or a non-streaming request whose client times out) aborts
its request and frees its G1 blocks; a killed engine core turns /health and new requests into
fast 503s and ends in-flight streams with an error event; SIGTERM drains in-flight requests,
aborts what is left at --shutdown-timeout (the stream still ends properly), flushes G3 writes
and exits 0; requests with different cache_salt never share prefix-cache hits.

The long requests run on a 64k-context variant of the tiny Llama (about 1k tokens/s here):
30000 tokens would take the better part of a minute, so a request that ends within seconds
was aborted, not finished."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import checkpoints
import httpx
import pytest
from kvtools.inspect_disk import inspect_dir
from serving import Server, start_server

LONG_ARGS = ("--served-model-name", "tiny", "--num-gpu-blocks", "4200")
LONG = {"model": "tiny", "prompt": "hello there", "max_tokens": 30000, "ignore_eos": True}


def kv_stats(srv: Server) -> dict:
    with srv.client(timeout=10) as c:
        r = c.get("/v1/kv/stats")
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(pred, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(interval)


def is_idle(st: dict) -> bool:
    return st["requests"]["running"] == 0 and st["requests"]["waiting"] == 0 and st["tiers"]["G1"]["usage"] == 0


class StreamReader(threading.Thread):
    """Reads one streaming request in the background: .events are the parsed `data:` payloads
    ("[DONE]" as is), .error what ended it otherwise, .first is set once a chunk arrived."""

    def __init__(self, srv: Server, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.srv, self.path, self.body = srv, path, {**body, "stream": True}
        self.status: int | None = None
        self.events: list = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.srv.url, timeout=60) as c:
                with c.stream("POST", self.path, json=self.body) as r:
                    self.status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                            self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def chunks(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "choices" in e]

    def finish_reasons(self) -> list[str]:
        return [ch["finish_reason"] for e in self.chunks() for ch in e["choices"] if ch.get("finish_reason")]


@pytest.fixture(scope="module")
def long_server(long_ckpt):
    srv = start_server(str(long_ckpt), *LONG_ARGS)
    yield srv
    srv.stop()


# -- disconnects ---------------------------------------------------------------------------------
def aborted(srv) -> float:
    """kvtier:request_success_total{finished_reason="abort"} from /metrics."""
    with srv.client() as c:
        text = c.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvtier:request_success_total{") and 'finished_reason="abort"' in line)


def test_stream_disconnect_aborts_and_frees_g1(long_server):
    assert wait_for(lambda: is_idle(kv_stats(long_server)), 10)
    before = kv_stats(long_server)["requests"]["generation_tokens"]
    aborts = aborted(long_server)
    with long_server.client(timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = (ln for ln in r.iter_lines() if ln)
            for _ in range(5):
                assert next(lines).startswith("data: {")
            busy = kv_stats(long_server)
            assert busy["requests"]["running"] == 1 and busy["tiers"]["G1"]["usage"] > 0, busy
        # the client hung up mid-stream
    t0 = time.monotonic()
    st = wait_for(lambda: s if is_idle(s := kv_stats(long_server)) else None, 5)
    assert st, f"request still holds G1 5s after the disconnect: {kv_stats(long_server)}"
    assert time.monotonic() - t0 < 5
    generated = st["requests"]["generation_tokens"] - before
    assert 5 <= generated < LONG["max_tokens"] // 2, generated  # stopped, far from done
    time.sleep(0.3)
    assert kv_stats(long_server)["requests"]["generation_tokens"] - before == generated  # and stays stopped
    assert aborted(long_server) == aborts + 1  # counted, with vLLM's finish reason
    steps = st["steps"]  # the engine's step timing reaches the stats endpoint
    assert 0 < steps["forward_seconds"] < steps["busy_seconds"] and 0 < steps["bubble_fraction"] < 1, steps


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {**{k: v for k, v in LONG.items() if k != "prompt"},
                              "messages": [{"role": "user", "content": "hello"}]}),
], ids=["completions", "chat"])
def test_non_streaming_client_timeout_aborts_and_frees_g1(long_server, path, body):
    assert wait_for(lambda: is_idle(kv_stats(long_server)), 10)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            with long_server.client(timeout=2.0) as c:
                c.post(path, json=body)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    assert wait_for(lambda: kv_stats(long_server)["requests"]["running"] == 1, 5), "the request never ran"
    th.join(10)
    assert outcome and isinstance(outcome[0], httpx.ReadTimeout), outcome
    t0 = time.monotonic()
    assert wait_for(lambda: is_idle(kv_stats(long_server)), 5), kv_stats(long_server)
    assert time.monotonic() - t0 < 5


# -- engine-core crash ---------------------------------------------------------------------------
def test_killed_core_fails_fast(long_ckpt):
    srv = start_server(str(long_ckpt), *LONG_ARGS)
    try:
        reader = StreamReader(srv, "/v1/completions", LONG)
        assert reader.first.wait(30) and reader.status == 200, (reader.status, reader.error)
        with srv.client(timeout=10) as c:
            assert c.get("/health").status_code == 200
            os.kill(srv.core_pid(), signal.SIGKILL)
            killed = time.monotonic()
            assert wait_for(lambda: c.get("/health").status_code == 503, 3), "/health still 200 3s after the kill"
            r = c.get("/health")
            assert r.json()["error"]["code"] == 503
            for path, body in [("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                               ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}),
                               ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})]:
                t0 = time.monotonic()
                r = c.post(path, json=body)
                assert time.monotonic() - t0 < 0.5
                assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
            assert c.get("/v1/kv/stats").status_code == 503
        reader.join(5)
        assert not reader.is_alive(), "the in-flight stream hangs after the core died"
        assert reader.error is None, reader.error  # it ended with an event, not a broken connection
        assert reader.ended_at - killed < 3
        errors = [e["error"] for e in reader.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == 503 and reader.events[-1] == "[DONE]", reader.events[-3:]
        assert not reader.finish_reasons()  # it did not pretend to finish
        assert srv.stop(timeout=30) == 1  # a supervisor must see that the engine had died
    finally:
        srv.stop(timeout=30)


# -- SIGTERM ---------------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_stream_and_exits_0(long_ckpt):
    srv = start_server(str(long_ckpt), *LONG_ARGS)
    n = 3000  # a few seconds of generation, far under the default 30s grace
    reader = StreamReader(srv, "/v1/completions", {**LONG, "max_tokens": n, "stream_options": {"include_usage": True}})
    assert reader.first.wait(30) and reader.status == 200, (reader.status, reader.error)
    srv.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = srv.proc.wait(120)
    reader.join(10)
    assert code == 0, srv.log()[-3000:]
    assert reader.error is None, reader.error
    assert reader.ended_at > sent  # it was still running when the signal came
    assert reader.finish_reasons() == ["length"], reader.events[-3:]
    assert reader.events[-1] == "[DONE]"
    usage = [e["usage"] for e in reader.events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == n


def test_sigterm_after_shutdown_timeout_aborts_cleanly(long_ckpt):
    srv = start_server(str(long_ckpt), *LONG_ARGS, "--shutdown-timeout", "1")
    reader = StreamReader(srv, "/v1/chat/completions", {
        **{k: v for k, v in LONG.items() if k != "prompt"}, "messages": [{"role": "user", "content": "hello"}]})
    other = StreamReader(srv, "/v1/completions", LONG)
    assert reader.first.wait(30) and other.first.wait(30), (reader.error, other.error)
    srv.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = srv.proc.wait(30)
    exited = time.monotonic() - sent
    assert code == 0, srv.log()[-3000:]
    assert 0.9 < exited < 6, exited  # waited for the grace period, then no longer than needed
    for r in (reader, other):
        r.join(5)
        assert not r.is_alive()
        # the response ended properly: a last chunk with finish_reason "abort", then [DONE]
        assert r.error is None, r.error
        assert r.finish_reasons() == ["abort"] and r.events[-1] == "[DONE]", r.events[-3:]
        assert r.ended_at - sent < 4
    assert "aborted 2 sequence(s)" in srv.log(), srv.log()[-3000:]


def test_sigterm_flushes_g3_writes(ckpt_dir, tmp_path):
    disk = tmp_path / "g3"
    args = (str(ckpt_dir("llama")), "--served-model-name", "tiny", "--num-gpu-blocks", "256",
            "--kv-offload-disk", str(disk))
    prompt = checkpoints.random_prompt(640, seed=21)  # 40 blocks of 16
    srv = start_server(*args)
    reader = StreamReader(srv, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 64,
                                                   "ignore_eos": True})
    assert reader.first.wait(30), reader.error
    srv.proc.send_signal(signal.SIGTERM)  # while the prompt's blocks are (being) written
    assert srv.proc.wait(60) == 0, srv.log()[-3000:]
    reader.join(5)
    assert reader.finish_reasons() == ["length"], reader.events[-3:]
    assert inspect_dir(Path(disk)).entries >= 40  # every block, in files of several

    srv2 = start_server(*args)
    try:
        with srv2.client(timeout=60) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            st = c.get("/v1/kv/stats").json()
        g3 = st["tiers"]["G3"]
        assert g3["hits"] >= 39 and g3["hit_tokens"] >= 39 * 16, g3  # all but maybe the last block
        assert st["tiers"]["G1"]["prefix_cache_hits"] == 0  # a fresh process: nothing came from G1
        assert cached == g3["hit_tokens"], (cached, g3)
    finally:
        assert srv2.stop() == 0


# -- tenant isolation ----------------------------------------------------------------------------
def test_cache_salt_isolates_prefix_cache(long_server):
    prompt = checkpoints.random_prompt(160, seed=33)  # 10 blocks, not sent before in this module
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}

    def cached(**kw) -> tuple[int, int]:
        hits0 = kv_stats(long_server)["tiers"]["G1"]["prefix_cache_hits"]
        with long_server.client(timeout=60) as c:
            r = c.post("/v1/completions", json={**body, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], \
            kv_stats(long_server)["tiers"]["G1"]["prefix_cache_hits"] - hits0

    # three tenants send the same prompt: nobody hits anybody else's blocks
    assert cached(cache_salt="tenant-a") == (0, 0)
    assert cached(cache_salt="tenant-b") == (0, 0)
    assert cached() == (0, 0)
    assert cached(cache_salt="tenant-a-") == (0, 0)  # salts are compared whole, not as prefixes
    # each hits its own
    for kw in ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}, {}):
        tokens, hits = cached(**kw)
        assert tokens >= 144 and hits >= 144, (kw, tokens, hits)
    # chat: the salt applies the same way
    msgs = [{"role": "user", "content": " ".join(["kesu bada"] * 60)}]
    with long_server.client(timeout=60) as c:
        def chat(**kw) -> int:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2, **kw})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert chat(cache_salt="x") == 0
        assert chat(cache_salt="y") == 0
        assert chat(cache_salt="x") >= 96
