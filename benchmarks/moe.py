#!/usr/bin/env python3
"""Qwen3-MoE prefill against a dense Qwen3 with the same active parameters (issue 16, acceptance 4).

Checkpoints (random weights, the test tokenizer, float32, written once under --workdir):
  dense  Qwen3ForCausalLM, intermediate_size = 2 * --moe-intermediate
  moe    Qwen3MoeForCausalLM, --experts experts, 2 active per token, moe_intermediate_size =
         --moe-intermediate: the same attention, and per token the same MLP FLOPs as dense.
Workload: --prompts prompts of --prompt-len random token ids, max_tokens=1 (prefill only; prefix
caching kept out with a fresh cache_salt per run). Metric: prompt tokens / wall time.
Engines: kvtier (LLM, one per checkpoint) and transformers (one forward over the batch, sdpa,
whose MoE block loops over experts). Runs are interleaved; cells are medians.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints.build_tokenizer: the test checkpoints' tokenizer

from _common import (RESULTS_DIR, log, median, preload_allocator, print_table, run_interleaved,  # noqa: E402
                     set_torch_threads, usable_cpus, write_json)

TARGET = 1.5  # acceptance 4: MoE prefill within 1.5x of the dense model's time


def write_checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from checkpoints import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  pad_token_id=PAD_ID, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    made = {}
    for name, cls, cfg in (
        ("dense", Qwen3ForCausalLM, Qwen3Config(intermediate_size=2 * args.moe_intermediate, **common)),
        ("moe", Qwen3MoeForCausalLM, Qwen3MoeConfig(intermediate_size=2 * args.moe_intermediate, num_experts=args.experts,
                                                    num_experts_per_tok=2, moe_intermediate_size=args.moe_intermediate,
                                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                                    **common)),
    ):
        path = root / f"{name}-h{args.hidden}-l{args.layers}-e{args.experts}-i{args.moe_intermediate}"
        if not (path / "config.json").is_file():
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():  # routers spread out, so that tokens go to different experts
                for pname, p in model.named_parameters():
                    if pname.endswith("mlp.gate.weight"):
                        p.normal_(0, cfg.hidden_size ** -0.5)
            model.save_pretrained(path, safe_serialization=True)
            tok.save_pretrained(path)
        made[name] = path
    return made


def kvtier_run(llm, prompts: list[list[int]], salt: str) -> dict[str, Any]:
    from engine import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False, cache_salt=salt)
    wall = time.perf_counter() - start
    return {"tok_s": sum(map(len, prompts)) / wall, "wall_s": wall}


def hf_run(model, prompts: list[list[int]]) -> dict[str, Any]:
    import torch

    ids = torch.tensor(prompts)  # equal lengths: no padding
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids)
    wall = time.perf_counter() - start
    return {"tok_s": ids.numel() / wall, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--experts", type=int, default=4, help="MoE experts, 2 active (default: %(default)s)")
    p.add_argument("--moe-intermediate", type=int, default=768, help="each expert's intermediate size; dense "
                                                                      "gets twice it (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per run (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs; cells are medians (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--threads", type=int, default=usable_cpus(), help="torch threads (default: all usable CPUs)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kvtier-bench-moe"),
                   help="where the checkpoints are written, once (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS_DIR / "moe.json"), help="JSON results (default: %(default)s)")
    args = p.parse_args()
    preload_allocator()
    set_torch_threads(args.threads)
    from engine import LLM

    paths = write_checkpoints(Path(args.workdir), args)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 400) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    items = {}
    for name, path in paths.items():
        log(f"loading kvtier {name}")
        llm = LLM(str(path), dtype="float32", max_num_seqs=args.prompts)
        kvtier_run(llm, prompts[:1], "warm")
        items[f"kvtier/{name}"] = lambda r, llm=llm, name=name: kvtier_run(llm, prompts, f"{name}-{r}-{time.time()}")
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32", attn_implementation="sdpa").eval()
            hf_run(hf, prompts[:1])
            items[f"transformers/{name}"] = lambda r, hf=hf: hf_run(hf, prompts)
    got = run_interleaved(args.runs, items, progress=lambda r, n, res: log(f"run {r} {n}: {res['tok_s']:.0f} tok/s"))
    med = {n: median([x["tok_s"] for x in runs]) for n, runs in got.items()}
    rows = []
    for engine in ("kvtier", "transformers"):
        if f"{engine}/dense" in med:
            d, m = med[f"{engine}/dense"], med[f"{engine}/moe"]
            rows.append([engine, f"{d:.0f}", f"{m:.0f}", f"{d / m:.2f}x"])
    print_table(["engine", "dense prefill tok/s", "moe prefill tok/s", "moe time / dense time"], rows)
    ratio = med["kvtier/dense"] / med["kvtier/moe"]
    log(f"kvtier MoE prefill takes {ratio:.2f}x the dense model's time "
        f"({'met' if ratio <= TARGET else 'MISSED'}: target <= {TARGET}x)")
    path = write_json(args.out, {"args": vars(args), "median_tok_s": med,
                                 "runs": {n: [x["tok_s"] for x in runs] for n, runs in got.items()},
                                 "kvtier_moe_vs_dense_time": ratio})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
