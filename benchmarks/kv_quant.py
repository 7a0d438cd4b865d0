#!/usr/bin/env python3
"""What an fp8 KV cache costs in accuracy and buys in capacity, decode speed and tier hits (issue 44).

Accuracy (`--parts accuracy`), each KV setting in its own engine, the same prompts:
- perplexity of a held-out text shipped with Python itself (the language reference's topics in
  `pydoc_data.topics`; no download), in `--ppl-windows` windows of `--ppl-tokens` tokens, from
  kvtier's prompt log-probs (the text's KV is quantized as it is written, so every position after
  the first reads quantized keys and values);
- greedy continuations of `--prompts` passages of the same text (after the perplexity windows),
  `--max-tokens` each, scored by transformers in float32 by teacher forcing: mean and max |Δ
  logprob| of the chosen tokens, greedy agreement (float32's argmax given the prefix is the token
  chosen), identical outputs (the whole continuation equals transformers' own greedy one);
- non-finite log-probs (NaN or inf) anywhere.
Accuracy and tier engines run eagerly (a compile costs a minute per engine here), decode compiled.
The settings: the weights' dtype (the control: kvtier's float32 KV is transformers' float32 up to
float error), bfloat16 KV, fp8_e4m3 and fp8_e5m2 with calibrated per-layer scales (the default),
and fp8_e4m3 with unit scales (what vLLM uses when a checkpoint has no k_scale/v_scale and
--calculate-kv-scales is off), which shows what calibration is worth. The tiers part also runs
"fp8 offload": G1 exact, --kv-offload-dtype fp8.

Speed (`--parts decode,tiers`) and capacity (`--parts capacity`):
- one decode step at batch `--decode-batch`, every row `--decode-context` tokens deep in scattered
  G1 blocks (random KV: a step's time does not depend on the values), the engines' forward and
  logits, interleaved over `--decode-runs`, medians;
- G1 tokens per GiB of KV memory at each setting;
- G2, G3 (disk) and G4 (a local redis-server) hits of a `--tier-tokens` prompt: TTFT and bytes
  loaded into G1, interleaved, medians, against the weights' dtype.

    .venv/bin/python benchmarks/kv_quant.py
    .venv/bin/python benchmarks/kv_quant.py --parts accuracy --prompts 100 --max-tokens 64

Writes benchmarks/results/kv_quant.json.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import torch  # noqa: E402

from _common import (RESULTS_DIR, log, machine_info, median, preload_allocator, print_table,  # noqa: E402
                     set_torch_threads, usable_cpus, write_json)

PARTS = ("accuracy", "perplexity", "capacity", "decode", "tiers")  # perplexity: accuracy's first half alone
# name -> (--kv-cache-dtype, unit scales instead of calibrated ones, --kv-offload-dtype)
SETTINGS = {
    "model dtype": ("auto", False, "auto"),
    "bfloat16": ("bfloat16", False, "auto"),
    "fp8_e4m3": ("fp8_e4m3", False, "auto"),
    "fp8_e5m2": ("fp8_e5m2", False, "auto"),
    "fp8_e4m3 unit scales": ("fp8_e4m3", True, "auto"),
    "fp8 offload": ("auto", False, "fp8"),  # G1 exact, the tiers fp8 (tiers part only)
    # Not built: what a finer granularity would give, emulated on a float32 cache (accuracy only).
    "fp8_e4m3 per-token (emulated)": ("auto", False, "auto"),
}
TIERS_ONLY = ("fp8 offload",)
PER_TOKEN = "fp8_e4m3 per-token (emulated)"


@contextlib.contextmanager
def emulated(setting: str):
    """For PER_TOKEN: every K and V row (a token's head) rounded through e4m3 with its own scale
    (amax / 448) before it is written, a float32 cache then holding the dequantized values: the
    accuracy of per-token-per-head dynamic scales (vLLM's and SGLang's finer schemes), whose
    speed and storage (a scale beside every row) are not built."""
    if setting != PER_TOKEN:
        yield
        return
    from engine.runner import attention, attention_cpu

    plain = attention.write_kv

    def rounded(x: torch.Tensor) -> torch.Tensor:
        big = torch.finfo(torch.float8_e4m3fn).max
        s = (x.abs().amax(-1, keepdim=True).float() / big).clamp_min(1e-30)
        return ((x.float() / s).clamp(-big, big).to(torch.float8_e4m3fn).float() * s).to(x.dtype)

    def write_kv(k, v, *args, **kw):
        plain(rounded(k), rounded(v), *args, **kw)

    with mock.patch.object(attention, "write_kv", write_kv), mock.patch.object(attention_cpu, "write_kv", write_kv):
        yield
PPL_TARGET = 0.01  # fp8_e4m3 perplexity within 1% of the model dtype's (issue 44, point 1)
BYTES_TARGET, TIME_TARGET = 0.55, 0.60  # tier hits: bytes and time against the model dtype's (point 2)
CAPACITY_TARGET = 1.9


def held_out_ids(tokenizer) -> list[int]:
    """The language reference's topics, in name order, as one token stream."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def scales_of(unit: bool):
    """Unit scales in place of calibration (the checkpoint's scales would still win)."""
    if not unit:
        yield
        return
    from engine.model_config import KVScale
    from engine.runner import kv_quant

    with mock.patch.object(kv_quant, "calibrate", lambda model, mc, *a, **k: (KVScale(),) * mc.num_layers):
        yield


def engine(model: str, setting: str, **kw):
    """An engine with that KV setting. Eager unless the caller says otherwise: a compile costs a
    minute per engine here, and only the decode step's time depends on it."""
    from engine import LLM

    kv_dtype, unit, offload_dtype = SETTINGS[setting]
    kw.setdefault("enforce_eager", True)
    if offload_dtype != "auto":
        kw["kv_offload_dtype"] = offload_dtype
    with scales_of(unit):
        return LLM(model, dtype="float32", kv_cache_dtype=kv_dtype, seed=0, **kw)


def accuracy(model: str, args, stream: list[int]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams

    w = args.ppl_tokens
    windows = [stream[i * w:(i + 1) * w] for i in range(args.ppl_windows)]
    rest = stream[args.ppl_windows * w:]
    stride = max(len(rest) // args.prompts, 1)
    prompts = [rest[i * stride:i * stride + args.prompt_tokens] for i in range(args.prompts)]
    if len(windows[-1]) < w or len(prompts[-1]) < args.prompt_tokens:
        raise SystemExit(f"the held-out text has {len(stream)} tokens: too few for these --ppl-*/--prompts settings")
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    got: dict[str, dict[str, Any]] = {}
    for name in (n for n in args.settings if n not in TIERS_ONLY):
        log(f"accuracy: {name}")
        with emulated(name), engine(model, name, max_model_len=max(w, args.prompt_tokens + args.max_tokens) + 8,
                                    num_gpu_blocks=2 * -(-max(w, len(prompts) * (args.prompt_tokens + args.max_tokens)) // 16)) as llm:
            outs = llm.generate([{"prompt_token_ids": x} for x in windows], score, use_tqdm=False)
            nll = [-e[t].logprob for o, x in zip(outs, windows) for e, t in zip(o.prompt_logprobs[1:], x[1:])]
            gen = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False) \
                if args.greedy else []
            cont = [(list(o.outputs[0].token_ids), [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                    for o in gen]
        lps = [x for _, lp in cont for x in lp]
        got[name] = {"ppl": math.exp(sum(nll) / len(nll)), "nll_tokens": len(nll), "cont": cont,
                     "nonfinite": sum(not math.isfinite(x) for x in nll + lps)}
    if not args.greedy:
        return {"prompts": 0, "max_tokens": 0, "ppl_tokens": next(iter(got.values()))["nll_tokens"],
                "settings": {n: {"perplexity": g["ppl"], "nonfinite": g["nonfinite"]} for n, g in got.items()}}
    log("transformers float32 scores the continuations")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None
    own = []
    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": args.max_tokens,
                           "ppl_tokens": next(iter(got.values()))["nll_tokens"], "settings": {}}
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)[0, len(p):].tolist()
            own.append(ids)
        for name, g in got.items():
            deltas, agree, identical = [], 0, 0
            for p, (ids, lps), ref in zip(prompts, g["cont"], own):
                ref_lp = torch.log_softmax(hf(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float(), -1)
                chosen = torch.tensor(ids)
                deltas += (torch.tensor(lps) - ref_lp[torch.arange(len(ids)), chosen]).abs().tolist()
                agree += int((ref_lp.argmax(-1) == chosen).sum())
                identical += ids == ref
            out["settings"][name] = {"perplexity": g["ppl"], "mean_abs_dlogprob": sum(deltas) / len(deltas),
                                     "max_abs_dlogprob": max(deltas), "greedy_agreement": agree / len(deltas),
                                     "identical_outputs": identical, "nonfinite": g["nonfinite"]}
    return out


def capacity(model: str) -> dict[str, Any]:
    from engine.model_config import load_model_config
    from engine.runner.model_runner import kv_cache_bytes_per_block

    res = {}
    for name in ("model dtype", "bfloat16", "fp8_e4m3"):
        mc = load_model_config(Path(model), "float32", kv_cache_dtype=SETTINGS[name][0])
        res[name] = {"kv_bytes_per_token": kv_cache_bytes_per_block(mc, 1),
                     "tokens_per_gib": 2**30 // kv_cache_bytes_per_block(mc, 1)}
    return res


def decode_step(llm, batch: int, context: int, gen: torch.Generator) -> float:
    """One decode step's forward and logits, every row `context` tokens deep in scattered blocks."""
    import time

    from engine.runner.attention import AttentionMetadata, DecodeGroup

    runner = llm.engine.runner
    bs = runner.block_size
    per_row = -(-context // bs)
    tables = torch.randperm(batch * per_row, generator=gen).view(batch, per_row)
    lens = torch.full((batch,), context, dtype=torch.long)
    mask = torch.ones(batch, 1, 1, per_row * bs, dtype=torch.bool)
    slots = tables[:, (context - 1) // bs] * bs + (context - 1) % bs
    meta = AttentionMetadata(slot_mapping=slots, prefills=[], decodes=[DecodeGroup(torch.arange(batch), tables, lens, mask)])
    ids = torch.randint(100, runner.cfg.vocab_size, (batch,), generator=gen)
    positions = torch.full((batch,), context - 1, dtype=torch.long)
    with torch.inference_mode():
        start = time.perf_counter()
        hidden, _ = runner.forward(ids, positions, runner.layer_caches, meta, ())
        runner.model.compute_logits(hidden)
        return time.perf_counter() - start


def decode(model: str, args) -> dict[str, Any]:
    names = [n for n in ("model dtype", "bfloat16", "fp8_e4m3", "fp8_e5m2") if n in args.settings]
    blocks = args.decode_batch * -(-args.decode_context // 16) + 16
    engines = {n: engine(model, n, num_gpu_blocks=blocks, max_model_len=args.decode_context + 16, enforce_eager=False)
               for n in names}
    gen = torch.Generator().manual_seed(0)
    for llm in engines.values():  # random K/V, already scaled for fp8 (the values do not change the time)
        cache = llm.engine.runner.kv_cache
        for slot in range(cache.shape[0]):
            cache[slot].copy_(torch.randn(cache[slot].shape, generator=gen).to(cache.dtype))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.decode_runs + 2):  # two warm-ups
        for n, llm in engines.items():
            t = decode_step(llm, args.decode_batch, args.decode_context, gen)
            if r >= 2:
                times[n].append(t)
        log(f"decode run {r + 1}: " + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in times.items() if v))
    for llm in engines.values():
        llm.close()
    return {n: {"step_s": v, "median_step_s": median(v)} for n, v in times.items()}


def tiers(model: str, args) -> dict[str, Any]:
    import random

    from offload import LocalRedis, drop_page_cache, ttft

    names = [n for n in ("model dtype", "bfloat16", "fp8_e4m3", "fp8 offload") if n in args.settings]
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-kvquant-bench-")
    work = Path(tmp.name)
    redis = LocalRedis(work / "redis")
    common = dict(max_model_len=args.tier_tokens + 8, max_num_batched_tokens=2048,
                  num_gpu_blocks=args.tier_tokens // 16 + 64)
    modes = {"G2": dict(kv_offloading_size=2.0), "G3": dict(kv_offload_disk_size=4.0)}
    if redis.url:
        modes["G4"] = dict(kv_offload_remote=redis.url, kv_offload_remote_trusted=True)
    else:
        log("no redis-server: G4 is skipped")
    engines = {(n, t): engine(model, n, **common, **kw, **({"kv_offload_disk": str(work / f"g3-{n}")} if t == "G3" else {}))
               for n in names for t, kw in modes.items()}
    rng = random.Random(0)
    vocab = next(iter(engines.values())).engine.model_config.vocab_size
    res: dict[str, Any] = {n: {t: {"ttft_s": [], "loaded_bytes": 0, "hit_tokens": 0} for t in modes} for n in names}
    dropped = False
    for r in range(args.tier_runs):
        prompt = [rng.randrange(100, vocab) for _ in range(args.tier_tokens)]
        salt = uuid.uuid4().hex
        for (n, t), llm in engines.items():
            ttft(llm, prompt, salt)
            llm.engine.flush_offload()
            llm.engine.pool.reset_prefix_cache()
            if t == "G3":
                dropped = drop_page_cache()
            before = llm.get_stats().tiers
            secs, out = ttft(llm, prompt, salt)
            after = llm.get_stats().tiers
            cell = res[n][t]
            cell["ttft_s"].append(secs)
            cell["loaded_bytes"] = after["load_bytes"] - before["load_bytes"]
            cell["hit_tokens"] = out.cached_tokens_by_tier.get(t, 0)
        log(f"tiers run {r + 1}: " + ", ".join(f"{n} {t} {res[n][t]['ttft_s'][-1]:.3f}s" for n, t in engines))
    for llm in engines.values():
        llm.close()
    redis.close()
    tmp.cleanup()
    for n in names:
        for t in modes:
            res[n][t]["median_ttft_s"] = median(res[n][t]["ttft_s"])
    res["page_cache_dropped"] = dropped
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts, comma-separated (default %(default)s)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"KV settings to compare, comma-separated, the first the reference (default {','.join(SETTINGS)})")
    ap.add_argument("--prompts", type=int, default=100, help="greedy continuations (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="tokens of text before each (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens each (default %(default)s)")
    ap.add_argument("--ppl-windows", type=int, default=8, help="perplexity windows (default %(default)s)")
    ap.add_argument("--ppl-tokens", type=int, default=1024, help="tokens per window (default %(default)s)")
    ap.add_argument("--decode-batch", type=int, default=64, help="decode rows (default %(default)s)")
    ap.add_argument("--decode-context", type=int, default=2048, help="tokens in each row's context (default %(default)s)")
    ap.add_argument("--decode-runs", type=int, default=7, help="decode steps per setting, after 2 warm-ups (default %(default)s)")
    ap.add_argument("--tier-tokens", type=int, default=8000, help="prompt tokens of a tier hit (default %(default)s)")
    ap.add_argument("--tier-runs", type=int, default=3, help="tier hits per setting and tier (default %(default)s)")
    ap.add_argument("--headroom", type=float, default=None,
                    help="calibration headroom for fp8 scales instead of engine/runner/kv_quant.py's HEADROOM "
                         "(to compare rules)")
    ap.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all cores)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_quant.json", help="JSON results (default %(default)s)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not set(parts) <= set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {', '.join(PARTS)}")
    if not set(args.settings) <= set(SETTINGS) or not args.settings:
        ap.error(f"--settings: unknown {sorted(set(args.settings) - set(SETTINGS))}; choose from {', '.join(SETTINGS)}")
    if min(args.prompts, args.prompt_tokens, args.max_tokens, args.ppl_windows, args.ppl_tokens, args.decode_batch,
           args.decode_context, args.decode_runs, args.tier_tokens, args.tier_runs) < 1:
        ap.error("counts and sizes must be >= 1")
    set_torch_threads(args.threads)
    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    from transformers import AutoTokenizer

    machine = machine_info()
    head = f"{machine['cpu_model']}, {machine['cpu_isa']}; {Path(args.model).name}, float32 weights"
    results: dict[str, Any] = {"benchmark": "kv_quant", "model": args.model, "parts": parts}
    ref = args.settings[0]
    if args.headroom is not None:
        from engine.runner import kv_quant

        if args.headroom < 1:
            ap.error("--headroom must be >= 1")
        kv_quant.HEADROOM = args.headroom  # this process's engines calibrate with it
        results["headroom"] = args.headroom
    if "accuracy" in parts or "perplexity" in parts:
        args.greedy = "accuracy" in parts
        acc = results["accuracy"] = accuracy(args.model, args, held_out_ids(AutoTokenizer.from_pretrained(args.model)))
        base = acc["settings"][ref]["perplexity"]
        print(f"{head}; perplexity over {acc['ppl_tokens']} tokens of pydoc_data.topics" + (
            f"; {acc['prompts']} continuations x {acc['max_tokens']} greedy tokens scored by transformers float32"
            if args.greedy else ""))
        print_table(["KV", "perplexity", f"vs {ref}", "mean |Δ logprob|", "max |Δ logprob|", "greedy agreement",
                     "identical outputs", "NaN/inf"],
                    [[n, f"{s['perplexity']:.4f}", f"{s['perplexity'] / base - 1:+.2%}",
                      f"{s['mean_abs_dlogprob']:.4f}" if args.greedy else "-",
                      f"{s['max_abs_dlogprob']:.3f}" if args.greedy else "-",
                      f"{s['greedy_agreement']:.2%}" if args.greedy else "-",
                      f"{s['identical_outputs']}/{acc['prompts']}" if args.greedy else "-", s["nonfinite"]]
                     for n, s in acc["settings"].items()])
        if "fp8_e4m3" in acc["settings"]:
            d = acc["settings"]["fp8_e4m3"]["perplexity"] / base - 1
            print(f"fp8_e4m3 perplexity {d:+.2%} vs {ref} (target within {PPL_TARGET:.0%}: "
                  f"{'met' if abs(d) <= PPL_TARGET else 'NOT met'})")
    if "capacity" in parts:
        cap = results["capacity"] = capacity(args.model)
        base = cap["model dtype"]["tokens_per_gib"]
        print_table(["KV", "bytes per token", "G1 tokens per GiB", "vs model dtype", "vs bfloat16"],
                    [[n, c["kv_bytes_per_token"], c["tokens_per_gib"], f"{c['tokens_per_gib'] / base:.2f}x",
                      f"{c['tokens_per_gib'] / cap['bfloat16']['tokens_per_gib']:.2f}x"] for n, c in cap.items()])
        x = cap["fp8_e4m3"]["tokens_per_gib"] / cap["bfloat16"]["tokens_per_gib"]
        print(f"fp8 G1 capacity {x:.2f}x bfloat16 KV's, {cap['fp8_e4m3']['tokens_per_gib'] / base:.2f}x the model "
              f"dtype's (target >= {CAPACITY_TARGET}x: {'met' if x >= CAPACITY_TARGET else 'NOT met'})")
    if "decode" in parts:
        dec = results["decode"] = decode(args.model, args)
        base = dec[ref]["median_step_s"] if ref in dec else None
        print(f"{head}; decode step (forward + logits) at batch {args.decode_batch}, {args.decode_context}-token "
              f"contexts, medians of {args.decode_runs}")
        print_table(["KV", "step ms", f"vs {ref}"], [[n, f"{d['median_step_s'] * 1e3:.1f}",
                                                     f"{d['median_step_s'] / base:.2f}x" if base else "-"]
                                                    for n, d in dec.items()])
    if "tiers" in parts:
        tr = results["tiers"] = tiers(args.model, args)
        names = [n for n in tr if n != "page_cache_dropped"]
        rows = []
        for n in names:
            for t, c in tr[n].items():
                b = tr[names[0]][t]
                rows.append([n, t, c["hit_tokens"], f"{c['loaded_bytes'] / 2**20:.1f}", f"{c['median_ttft_s']:.3f}",
                             f"{c['loaded_bytes'] / b['loaded_bytes']:.0%}" if b["loaded_bytes"] else "-",
                             f"{c['median_ttft_s'] / b['median_ttft_s']:.0%}"])
        print(f"{head}; {args.tier_tokens}-token hits, medians of {args.tier_runs} (page cache dropped for G3: "
              f"{tr['page_cache_dropped']})")
        print_table(["KV", "tier", "hit tokens", "MiB loaded", "TTFT s", f"bytes vs {names[0]}",
                     f"time vs {names[0]}"], rows)
        for n in (x for x in ("fp8_e4m3", "fp8 offload") if x in tr):
            for t, c in tr[n].items():
                b = tr[names[0]][t]
                by, ti = c["loaded_bytes"] / max(b["loaded_bytes"], 1), c["median_ttft_s"] / b["median_ttft_s"]
                print(f"{n} {t} hit: {by:.0%} of the bytes, {ti:.0%} of the time (targets <= {BYTES_TARGET:.0%}, "
                      f"<= {TIME_TARGET:.0%}: {'met' if by <= BYTES_TARGET and ti <= TIME_TARGET else 'NOT met'})")
    path = write_json(args.out, results)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    preload_allocator()
    sys.exit(main())
