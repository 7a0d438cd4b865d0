"""The GPU path's figures in one run (issue 14), on a random-weight Llama-3-8B-shaped model in bf16.

  kernels   benchmarks/kernels.py: the Triton decode and prefill attention kernels against SDPA
            (flash) on the same shapes, and decode bandwidth against a device-to-device copy.
  ttft      time to first token at --lengths (default 8k and 32k tokens): cold, G1 hit, G2 hit,
            G3 hit (one engine per tier, loaded in turn so that one model's weights are on the GPU
            at a time), and the G2 -> G1 load bandwidth against a raw pinned host-to-device copy_
            of the same bytes.
  decode    output tokens/s at batch 1, 16, 64 and 256 (prompts of --decode-prompt tokens,
            --decode-output tokens each, EOS ignored): kvtier eager, compiled and with CUDA graphs
            (--decode-variants) against transformers' `generate` (dynamic cache, and static cache
            with its forward compiled into CUDA graphs) on the same GPU, greedy, same prompts; and
            each decode step's time against the bandwidth bound (every weight and the K/V read
            once, at the measured device copy rate).

Every section writes into one JSON (--out). The model is written once under --model-dir (weights
drawn on the device, no download). `--smoke` runs every section on a tiny model on any device, CPU
included, to check the script (CI does).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints.build_tokenizer: the test checkpoints' tokenizer

import torch  # noqa: E402

from _common import RESULTS_DIR, Timer, log, median, print_table, ratio, write_json  # noqa: E402

# Llama-3-8B's shape (the vocabulary is the test tokenizer's: the benchmark needs no real text).
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
}
INIT_STD = 0.02


@torch.no_grad()
def write_model(path: Path, shape: str, device: torch.device) -> Path:
    """A random bf16 Llama checkpoint of `shape` with the test tokenizer; kept when it exists."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from checkpoints import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    if (path / "done").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                      pad_token_id=PAD_ID, tie_word_embeddings=False, dtype="bfloat16",
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **SHAPES[shape])
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    tok.save_pretrained(path)
    g = torch.Generator(device=device).manual_seed(0)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads

    def rand(*shape_):
        return (torch.randn(shape_, generator=g, device=device, dtype=torch.float32) * INIT_STD).bfloat16().cpu()

    ones = torch.ones(h, dtype=torch.bfloat16)
    index: dict[str, str] = {}
    save = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "lm_head.weight": rand(cfg.vocab_size, h),
            "model.norm.weight": ones.clone()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        save.update({p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                     p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                     p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                     p + "mlp.down_proj.weight": rand(h, inter), p + "input_layernorm.weight": ones.clone(),
                     p + "post_attention_layernorm.weight": ones.clone()})
        if i % 4 == 3 or i == cfg.num_hidden_layers - 1:  # ~1.8 GB shards at the 8B shape
            name = f"model-{i:05d}.safetensors"
            save_file(save, str(path / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(save, name))
            save = {}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "done").write_text("")
    return path


def _free() -> None:
    """Returns a closed engine's device memory (call once nothing refers to it), so the next engine
    sizes G1 from a clean GPU."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kernels_section(smoke: bool, work: Path) -> dict[str, Any]:
    """benchmarks/kernels.py in a subprocess (its JSON is read back)."""
    out_dir = work / "kernels"
    cmd = [sys.executable, str(_HERE / "kernels.py"), "--copy-to", str(out_dir)] + (["--smoke"] if smoke else [])
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # the smoke run on CPU: Triton's interpreter
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        return {"error": f"benchmarks/kernels.py exited {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(next(out_dir.glob("kernels-*.json")).read_text())


def pinned_h2d_GBps(nbytes: int, device: torch.device) -> float:
    """A raw copy_ of `nbytes` from pinned host memory to the device (host-to-host on CPU)."""
    cuda = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(device)
    with Timer() as t:
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
    return nbytes / t.seconds / 1e9


def _tier_runs(model: Path, tier: str, engine_kw: dict[str, Any], prompts: dict[int, list[list[int]]],
               times: dict[int, dict[str, list[float]]], load_bw: dict[int, list[float]]) -> None:
    """One engine with `tier` below G1: each prompt cold then (G1) again, or (G2/G3) stored, G1
    emptied, and loaded back. prompts[n][0] is a warm-up, not recorded: an H200 ran the first
    8k prompt of a fresh engine in 2.4 s and the next in 0.26 s (kernel and allocator warm-up)."""
    from engine import LLM
    from offload import ttft

    llm = LLM(str(model), **engine_kw)
    try:
        for n, runs in prompts.items():
            for r, prompt in enumerate(runs):
                salt = uuid.uuid4().hex
                t, _ = ttft(llm, prompt, salt)
                if tier == "G1":
                    t_hit = ttft(llm, prompt, salt)[0]
                    if r:
                        times[n]["cold"].append(t)
                        times[n]["G1"].append(t_hit)
                    continue
                llm.engine.flush_offload()
                llm.engine.pool.reset_prefix_cache()
                before = llm.get_stats().tiers
                t, out = ttft(llm, prompt, salt)
                after = llm.get_stats().tiers
                if not r:
                    continue
                times[n][tier].append(t)
                secs = after["load_seconds"] - before["load_seconds"]
                if tier == "G2" and secs:
                    load_bw[n].append((after["load_bytes"] - before["load_bytes"]) / secs / 1e9)
                log(f"[{tier}, {n} tokens, run {r}] TTFT {t:.3f} s, hit {out.cached_tokens_by_tier}")
    finally:
        llm.close()


def ttft_section(model: Path, lengths: list[int], runs: int, device: str, work: Path,
                 offload_block: int | None = None) -> dict[str, Any]:
    import random

    from checkpoints import FIRST_WORD_ID
    from engine.model_config import load_model_config

    rng = random.Random(0)
    prompts = {n: [[rng.randrange(FIRST_WORD_ID, 90) for _ in range(n)] for _ in range(runs + 1)] for n in lengths}
    longest = max(lengths)
    common = dict(dtype="bfloat16", device=device, max_model_len=longest + 8, max_num_batched_tokens=8192,
                  kv_offload_block_size=offload_block)
    mc = load_model_config(model, "bfloat16", device)
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    gib = max(1.0, 2.5 * longest * per_token / 2**30)  # room for every run's prompt of the longest length
    tiers = {"G1": {}, "G2": {"kv_offloading_size": gib},
             "G3": {"kv_offload_disk": str(work / "g3"), "kv_offload_disk_size": gib * (runs + 1)}}
    times: dict[int, dict[str, list[float]]] = {n: {"cold": [], "G1": [], "G2": [], "G3": []} for n in lengths}
    load_bw: dict[int, list[float]] = {n: [] for n in lengths}
    for tier, extra in tiers.items():  # one engine at a time: one copy of the weights on the device
        _tier_runs(model, tier, {**common, **extra}, prompts, times, load_bw)
        _free()
    raw = pinned_h2d_GBps(longest * per_token, torch.device(device))
    rows, out = [], {"raw_pinned_copy_GBps": raw, "lengths": {}}
    for n in lengths:
        med = {k: median(v) for k, v in times[n].items()}
        bw = median(load_bw[n]) if load_bw[n] else 0.0
        out["lengths"][str(n)] = {"ttft_s": times[n], "median_s": med, "g2_load_GBps": bw}
        rows.append([n, *(f"{med[k]:.3f}" for k in ("cold", "G1", "G2", "G3")),
                     *(f"{ratio(med['cold'], med[k]):.1f}x" for k in ("G1", "G2", "G3")),
                     f"{bw:.1f}", f"{bw / raw:.0%}"])
    print_table(["tokens", "cold s", "G1 s", "G2 s", "G3 s", "G1 vs cold", "G2 vs cold", "G3 vs cold",
                 "G2 load GB/s", "vs raw pinned copy"], rows)
    print(f"raw pinned host-to-device copy_: {raw:.1f} GB/s")
    return out


# --decode-variants: name -> (optimization level, cudagraph_mode, async scheduling). graphs-async:
# each step launched while the last one's ids are still on the device (engine/sample/device_tokens.py)
DECODE_VARIANTS = {"eager": (0, "none", False), "eager-graphs": (0, "full_decode_only", False),
                   "compiled": (1, "none", False), "graphs": (1, "full_decode_only", False),
                   "graphs-async": (1, "full_decode_only", True)}


def _kvtier_decode(model: Path, prompts: torch.Tensor, batches: list[int], output_len: int,
                   device: str, variant: str) -> dict[int, dict[str, float]]:
    """Per batch: output tok/s of whole requests (prefill included), and the decode step time
    (the same requests with 1 output token, subtracted, over the other output_len - 1 steps)."""
    from engine import LLM, SamplingParams

    level, mode, async_scheduling = DECODE_VARIANTS[variant]
    if device == "cpu" and mode != "none":  # --smoke on CPU: the graphs' buffers, replayed eagerly
        mode = "eager_replay"
    out: dict[int, dict[str, float]] = {}
    llm = LLM(str(model), dtype="bfloat16", device=device, max_model_len=prompts.shape[1] + output_len + 8,
              max_num_seqs=max(batches), optimization_level=level, cudagraph_mode=mode,
              async_scheduling=async_scheduling)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for b in batches:
            batch = [{"prompt_token_ids": p} for p in prompts[:b].tolist()]
            llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            with Timer() as t1:
                llm.generate(batch, first, use_tqdm=False)
            with Timer() as t:
                llm.generate(batch, sp, use_tqdm=False)
            step = max(t.seconds - t1.seconds, 1e-9) / (output_len - 1)
            out[b] = {"tok_s": b * output_len / t.seconds, "step_ms": step * 1e3, "decode_tok_s": b / step}
            log(f"kvtier {variant} batch {b}: {out[b]['tok_s']:.0f} output tok/s, decode step {step * 1e3:.2f} ms "
                f"({b / step:.0f} tok/s)")
    finally:
        llm.close()
    return out


def _copy_GBps(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        with Timer() as t:
            dst.copy_(src)
            torch.cuda.synchronize()
        times.append(t.seconds)
    del src, dst
    return 2 * nbytes / median(times[1:]) / 1e9


def _step_bytes(model: Path, batch: int, context: int) -> int:
    """What one decode step must read: every weight once (the embedding table only its rows), and
    each sequence's K/V so far, in bf16."""
    cfg = json.loads((model / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    dim = cfg.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv_heads) * dim + heads * dim * h + 3 * h * inter + 2 * h
    weights = layers * per_layer + vocab * h + h  # lm_head (untied) and the final norm
    kv = batch * context * layers * 2 * kv_heads * dim
    return 2 * (weights + kv)


def _hf_decode(model: Path, prompts: torch.Tensor, batches: list[int], output_len: int, device: str,
               static: bool) -> dict[int, float]:
    """transformers' generate; static=True is its fastest decode: a static cache, with which generate
    compiles the forward with mode="reduce-overhead" (CUDA graphs) on a GPU. Each batch size is warmed
    up at its own shape first (a static cache recompiles per shape and length)."""
    from transformers import AutoModelForCausalLM

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict[int, float] = {}
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    extra = {"cache_implementation": "static"} if static else {}
    for b in batches:
        ids = prompts[:b].to(device)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
                  min_new_tokens=output_len, pad_token_id=0, eos_token_id=[], **extra)
        # A static cache is sized by max_new_tokens: warming up with fewer tokens would leave the
        # timed run to recompile (seen: 1 tok/s at batch 1). So the warm-up is the timed call itself.
        hf.generate(ids, **(kw if static else {**kw, "max_new_tokens": 2, "min_new_tokens": 2}))
        sync()
        with Timer() as t:
            hf.generate(ids, **kw)
            sync()
        out[b] = b * output_len / t.seconds
        log(f"transformers{' static-compiled' if static else ''} batch {b}: {out[b]:.0f} output tok/s")
    del hf
    _free()
    return out


def decode_section(model: Path, batches: list[int], prompt_len: int, output_len: int, device: str,
                   variants: list[str], hf_kinds: list[str]) -> dict[str, Any]:
    """kvtier's variants and transformers' peers on the same prompts, and the bandwidth bound:
    a decode step reads at least `_step_bytes`, at no more than the measured device copy rate."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, 90, (max(batches), prompt_len), generator=g)
    res: dict[str, Any] = {"kvtier": {}, "transformers": {}}
    on_gpu = device.startswith("cuda")
    bw = _copy_GBps(device) if on_gpu else 0.0
    context = prompt_len + output_len // 2  # the mean context over the decode steps
    res["bound"] = {"copy_GBps": bw, "tok_s": {b: b / (_step_bytes(model, b, context) / (bw * 1e9)) if bw else 0.0
                                              for b in batches}}
    for variant in variants:
        res["kvtier"][variant] = _kvtier_decode(model, prompts, batches, output_len, device, variant)
        _free()
    for kind in hf_kinds:
        res["transformers"][kind] = _hf_decode(model, prompts, batches, output_len, device, kind == "static")
    best_hf = {b: max((res["transformers"][k][b] for k in hf_kinds), default=0.0) for b in batches}
    rows = []
    for b in batches:
        bound = res["bound"]["tok_s"][b]
        rows.append([b, *(f"{res['kvtier'][v][b]['tok_s']:.0f}" for v in variants),
                     *(f"{res['transformers'][k][b]:.0f}" for k in hf_kinds),
                     *(f"{res['kvtier'][v][b]['decode_tok_s']:.0f} ({ratio(res['kvtier'][v][b]['decode_tok_s'], bound):.0%})"
                       if bound else f"{res['kvtier'][v][b]['decode_tok_s']:.0f}" for v in variants),
                     f"{bound:.0f}",
                     *(f"{ratio(res['kvtier'][v][b]['tok_s'], best_hf[b]):.2f}x" for v in variants if hf_kinds)])
    print_table(["batch", *(f"{v} tok/s" for v in variants), *(f"transformers {k} tok/s" for k in hf_kinds),
                 *(f"{v} decode tok/s (of bound)" for v in variants), "bound tok/s",
                 *(f"{v} / best transformers" for v in variants if hf_kinds)], rows)
    if bw:
        print(f"bound: {_step_bytes(model, 1, context) / 1e9:.2f} GB a step at batch 1 (context {context}), "
              f"device copy {bw:.0f} GB/s (read + written)")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompts, any device (checks the script)")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu (default: auto; cpu only with --smoke)")
    ap.add_argument("--model-dir", type=Path, help="where the random model is written and reused "
                    "(default: $KVTIER_CACHE_DIR/gpu-bench-<shape>)")
    ap.add_argument("--lengths", default="8000,32000", help="TTFT prompt lengths (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="TTFT runs per length and tier; medians (default 3)")
    ap.add_argument("--batches", default="1,16,64,256", help="decode batch sizes (default %(default)s)")
    ap.add_argument("--decode-prompt", type=int, default=128, help="decode prompts' tokens (default 128)")
    ap.add_argument("--decode-output", type=int, default=128, help="decode output tokens (default 128)")
    ap.add_argument("--decode-variants", default="eager,compiled,graphs",
                    help=f"kvtier's engines in the decode section, each loaded in turn: {', '.join(DECODE_VARIANTS)} "
                    "(-O0 or -O1, CUDA graphs off or on; graphs is the CUDA default) (default %(default)s)")
    ap.add_argument("--hf", default="eager,static", help="transformers peers in the decode section: eager "
                    "(dynamic cache) and/or static (static cache, forward compiled with CUDA graphs) "
                    "(default %(default)s)")
    ap.add_argument("--offload-block-size", type=int, help="tokens per G2/G3 entry (default: the engine's, "
                    "one KV block)")
    ap.add_argument("--sections", default="kernels,ttft,decode", help="which sections run (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "gpu.json", help="JSON results (default %(default)s)")
    args = ap.parse_args(argv)
    from kvstore.cache_dir import cache_root
    from engine.config import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    if device == "cpu" and not args.smoke:
        ap.error("no CUDA device here: the GPU benchmark needs one (--smoke checks the script on CPU)")
    sections = set(args.sections.split(","))
    if sections - {"kernels", "ttft", "decode"}:
        ap.error(f"unknown --sections: {sorted(sections - {'kernels', 'ttft', 'decode'})}")
    variants = args.decode_variants.split(",")
    if set(variants) - set(DECODE_VARIANTS):
        ap.error(f"unknown --decode-variants: {sorted(set(variants) - set(DECODE_VARIANTS))} ({', '.join(DECODE_VARIANTS)})")
    hf_kinds = [k for k in args.hf.split(",") if k]
    if set(hf_kinds) - {"eager", "static"}:
        ap.error(f"unknown --hf: {sorted(set(hf_kinds) - {'eager', 'static'})} (eager, static)")
    lengths = [64, 200] if args.smoke else [int(x) for x in args.lengths.split(",")]
    batches = [1, 4] if args.smoke else [int(x) for x in args.batches.split(",")]
    prompt_len, output_len = (16, 8) if args.smoke else (args.decode_prompt, args.decode_output)
    shape = "tiny" if args.smoke else "llama3-8b"
    dev = torch.device(device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                               "torch": torch.__version__, "shape": shape, "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-bench-") as tmp:
        work = Path(tmp)
        model = write_model(args.model_dir or (cache_root() / f"gpu-bench-{shape}"), shape, dev)
        log(f"model: {model} ({shape}, random bf16 weights) on {results['device']}")
        if "kernels" in sections:
            results["kernels"] = kernels_section(args.smoke, work)
        if "ttft" in sections:
            results["ttft"] = ttft_section(model, lengths, 1 if args.smoke else args.runs, device, work,
                                           args.offload_block_size)
        if "decode" in sections:
            results["decode"] = decode_section(model, batches, prompt_len, output_len, device, variants, hf_kinds)
    path = write_json(args.out, results)
    log(f"wrote {path}")
    return 0 if "error" not in results.get("kernels", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
