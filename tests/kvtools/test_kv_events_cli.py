"""`kvtier kv events`: bad input exits 2 with one line, every flag has help, and the real command
subscribed to crafted publishers (ZMQ XPUB sockets here, so a batch goes out only once the command
has subscribed) reports their residency, gaps and the servers' counts; Ctrl-C prints a final summary
and exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgpack
import pytest
import zmq

from server.cli import main

REPO = Path(__file__).resolve().parents[2]
H = [bytes([i]) * 16 for i in range(32)]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["kv", "events", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (["localhost:5557"], "an endpoint is tcp://host:port or ipc://path"),
    (["tcp://127.0.0.1"], "a tcp endpoint is tcp://host:port"),
    (["tcp://*:5557"], "a tcp endpoint is tcp://host:port"),
    (["tcp://127.0.0.1:0"], "port in 1..65535"),
    (["=tcp://127.0.0.1:5557"], "a replica name must be non-empty"),
    (["a=tcp://127.0.0.1:5557", "a=tcp://127.0.0.1:5558"], "replica names must differ"),
    (["a=tcp://127.0.0.1:5557", "--stats-url", "b=http://127.0.0.1:8000"], "--stats-url names ['b']"),
    (["a=tcp://127.0.0.1:5557", "--stats-url", "a=127.0.0.1:8000"], "expected NAME=http://host:port"),
    (["tcp://127.0.0.1:5557", "--interval", "0"], "must be a number > 0"),
    (["tcp://127.0.0.1:5557", "--duration", "soon"], "not a number"),
    ([], "required: ENDPOINT"),
])
def test_bad_input_exits_2_with_a_message(args, message, capsys):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and "kvtier kv events: error:" in err and "Traceback" not in err, err


def test_every_flag_has_help(capsys):
    import argparse

    from kvtools.cli import _parser

    flags = ["--topic", "--interval", "--duration", "--json", "--stats-url", "--api-key"]
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "ENDPOINT" in out and all(f in out for f in flags)
    [subs] = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = subs.choices["events"]._actions
    assert {o for a in actions for o in a.option_strings if o.startswith("--")} == {"--help", *flags}
    assert all(a.help and len(a.help) > 15 for a in actions), [a.dest for a in actions if not a.help]
    assert main(["kv", "--help"]) == 0 and "events" in capsys.readouterr().out


# ---- the real command against crafted publishers -------------------------------------------------

class Publisher:
    """A replica's KV-event socket: XPUB, so the test knows when the command has subscribed."""

    def __init__(self, ctx: zmq.Context, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.topic = topic

    def wait_subscribed(self, timeout_s: float = 60.0) -> bytes:
        assert self.sock.poll(int(timeout_s * 1000)), "the command never subscribed"
        return self.sock.recv()  # b"\x01" + the topic

    def send(self, seq: int, events: list) -> None:
        self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"),
                                  msgpack.packb([time.time(), events], use_bin_type=True)])


def stored(hashes, medium="GPU", block_size=16, parent=None, **extra) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, "token_ids": [],
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None, **extra}


def start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "server.cli", "kv", "events", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class StatsServer:
    """A stand-in for a replica's `GET /v1/kv/stats`."""

    def __init__(self, body: dict) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.auth = self.headers.get("Authorization")
                data = json.dumps(body).encode() if self.path == "/v1/kv/stats" else b"{}"
                self.send_response(200 if self.path == "/v1/kv/stats" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.auth: str | None = None
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_two_replicas_their_tiers_a_gap_and_the_servers_counts():
    """Replica a: G1-granular events in both wire forms, G2 in 32-token offload blocks, checked
    against its (stand-in) server; replica b skips a batch: stale, one gap."""
    ctx = zmq.Context()
    a, b = Publisher(ctx), Publisher(ctx)
    stats = StatsServer({"tiers": {"G1": {"num_blocks": 64, "free_blocks": 60},
                                   "G2": {"backend": "host", "hit_tokens": 0, "blocks": 2}}})
    proc = start(f"a=tcp://127.0.0.1:{a.port}", f"b=tcp://127.0.0.1:{b.port}", "--json", "--interval", "0.5",
                 "--duration", "4", "--stats-url", f"a={stats.url}", "--api-key", "sekret")
    try:
        assert a.wait_subscribed() == b"\x01" and b.wait_subscribed()  # the default topic: every message
        a.send(0, [stored(H[:6]), stored(H[:2], "CPU"), stored(H[2:4], "CPU", parent=H[1])])
        a.send(1, [["BlockRemoved", [H[5]], "GPU"], ["BlockStored", [H[6]], H[4], list(range(16)), 16, "GPU"],
                   ["BlockStored", [H[1]], None, [], 32, "DISK"], stored([H[0]], "NVME")])
        b.send(0, [stored(H[10:13])])
        b.send(2, [{"type": "BlockRemoved", "block_hashes": [H[10], H[20]], "medium": "GPU"}])
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        stats.close()
        ctx.destroy(linger=0)
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) >= 2 and records[-1]["final"] and not any(r["final"] for r in records[:-1])
    ra, rb = records[-1]["replicas"]["a"], records[-1]["replicas"]["b"]
    assert ra["endpoint"] == f"tcp://127.0.0.1:{a.port}"
    assert (ra["state"], ra["complete"], ra["batches"], ra["gaps"], ra["block_size"]) == ("live", True, 2, 0, 16)
    g1, g2, g3 = ra["tiers"]["G1"], ra["tiers"]["G2"], ra["tiers"]["G3"]
    assert (g1["blocks"], g1["stores"], g1["removes"]) == (6, 7, 1)  # H0..H4, H6
    assert (g2["blocks"], g2["hashes"], g2["unit_tokens"]) == (4, 4, 32)
    assert (g3["blocks"], g3["hashes"]) == (2, 1)  # one array-form entry of 32 tokens: 2 G1 blocks
    assert ra["other_medium"] == {"NVME": 1} and "NVME" in err
    assert ra["server"]["G1"] == {"what": "cached blocks <= capacity", "events": 6, "server": 64, "match": True,
                                  "note": ""}
    assert ra["server"]["G2"]["events"] == ra["server"]["G2"]["server"] == 4 and ra["server"]["G2"]["match"]
    assert stats.auth == "Bearer sekret"
    assert (rb["state"], rb["gaps"], rb["missed_batches"], rb["tiers"]["G1"]["blocks"]) == ("stale", 1, 1, 2)
    assert rb["tiers"]["G1"]["unknown_removes"] == 1 and "gap before batch 2" in rb["stale_reasons"][0]
    assert "server" not in rb and "Traceback" not in err


def test_ctrl_c_prints_a_final_summary_and_exits_0():
    ctx = zmq.Context()
    pub = Publisher(ctx, b"mytopic")
    proc = start(f"tcp://127.0.0.1:{pub.port}", "--topic", "mytopic", "--interval", "0.3",
                 "--stats-url", f"127.0.0.1:{pub.port}=http://127.0.0.1:1")
    try:
        assert pub.wait_subscribed() == b"\x01mytopic"
        pub.send(3, [stored(H[:3])])  # joined late, as far as the command can tell
        lines = []
        while not any(" stale " in line and " G1 " in line for line in lines):  # the batch is applied
            lines.append(proc.stdout.readline())
            assert lines[-1], "the command ended early"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
    assert proc.returncode == 0, err
    final = out[out.rindex("-- final"):].splitlines()
    row = next(line for line in final if line.startswith(f"127.0.0.1:{pub.port}"))
    assert row.split()[1:8] == ["stale", "1", "0", "G1", "3", "3", "0"], row
    assert any("joined at batch 3" in line for line in final)
    assert any("/v1/kv/stats: URLError" in line for line in final)  # unreachable server: said, not fatal
    assert "Traceback" not in err
