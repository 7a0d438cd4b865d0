"""Issue 41, acceptance 3: `kvtier serve -tp 2` (two gloo ranks on the tiny Llama) answers the
official `openai` client as one rank does; a worker rank killed turns /health and requests into
503s naming the rank within 5 s, while idle too; a stopped (hung) rank fails the next request
within --distributed-timeout-seconds. Oracle: the same requests to `kvtier serve -tp 1`."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest
from serving import Server, start_server

ARGS = ("--served-model-name", "tiny", "--num-gpu-blocks", "256", "--distributed-timeout-seconds", "3")
CHAT = [{"role": "user", "content": "hello there"}]


def worker_pid(srv: Server) -> int:
    core = srv.core_pid()
    kids = subprocess.run(["pgrep", "-P", str(core)], capture_output=True, text=True, check=False).stdout.split()
    workers = [int(k) for k in kids if b"engine.parallel.worker" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(workers) == 1, (core, kids)
    return workers[0]


def answers(srv: Server) -> dict:
    c = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=60)
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    stream = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    choice = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    return {"chat": chat.choices[0].message.content, "finish": chat.choices[0].finish_reason,
            "streamed": streamed, "choice": choice.choices[0].message.content}


def test_two_ranks_answer_the_openai_client_as_one_rank_does(ckpt_dir):
    got = {}
    for tp in ("1", "2"):
        srv = start_server(str(ckpt_dir("llama")), *ARGS, "-tp", tp)
        try:
            got[tp] = answers(srv)
        finally:
            assert srv.stop(timeout=30) == 0, srv.log()[-2000:]
    assert got["2"] == got["1"]
    assert got["2"]["streamed"] == got["2"]["chat"] and got["2"]["choice"] in ("yes", "no", "maybe")


def _wait_503(srv: Server, within: float) -> dict:
    deadline = time.monotonic() + within
    with srv.client(timeout=5) as c:
        while time.monotonic() < deadline:
            r = c.get("/health")
            if r.status_code == 503:
                return r.json()
            time.sleep(0.05)
    pytest.fail(f"/health not 503 within {within} s")


def test_a_killed_rank_gives_503_within_5_s_while_idle_and_names_it(ckpt_dir):
    srv = start_server(str(ckpt_dir("llama")), *ARGS, "-tp", "2")
    try:
        assert answers(srv)["finish"] in ("stop", "length")
        os.kill(worker_pid(srv), signal.SIGKILL)
        err = _wait_503(srv, 5)["error"]
        assert "rank 1" in err["message"] and err["code"] == 503, err
        with srv.client(timeout=5) as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert srv.stop(timeout=30) == 1  # a supervisor sees the engine died
        assert "tensor-parallel rank 1" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop(timeout=30)


def test_a_stopped_rank_fails_the_next_request_within_the_timeout(ckpt_dir):
    srv = start_server(str(ckpt_dir("llama")), *ARGS, "-tp", "2")
    pid = worker_pid(srv)
    try:
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with srv.client(timeout=30) as c:
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 4})
        assert r.status_code == 503 and time.monotonic() - start < 3 + 5, (r.status_code, r.text)
        assert "all-reduce" in _wait_503(srv, 5)["error"]["message"]
    finally:
        os.kill(pid, signal.SIGKILL)  # a stopped process ignores SIGTERM until continued
        srv.stop(timeout=30)
