"""soak.py's oracle: every distinct request of the slice once, greedy, on a clean server (no
offload, no prefix caching), with the top-2 logprob margin of every output token; cached in
benchmarks/results/ under a key that covers the workload, the flags, the model files and the
source that computes the outputs, so that a change to any of them recomputes it.

Imported by soak.py after it has put the repo root first on sys.path and benchmarks/ last.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, RESULTS_DIR, log
from serve import Req, start_server

SOURCE_DIRS = ("engine", "server", "kvstore", "connectors", "policies")


def source_digest() -> str:
    """The .py files under SOURCE_DIRS: the code the outputs come from."""
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for p in sorted((REPO_ROOT / d).rglob("*.py")):
            h.update(str(p.relative_to(REPO_ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def model_digest(model_dir: Path) -> str:
    """The model directory's path and its files' names, sizes and mtimes (no file is read)."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def oracle_key(workload_sha256: str, oracle_args: list[str], concurrency: int, model_dir: Path) -> str:
    """The cache key of the oracle of this workload, server flags, model and source."""
    return hashlib.sha256(json.dumps([workload_sha256, oracle_args, concurrency, model_digest(model_dir),
                                      source_digest()]).encode()).hexdigest()


async def oracle_outputs(url: str, reqs: list[Req], concurrency: int, timeout: float) -> dict[int, dict[str, Any]]:
    import httpx

    out: dict[int, dict[str, Any]] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout) as client:
        async def one(i: int, r: Req) -> None:
            async with sem:
                body = {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "logprobs": 2}
                resp = await client.post(url + "/v1/completions", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"oracle request {i}: HTTP {resp.status_code}: {resp.text[:300]}")
                ch = resp.json()["choices"][0]
                toks = ch["token_ids"]
                if len(toks) != r.max_tokens:
                    raise RuntimeError(f"oracle request {i}: {len(toks)} tokens, {r.max_tokens} asked")
                margins = []
                for top in (ch.get("logprobs") or {}).get("top_logprobs") or []:
                    v = sorted(top.values(), reverse=True)
                    margins.append(v[0] - v[1] if len(v) > 1 else None)
                out[i] = {"token_ids": toks, "margins": margins}

        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return out


def get_oracle(args: argparse.Namespace, reqs: list[Req], oracle_args: list[str], key: str) -> tuple[dict, dict]:
    path = RESULTS_DIR / f"soak-oracle-{key[:16]}.json"
    if not args.no_oracle_cache and path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            log(f"oracle: {len(doc['outputs'])} outputs from {path}")
            return {int(k): v for k, v in doc["outputs"].items()}, {"source": "cache", "path": str(path)}
    log(f"oracle: {len(reqs)} requests on a clean server: kvtier serve {' '.join(oracle_args)}")
    t = time.perf_counter()
    srv = start_server(oracle_args, args.threads, args.start_timeout)
    try:
        outs = asyncio.run(oracle_outputs(srv.url, reqs, args.concurrency, args.request_timeout))
    except BaseException:
        log(f"oracle failed; its server's last lines:\n{srv.tail()}")
        raise
    finally:
        srv.stop()
    secs = time.perf_counter() - t
    log(f"oracle: done in {secs:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "server_args": oracle_args, "outputs": outs}))
    return outs, {"source": "computed", "path": str(path), "seconds": round(secs, 1)}

