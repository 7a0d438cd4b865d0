"""Issue 11 through real `kvtier serve` processes: one request never kills the engine; a core
that dies or hangs is reported (503, failed requests, exit 1) instead of hanging behind a
healthy /health; request-supplied templates and big prompts cannot stall the HTTP loop; the key
guards every route but /health; fields that would change the answer are refused by name."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from checkpoints import random_prompt
from faulty_connector import TRIGGER
from serving import REPO, start_server
from test_serve_errors import CHAT, assert_openai_error
from test_serve_lifecycle import LONG, LONG_ARGS, StreamReader, wait_for

HERE = Path(__file__).resolve().parent


# -- finding 1: token ids outside the vocabulary ---------------------------------------------------
@pytest.mark.parametrize("bad", [-600, 100_000, 2**63 - 1])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_out_of_vocab_stop_token_ids_are_400_and_the_engine_lives(tiny_server, path, bad):
    """The finding's 100-byte repro took the engine core down while /health said 200."""
    body = {"max_tokens": 4, "min_tokens": 1, "stop_token_ids": [bad]}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    with tiny_server.client(timeout=30) as c:
        err = assert_openai_error(c.post(path, json=body), 400, "stop_token_ids")
        assert str(bad) in err["message"]
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [7]})
        assert r.status_code == 200, r.text


# -- finding 2: a core that dies or hangs ------------------------------------------------------------
def _assert_dead_server(srv, reader: StreamReader, since: float) -> None:
    """/health 503 within a second, the in-flight stream ended with one 503 error event, new
    requests and the stats routes answer 503 at once, and the process exits 1 by itself."""
    with srv.client(timeout=10) as c:
        assert wait_for(lambda: c.get("/health").status_code == 503, 1.0), "/health still 200 a second later"
        for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})]:
            t0 = time.monotonic()
            assert_openai_error(c.post(path, json=body), 503)
            assert time.monotonic() - t0 < 0.5
        for path in ("/v1/kv/stats", "/metrics"):
            t0 = time.monotonic()
            assert c.get(path).status_code in (503, 200)  # /metrics renders without engine gauges
            assert time.monotonic() - t0 < 1.0, f"{path} hangs"
    reader.join(5)
    assert not reader.is_alive() and reader.error is None, reader.error
    errors = [e["error"] for e in reader.events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503 and reader.events[-1] == "[DONE]", reader.events[-3:]
    assert srv.proc.wait(30) == 1, "a server whose engine died must exit 1 on its own"
    assert time.monotonic() - since < 20


def test_core_failure_is_a_death_not_a_clean_stop(long_ckpt):
    """A plugin that raises inside the step: the core used to send "stopped" from its finally, so the
    server took it for a clean stop: /health 200, requests and /v1/kv/stats hung, SIGTERM exit 0."""
    tc = {"kv_connector": "FaultyConnector", "kv_connector_module_path": "faulty_connector"}
    srv = start_server(str(long_ckpt), *LONG_ARGS, "--kv-transfer-config", json.dumps(tc),
                       env={"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}"})
    try:
        reader = StreamReader(srv, "/v1/completions", LONG)
        assert reader.first.wait(30) and reader.status == 200, (reader.status, reader.error)
        with srv.client(timeout=10) as c:
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": TRIGGER, "max_tokens": 2})
            assert_openai_error(r, 503)
            assert time.monotonic() - t0 < 3
        _assert_dead_server(srv, reader, t0)
        assert "FaultyConnector: a plugin bug" in srv.log()
    finally:
        srv.stop(timeout=30)


def test_a_stat_the_channel_cannot_carry_fails_that_query_alone(ckpt_dir):
    """A tier that reported a numpy float took the core down with the stats query (G3's batch
    reader did, in CI): now the query is a 500 naming the type, and the engine serves on."""
    tc = {"kv_connector": "OddStatsConnector", "kv_connector_module_path": "faulty_connector"}
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", "64", "--kv-transfer-config", json.dumps(tc),
                       env={"PYTHONPATH": f"{REPO}{os.pathsep}{HERE}"})
    try:
        with srv.client(timeout=30) as c:
            for _ in range(2):
                err = assert_openai_error(c.get("/v1/kv/stats"), 500)
                assert "float32" in err["message"], err
                assert c.get("/metrics").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert c.get("/health").status_code == 200
        assert "stats snapshot not sent" in srv.log()
    finally:
        srv.stop(timeout=30)


def test_hung_core_is_detected_by_the_heartbeat(long_ckpt):
    srv = start_server(str(long_ckpt), *LONG_ARGS, "--engine-heartbeat-timeout", "1.5")
    try:
        reader = StreamReader(srv, "/v1/completions", LONG)
        assert reader.first.wait(30) and reader.status == 200, (reader.status, reader.error)
        core = srv.core_pid()
        os.kill(core, signal.SIGSTOP)
        stopped = time.monotonic()
        with srv.client(timeout=10) as c:
            assert wait_for(lambda: c.get("/health").status_code == 503, 4.0), "a stopped core went unnoticed"
            assert time.monotonic() - stopped > 1.0  # not before the timeout
        _assert_dead_server(srv, reader, stopped)
        assert "heartbeat" in srv.log()
        assert wait_for(lambda: not Path(f"/proc/{core}").exists() or b"Z" in Path(f"/proc/{core}/stat").read_bytes().split()[2:3], 5)
    finally:
        srv.stop(timeout=30)


def test_a_long_step_is_not_a_hang(tiny_server):
    """The default heartbeat timeout tolerates the steps the suite makes (a 2k-token prefill here)."""
    with tiny_server.client(timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": random_prompt(1900, 7001), "max_tokens": 2})
        assert r.status_code == 200 and c.get("/health").status_code == 200


# -- finding 5: nothing a request sends may stall the HTTP loop ------------------------------------
def _health_gaps(srv, busy: threading.Thread) -> list[float]:
    gaps = []
    with srv.client(timeout=30) as c:
        while busy.is_alive():
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            gaps.append(time.monotonic() - t0)
            time.sleep(0.05)
    return gaps


def test_a_huge_prompt_tokenizes_off_the_event_loop(tiny_server):
    """A 7 MB prompt took ~5 s to tokenize on the event loop, and every route waited."""
    text = ("hello world , this is a test . " * 250_000)[:7_000_000]
    took: list[float] = []

    def send() -> None:
        with tiny_server.client(timeout=120) as c:
            t0 = time.monotonic()
            r = c.post("/tokenize", json={"prompt": text})
            took.append(time.monotonic() - t0)
            assert r.status_code == 200 and r.json()["count"] > 1_000_000

    t = threading.Thread(target=send)
    t.start()
    gaps = _health_gaps(tiny_server, t)
    t.join()
    assert took and took[0] > 1.5, took  # long enough for a blocked loop to show
    assert max(gaps) < min(1.0, took[0] / 3), (max(gaps), took)


@pytest.fixture(scope="module")
def trusting_server(ckpt_dir):
    srv = start_server(str(ckpt_dir("llama")), "--served-model-name", "tiny", "--num-gpu-blocks", "256",
                       "--trust-request-chat-template", "--chat-template-timeout", "1")
    yield srv
    srv.stop()


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_request_templates_need_the_trust_flag(tiny_server):
    with tiny_server.client(timeout=30) as c:
        for body in ({"chat_template": NESTED}, {"chat_template_kwargs": {"chat_template": NESTED}}):
            err = assert_openai_error(c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body}), 400)
            assert "--trust-request-chat-template" in err["message"]
            err = assert_openai_error(c.post("/tokenize", json={"messages": CHAT, **body}), 400)


def test_a_trusted_template_renders_under_a_deadline(trusting_server):
    """The nested-loop template blocked every route for 43 s; now it fails its request in about
    --chat-template-timeout and the loop stays free meanwhile."""
    done: list[tuple[float, httpx.Response]] = []

    def send() -> None:
        with trusting_server.client(timeout=60) as c:
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "chat_template": NESTED})
            done.append((time.monotonic() - t0, r))

    t = threading.Thread(target=send)
    t.start()
    gaps = _health_gaps(trusting_server, t)
    t.join()
    took, r = done[0]
    err = assert_openai_error(r, 400, "chat_template")
    assert "did not render within 1s" in err["message"]
    assert took < 10 and max(gaps) < 0.5, (took, max(gaps))


def test_a_trusted_template_is_used(trusting_server):
    tpl = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with trusting_server.client(timeout=30) as c:
        want = c.post("/tokenize", json={"prompt": "hello there ", "add_special_tokens": False}).json()["tokens"]
        for body in ({"chat_template": tpl}, {"chat_template_kwargs": {"chat_template": tpl}}):
            got = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hello there"}], **body})
            assert got.status_code == 200 and got.json()["tokens"] == want, got.text
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello there"}],
                                                     "max_tokens": 2, "return_token_ids": True, **body})
            assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == want
        err = assert_openai_error(c.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 2, "chat_template": "{{ 1 / 0 }}"}), 400, "messages")
        assert "ZeroDivisionError" in err["message"]


@pytest.mark.parametrize("metrics_open", [False, True])
def test_the_api_key_guards_every_route_but_health(ckpt_dir, metrics_open):
    """Unauthenticated /tokenize floods slowed authenticated chat 100x; /metrics describes the traffic."""
    srv = start_server(str(ckpt_dir("llama")), "--served-model-name", "tiny", "--num-gpu-blocks", "64",
                       "--api-key", "sekrit", *(["--metrics-no-auth"] if metrics_open else []))
    key = {"Authorization": "Bearer sekrit"}
    try:
        with srv.client(timeout=30) as c:
            for method, path, body in [("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [7]}),
                                       ("GET", "/v1/models", None), ("GET", "/v1/kv/stats", None),
                                       ("GET", "/metrics", None)]:
                anon = c.request(method, path, json=body)
                if path == "/metrics" and metrics_open:
                    assert anon.status_code == 200
                else:
                    assert_openai_error(anon, 401)
                assert c.request(method, path, json=body, headers=key).status_code == 200
            assert c.get("/health").status_code == 200 and c.get("/version").status_code == 200
    finally:
        srv.stop()


# -- finding 7: fields that change the answer are refused by name -----------------------------------
REFUSED = {
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "kv_transfer_params": {"do_remote_prefill": True},
    "use_beam_search": True,
    "frobnicate": 1,
}


@pytest.mark.parametrize("field", list(REFUSED))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fields_that_change_the_answer_are_refused_by_name(tiny_server, path, field):
    body = {"max_tokens": 2, field: REFUSED[field]}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "hi"})
    with tiny_server.client(timeout=30) as c:
        err = assert_openai_error(c.post(path, json=body), 400, field)
        assert repr(field) in err["message"]


def test_harmless_and_off_fields_are_accepted(tiny_server):
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "parallel_tool_calls": True, "logit_bias": {}, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "guided_json": None, "seed": None}
    with tiny_server.client(timeout=30) as c:
        for path, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})]:
            r = c.post(path, json={"max_tokens": 2, **harmless, **body})
            assert r.status_code == 200, r.text
        msg = {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}
        assert_openai_error(c.post("/v1/chat/completions", json={"messages": [*CHAT, msg], "max_tokens": 2}), 400)


# -- finding 8 -------------------------------------------------------------------------------------
def test_completions_default_to_16_tokens(tiny_server):
    with tiny_server.client(timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_continuous_usage_stats_are_in_every_chunk(tiny_server):
    reader = StreamReader(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "ignore_eos": True,
                                                           "stream_options": {"continuous_usage_stats": True}})
    reader.join(30)
    chunks = reader.chunks()
    assert chunks and all("usage" in ch for ch in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_disconnect_during_the_upload_is_quiet(tiny_server):
    host, port = tiny_server.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{\"prompt\": \"hel")
        time.sleep(0.3)
    with tiny_server.client(timeout=30) as c:
        assert c.get("/health").status_code == 200
    log = tiny_server.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_hidden_state_files_never_overwrite_each_other(ckpt_dir, tmp_path):
    """request_id is client-chosen and names the file: a second client's same id got the first one's file."""
    from connectors.hidden_spec import speculative_config
    from safetensors.torch import load_file

    out = tmp_path / "hs"
    tc = {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": str(out)}}
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", "128", "--dtype", "float32",
                       "--kv-transfer-config", json.dumps(tc), "-sc", json.dumps(speculative_config([0, 1])))
    try:
        paths = []
        prompts = [random_prompt(20, 7100 + i) for i in range(3)]
        with srv.client(timeout=60) as c:
            for p in prompts:
                r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 1, "request_id": "same"})
                assert r.status_code == 200, r.text
                paths.append(r.json()["kv_transfer_params"]["hidden_states_path"])
        assert len(set(paths)) == 3 and paths[0] == str(out / "same.safetensors")
        for path, p in zip(paths, prompts):
            assert load_file(path)["token_ids"].tolist() == p
        assert (out.stat().st_mode & 0o777) == 0o700
    finally:
        assert srv.stop() == 0


# -- acceptance 2: fuzzing both completion endpoints with token ids from the whole int64 range ------
def test_fuzzed_token_ids_never_500_kill_or_hang(tiny_server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tid = st.integers(-(2**63), 2**63 - 1) | st.integers(0, 511) | st.sampled_from([-1, 512, 100_000, 2**63 - 1])
    ids = st.lists(tid, min_size=1, max_size=6)
    tiny = st.sampled_from([0.0, 1e-46, 1e-38, 1e-6, 0.5, 1.0])
    common = {"max_tokens": st.integers(1, 3), "min_tokens": st.integers(0, 2), "stop_token_ids": ids,
              "logit_bias": st.dictionaries(tid.map(str), st.floats(-100, 100), max_size=2),
              "temperature": tiny, "top_p": tiny.filter(bool), "top_k": st.integers(-1, 600),
              "seed": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans()}
    bodies = st.one_of(
        st.fixed_dictionaries({"prompt": ids | st.lists(ids, min_size=1, max_size=3)}, optional=common)
        .map(lambda d: ("/v1/completions", d)),
        st.fixed_dictionaries({"messages": st.just(CHAT)}, optional=common).map(lambda d: ("/v1/chat/completions", d)),
    )
    statuses: list[int] = []
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        @settings(max_examples=int(os.environ.get("KVTIER_FUZZ_EXAMPLES", 400)), deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(bodies)
        def check(case) -> None:
            path, body = case
            r = c.post(path, json=body)  # a hang is an httpx timeout: the test fails
            statuses.append(r.status_code)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300], body)
            if r.status_code == 200 and body.get("stream"):
                assert r.text.rstrip().endswith("data: [DONE]") and '"code":5' not in r.text, r.text[-300:]
            assert c.get("/health").status_code == 200

        check()
        stats = c.get("/v1/kv/stats").json()
        assert stats["requests"]["running"] == stats["requests"]["waiting"] == 0
    assert statuses.count(200) >= 20 and len(statuses) >= 400, (len(statuses), statuses.count(200))
