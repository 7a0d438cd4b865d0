#!/usr/bin/env python3
"""Async scheduling on the demo model: the synchronous engine against --async-scheduling.

On a GPU (scripts/gpu-check.sh's async-scheduling step): `--model` the random Llama-3-8B-shaped
checkpoint benchmarks/gpu.py writes, `--gpu-memory-utilization 0.4`.

Workloads (random token ids >= 100, ignore_eos; greedy unless said):
  decode64  64 requests, 32-token prompts, 256 output tokens each: batch-64 decode, where the
            per-step host work (schedule, input preparation, sampling, update) is the bubble.
  sampled64 decode64 sampled (temperature 0.8, top_p 0.95, unseeded): on a GPU such steps draw in
            the sampler's device batch and keep their ids on the device between async steps.
  default   benchmarks/throughput.py's default workload (64 requests, prompts 32-512 tokens,
            outputs 32-256), the issue's throughput target.

Engines are two LLM instances in this process, built once: `sync` and `async`. Runs are
interleaved (sync, async, sync, ...); cells are medians over --runs of output tokens / wall time.
The bubble is the engine's own measure (EngineStats.bubble_fraction over the run): the share of
busy wall time in which no forward ran. A fresh cache_salt per run keeps prefix caching out, and
outputs are compared between the engines (async must not change them).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import RESULTS_DIR, log, median, preload_allocator, print_table, run_interleaved, set_torch_threads, usable_cpus, write_json  # noqa: E402
from throughput import DEFAULTS, Workload, make_workload  # noqa: E402

TARGET_BUBBLE = 0.05  # acceptance 4: under 5% of step time at batch-64 decode
TARGET_RATIO = 1.1  # acceptance 4: async >= 1.1x the synchronous engine on the default workload


SAMPLING = {"sampled64": dict(temperature=0.8, top_p=0.95)}  # the others are greedy


def workloads(vocab: int, seed: int) -> dict[str, Workload]:
    d = DEFAULTS
    return {"decode64": make_workload(64, (32, 32), (256, 256), vocab, seed),
            "sampled64": make_workload(64, (32, 32), (256, 256), vocab, seed),
            "default": make_workload(d["num_requests"], (d["min_prompt"], d["max_prompt"]),
                                     (d["min_output"], d["max_output"]), vocab, seed)}


def measure(llm, wl: Workload, salt: str, sampling: dict[str, float] | None = None) -> dict[str, Any]:
    from engine import SamplingParams

    before = llm.get_stats()
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(**(sampling or {"temperature": 0}), max_tokens=n, ignore_eos=True) for n in wl.outputs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, cache_salt=salt)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    busy = after.busy_seconds - before.busy_seconds
    forward = after.forward_seconds - before.forward_seconds
    return {"tok_s": wl.output_tokens / wall, "wall_s": wall, "busy_s": busy, "forward_s": forward,
            "bubble": 1 - forward / busy if busy > 0 else 0.0, "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--workloads", default="decode64,sampled64,default",
                   help="comma-separated: decode64, sampled64, default (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; cells are medians (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all usable CPUs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="each engine's share of the GPU (both live in this process: 0.4 each on a GPU; "
                   "default: the engine's, which suits one engine)")
    p.add_argument("-O", "--optimization-level", type=int, choices=(0, 1, 2, 3), default=None,
                   help="both engines' -O (default: the engine's); on CUDA, 2 captures mixed steps piecewise")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="both engines' (CUDA only; default: the engine's): fewer sizes to capture at start-up")
    p.add_argument("--out", default=str(RESULTS_DIR / "async_scheduling.json"), help="JSON results (default: %(default)s)")
    args = p.parse_args()
    preload_allocator()
    set_torch_threads(args.threads)
    from engine import LLM

    engines = {}
    for name, flag in (("sync", False), ("async", True)):
        log(f"loading {name}")
        kw = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
        for key in ("optimization_level", "max_cudagraph_capture_size"):
            if getattr(args, key) is not None:
                kw[key] = getattr(args, key)
        engines[name] = LLM(args.model, async_scheduling=flag, **kw)
    all_wl = workloads(engines["sync"].engine.model_config.vocab_size, args.seed)
    names = args.workloads.split(",")
    if set(names) - set(all_wl):
        p.error(f"--workloads: unknown {sorted(set(names) - set(all_wl))}")
    for llm in engines.values():  # warm-up: compiled graphs, kernels, allocator
        measure(llm, make_workload(4, (16, 16), (8, 8), llm.engine.model_config.vocab_size, 1), "warm")
    rows, results = [], {}
    for w in names:
        wl = all_wl[w]
        got = run_interleaved(args.runs, {n: (lambda r, llm=llm: measure(llm, wl, f"{w}-{r}-{time.time()}",
                                                                          SAMPLING.get(w)))
                                          for n, llm in engines.items()},
                              progress=lambda r, n, res: log(f"{w} run {r} {n}: {res['tok_s']:.1f} tok/s, "
                                                             f"bubble {100 * res['bubble']:.1f}%"))
        base = median([x["tok_s"] for x in got["sync"]])
        for name, runs in got.items():
            tok_s, bubble = median([x["tok_s"] for x in runs]), median([x["bubble"] for x in runs])
            # run by run: unseeded draws advance each engine's generator, the same way in both
            same = all(x["tokens"] == s["tokens"] for x, s in zip(runs, got["sync"]))
            rows.append([w, name, f"{tok_s:.1f}", f"{tok_s / base:.3f}", f"{100 * bubble:.2f}%", "yes" if same else "NO"])
            results[f"{w}/{name}"] = {"tok_s": [x["tok_s"] for x in runs], "median_tok_s": tok_s,
                                      "vs_sync": tok_s / base, "bubble": [x["bubble"] for x in runs],
                                      "median_bubble": bubble, "identical_to_sync": same,
                                      "forward_s": [x["forward_s"] for x in runs], "busy_s": [x["busy_s"] for x in runs]}
    graphs = {}  # steps each engine replayed from decode and piecewise graphs (or their eager replay)
    for name, llm in engines.items():
        runner = llm.engine.runner
        graphs[name] = {kind: sum(g.stats().replays.values()) if g is not None else None
                        for kind, g in (("decode", runner.graphs), ("piecewise", runner.pieces))}
    log(f"graph replays: {graphs}")
    for llm in engines.values():
        llm.close()
    print_table(["workload", "engine", "output tok/s", "vs sync", "bubble", "same tokens"], rows)
    if "decode64/async" in results:
        b = results["decode64/async"]["median_bubble"]
        log(f"bubble at batch-64 decode with async scheduling: {100 * b:.2f}% "
            f"({'met' if b < TARGET_BUBBLE else 'MISSED'}: target < {100 * TARGET_BUBBLE:.0f}%)")
    if "default/async" in results:
        r = results["default/async"]["vs_sync"]
        log(f"default workload, async vs sync: {r:.3f}x ({'met' if r >= TARGET_RATIO else 'MISSED'}: "
            f"target >= {TARGET_RATIO}x)")
    path = write_json(args.out, {"args": vars(args), "results": results, "graph_replays": graphs})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
