#!/usr/bin/env python3
"""Writes a random-weight Gemma 4 text checkpoint shaped like Gemma 4 E2B's layer pattern, for the
benchmarks that want a Gemma-4-style model (`benchmarks/offload.py --model DIR`): 35 layers, every
fifth full attention and the rest a 512-token window, global layers with twice the head size, the
last 20 layers reusing earlier layers' KV, per-layer embeddings; hidden 256 so that it runs on CPU.
Weights are random (the test tokenizer, 512 tokens): for timing and bytes moved, not for text.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE.parent / "tests"))  # checkpoints.build_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="directory to write the checkpoint to")
    ap.add_argument("--max-len", type=int, default=9000, help="max_position_embeddings (default %(default)s)")
    args = ap.parse_args(argv)
    from checkpoints import build_checkpoint

    sliding, full = "sliding_attention", "full_attention"
    build_checkpoint("gemma4", args.out, num_hidden_layers=35, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=64, global_head_dim=128,
                     num_global_key_value_heads=1, attention_k_eq_v=False, num_kv_shared_layers=20,
                     sliding_window=512, layer_types=[full if i % 5 == 4 else sliding for i in range(35)],
                     hidden_size_per_layer_input=64, max_position_embeddings=args.max_len)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
