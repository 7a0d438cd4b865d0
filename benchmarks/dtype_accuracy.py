#!/usr/bin/env python3
"""How far kvtier's outputs in each dtype are from transformers in float32 (issue 39, acceptance 4).

For each prompt (chat-templated questions, the demo model by default), kvtier generates greedily
in the given dtypes with the sampled token's log-prob. transformers in float32 then scores the same
tokens (teacher forcing: one forward over prompt + kvtier's output) and generates greedily on its
own. Per dtype:

- mean and max |Δ logprob|: kvtier's log-prob of each token it chose against float32's;
- greedy agreement: the share of positions where float32's argmax, given kvtier's prefix, is the
  token kvtier chose (a disagreement is where a bf16 run would fork from the float32 text);
- identical outputs: prompts whose whole output equals transformers' own float32 greedy output.

float32 is the control: its figures say what "exact" measures at (0 and 100% up to float error).
transformers in bfloat16 (its own greedy run, its own log-probs) is the bar: what running the
model in bf16 costs in any engine. kvtier's bf16 default is acceptable when it is no worse.

    .venv/bin/python benchmarks/dtype_accuracy.py                       # float32 and bfloat16
    .venv/bin/python benchmarks/dtype_accuracy.py --max-tokens 64 --prompts 8

Writes benchmarks/results/dtype_accuracy.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

import torch  # noqa: E402

from _common import RESULTS_DIR, log, machine_info, print_table, write_json  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn.", "What is 17 times 23?", "Name three primary colors.",
    "Why is the sky blue?", "Give me a tip for learning a new language.", "What does a CPU do?",
    "Summarize the plot of Romeo and Juliet.", "How do vaccines work?", "List the planets of the solar system.",
    "What is the boiling point of water at sea level?", "Describe a cat to someone who has never seen one.",
    "What is a prime number?", "Translate 'good morning' into Spanish.", "How does a rainbow form?",
]


def kvtier_outputs(model: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [lp[t] for t, lp in zip(c.token_ids, c.logprobs or [])]))
    del llm
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: the demo model)")
    ap.add_argument("--dtype", default="float32,bfloat16", help="kvtier dtypes, comma-separated (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"how many questions (at most {len(QUESTIONS)})")
    ap.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt (default %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "dtype_accuracy.json")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(QUESTIONS) or args.max_tokens < 1:
        ap.error(f"--prompts must be 1..{len(QUESTIONS)} and --max-tokens >= 1")
    dtypes = args.dtype.split(",")
    if not set(dtypes) <= {"float32", "bfloat16"}:
        ap.error(f"--dtype takes float32 and bfloat16, not {args.dtype!r}")
    if args.model is None:
        from engine.demo.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS[:args.prompts]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    got = {dt: kvtier_outputs(args.model, dt, prompts, args.max_tokens) for dt in dtypes}
    log("kvtier done; transformers float32 scores and generates")
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    own = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)
            own.append(out[0, len(p):].tolist())
        if "bfloat16" in dtypes:  # the bar: transformers' own bf16 run, scored the same way
            hf16 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                        attn_implementation="sdpa").eval()
            hf16.generation_config.eos_token_id = None
            got["transformers bfloat16"] = []
            for p in prompts:
                ids = hf16.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=0)[0, len(p):].tolist()
                lp = torch.log_softmax(hf16(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float(), -1)
                got["transformers bfloat16"].append((ids, lp[torch.arange(len(ids)), torch.tensor(ids)].tolist()))
            del hf16
    rows, results = [], {}
    for dt, outs in got.items():
        deltas, agree, identical = [], 0, 0
        with torch.inference_mode():
            for p, (ids, lps), ref in zip(prompts, outs, own):
                logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float()
                ref_lp = torch.log_softmax(logits, -1)
                chosen = torch.tensor(ids)
                deltas += (torch.tensor(lps) - ref_lp[torch.arange(len(ids)), chosen]).abs().tolist()
                agree += int((ref_lp.argmax(-1) == chosen).sum())
                identical += ids == ref
        n = len(deltas)
        results[dt] = {"mean_abs_dlogprob": sum(deltas) / n, "max_abs_dlogprob": max(deltas),
                       "greedy_agreement": agree / n, "identical_outputs": identical, "prompts": len(prompts),
                       "tokens": n}
        rows.append([dt if dt.startswith("transformers") else f"kvtier {dt}", f"{sum(deltas) / n:.4f}", f"{max(deltas):.3f}", f"{100 * agree / n:.2f}%",
                     f"{identical}/{len(prompts)}"])
    machine = machine_info()
    print(f"{machine['cpu_model']}, {machine['cpu_isa']}; {len(prompts)} prompts x {args.max_tokens} greedy tokens, "
          "against transformers float32")
    print_table(["engine", "mean |Δ logprob|", "max |Δ logprob|", "greedy agreement", "identical outputs"], rows)
    path = write_json(args.out, {"benchmark": "dtype_accuracy", "model": args.model, "max_tokens": args.max_tokens,
                                 "results": results})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
