"""`kvtier kv events`: subscribe to replicas' KV events and print which blocks each holds, per tier.

    kvtier kv events ENDPOINT [ENDPOINT...] [--topic T] [--interval S] [--duration S] [--json]
                     [--stats-url NAME=URL]... [--api-key KEY]

An ENDPOINT is a replica's kv_events_config endpoint: tcp://host:port (named host:port) or
NAME=tcp://host:port (ipc:// too). The view is `kvtools.residency`'s: one `ResidencyIndex` per
replica, fed each ZMQ message as it comes. Every --interval seconds, and once more at the end
(--duration, Ctrl-C or SIGTERM), a summary: per replica its state (waiting, live, or stale: events
were lost, and why) and per tier the resident blocks (G1-granular), the stores and removes seen.
With --stats-url the replica's `GET /v1/kv/stats` is read at each summary and set beside the
events' counts (`residency.compare_with_stats`), a mismatch flagged.

Exit codes: 0 stopped (duration over, Ctrl-C or SIGTERM); 2 bad input (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.events import DEFAULT_TOPIC
from kvtools.residency import FleetView, StatsCheck, Tier, compare_with_stats

DEFAULT_INTERVAL_S = 2.0
STATS_TIMEOUT_S = 2.0
POLL_SLICE_S = 0.1  # longest wait between looks at the stop flag (Ctrl-C, SIGTERM)
DRAIN_MAX = 1000  # messages read off one socket before the others get a turn
RCVHWM = 100_000  # like the publisher's send high-water mark: a burst is not dropped here


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name) or "=" in self.name:
            raise ValueError(f"a replica name must be non-empty, without spaces or '=', got {self.name!r}")
        scheme, sep, rest = self.url.partition("://")
        if not sep or scheme not in ("tcp", "ipc"):
            raise ValueError(f"an endpoint is tcp://host:port or ipc://path, got {self.url!r}")
        if scheme == "ipc":
            if not rest:
                raise ValueError(f"ipc endpoint {self.url!r} has no path")
            return
        host, colon, port = rest.rpartition(":")
        if not colon or not host or host == "*" or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a tcp endpoint is tcp://host:port with a port in 1..65535, got {self.url!r}")


def parse_endpoint(text: str) -> Endpoint:
    """`tcp://host:port` (named `host:port`) or `NAME=tcp://host:port`."""
    head = text.split("://", 1)[0]
    if "=" in head:
        name, _, url = text.partition("=")
        return Endpoint(name, url)
    return Endpoint(text.partition("://")[2] or text, text)


def _endpoint_arg(text: str) -> Endpoint:
    try:
        return parse_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _stats_arg(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port, got {text!r}")
    return name, url.rstrip("/")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The `events` subcommand on `kvtier kv`'s subparsers."""
    import os

    p = sub.add_parser("events", help="subscribe to replicas' KV events; summarize the blocks each holds per tier",
                       description="Subscribe to one or more replicas' ZMQ KV events (kv_events_config) and keep, per "
                                   "replica, which blocks are resident in which tier (G1..G4), with a summary every "
                                   "--interval seconds and a final one on exit. A replica whose events were lost (a "
                                   "sequence gap, a late join, an undecodable message) is shown as stale, with why.")
    p.add_argument("endpoints", metavar="ENDPOINT", nargs="+", type=_endpoint_arg,
                   help="a replica's KV events endpoint: tcp://host:port (named host:port) or NAME=tcp://host:port")
    p.add_argument("--topic", default=DEFAULT_TOPIC,
                   help=f"the topic to subscribe to, the replicas' kv_events_config topic (default: {DEFAULT_TOPIC!r}, every topic)")
    p.add_argument("--interval", type=_positive, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help=f"print a summary every SECONDS (default: {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--duration", type=_positive, default=None, metavar="SECONDS",
                   help="stop after SECONDS and print the final summary (default: run until Ctrl-C)")
    p.add_argument("--json", action="store_true",
                   help="print each summary as one JSON object on one line instead of a table")
    p.add_argument("--stats-url", type=_stats_arg, action="append", default=[], metavar="NAME=URL",
                   help="the replica NAME's server (http://host:port): read its GET /v1/kv/stats at each summary "
                        "and show the server's counts beside the events', a mismatch flagged (repeatable)")
    p.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY"), metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' to the --stats-url servers (default: $KVTIER_API_KEY)")
    return p


def run(ns: argparse.Namespace) -> int:
    """Raises ValueError on bad input (kv_cli prints it and exits 2)."""
    endpoints: list[Endpoint] = ns.endpoints
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"replica names must differ; got {names} (name them: NAME=tcp://host:port)")
    stats_urls = dict(ns.stats_url)
    if unknown := sorted(set(stats_urls) - set(names)):
        raise ValueError(f"--stats-url names {unknown}, not among the endpoints' names {names}")
    fleet = FleetView(names)
    emit = _Printer(fleet, endpoints, stats_urls, ns.api_key, ns.json)
    stop = threading.Event()
    with contextlib.closing(_Subscribers(endpoints, ns.topic)) as subs, _SignalStop(stop):
        subs.loop(fleet, stop, ns.interval, ns.duration, emit)
    return 0


class _Subscribers:
    """One SUB socket per replica, so each message is known to come from its replica."""

    def __init__(self, endpoints: list[Endpoint], topic: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._names: dict[Any, str] = {}
        try:
            for e in endpoints:
                sock = self._ctx.socket(zmq.SUB)
                self._names[sock] = e.name
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, RCVHWM)
                sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
                try:
                    sock.connect(e.url)
                except zmq.ZMQError as err:
                    raise ValueError(f"cannot connect to {e.url!r}: {err}") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for sock in self._names:
            sock.close()
        self._ctx.term()

    def _drain(self, fleet: FleetView, sock: Any) -> None:
        for _ in range(DRAIN_MAX):
            try:
                frames = sock.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            fleet.receive(self._names[sock], frames)

    def loop(self, fleet: FleetView, stop: threading.Event, interval: float, duration: float | None,
             emit: Callable[[float, bool], None]) -> None:
        poller = self._zmq.Poller()
        for sock in self._names:
            poller.register(sock, self._zmq.POLLIN)
        start = time.monotonic()
        deadline = math.inf if duration is None else start + duration
        next_at = start + interval
        while not stop.is_set():
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_at:
                emit(now - start, False)
                next_at += interval * max(1, math.ceil((now - next_at) / interval))  # a slow print skips, never bursts
            wait = min(next_at, deadline, now + POLL_SLICE_S) - now
            for sock, _ in poller.poll(max(0.0, wait) * 1000):
                self._drain(fleet, sock)
        for sock in self._names:  # what arrived before the stop belongs in the final summary
            self._drain(fleet, sock)
        emit(time.monotonic() - start, True)


class _SignalStop:
    """SIGINT and SIGTERM set `stop` (a flag the loop looks at, so no event is half-applied); the
    previous handlers come back on exit."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._old: dict[int, Any] = {}

    def __enter__(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # an embedder's thread: signals stay the embedder's business
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, lambda *_: self._stop.set())

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# ---- the summary ------------------------------------------------------------------------------

class _Printer:
    def __init__(self, fleet: FleetView, endpoints: list[Endpoint], stats_urls: dict[str, str],
                 api_key: str | None, as_json: bool) -> None:
        self.fleet, self.stats_urls, self.api_key, self.as_json = fleet, stats_urls, api_key, as_json
        self.urls = {e.name: e.url for e in endpoints}

    def __call__(self, elapsed: float, final: bool) -> None:
        record = self.record(elapsed, final)
        print(json.dumps(record, sort_keys=True) if self.as_json else "\n".join(format_table(record)), flush=True)

    def record(self, elapsed: float, final: bool) -> dict[str, Any]:
        replicas = {}
        for name in self.fleet:
            index = self.fleet[name]
            entry = {"endpoint": self.urls[name], **index.to_dict()}
            if name in self.stats_urls:
                try:
                    checks = compare_with_stats(index, self._fetch(self.stats_urls[name]))
                    entry["server"] = {c.tier.value: _check_dict(c) for c in checks}
                except (OSError, ValueError) as e:  # unreachable, HTTP error, not JSON: say so, keep watching
                    entry["server_error"] = f"{type(e).__name__}: {e}"
            replicas[name] = entry
        return {"ts": time.time(), "elapsed_s": round(elapsed, 3), "final": final, "replicas": replicas}

    def _fetch(self, base: str) -> dict[str, Any]:
        req = urllib.request.Request(f"{base}/v1/kv/stats")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=STATS_TIMEOUT_S) as resp:  # http(s) only: _stats_arg checked
            body = json.loads(resp.read())
        if not isinstance(body, dict):
            raise ValueError("/v1/kv/stats did not return a JSON object")  # noqa: TRY004 (a reply, reported as such)
        return body


def _check_dict(c: StatsCheck) -> dict[str, Any]:
    return {"what": c.what, "events": c.events, "server": c.server, "match": c.match, "note": c.note}


def format_table(record: dict[str, Any]) -> list[str]:
    """The text form of one summary record."""
    head = f"{'replica':<16} {'state':<7} {'batches':>7} {'gaps':>4} {'tier':<4} {'blocks':>8} {'stores':>8} " \
           f"{'removes':>8}  server"
    lines = [f"-- {'final' if record['final'] else 'at'} {record['elapsed_s']:.1f} s", head]
    notes = []
    for name, r in record["replicas"].items():
        server = r.get("server", {})
        shown = [t.value for t in Tier if _active(r["tiers"][t.value]) or t.value in server] or [Tier.G1.value]
        for i, tier in enumerate(shown):
            c = r["tiers"][tier]
            left = f"{name:<16} {r['state']:<7} {r['batches']:>7} {r['gaps']:>4}" if i == 0 else " " * 37
            lines.append(f"{left} {tier:<4} {c['blocks']:>8} {c['stores']:>8} {c['removes']:>8}  "
                         f"{_server_cell(server.get(tier))}{' (stale)' if c['stale'] else ''}")
        if r["stale_reasons"]:
            notes.append(f"{name}: stale: {'; '.join(r['stale_reasons'][:3])}")
        if r.get("server_error"):
            notes.append(f"{name}: /v1/kv/stats: {r['server_error']}")
        if r["other_medium"]:
            notes.append(f"{name}: events of unknown media, not applied: {r['other_medium']}")
    return lines + notes


def _active(c: dict[str, Any]) -> bool:
    return bool(c["hashes"] or c["stores"] or c["removes"])


def _server_cell(check: dict[str, Any] | None) -> str:
    if check is None:
        return "-"
    if check["server"] is None:
        return f"n/a ({check['note']})"
    flag = {True: "ok", False: "MISMATCH", None: "not compared"}[check["match"]]
    return f"{check['server']} {check['what']}: {flag}"
