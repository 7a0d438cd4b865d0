"""One engine process for the G4 fleet tests: runs prompts through `LLM` and prints, as one
JSON line, each output's tokens and per-tier cached tokens, plus the G4 stats.

    python engine_proc.py MODEL_DIR JSON_ARGS
JSON_ARGS: {"prompts": [[ids...], ...], "salt": str|null, "llm": {LLM kwargs}}
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    model, args = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model, **{"dtype": "float32", **args.get("llm", {})})
    sp = SamplingParams(temperature=0, max_tokens=args.get("max_tokens", 8), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], sp, use_tqdm=False,
                        cache_salt=args.get("salt"))
    llm.engine.flush_offload()  # G4 writes are asynchronous: make them land before exiting
    tiers = llm.get_stats().tiers
    llm.close()
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "by_tier": [o.cached_tokens_by_tier for o in outs],
                      "g4": tiers.get("G4", {})}))


if __name__ == "__main__":
    main()
