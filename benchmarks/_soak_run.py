"""soak.py's run: the soak server (restarted after a core kill), the closed-loop load that
checks every output against the oracle, the /v1/kv/stats samples and the progress lines, with
the faults of a `Chaos` injected on a thread of their own.

Imported by soak.py after it has put the repo root first on sys.path and benchmarks/ last.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _chaos import Chaos
from _common import log
from _soak_stats import LOWER_TIERS, Counters, flatten, lower_hits
from serve import Req, Server, start_server

if TYPE_CHECKING:
    from redis_procs import RedisProc


class Soak:
    """One soak run's state, shared by the load's workers (asyncio), the sampler thread and the
    chaos thread: the server in use (`lock` guards its url and incarnation), `up` while one
    serves, `stop` when the run ends, every request's record, the counters and the findings."""

    def __init__(self, args: argparse.Namespace, server_args: list[str], wl_reqs: list[Req],
                 oracle: dict[int, dict[str, Any]], g3_root: Path, g3_tmpfs: bool, redis: RedisProc) -> None:
        self.args, self.server_args, self.reqs, self.oracle = args, server_args, wl_reqs, oracle
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.up = threading.Event()
        self.stop = threading.Event()
        self.fatal: str | None = None
        self.server: Server | None = None
        self.url = ""
        self.inc = -1
        self.logs: list[tuple[int, list[str]]] = []  # (incarnation, lines) of every server started
        self.counters = Counters()
        self.records: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []
        self.run_id = uuid.uuid4().hex[:8]
        self.chaos = Chaos(self, g3_root, g3_tmpfs, redis)  # last: it takes args, stop and up from here

    def now(self) -> float:
        return time.monotonic() - self.t0

    def finding(self, what: str, **detail: Any) -> None:
        log(f"FINDING at {self.now():.0f}s: {what} {detail if detail else ''}")
        self.findings.append({"t_s": round(self.now(), 1), "finding": what, **detail})

    # -- server --------------------------------------------------------------------------------
    def start_server(self) -> float:
        t = time.monotonic()
        for attempt in (1, 2):
            try:
                srv = start_server(self.server_args, self.args.threads, self.args.start_timeout)
                break
            except RuntimeError as e:
                self.finding("kvtier serve failed to start", attempt=attempt, error=str(e)[-2000:])
                if attempt == 2:
                    raise
        with self.lock:
            self.server, self.url, self.inc = srv, srv.url, self.inc + 1
            self.logs.append((self.inc, srv.lines))
        self.up.set()
        return time.monotonic() - t

    def sample(self, timeout: float = 5.0) -> dict[str, Any] | None:
        import httpx

        with self.lock:
            url, inc = self.url, self.inc
        if not url:
            return None
        try:
            r = httpx.get(url + "/v1/kv/stats", timeout=timeout)
            if r.status_code != 200:
                return None
            flat = flatten(r.json())
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        self.counters.add(self.now(), inc, flat)
        return flat

    def sampler(self) -> None:
        while not self.stop.wait(self.args.sample_interval):
            self.sample()

    # -- requests ------------------------------------------------------------------------------
    async def worker(self, client: Any, seq: Any, deadline: float) -> None:
        import httpx

        async def stats(url: str, inc: int) -> dict[str, Any] | None:
            try:
                r = await client.get(url + "/v1/kv/stats", timeout=5)
                if r.status_code == 200:
                    flat = flatten(r.json())
                    self.counters.add(self.now(), inc, flat)
                    return flat
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            return None

        while self.now() < deadline and not self.stop.is_set():
            if not self.up.is_set():
                await asyncio.sleep(0.2)
                continue
            n = next(seq)
            p, i = divmod(n, len(self.reqs))
            req = self.reqs[i]
            with self.lock:
                url, inc = self.url, self.inc
            tenant = p % self.args.tenants
            body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "cache_salt": f"soak-{self.run_id}-tenant{tenant}"}
            rec: dict[str, Any] = {"n": n, "pass": p, "idx": i, "tenant": tenant, "inc": inc, "ok": False,
                                   "cause": None, "wrong": False}
            before = await stats(url, inc)
            rec["sent"] = self.now()
            try:
                r = await client.post(url + "/v1/completions", json=body, timeout=self.args.request_timeout)
                if r.status_code != 200:
                    rec["cause"] = f"HTTP {r.status_code}"
                    rec["msg"] = r.text[:300]
                else:
                    out = r.json()
                    ch = out["choices"][0]
                    toks, fr = ch.get("token_ids"), ch.get("finish_reason")
                    rec["cached"] = out.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
                    if fr != "length" or toks is None or len(toks) != req.max_tokens:
                        rec["cause"] = f"finish_reason {fr}"
                        rec["msg"] = f"{len(toks or [])} of {req.max_tokens} tokens"
                    else:
                        rec["ok"] = True
                        want = self.oracle[i]["token_ids"]
                        if toks != want:
                            j = next(k for k, (a, b) in enumerate(zip(toks, want)) if a != b)
                            margins = self.oracle[i].get("margins") or []
                            rec.update(wrong=True, diverge_at=j, got=toks, want=want,
                                       oracle_margin=margins[j] if j < len(margins) else None)
            except httpx.ConnectError as e:
                rec["cause"], rec["msg"] = "connection refused", str(e)[:200]
            except httpx.TimeoutException as e:
                rec["cause"], rec["msg"] = "timeout", type(e).__name__
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                rec["cause"], rec["msg"] = "connection dropped", f"{type(e).__name__}: {str(e)[:200]}"
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                rec["cause"], rec["msg"] = f"bad response ({type(e).__name__})", str(e)[:200]
            rec["done"] = self.now()
            after = await stats(url, inc) if rec["ok"] else None
            if before is not None and after is not None:
                rec["lower_hit_tokens_window"] = lower_hits(after) - lower_hits(before)
            self.records.append(rec)
            if rec["wrong"]:
                log(f"WRONG output: trace line {req.index} (slice #{i}, pass {p}) diverges at token "
                    f"{rec['diverge_at']} (oracle top-2 margin {rec['oracle_margin']}); lower-tier hits in its window: "
                    f"{rec.get('lower_hit_tokens_window')}")
            if not rec["ok"]:
                await asyncio.sleep(1.0)  # no retry, but no spinning on a server that is going down either

    async def progress(self, deadline: float) -> None:
        last_t, last = 0.0, self.counters.at(0)
        while self.now() < deadline and not self.stop.is_set():
            await asyncio.sleep(min(self.args.progress_interval, max(deadline - self.now(), 0.1)))
            t = self.now()
            cum, breaker = self.counters.now()
            recs = list(self.records)
            d = {k: cum[k] - last.get(k, 0) for k in cum}
            pt = d["prompt_tokens"] or 1
            rates = " ".join(f"{tier} {d[f'{tier}.hit_tokens'] / pt:.0%}" for tier in ("G1", *LOWER_TIERS))
            log(f"[{t:4.0f}s] done {len(recs)}, ok {sum(r['ok'] for r in recs)}, failed "
                f"{sum(not r['ok'] for r in recs)}, wrong {sum(r['wrong'] for r in recs)}; "
                f"faults {len(self.chaos.faults)}; "
                f"server #{self.inc}{'' if self.up.is_set() else ' (down)'}; last {t - last_t:.0f}s hit: {rates}; "
                f"corrupt so far {sum(cum[f'{x}.corrupt'] for x in LOWER_TIERS):.0f}; G4 breaker {breaker}")
            last_t, last = t, cum

    async def load(self, deadline: float) -> None:
        import httpx

        seq = itertools.count()
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            await asyncio.gather(*(self.worker(client, seq, deadline) for _ in range(self.args.concurrency)),
                                 self.progress(deadline))

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> None:
        deadline = self.args.minutes * 60
        log(f"starting the soak server: kvtier serve {' '.join(self.server_args)}")
        self.start_server()
        self.t0 = time.monotonic()  # the clock starts with the first server serving
        self.sample()
        threads = [threading.Thread(target=self.sampler, daemon=True, name="sampler"),
                   threading.Thread(target=self.chaos.run, args=(deadline,), daemon=True, name="chaos")]
        for t in threads:
            t.start()
        try:
            asyncio.run(self.load(deadline))
        finally:
            self.stop.set()
            for t in threads:
                t.join(self.args.start_timeout + 30)
            self.chaos.run_undo()
            self.sample()

    def close(self) -> None:
        self.stop.set()
        self.chaos.run_undo()
        if self.server is not None:
            self.server.stop(60)

