#!/usr/bin/env python3
"""Writes a random-weight Llama checkpoint whose KV cache is byte for byte the shape of another
checkpoint's (layers, KV heads, head size, dtype), with a context window of its own and the
cheapest body that produces it: as many query heads as KV heads, a 64-wide MLP.

For the tier benchmarks at lengths the real model cannot reach on a CPU (`benchmarks/offload.py
--model DIR --lengths 32000`): what a tier moves, checks and indexes depends only on the KV bytes
per token, the block and entry sizes and the token count, all the same here, while the prefill
that fills the tier costs a third of the demo model's attention (3 query heads instead of 9; the
demo model's window is 8,192 tokens, and a copy of it with a 32k window took over 20 minutes for
one 32k prefill on a 2-core AMD EPYC). Weights are random and the tokenizer is the test one (512
tokens): for bytes and time, not for text; TTFTs against cold are not the real model's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints.build_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory to write the checkpoint to")
    ap.add_argument("--like", type=Path, default=None,
                    help="checkpoint whose KV geometry to copy (default: the demo model, SmolLM2-135M-Instruct)")
    ap.add_argument("--max-len", type=int, default=33000, help="max_position_embeddings (default %(default)s)")
    args = ap.parse_args(argv)
    if args.max_len < 1:
        ap.error(f"--max-len must be >= 1; got {args.max_len}")
    if args.like is None:
        from engine.demo.demo_model import ensure_demo_model

        args.like = ensure_demo_model()
    try:
        src = json.loads((args.like / "config.json").read_text())
    except (OSError, ValueError) as e:
        ap.error(f"--like {args.like}: no readable config.json ({e})")
    if src.get("model_type") != "llama":
        ap.error(f"--like {args.like}: a llama checkpoint is needed; its model_type is {src.get('model_type')!r}")
    import torch
    from checkpoints import build_checkpoint

    kv_heads = src.get("num_key_value_heads") or src["num_attention_heads"]
    head_dim = src.get("head_dim") or src["hidden_size"] // src["num_attention_heads"]
    dtype = getattr(torch, src.get("torch_dtype") or src.get("dtype") or "float32")
    build_checkpoint("llama", args.out, dtype=dtype, num_hidden_layers=src["num_hidden_layers"],
                     num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                     hidden_size=kv_heads * head_dim, intermediate_size=64, max_position_embeddings=args.max_len,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    per_token = 2 * src["num_hidden_layers"] * kv_heads * head_dim * dtype.itemsize
    print(f"wrote {args.out}: {src['num_hidden_layers']} layers x {kv_heads} KV heads x {head_dim}, {dtype}, "
          f"{per_token / 1024:.1f} KiB of KV per token (as {args.like.name}), window {args.max_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
