"""Do slow lower-tier loads hold back requests that need none? (issue 43: no load convoys)

Requests decoding with no lower-tier hit ("plain") run beside requests whose long prompts sit in a G3
slowed to --rate MB/s (a pacing wrapper around the disk backend's reads: each read takes at least
its bytes / rate). Three modes, interleaved over --runs:
  alone   the plain requests only
  slow    the same, with --loaders requests arriving one by one whose prompts load from the paced G3
  fast    the same loaders, G3 unpaced
Reported: the plain requests' time per output token (p50 and p90 of every inter-token gap), and the
loaders' TTFT and G3 hit tokens. Target: slow's TPOT p50 within 10% of alone's.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (RESULTS_DIR, log, median, preload_allocator, print_table, set_torch_threads,  # noqa: E402
                     usable_cpus, write_json)
from kvstore.backend import Scatter  # noqa: E402

TARGET = 1.10  # slow TPOT p50 / alone TPOT p50


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Pacer:
    """Wraps a backend's reads (`get_into`, and `batch` for `get_into_batch`) so that all calls
    together move at most `rate` bytes per second: each call books its bytes / rate on one shared
    timeline and returns when its share ends."""

    def __init__(self, backend: Any, rate_Bps: float) -> None:
        self.backend, self.rate, self.real, self.real_batch = backend, rate_Bps, backend.get_into, backend.get_into_batch
        self.on = False
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the paced medium is next idle

    def __call__(self, keys, outs):
        got = self.real(keys, outs)
        self._pace(sum(o.nbytes if isinstance(o, Scatter) else memoryview(o).nbytes for o in outs))
        return got

    def batch(self, keys, batch, threads):
        """`get_into_batch` (a whole load into G1 in one call), paced likewise."""
        got = self.real_batch(keys, batch, threads)
        self._pace(int(batch.value_bytes.sum()))
        return got

    def _pace(self, nbytes: int) -> None:
        if self.on:
            with self._lock:
                self._free_at = max(time.perf_counter(), self._free_at) + nbytes / self.rate
                until = self._free_at
            time.sleep(max(0.0, until - time.perf_counter()))


def one_run(llm, mode: str, plain_prompts: list[list[int]], loader_prompts: list[list[int]], args) -> dict[str, Any]:
    from engine import SamplingParams

    eng = llm.engine
    eng.pool.reset_prefix_cache()  # the loaders' prompts are in G3 only
    tag = f"{mode}-{time.perf_counter_ns()}"
    plain = [eng.make_request(f"p{i}-{tag}", p, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                               ignore_eos=True)) for i, p in enumerate(plain_prompts)]
    for r in plain:
        eng.add_request(r)
    stamps: dict[str, list[float]] = {r.request_id: [] for r in plain}
    loaders, pending, t_add = [], list(loader_prompts) if mode != "alone" else [], {}
    step = 0
    while any(not r.status.finished for r in plain + loaders):
        if pending and step >= args.first_load_step and (step - args.first_load_step) % args.load_every == 0:
            r = eng.make_request(f"l{len(loaders)}-{tag}", pending.pop(0), SamplingParams(temperature=0, max_tokens=1,
                                                                                        ignore_eos=True))
            t_add[r.request_id] = time.perf_counter()
            eng.add_request(r)
            loaders.append(r)
        got = eng.step()
        now = time.perf_counter()
        for r in got:
            if r.request_id in stamps:
                stamps[r.request_id].append(now)
            elif r.request_id in t_add and r.request_id + "/ttft" not in t_add:
                t_add[r.request_id + "/ttft"] = now - t_add[r.request_id]
        step += 1
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    return {"tpot_p50_s": percentile(gaps, 0.5), "tpot_p90_s": percentile(gaps, 0.9), "steps": step,
            "loader_ttft_s": [t_add.get(r.request_id + "/ttft") for r in loaders],
            "loader_g3_tokens": [r.cached_by_tier.get("G3", 0) for r in loaders]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--rate", type=float, default=200.0, help="paced G3 read rate, MB/s (default %(default)s)")
    ap.add_argument("--plain", type=int, default=4, help="requests with no lower-tier hit (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=160, help="their output tokens (default %(default)s)")
    ap.add_argument("--loaders", type=int, default=4, help="requests loading from G3 (default %(default)s)")
    ap.add_argument("--loader-tokens", type=int, default=3000, help="their prompt length (default %(default)s)")
    ap.add_argument("--first-load-step", type=int, default=10, help="step the first loader arrives at (default %(default)s)")
    ap.add_argument("--load-every", type=int, default=15, help="steps between loaders (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode, interleaved (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all cores)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "convoy.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.runs < 1 or args.plain < 1:
        ap.error("--rate, --runs and --plain must be positive")
    set_torch_threads(args.threads)
    import random

    from engine import LLM, SamplingParams
    from engine.demo.demo_model import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvtier-convoy-") as tmp:
        llm = LLM(model, dtype="float32", kv_offload_disk=str(Path(tmp) / "g3"), kv_offload_disk_size=4.0,
                  max_num_batched_tokens=2048)
        vocab = llm.engine.model_config.vocab_size
        loader_prompts = [[rng.randrange(100, vocab) for _ in range(args.loader_tokens)] for _ in range(args.loaders)]
        log(f"writing {args.loaders} prompts of {args.loader_tokens} tokens to G3")
        llm.generate([{"prompt_token_ids": p} for p in loader_prompts], SamplingParams(max_tokens=1), use_tqdm=False)
        llm.engine.flush_offload()
        g3 = llm.engine.connector.tier("G3").backend
        pacer = Pacer(g3, args.rate * 1e6)
        g3.get_into, g3.get_into_batch = pacer, pacer.batch
        results: dict[str, list[dict[str, Any]]] = {"alone": [], "slow": [], "fast": []}
        for r in range(args.runs):
            for mode in results:
                pacer.on = mode == "slow"
                plain = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(args.plain)]
                out = one_run(llm, mode, plain, loader_prompts, args)
                results[mode].append(out)
                log(f"[run {r + 1}/{args.runs}] {mode}: TPOT p50 {out['tpot_p50_s'] * 1e3:.2f} ms, loader TTFT "
                    + ", ".join(f"{t:.2f}s" for t in out["loader_ttft_s"] if t is not None))
        llm.close()
    rows, med = [], {}
    for mode, runs in results.items():
        med[mode] = median([x["tpot_p50_s"] for x in runs])
        ttfts = [t for x in runs for t in x["loader_ttft_s"] if t is not None]
        hits = [h for x in runs for h in x["loader_g3_tokens"]]
        rows.append([mode, f"{med[mode] * 1e3:.2f}", f"{median([x['tpot_p90_s'] for x in runs]) * 1e3:.2f}",
                     f"{median(ttfts):.2f}" if ttfts else "-", f"{median(hits):.0f}" if hits else "-"])
    print_table(["mode", "plain TPOT p50 ms", "plain TPOT p90 ms", "loader TTFT s (median)", "loader G3 hit tokens"],
                rows)
    got = med["slow"] / med["alone"]
    print(f"slow loads at {args.rate:g} MB/s: plain TPOT p50 {got:.3f}x of alone "
          f"(target <= {TARGET:.2f}x: {'met' if got <= TARGET else 'NOT met'})")
    path = write_json(args.out, {"benchmark": "convoy", "args": vars(args) | {"out": str(args.out)},
                                 "runs": results, "tpot_p50_ratio_slow_vs_alone": got})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    preload_allocator()
    sys.exit(main())
